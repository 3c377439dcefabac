"""The KV-cache append's launch (tl/kv_append.py): keys and values in one launch, every
position read on the device, so that a call stays CUDA-graph capturable.  backends/kv_append.py
calls it for CUDA tensors (on the CPU, for tests under TRITON_INTERPRET=1)."""

from __future__ import annotations

from . import run
from .limits import MAX_GRID_YZ
from .shapes import cdiv, next_pow2
from .tl.kv_append import _kv_append

# Elements of one tensor a program copies per step: a decode row (Sn = 1, D = 128) is one warp's
# 4 elements a thread; a long chunk of new rows takes up to 4 warps at 16 rows of 128.
TILE = 2048


def append_kv_kernel(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None) -> None:
    """backends.kv_append.append_kv's write in one launch of :func:`_kv_append` (same arguments:
    dense caches (B, Hkv, S, D), paged ones (num_blocks, block_size, Hkv, D) with ``block_table``
    int32 (B, max_blocks); ``cache_seqlens`` int32 (B,); any strides).  Rows whose position is
    past the cache, or whose block entry is out of range, are skipped, never written elsewhere."""
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
    run.launch_one(_kv_append, grid, args, constexprs, warps, 1)
