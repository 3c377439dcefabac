"""The tl forward's query load and normalised store (output, logsumexp), apart from its main loop
(forward.py).  Conventions: see common.py."""

import triton
import triton.language as tl

from .common import _load_tile, _tile_desc
from .score import _sink_denominator


@triton.jit
def _load_q(
    Q,
    q_base,
    row0,
    offs_m,
    sq,
    sqs,
    offs_dq,
    HEAD_DQK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    VIA_DESC: tl.constexpr,
):
    """The (HALF, BLOCK_DQK) query tile at rows ``row0``.. (``offs_m``): pointer loads, or
    with VIA_DESC one TMA copy through a descriptor built here."""
    if VIA_DESC:
        return _tile_desc(Q, q_base, sq, sqs, HEAD_DQK, HALF, BLOCK_DQK, True).load([row0, 0])
    else:
        return _load_tile(Q, q_base, row0, offs_m, sqs, offs_m < sq, offs_dq, HEAD_DQK, BLOCK_DQK, False)


@triton.jit
def _fwd_store(
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
    HEAD_DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    LSE_PAIR: tl.constexpr = False,
):
    """Normalise the rows ``offs_m`` (with HAS_SINKS the sink ``sink2``, log2 domain, joins the
    denominator) and store them and, with STORE_LSE, their logsumexp (natural log, without the
    sink; -inf for a row with no allowed key, whose output is 0).  LSE_PAIR (float32 inputs): it
    goes to (*lse_shape, 2) memory instead, in log2 units as an exact sum hi + lo (hi = fl(m + log2 l),
    lo its rounding error): the backward's P = exp2((s - hi) - lo) keeps P = 1 exact where one key
    dominates a row at large scores (issue 38); the launcher writes the natural-log lse from hi."""
    row_ok = offs_m < sq
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, _sink_denominator(l_i, m_i, sink2, HAS_SINKS))
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = (acc * inv_l[:, None]).to(o_base.dtype.element_ty)
    o_ptrs = o_base + offs_m.to(tl.int64)[:, None] * sos + offs_dv[None, :]
    if BLOCK_DV == HEAD_DV:
        tl.store(o_ptrs, out, mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, out, mask=row_ok[:, None] & (offs_dv < HEAD_DV)[None, :])
    if LSE_PAIR:
        a = tl.where(empty, 0.0, m_i)  # an empty row's -inf would make the residual NaN
        b = tl.math.log2(tl.where(empty, 1.0, l_i))
        hi = a + b
        bb = hi - a  # TwoSum (additions only: no contraction into an FMA can change it)
        lo = (a - (hi - bb)) + (b - bb)
        p_ptrs = lse_base + offs_m.to(tl.int64) * sls
        tl.store(p_ptrs, tl.where(empty, float("-inf"), hi), mask=row_ok)
        tl.store(p_ptrs + 1, tl.where(empty, 0.0, lo), mask=row_ok)
    elif STORE_LSE:  # off for inference calls (nothing reads it)
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        tl.store(lse_base + offs_m.to(tl.int64) * sls, lse, mask=row_ok)
