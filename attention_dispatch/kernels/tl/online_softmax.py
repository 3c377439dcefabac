"""One key block of the tl forward's online softmax (the softmax alone is shared with the
head-dim-chunked loop of forward_dchunk.py).  Conventions: see common.py."""

import triton
import triton.language as tl

from .common import _apply_bias, _band_mask, _dot, _dropout_keep, _lowp
from .score import _mul_rn, _score_log2


@triton.jit
def _fwd_softmax(
    l_i,
    m_i,
    s,
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
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    EXACT_P: tl.constexpr,
):
    """The online softmax (log2 domain) of one key block given the raw scores ``s = q k^T`` of
    the rows ``offs_m`` (from ``m0``) -> (p before dropout, the accumulator's rescale alpha, the
    new row sums, the new row maxima).  MASKED: apply the band mask (edge blocks); MAY_EMPTY: a
    row may have seen only masked keys so far (max = -inf); SCALE_POS: the softmax scale is > 0;
    SOFTCAP / HAS_ALIBI: score transforms (score.py)."""
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
    return p, alpha, l_i, m_new


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
    """One key block of the online softmax (:func:`_fwd_softmax`) and the accumulator's update."""
    p, alpha, l_i, m_new = _fwd_softmax(
        l_i,
        m_i,
        s,
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
        SOFTCAP,
        HAS_ALIBI,
        EXACT_P,
    )
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        p = tl.where(_dropout_keep(seed, rng_rows, start_n, dropout_p, offs_n0.shape[0], False), p, 0.0)
    if DOT_UPCAST | DOT_IEEE:
        acc += _dot(_lowp(p, v.dtype, ROUND_P), v, DOT_UPCAST, DOT_IEEE)
    else:
        acc = tl.dot(_lowp(p, v.dtype, ROUND_P), v, acc)
    return acc, l_i, m_new
