"""The backward's first pass (tl/backward.py's conventions): delta = rowsum(dO * O) per query row,
with the sinks' and a logsumexp gradient's share of it."""

import triton
import triton.language as tl

from .common import _load_rows

# a row whose sink outweighs its keys by more than e^EXCESS_SPLIT: the passes take the plain lse as P's
# normaliser (see _attn_bwd_preprocess); below it P with the sink stays far from float32's underflow
EXCESS_SPLIT = tl.constexpr(16.0)


@triton.jit
def _attn_bwd_preprocess(
    O,
    DO,
    Delta,
    CuQ,
    LSE,
    Sinks,
    DLse,
    LseTotal,
    DSinkRows,
    DOScaled,
    sob,
    soh,
    sos,
    sdob,
    sdoh,
    sdos,
    sdsb,
    sdsh,
    sdss,
    slb,
    slh,
    sls,
    H,
    seqlen_q,
    bh_start,
    HEAD_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SINK_GRAD: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """delta = rowsum(dO * O).  HAS_SINKS: LseTotal = logaddexp(lse, sink) (-inf kept for an
    empty row), P's normaliser in the dK/dV and dQ passes; SINK_GRAD: DSinkRows = -exp(sink -
    LseTotal) * delta per row, summed over rows on the host.  HAS_DLSE: a gradient flowing into
    lse adds dlse * P_plain to dS, i.e. delta -= dlse * exp(LseTotal - lse) (dlse without sinks;
    0 for an empty row).  With both, DOScaled (dO's shape, contiguous) is the dO the passes read: a
    row whose sink outweighs its keys by e^excess > e^EXCESS_SPLIT would need exp(excess) (inf past
    ~88: NaN) times P normalised with the sink (0 past ~88: the lse gradient lost), so its passes
    normalise P by the plain lse and take dO and delta scaled by r = exp(-excess), delta = r rowsum(dO
    O) - dlse: dS = P_plain (r dP - r delta + dlse) and dV = sum P_plain r dO, as before; other rows
    copy dO.  LSE, DLse, LseTotal and DSinkRows share delta's layout."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1) + bh_start
    b = pid_bh // H
    h = pid_bh % H
    if IS_VARLEN:
        q_start = tl.load(CuQ + b).to(tl.int64)
        sq = (tl.load(CuQ + b + 1).to(tl.int64) - q_start).to(tl.int32)
    else:
        q_start = 0
        sq = seqlen_q
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < sq
    rows = q_start + offs_m.to(tl.int64)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    o = _load_rows(
        O + b64 * sob + h64 * soh + rows[:, None] * sos + offs_d[None, :], row_ok, offs_d < HEAD_DV, BLOCK_DV == HEAD_DV
    )
    do = _load_rows(
        DO + b64 * sdob + h64 * sdoh + rows[:, None] * sdos + offs_d[None, :],
        row_ok,
        offs_d < HEAD_DV,
        BLOCK_DV == HEAD_DV,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    l_ptrs = b64 * slb + h64 * slh + rows * sls
    if HAS_SINKS | HAS_DLSE:
        lse = tl.load(LSE + l_ptrs, mask=row_ok, other=float("-inf"))
        empty = lse == float("-inf")
        lse_used = tl.where(empty, 0.0, lse)
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32)
        d = sink - lse_used
        # logaddexp(lse, sink) - lse = softplus(sink - lse) >= 0, +inf for a sink of +inf (not inf - inf)
        excess = tl.maximum(d, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(d)))
        lse_total = tl.where(empty, float("-inf"), lse_used + excess)
        if SINK_GRAD:
            p_sink = tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp(-d)))  # exp(sink - lse_total) = sigmoid(d)
            tl.store(DSinkRows + l_ptrs, -p_sink * delta, mask=row_ok)
    if HAS_DLSE:
        dlse = tl.load(DLse + l_ptrs, mask=row_ok, other=0.0)
        if HAS_SINKS:
            far = (excess > EXCESS_SPLIT) & ~empty
            r = tl.where(far, tl.exp(-excess), 1.0)
            lse_total = tl.where(far, lse, lse_total)
            delta = tl.where(far, r * delta - dlse, delta - dlse * tl.exp(tl.minimum(excess, EXCESS_SPLIT)))
            ds_ptrs = DOScaled + b64 * sdsb + h64 * sdsh + rows[:, None] * sdss + offs_d[None, :]
            tl.store(
                ds_ptrs,
                (do.to(tl.float32) * r[:, None]).to(DOScaled.dtype.element_ty),
                mask=row_ok[:, None] & (offs_d < HEAD_DV)[None, :],
            )
        else:
            delta = delta - dlse
        delta = tl.where(empty, 0.0, delta)
    if HAS_SINKS:
        tl.store(LseTotal + l_ptrs, lse_total, mask=row_ok)
    tl.store(Delta + l_ptrs, delta, mask=row_ok)
