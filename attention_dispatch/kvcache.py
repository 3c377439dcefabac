"""sdpa_with_kvcache() and explain_with_kvcache(): attention of a few new queries per sequence
against a KV cache (decode, chunked prefill, speculative decoding), dense or paged.

The same path as sdpa(): validate every argument (raising before any kernel runs) -> Problem
(layout "kvcache" or "paged"; seqlen_k is the cache's capacity, so every step of a generation
is the same Problem and hits the decision cache) -> dispatch.decide -> Backend.run_kvcache,
the decision recorded for last_decision() / record().

A repeated call (a decode step: same shapes, strides, dtypes, devices, alignment and options;
cache_seqlens, block_table and the tensors' contents may change) skips all of that
(kv_fast_key.py: :func:`kv_call_key`, ``kv_calls``, and the recent signatures checked in C++): its key holds everything normalize_kvcache() validates or
derives but the values of cache_seqlens and block_table, and everything decide() keys on, so a
hit is a call the full path accepted before and would decide the same way.  What a hit still
does is what depends on those values: an int cache_seqlens is range-checked and made a tensor,
and where values are checked (CPU tensors, or validate=True) :func:`_check_values` reads them,
with the full path's messages; then the runner the backend prepared for the signature
(Backend.prepare_kvcache: the `triton` backend's relaunches its decode plan).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from . import config as _config
from . import registry
from .call import _check_scalars, check_plain_tensor
from .features import check_alibi_slopes, check_return_lse, check_sinks, check_softcap
from .caches import register_cache
from .backends.base import dtype_name
from .debug import _last, _recorders, logger, note_decision
from .fast_key import RECENT, _is_compiling
from .kv_fast_key import kv_call_key, kv_calls, kv_recent_entry, kv_recent_hit, kv_remember_recent
from .dispatch import FAST_CALLS_LIMIT, Decision, decide, run_with_fallback
from .policy import guard_kv as _guard_kv
from .problem import Problem, _aligned_16, compute_capability
from .semantics import CausalKind, normalize_window
from .torch_private import forward_ad as _forward_ad, functorch_wrapped

_ALLOWED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t) -> str:
    return str(tuple(t.shape))


def _same_kind(t, name: str, query) -> None:
    """A floating tensor of the query's dtype on the query's device."""
    check_plain_tensor(t, name)
    if t.dtype != query.dtype:
        raise ValueError(
            f"{name}.dtype={dtype_name(t.dtype)} but query.dtype={dtype_name(query.dtype)}; they must match"
        )
    if t.device != query.device:
        raise ValueError(f"{name} is on {t.device} but query is on {query.device}")


def _index_tensor(t, name: str, query, want: str) -> None:
    """An int32 tensor on the query's device (its shape is checked by the caller)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor {want}, got {type(t).__name__}")
    check_plain_tensor(t, name)
    if t.dtype != torch.int32:
        raise TypeError(f"{name}.dtype={dtype_name(t.dtype)} is not allowed; allowed: int32 {want}")
    if t.device != query.device:
        raise ValueError(f"{name} is on {t.device} but query is on {query.device}")


def _causal_kind(causal) -> CausalKind | None:
    """causal=True (flash-attn's) or "bottom_right" (sdpa()'s name of the same alignment):
    bottom-right against each sequence's length; False or None: none."""
    if causal is None or causal is False:
        return None
    if causal is True or causal == CausalKind.BOTTOM_RIGHT:
        return CausalKind.BOTTOM_RIGHT
    if causal == CausalKind.TOP_LEFT:
        raise ValueError(
            f"causal={causal!r} is not allowed with a KV cache: causal is aligned bottom-right against each "
            "sequence's length (key j for query i when j <= i + L_b - Sq); pass causal=True"
        )
    error = ValueError if isinstance(causal, str) else TypeError
    raise error(f"causal={causal!r} is not allowed; allowed: True, False (or 'bottom_right', the same as True)")


class KvCall:
    """A validated sdpa_with_kvcache() call: the tensors, the backend's options, the Problem, and
    ``limits``: what the values are checked against, (n_new, capacity, what, num_blocks, page,
    check: whether _check_values runs)."""

    __slots__ = ("query", "k_cache", "v_cache", "cache_seqlens", "options", "problem", "limits")

    def __init__(self, query, k_cache, v_cache, cache_seqlens, options, problem, limits):
        self.query, self.k_cache, self.v_cache, self.cache_seqlens = query, k_cache, v_cache, cache_seqlens
        self.options, self.problem, self.limits = options, problem, limits


def _check_values(cache_seqlens, block_table, n_new: int, capacity: int, what: str, num_blocks: int, page) -> None:
    """cache_seqlens[b] (+ n_new appended keys) within [0, capacity]; for a paged cache, the
    block_table entries each sequence reads within [0, num_blocks).  Reads the tensors."""
    lengths = cache_seqlens.tolist()  # on a CUDA tensor: a copy to the host
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}]={n} is negative")
        if n + n_new > capacity:
            total = f" + {n_new} new keys (k_new) = {n + n_new}" if n_new else ""
            raise ValueError(f"cache_seqlens[{b}]={n}{total} exceeds the cache's capacity {capacity} ({what})")
    if block_table is None or not lengths:
        return
    table = block_table.cpu()
    needed = torch.tensor([-(-(n + n_new) // page) for n in lengths])  # blocks each sequence reads
    used = torch.arange(table.shape[1])[None, :] < needed[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {i}]={int(table[b, i])} is out of range [0, {num_blocks}) (num_blocks = "
            f"k_cache.shape[0]; sequence {b} reads its first {int(needed[b])} blocks)"
        )


def normalize_kvcache(
    query,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    k_new=None,
    v_new=None,
    block_table=None,
    causal=False,
    window=None,
    scale=None,
    enable_gqa=True,
    validate=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
) -> KvCall:
    """Validate every argument of sdpa_with_kvcache() (raising before any kernel) and build the call."""
    check_plain_tensor(query, "query")
    tensors = (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new))
    for name, t in () if _is_compiling() else tensors:
        if isinstance(t, torch.Tensor) and functorch_wrapped(t):
            raise TypeError(
                f"{name} is a tensor of a torch.func transform (vmap, grad, jvp); sdpa_with_kvcache is forward "
                "only and writes its cache in place: call it outside the transform"
            )
    if query.dtype not in _ALLOWED_DTYPES:
        raise TypeError(
            f"query.dtype={dtype_name(query.dtype)} is not allowed; allowed: float16, bfloat16, float32, float64"
        )
    if query.dim() != 4:
        raise ValueError(f"query must be (B, Hq, Sq, D), got shape {_shape(query)}")
    _check_scalars(0.0, scale, enable_gqa, None)
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate must be None, True or False, got {type(validate).__name__}")
    kind = _causal_kind(causal)
    window = normalize_window(window)
    b, hq, sq, d = query.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _same_kind(t, name, query)
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D: dense (B, Hkv, S_cache, D), or paged (num_blocks, block_size, Hkv, D) "
                f"with block_table; got shape {_shape(t)}"
            )
    paged = block_table is not None
    layout = "(num_blocks, block_size, Hkv, D)" if paged else "(B, Hkv, S_cache, D)"
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache has shape {_shape(v_cache)} but k_cache {_shape(k_cache)}; both must be {layout} "
            "(equal head dims)"
        )
    if paged:
        _index_tensor(block_table, "block_table", query, "(B, max_blocks)")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(f"block_table must be (B, max_blocks) with B={b}, got shape {_shape(block_table)}")
        num_blocks, page, hkv, dk = k_cache.shape
        if page < 1:
            raise ValueError(f"k_cache has block_size={page}: a paged cache is {layout} with block_size >= 1")
        capacity = block_table.shape[1] * page
        what = f"block_table.shape[1] * block_size = {block_table.shape[1]} * {page}"
    else:
        if k_cache.shape[0] != b:
            raise ValueError(
                f"k_cache has batch {k_cache.shape[0]} but query has {b}: a dense cache is {layout} "
                "(pass block_table for a paged cache)"
            )
        _, hkv, capacity, dk = k_cache.shape
        num_blocks, page = 0, None
        what = "k_cache.shape[2]"
    if dk != d:
        raise ValueError(f"k_cache has head_dim {dk} but query has {d}; they must match")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query has {hq} heads, not a multiple of the cache's key/value heads ({hkv})")
    if hq != hkv and not enable_gqa:
        raise ValueError(
            f"query has {hq} heads but the cache has {hkv}; pass enable_gqa=True (the default) for "
            "grouped-query attention"
        )
    if (k_new is None) != (v_new is None):
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{given} given without {missing}: pass both, (B, Hkv, Sq, D), or neither")
    append = k_new is not None
    if append:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _same_kind(t, name, query)
            if tuple(t.shape) != (b, hkv, sq, d):
                raise ValueError(
                    f"{name} must be (B, Hkv, Sq, D) = ({b}, {hkv}, {sq}, {d}) (query's B, Sq, D and the cache's "
                    f"Hkv), got shape {_shape(t)}"
                )
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        # flash-attn's form: one length for every sequence (a host value, checked below)
        if cache_seqlens < 0 or cache_seqlens + (sq if append else 0) > capacity:
            total = f" + {sq} new keys (k_new)" if append else ""
            raise ValueError(
                f"cache_seqlens={cache_seqlens}{total} is outside the cache's capacity [0, {capacity}] ({what})"
            )
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=query.device)
    else:
        _index_tensor(cache_seqlens, "cache_seqlens", query, "(B,)")
        if tuple(cache_seqlens.shape) != (b,):
            raise ValueError(f"cache_seqlens must be (B,) with B={b}, got shape {_shape(cache_seqlens)}")
    check = validate if validate is not None else query.device.type == "cpu"
    if check and not torch.compiler.is_compiling():
        if query.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "validate=True reads cache_seqlens and block_table on the host, which a CUDA graph "
                "capture forbids: pass validate=None or False while capturing"
            )
        _check_values(cache_seqlens, block_table, sq if append else 0, capacity, what, num_blocks, page)
    softcap = check_softcap(softcap)
    alibi_slopes = check_alibi_slopes(alibi_slopes, b, hq, (b,), query)
    sinks = check_sinks(sinks, hq, query)
    return_lse = check_return_lse(return_lse)
    features = (softcap is not None, alibi_slopes is not None, sinks is not None, return_lse)
    problem = kv_problem(query, k_cache, v_cache, k_new if append else None, v_new, block_table, kind, window, features)
    options = dict(
        k_new=k_new,
        v_new=v_new,
        block_table=block_table,
        causal=kind,
        window=window,
        scale=float(scale) if scale is not None else (1.0 / math.sqrt(d) if d else 1.0),
    )
    # only where used, as sdpa()'s options: run_kvcache() of a backend that never declared them
    # is never called with them
    for name, value in (("softcap", softcap), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if value is not None:
            options[name] = value
    if return_lse:
        options["return_lse"] = True
    limits = (sq if append else 0, capacity, what, num_blocks, page, check)
    return KvCall(query, k_cache, v_cache, cache_seqlens, options, problem, limits)


_problems: dict = {}
register_cache("kvcache.problems", _problems.clear, _problems.__len__)


def kv_problem(
    query, k_cache, v_cache, k_new, v_new, block_table, causal, window, features=(False, False, False, False)
) -> Problem:
    """The Problem of a validated KV-cache call (``causal``: a CausalKind or None; ``window``
    normalised; ``features``: whether softcap, alibi_slopes, sinks, return_lse are given): the
    one place its facts are read, here and in adapters that choose a route."""
    b, hq, sq, d = query.shape
    if block_table is not None:
        page, hkv, capacity = k_cache.shape[1], k_cache.shape[2], block_table.shape[1] * k_cache.shape[1]
    else:
        page, hkv, capacity = None, k_cache.shape[1], k_cache.shape[2]
    tensors = (query, k_cache, v_cache) + ((k_new, v_new) if k_new is not None else ())
    return _problem(
        (
            b,
            hq,
            hkv,
            sq,
            capacity,
            d,
            query.dtype,
            query.device,
            "paged" if block_table is not None else "kvcache",
            causal,
            window,
            all(t.stride(-1) == 1 for t in tensors),
            all(_aligned_16(t) for t in tensors),
            page,
            k_new is not None,
            *features,
        )
    )


def _problem(facts: tuple) -> Problem:
    """The Problem of a KV-cache call, memoised on its facts (a decode step repeats them)."""
    problem = _problems.get(facts)
    if problem is None:
        b, hq, hkv, sq, capacity, d, dtype, device, layout, kind, window, contiguous, aligned, page, append = facts[:15]
        softcap, alibi, sinks, return_lse = facts[15:]
        if len(_problems) >= 4096:
            _problems.clear()
        problem = _problems[facts] = Problem(
            batch=b,
            heads_q=hq,
            heads_kv=hkv,
            seqlen_q=sq,
            seqlen_k=capacity,
            head_dim_qk=d,
            head_dim_v=d,
            dtype=dtype,
            device_type=device.type,
            compute_capability=compute_capability(device),
            layout=layout,
            mask_kind="none",
            mask_shape=None,
            mask_requires_grad=False,
            causal=kind,
            window=window,
            dropout=False,
            requires_grad=False,  # forward only
            deterministic=False,  # the forward of every backend is deterministic
            deterministic_warn_only=False,
            last_dim_contiguous=contiguous,
            aligned_16=aligned,
            kv_block_size=page,
            kv_append=append,
            softcap=softcap,
            alibi=alibi,
            sinks=sinks,
            return_lse=return_lse,
        )
    return problem


def _execute(decision: Decision, call: KvCall):
    """Run the chosen backend, falling back per config (a fallback appends k_new/v_new again at
    the same positions: the same cache)."""

    def run(backend):
        with torch.no_grad():
            return backend.run_kvcache(call.query, call.k_cache, call.v_cache, call.cache_seqlens, **call.options)

    return run_with_fallback(decision, run)


@functools.cache
def _eager_sdpa_with_kvcache():
    """sdpa_with_kvcache under torch.compiler.disable, made on the first compiled call (at import it
    would import torch._dynamo): torch.compile runs the call eagerly (a graph break; fullgraph=True
    refuses it), since it writes the caches in place, has no traced op yet, and tracing into its
    kernel launches failed."""
    return torch.compiler.disable(sdpa_with_kvcache)


def _primal(t):
    """A dual tensor's primal (a view of its data), any other value as it is."""
    return t if not isinstance(t, torch.Tensor) else torch.autograd.forward_ad.unpack_dual(t).primal


def sdpa_with_kvcache(
    query,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    k_new=None,
    v_new=None,
    block_table=None,
    causal=False,
    window=None,
    scale=None,
    enable_gqa=True,
    backend=None,
    validate=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
):
    """Attention of Sq new queries per sequence against a KV cache, through the best backend
    that computes exactly this call (chosen, cached and recorded as sdpa()'s).

    query (B, Hq, Sq, D).  k_cache, v_cache: dense (B, Hkv, S_cache, D), or paged
    (num_blocks, block_size, Hkv, D) with block_table int32 (B, max_blocks), whose entry [b, i]
    is the block holding keys i*block_size ... of sequence b.  cache_seqlens: int32 (B,) on the
    query's device, the valid cached keys of each sequence before k_new (or one int for all,
    as flash-attn); it is not modified.  k_new, v_new: None or (B, Hkv, Sq, D), written into
    the cache in place at positions cache_seqlens[b] ... first, then attended to.

    Sequence b attends to its first L_b = cache_seqlens[b] (+ Sq with k_new) keys.
    causal=True allows key j for query i when j <= i + L_b - Sq; window=(left, right) (-1
    unbounded) allows i + L_b - Sq - left <= j <= i + L_b - Sq + right, both aligned bottom-right
    as in sdpa().  A sequence with L_b = 0 gives 0.  Hq a multiple of Hkv (enable_gqa=False
    requires Hq == Hkv); scale defaults to 1/sqrt(D).  Returns (B, Hq, Sq, D) in query's dtype.

    Forward only: it runs under torch.no_grad() (inputs may require grad; the output has no
    graph) and on dual tensors' primals (forward-mode AD: the output has no tangent).  Nothing is read on the host unless validation does: ``validate=None`` (default)
    checks cache_seqlens against the capacity (with the appended tokens) and the block_table
    entries each sequence reads against [0, num_blocks) when the tensors are on the CPU, where
    that is free; ``True`` also on CUDA (a host sync; not while capturing a CUDA graph);
    ``False`` never (an out-of-range value is then undefined behaviour of the kernel).  Shapes,
    dtypes and devices are always checked.  Without host reads a call can be captured in a CUDA
    graph, cache_seqlens, block_table and the tensors' contents changing between replays.
    backend: force one backend by name.  softcap, alibi_slopes, sinks: as in sdpa(), aligned to
    each sequence's length (ALiBi's distance |i + L_b - Sq - j|); return_lse: also return the
    rows' logsumexp, float32 (B, Hq, Sq) (-inf for a row with no key, without the sinks).
    """
    if _is_compiling():
        return _eager_sdpa_with_kvcache()(
            query=query, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new,
            block_table=block_table, causal=causal, window=window, scale=scale, enable_gqa=enable_gqa,
            backend=backend, validate=validate, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            return_lse=return_lse,
        )  # fmt: skip
    if _forward_ad._current_level >= 0:  # forward only in forward-mode AD too: primals, no tangent
        query, k_new, v_new = (_primal(t) for t in (query, k_new, v_new))
    features = softcap is not None or alibi_slopes is not None or sinks is not None or return_lse
    key = hit = None
    if not features:  # not compiling: that returned above
        try:
            recent = kv_calls.get(RECENT)
            if recent is not None:  # kv_fast_key.kv_recent_hit: the key's facts checked in C++
                entry = kv_recent_hit(
                    recent[1], query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                    (causal, window, scale, enable_gqa, backend, validate),
                )  # fmt: skip
                if entry is not None:
                    hit, key = entry[4], entry[5]
            if hit is None:
                key = kv_call_key(
                    query,
                    k_cache,
                    v_cache,
                    cache_seqlens,
                    k_new,
                    v_new,
                    block_table,
                    causal,
                    window,
                    scale,
                    enable_gqa,
                    backend,
                    validate,
                )
                hit = None if key is None else kv_calls.get(key)
                if hit is not None:  # the next call of this key checks it in C++
                    entry = kv_recent_entry(key, hit, query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
                    if entry is not None:
                        kv_remember_recent(entry)
        except RuntimeError:  # a tensor without a data pointer (torch.func's): the full path says why
            hit = key = None
    if hit is not None:
        decision, run, limits, on_cuda = hit
        n_new, capacity, what, num_blocks, page, check = limits
        lengths = cache_seqlens
        if type(lengths) is int:  # flash-attn's form; out of range: the full path says so
            lengths = (
                torch.full((query.shape[0],), lengths, dtype=torch.int32, device=query.device)
                if 0 <= lengths <= capacity - n_new
                else None
            )
        if lengths is not None and not (check and on_cuda and torch.cuda.is_current_stream_capturing()):
            if check:
                _check_values(lengths, block_table, n_new, capacity, what, num_blocks, page)
            grad = torch.is_grad_enabled()  # forward only, as the full path's torch.no_grad()
            try:
                if grad:
                    torch.set_grad_enabled(False)
                try:
                    out = run(query, k_cache, v_cache, lengths, k_new, v_new, block_table)
                finally:
                    if grad:
                        torch.set_grad_enabled(True)
            except Exception:  # noqa: BLE001 - the full path below raises or falls back per config
                kv_calls.pop(key, None)
                kv_calls.pop(RECENT, None)  # its recent entry with it
            else:
                if _last.get() is not decision:  # note_decision(), inline
                    _last.set(decision)
                for sink in _recorders.get():
                    sink.append(decision)
                return out
    call = normalize_kvcache(
        query,
        k_cache,
        v_cache,
        cache_seqlens,
        k_new=k_new,
        v_new=v_new,
        block_table=block_table,
        causal=causal,
        window=window,
        scale=scale,
        enable_gqa=enable_gqa,
        validate=validate,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        return_lse=return_lse,
    )
    decided = decide(call.problem, backend)
    decision, out = _execute(decided, call)
    guard = _config.current_config().guard
    if guard.mode != "off":  # check the answer; a wrong backend is quarantined and the call re-run
        decision, out = _guard_kv.guard_kv_call(
            decision, call, out, guard, lambda: _execute(decide(call.problem, backend), call)
        )
    note_decision(decision)
    # a call that fell back at run time keeps the full path, as every call of the guard's
    # sample and strict modes (the repeated-call path below is not checked)
    if key is not None and decision is decided and guard.mode in ("off", "first"):
        try:  # the backend's run for this signature, its per-call work done once
            run = registry.get_backend(decision.backend).prepare_kvcache(
                call.query, call.k_cache, call.v_cache, call.cache_seqlens, call.options
            )
        except Exception as exc:  # noqa: BLE001 - a backend that cannot prepare keeps the full path
            logger.debug(
                "backend %r: prepare_kvcache() failed (%s); this signature keeps the full path", decision.backend, exc
            )
        else:
            if len(kv_calls) >= FAST_CALLS_LIMIT:
                kv_calls.clear()
            on_cuda = query.device.type == "cuda"  # the key holds the device
            kv_calls[key] = (decision, run, call.limits, on_cuda)
    return out


def explain_with_kvcache(
    query,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    k_new=None,
    v_new=None,
    block_table=None,
    causal=False,
    window=None,
    scale=None,
    enable_gqa=True,
    backend=None,
    validate=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
) -> Decision:
    """The Decision sdpa_with_kvcache() would make for these arguments (validated the same
    way); runs nothing and writes nothing into the cache.  A call no backend can serve returns
    a Decision with backend=None."""
    call = normalize_kvcache(
        query,
        k_cache,
        v_cache,
        cache_seqlens,
        k_new=k_new,
        v_new=v_new,
        block_table=block_table,
        causal=causal,
        window=window,
        scale=scale,
        enable_gqa=enable_gqa,
        validate=validate,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        return_lse=return_lse,
    )
    decision = decide(call.problem, backend, raise_if_none=False)
    if decision.backend is None:
        return decision
    route = registry.get_backend(decision.backend).route_kvcache(
        call.query, call.k_cache, call.v_cache, call.cache_seqlens, call.options
    )
    return decision if route is None else dataclasses.replace(decision, route=route)
