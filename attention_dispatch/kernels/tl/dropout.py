"""The dropout keep-mask kernel: the mask the attention kernels apply, written out (uint8)."""

import triton
import triton.language as tl

from .common import _dropout_keep, _load_stream, _rng_rows


@triton.jit
def _dropout_mask_kernel(
    Out, Seed, dropout_p, so_bh, so_i, H, seqlen_q, seqlen_k, bh_start, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Keep-mask (uint8) of the element (b, h, i, j): the same stream (Seed) and offsets as the
    attention kernels."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1) + bh_start
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    seed, row0, col4, whole_q, per_row = _load_stream(Seed, seqlen_q, seqlen_k)
    rng_rows = _rng_rows(pid_bh.to(tl.int64), offs_m, row0, col4, whole_q, per_row)
    base = Out + pid_bh.to(tl.int64) * so_bh
    for start_n in range(0, seqlen_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = _dropout_keep(seed, rng_rows, start_n, dropout_p, BLOCK_N, False)
        ptrs = base + offs_m.to(tl.int64)[:, None] * so_i + offs_n[None, :]
        tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))
