"""sdpa() and explain(): normalise arguments -> Problem -> dispatch -> run."""
from __future__ import annotations

import math
import numbers

import torch

from . import config as _config
from . import registry
from .debug import logger, note_decision
from .dispatch import FAST_CALLS_LIMIT, BackendRunError, Decision, _scope, decide, fast_calls
from .fastest import choose_fastest
from .problem import Problem, _aligned_16, compute_capability
from .semantics import normalize_causal, normalize_window

_ALLOWED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Call:
    """A normalised call: canonical tensors, backend options, the Problem, and how to
    turn the canonical output back into the caller's layout."""

    __slots__ = ("query", "key", "value", "options", "problem", "restore", "facts")

    def __init__(self, query, key, value, options, problem, restore):
        self.query, self.key, self.value = query, key, value
        self.options, self.problem, self.restore = options, problem, restore


def _shape(t) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_tensors(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if query.dtype not in _ALLOWED_DTYPES:
        raise TypeError(f"query.dtype={str(query.dtype).removeprefix('torch.')} is not allowed; "
                        "allowed: float16, bfloat16, float32, float64")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError("query, key and value must share one dtype, got "
                         f"query={query.dtype}, key={key.dtype}, value={value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError("query, key and value must be on one device, got "
                         f"query={query.device}, key={key.device}, value={value.device}")


def _check_heads(hq: int, hkv: int, hv: int, enable_gqa: bool) -> None:
    if hkv != hv:
        raise ValueError(f"key has {hkv} heads but value has {hv}; they must match")
    if hq != hkv:
        if not enable_gqa:
            raise ValueError(f"query has {hq} heads but key/value have {hkv}; pass enable_gqa=True "
                             "for grouped-query attention")
        if hkv == 0 or hq % hkv:
            raise ValueError(f"enable_gqa=True needs query heads ({hq}) to be a multiple of key/value heads ({hkv})")


def _broadcast_mask(attn_mask, target: tuple[int, ...], what: str, query) -> torch.Tensor:
    """Validate attn_mask against `target` and return it as a view of the same rank."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask.dtype={attn_mask.dtype} is not allowed; allowed: bool (True = attend) "
                        "or a floating dtype (added to the scores)")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    shape = tuple(attn_mask.shape)
    ok = len(shape) <= len(target) and all(m in (1, t) for m, t in zip(reversed(shape), reversed(target)))
    if not ok:
        raise ValueError(f"attn_mask of shape {shape} is not broadcastable to {what} = {target}")
    mask = attn_mask.reshape((1,) * (len(target) - len(shape)) + shape) if len(shape) < len(target) else attn_mask
    if mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    return mask


def _seqlens(cu: torch.Tensor, name: str, total: int, max_seqlen, validate: bool) -> int:
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral)
                                   or max_seqlen < 0):
        raise ValueError(f"max_seqlen for {name} must be a non-negative int, got {max_seqlen!r}")
    if not validate:
        return int(max_seqlen)
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:])]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {values[-1]}")
    longest = max(lengths, default=0)
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen} for {name} is less than its longest sequence ({longest})")
    return int(longest if max_seqlen is None else max_seqlen)


def _cu_tensor(cu, name: str, device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}.dtype={cu.dtype} is not allowed; allowed: int32 (or int64, converted)")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but query is on {device}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length batch+1, got shape {_shape(cu)}")
    return cu if cu.dtype == torch.int32 else cu.to(torch.int32)


def _unpack_nested(query, key, value):
    """torch.nested jagged (B, H, j, D) -> packed values (total, H, D) and int32 offsets."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.is_nested:
            raise TypeError(f"query, key and value must all be nested tensors or none of them; {name} is not")
        if t.layout != torch.jagged:
            raise TypeError(f"{name} is a nested tensor with layout {t.layout}; only torch.jagged is supported")
        if t.dim() != 4 or t._ragged_idx != 2:
            raise ValueError(f"{name} must be a jagged nested tensor of shape (B, H, j, D) (ragged dim 2), "
                             f"got {t.dim()}-D with ragged dim {t._ragged_idx}")
    packed = [t.transpose(1, 2) for t in (query, key, value)]
    offsets_q, offsets_k = packed[0].offsets(), packed[1].offsets()
    cu_q = offsets_q.to(torch.int32)
    # one offsets tensor stays one (it tells the dispatcher that query and key lengths match)
    return [p.values() for p in packed], cu_q, (cu_q if offsets_k is offsets_q else offsets_k.to(torch.int32))


def normalize_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, causal=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                   max_seqlen_q=None, max_seqlen_k=None, deterministic=None) -> _Call:
    """Validate every argument (raising before any kernel) and build the canonical call."""
    nested = (getattr(query, "is_nested", False) or getattr(key, "is_nested", False)
              or getattr(value, "is_nested", False))
    if nested:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_q/k must not be given with nested tensors (their offsets are used)")
        offsets_q = query.transpose(1, 2).offsets() if query.is_nested else None
        (query, key, value), cu_seqlens_q, cu_seqlens_k = _unpack_nested(query, key, value)
    _check_tensors(query, key, value)
    if type(dropout_p) is not float and (isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real)) \
            or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite float, got {scale!r}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be None or a bool, got {type(deterministic).__name__}")
    causal_kind = normalize_causal(is_causal, causal)
    window = normalize_window(window)
    restore = None
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 3:
                raise ValueError(f"with cu_seqlens, {name} must be packed (total, heads, head_dim), "
                                 f"got shape {_shape(t)}")
        if key.shape[0] != value.shape[0]:
            raise ValueError(f"key and value must have the same packed length, got {key.shape[0]} and {value.shape[0]}")
        same_offsets = cu_seqlens_q is cu_seqlens_k
        cu_q = _cu_tensor(cu_seqlens_q, "cu_seqlens_q", query.device)
        cu_k = cu_q if same_offsets else _cu_tensor(cu_seqlens_k, "cu_seqlens_k", query.device)
        if cu_q.numel() != cu_k.numel():
            raise ValueError(f"cu_seqlens_q has {cu_q.numel()} entries but cu_seqlens_k has {cu_k.numel()}; "
                             "both must be batch+1")
        # Reading the offsets syncs the device: done on the CPU, or when max_seqlen must be computed.
        validate = query.device.type == "cpu" or max_seqlen_q is None or max_seqlen_k is None
        if validate and torch.compiler.is_compiling():
            if max_seqlen_q is None or max_seqlen_k is None:
                raise ValueError("under torch.compile, pass max_seqlen_q and max_seqlen_k with cu_seqlens "
                                 "(computing them reads the offsets back to the host)")
            validate = False
        max_q = _seqlens(cu_q, "cu_seqlens_q", query.shape[0], max_seqlen_q, validate)
        max_k = _seqlens(cu_k, "cu_seqlens_k", key.shape[0], max_seqlen_k, validate)
        batch, hq, dqk = cu_q.numel() - 1, query.shape[1], query.shape[2]
        hkv, dv = key.shape[1], value.shape[2]
        _check_heads(hq, hkv, value.shape[1], enable_gqa)
        if key.shape[2] != dqk:
            raise ValueError(f"query head_dim {dqk} != key head_dim {key.shape[2]}")
        sq, sk = max_q, max_k
        if attn_mask is not None:
            attn_mask = _broadcast_mask(attn_mask, (batch, hq, sq, sk), "(B, Hq, max_seqlen_q, max_seqlen_k)", query)
        if nested:
            def restore(out, offsets=offsets_q):
                return torch.nested.nested_tensor_from_jagged(out, offsets).transpose(1, 2)
    else:
        cu_q = cu_k = None
        max_q = max_k = None
        same_offsets = False
        qs, ks, vs = query.shape, key.shape, value.shape
        nd = len(qs)
        if nd < 3 or nd != len(ks) or nd != len(vs):
            raise ValueError("query, key and value must have the same number of dims, at least 3 "
                             f"((B, H, S, D) or (N, S, D)), got {_shape(query)}, {_shape(key)}, {_shape(value)}")
        lead = qs[:-3] if nd > 3 else qs[:-2]
        if ks[:len(lead)] != lead or vs[:len(lead)] != lead:
            raise ValueError(f"batch dims differ: query {_shape(query)}, key {_shape(key)}, value {_shape(value)}")
        if ks[-2] != vs[-2]:
            raise ValueError(f"key has {ks[-2]} positions but value has {vs[-2]}")
        if qs[-1] != ks[-1]:
            raise ValueError(f"query head_dim {qs[-1]} != key head_dim {ks[-1]}")
        target = tuple(qs[:-1]) + (ks[-2],)
        if attn_mask is not None:
            attn_mask = _broadcast_mask(attn_mask, target, "(B, Hq, Sq, Sk)" if nd == 4 else
                                        "query.shape[:-1] + (Sk,)", query)
        if nd == 3:    # (N, S, D): one head
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            attn_mask = None if attn_mask is None else attn_mask.unsqueeze(1)

            def restore(out):
                return out.squeeze(1)
        elif nd > 4:   # (*batch, H, S, D): fold the batch dims
            lead = tuple(lead)
            query, key, value = (t.reshape((-1,) + tuple(t.shape[-3:])) for t in (query, key, value))
            if attn_mask is not None:
                attn_mask = attn_mask.expand(target).reshape((-1,) + target[-3:])

            def restore(out, lead=lead):
                return out.reshape(lead + tuple(out.shape[1:]))
        batch, hq, sq, dqk = query.shape
        hkv, sk, dv = key.shape[1], key.shape[2], value.shape[3]
        _check_heads(hq, hkv, value.shape[1], enable_gqa)
    grad = torch.is_grad_enabled()
    mask_grad = attn_mask is not None and grad and attn_mask.requires_grad
    compiling = torch.compiler.is_compiling()
    # Everything the decision needs, as plain constants (torch.compile treats them as such).
    facts = (batch, hq, hkv, sq, sk, dqk, dv, query.dtype, query.device, "varlen" if varlen else "dense",
             "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float"),
             None if attn_mask is None else tuple(attn_mask.shape), mask_grad, causal_kind, window,
             dropout_p > 0,
             grad and (query.requires_grad or key.requires_grad or value.requires_grad or mask_grad),
             query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1,
             _aligned_16(query, compiling) and _aligned_16(key, compiling) and _aligned_16(value, compiling),
             deterministic, same_offsets)
    problem = None if compiling else _cached_problem(facts)
    options = dict(attn_mask=attn_mask, dropout_p=float(dropout_p), causal=causal_kind, window=window,
                   scale=float(scale) if scale is not None else (1.0 / math.sqrt(dqk) if dqk else 1.0),
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                   enable_gqa=hq != hkv, deterministic=None if problem is None else problem.deterministic)
    call = _Call(query, key, value, options, problem, restore)
    call.facts = facts
    return call


_problems: dict = {}


def _cached_problem(facts: tuple) -> Problem:
    """make_problem, memoised on the facts and everything determinism depends on."""
    cfg = _config.current_config()
    key = (facts, id(cfg), _config.config_version(), torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    problem = _problems.get(key)
    if problem is None:
        if len(_problems) >= 4096:
            _problems.clear()
        problem = _problems[key] = make_problem(facts)
    return problem


def make_problem(facts: tuple) -> Problem:
    """The Problem of normalize_call's facts, with determinism resolved from the argument,
    the config, or torch.are_deterministic_algorithms_enabled()."""
    (batch, hq, hkv, sq, sk, dqk, dv, dtype, device, layout, mask_kind, mask_shape, mask_grad, causal, window,
     dropout, requires_grad, last_dim_contiguous, aligned_16, deterministic, same_offsets) = facts
    warn_only = False
    if deterministic is None:
        policy = _config.current_config().dispatch.deterministic
        if policy == "auto":
            deterministic = torch.are_deterministic_algorithms_enabled()
            warn_only = deterministic and torch.is_deterministic_algorithms_warn_only_enabled()
        else:
            deterministic = policy
    return Problem(
        batch=batch, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, head_dim_qk=dqk, head_dim_v=dv,
        dtype=dtype, device_type=device.type, compute_capability=compute_capability(device), layout=layout,
        mask_kind=mask_kind, mask_shape=mask_shape, mask_requires_grad=mask_grad, causal=causal, window=window,
        dropout=dropout, requires_grad=requires_grad, deterministic=bool(deterministic),
        deterministic_warn_only=bool(warn_only), last_dim_contiguous=last_dim_contiguous, aligned_16=aligned_16,
        same_offsets=same_offsets)


@torch.compiler.assume_constant_result
def _decide_at_trace_time(facts: tuple, forced) -> tuple:
    """Under torch.compile: decide once while tracing (eagerly, outside the graph), so the
    graph holds only the chosen backend's ops. Returns (backend name, deterministic)."""
    problem = make_problem(facts)
    decision = decide(problem, forced)
    note_decision(decision)
    return decision.backend, problem.deterministic


def _execute(decision: Decision, call: _Call):
    """Run the chosen backend; on a run-time failure re-raise or fall back per config."""
    on_error = _config.current_config().dispatch.on_error
    while True:
        backend = registry.get_backend(decision.backend)
        try:
            return decision, backend.run(call.query, call.key, call.value, **call.options)
        except Exception as exc:
            if on_error != "fallback":
                raise BackendRunError(f"backend {decision.backend!r} failed while running: "
                                      f"{type(exc).__name__}: {exc}") from exc
            failed = decision.backend
            decision = decision.fallback_after_failure(failed, exc)
            logger.warning("backend %r failed (%s: %s); falling back to %r", failed, type(exc).__name__,
                           exc, decision.backend)
            if decision.backend is None:
                raise BackendRunError(f"every eligible backend failed while running; last was {failed!r}: "
                                      f"{type(exc).__name__}: {exc}\n{decision}") from exc


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
         causal=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
         backend=None, deterministic=None):
    """Scaled dot-product attention through the best backend that computes exactly this call.

    Dense: query (B, Hq, Sq, Dqk), key (B, Hkv, Sk, Dqk), value (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv)
    (any number of leading batch dims, or (N, S, D), as torch's sdpa). Varlen: packed
    (total, H, D) with cu_seqlens_q/k (int32, B+1), or torch.nested jagged (B, H, j, D).
    attn_mask: bool (True = attend) or float (added), broadcastable to (B, Hq, Sq, Sk).
    causal: None | "top_left" (= is_causal=True) | "bottom_right"; window: (left, right), -1 unbounded.
    backend: force one backend by name; deterministic: None follows torch's setting.
    """
    fast_key = _fast_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal, window,
                         deterministic, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if fast_key is not None:
        hit = fast_calls.get(fast_key)
        if hit is not None:
            decision, runner = hit
            try:
                if cu_seqlens_q is not None:
                    if query.device.type == "cpu":   # normalize_call reads the offsets where that is free
                        _seqlens(cu_seqlens_q, "cu_seqlens_q", query.shape[0], max_seqlen_q, True)
                        _seqlens(cu_seqlens_k, "cu_seqlens_k", key.shape[0], max_seqlen_k, True)
                    out = runner(query, key, value, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
                elif attn_mask is None:
                    out = runner(query, key, value)
                else:
                    out = runner(query, key, value, attn_mask)
            except Exception:   # noqa: BLE001 - the full path below raises or falls back per config
                fast_calls.pop(fast_key, None)
            else:
                note_decision(decision)
                return out
    call = normalize_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                          causal=causal, window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, deterministic=deterministic)
    if call.problem is None:   # tracing under torch.compile: one op, no run-time dispatch
        name, call.options["deterministic"] = _decide_at_trace_time(call.facts, backend)
        out = registry.get_backend(name).run(call.query, call.key, call.value, **call.options)
        return out if call.restore is None else call.restore(out)
    decision = decide(call.problem, backend)
    policy = _config.current_config().dispatch
    if policy.policy == "fastest" and backend is None:
        decision = choose_fastest(decision, call, policy.fastest_cache)
    decided = decision
    decision, out = _execute(decision, call)
    note_decision(decision)
    opts = call.options
    # a call that fell back at run time keeps the full path (failures while fastest timed do not)
    if fast_key is not None and decision is decided and call.restore is None and call.query is query \
            and call.key is key and call.value is value and opts["attn_mask"] is attn_mask \
            and opts["cu_seqlens_q"] is cu_seqlens_q and opts["cu_seqlens_k"] is cu_seqlens_k:
        try:
            runner = registry.get_backend(decision.backend).prepare(query, key, value, call.options)
        except Exception as exc:   # noqa: BLE001 - the call succeeded; only its fast path is lost
            logger.debug("backend %r: prepare() failed (%s); this signature keeps the full path",
                         decision.backend, exc)
        else:
            if len(fast_calls) >= FAST_CALLS_LIMIT:
                fast_calls.clear()
            fast_calls[fast_key] = (decision, runner)
    return out if call.restore is None else call.restore(out)


def _fast_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal, window, deterministic,
              backend, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """sdpa()'s fast-path key for plain 4-D tensors (a 4-D mask of bool or the query's dtype
    included), or packed 3-D ones with int32 offsets and int max_seqlen (no mask), and scalar
    options; None when the call must take the full path.  The key
    holds everything normalize_call() validates or derives (shapes, strides, dtypes,
    devices, alignment, grad needs, the exact option values with their types: True == 1.0
    must not hit) and everything decide() keys on (config, registry, scope, determinism): a
    hit is a call that the full path accepted before and would decide the same way.  Kept
    lean: it is most of what a repeated call costs the dispatcher (issue 5: <= 3 us)."""
    tensor = torch.Tensor
    if (type(query) is not tensor or type(key) is not tensor or type(value) is not tensor
            or type(dropout_p) is not float or type(is_causal) is not bool or type(enable_gqa) is not bool
            or (scale is not None and type(scale) is not float) or (causal is not None and type(causal) is not str)
            or (deterministic is not None and type(deterministic) is not bool)
            or (backend is not None and type(backend) is not str)
            or (window is not None and not (type(window) is tuple and len(window) == 2
                                            and type(window[0]) is int and type(window[1]) is int))):
        return None
    qs = query.shape
    if torch.compiler.is_compiling():
        return None
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if len(qs) != 4:
            return None
        packed = None
    elif (len(qs) != 3 or attn_mask is not None or type(cu_seqlens_q) is not tensor
          or type(cu_seqlens_k) is not tensor or cu_seqlens_q.dtype != torch.int32
          or cu_seqlens_k.dtype != torch.int32 or type(max_seqlen_q) is not int or type(max_seqlen_k) is not int):
        return None   # normalize_call() would convert the offsets or compute max_seqlen (a device sync)
    else:   # the offsets' values are each call's own (read only on the CPU, as normalize_call does)
        packed = (cu_seqlens_q.shape, cu_seqlens_k.shape, cu_seqlens_q.device, cu_seqlens_k.device,
                  cu_seqlens_q is cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if attn_mask is None:
        mask = None
    elif (type(attn_mask) is not tensor or attn_mask.dim() != 4
          or (attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype)):
        return None   # not a tensor, or normalize_call() would reshape / convert it
    else:
        mask = (attn_mask.shape, attn_mask.stride(), attn_mask.dtype, attn_mask.device, attn_mask.requires_grad,
                attn_mask.data_ptr() & 15)
    det = torch.are_deterministic_algorithms_enabled()
    return (qs, query.stride(), key.shape, key.stride(), value.shape, value.stride(),
            query.dtype, key.dtype, value.dtype, query.device, key.device, value.device,
            query.data_ptr() & 15, key.data_ptr() & 15, value.data_ptr() & 15, mask, packed,
            torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                         or (mask is not None and attn_mask.requires_grad)),
            dropout_p, is_causal, scale, enable_gqa, causal, window, deterministic, backend,
            id(_config.current_config()), _config.config_version(), registry.registry_version(), _scope.get(),
            det and (1 + torch.is_deterministic_algorithms_warn_only_enabled()))


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            causal=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            backend=None, deterministic=None) -> Decision:
    """The Decision sdpa() would make for these arguments; runs nothing.

    Unlike sdpa(), a call no backend can serve returns a Decision with backend=None.
    """
    call = normalize_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                          causal=causal, window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, deterministic=deterministic)
    return decide(call.problem or make_problem(call.facts), backend, raise_if_none=False)
