"""sdpa() and explain(): normalise arguments -> Problem -> dispatch -> run."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

from . import config as _config
from . import registry
from .debug import logger, note_decision
from . import dispatch
from .dispatch import FAST_CALLS_LIMIT, Decision, decide, fast_calls, run_with_fallback, span_calls
from .call import Call, _seqlens, make_problem, normalize_call
from .fast_key import (
    RECENT,
    _compiler,
    _config_vars,
    _deterministic,
    _deterministic_warn_only,
    _grad_enabled,
    _is_dynamo_compiling,
    _last_get,
    _last_set,
    _recent_get,
    _recorders_get,
    _scope_get,
    _scoped_config,
    call_key,
    forget_recent,
    length_key,
    recent_entry,
    remember_recent,
)
from .autocast import autocast_inputs
from .fastest import choose_fastest
from .torch_private import any_autocast as _any_autocast, checkpoint_stop as _checkpoint_stop, forward_ad as _forward_ad
from .tracing import decide_while_tracing
from .policy import guard as _guard


def _execute(decision: Decision, call: Call):
    """Run the chosen backend; on a run-time failure re-raise or fall back per config."""
    return run_with_fallback(decision, lambda backend: backend.run(call.query, call.key, call.value, **call.options))


def _execute_again(call: Call, backend):
    """Decide again and run (the guard's re-run); a function, not a closure in sdpa(): a closure's
    cells would be made on every call, hits included."""
    return _execute(decide(call.problem, backend), call)


_KEYWORD_ONLY = object()  # sdpa()'s marker parameter's default


def _keyword_only_signature(fn) -> inspect.Signature:
    """``fn``'s signature with the parameters after its ``_keyword_only`` marker keyword-only
    and the marker gone: what sdpa() means and shows (help, inspect).  sdpa() declares them
    positional-or-keyword behind the marker (a 9th positional argument lands on it and raises)
    because CPython 3.11 fills a keyword-only parameter's default by a dict lookup and does not
    specialize the call: ~0.7 us of the tiny CPU call, ~5% (experiment 91)."""
    params = list(inspect.signature(fn).parameters.values())
    at = [p.name for p in params].index("_keyword_only")
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[at + 1 :]]
    return inspect.Signature(params[:at] + rest)


def sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    _keyword_only=_KEYWORD_ONLY,  # the rest is keyword-only: see _keyword_only_signature
    causal=None,
    window=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    backend=None,
    deterministic=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
):
    """Scaled dot-product attention through the best backend that computes exactly this call.

    Dense: query (B, Hq, Sq, Dqk), key (B, Hkv, Sk, Dqk), value (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv)
    (any number of leading batch dims, or (N, S, D), as torch's sdpa). Varlen: packed
    (total, H, D) with cu_seqlens_q/k (int32, B+1), or torch.nested jagged (B, H, j, D).
    attn_mask: bool (True = attend) or float (added), broadcastable to (B, Hq, Sq, Sk).
    causal: None | "top_left" (= is_causal=True) | "bottom_right"; window: (left, right), -1 unbounded.
    backend: force one backend by name; deterministic: None follows torch's setting.
    softcap: float > 0, scores capped to softcap * tanh(score / softcap) before the mask is added;
    alibi_slopes: float32 (Hq,) or (B, Hq), adds -slope * |i + off - j| (off as the window's);
    sinks: (Hq,), one extra logit per head in each row's softmax denominator, carrying no value;
    return_lse: also return the rows' logsumexp (without the sinks; -inf for an empty row),
    float32 (float64 for float64 inputs), (B, Hq, Sq) (varlen: (Hq, total_q)), differentiable.
    """
    if _keyword_only is not _KEYWORD_ONLY:
        raise TypeError(
            "sdpa() takes from 3 to 8 positional arguments but more were given (a "
            f"{type(_keyword_only).__name__} after enable_gqa); causal and the options after it are keyword-only"
        )
    compiling = _is_dynamo_compiling()
    if compiling or _any_autocast():
        cast = autocast_inputs(query, key, value, attn_mask)
        if cast is not None:  # torch.autocast on: the inputs as F.sdpa gets them, the call run with it off
            with torch.autocast(query.device.type, enabled=False):
                return sdpa(
                    *cast,
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
                    backend=backend,
                    deterministic=deterministic,
                    softcap=softcap,
                    alibi_slopes=alibi_slopes,
                    sinks=sinks,
                    return_lse=return_lse,
                )
    if (
        softcap is not None
        or alibi_slopes is not None
        or sinks is not None
        or return_lse
        or _forward_ad._current_level >= 0
    ):
        fast_key = None  # the fast path's key knows none of these (nor dual tensors)
    else:
        # torch.compiler.is_compiling() (call_key returns None), without its two Python calls
        recent = None if compiling or _compiler._is_compiling_flag else _recent_get(RECENT)
        if recent is not None and cu_seqlens_q is None and cu_seqlens_k is None:
            # a recent signature (fast_key.recent_entry): a call that passes its check has its
            # call_key, every field (options by identity, else exact type and equality; tensors in
            # C++; 16-byte pointers; dispatch state by identity).  Inline: a Python frame is ~3% of
            # the tiny CPU call (experiment 92).
            has_mask = attn_mask is not None
            for entry in recent[1]:
                o = entry[2]  # the entry's options, of the types call_key() accepts: bools and None by identity
                if not (
                    entry[1] is has_mask
                    and is_causal is o[1]
                    and enable_gqa is o[3]
                    and deterministic is o[6]
                    and (dropout_p is o[0] or (type(dropout_p) is float and dropout_p == o[0]))
                    and (scale is o[2] or (type(scale) is float and scale == o[2]))
                    and (causal is o[4] or (type(causal) is str and causal == o[4]))
                    and (backend is o[7] or (type(backend) is str and backend == o[7]))
                    and (
                        window is o[5]
                        or (
                            type(window) is tuple
                            and window == o[5]
                            and type(window[0]) is int
                            and type(window[1]) is int
                        )
                    )
                ):
                    continue  # another option, or an equal one of another type (1 == 1.0 == True)
                if has_mask:
                    if not entry[0](query, key, value, attn_mask):
                        continue
                    if (query.data_ptr() | key.data_ptr() | value.data_ptr() | attn_mask.data_ptr()) & 15:
                        break  # every entry is aligned
                elif not entry[0](query, key, value):
                    continue
                elif (query.data_ptr() | key.data_ptr() | value.data_ptr()) & 15:
                    break
                if not (
                    _scoped_config() is entry[3]
                    and _scope_get() is entry[9]
                    and _config_vars["_loaded"] is entry[10]
                    and _config_vars["_version"] == entry[11]
                    and registry._version == entry[12]
                    and entry[13] == (_deterministic() and 1 + _deterministic_warn_only())
                    and (not entry[4] or _grad_enabled() is entry[5])
                ):
                    continue
                decision, op = entry[6], entry[14]
                try:  # op: the runner's own C call (Backend.prepare's first_of), a Python frame less
                    if op is not None:
                        out = op(query, key, value)[0]
                    else:
                        out = (
                            entry[7](query, key, value) if attn_mask is None else entry[7](query, key, value, attn_mask)
                        )
                except _checkpoint_stop:  # activation checkpointing ends its recomputation
                    raise
                except Exception:  # noqa: BLE001 - the full path below raises or falls back per config
                    forget_recent(fast_calls, entry)
                    break
                if _last_get() is not decision:  # note_decision(), inline
                    _last_set(decision)
                for sink in _recorders_get():
                    sink.append(decision)
                return out
        try:
            fast_key = call_key(
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
        except RuntimeError:  # a tensor without a data pointer (torch.func's wrappers): the full path
            fast_key = None
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
            except _checkpoint_stop:
                raise
            except Exception:  # noqa: BLE001 - the full path below raises or falls back per config
                fast_calls.pop(fast_key, None)
            else:
                _last_set(decision)  # note_decision(), inline: it is a tenth of a tiny call's overhead
                for sink in _recorders_get():
                    sink.append(decision)
                if cu_seqlens_q is None:  # the next call of this signature checks it in C++
                    entry = recent_entry(fast_key, decision, runner, query, key, value, attn_mask)
                    if entry is not None:
                        remember_recent(fast_calls, entry)
                return out
        lengths = length_key(fast_key)
        if lengths is not None:  # a call that differs from earlier ones only in Sk (dispatch.seqlen_k_span)
            spans = span_calls.get(lengths[0])
            if spans is not None:
                sk = lengths[1]
                for lo, hi, decision, run, options in spans[0]:
                    if lo <= sk <= hi:
                        try:
                            out = run(query, key, value, **options)
                        except _checkpoint_stop:
                            raise
                        except Exception:  # noqa: BLE001 - the full path below raises or falls back per config
                            span_calls.pop(lengths[0], None)
                        else:
                            dispatch.span_stats["hits"] += 1
                            note_decision(decision)
                            return out
                        break
    else:
        lengths = None
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
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        return_lse=return_lse,
    )
    if call.problem is None:  # tracing under torch.compile: one op, no run-time dispatch
        name, call.options["deterministic"] = decide_while_tracing(call.facts, backend)
        out = registry.get_backend(name).run(call.query, call.key, call.value, **call.options)
        return out if call.restore is None else call.restore(out)
    decision = decide(call.problem, backend)
    cfg = _config.current_config()
    policy, guard = cfg.dispatch, cfg.guard
    if policy.policy == "fastest" and backend is None:
        decision = choose_fastest(decision, call, policy.fastest_cache)
    decided = decision
    rng = _guard.rng_before(decision.backend, call.problem, call.query.device, guard)  # dropout: its mask
    decision, out = _execute(decision, call)
    if guard.mode != "off":  # check the answer; a wrong backend is quarantined and the call re-run
        decision, out = _guard.guard_call(
            decision, call, out, guard, functools.partial(_execute_again, call, backend), rng
        )
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
        and guard.mode != "strict"  # strict checks every call, on the full path
    ):
        runner = None
        try:
            runner = registry.get_backend(decision.backend).prepare(query, key, value, call.options)
        except Exception as exc:  # noqa: BLE001 - the call succeeded; only its fast path is lost
            logger.debug("backend %r: prepare() failed (%s); this signature keeps the full path", decision.backend, exc)
        else:
            if guard.mode == "sample":
                runner = _guard.sampled(runner, decision, call.options, guard)
            if len(fast_calls) >= FAST_CALLS_LIMIT:
                fast_calls.clear()
            fast_calls[fast_key] = (decision, runner)
        if (
            lengths is not None
            and guard.mode in ("off", "first")
            and not (policy.policy == "fastest" and backend is None)
        ):
            _remember_span(lengths[0], decision, call.options, backend, runner)
    return out if call.restore is None else call.restore(out)


sdpa.__signature__ = _keyword_only_signature(sdpa)


def _remember_span(length_key_: tuple, decision: Decision, options: dict, forced, runner=None) -> None:
    """After a full path of a call with a length key: the first one of its signature only
    marks it; a later one (another Sk) proves the span of its Decision
    (dispatch.seqlen_k_span) and keeps it for sdpa()'s calls with Sk in it, to run through
    ``runner`` (this call's prepared one) where it serves any key length (Backend.prepare),
    else through the backend's run()."""
    spans = span_calls.get(length_key_)
    if spans is None:
        if len(span_calls) >= FAST_CALLS_LIMIT:
            span_calls.clear()
        span_calls[length_key_] = ((), dispatch.SPAN_PROBES)
        return
    entries, probes = spans
    if probes <= 0:
        return
    span = dispatch.seqlen_k_span(decision, forced)
    if span is None or span[0] == span[1]:
        dispatch.span_stats["unprovable"] += 1
        span_calls[length_key_] = (entries, 0 if span is None else probes - 1)
        return
    dispatch.span_stats["proofs"] += 1
    entry = (
        *span,
        dataclasses.replace(decision, seqlen_k_span=span),
        *(
            (runner, {})
            if getattr(runner, "any_key_length", False)
            else (registry.get_backend(decision.backend).run, options)
        ),
    )
    span_calls[length_key_] = ((entry,) + entries[: dispatch.SPAN_ENTRIES - 1], probes)


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
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
) -> Decision:
    """The Decision sdpa() would make for these arguments, with the route inside the chosen
    backend (``decision.route``); runs nothing.

    Unlike sdpa(), a call no backend can serve returns a Decision with backend=None.
    """
    query, key, value, attn_mask = autocast_inputs(query, key, value, attn_mask) or (query, key, value, attn_mask)
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
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        return_lse=return_lse,
    )
    decision = decide(call.problem or make_problem(call.facts), backend, raise_if_none=False)
    if decision.backend is None:
        return decision
    route = registry.get_backend(decision.backend).route(call.query, call.key, call.value, call.options)
    guard = _config.current_config().guard
    note = _guard.not_judged_note(decision.backend, decision.problem, call.options, guard, (decision.backend,))
    notes = decision.notes + tuple(n for n in (note, _guard.mode_note(guard)) if n)
    return dataclasses.replace(decision, notes=notes, **({} if route is None else {"route": route}))
