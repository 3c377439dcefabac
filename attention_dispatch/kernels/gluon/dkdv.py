"""The warp-specialised dK/dV pass (optionally with dQ fused in, FUSE_DQ): a Q/dO loader
warp and two consumer warpgroups of 64 keys each (conventions and scope: common.py)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import (
    _lse_log2,
    LOG2E,
    MASKED_TANH,
    WG_ROWS,
    _band_edge,
    _bias_row,
    _causal,
    _masked,
    _program_row,
    _q_tiles,
    _scale_in_place,
    _score_scales,
    _score_transform,
    _small_int_f32,
    _tile_origin,
    _tma_reduce_add,
    _wgmma_layout,
    _wgmma_operand,
    _window,
)


@gluon.jit
def _q_tile(t, m_lo, n_m, pid_n, ROTATE: gl.constexpr):
    """The query tile of a dK/dV program's step ``t`` (of ``n_m`` tiles from ``m_lo``).  ROTATE
    (the fused dQ): each program starts at its own tile and wraps, so that the programs running
    together add their dQ partials into different rows (16k: 11.2 -> 10.7 ms, E54)."""
    if ROTATE:
        return m_lo + (t + pid_n * 2) % n_m
    return m_lo + t % n_m


@gluon.jit
def _ws_bwd_loader(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dk_desc,
    dv_desc,
    lse_ptr,
    delta_ptr,
    k_bufs,
    v_bufs,
    q_bufs,
    do_bufs,
    bars,
    bias,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    scores,
    seq_rows,
    WG: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    DO_ROWS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    FUSE_DQ: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    ALIBI_ROWS: gl.constexpr,
):
    kv_bar, q_ready, q_empty, lse_bufs, delta_bufs = bars
    HEAD_D: gl.constexpr = k_desc.block_type.shape[1]
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    pid_n = gl.program_id(0)
    n_kv = num_heads // group
    pid_bkv = _program_row(n_kv, BATCH_MINOR)  # b * Hkv + hk
    b = pid_bkv // n_kv
    hk = pid_bkv % n_kv
    n0 = pid_n * 2 * BLOCK_N
    kv_row, kv_col = _tile_origin(b * num_heads + hk * group, group, num_heads, seq_k, KV_ROWS, HEAD_D)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [kv_row + n0 + w * BLOCK_N, kv_col], kv_bar, k_bufs.index(w))
        tma.async_copy_global_to_shared(v_desc, [kv_row + n0 + w * BLOCK_N, kv_col], kv_bar, v_bufs.index(w))
    m_lo, n_m = _q_tiles(n0, seq_q, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, 2 * BLOCK_N)
    for t in range(group * n_m):
        g = t // n_m
        m = _q_tile(t, m_lo, n_m, pid_n, FUSE_DQ) * BLOCK_M
        h = b * num_heads + hk * group + g
        # a block's rows of longer tensors: their sequences seq_rows apart (launch.rows_descriptor)
        q_row, q_col = _tile_origin(h, 1, num_heads, seq_rows[0], Q_ROWS, HEAD_D)
        do_row, do_col = _tile_origin(h, 1, num_heads, seq_rows[1], DO_ROWS, HEAD_D)
        s = t % STAGES
        mbarrier.wait(q_empty.index(s), ((t // STAGES) & 1) ^ 1)
        if HAS_BIAS:  # the (query tile, 128 keys) bias tile rides in the (Q, dO) slot
            bias_desc, bias_bufs = bias[0], bias[1]
            mbarrier.expect(
                q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes + bias_desc.block_type.nbytes
            )
            tma.async_copy_global_to_shared(
                bias_desc, [_bias_row(h, num_heads, bias[4], bias[5]) + m, n0], q_ready.index(s), bias_bufs.index(s)
            )
        else:
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + m, q_col], q_ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [do_row + m, do_col], q_ready.index(s), do_bufs.index(s))
        # the tile's logsumexp and delta rows: the slot's second arrival (the consumers read
        # them from shared memory instead of waiting on global loads inside each step)
        offs = h * seq_q + m + gl.arange(0, BLOCK_M, row_layout)
        lse2 = _lse_log2(gl.load(lse_ptr + offs), HAS_BIAS)
        if ALIBI_ROWS:  # lse2 + c r, lse2 - c r and c r: the consumers' ALiBi (_ws_bwd_consumer)
            alibi_ptr, alibi_sb, alibi_sh, alibi_off = scores[2], scores[3], scores[4], scores[5]
            c = gl.load(alibi_ptr + b * alibi_sb + (hk * group + g) * alibi_sh) * LOG2E
            r = c * (m + alibi_off - n0 + gl.arange(0, BLOCK_M, row_layout)).to(gl.float32)
            lse_bufs.index(STAGES + s).store(lse2 - r)
            lse_bufs.index(2 * STAGES + s).store(r)
            lse2 = lse2 + r
        lse_bufs.index(s).store(lse2)
        delta_bufs.index(s).store(gl.load(delta_ptr + offs))
        mbarrier.arrive(q_ready.index(s), count=1)


@gluon.jit
def _ws_bwd_consumer(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dk_desc,
    dv_desc,
    lse_ptr,
    delta_ptr,
    k_bufs,
    v_bufs,
    q_bufs,
    do_bufs,
    bars,
    bias,
    dq_fused,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    scores,
    WG: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    DO_ROWS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    FUSE_DQ: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
):
    # this warpgroup: BLOCK_N (64) keys; scores transposed (keys x queries) as the tl kernel.
    # FUSE_DQ: dQ too, FA3's way: both warpgroups put their dS^T half in shared memory, then
    # each multiplies the whole (queries x 128 keys) dS by its half of K's columns and adds
    # that (64, HEAD_D / 2) fp32 partial into dQ by TMA reduce-add from a shared slot
    # (per-thread atomics, here or from a reducer partition, cost more, E54)
    kv_bar, q_ready, q_empty, lse_bufs, delta_bufs = bars
    HEAD_D: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    a_layout: gl.constexpr = _wgmma_layout(HEAD_D)
    op_layout: gl.constexpr = _wgmma_operand(HEAD_D)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    pid_n = gl.program_id(0)
    n_kv = num_heads // group
    pid_bkv = _program_row(n_kv, BATCH_MINOR)
    n0 = pid_n * 2 * BLOCK_N
    k_buf = k_bufs.index(WG)
    v_buf = v_bufs.index(WG)
    keys = n0 + WG * BLOCK_N + gl.arange(0, BLOCK_N, row_s)
    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, a_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, a_layout)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    m_lo, n_m = _q_tiles(n0, seq_q, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, 2 * BLOCK_N)
    # issue 36's transforms (common._score_transform): ``scores`` = (softcap_in, softcap, slopes,
    # their batch and head strides, ALiBi's diagonal offset).  ALiBi alone (ALIBI_ROWS), in log2
    # units c = slope log2(e), r = i + off - n0, k = j - n0 (n0 the program's first key): a tile
    # left of the diagonal (r >= k) has -c |r - k| = -c r + c k, one right of it c r - c k, so the
    # loader folds -+c r into the slot's lse2 and the step adds +-c k (one FADD a score, no per-score
    # distance); a tile crossing the diagonal adds 2 min(c r - c k, 0) (E87).  With a softcap (whose
    # tanh already fills the registers that needs) the distances go through _score_transform.
    softcap_in, softcap, alibi_ptr, alibi_sb, alibi_sh, alibi_off = scores
    ALIBI_ROWS: gl.constexpr = HAS_ALIBI and not SOFTCAP and HEAD_D >= 128  # see _attn_bwd_dkdv_ws
    scale, to_nat, _coef = _score_scales(qk_scale, softcap, 0.0, HAS_BIAS, SOFTCAP)
    # a softcap alone: the scores are the tanh tile, masked to MASKED_TANH instead of -inf so that one
    # tile (not the scores and the tanh beside them) is live through the mask's branch (E106)
    TANH_IS_SCORE: gl.constexpr = SOFTCAP and not (HAS_BIAS or HAS_ALIBI)
    FILL: gl.constexpr = MASKED_TANH if TANH_IS_SCORE else float("-inf")
    key0 = n0 + WG * BLOCK_N
    keys_rel = (keys - n0).to(gl.float32)
    keys_f = _small_int_f32(keys - key0)
    if FUSE_DQ:
        dq_desc, ds_bufs, ds_ready, kv_done, dq_bufs, dq_head_rows = dq_fused
        # each warpgroup's share of the tile's dQ: with 64-row tiles the 64 rows x half the columns,
        # with 128-row tiles its 64-row half x every column (E81)
        DQ_SPLIT_ROWS: gl.constexpr = BLOCK_M == 2 * WG_ROWS
        DQ_COLS: gl.constexpr = HEAD_D if DQ_SPLIT_ROWS else HEAD_D // 2
        gl.static_assert(dq_desc.block_type.shape[0] == WG_ROWS and dq_desc.block_type.shape[1] == DQ_COLS)
        gl.static_assert(BLOCK_N == BLOCK_M or DQ_SPLIT_ROWS)
        DQ_STAGES: gl.constexpr = dq_bufs.shape[0] // 2
        n_kv_heads = num_heads // group
        dq_head0 = (pid_bkv // n_kv_heads) * num_heads + (pid_bkv % n_kv_heads) * group
        # the dQ product's (64 queries x DQ_COLS) accumulator: zero_s where it has that shape (d128)
        if DQ_COLS == BLOCK_M and not DQ_SPLIT_ROWS:
            zero_dq = zero_s
        else:
            zero_dq = gl.zeros([WG_ROWS, DQ_COLS], gl.float32, _wgmma_layout(DQ_COLS))
    mbarrier.wait(kv_bar, 0)
    # the tanh's argument scale folded into this warpgroup's K tile once, before any product reads it (the other
    # warpgroup's dQ products read it after this one's first dS): one FMUL a score fewer; dQ = dS (K * softcap_in)
    # takes 1 / softcap_in back in its one scale (E152, bfloat16 as the forward's E150)
    dq_scale = sm_scale
    if SOFTCAP and dtype == gl.bfloat16:
        _scale_in_place(k_buf, softcap_in)
        dq_scale = sm_scale / softcap_in
        softcap_in = 1.0
    for t in range(group * n_m):
        mi = _q_tile(t, m_lo, n_m, pid_n, FUSE_DQ)
        s = t % STAGES
        mbarrier.wait(q_ready.index(s), (t // STAGES) & 1)
        q_buf = q_bufs.index(s)
        do_buf = do_bufs.index(s)
        st_tok = warpgroup_mma(k_buf, q_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_buf, do_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        offs_m = mi * BLOCK_M + gl.arange(0, BLOCK_M, col_s)
        lse_slot = s
        if HAS_ALIBI:  # the slope of query head g of the group, in log2 units
            h = (pid_bkv % n_kv) * group + t // n_m
            c = gl.load(alibi_ptr + (pid_bkv // n_kv) * alibi_sb + h * alibi_sh) * LOG2E
        if ALIBI_ROWS:  # the tile is right of the diagonal (the lse2 - c r slot), left of it, or crosses it
            r_lo = mi * BLOCK_M + alibi_off - n0
            right = r_lo + BLOCK_M - 1 <= key0 - n0
            crossing = (r_lo < key0 + BLOCK_N - 1 - n0) & (not right)
            if right:
                lse_slot = s + STAGES
        # the rows' logsumexp and delta (per query column: BLOCK_M / 4 registers each): read before the
        # waits with 64-row tiles (late ran 2-4% slower at d128), where used with 128 (early spilled, E79)
        EARLY_ROWS: gl.constexpr = BLOCK_M == WG_ROWS
        # a softcap's tanh or ALiBi's crossing tile takes its registers (E87)
        EARLY_DELTA: gl.constexpr = EARLY_ROWS and not SOFTCAP and not HAS_ALIBI
        if EARLY_ROWS:
            lse2 = lse_bufs.index(lse_slot).load(col_s)
        if EARLY_DELTA:
            delta = delta_bufs.index(s).load(col_s)
        st = warpgroup_mma_wait(1, deps=[st_tok])
        st, tanh_t = _score_transform(
            st,
            _small_int_f32(offs_m + alibi_off - key0)[None, :],
            keys_f[:, None],
            softcap_in,
            to_nat,
            c / scale if HAS_ALIBI else 0.0,
            HAS_BIAS,
            SOFTCAP,
            HAS_ALIBI and not ALIBI_ROWS,
            False,
        )
        if HAS_BIAS:  # this warpgroup's keys of the slot's bias tile, transposed as the scores
            bt = bias[1].index(s).slice(WG * BLOCK_N, BLOCK_N, dim=1).permute((1, 0)).load(s_layout)
            st = st + bt.to(gl.float32)
        if _causal(WINDOW_LEFT, WINDOW_RIGHT):
            if mi * BLOCK_M < n0 + 2 * BLOCK_N:
                st = _masked(st, offs_m[None, :], keys[:, None], WINDOW_LEFT, WINDOW_RIGHT, FILL)
        elif _window(WINDOW_LEFT, WINDOW_RIGHT):
            if _band_edge(mi * BLOCK_M, n0 + WG * BLOCK_N, BLOCK_M, BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT):
                st = _masked(st, offs_m[None, :], keys[:, None], WINDOW_LEFT, WINDOW_RIGHT, FILL)
        if TANH_IS_SCORE:  # the masked tile is the tanh tile (common.MASKED_TANH)
            tanh_t = st
        if not EARLY_ROWS:
            lse2 = lse_bufs.index(lse_slot).load(col_s)
        if ALIBI_ROWS:
            ck = gl.where(right, -c, c) * keys_rel
            x = st * scale - lse2[None, :]
            if crossing:  # -c |r - k| = c k - c r + 2 min(c r - c k, 0)
                cr = lse_bufs.index(s + 2 * STAGES).load(col_s)
                x = x + 2.0 * gl.minimum(cr[None, :] - ck[:, None], 0.0)
            pt = gl.exp2(x + ck[:, None])
        else:
            pt = gl.exp2(st * scale - lse2[None, :])
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv_tok = warpgroup_mma(pt_op, do_buf, dv, is_async=True)
        if SOFTCAP:  # d score / d(q.k scaled): 1 - tanh^2, folded into P before the dP wait, where
            # tanh kept live beside P and dP spilled (392 B, issue 36)
            pt = pt * (1.0 - tanh_t * tanh_t)
        dpt, _ = warpgroup_mma_wait(1, deps=[dpt_tok, pt_op])
        if not EARLY_DELTA:
            delta = delta_bufs.index(s).load(col_s)
        dst = pt * (dpt - delta[None, :])
        dst = dst.to(dtype)
        if FUSE_DQ:  # this warpgroup's keys of dS^T, for both warpgroups' dQ products and its dK's
            ds_buf = ds_bufs.index(t % 2)
            ds_buf.slice(WG * BLOCK_N, BLOCK_N).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(t % 2), count=1)
            dk_tok = warpgroup_mma(ds_buf.slice(WG * BLOCK_N, BLOCK_N), q_buf, dk, is_async=True)
        else:
            dst_op = gl.convert_layout(dst, op_layout)
            dk_tok = warpgroup_mma(dst_op, q_buf, dk, is_async=True)
        if FUSE_DQ:
            # dQ[rows, cols] = dS (rows x 128 keys) K[keys, cols]: the program's two 64-key K tiles
            mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
            if DQ_SPLIT_ROWS:
                dq_row: gl.constexpr = WG * WG_ROWS
                dq_col: gl.constexpr = 0
                ds_lo = ds_buf.slice(0, BLOCK_N).slice(dq_row, WG_ROWS, dim=1)
                ds_hi = ds_buf.slice(BLOCK_N, BLOCK_N).slice(dq_row, WG_ROWS, dim=1)
                k_lo = k_bufs.index(0)
                k_hi = k_bufs.index(1)
            else:
                dq_row: gl.constexpr = 0
                dq_col: gl.constexpr = WG * DQ_COLS
                ds_lo = ds_buf.slice(0, BLOCK_N)
                ds_hi = ds_buf.slice(BLOCK_N, BLOCK_N)
                k_lo = k_bufs.index(0).slice(dq_col, DQ_COLS, dim=1)
                k_hi = k_bufs.index(1).slice(dq_col, DQ_COLS, dim=1)
            dq_tok = warpgroup_mma(ds_lo.permute((1, 0)), k_lo, zero_dq, use_acc=False, is_async=True)
            dq_tok = warpgroup_mma(ds_hi.permute((1, 0)), k_hi, dq_tok, is_async=True)
            dv, dk, dq, _, _, _ = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok, q_buf, do_buf, ds_buf])
            # the partial leaves through shared memory by TMA reduce-add (FA3's way); the slot's
            # previous reduce, DQ_STAGES steps ago, must have read it first
            tma.store_wait(DQ_STAGES - 1)
            gl.thread_barrier()
            dq_buf = dq_bufs.index((t % DQ_STAGES) * 2 + WG)
            dq_buf.store(dq * dq_scale)
            fence_async_shared()
            row0 = (dq_head0 + t // n_m) * dq_head_rows + mi * BLOCK_M + dq_row
            _tma_reduce_add(dq_desc, [row0, dq_col], dq_buf)
        else:
            dv, dk, _, _, _ = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dst_op, q_buf, do_buf])
        if HAS_BIAS:  # its bias tile was read through the generic proxy (see _release_bias)
            fence_async_shared()
        mbarrier.arrive(q_empty.index(s), count=1)
    if FUSE_DQ:  # the other warpgroup's last dQ products read this one's K tile
        mbarrier.arrive(kv_done, count=1)
        mbarrier.wait(kv_done, 0)
    # dK and dV leave through this warpgroup's K and V buffers
    k_buf.store((dk * sm_scale).to(dtype))
    v_buf.store(dv.to(dtype))
    fence_async_shared()
    out_row = pid_bkv * seq_k + n0 + WG * BLOCK_N
    tma.async_copy_shared_to_global(dk_desc, [out_row, 0], k_buf)
    tma.async_copy_shared_to_global(dv_desc, [out_row, 0], v_buf)
    tma.store_wait(0)


@gluon.jit
def _attn_bwd_dkdv_ws(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dk_desc,
    dv_desc,
    bias_desc,
    lse_ptr,
    delta_ptr,
    dq_desc,
    dq_head_rows,
    q_seq_rows,
    do_seq_rows,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
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
    FUSE_DQ: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    SOFTCAP: gl.constexpr = False,
    HAS_ALIBI: gl.constexpr = False,
):
    """Grid (Sk / 128, B * Hkv); one program: 128 keys of one (b, kv head) in two consumer
    warpgroups of 64, over the query tiles (``q_desc``'s rows: 64 or 128) of every query head of
    its group.
    Q, dO: rows of their layouts (Q_ROWS, DO_ROWS), a sequence's first rows ``q_seq_rows`` /
    ``do_seq_rows`` apart (Sq, or more for a block's rows of longer tensors).
    dK, dV: (B * Hkv * Sk, D) rows; lse, delta: (B, Hq, Sq) contiguous; ``bias_desc``
    (HAS_BIAS): (rows, Sk) bias matrix, tiles (query tile rows, 128); None without.  FUSE_DQ: dQ is added
    into ``dq_desc``, fp32 rows (head h of batch b from row (b * Hq + h) * ``dq_head_rows``: Sq,
    or more for a slice of a larger accumulator's rows), tiles (64, D / 2) with 64-row query
    tiles and (64, D) with 128; None without.  SOFTCAP / HAS_ALIBI: the forward's score
    transforms (its arguments: _attn_fwd_ws's), recomputed; dS times 1 - tanh^2 under a softcap."""
    BLOCK_N: gl.constexpr = WG_ROWS  # keys per consumer warpgroup
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]  # query rows per tile
    gl.static_assert(BLOCK_M == WG_ROWS or BLOCK_M == 2 * WG_ROWS)
    dtype: gl.constexpr = k_desc.dtype
    k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    # the (Q, dO) slot's rows of logsumexp (log2 domain) and delta
    row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    # lse2 + c r, lse2 - c r, c r (_ws_bwd_consumer); not at d64, whose fused dK/dV+dQ had 233,904 B of
    # shared memory with the two extra slots (sm90's limit 232,448: out of resources on the H100)
    ALIBI_ROWS: gl.constexpr = HAS_ALIBI and not SOFTCAP and k_desc.block_type.shape[1] >= 128
    LSE_SLOTS: gl.constexpr = 3 * STAGES if ALIBI_ROWS else STAGES
    lse_bufs = gl.allocate_shared_memory(gl.float32, [LSE_SLOTS, BLOCK_M], row_smem)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=2)  # the copies' expect, and the rows' arrival
        mbarrier.init(q_empty.index(i), count=2)
    bars = (kv_bar, q_ready, q_empty, lse_bufs, delta_bufs)
    if HAS_BIAS:  # a bias tile per (Q, dO) slot, under the slot's barriers
        bias_bufs = gl.allocate_shared_memory(bias_desc.dtype, [STAGES] + bias_desc.block_type.shape, bias_desc.layout)
        bias = (bias_desc, bias_bufs, q_ready, q_empty, bias_batch_rows, bias_head_rows)
    else:
        bias = bars  # not read: a stand-in of a type the partitions accept
    if FUSE_DQ:  # dS^T tiles (128 keys x 64 queries), double-buffered: step t + 2 rewrites step t's
        # after both warpgroups passed step t + 1's ds_ready, hence after their step-t dQ products
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, BLOCK_M], dtype)
        ds_bufs = gl.allocate_shared_memory(dtype, [2, 2 * BLOCK_N, BLOCK_M], ds_layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(kv_done, count=2)
        # each warpgroup's (64, HEAD_D / 2) fp32 partials: two slots where shared memory allows,
        # one beside a bias
        DQ_STAGES: gl.constexpr = 1 if HAS_BIAS else 2
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2 * DQ_STAGES] + dq_desc.block_type.shape, dq_desc.layout)
        dq_fused = (dq_desc, ds_bufs, ds_ready, kv_done, dq_bufs, dq_head_rows)
    else:
        dq_fused = bars  # not read
    scores = (softcap_in, softcap, alibi_ptr, alibi_sb, alibi_sh, alibi_off)
    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    gl.warp_specialize(
        [
            (
                _ws_bwd_consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dk_desc,
                    dv_desc,
                    lse_ptr,
                    delta_ptr,
                    k_bufs,
                    v_bufs,
                    q_bufs,
                    do_bufs,
                    bars,
                    bias,
                    dq_fused,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    scores,
                    WG0,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    KV_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    FUSE_DQ,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    SOFTCAP,
                    HAS_ALIBI,
                ),
            ),
            (
                _ws_bwd_consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dk_desc,
                    dv_desc,
                    lse_ptr,
                    delta_ptr,
                    k_bufs,
                    v_bufs,
                    q_bufs,
                    do_bufs,
                    bars,
                    bias,
                    dq_fused,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    scores,
                    WG1,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    KV_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    FUSE_DQ,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    SOFTCAP,
                    HAS_ALIBI,
                ),
            ),
            (
                _ws_bwd_loader,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dk_desc,
                    dv_desc,
                    lse_ptr,
                    delta_ptr,
                    k_bufs,
                    v_bufs,
                    q_bufs,
                    do_bufs,
                    bars,
                    bias,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    scores,
                    (q_seq_rows, do_seq_rows),
                    WG0,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    KV_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    FUSE_DQ,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    ALIBI_ROWS,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )
