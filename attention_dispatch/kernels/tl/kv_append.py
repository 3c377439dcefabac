"""The KV-cache append: k_new / v_new (B, Hkv, Sn, D) written into the cache at positions
cache_seqlens[b] + i, keys and values in one launch (launched by kernels/kv_append.py).

Grid (B * Hkv, row blocks): program (bh, r) copies rows r BLOCK_S, (r + 1) BLOCK_S, ... (a
stride of the grid's second axis) of sequence b's kv head h, both tensors.  Dense caches are
(B, Hkv, S, D), paged ones (num_blocks, page, Hkv, D) with BlockTable (B, max_blocks); every
tensor is read through its own strides (``s*0..3``: the strides of its four dims in that
order).  Positions are device data only (CUDA-graph capturable).  A row whose position lies
outside [0, capacity), or whose block entry lies outside [0, num_blocks), is not written: an
input error the caller validates where that is free, never a write past the cache.
"""

import triton
import triton.language as tl


@triton.jit
def _kv_append(
    KCache, VCache, KNew, VNew, CacheSeqlens, BlockTable,
    skc0, skc1, skc2, skc3, svc0, svc1, svc2, svc3,
    skn0, skn1, skn2, skn3, svn0, svn1, svn2, svn3,
    s_lens, sbt0, sbt1,
    Hkv, Sn, D, capacity, page, num_blocks,
    PAGED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = (bh // Hkv).to(tl.int64)
    h = (bh % Hkv).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < D
    start = tl.load(CacheSeqlens + b * s_lens).to(tl.int64)
    k_src = KNew + b * skn0 + h * skn1 + d[None, :] * skn3
    v_src = VNew + b * svn0 + h * svn1 + d[None, :] * svn3
    for s0 in range(tl.program_id(1) * BLOCK_S, Sn, tl.num_programs(1) * BLOCK_S):
        i = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
        pos = start + i
        ok = (i < Sn) & (pos >= 0) & (pos < capacity)
        if PAGED:
            blk = tl.load(BlockTable + b * sbt0 + (pos // page) * sbt1, mask=ok, other=0).to(tl.int64)
            ok = ok & (blk >= 0) & (blk < num_blocks)
            slot = pos % page
            k_dst = blk * skc0 + slot * skc1 + h * skc2
            v_dst = blk * svc0 + slot * svc1 + h * svc2
        else:
            k_dst = b * skc0 + h * skc1 + pos * skc2
            v_dst = b * svc0 + h * svc1 + pos * svc2
        mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_src + i[:, None] * skn2, mask=mask)
        tl.store(KCache + k_dst[:, None] + d[None, :] * skc3, k, mask=mask)
        v = tl.load(v_src + i[:, None] * svn2, mask=mask)
        tl.store(VCache + v_dst[:, None] + d[None, :] * svc3, v, mask=mask)
