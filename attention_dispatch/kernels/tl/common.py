"""Tile helpers shared by the tl kernels (band mask, bias tile, dropout keep-mask, tile loads),
so that forward, backward and the dropout-mask kernel see bit-identical masks.

Conventions (all kernels):
  * one program owns a tile of one (batch b, query head h); ``pid_bh = b * H + h`` is the
    GLOBAL flattened index (``bh_start`` is added for chunked launches); the launch index
    runs over (b, h) with h fastest, or b fastest (BATCH_MINOR, :func:`_batch_head`);
  * varlen: ``CuQ/CuK`` hold the cumulative lengths; the batch stride is then 0 and the
    sequence's first row is added to the row index, so one code path serves both layouts;
  * scores live in the log2 domain: ``s2 = s * log2(e)``, ``qk_scale = scale * log2(e)``;
  * EXACT_P (float32 inputs, issue 38): the backward recomputes the forward's log2 scores bit
    for bit, so that P = exp2((s - hi) - lo) is exactly 1 / l where one key dominates a row at
    large scores: the products through :func:`_qk`, the scale as a multiply rounded on its own
    (score._mul_rn: a contraction into the max's subtraction would leave the max's exponent
    at its rounding error instead of 0, in one pass and maybe not the other); 1 the GPU, 2 the
    interpreter;
  * a key j is allowed for query i when ``(HAS_WL: j >= i + off - wl)`` and
    ``(HAS_WR: j <= i + off + wr)``, ``off = Sk - Sq`` (per sequence) if ALIGN_BR else 0;
  * dropout: lane ``j % 4`` of the Philox4x32-7 draw at counter
    ``(pid_bh * max_sq + i) * ceil(max_sk / 4) + j // 4`` (:func:`_dropout_keep`), keep when
    ``u >= p``; i, j and the lengths are those of the whole call the stream places this one
    in (:func:`_load_stream`: a block of context parallelism), by default the call itself.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Rounds of the dropout's Philox4x32 draw: 7, flash-attn's and the fewest that pass BigCrush;
# tl.randint4x's default 10 made dropout calls ~12% slower (E84).
PHILOX_ROUNDS = tl.constexpr(7)


@triton.jit
def _dot(a, b, DOT_UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr):
    # DOT_UPCAST: the CPU interpreter's bf16 tl.dot is broken (garbage), so half operands
    # are upcast there (exactly) to fp32.  DOT_IEEE: fp32 inputs must not use TF32.
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif DOT_IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _qk(a, b, DOT_UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr, EXACT_P: tl.constexpr):
    """Raw score products a b^T of rows a (R, D) and b (C, D): (R, C).  The backward recomputes
    the forward's scores with the operands swapped and other tiles; float32 needs the same bits
    (issue 38).  The GPU's ieee tl.dot is one FMA chain over D, whatever the orientation; the
    interpreter's np.matmul is not (27-40% of the scores differ), so with EXACT_P == 2 the
    scores are a sum over D of the rounded products, the same bits in every orientation and tile."""
    if EXACT_P == 2:
        return tl.sum(a[:, None, :].to(tl.float32) * b[None, :, :].to(tl.float32), 2)  # float32: no-op casts
    else:
        return _dot(a, tl.trans(b), DOT_UPCAST, DOT_IEEE)


@triton.jit
def _lowp(x, dtype, ROUND_P: tl.constexpr):
    # Probabilities / dS enter the second matmuls in the input dtype on the GPU (as in
    # FlashAttention).  Without ROUND_P (CPU interpreter by default) they stay fp32.
    if ROUND_P:
        return x.to(dtype)
    else:
        return x


@triton.jit
def _load_rows(ptrs, row_mask, col_mask, EVEN_COL: tl.constexpr):
    if EVEN_COL:
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _band_mask(offs_m, offs_n, sk, off, wl, wr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, TRANS: tl.constexpr):
    """Allowed-by-band (and j < sk) tile: (BM, BN), or (BN, BM) when TRANS."""
    if TRANS:
        i = offs_m[None, :]
        j = offs_n[:, None]
    else:
        i = offs_m[:, None]
        j = offs_n[None, :]
    mask = (j < sk) & (i >= 0)
    if HAS_WL:
        mask = mask & (j >= i + off - wl)
    if HAS_WR:
        mask = mask & (j <= i + off + wr)
    return mask


@triton.jit
def _bias_ptrs(bias_base, offs_m, offs_n, sbi, sbj, TRANS: tl.constexpr):
    rows = offs_m.to(tl.int64) * sbi
    cols = offs_n.to(tl.int64) * sbj
    if TRANS:
        return bias_base + rows[None, :] + cols[:, None]
    else:
        return bias_base + rows[:, None] + cols[None, :]


@triton.jit
def _tile_mask(offs_m, offs_n, sq, sk, TRANS: tl.constexpr):
    if TRANS:
        return (offs_m[None, :] < sq) & (offs_n[:, None] < sk)
    else:
        return (offs_m[:, None] < sq) & (offs_n[None, :] < sk)


@triton.jit
def _apply_bias(
    s,
    bias_src,
    row0,
    col0,
    offs_m,
    offs_n,
    sq,
    sk,
    sbi,
    sbj,
    BIAS_KIND: tl.constexpr,
    BIAS_DESC: tl.constexpr,
    TRANS: tl.constexpr,
):
    """BIAS_KIND 1: add float bias (upcast, log2 domain); 2: bool mask (nonzero = attend).
    ``bias_src``: the (sequence, head)'s bias base pointer, or with BIAS_DESC its TMA
    descriptor (:func:`_bias_desc`; the tile at rows row0.., keys col0.. in one copy, no
    per-element addresses; out-of-range elements read as 0 like the masked loads)."""
    if BIAS_KIND != 0:
        if BIAS_DESC:
            bt = bias_src.load([row0, col0])
            if TRANS:
                bt = tl.trans(bt)
        else:
            bt = tl.load(
                _bias_ptrs(bias_src, offs_m, offs_n, sbi, sbj, TRANS),
                mask=_tile_mask(offs_m, offs_n, sq, sk, TRANS),
                other=0,
            )
        if BIAS_KIND == 1:
            s = s + bt.to(tl.float32) * 1.4426950408889634
        else:
            s = tl.where(bt != 0, s, float("-inf"))
    return s


@triton.jit
def _bias_desc(bias_base, sq, sk, sbi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BIAS_DESC: tl.constexpr):
    """With BIAS_DESC: a TMA descriptor over the sq x sk bias of one (sequence, head) (rows
    16-byte aligned, checked by the launcher), read in (BLOCK_M, BLOCK_N) tiles."""
    if BIAS_DESC:
        return tl.make_tensor_descriptor(
            bias_base, shape=[tl.maximum(sq, 1), tl.maximum(sk, 1)], strides=[sbi, 1], block_shape=[BLOCK_M, BLOCK_N]
        )
    else:
        return bias_base


@triton.jit
def _batch_head(pid, H, NB, BATCH_MINOR: tl.constexpr):
    """(b, h) of launch index ``pid`` over NB batches x H heads: h fastest, or b fastest with
    BATCH_MINOR, chosen when the bias is shared by the batches: the programs that read
    the same bias tiles then run side by side and the tiles come from L2 instead of being
    read from HBM once per batch."""
    if BATCH_MINOR:
        return pid % NB, pid // NB
    else:
        return pid // H, pid % H


@triton.jit
def _load_stream(Seed, seqlen_q, seqlen_k):
    """The dropout stream at ``Seed`` (kernels/dropout.py): int64 [seed, first row, first key (a
    multiple of 4), the whole call's Sq, Sk (0: this call's own)] -> (seed, row0, counter
    column of key 0, whole Sq, counters per row).  A plain call's stream is [seed, 0, 0, 0, 0]."""
    seed = tl.load(Seed)
    row0 = tl.load(Seed + 1)
    col4 = tl.load(Seed + 2) // 4
    whole_q = tl.load(Seed + 3)
    whole_k = tl.load(Seed + 4)
    whole_q = tl.where(whole_q > 0, whole_q, seqlen_q)
    whole_k = tl.where(whole_k > 0, whole_k, seqlen_k)
    return seed, row0, col4, whole_q, (whole_k + 3) // 4


@triton.jit
def _rng_rows(pid_bh64, offs_m, row0, col4, whole_q, per_row):
    """First Philox counter of each query row: rows of ceil(Sk / 4) counters of the whole call
    (:func:`_load_stream`), one counter per 4 consecutive keys (global coordinates: the same in
    every kernel and every chunk)."""
    return (pid_bh64 * whole_q + row0 + offs_m) * per_row + col4


@triton.jit
def _interleave(a, b):
    """(R, W), (R, W) -> (R, 2W) with columns a0 b0 a1 b1 ..."""
    return tl.reshape(tl.join(a, b), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _keep_lane(r, dropout_p):
    """One lane of Philox draws -> keep (int8, interleavable): uniform in [0, 1) >= p."""
    return (tl.random.uint_to_uniform_float(r) >= dropout_p).to(tl.int8)


@triton.jit
def _dropout_keep(seed, rng_rows, start_n, dropout_p, BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """Keep mask of keys start_n .. start_n + BLOCK_N - 1 (start_n a multiple of 4) for the
    query rows of ``rng_rows`` (:func:`_rng_rows`): (BM, BLOCK_N), or (BLOCK_N, BM) when
    TRANS.  Key j of a row takes lane j % 4 of the Philox4x32 draw at counter
    row + j // 4: one draw per four keys (the draw, PHILOX_ROUNDS rounds, dominates the cost)."""
    cols = (start_n // 4 + tl.arange(0, BLOCK_N // 4)).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, rng_rows[:, None] + cols[None, :], PHILOX_ROUNDS)
    keep = (
        _interleave(
            _interleave(_keep_lane(r0, dropout_p), _keep_lane(r2, dropout_p)),
            _interleave(_keep_lane(r1, dropout_p), _keep_lane(r3, dropout_p)),
        )
        != 0
    )
    if TRANS:
        return tl.trans(keep)
    else:
        return keep


@triton.jit
def _tile_desc(
    ptr, base, rows, stride, HEAD_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, DESC: tl.constexpr
):
    """With DESC: a TMA descriptor over the ``rows`` x HEAD_D matrix of one (sequence, head)
    at ``base`` (row stride ``stride``), read in (BLOCK_R, BLOCK_D) tiles.  Without: ``ptr``
    unchanged (the pointer path of :func:`_load_tile` reads from ``base``)."""
    if DESC:
        return tl.make_tensor_descriptor(
            base, shape=[tl.maximum(rows, 1), HEAD_D], strides=[stride, 1], block_shape=[BLOCK_R, BLOCK_D]
        )
    else:
        return ptr


@triton.jit
def _load_tile(
    desc_or_ptr,
    base,
    row0,
    offs_rows,
    stride,
    rows_ok,
    offs_d,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DESC: tl.constexpr,
):
    """A tile of rows ``offs_rows`` (= row0 + arange) of one sequence's Q/K/V/dO: a TMA
    tensor-descriptor load (rows past the sequence and columns past HEAD_D read as zeros)
    or masked pointer loads."""
    if DESC:
        return desc_or_ptr.load([row0, 0])
    else:
        return _load_rows(
            base + offs_rows.to(tl.int64)[:, None] * stride + offs_d[None, :],
            rows_ok,
            offs_d < HEAD_D,
            BLOCK_D == HEAD_D,
        )
