"""Score transforms of the tl kernels beyond scale and bias: logit softcapping, ALiBi and the
attention sink (forward, backward and decode share them, so every pass sees the same scores).

Scores live in the log2 domain (conventions: common.py).  With SOFTCAP the scaled score is
``softcap * tanh(scale * <q, k> / softcap)``: the kernels take ``softcap_in = scale / softcap``
and ``softcap_out = softcap * log2(e)``.  ALiBi subtracts ``slope * |i + off - j|`` (``off``: the
band's diagonal offset), the slope pre-multiplied by log2(e).  SOFTCAP: 0 off, 1 the exact tanh,
2 the GPU's tanh.approx (tl/launch.TANH_APPROX_DTYPES).
"""

import triton
import triton.language as tl

from .common import LOG2E

LOG2E_SC = tl.constexpr(LOG2E)
TWO_LOG2E = tl.constexpr(2.0 * LOG2E)


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): exact at both ends (e^{2x} = inf or 0); tl has no tanh and
    # libdevice's is not in the CPU interpreter
    return 1.0 - tl.fdiv(2.0, tl.math.exp2(x * TWO_LOG2E) + 1.0)


@triton.jit
def _tanh_approx(x):
    # one MUFU op (max relative error ~2^-11) instead of the exp2 and the division of _tanh
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mul_rn(x, y, EXACT_P: tl.constexpr):
    """x * y rounded once to float32, never fused into a later add (the forward and the backward
    would round differently: common.py's EXACT_P).  The interpreter (EXACT_P == 2) fuses nothing."""
    if EXACT_P == 1:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return x * y


@triton.jit
def _score_log2(
    s,
    qk_scale,
    softcap_in,
    softcap_out,
    slope2,
    offs_m,
    offs_n,
    off,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    TRANS: tl.constexpr,
    EXACT_P: tl.constexpr = 0,
):
    """Raw products ``s = q k^T`` (BM, BN), or (BN, BM) when TRANS -> (scores in the log2
    domain before the bias, tanh of the capped score or 0.0 without SOFTCAP: the backward's
    d score / d(q k) = scale * (1 - tanh^2)).  ``slope2``: a scalar, or (BM, 1) per row (decode);
    ``off``: a scalar, or (BM, 1) per row (decode).  EXACT_P: common.py's."""
    if SOFTCAP:
        if SOFTCAP == 2:
            t = _tanh_approx(s * softcap_in)
        else:
            t = _tanh(s * softcap_in)
        if EXACT_P:
            s = _mul_rn(t, softcap_out, EXACT_P)
        else:
            s = t * softcap_out
    else:
        t = 0.0
        if EXACT_P:
            s = _mul_rn(s, qk_scale, EXACT_P)
        else:
            s = s * qk_scale
    if HAS_ALIBI:
        if TRANS:
            dist = tl.abs(offs_m[None, :] + off - offs_n[:, None]).to(tl.float32)
            s = s - slope2 * dist
        else:
            dist = tl.abs(offs_m[:, None] + off - offs_n[None, :]).to(tl.float32)
            s = s - slope2 * dist
    return s, t


@triton.jit
def _softcap_grad(ds, t, SOFTCAP: tl.constexpr):
    """d loss / d(scale * q k) from d loss / d score: times 1 - tanh^2 under a softcap."""
    if SOFTCAP:
        return ds * (1.0 - t * t)
    else:
        return ds


@triton.jit
def _alibi_slope2(Alibi, b, h, sab, sah, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of (batch b, head h) times log2(e) (0.0 without ALiBi)."""
    if HAS_ALIBI:
        return tl.load(Alibi + b.to(tl.int64) * sab + h.to(tl.int64) * sah).to(tl.float32) * LOG2E_SC
    else:
        return 0.0


@triton.jit
def _sink_denominator(l_i, m_i, sink2, HAS_SINKS: tl.constexpr):
    """The softmax denominator of rows with running max ``m_i`` and sum ``l_i`` (log2 domain),
    plus the sink's 2^(sink2 - m_i); a row that saw no allowed key (l_i = 0) keeps 0: its output
    is 0 whatever the sink."""
    if HAS_SINKS:
        empty = l_i == 0.0
        return tl.where(empty, 0.0, l_i + tl.math.exp2(sink2 - tl.where(empty, 0.0, m_i)))
    else:
        return l_i
