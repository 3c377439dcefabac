"""sdpa_with_kvcache()'s fast-path key: the signature of a repeated call (a decode step: same
shapes, strides, dtypes, devices, alignment and options; cache_seqlens, block_table and the
tensors' contents may change) whose normalisation and decision an earlier call already made,
and ``kv_calls``, what such a call reuses.  kvcache.py's module doc says what a hit still does.

The recent signatures (:func:`kv_recent_entry`, :func:`kv_recent_hit`) are fast_key's for
sdpa(): the last RECENT_LIMIT keys that hit keep torch's C++ check of their tensors
(torch_private.tensor_check: type, dispatch keys, dtype, device, requires_grad, sizes,
strides), and a call passing it with the same arguments present, the same options (types
included), 16-byte pointers and dispatch state is a call with that key: ~1 us where the key
costs ~4-6 us of tensor attributes read from Python (perf-notes experiment 89).
"""

from __future__ import annotations

import torch

from .caches import register_cache
from .fast_key import RECENT, RECENT_LIMIT, _is_compiling, dispatch_state
from .torch_private import tensor_check

# sdpa_with_kvcache()'s repeated calls: kv_call_key -> (Decision, the backend's prepare_kvcache()
# runner, KvCall.limits, whether the tensors are on CUDA);
# kv_calls[RECENT] = (None, recent entries, newest first)
kv_calls: dict = {}
register_cache("kv_fast_key.kv_calls", kv_calls.clear, kv_calls.__len__)


def kv_call_key(
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
):
    """sdpa_with_kvcache()'s fast-path key (module doc), for plain tensors and scalar options of
    the plain types (causal a bool or None, window None or two ints, scale None or a float, an
    int cache_seqlens or an int32 tensor); None when the call must take the full path.  It
    holds what normalize_kvcache() reads but the values of cache_seqlens and block_table
    (shapes, strides, dtypes, devices and 16-byte alignment of every tensor, the option values
    with their types) and what decide() keys on (config, registry, scope, torch's determinism
    flags, which some backends' checks read)."""
    tensor = torch.Tensor
    if (
        type(query) is not tensor
        or type(k_cache) is not tensor
        or type(v_cache) is not tensor
        or (causal is not None and type(causal) is not bool)
        or (scale is not None and type(scale) is not float)
        or type(enable_gqa) is not bool
        or (backend is not None and type(backend) is not str)
        or (validate is not None and type(validate) is not bool)
        or (
            window is not None
            and not (type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int)
        )
        or _is_compiling()
    ):
        return None
    try:  # a strided nested tensor has no shape or strides (normalize_kvcache says what to pass)
        # each tensor's shape, strides, dtype, device and 16-byte alignment, read inline (every decode step pays here)
        q_key = query.shape, query.stride(), query.dtype, query.device, query.data_ptr() & 15
        k_key = k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.data_ptr() & 15
        v_key = v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, v_cache.data_ptr() & 15
        if type(cache_seqlens) is int:
            lengths = int
        elif type(cache_seqlens) is tensor:
            lengths = (cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device)
        else:
            return None
        if k_new is None and v_new is None:
            new = None
        elif type(k_new) is tensor and type(v_new) is tensor:
            new = (
                k_new.shape,
                k_new.stride(),
                k_new.dtype,
                k_new.device,
                k_new.data_ptr() & 15,
                v_new.shape,
                v_new.stride(),
                v_new.dtype,
                v_new.device,
                v_new.data_ptr() & 15,
            )
        else:
            return None
        if block_table is None:
            table = None
        elif type(block_table) is tensor and not block_table.is_nested:
            table = (block_table.shape, block_table.dtype, block_table.device)
        else:
            return None
    except RuntimeError:
        return None
    return (
        q_key,
        k_key,
        v_key,
        lengths,
        new,
        table,
        causal,
        window,
        scale,
        enable_gqa,
        backend,
        validate,
        dispatch_state(),  # config, registry, scope, determinism
    )


def _tensors(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table) -> tuple:
    """The call's tensors in the order a recent entry's check takes them."""
    tensors = (query, k_cache, v_cache)
    if type(cache_seqlens) is not int:
        tensors += (cache_seqlens,)
    if k_new is not None:
        tensors += (k_new, v_new)
    return tensors if block_table is None else tensors + (block_table,)


def kv_recent_entry(exact: tuple, hit, query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table):
    """The entry of :func:`kv_recent_hit` for a call whose :func:`kv_call_key` is ``exact`` and
    whose kv_calls entry is ``hit``: (check, which arguments are present, options, dispatch
    state, hit, exact); None where the check cannot serve (no tested TensorGuards, a pointer off
    16 bytes, one tensor passed twice)."""
    if (
        tensor_check is None
        or exact[0][4]
        or exact[1][4]
        or exact[2][4]
        or (exact[4] is not None and exact[4][4] | exact[4][9])
    ):
        return None
    tensors = _tensors(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    if len({id(t) for t in tensors}) != len(tensors):
        return None
    check = tensor_check(*tensors)
    if check is None:
        return None
    present = (type(cache_seqlens) is int, k_new is None, block_table is None)
    return (check, present, exact[6:12], exact[12], hit, exact)


def kv_recent_hit(entries, query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, options):
    """The entry among ``entries`` (:func:`kv_recent_entry`) whose key this call has, else None.
    ``options``: (causal, window, scale, enable_gqa, backend, validate).  The call has no
    features and is not being traced (torch.compiler.is_compiling())."""
    present = (type(cache_seqlens) is int, k_new is None, block_table is None)
    state = None
    for entry in entries:
        if entry[1] != present or entry[2] != options:
            continue
        if state is None:  # what every entry compares alike: types, alignment, dispatch state
            causal, window, scale, enable_gqa, backend, validate = options
            if not (
                (causal is None or type(causal) is bool)
                and (scale is None or type(scale) is float)
                and type(enable_gqa) is bool
                and (backend is None or type(backend) is str)
                and (validate is None or type(validate) is bool)
                and (window is None or (type(window) is tuple and type(window[0]) is int and type(window[1]) is int))
                and (k_new is None) is (v_new is None)
            ):
                return None
            tensors = _tensors(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
            pointers = query.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
            if k_new is not None:
                pointers |= k_new.data_ptr() | v_new.data_ptr()
            if pointers & 15:
                return None
            state = dispatch_state()
        if entry[3] == state and entry[0](*tensors):
            return entry
    return None


def kv_remember_recent(entry) -> None:
    """Put ``entry`` first among kv_calls' recent entries, the oldest beyond RECENT_LIMIT dropped."""
    recent = kv_calls.get(RECENT)
    others = () if recent is None else tuple(e for e in recent[1] if e[5] != entry[5])
    kv_calls[RECENT] = (None, (entry,) + others[: RECENT_LIMIT - 1])
