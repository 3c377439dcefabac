"""The numerics guard's sampled check of a dense 16-bit call (issue 38): each picked query row
recomputed from the call's own tensors (no gathered copies) in float64 (the reference) and in
the input dtype step by step (the rule's base), its keys split across programs flash-decoding
style so that a check fills the GPU instead of 8 SMs (policy/guard_triton.py).

Grid (n rows, splits): program (r, s) reads keys and values [s BLOCK_N, (s + 1) BLOCK_N) once
and stores its partial to Parts (float64, (n, splits, 4 + 2 Dv)): [max, sum] in float64, the
same in the input dtype, the float64 output unnormalised, the input dtype's normalised by its
block's sum.  Within a block the input dtype follows torch's bf16/fp16 softmax step by step
(every op rounded, sums in float32), so a one-block row is the torch path's computation; the
row's last program (an atomic counter per row) merges the blocks flash-decoding style (rescales
and weights in float32), rounds the output once, measures the two errors against the backend's
row and folds them into the payload's first two slots with an atomic max.

Buf (float64, 3 + 8 n): [error, base, the picks' 7 columns of n: batch, head, row, kv head,
diagonal, band's lo, hi, the scale (float64: a Python float argument would be float32), then
n counters at 0]; Bits is the same memory as int64: the errors start at 0 and are
non-negative, so their bits order as their values.  A NaN error is stored as inf.
"""

import triton
import triton.language as tl


@triton.jit
def _rnd(x, IS_BF16: tl.constexpr):
    """float32 x rounded to the input dtype (to nearest even), back in float32.  bf16 by its
    bits (the interpreter has no bf16 arithmetic); inf and -inf stay."""
    if IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float16).to(tl.float32)


@triton.jit
def _finite_or_0(m):
    """A shift for exp(s - m): a block without keys, or a non-finite max, shifts by 0."""
    return tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)


@triton.jit
def _rescale(m_old, m_new):
    """exp(m_old - m_new) for a running or partial sum: 0 where it had no keys (its sums are 0)."""
    return tl.where(m_old == float("-inf"), 0.0, tl.exp(_finite_or_0(m_old) - _finite_or_0(m_new)))


@triton.jit
def _guard_check(
    Q, K, V, O, Buf, Bits, Parts,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod,
    n, Sk, D, Dv, splits,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, IS_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.load(Buf + 2 + r).to(tl.int64)
    h = tl.load(Buf + 2 + n + r).to(tl.int64)
    i = tl.load(Buf + 2 + 2 * n + r).to(tl.int64)
    kv = tl.load(Buf + 2 + 3 * n + r).to(tl.int64)
    lo = tl.load(Buf + 2 + 5 * n + r).to(tl.int64)
    hi = tl.load(Buf + 2 + 6 * n + r).to(tl.int64)
    scale = tl.load(Buf + 2 + 7 * n)
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    j = split.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = j < Sk
    if HAS_LO:
        ok = ok & (j >= lo)
    if HAS_HI:
        ok = ok & (j <= hi)
    W = 4 + 2 * Dv
    part = Parts + (r.to(tl.int64) * splits + split) * W
    m64 = tl.full((), float("-inf"), tl.float64)
    m16 = tl.full((), float("-inf"), tl.float32)
    z64 = tl.zeros((), tl.float64)
    z16 = tl.zeros((), tl.float32)
    o64 = tl.zeros((BLOCK_DV,), tl.float64)
    o16 = tl.zeros((BLOCK_DV,), tl.float32)
    if tl.max(ok.to(tl.int32), 0) > 0:  # keys outside the band are never read
        q32 = tl.load(Q + b * sqb + h * sqh + i * sqs + d * sqd, mask=d < D, other=0.0).to(tl.float32)
        k = tl.load(
            K + b * skb + kv * skh + j[:, None] * sks + d[None, :] * skd,
            mask=ok[:, None] & (d < D)[None, :],
            other=0.0,
        ).to(tl.float32)
        # scores: float64 (16-bit -> float64 through float32 is exact; products exact, summed in
        # float64); the input dtype's bmm, then * scale, each rounded
        s64 = tl.where(ok, tl.sum(k.to(tl.float64) * q32.to(tl.float64)[None, :], 1) * scale, float("-inf"))
        s16 = _rnd(_rnd(tl.sum(k * q32[None, :], 1), IS_BF16) * scale.to(tl.float32), IS_BF16)
        s16 = tl.where(ok, s16, float("-inf"))
        m64 = tl.max(s64, 0)
        m16 = tl.max(s16, 0)
        p64 = tl.exp(s64 - _finite_or_0(m64))
        p16 = _rnd(tl.exp(_rnd(s16 - _finite_or_0(m16), IS_BF16)), IS_BF16)
        z64 = tl.sum(p64, 0)
        z16 = _rnd(tl.sum(p16, 0), IS_BF16)
        p16 = _rnd(p16 / tl.maximum(z16, 1.0), IS_BF16)  # normalised and rounded as torch's softmax
        v32 = tl.load(
            V + b * svb + kv * svh + j[:, None] * svs + e[None, :] * svd,
            mask=ok[:, None] & (e < Dv)[None, :],
            other=0.0,
        ).to(tl.float32)
        o64 = tl.sum(p64[:, None] * v32.to(tl.float64), 0)
        o16 = tl.sum(p16[:, None] * v32, 0)
    # this block's partial: max and sum in float64, in the input dtype, then the outputs (float64's
    # unnormalised, the input dtype's normalised by its own sum)
    tl.store(part, m64)
    tl.store(part + 1, z64)
    tl.store(part + 2, m16.to(tl.float64))
    tl.store(part + 3, z16.to(tl.float64))
    tl.store(part + 4 + e, o64, mask=e < Dv)
    tl.store(part + 4 + Dv + e, o16.to(tl.float64), mask=e < Dv)
    tl.debug_barrier()  # every thread's stores before the counter's release
    if tl.atomic_add(Bits + 3 + 7 * n + r, 1, sem="acq_rel") == splits - 1:  # the row's last: it merges
        _merge(O, Bits, Parts + r.to(tl.int64) * splits * W, b * sob + h * soh + i * sos, sod,
               splits, Dv, W, IS_BF16, BLOCK_P, BLOCK_DV)  # fmt: skip


@triton.jit
def _column(Part, c, s, ok, W, other):
    """Column c of the partials s where ok (read past the cache: other programs stored them)."""
    return tl.load(Part + s * W + c, mask=ok, other=other, cache_modifier=".cg")


@triton.jit
def _merge(O, Bits, Part, o_row, sod, splits, Dv, W, IS_BF16: tl.constexpr, BLOCK_P: tl.constexpr,
           BLOCK_DV: tl.constexpr):  # fmt: skip
    """The row's partials merged (max, rescaled sums and outputs), its two errors folded in."""
    e = tl.arange(0, BLOCK_DV)
    p = tl.arange(0, BLOCK_P)
    m64 = tl.full((), float("-inf"), tl.float64)
    m16 = tl.full((), float("-inf"), tl.float32)
    for start in range(0, splits, BLOCK_P):
        m64 = tl.maximum(m64, tl.max(_column(Part, 0, start + p, start + p < splits, W, float("-inf")), 0))
        m16 = tl.maximum(
            m16, tl.max(_column(Part, 2, start + p, start + p < splits, W, float("-inf")).to(tl.float32), 0)
        )
    m64, m16 = _finite_or_0(m64), _finite_or_0(m16)
    z64 = tl.zeros((), tl.float64)
    z16 = tl.zeros((), tl.float32)
    o64 = tl.zeros((BLOCK_DV,), tl.float64)
    o16 = tl.zeros((BLOCK_DV,), tl.float32)
    for start in range(0, splits, BLOCK_P):
        s = start + p
        a64 = _rescale(_column(Part, 0, s, s < splits, W, float("-inf")), m64)
        a16 = _rescale(_column(Part, 2, s, s < splits, W, float("-inf")).to(tl.float32), m16)
        z64 += tl.sum(a64 * _column(Part, 1, s, s < splits, W, 0.0), 0)
        z16 += tl.sum(a16 * _column(Part, 3, s, s < splits, W, 0.0).to(tl.float32), 0)
        both = (s < splits)[:, None] & (e < Dv)[None, :]
        o64 += tl.sum(a64[:, None] * _column(Part, 4 + e[None, :], s[:, None], both, W, 0.0), 0)
    z16 = tl.maximum(z16, 1.0)
    for start in range(0, splits, BLOCK_P):  # the input dtype's outputs weighted by their share of the sum
        s = start + p
        w = _rescale(_column(Part, 2, s, s < splits, W, float("-inf")).to(tl.float32), m16)
        w = w * _column(Part, 3, s, s < splits, W, 0.0).to(tl.float32) / z16  # one block: exactly 1
        both = (s < splits)[:, None] & (e < Dv)[None, :]
        o16 += tl.sum(w[:, None] * _column(Part, 4 + Dv + e[None, :], s[:, None], both, W, 0.0).to(tl.float32), 0)
    # >= 1 wherever a key counts (the max's exp is 1); 1 for a row without keys
    o64 = o64 / tl.maximum(z64, 1.0)
    o16 = _rnd(o16, IS_BF16).to(tl.float64)
    got = tl.load(O + o_row + e * sod, mask=e < Dv, other=0.0).to(tl.float32).to(tl.float64)
    inf = float("inf")
    error = tl.where(got == o64, 0.0, tl.abs(got - o64))  # equal entries (infinities too) count 0
    base = tl.where(o16 == o64, 0.0, tl.abs(o16 - o64))
    error = tl.max(tl.where(error == error, error, inf), 0)  # NaN is read as inf
    base = tl.max(tl.where(base == base, base, inf), 0)
    tl.atomic_max(Bits, error.to(tl.int64, bitcast=True))
    tl.atomic_max(Bits + 1, base.to(tl.int64, bitcast=True))
