"""The warp-specialised dQ pass over the forward's K/V loader (conventions and scope:
common.py)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .common import (
    _lse_log2,
    MASKED_TANH,
    WG_ROWS,
    _alibi_split,
    _bias_ring,
    _bias_tile,
    _causal,
    _kv_ring,
    _kv_tiles,
    _mask_tile,
    _program_row,
    _release_bias,
    _scale_in_place,
    _score_scales,
    _score_transform,
    _small_int_f32,
    _store_rows,
    _tile_origin,
    _wgmma_layout,
    _wgmma_operand,
)
from .forward import _ws_loader


@gluon.jit
def _dq_step(
    step,
    j,
    dq,
    WG: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BIAS_STAGES: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    ALIBI_SPLIT: gl.constexpr,
    MASK: gl.constexpr,
):
    """Key tile ``j`` of :func:`_ws_bwd_dq_consumer`'s loop (``step``: its loop-invariant values):
    dQ += dS_j K_j; MASK: the tile may cross the band (:func:`_mask_tile`)."""
    (
        q_buf,
        do_buf,
        k_bufs,
        v_bufs,
        bars,
        bias,
        rows,
        rows_f,
        q_start,
        first,
        n_full,
        lse2,
        delta,
        cr,
        ckj,
        origin,
        scale,
        to_nat,
        alibi_coef,
        softcap_in,
    ) = step
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    BLOCK_M: gl.constexpr = q_buf.shape[0]
    HEAD_D: gl.constexpr = q_buf.shape[1]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    STAGES: gl.constexpr = k_bufs.shape[0]
    dtype: gl.constexpr = q_buf.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    op_layout: gl.constexpr = _wgmma_operand(HEAD_D)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = j % STAGES
    ph = (j // STAGES) & 1
    mbarrier.wait(k_ready.index(s), ph)
    k_buf = k_bufs.index(s)
    s_tok = warpgroup_mma(q_buf, k_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(s), ph)
    v_buf = v_bufs.index(s)
    dp_tok = warpgroup_mma(do_buf, v_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if HAS_BIAS:
        b = _bias_tile(bias, j, WG, BLOCK_M, BIAS_STAGES, s_layout)
    sc = warpgroup_mma_wait(1, deps=[s_tok])
    cols_f = 0.0
    if HAS_ALIBI and not ALIBI_SPLIT:
        cols_f = _small_int_f32((first + j) * BLOCK_N - q_start + gl.arange(0, BLOCK_N, col_s))[None, :]
    sc, tanh_t = _score_transform(
        sc,
        rows_f[:, None],
        cols_f,
        softcap_in,
        to_nat,
        alibi_coef,
        HAS_BIAS,
        SOFTCAP,
        HAS_ALIBI and not ALIBI_SPLIT,
        False,
    )
    lse_j = lse2
    if ALIBI_SPLIT:
        sc, roff = _alibi_split(sc, cr, ckj, (first + j) * BLOCK_N - origin, alibi_coef, BLOCK_M, BLOCK_N)
        lse_j = lse2 - roff * scale
    if HAS_BIAS:
        sc = sc + b
        _release_bias(bias, j, BIAS_STAGES)
    # a softcap alone: the scores are the tanh tile, masked to MASKED_TANH (one tile through the branch)
    TANH_IS_SCORE: gl.constexpr = SOFTCAP and not (HAS_BIAS or HAS_ALIBI)
    if MASK:
        FILL: gl.constexpr = MASKED_TANH if TANH_IS_SCORE else float("-inf")
        sc = _mask_tile(sc, rows, q_start, j, first, n_full, col_s, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, FILL)
    if TANH_IS_SCORE:
        tanh_t = sc
    p = gl.exp2(sc * scale - lse_j[:, None])
    # d score / d(q.k scaled): 1 - tanh^2; a softcap alone folds it into P before the dP wait (dkdv.py's
    # order: tanh kept beside P, dP and dQ spilled 720 B in causal calls, E106); with ALiBi or a bias
    # (tanh not the score) the fold spilled more (564 -> 692 B causal), so dS takes it after the wait
    if TANH_IS_SCORE:
        p = p * (1.0 - tanh_t * tanh_t)
    dp, _, _ = warpgroup_mma_wait(0, deps=[dp_tok, do_buf, v_buf])
    mbarrier.arrive(v_empty.index(s), count=1)
    ds = p * (dp - delta[:, None])
    if SOFTCAP and not TANH_IS_SCORE:
        ds = ds * (1.0 - tanh_t * tanh_t)
    ds_op = gl.convert_layout(ds.to(dtype), op_layout)
    dq_tok = warpgroup_mma(ds_op, k_buf, dq, is_async=True)
    dq, _, _ = warpgroup_mma_wait(0, deps=[dq_tok, ds_op, k_buf])
    mbarrier.arrive(k_empty.index(s), count=1)
    return dq


@gluon.jit
def _ws_bwd_dq_consumer(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dq_desc,
    lse_ptr,
    delta_ptr,
    q_bufs,
    do_bufs,
    k_bufs,
    v_bufs,
    bars,
    bias,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    n_m_blocks,
    scores,
    seq_rows,
    WG: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    DO_ROWS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    BIAS_STAGES: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
):
    # the forward's consumer with dP = dO V^T and dQ += dS K in place of the output products
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_D)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    pid_m = n_m_blocks - 1 - gl.program_id(0)
    pid_bh = _program_row(num_heads, BATCH_MINOR)
    q_start = pid_m * 2 * BLOCK_M + WG * BLOCK_M
    # a block's rows of longer tensors: their sequences seq_rows apart (launch.rows_descriptor)
    q_row, q_col = _tile_origin(pid_bh, 1, num_heads, seq_rows[0], Q_ROWS, HEAD_D)
    do_row, do_col = _tile_origin(pid_bh, 1, num_heads, seq_rows[1], DO_ROWS, HEAD_D)
    q_buf = q_bufs.index(WG)
    do_buf = do_bufs.index(WG)
    mbarrier.expect(q_bar.index(WG), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + q_start, q_col], q_bar.index(WG), q_buf)
    tma.async_copy_global_to_shared(do_desc, [do_row + q_start, do_col], q_bar.index(WG), do_buf)

    rows = q_start + gl.arange(0, BLOCK_M, row_s)
    lse2 = _lse_log2(gl.load(lse_ptr + pid_bh * seq_q + rows), HAS_BIAS)
    delta = gl.load(delta_ptr + pid_bh * seq_q + rows)
    # issue 36's transforms (common._score_transform), distances from this warpgroup's first row
    softcap_in, softcap, alibi_ptr, alibi_sb, alibi_sh, alibi_off = scores
    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = gl.load(alibi_ptr + (pid_bh // num_heads) * alibi_sb + (pid_bh % num_heads) * alibi_sh)
    scale, to_nat, alibi_coef = _score_scales(qk_scale, softcap, alibi_slope, HAS_BIAS, SOFTCAP)
    # ALiBi alone as the forward's (common._alibi_split): r = i + off - origin in [0, BLOCK_M), the row
    # part in the logsumexp, one FFMA a score; with a softcap the distances stay in _score_transform
    # (the split's 32 key registers beside tanh spilled 1020 B at d128, E87)
    ALIBI_SPLIT: gl.constexpr = HAS_ALIBI and not SOFTCAP
    origin = q_start + alibi_off
    rows_f = _small_int_f32(rows + alibi_off - q_start)
    cr = 0.0
    ckj = 0.0
    if ALIBI_SPLIT:
        cr = alibi_coef * (rows - q_start).to(gl.float32)
        ckj = alibi_coef * gl.arange(0, BLOCK_N, col_s).to(gl.float32)
    dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    first, n_tiles, n_full = _kv_tiles(pid_m, seq_k, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, 2)
    mbarrier.wait(q_bar.index(WG), 0)
    # the tanh's argument scale folded into this warpgroup's Q tile once (it leaves through q_buf, dQ = dS K
    # reads no Q): one FMUL a score fewer (E152, bfloat16 as the forward's E150)
    if SOFTCAP and dtype == gl.bfloat16:
        _scale_in_place(q_buf, softcap_in)
        softcap_in = 1.0
    step_args = (
        q_buf,
        do_buf,
        k_bufs,
        v_bufs,
        bars,
        bias,
        rows,
        rows_f,
        q_start,
        first,
        n_full,
        lse2,
        delta,
        cr,
        ckj,
        origin,
        scale,
        to_nat,
        alibi_coef,
        softcap_in,
    )
    # the key tiles no row masks, in a loop without the mask's code (the forward's split: 390 instead of
    # 558 instructions a step, E97/E98); not with a bias or ALiBi, where the second loop's registers
    # spilled 130-800 B; a softcap alone since its masked tile is the tanh tile (E106: 0 B)
    SPLIT: gl.constexpr = _causal(WINDOW_LEFT, WINDOW_RIGHT) and not (HAS_BIAS or HAS_ALIBI)
    n_plain = 0
    if SPLIT:
        n_plain = gl.minimum(n_full, n_tiles)
        for j in range(n_plain):
            dq = _dq_step(
                step_args,
                j,
                dq,
                WG,
                WINDOW_LEFT,
                WINDOW_RIGHT,
                HAS_BIAS,
                BIAS_STAGES,
                SOFTCAP,
                HAS_ALIBI,
                ALIBI_SPLIT,
                False,
            )
    for j in range(n_plain, n_tiles):
        dq = _dq_step(
            step_args,
            j,
            dq,
            WG,
            WINDOW_LEFT,
            WINDOW_RIGHT,
            HAS_BIAS,
            BIAS_STAGES,
            SOFTCAP,
            HAS_ALIBI,
            ALIBI_SPLIT,
            True,
        )
    # dQ leaves through this warpgroup's Q buffer
    _store_rows(q_buf, (dq * sm_scale).to(dtype), dq_desc, pid_bh * seq_q + q_start)


@gluon.jit
def _attn_bwd_dq_ws(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dq_desc,
    bias_desc,
    lse_ptr,
    delta_ptr,
    q_seq_rows,
    do_seq_rows,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    n_m_blocks,
    bias_batch_rows,
    bias_head_rows,
    softcap_in,
    softcap,
    alibi_ptr,
    alibi_sb,
    alibi_sh,
    alibi_off,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    DO_ROWS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    BIAS_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    SOFTCAP: gl.constexpr = False,
    HAS_ALIBI: gl.constexpr = False,
):
    """Grid (Sq / 128, B * Hq); one program: dQ of 128 query rows of one (b, h), the K/V ring, the
    bias ring and their loader shared with the forward (_ws_loader).  dQ: (B * Hq * Sq, D) rows;
    Q, dO: rows of their layouts, a sequence's first rows ``q_seq_rows`` / ``do_seq_rows`` apart
    (Sq, or more for a block's rows of longer tensors).
    SOFTCAP / HAS_ALIBI: the forward's score transforms (its arguments: _attn_fwd_ws's)."""
    BLOCK_M: gl.constexpr = WG_ROWS
    NUM_WG: gl.constexpr = 2
    q_bufs, k_bufs, v_bufs, bars = _kv_ring(q_desc, k_desc, v_desc, STAGES, NUM_WG)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    if HAS_BIAS:
        bias = _bias_ring(bias_desc, bias_batch_rows, bias_head_rows, BIAS_STAGES, NUM_WG)
    else:
        bias = bars  # not read: a stand-in of a type the partitions accept
    scores = (softcap_in, softcap, alibi_ptr, alibi_sb, alibi_sh, alibi_off)
    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    NO_LSE: gl.constexpr = False  # also: no KV-cache lengths
    # the forward's loader (its runtime arguments as one tuple): it reads only the K/V descriptors,
    # the rings, the barriers and the sizes
    loader_args = (
        q_desc,
        k_desc,
        v_desc,
        dq_desc,
        lse_ptr,
        q_bufs,
        k_bufs,
        v_bufs,
        bars,
        bias,
        qk_scale,
        seq_q,
        seq_k,
        num_heads,
        group,
        n_m_blocks,
        0,  # the forward's lpt_rows: the grid's own order (gluon.common._query_block)
        lse_ptr,  # no KV-cache lengths: not read
        0,
        lse_ptr,  # the forward's sinks, softcap and ALiBi arguments: not read by the loader
        0.0,
        0.0,
        lse_ptr,
        0,
        0,
        0,
    )
    gl.warp_specialize(
        [
            (
                _ws_bwd_dq_consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dq_desc,
                    lse_ptr,
                    delta_ptr,
                    q_bufs,
                    do_bufs,
                    k_bufs,
                    v_bufs,
                    bars,
                    bias,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    n_m_blocks,
                    scores,
                    (q_seq_rows, do_seq_rows),
                    WG0,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    BIAS_STAGES,
                    SOFTCAP,
                    HAS_ALIBI,
                ),
            ),
            (
                _ws_bwd_dq_consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dq_desc,
                    lse_ptr,
                    delta_ptr,
                    q_bufs,
                    do_bufs,
                    k_bufs,
                    v_bufs,
                    bars,
                    bias,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    n_m_blocks,
                    scores,
                    (q_seq_rows, do_seq_rows),
                    WG1,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    BIAS_STAGES,
                    SOFTCAP,
                    HAS_ALIBI,
                ),
            ),
            (
                _ws_loader,
                (
                    loader_args,
                    WG0,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    KV_ROWS,
                    NO_LSE,
                    HAS_BIAS,
                    BATCH_MINOR,
                    BIAS_STAGES,
                    NO_LSE,  # KV_LENS
                    NO_LSE,  # SOFTCAP
                    NO_LSE,  # HAS_SINKS
                    NO_LSE,  # HAS_ALIBI
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )
