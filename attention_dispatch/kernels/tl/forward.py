"""The tl forward kernel: FlashAttention-2 style online softmax over key tiles, one program per
(query tile, batch x head).  Conventions: see common.py."""

import triton
import triton.language as tl

from .common import (
    _apply_bias,
    _band_mask,
    _batch_head,
    _bias_desc,
    _dot,
    _dropout_keep,
    _load_tile,
    _lowp,
    _load_stream,
    _qk,
    _rng_rows,
    _tile_desc,
)
from .forward_io import _fwd_store, _load_q
from .score import _alibi_slope2, _mul_rn, _score_log2


@triton.jit
def _fwd_step(
    acc,
    l_i,
    m_i,
    s,
    v,
    m0,
    start_n,
    offs_m,
    offs_n0,
    qk_scale,
    sk,
    sq,
    off,
    window_left,
    window_right,
    bias_base,
    sbi,
    sbj,
    seed,
    rng_rows,
    dropout_p,
    softcap_in,
    softcap_out,
    slope2,
    MASKED: tl.constexpr,
    MAY_EMPTY: tl.constexpr,
    SCALE_POS: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    BIAS_KIND: tl.constexpr,
    BIAS_DESC: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    ROUND_P: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    EXACT_P: tl.constexpr,
):
    """One key block of the online softmax (log2 domain) given the raw scores ``s = q k^T``
    of the rows ``offs_m`` (from ``m0``).  MASKED: apply the band mask (edge blocks);
    MAY_EMPTY: a row may have seen only masked keys so far (max = -inf); SCALE_POS: the
    softmax scale is > 0; SOFTCAP / HAS_ALIBI: score transforms (score.py)."""
    offs_n = start_n + offs_n0
    # Without a bias or score transform and with a positive scale, the scale is applied inside
    # exp2's argument (one FMA per score instead of a multiply and a subtract): the row max of
    # the raw scores times the scale is the max of the scaled ones.
    PLAIN: tl.constexpr = BIAS_KIND == 0 and SCALE_POS and not SOFTCAP and not HAS_ALIBI
    if not PLAIN:
        s, _ = _score_log2(
            s, qk_scale, softcap_in, softcap_out, slope2, offs_m, offs_n, off, SOFTCAP, HAS_ALIBI, False, EXACT_P
        )
        s = _apply_bias(s, bias_base, m0, start_n, offs_m, offs_n, sq, sk, sbi, sbj, BIAS_KIND, BIAS_DESC, False)
    if MASKED:
        s = tl.where(
            _band_mask(offs_m, offs_n, sk, off, window_left, window_right, HAS_WL, HAS_WR, False), s, float("-inf")
        )
    if PLAIN:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no allowed key so far keeps max -inf (carried as such: a finite placeholder
    # would underflow the exp2 of later, very negative, scores) and exponentiates against 0.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if MAY_EMPTY else m_new
    if PLAIN:
        if EXACT_P:  # no fma: the max's exponent is 0, as in the backward (common.py)
            p = tl.math.exp2(_mul_rn(s, qk_scale, EXACT_P) - m_use[:, None])
        else:
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
    else:
        p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        p = tl.where(_dropout_keep(seed, rng_rows, start_n, dropout_p, offs_n0.shape[0], False), p, 0.0)
    if DOT_UPCAST | DOT_IEEE:
        acc += _dot(_lowp(p, v.dtype, ROUND_P), v, DOT_UPCAST, DOT_IEEE)
    else:
        acc = tl.dot(_lowp(p, v.dtype, ROUND_P), v, acc)
    return acc, l_i, m_new


@triton.jit
def _fwd_range(
    acc,
    l_i,
    m_i,
    q,
    m0,
    offs_m,
    rng_rows,
    acc_b,
    l_b,
    m_b,
    q_b,
    rng_rows_b,
    k_desc,
    v_desc,
    k_base,
    v_base,
    kv_row0,
    k_col0,
    v_col0,
    n_lo,
    n_hi,
    offs_n0,
    offs_dq,
    offs_dv,
    sks,
    svs,
    qk_scale,
    sk,
    sq,
    off,
    window_left,
    window_right,
    bias_base,
    sbi,
    sbj,
    seed,
    dropout_p,
    softcap_in,
    softcap_out,
    slope2,
    MASKED: tl.constexpr,
    MAY_EMPTY: tl.constexpr,
    SCALE_POS: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    BIAS_KIND: tl.constexpr,
    BIAS_DESC: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HEAD_DQK: tl.constexpr,
    HEAD_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    USE_DESC: tl.constexpr,
    SUBTILES: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    ROUND_P: tl.constexpr,
    KV_HOST: tl.constexpr,
    EXACT_P: tl.constexpr,
):
    """The online softmax over key blocks [n_lo, n_hi) (one software-pipelined loop).  With
    SUBTILES=2 the program's query rows are two halves (``q`` at row m0, ``q_b`` right after)
    sharing each K/V block: both q k^T products are issued before either softmax, so the
    tensor cores work on the second while the first is exponentiated (E22); with SUBTILES=1 the
    ``_b`` arguments are unused placeholders."""
    HALF: tl.constexpr = offs_m.shape[0]
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + offs_n0
        row = kv_row0 + start_n
        if KV_HOST == 2:  # (B * Sk, Hkv * D) rows: this head's tile at its columns
            k = k_desc.load([row, k_col0])
            v = v_desc.load([row, v_col0])
        else:
            k = _load_tile(k_desc, k_base, row, offs_n, sks, offs_n < sk, offs_dq, HEAD_DQK, BLOCK_DQK, USE_DESC)
            v = _load_tile(v_desc, v_base, row, offs_n, svs, offs_n < sk, offs_dv, HEAD_DV, BLOCK_DV, USE_DESC)
        s = _qk(q, k, DOT_UPCAST, DOT_IEEE, EXACT_P)
        if SUBTILES == 2:
            s_b = _qk(q_b, k, DOT_UPCAST, DOT_IEEE, EXACT_P)
        acc, l_i, m_i = _fwd_step(
            acc,
            l_i,
            m_i,
            s,
            v,
            m0,
            start_n,
            offs_m,
            offs_n0,
            qk_scale,
            sk,
            sq,
            off,
            window_left,
            window_right,
            bias_base,
            sbi,
            sbj,
            seed,
            rng_rows,
            dropout_p,
            softcap_in,
            softcap_out,
            slope2,
            MASKED,
            MAY_EMPTY,
            SCALE_POS,
            HAS_WL,
            HAS_WR,
            BIAS_KIND,
            BIAS_DESC,
            HAS_DROPOUT,
            DOT_UPCAST,
            DOT_IEEE,
            ROUND_P,
            SOFTCAP,
            HAS_ALIBI,
            EXACT_P,
        )
        if SUBTILES == 2:
            acc_b, l_b, m_b = _fwd_step(
                acc_b,
                l_b,
                m_b,
                s_b,
                v,
                m0 + HALF,
                start_n,
                offs_m + HALF,
                offs_n0,
                qk_scale,
                sk,
                sq,
                off,
                window_left,
                window_right,
                bias_base,
                sbi,
                sbj,
                seed,
                rng_rows_b,
                dropout_p,
                softcap_in,
                softcap_out,
                slope2,
                MASKED,
                MAY_EMPTY,
                SCALE_POS,
                HAS_WL,
                HAS_WR,
                BIAS_KIND,
                BIAS_DESC,
                HAS_DROPOUT,
                DOT_UPCAST,
                DOT_IEEE,
                ROUND_P,
                SOFTCAP,
                HAS_ALIBI,
                EXACT_P,
            )
    return acc, l_i, m_i, acc_b, l_b, m_b


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    Bias,
    O,
    LSE,
    Seed,
    CuQ,
    CuK,
    Alibi,
    Sinks,
    qk_scale,
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
    sob,
    soh,
    sos,
    slb,
    slh,
    sls,
    H,
    NB,
    GROUP,
    seqlen_q,
    seqlen_k,
    bh_start,
    window_left,
    window_right,
    KD,
    VD,
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
    HAS_SINKS: tl.constexpr,
    BATCH_MINOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    ROUND_P: tl.constexpr,
    USE_DESC: tl.constexpr,
    MAY_EMPTY: tl.constexpr,
    SCALE_POS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    SUBTILES: tl.constexpr = 1,
    KV_HOST: tl.constexpr = 0,
    LSE_PAIR: tl.constexpr = False,
    EXACT_P: tl.constexpr = 0,
):
    """USE_DESC: K/V (and Q beside a bias descriptor) through TMA tensor descriptors built
    in-kernel per (sequence, head) (Hopper+; the launcher checks the 16-byte alignment TMA
    needs and provides the scratch allocator).  MAY_EMPTY: some row may see only masked keys
    in its first key block.  The band-masked edge key blocks run in their own loops and the
    middle loop runs unmasked: one loop with a per-block branch around two copies of the step
    pipelines badly (E4).  SUBTILES=2: the BLOCK_M rows are processed as two halves that share
    every K/V block (:func:`_fwd_range`).  KV_HOST: K/V
    through the TMA descriptors KD/VD that the launcher built (Sk a multiple of BLOCK_N, so
    no tile reaches into the next head or sequence): 1 over the (B * Hkv * Sk, D) rows of
    (B, Hkv, Sk, D) memory, 2 over the (B * Sk, Hkv * D) rows of (B, Sk, Hkv, D) memory.  No
    tensormap is written per program for them (E30).  LSE_PAIR (float32): LSE is the (*lse_shape, 2)
    log2 logsumexp as hi + lo (forward_io._fwd_store), its strides those of that memory.
    EXACT_P (float32): see common.py."""
    # Last query tiles first: under a causal band they have the most keys, and starting
    # the longest programs first shortens the tail of the launch.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
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

    # SUBTILES=2: the tile's rows are two halves of HALF rows (see _fwd_range); SUBTILES=1: one.
    HALF: tl.constexpr = BLOCK_M // SUBTILES
    offs_m = m0 + tl.arange(0, HALF)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)

    q_base = Q + b64 * sqb + h.to(tl.int64) * sqh + q_start * sqs
    k_base = K + b64 * skb + hk.to(tl.int64) * skh + k_start * sks
    v_base = V + b64 * svb + hk.to(tl.int64) * svh + k_start * svs
    o_base = O + b64 * sob + h.to(tl.int64) * soh + q_start * sos
    lse_base = LSE + b64 * slb + h.to(tl.int64) * slh + q_start * sls
    bias_base = _bias_desc(Bias + b64 * sbb + h.to(tl.int64) * sbh, sq, sk, sbi, HALF, BLOCK_N, BIAS_DESC)

    if KV_HOST != 0:  # this head's tiles: rows from kv_row0, columns from k_col0 / v_col0
        k_desc = KD
        v_desc = VD
        if KV_HOST == 1:
            kv_row0 = (b * (H // GROUP) + hk) * sk
            k_col0 = 0
            v_col0 = 0
        else:
            kv_row0 = b * sk
            k_col0 = hk * HEAD_DQK
            v_col0 = hk * HEAD_DV
    else:
        k_desc = _tile_desc(K, k_base, sk, sks, HEAD_DQK, BLOCK_N, BLOCK_DQK, USE_DESC)
        v_desc = _tile_desc(V, v_base, sk, svs, HEAD_DV, BLOCK_N, BLOCK_DV, USE_DESC)
        kv_row0 = 0
        k_col0 = 0
        v_col0 = 0
    # Q (read once) and O (written once) through pointers: each in-kernel descriptor is a
    # tensormap written and fenced per program (pointers for them ran 0-13% faster, E29).
    # Beside a bias descriptor Q keeps one: Triton 3.6's ptxas (12.8) crashes (SIGSEGV) on
    # the pointer load of Q next to the in-kernel bias tensormap, for every tile shape.
    q = _load_q(Q, q_base, m0, offs_m, sq, sqs, offs_dq, HEAD_DQK, HALF, BLOCK_DQK, BIAS_DESC)

    # ---- key range: blocks entirely outside the band are skipped by the loop bounds ----
    m_last = tl.minimum(m0 + BLOCK_M, sq) - 1
    lo = 0
    hi = sk
    if HAS_WL:
        lo = tl.maximum(m0 + off - window_left, 0)
    if HAS_WR:
        hi = tl.minimum(m_last + off + window_right + 1, sk)
    lo = (lo // BLOCK_N) * BLOCK_N
    # [full_lo, full_hi): key blocks allowed for every row of this tile and inside sk.
    full_lo = lo
    full_hi = (sk // BLOCK_N) * BLOCK_N
    if HAS_WL:
        full_lo = tl.maximum(((tl.maximum(m_last + off - window_left, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo)
    if HAS_WR:
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + off + window_right + 1, 0) // BLOCK_N) * BLOCK_N)

    if HAS_DROPOUT:
        seed, rng_row0, rng_col4, rng_sq, rng_per_row = _load_stream(Seed, seqlen_q, seqlen_k)
        rng_rows = _rng_rows(pid_bh.to(tl.int64), offs_m, rng_row0, rng_col4, rng_sq, rng_per_row)
    else:
        seed = 0
        rng_rows = offs_m.to(tl.int64)

    m_i = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HALF], dtype=tl.float32)
    acc = tl.zeros([HALF, BLOCK_DV], dtype=tl.float32)
    if SUBTILES == 2:
        q_b = _load_q(Q, q_base, m0 + HALF, offs_m + HALF, sq, sqs, offs_dq, HEAD_DQK, HALF, BLOCK_DQK, BIAS_DESC)
        m_b = tl.full([HALF], float("-inf"), dtype=tl.float32)
        l_b = tl.zeros([HALF], dtype=tl.float32)
        acc_b = tl.zeros([HALF, BLOCK_DV], dtype=tl.float32)
        if HAS_DROPOUT:
            rng_rows_b = _rng_rows(pid_bh.to(tl.int64), offs_m + HALF, rng_row0, rng_col4, rng_sq, rng_per_row)
        else:
            rng_rows_b = (offs_m + HALF).to(tl.int64)
    else:
        q_b = q
        m_b = 0.0
        l_b = 0.0
        acc_b = 0.0
        rng_rows_b = rng_rows

    slope2 = _alibi_slope2(Alibi, b, h, sab, sah, HAS_ALIBI)
    if HAS_SINKS:
        sink2 = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
    else:
        sink2 = 0.0

    # masked leading edge (window left), unmasked middle, masked trailing edge (causal, sk)
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.maximum(tl.minimum(full_hi, hi), mid_lo)
    for part in tl.static_range(3):  # unrolled at compile time: three loops, only the middle one unmasked
        if part == 0:
            n_lo, n_hi = lo, mid_lo
        elif part == 1:
            n_lo, n_hi = mid_lo, mid_hi
        else:
            n_lo, n_hi = mid_hi, hi
        acc, l_i, m_i, acc_b, l_b, m_b = _fwd_range(
            acc,
            l_i,
            m_i,
            q,
            m0,
            offs_m,
            rng_rows,
            acc_b,
            l_b,
            m_b,
            q_b,
            rng_rows_b,
            k_desc,
            v_desc,
            k_base,
            v_base,
            kv_row0,
            k_col0,
            v_col0,
            n_lo,
            n_hi,
            offs_n0,
            offs_dq,
            offs_dv,
            sks,
            svs,
            qk_scale,
            sk,
            sq,
            off,
            window_left,
            window_right,
            bias_base,
            sbi,
            sbj,
            seed,
            dropout_p,
            softcap_in,
            softcap_out,
            slope2,
            part != 1,
            MAY_EMPTY,
            SCALE_POS,
            HAS_WL,
            HAS_WR,
            BIAS_KIND,
            BIAS_DESC,
            HAS_DROPOUT,
            SOFTCAP,
            HAS_ALIBI,
            HEAD_DQK,
            HEAD_DV,
            BLOCK_N,
            BLOCK_DQK,
            BLOCK_DV,
            USE_DESC,
            SUBTILES,
            DOT_UPCAST,
            DOT_IEEE,
            ROUND_P,
            KV_HOST,
            EXACT_P,
        )
    _fwd_store(
        acc,
        l_i,
        m_i,
        o_base,
        lse_base,
        offs_m,
        sq,
        sos,
        sls,
        dropout_p,
        sink2,
        offs_dv,
        HEAD_DV,
        BLOCK_DV,
        HAS_DROPOUT,
        STORE_LSE,
        HAS_SINKS,
        LSE_PAIR,
    )
    if SUBTILES == 2:
        _fwd_store(
            acc_b,
            l_b,
            m_b,
            o_base,
            lse_base,
            offs_m + HALF,
            sq,
            sos,
            sls,
            dropout_p,
            sink2,
            offs_dv,
            HEAD_DV,
            BLOCK_DV,
            HAS_DROPOUT,
            STORE_LSE,
            HAS_SINKS,
            LSE_PAIR,
        )
