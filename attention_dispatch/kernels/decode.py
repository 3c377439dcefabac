"""A call against a KV cache: its route (:func:`kv_route`), the decode kernels (tl/decode.py,
launched by decode_plan.DecodePlan: key splits, the split and combine passes) or the Gluon
forward over the cache (:func:`cache_forward`), and their prepared runners for repeated calls.

Everything is device work or python ints: ``cache_seqlens`` and ``block_table`` are never read
on the host, so a call is CUDA-graph capturable with their contents changing between replays.
"""

from __future__ import annotations

import torch

from .decode_plan import (
    MAX_DECODE_SPLITS,
    MIN_KEYS_PER_SPLIT,
    KvRunner,
    decode_splits,
    plan_for,
)
from .kv_append import append_kv
from .launch_replay import Replay
from .params import KernelParams

__all__ = ["MAX_DECODE_SPLITS", "MIN_KEYS_PER_SPLIT", "decode_splits"]  # kept here for their users


def _empty_result(q, capacity: int):
    """Zeros when there is nothing to compute (no rows, or a cache of capacity 0), else None."""
    if q.numel() == 0 or capacity == 0:
        return torch.zeros(q.shape, device=q.device, dtype=q.dtype)
    return None


def _with_lse(out, lse, need_lse: bool, q):
    """``out``, or (out, lse) when the call asked for its logsumexp (-inf rows when nothing ran)."""
    if not need_lse:
        return out
    if lse is None:
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
    return out, lse


def _one_new_layout(k_new, v_new):
    """k_new and v_new with one set of strides, the one the decode kernel reads both with (and its
    plan keeps): copies of both where their layouts differ (a rare call; never the common one)."""
    if k_new is None or k_new.stride() == v_new.stride():
        return k_new, v_new
    return k_new.contiguous(), v_new.contiguous()


def decode_forward(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    params: KernelParams,
    block_table=None,
    n_new: int = 0,
    num_splits: int = 0,
    k_new=None,
    v_new=None,
    alibi=None,
    sinks=None,
    need_lse: bool = False,
):
    """Attention of q (B, Hq, Sq, D) over each sequence's first cache_seqlens[b] + n_new cached
    keys by the decode kernel (every sequence the whole cache when ``cache_seqlens`` is None): the
    new ones already appended, or given as ``k_new``/``v_new`` (B, Hkv, n_new, D), which the
    kernel writes into the cache as it reads them.  A repeated signature relaunches its
    :class:`~.decode_plan.DecodePlan`.  ``params``:
    scale, softcap, window and bottom-right causal (``window_right=0``); ``num_splits`` > 0
    forces the key splits; ``alibi`` (B, Hq) fp32 slopes, ``sinks`` (Hq,), or None.  Returns
    (B, Hq, Sq, D), or with ``need_lse`` (out, logsumexp fp32 (B, Hq, Sq) without the sink)."""
    empty = _empty_call(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, need_lse)
    if empty is not None:
        return empty
    k_new, v_new = _one_new_layout(k_new, v_new)
    if sinks is not None and sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    plan = plan_for(
        q, k_cache, v_cache, cache_seqlens, params, block_table, k_new, v_new, alibi, sinks, need_lse, n_new, num_splits
    )
    return _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, alibi, sinks, need_lse)


def _empty_call(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, need_lse):
    """The result of a call with no query rows or a cache of capacity 0 (zeros; k_new appended
    where there is room), else None: such a call has no plan (its split geometry divides by them)."""
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[2]
    if q.numel() and capacity:
        return None
    if k_new is not None and capacity and k_new.numel():
        append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    return _with_lse(_empty_result(q, 0), None, need_lse, q)


def _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, alibi, sinks, need_lse, geo=None):
    """decode_forward's result through its plan (kernels/decode_plan.py), for a call _empty_call passed."""
    out, lse = plan(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, alibi, sinks, geo)
    return (out, lse) if need_lse else out


def cache_forward(q, k_cache, v_cache, cache_seqlens, params: KernelParams, n_new: int = 0, need_lse: bool = False):
    """decode_forward's result for a call gluon.route.cache_forward_reason accepts (many new
    queries over a dense cache): one launch of the Gluon forward over each sequence's key tiles,
    the last one partial (gluon/common._cache_tiles).  Returns (B, Hq, Sq, D), or with
    ``need_lse`` (out, the logsumexp (B, Hq, Sq))."""
    from .gluon import launch as gluon_launch
    from .shapes import KernelShapes, rows_layout

    empty = _empty_result(q, k_cache.shape[2])
    if empty is not None:
        return _with_lse(empty, None, need_lse, q)
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if need_lse else None
    prob = KernelShapes(q, k_cache, v_cache, None, None, None, None)
    gluon_launch.forward(
        q,
        k_cache,
        v_cache,
        out,
        lse,
        params,
        prob,
        rows_layout(q),
        rows_layout(k_cache, v_cache),
        kv_lens=cache_seqlens,
        n_new=n_new,
    )
    return _with_lse(out, lse, need_lse, q)


CACHE_GLUON = "gluon cache forward"  # cache_forward
CACHE_DECODE = "decode split-KV"  # decode_forward


def kv_route(q, k_cache, v_cache, block_table, params: KernelParams, alibi=None, sinks=None) -> tuple[str, str | None]:
    """(the kernel a KV-cache call runs, CACHE_GLUON or CACHE_DECODE; why not CACHE_GLUON, or None)."""
    from .gluon.route import cache_forward_reason, score_features_reason

    why_not = score_features_reason(params, alibi is not None, sinks is not None, "cache forward")
    why_not = why_not or cache_forward_reason(q, k_cache, v_cache, block_table, params)
    return (CACHE_DECODE, why_not) if why_not else (CACHE_GLUON, None)


def kv_forward(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    params: KernelParams,
    block_table=None,
    k_new=None,
    v_new=None,
    alibi=None,
    sinks=None,
    need_lse: bool = False,
):
    """sdpa_with_kvcache()'s kernels, k_new/v_new (or None) appended into the cache in place:
    :func:`cache_forward` after the append where :func:`kv_route` takes it, else
    :func:`decode_forward` with the append fused.  ``alibi``/``sinks``/``need_lse``: as
    :func:`decode_forward`'s.  The route is chosen once per signature (its plan's geometry)."""
    empty = _empty_call(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, need_lse)
    if empty is not None:
        return empty
    n_new = q.shape[2] if k_new is not None else 0
    k_new, v_new = _one_new_layout(k_new, v_new)
    if sinks is not None and sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    plan = plan_for(
        q, k_cache, v_cache, cache_seqlens, params, block_table, k_new, v_new, alibi, sinks, need_lse, n_new, 0
    )
    geo = plan.geometry(q, k_cache, v_cache, block_table)
    if geo.route is None:  # kv_route reads shapes, strides, alignment and params: fixed per plan and geometry
        geo.route = kv_route(q, k_cache, v_cache, block_table, params, alibi, sinks)[0]
    if geo.route == CACHE_GLUON:
        if k_new is not None:
            append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
        return cache_forward(q, k_cache, v_cache, cache_seqlens, params, n_new, need_lse)
    return _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, alibi, sinks, need_lse, geo)


def prepare_kv(q, k_cache, v_cache, cache_seqlens, params: KernelParams, block_table, k_new, v_new, fallback):
    """A :class:`~.decode_plan.KvRunner` (the decode kernel) or :class:`CacheRunner` (the Gluon
    route) for repeated calls of this one's signature (no alibi, sinks or logsumexp), or None
    (rows to copy, k_new and v_new in two layouts, an empty call, lengths with another stride):
    kv_forward serves those."""
    tensors = (q, k_cache, v_cache) + ((k_new, v_new) if k_new is not None else ())
    if (
        any(t.stride(-1) != 1 for t in tensors)
        or (k_new is not None and k_new.stride() != v_new.stride())
        or cache_seqlens.stride(0) != 1
        or (block_table is not None and block_table.stride(-1) != 1)
        or q.numel() == 0
    ):
        return None
    n_new = q.shape[2] if k_new is not None else 0
    plan = plan_for(q, k_cache, v_cache, cache_seqlens, params, block_table, k_new, v_new, None, None, False, n_new, 0)
    geo = plan.geometry(q, k_cache, v_cache, block_table)
    if geo.route is None:
        geo.route = kv_route(q, k_cache, v_cache, block_table, params)[0]
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[2]
    if capacity == 0:
        return None
    if geo.route == CACHE_GLUON:
        return CacheRunner(params, n_new, cache_seqlens, fallback)
    return KvRunner(plan, geo, cache_seqlens, block_table, fallback)


class CacheRunner:
    """sdpa_with_kvcache()'s repeated calls of one signature on the Gluon route (prepare_kv): the
    append, then :func:`cache_forward`'s launch captured on the first call and relaunched over
    the new tensors after it (launch_replay.Replay: its descriptors' tensormaps kept per address), none
    of kv_forward's or the launcher's argument processing.  A call whose lengths have another
    stride or alignment than the prepared call's goes to ``fallback`` (the backend's whole path)."""

    __slots__ = ("params", "n_new", "lens_align", "fallback", "launch", "out_like_query")

    def __init__(self, params: KernelParams, n_new: int, cache_seqlens, fallback):
        self.params, self.n_new, self.fallback, self.launch = params, n_new, fallback, None
        self.lens_align = cache_seqlens.data_ptr() & 15

    def __call__(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table):
        from .compiled_cache import COMPILED, hooks_installed

        if cache_seqlens.stride(0) != 1 or cache_seqlens.data_ptr() & 15 != self.lens_align:
            return self.fallback(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
        if k_new is not None:
            append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new)
        launch = self.launch  # None: not captured yet; False: its launches cannot be replayed
        if launch and not hooks_installed():
            out = torch.empty_like(q) if self.out_like_query else torch.empty(q.shape, device=q.device, dtype=q.dtype)
            launch((q, k_cache, v_cache, cache_seqlens, out))
            return out
        with COMPILED.capture() as launches:
            out = cache_forward(q, k_cache, v_cache, cache_seqlens, self.params, self.n_new)
        if launch is None:
            self.out_like_query = q.is_contiguous()  # empty_like gives cache_forward's contiguous out
            self.launch = Replay.capture(launches, (q, k_cache, v_cache, cache_seqlens, out), q.device) or False
        return out
