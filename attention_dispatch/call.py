"""Argument normalisation: sdpa()'s arguments -> one canonical call and its Problem.

Everything is validated here, before any backend sees a tensor: shapes (with
F.scaled_dot_product_attention's broadcasting, broadcasting.py), dtypes, masks (PyTorch's
``CausalBias`` mapped to our causal kinds), tensor subclasses (handled on purpose, never taken
for plain tensors), varlen offsets and nested tensors.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import NamedTuple

import torch

from . import config as _config
from .broadcasting import check_heads, dense_layout, fold_mask_batch, shape_text
from .caches import register_cache
from .features import check_alibi_slopes, check_return_lse, check_sinks, check_softcap
from .problem import Problem, _aligned_16, compute_capability
from .semantics import CausalKind, normalize_causal, normalize_window
from .torch_private import forward_ad, functorch_wrapped

_ALLOWED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)


class Call:
    """A normalised call: canonical tensors, backend options, the Problem, and how to
    turn the canonical output back into the caller's layout (``restore``, None when the
    output is already in it)."""

    __slots__ = ("query", "key", "value", "options", "problem", "restore", "facts")

    def __init__(self, query, key, value, options, problem, restore, facts):
        self.query, self.key, self.value = query, key, value
        self.options, self.problem, self.restore, self.facts = options, problem, restore, facts


def has_tangent(*tensors) -> bool:
    """Whether a tensor among ``tensors`` (None skipped) is a dual tensor of the current forward-AD level."""
    unpack = torch.autograd.forward_ad.unpack_dual
    return any(t is not None and unpack(t).tangent is not None for t in tensors)


class CallFacts(NamedTuple):
    """Everything the decision needs of a call, as plain constants (hashable; torch.compile
    treats them as constants while tracing). Problem's fields, with the device itself and
    ``deterministic`` as given (None: resolved by make_problem)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim_qk: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    layout: str
    mask_kind: str
    mask_shape: tuple[int, ...] | None
    mask_requires_grad: bool
    causal: CausalKind | None
    window: tuple[int, int] | None
    dropout: bool
    requires_grad: bool
    last_dim_contiguous: bool
    aligned_16: bool
    deterministic: bool | None
    same_offsets: bool
    float32_bias: bool
    softcap: bool
    alibi: bool
    sinks: bool
    sinks_grad: bool
    return_lse: bool
    forward_ad: bool
    func_transform: bool


# ---- tensor subclasses -------------------------------------------------------------------


def _type_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_plain_tensor(t, name: str) -> None:
    """Raise unless `t` is a plain tensor (a Parameter, or torch.compile's own fake and
    functional tensors while tracing, count as plain). A subclass carries a meaning of its
    own (a sharding, a lazy mask, a quantisation) that computing on its storage would lose."""
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if name == 'attn_mask' else ''}, got {cls.__name__}")
    if isinstance(t, torch.nn.Parameter) or cls.__module__.startswith("torch._subclasses."):
        return
    if cls.__name__ == "DTensor":
        raise TypeError(
            f"{name} is a DTensor ({_type_name(cls)}); sdpa() computes on whole local tensors: pass "
            f"{name}.to_local() where only batch or heads are sharded, or gather the sequence first"
        )
    if getattr(t, "is_nested", False):
        raise TypeError(
            f"{name} is a nested tensor; query, key and value must then all be torch.jagged nested "
            "tensors (B, H, j, D), and attn_mask a plain tensor"
        )
    raise TypeError(
        f"{name} is a {_type_name(cls)}, a torch.Tensor subclass that sdpa() does not know; its "
        "meaning cannot be guessed from its storage: pass a plain torch.Tensor"
    )


def _causal_bias_kind(attn_mask, is_causal: bool, causal) -> CausalKind | None:
    """The causal kind of a torch.nn.attention.bias.CausalBias mask, None for other masks."""
    if type(attn_mask) is torch.Tensor:
        return None
    bias_module = sys.modules.get("torch.nn.attention.bias")  # not imported: no CausalBias exists
    cls = getattr(bias_module, "CausalBias", None)
    if cls is None or not isinstance(attn_mask, cls):
        return None
    if is_causal or causal not in (None, False):
        raise ValueError(
            "CausalBias should not be used with causal=True: attn_mask is a CausalBias "
            f"({attn_mask.variant.name}), which is the causal mask already; pass only one of them"
        )
    variant = bias_module.CausalVariant
    return {variant.UPPER_LEFT: CausalKind.TOP_LEFT, variant.LOWER_RIGHT: CausalKind.BOTTOM_RIGHT}[attn_mask.variant]


# ---- checks ------------------------------------------------------------------------------


def _check_tensors(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_plain_tensor(t, name)
    if query.dtype not in _ALLOWED_DTYPES:
        raise TypeError(
            f"query.dtype={str(query.dtype).removeprefix('torch.')} is not allowed; "
            "allowed: float16, bfloat16, float32, float64"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query, key and value must share one dtype, got query={query.dtype}, key={key.dtype}, value={value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            "query, key and value must be on one device, got "
            f"query={query.device}, key={key.device}, value={value.device}"
        )


def mask_kept_as_given(mask_dtype: torch.dtype, query_dtype: torch.dtype) -> bool:
    """Whether normalisation passes a mask of this dtype on unconverted: bool, the query's
    dtype, or float32 with 16-bit inputs (PyTorch adds it at float32; rounding it would move
    the scores)."""
    return (
        mask_dtype == torch.bool
        or mask_dtype == query_dtype
        or (mask_dtype == torch.float32 and query_dtype in (torch.float16, torch.bfloat16))
    )


def offsets_kept_as_given(cu: torch.Tensor) -> bool:
    """Whether normalisation passes cu_seqlens on unconverted (int32; int64 is converted)."""
    return cu.dtype == torch.int32


def _mask_dtype(attn_mask, query):
    """F.sdpa's rule: bool, float32, or the query's dtype (:func:`mask_kept_as_given`); a
    float32 mask with float64 inputs is converted exactly."""
    dtype = attn_mask.dtype
    if mask_kept_as_given(dtype, query.dtype):
        return attn_mask
    if dtype == torch.float32 and query.dtype == torch.float64:
        return attn_mask.to(torch.float64)  # exact
    q = str(query.dtype).removeprefix("torch.")
    floats = " or float32" if q == "float32" else f", float32 or {q}"
    raise TypeError(
        f"attn_mask.dtype={str(dtype).removeprefix('torch.')} is not allowed with query.dtype={q}; "
        f"allowed: bool (True = attend){floats} (added to the scores), as "
        "F.scaled_dot_product_attention"
    )


def _broadcast_mask(attn_mask, target: tuple[int, ...], what: str, query) -> torch.Tensor:
    """Validate attn_mask against `target` and return it as a view of the same rank."""
    check_plain_tensor(attn_mask, "attn_mask")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(
            f"attn_mask.dtype={attn_mask.dtype} is not allowed; allowed: bool (True = attend) "
            "or a floating dtype (added to the scores)"
        )
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    shape = tuple(attn_mask.shape)
    ok = len(shape) <= len(target) and all(m in (1, t) for m, t in zip(reversed(shape), reversed(target)))
    if not ok:
        raise ValueError(f"attn_mask of shape {shape} is not broadcastable to {what} = {target}")
    mask = attn_mask.reshape((1,) * (len(target) - len(shape)) + shape) if len(shape) < len(target) else attn_mask
    return _mask_dtype(mask, query)


def _seqlens(cu: torch.Tensor, name: str, total: int, max_seqlen, validate: bool) -> int:
    if max_seqlen is not None and (
        isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < 0
    ):
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
    check_plain_tensor(cu, name)
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}.dtype={cu.dtype} is not allowed; allowed: int32 (or int64, converted)")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but query is on {device}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length batch+1, got shape {shape_text(cu)}")
    return cu if offsets_kept_as_given(cu) else cu.to(torch.int32)


def _unpack_nested(query, key, value):
    """torch.nested jagged (B, H, j, D) -> packed values (total, H, D), int32 offsets of
    query and key, and the query's own offsets (for the output)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not getattr(t, "is_nested", False):
            raise TypeError(f"query, key and value must all be nested tensors or none of them; {name} is not")
        if t.layout != torch.jagged:
            raise TypeError(
                f"{name} is a nested tensor with layout {t.layout}; only torch.jagged is supported "
                "(torch.nested.nested_tensor(..., layout=torch.jagged))"
            )
        if t.dim() != 4 or t._ragged_idx != 2:
            raise ValueError(
                f"{name} must be a jagged nested tensor of shape (B, H, j, D) (ragged dim 2), "
                f"got {t.dim()}-D with ragged dim {t._ragged_idx}"
            )
    packed = [t.transpose(1, 2) for t in (query, key, value)]
    offsets_q, offsets_k = packed[0].offsets(), packed[1].offsets()
    cu_q = offsets_q.to(torch.int32)
    # one offsets tensor stays one (it tells the dispatcher that query and key lengths match)
    cu_k = cu_q if offsets_k is offsets_q else offsets_k.to(torch.int32)
    return [p.values() for p in packed], cu_q, cu_k, offsets_q


# ---- the whole call ----------------------------------------------------------------------


def _check_scalars(dropout_p, scale, enable_gqa, deterministic) -> None:
    if (
        type(dropout_p) is not float
        and (isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real))
        or not 0.0 <= dropout_p <= 1.0
    ):
        raise ValueError(f"dropout_p must be a float in [0, 1], got {dropout_p!r}")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale)
    ):
        raise ValueError(
            f"scale must be None or a finite float, got {scale!r} (F.sdpa's result for a "
            "non-finite scale is NaN wherever a score is positive)"
        )
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be None or a bool, got {type(deterministic).__name__}")


def normalize_call(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    causal=None,
    window=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    deterministic=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
) -> Call:
    """Validate every argument (raising before any kernel) and build the canonical call."""
    steps = []  # turn the canonical output back into the caller's layout, in order
    nested = (
        getattr(query, "is_nested", False) or getattr(key, "is_nested", False) or getattr(value, "is_nested", False)
    )
    if nested:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_q/k must not be given with nested tensors (their offsets are used)")
        (query, key, value), cu_seqlens_q, cu_seqlens_k, offsets_q = _unpack_nested(query, key, value)
    _check_tensors(query, key, value)
    _check_scalars(dropout_p, scale, enable_gqa, deterministic)
    softcap = check_softcap(softcap)
    return_lse = check_return_lse(return_lse)
    lse_steps = []  # the same for a returned logsumexp: (B, Hq, Sq) dense, (Hq, total_q) varlen
    mask_causal = None if attn_mask is None else _causal_bias_kind(attn_mask, is_causal, causal)
    if mask_causal is not None:
        lengths = (attn_mask.seq_len_q, attn_mask.seq_len_kv)
        if (
            not nested
            and cu_seqlens_q is None
            and min(query.dim(), key.dim()) >= 2
            and lengths != (query.shape[-2], key.shape[-2])
        ):
            raise ValueError(
                f"attn_mask is a CausalBias for seq_len_q={lengths[0]}, seq_len_kv={lengths[1]} but "
                f"query has {query.shape[-2]} positions and key {key.shape[-2]}"
            )
        attn_mask, causal = None, mask_causal
    causal_kind = normalize_causal(is_causal, causal)
    window = normalize_window(window)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if mask_causal is not None:
            raise ValueError(
                "attn_mask=CausalBias with cu_seqlens/nested inputs: pass causal='top_left' or "
                "'bottom_right' instead (it applies to each sequence)"
            )
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 3:
                raise ValueError(
                    f"with cu_seqlens, {name} must be packed (total, heads, head_dim), got shape {shape_text(t)}"
                )
        if key.shape[0] != value.shape[0]:
            raise ValueError(f"key and value must have the same packed length, got {key.shape[0]} and {value.shape[0]}")
        same_offsets = cu_seqlens_q is cu_seqlens_k
        cu_q = _cu_tensor(cu_seqlens_q, "cu_seqlens_q", query.device)
        cu_k = cu_q if same_offsets else _cu_tensor(cu_seqlens_k, "cu_seqlens_k", query.device)
        if cu_q.numel() != cu_k.numel():
            raise ValueError(
                f"cu_seqlens_q has {cu_q.numel()} entries but cu_seqlens_k has {cu_k.numel()}; both must be batch+1"
            )
        # Reading the offsets syncs the device: done on the CPU, or when max_seqlen must be computed.
        validate = query.device.type == "cpu" or max_seqlen_q is None or max_seqlen_k is None
        if validate and torch.compiler.is_compiling():
            if max_seqlen_q is None or max_seqlen_k is None:
                raise ValueError(
                    "under torch.compile, pass max_seqlen_q and max_seqlen_k with cu_seqlens "
                    "(computing them reads the offsets back to the host)"
                )
            validate = False
        max_q = _seqlens(cu_q, "cu_seqlens_q", query.shape[0], max_seqlen_q, validate)
        max_k = _seqlens(cu_k, "cu_seqlens_k", key.shape[0], max_seqlen_k, validate)
        batch, hq, dqk = cu_q.numel() - 1, query.shape[1], query.shape[2]
        hkv, dv = key.shape[1], value.shape[2]
        check_heads(hq, hkv, value.shape[1], enable_gqa)
        if key.shape[2] != dqk:
            raise ValueError(f"query head_dim {dqk} != key head_dim {key.shape[2]}")
        sq, sk = max_q, max_k
        if attn_mask is not None:
            attn_mask = _broadcast_mask(attn_mask, (batch, hq, sq, sk), "(B, Hq, max_seqlen_q, max_seqlen_k)", query)
        if nested:
            steps.append(
                lambda out, offsets=offsets_q: torch.nested.nested_tensor_from_jagged(out, offsets).transpose(1, 2)
            )
            lse_steps.append(
                lambda lse, offsets=offsets_q: torch.nested.nested_tensor_from_jagged(lse.t(), offsets).transpose(1, 2)
            )
        lead = (batch,)
    else:
        cu_q = cu_k = None
        max_q = max_k = None
        same_offsets = False
        query, key, value, out_shape, lead = dense_layout(query, key, value, enable_gqa)
        if attn_mask is not None:
            attn_mask = _broadcast_mask(
                attn_mask,
                lead + (query.shape[2], key.shape[2]),
                "(B, Hq, Sq, Sk)" if len(lead) == 2 else "the output's (*batch, Hq, Sq, Sk)",
                query,
            )
            attn_mask = fold_mask_batch(attn_mask, lead[:-1])
        if out_shape is not None:
            steps.append(lambda out, shape=out_shape: out.reshape(shape))
            lse_steps.append(lambda lse, shape=out_shape[:-1]: lse.reshape(shape))
        lead = lead[:-1]
        batch, hq, sq, dqk = query.shape
        hkv, sk, dv = key.shape[1], key.shape[2], value.shape[3]
    if dropout_p == 1.0:  # every weight dropped: F.sdpa multiplies by zero, so do we
        steps.insert(0, lambda out: out * 0)
        dropout_p = 0.0
    alibi_slopes = check_alibi_slopes(alibi_slopes, batch, hq, lead, query)
    sinks = check_sinks(sinks, hq, query)
    grad = torch.is_grad_enabled()
    mask_grad = attn_mask is not None and grad and attn_mask.requires_grad
    sinks_grad = sinks is not None and grad and sinks.requires_grad
    compiling = torch.compiler.is_compiling()
    wrapped = not compiling and functorch_wrapped(query)  # torch.func's wrappers have no data pointer
    no_pointer = compiling or wrapped  # _aligned_16 then reads the strides alone
    # Everything the decision needs, as plain constants (torch.compile treats them as such).
    # positional (a keyword call costs 1.2 us more per new signature); each value's field named
    facts = tuple.__new__(
        CallFacts,
        (
            batch,  # batch
            hq,  # heads_q
            hkv,  # heads_kv
            sq,  # seqlen_q
            sk,  # seqlen_k
            dqk,  # head_dim_qk
            dv,  # head_dim_v
            query.dtype,  # dtype
            query.device,  # device
            "varlen" if varlen else "dense",  # layout
            "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float"),  # mask_kind
            None if attn_mask is None else tuple(attn_mask.shape),  # mask_shape
            mask_grad,  # mask_requires_grad
            causal_kind,  # causal
            window,  # window
            dropout_p > 0,  # dropout
            (grad and (query.requires_grad or key.requires_grad or value.requires_grad or mask_grad or sinks_grad))
            # a dropout call on inputs that require grad, under no_grad (reentrant checkpointing's first forward):
            # decided as its recomputation with grad will be, so that both draw their mask on one backend
            or (dropout_p > 0 and not grad and (query.requires_grad or key.requires_grad or value.requires_grad)),
            # requires_grad
            query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1,  # last_dim_contiguous
            _aligned_16(query, no_pointer)
            and _aligned_16(key, no_pointer)
            and _aligned_16(value, no_pointer),  # aligned_16
            deterministic,  # deterministic
            same_offsets,  # same_offsets
            attn_mask is not None and attn_mask.dtype == torch.float32 and query.dtype in _HALF,  # float32_bias
            softcap is not None,  # softcap
            alibi_slopes is not None,  # alibi
            sinks is not None,  # sinks
            sinks_grad,  # sinks_grad
            return_lse,  # return_lse
            forward_ad._current_level >= 0
            and has_tangent(query, key, value, attn_mask, sinks, alibi_slopes),  # forward_ad
            wrapped,  # func_transform
        ),
    )
    problem = None if compiling else _cached_problem(facts)
    options = dict(
        attn_mask=attn_mask,
        dropout_p=float(dropout_p),
        causal=causal_kind,
        window=window,
        scale=float(scale) if scale is not None else (1.0 / math.sqrt(dqk) if dqk else 1.0),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        enable_gqa=hq != hkv,
        deterministic=None if problem is None else problem.deterministic,
    )
    # only where used: a backend that never heard of them sees the options it always saw
    if softcap is not None:
        options["softcap"] = softcap
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    if sinks is not None:
        options["sinks"] = sinks
    if return_lse:
        options["return_lse"] = True
    restore = None
    if steps:

        def restore(out, steps=tuple(steps)):
            for step in steps:
                out = step(out)
            return out

    if return_lse and (steps or lse_steps):

        def restore(result, restore_out=restore, steps=tuple(lse_steps)):
            out, lse = result
            for step in steps:
                lse = step(lse)
            return (out if restore_out is None else restore_out(out)), lse

    return Call(query, key, value, options, problem, restore, facts)


_problems: dict = {}
register_cache("call.problems", _problems.clear, _problems.__len__)


def _cached_problem(facts: CallFacts) -> Problem:
    """make_problem, memoised on the facts and everything determinism depends on."""
    cfg = _config.current_config()
    key = (
        facts,
        id(cfg),
        _config.config_version(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    problem = _problems.get(key)
    if problem is None:
        if len(_problems) >= 4096:
            _problems.clear()
        problem = _problems[key] = make_problem(facts)
    return problem


def make_problem(facts: CallFacts) -> Problem:
    """The Problem of normalize_call's facts, with determinism resolved from the argument,
    the config, or torch.are_deterministic_algorithms_enabled()."""
    deterministic = facts.deterministic
    warn_only = False
    if deterministic is None:
        policy = _config.current_config().dispatch.deterministic
        if policy == "auto":
            deterministic = torch.are_deterministic_algorithms_enabled()
            warn_only = deterministic and torch.is_deterministic_algorithms_warn_only_enabled()
        else:
            deterministic = policy
    fields = facts._asdict()
    device = fields.pop("device")
    fields.update(deterministic=bool(deterministic), deterministic_warn_only=bool(warn_only))
    return Problem(**fields, device_type=device.type, compute_capability=compute_capability(device))
