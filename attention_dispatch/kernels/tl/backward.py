"""Triton backward kernels: dK/dV (+ d(bias); or dV and dK in two launches), dQ (optionally
split over keys with fp32 atomics); the delta pass before them is backward_delta.py.  Conventions:
see common.py.

Gradients (natural-log units): P = exp(s - lse), dP = dO V^T (times keep/(1-p) under
dropout), dS = P * (dP - delta) with delta = rowsum(dO * O); dQ = scale * dS K,
dK = scale * dS^T Q, dV = (P * keep/(1-p))^T dO, d(bias) = dS; with a softcap, dQ and dK take
dS * (1 - tanh^2) (score.py).  The sink and a logsumexp gradient reach these kernels only through
lse (then the logsumexp with the sink) and delta, prepared by the delta pass.
A row whose logsumexp is -inf (nothing allowed) is given lse = +inf so that P = 0 and every
gradient it touches is exactly 0 (never NaN).
"""

import triton
import triton.language as tl

from .common import (
    _apply_bias,
    _band_mask,
    _batch_head,
    _bias_desc,
    _dot,
    _dropout_keep,
    _load_rows,
    _load_tile,
    _lowp,
    _load_stream,
    _qk,
    _rng_rows,
    _tile_desc,
)
from .score import _alibi_slope2, _score_log2, _softcap_grad


@triton.jit
def _lse_log2(LSE, offs, row_ok, LSE_PAIR: tl.constexpr):
    """(hi, lo): the rows' logsumexp in log2 units, P = exp2((s - hi) - lo); +inf for a row with
    nothing allowed (P = 0).  ``offs``: the rows' offsets in lse's layout.  LSE_PAIR: LSE is the
    forward's (*lse_shape, 2) pairs (float32 inputs, issue 38); else the natural-log lse, lo = 0."""
    if LSE_PAIR:
        hi = tl.load(LSE + 2 * offs, mask=row_ok, other=0.0)
        lo = tl.load(LSE + 2 * offs + 1, mask=row_ok, other=0.0)
        return tl.where(hi == float("-inf"), float("inf"), hi), lo
    else:
        lse = tl.load(LSE + offs, mask=row_ok, other=0.0)
        return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), 0.0


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    Bias,
    DO,
    LSE,
    Delta,
    Seed,
    CuQ,
    CuK,
    DK,
    DV,
    DB,
    Alibi,
    qk_scale,
    sm_scale,
    dropout_p,
    softcap_in,
    softcap_out,
    sab,
    sah,
    sqb,
    sqh,
    sqs,
    skb,
    skh,
    sks,
    svb,
    svh,
    svs,
    sbb,
    sbh,
    sbi,
    sbj,
    sdob,
    sdoh,
    sdos,
    slb,
    slh,
    sls,
    sdkb,
    sdkh,
    sdks,
    sdvb,
    sdvh,
    sdvs,
    sdbb,
    sdbh,
    sdbi,
    sdbj,
    H,
    NB,
    GROUP,
    HK,
    seqlen_q,
    seqlen_k,
    bh_start,
    window_left,
    window_right,
    group_per_split,
    sdk_split,
    sdv_split,
    HEAD_DQK: tl.constexpr,
    HEAD_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    ALIGN_BR: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    BIAS_KIND: tl.constexpr,
    BIAS_DESC: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    BATCH_MINOR: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    DB_SUM_ROWS: tl.constexpr,
    DB_SUM_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    ROUND_P: tl.constexpr,
    USE_DESC: tl.constexpr,
    LSE_PAIR: tl.constexpr = False,
    EXACT_P: tl.constexpr = 0,
    DO_DK: tl.constexpr = True,
    DO_DV: tl.constexpr = True,
    DP_IN_BRANCH: tl.constexpr = False,
):
    """One program: one key tile of one (batch, kv head); loops over the query heads of the
    GROUP that read this kv head (all of them, or the share of split program_id(2), whose
    partial dK/dV go to an fp32 workspace slice summed on the host) and over the query tiles
    of the band.  No atomics.  EXACT_P (float32): see common.py.  DO_DK / DO_DV: which of the
    two gradients this launch computes; one alone (two launches, d > 256: E108) holds one
    BN x D fp32 accumulator instead of two, and the dV pass needs neither V nor dP.
    DP_IN_BRANCH (d > 256): dP goes through the band-edge branch as S does.  Triton 3.6 gives a
    product whose value reaches another product (a forward slice, which an if's yield ends) warps
    [num_warps, 1]: at 64 rows over 8 warps both warpgroups then compute all of dP (E105, E108)."""
    pid_n = tl.program_id(0)
    gsplit = tl.program_id(2)
    b, hk = _batch_head(tl.program_id(1) + bh_start, HK, NB, BATCH_MINOR)
    if IS_VARLEN:
        q_start = tl.load(CuQ + b).to(tl.int64)
        sq = (tl.load(CuQ + b + 1).to(tl.int64) - q_start).to(tl.int32)
        k_start = tl.load(CuK + b).to(tl.int64)
        sk = (tl.load(CuK + b + 1).to(tl.int64) - k_start).to(tl.int32)
    else:
        q_start = 0
        k_start = 0
        sq = seqlen_q
        sk = seqlen_k
    n0 = pid_n * BLOCK_N
    if n0 >= sk:
        return
    if ALIGN_BR:
        off = sk - sq
    else:
        off = 0
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < sk
    krows = k_start + offs_n.to(tl.int64)

    k = _load_rows(
        K + b64 * skb + hk64 * skh + krows[:, None] * sks + offs_dq[None, :],
        col_ok,
        offs_dq < HEAD_DQK,
        BLOCK_DQK == HEAD_DQK,
    )
    if DO_DK:
        v = _load_rows(
            V + b64 * svb + hk64 * svh + krows[:, None] * svs + offs_dv[None, :],
            col_ok,
            offs_dv < HEAD_DV,
            BLOCK_DV == HEAD_DV,
        )

    # ---- query range of the band for this key tile ----
    n_last = tl.minimum(n0 + BLOCK_N, sk) - 1
    lo = 0
    hi = sq
    if HAS_WR:
        lo = tl.maximum(n0 - off - window_right, 0)
    if HAS_WL:
        hi = tl.minimum(n_last - off + window_left + 1, sq)
    lo = (lo // BLOCK_M) * BLOCK_M
    full_lo = lo
    full_hi = (sq // BLOCK_M) * BLOCK_M
    if HAS_WR:
        full_lo = tl.maximum(((tl.maximum(n_last - off - window_right, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, lo)
    if HAS_WL:
        full_hi = tl.minimum(full_hi, (tl.maximum(n0 - off + window_left + 1, 0) // BLOCK_M) * BLOCK_M)

    if HAS_DROPOUT:
        seed, rng_row0, rng_col4, rng_sq, rng_per_row = _load_stream(Seed, seqlen_q, seqlen_k)
    else:
        seed = 0
    inv_keep = 1.0 / (1.0 - dropout_p)

    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)

    g_lo = gsplit * group_per_split
    g_hi = tl.minimum(g_lo + group_per_split, GROUP)
    for g in range(g_lo, g_hi):
        h = hk * GROUP + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * sqb + h64 * sqh + q_start * sqs
        do_base = DO + b64 * sdob + h64 * sdoh + q_start * sdos
        l_base = b64 * slb + h64 * slh + q_start * sls
        bias_base = _bias_desc(Bias + b64 * sbb + h64 * sbh, sq, sk, sbi, BLOCK_M, BLOCK_N, BIAS_DESC)
        if DB_SUM_HEADS:
            db_base = DB + b64 * sdbb + hk64 * sdbh
        else:
            db_base = DB + b64 * sdbb + h64 * sdbh
        if DB_SUM_ROWS:
            if not DB_SUM_HEADS:
                db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        pid_bh64 = b64 * H + h64
        slope2 = _alibi_slope2(Alibi, b, h, sab, sah, HAS_ALIBI)
        q_desc = _tile_desc(Q, q_base, sq, sqs, HEAD_DQK, BLOCK_M, BLOCK_DQK, USE_DESC)
        do_desc = _tile_desc(DO, do_base, sq, sdos, HEAD_DV, BLOCK_M, BLOCK_DV, USE_DESC)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            row_ok = offs_m < sq
            q = _load_tile(q_desc, q_base, start_m, offs_m, sqs, row_ok, offs_dq, HEAD_DQK, BLOCK_DQK, USE_DESC)
            do = _load_tile(do_desc, do_base, start_m, offs_m, sdos, row_ok, offs_dv, HEAD_DV, BLOCK_DV, USE_DESC)
            if LSE_PAIR:  # a helper for the one-float load too reorders the bf16 PTX
                lse2, lse_lo = _lse_log2(LSE, l_base + offs_m.to(tl.int64) * sls, row_ok, LSE_PAIR)
            else:
                lse = tl.load(LSE + l_base + offs_m.to(tl.int64) * sls, mask=row_ok, other=0.0)
                lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            if DO_DK:
                delta = tl.load(Delta + l_base + offs_m.to(tl.int64) * sls, mask=row_ok, other=0.0)

            # both products first: Triton 3.6 waits for each one where it is issued, so this
            # order and the other one compile to the same schedule (neutral, E25, E27)
            sT = _qk(k, q, DOT_UPCAST, DOT_IEEE, EXACT_P)
            if DO_DK:
                dpT = _dot(v, tl.trans(do), DOT_UPCAST, DOT_IEEE)
            sT, tT = _score_log2(
                sT, qk_scale, softcap_in, softcap_out, slope2, offs_m, offs_n, off, SOFTCAP, HAS_ALIBI, True, EXACT_P
            )
            sT = _apply_bias(sT, bias_base, start_m, n0, offs_m, offs_n, sq, sk, sbi, sbj, BIAS_KIND, BIAS_DESC, True)
            if (start_m < full_lo) | (start_m >= full_hi):
                band = _band_mask(offs_m, offs_n, sk, off, window_left, window_right, HAS_WL, HAS_WR, True)
                sT = tl.where(band, sT, float("-inf"))
                if DO_DK and DP_IN_BRANCH:  # the same P = 0 there; dP's warps split like S's
                    dpT = tl.where(band, dpT, 0.0)
            if LSE_PAIR:
                pT = tl.math.exp2((sT - lse2[None, :]) - lse_lo[None, :])
            else:
                pT = tl.math.exp2(sT - lse2[None, :])
            if HAS_DROPOUT:
                rng_rows = _rng_rows(pid_bh64, offs_m, rng_row0, rng_col4, rng_sq, rng_per_row)
                keep = _dropout_keep(seed, rng_rows, n0, dropout_p, BLOCK_N, True)
                pdT = tl.where(keep, pT * inv_keep, 0.0)
                if DO_DK:
                    dpT = tl.where(keep, dpT * inv_keep, 0.0)
            else:
                pdT = pT
            if DO_DV:
                dv += _dot(_lowp(pdT, do.dtype, ROUND_P), do, DOT_UPCAST, DOT_IEEE)
            if DO_DK:
                dsT = pT * (dpT - delta[None, :])
                dk += _dot(_lowp(_softcap_grad(dsT, tT, SOFTCAP), q.dtype, ROUND_P), q, DOT_UPCAST, DOT_IEEE)
            if BIAS_GRAD:
                if DB_SUM_ROWS:
                    db_acc += tl.sum(tl.where(row_ok[None, :], dsT, 0.0), 1)
                else:
                    db_ptrs = db_base + offs_n.to(tl.int64)[:, None] * sdbj + offs_m.to(tl.int64)[None, :] * sdbi
                    db_mask = col_ok[:, None] & row_ok[None, :]
                    if DB_SUM_HEADS:
                        prev = tl.load(db_ptrs, mask=db_mask, other=0.0)
                        tl.store(db_ptrs, prev + dsT, mask=db_mask)
                        tl.debug_barrier()
                    else:
                        tl.store(db_ptrs, dsT, mask=db_mask)
        if BIAS_GRAD:
            if DB_SUM_ROWS:
                if not DB_SUM_HEADS:
                    tl.store(db_base + offs_n.to(tl.int64) * sdbj, db_acc, mask=col_ok)
    if BIAS_GRAD:
        if DB_SUM_ROWS:
            if DB_SUM_HEADS:
                tl.store(DB + b64 * sdbb + hk64 * sdbh + offs_n.to(tl.int64) * sdbj, db_acc, mask=col_ok)

    dk = dk * sm_scale
    dk_ptrs = DK + gsplit.to(tl.int64) * sdk_split + b64 * sdkb + hk64 * sdkh + krows[:, None] * sdks + offs_dq[None, :]
    dv_ptrs = DV + gsplit.to(tl.int64) * sdv_split + b64 * sdvb + hk64 * sdvh + krows[:, None] * sdvs + offs_dv[None, :]
    if DO_DK:
        if BLOCK_DQK == HEAD_DQK:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
        else:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & (offs_dq < HEAD_DQK)[None, :])
    if DO_DV:
        if BLOCK_DV == HEAD_DV:
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])
        else:
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & (offs_dv < HEAD_DV)[None, :])


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    Bias,
    DO,
    LSE,
    Delta,
    Seed,
    CuQ,
    CuK,
    DQ,
    Alibi,
    qk_scale,
    sm_scale,
    dropout_p,
    softcap_in,
    softcap_out,
    sab,
    sah,
    sqb,
    sqh,
    sqs,
    skb,
    skh,
    sks,
    svb,
    svh,
    svs,
    sbb,
    sbh,
    sbi,
    sbj,
    sdob,
    sdoh,
    sdos,
    slb,
    slh,
    sls,
    sdqb,
    sdqh,
    sdqs,
    H,
    NB,
    GROUP,
    seqlen_q,
    seqlen_k,
    bh_start,
    window_left,
    window_right,
    num_splits,
    HEAD_DQK: tl.constexpr,
    HEAD_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    ALIGN_BR: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    BIAS_KIND: tl.constexpr,
    BIAS_DESC: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    BATCH_MINOR: tl.constexpr,
    ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    ROUND_P: tl.constexpr,
    USE_DESC: tl.constexpr,
    LSE_PAIR: tl.constexpr = False,
    EXACT_P: tl.constexpr = 0,
    DP_IN_BRANCH: tl.constexpr = False,
):
    """One program: one query tile of one (batch, head) and one split of its key range.
    ATOMIC (split-keys): partial dQ is atomically added to an fp32 workspace.  EXACT_P (float32):
    see common.py.  DP_IN_BRANCH: see :func:`_attn_bwd_dkdv`."""
    pid_m = tl.program_id(0)
    split = tl.program_id(2)
    b, h = _batch_head(tl.program_id(1) + bh_start, H, NB, BATCH_MINOR)
    pid_bh = b * H + h
    hk = h // GROUP
    if IS_VARLEN:
        q_start = tl.load(CuQ + b).to(tl.int64)
        sq = (tl.load(CuQ + b + 1).to(tl.int64) - q_start).to(tl.int32)
        k_start = tl.load(CuK + b).to(tl.int64)
        sk = (tl.load(CuK + b + 1).to(tl.int64) - k_start).to(tl.int32)
    else:
        q_start = 0
        k_start = 0
        sq = seqlen_q
        sk = seqlen_k
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    if ALIGN_BR:
        off = sk - sq
    else:
        off = 0
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < sq
    rows = q_start + offs_m.to(tl.int64)

    q = _load_rows(
        Q + b64 * sqb + h64 * sqh + rows[:, None] * sqs + offs_dq[None, :],
        row_ok,
        offs_dq < HEAD_DQK,
        BLOCK_DQK == HEAD_DQK,
    )
    do = _load_rows(
        DO + b64 * sdob + h64 * sdoh + rows[:, None] * sdos + offs_dv[None, :],
        row_ok,
        offs_dv < HEAD_DV,
        BLOCK_DV == HEAD_DV,
    )
    l_ptrs = b64 * slb + h64 * slh + rows * sls
    if LSE_PAIR:
        lse2, lse_lo = _lse_log2(LSE, l_ptrs, row_ok, LSE_PAIR)
    else:
        lse = tl.load(LSE + l_ptrs, mask=row_ok, other=0.0)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + l_ptrs, mask=row_ok, other=0.0)
    k_base = K + b64 * skb + hk64 * skh + k_start * sks
    v_base = V + b64 * svb + hk64 * svh + k_start * svs
    bias_base = _bias_desc(Bias + b64 * sbb + h64 * sbh, sq, sk, sbi, BLOCK_M, BLOCK_N, BIAS_DESC)
    slope2 = _alibi_slope2(Alibi, b, h, sab, sah, HAS_ALIBI)

    m_last = tl.minimum(m0 + BLOCK_M, sq) - 1
    lo = 0
    hi = sk
    if HAS_WL:
        lo = tl.maximum(m0 + off - window_left, 0)
    if HAS_WR:
        hi = tl.minimum(m_last + off + window_right + 1, sk)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = lo
    full_hi = (sk // BLOCK_N) * BLOCK_N
    if HAS_WL:
        full_lo = tl.maximum(((tl.maximum(m_last + off - window_left, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo)
    if HAS_WR:
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + off + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    # split-keys: this program takes a contiguous share of the key tiles
    n_tiles = tl.maximum((hi - lo + BLOCK_N - 1) // BLOCK_N, 0)
    per = (n_tiles + num_splits - 1) // num_splits
    seg_lo = lo + split * per * BLOCK_N
    seg_hi = tl.minimum(hi, seg_lo + per * BLOCK_N)

    if HAS_DROPOUT:
        seed, rng_row0, rng_col4, rng_sq, rng_per_row = _load_stream(Seed, seqlen_q, seqlen_k)
        rng_rows = _rng_rows(pid_bh.to(tl.int64), offs_m, rng_row0, rng_col4, rng_sq, rng_per_row)
    else:
        seed = 0
        rng_rows = offs_m.to(tl.int64)
    inv_keep = 1.0 / (1.0 - dropout_p)

    k_desc = _tile_desc(K, k_base, sk, sks, HEAD_DQK, BLOCK_N, BLOCK_DQK, USE_DESC)
    v_desc = _tile_desc(V, v_base, sk, svs, HEAD_DV, BLOCK_N, BLOCK_DV, USE_DESC)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    for start_n in range(seg_lo, seg_hi, BLOCK_N):
        offs_n = start_n + offs_n0
        col_ok = offs_n < sk
        k = _load_tile(k_desc, k_base, start_n, offs_n, sks, col_ok, offs_dq, HEAD_DQK, BLOCK_DQK, USE_DESC)
        v = _load_tile(v_desc, v_base, start_n, offs_n, svs, col_ok, offs_dv, HEAD_DV, BLOCK_DV, USE_DESC)
        s = _qk(q, k, DOT_UPCAST, DOT_IEEE, EXACT_P)
        dp = _dot(do, tl.trans(v), DOT_UPCAST, DOT_IEEE)  # the same order as dK/dV
        s, t = _score_log2(
            s, qk_scale, softcap_in, softcap_out, slope2, offs_m, offs_n, off, SOFTCAP, HAS_ALIBI, False, EXACT_P
        )
        s = _apply_bias(s, bias_base, m0, start_n, offs_m, offs_n, sq, sk, sbi, sbj, BIAS_KIND, BIAS_DESC, False)
        if (start_n < full_lo) | (start_n >= full_hi):
            band = _band_mask(offs_m, offs_n, sk, off, window_left, window_right, HAS_WL, HAS_WR, False)
            s = tl.where(band, s, float("-inf"))
            if DP_IN_BRANCH:  # the same P = 0 there; dP's warps split like S's
                dp = tl.where(band, dp, 0.0)
        if LSE_PAIR:
            p = tl.math.exp2((s - lse2[:, None]) - lse_lo[:, None])
        else:
            p = tl.math.exp2(s - lse2[:, None])
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, rng_rows, start_n, dropout_p, BLOCK_N, False)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = _softcap_grad(p * (dp - delta[:, None]), t, SOFTCAP)
        dq += _dot(_lowp(ds, k.dtype, ROUND_P), k, DOT_UPCAST, DOT_IEEE)
    dq = dq * sm_scale

    dq_ptrs = DQ + b64 * sdqb + h64 * sdqh + rows[:, None] * sdqs + offs_dq[None, :]
    if BLOCK_DQK == HEAD_DQK:
        dq_mask = row_ok[:, None] & (offs_dq >= 0)[None, :]
    else:
        dq_mask = row_ok[:, None] & (offs_dq < HEAD_DQK)[None, :]
    if ATOMIC:
        if seg_hi > seg_lo:
            tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_mask)
