"""Appending new keys and values into a KV cache, in place: the one implementation that every
backend with a kv-cache path and the triton backend's decode kernels share (the math reference
writes them from the definition).  CUDA tensors: one launch of tl/kv_append.py's kernel, keys and
values together, every position read on the device, so that a call stays CUDA-graph capturable;
elsewhere, or while torch.compile traces the call, torch ops.  Imports no Triton until a launch:
backends without it keep the torch ops."""

from __future__ import annotations

import functools

import torch

from ..caches import register_cache
from .limits import MAX_GRID_YZ

# Elements of one tensor a program copies per step: a decode row (Sn = 1, D = 128) is one warp's
# 4 elements a thread; a long chunk of new rows takes up to 4 warps at 16 rows of 128.
TILE = 2048


def append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None) -> None:
    """Write k_new / v_new (B, Hkv, Sn, D) at positions cache_seqlens[b] + i with device-side
    indices (no host read: CUDA-graph capturable).  Dense caches are (B, Hkv, S, D), paged ones
    (num_blocks, block_size, Hkv, D) with ``block_table`` (B, max_blocks).  CUDA tensors: one
    launch (:func:`append_kv_kernel`); elsewhere, or while torch.compile traces the call,
    :func:`append_kv_torch`."""
    if k_new.is_cuda and not torch.compiler.is_compiling() and _launch_parts() is not None:
        append_kv_kernel(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
        return
    append_kv_torch(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)


@functools.cache
def _launch_parts():
    """(run, cdiv, next_pow2, the kernel), imported once; None where Triton is missing or broken
    (the torch ops then serve)."""
    try:
        from . import run
        from .shapes import cdiv, next_pow2
        from .tl.kv_append import _kv_append
    except Exception:
        return None
    return run, cdiv, next_pow2, _kv_append


register_cache("kernels.kv_append.launch_parts", _launch_parts.cache_clear, lambda: _launch_parts.cache_info().currsize)


def append_kv_torch(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None) -> None:
    """append_kv in torch ops (the CPU's path, and the kernel's reference in the tests): dense
    caches by scatter_ (3.5x less host time than index_put_ on the CPU), paged ones by
    index_put_ through the block table; ~6 launches dense, ~12 paged on a GPU."""
    B, Hkv, Sn, D = k_new.shape
    steps = torch.arange(Sn, device=k_new.device)
    if block_table is None:
        index = (cache_seqlens.view(B, 1, 1, 1) + steps.view(1, 1, Sn, 1)).long().expand(B, Hkv, Sn, D)
        k_cache.scatter_(2, index, k_new)
        v_cache.scatter_(2, index, v_new)
        return
    pos = cache_seqlens.long()[:, None] + steps  # (B, Sn)
    page = k_cache.shape[1]
    index = (block_table.long().gather(1, pos // page).reshape(-1), (pos % page).reshape(-1))
    k_cache.index_put_(index, k_new.transpose(1, 2).reshape(B * Sn, Hkv, D))
    v_cache.index_put_(index, v_new.transpose(1, 2).reshape(B * Sn, Hkv, D))


def append_kv_kernel(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None) -> None:
    """:func:`append_kv`'s write in one launch of tl/kv_append.py's kernel (same arguments:
    dense caches (B, Hkv, S, D), paged ones (num_blocks, block_size, Hkv, D) with ``block_table``
    int32 (B, max_blocks); ``cache_seqlens`` int32 (B,); any strides).  Rows whose position is
    past the cache, or whose block entry is out of range, are skipped, never written elsewhere."""
    run, cdiv, next_pow2, kernel = _launch_parts()
    B, Hkv, Sn, D = k_new.shape
    if k_new.numel() == 0:
        return
    if block_table is None:
        num_blocks, page, capacity = 0, 1, k_cache.shape[2]
        table, table_strides = cache_seqlens, (0, 0)  # not read: PAGED is off
    else:
        num_blocks, page = k_cache.shape[0], k_cache.shape[1]
        capacity = block_table.shape[1] * page
        table, table_strides = block_table, block_table.stride()
    if capacity == 0:
        return
    block_d = next_pow2(D)
    block_s = min(next_pow2(Sn), max(1, TILE // block_d))
    grid = (B * Hkv, min(cdiv(Sn, block_s), MAX_GRID_YZ))  # more row blocks: each program loops
    args = (
        k_cache, v_cache, k_new, v_new, cache_seqlens, table,
        *k_cache.stride(), *v_cache.stride(), *k_new.stride(), *v_new.stride(),
        cache_seqlens.stride(0), *table_strides,
        Hkv, Sn, D, capacity, page, num_blocks,
    )  # fmt: skip
    constexprs = dict(PAGED=block_table is not None, BLOCK_S=block_s, BLOCK_D=block_d)
    warps = max(1, min(4, block_s * block_d // 256))
    run.launch_one(kernel, grid, args, constexprs, warps, 1)
