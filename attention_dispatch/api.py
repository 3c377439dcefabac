"""sdpa() and explain(): normalise arguments -> Problem -> dispatch -> run."""

from __future__ import annotations

import dataclasses

import torch

from . import config as _config
from . import registry
from .debug import logger, note_decision
from .dispatch import FAST_CALLS_LIMIT, BackendRunError, Decision, _scope, decide, fast_calls
from .call import Call, CallFacts, _seqlens, make_problem, normalize_call
from .fastest import choose_fastest


@torch.compiler.assume_constant_result
def _decide_at_trace_time(facts: tuple, forced) -> tuple:
    """Under torch.compile: decide once while tracing (eagerly, outside the graph), so the
    graph holds only the chosen backend's ops. Returns (backend name, deterministic).
    ``facts``: a CallFacts as a plain tuple (dynamo rebuilds a NamedTuple constant wrongly)."""
    problem = make_problem(CallFacts._make(facts))
    decision = decide(problem, forced)
    note_decision(decision)
    return decision.backend, problem.deterministic


def _execute(decision: Decision, call: Call):
    """Run the chosen backend; on a run-time failure re-raise or fall back per config."""
    on_error = _config.current_config().dispatch.on_error
    while True:
        backend = registry.get_backend(decision.backend)
        try:
            return decision, backend.run(call.query, call.key, call.value, **call.options)
        except Exception as exc:
            if on_error != "fallback":
                raise BackendRunError(
                    f"backend {decision.backend!r} failed while running: {type(exc).__name__}: {exc}"
                ) from exc
            failed = decision.backend
            decision = decision.fallback_after_failure(failed, exc)
            logger.warning(
                "backend %r failed (%s: %s); falling back to %r", failed, type(exc).__name__, exc, decision.backend
            )
            if decision.backend is None:
                raise BackendRunError(
                    f"every eligible backend failed while running; last was {failed!r}: "
                    f"{type(exc).__name__}: {exc}\n{decision}"
                ) from exc


def sdpa(
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
    backend=None,
    deterministic=None,
):
    """Scaled dot-product attention through the best backend that computes exactly this call.

    Dense: query (B, Hq, Sq, Dqk), key (B, Hkv, Sk, Dqk), value (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv)
    (any number of leading batch dims, or (N, S, D), as torch's sdpa). Varlen: packed
    (total, H, D) with cu_seqlens_q/k (int32, B+1), or torch.nested jagged (B, H, j, D).
    attn_mask: bool (True = attend) or float (added), broadcastable to (B, Hq, Sq, Sk).
    causal: None | "top_left" (= is_causal=True) | "bottom_right"; window: (left, right), -1 unbounded.
    backend: force one backend by name; deterministic: None follows torch's setting.
    """
    fast_key = _fast_key(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal,
        window,
        deterministic,
        backend,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )
    if fast_key is not None:
        hit = fast_calls.get(fast_key)
        if hit is not None:
            decision, runner = hit
            try:
                if cu_seqlens_q is not None:
                    if query.device.type == "cpu":  # normalize_call reads the offsets where that is free
                        _seqlens(cu_seqlens_q, "cu_seqlens_q", query.shape[0], max_seqlen_q, True)
                        _seqlens(cu_seqlens_k, "cu_seqlens_k", key.shape[0], max_seqlen_k, True)
                    out = runner(query, key, value, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
                elif attn_mask is None:
                    out = runner(query, key, value)
                else:
                    out = runner(query, key, value, attn_mask)
            except Exception:  # noqa: BLE001 - the full path below raises or falls back per config
                fast_calls.pop(fast_key, None)
            else:
                note_decision(decision)
                return out
    call = normalize_call(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal=causal,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        deterministic=deterministic,
    )
    if call.problem is None:  # tracing under torch.compile: one op, no run-time dispatch
        name, call.options["deterministic"] = _decide_at_trace_time(tuple(call.facts), backend)
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
    if (
        fast_key is not None
        and decision is decided
        and call.restore is None
        and call.query is query
        and call.key is key
        and call.value is value
        and opts["attn_mask"] is attn_mask
        and opts["cu_seqlens_q"] is cu_seqlens_q
        and opts["cu_seqlens_k"] is cu_seqlens_k
    ):
        try:
            runner = registry.get_backend(decision.backend).prepare(query, key, value, call.options)
        except Exception as exc:  # noqa: BLE001 - the call succeeded; only its fast path is lost
            logger.debug("backend %r: prepare() failed (%s); this signature keeps the full path", decision.backend, exc)
        else:
            if len(fast_calls) >= FAST_CALLS_LIMIT:
                fast_calls.clear()
            fast_calls[fast_key] = (decision, runner)
    return out if call.restore is None else call.restore(out)


def _fast_key(
    query,
    key,
    value,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    causal,
    window,
    deterministic,
    backend,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
):
    """sdpa()'s fast-path key for plain 4-D tensors (a 4-D mask of bool or the query's dtype
    included), or packed 3-D ones with int32 offsets and int max_seqlen (no mask), and scalar
    options; None when the call must take the full path.  The key
    holds everything normalize_call() validates or derives (shapes, strides, dtypes,
    devices, alignment, grad needs, the exact option values with their types: True == 1.0
    must not hit) and everything decide() keys on (config, registry, scope, determinism): a
    hit is a call that the full path accepted before and would decide the same way.  Kept
    lean: it is most of what a repeated call costs the dispatcher (issue 5: <= 3 us)."""
    tensor = torch.Tensor
    if (
        type(query) is not tensor
        or type(key) is not tensor
        or type(value) is not tensor
        or type(dropout_p) is not float
        or type(is_causal) is not bool
        or type(enable_gqa) is not bool
        or (scale is not None and type(scale) is not float)
        or (causal is not None and type(causal) is not str)
        or (deterministic is not None and type(deterministic) is not bool)
        or (backend is not None and type(backend) is not str)
        or (
            window is not None
            and not (type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int)
        )
    ):
        return None
    if query.is_nested or torch.compiler.is_compiling():
        return None  # a strided nested tensor has no shape: normalize_call() says what to pass
    qs = query.shape
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if len(qs) != 4:
            return None
        packed = None
    elif (
        len(qs) != 3
        or attn_mask is not None
        or type(cu_seqlens_q) is not tensor
        or type(cu_seqlens_k) is not tensor
        or cu_seqlens_q.dtype != torch.int32
        or cu_seqlens_k.dtype != torch.int32
        or type(max_seqlen_q) is not int
        or type(max_seqlen_k) is not int
    ):
        return None  # normalize_call() would convert the offsets or compute max_seqlen (a device sync)
    else:  # the offsets' values are each call's own (read only on the CPU, as normalize_call does)
        packed = (
            cu_seqlens_q.shape,
            cu_seqlens_k.shape,
            cu_seqlens_q.device,
            cu_seqlens_k.device,
            cu_seqlens_q is cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
        )
    if attn_mask is None:
        mask = None
    elif (
        type(attn_mask) is not tensor
        or attn_mask.dim() != 4
        or (
            attn_mask.dtype != torch.bool
            and attn_mask.dtype != query.dtype
            and (attn_mask.dtype != torch.float32 or query.dtype == torch.float64)
        )
    ):
        return None  # not a tensor, or normalize_call() would reshape / convert it
    else:
        mask = (
            attn_mask.shape,
            attn_mask.stride(),
            attn_mask.dtype,
            attn_mask.device,
            attn_mask.requires_grad,
            attn_mask.data_ptr() & 15,
        )
    det = torch.are_deterministic_algorithms_enabled()
    return (
        qs,
        query.stride(),
        key.shape,
        key.stride(),
        value.shape,
        value.stride(),
        query.dtype,
        key.dtype,
        value.dtype,
        query.device,
        key.device,
        value.device,
        query.data_ptr() & 15,
        key.data_ptr() & 15,
        value.data_ptr() & 15,
        mask,
        packed,
        torch.is_grad_enabled()
        and (
            query.requires_grad
            or key.requires_grad
            or value.requires_grad
            or (mask is not None and attn_mask.requires_grad)
        ),
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal,
        window,
        deterministic,
        backend,
        id(_config.current_config()),
        _config.config_version(),
        registry.registry_version(),
        _scope.get(),
        det and (1 + torch.is_deterministic_algorithms_warn_only_enabled()),
    )


def explain(
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
    backend=None,
    deterministic=None,
) -> Decision:
    """The Decision sdpa() would make for these arguments, with the route inside the chosen
    backend (``decision.route``); runs nothing.

    Unlike sdpa(), a call no backend can serve returns a Decision with backend=None.
    """
    call = normalize_call(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal=causal,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        deterministic=deterministic,
    )
    decision = decide(call.problem or make_problem(call.facts), backend, raise_if_none=False)
    if decision.backend is None:
        return decision
    route = registry.get_backend(decision.backend).route(call.query, call.key, call.value, call.options)
    return decision if route is None else dataclasses.replace(decision, route=route)
