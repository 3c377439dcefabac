"""The numerics guard's sampled check of a dense 16-bit call as one kernel (issue 38): each
program recomputes one picked query row from the call's own tensors (no gathered copies), in
float64 (the reference) and in the input dtype step by step (the rule's base: every op rounded
to the input dtype as torch's bf16/fp16 ops round, sums accumulated in float32), and folds its
two errors into the payload's first two slots with an atomic max (policy/guard_triton.py).

Scores (float64, (2, n, Sk)): each row's scores in float64 and in the input dtype, kept from
the pass over the keys for the two that follow (the keys and values are each read once).
Buf (float64, 3 + 7 n): [error, base, the picks' 7 columns of n: batch, head, row, kv head,
diagonal, band's lo, hi, then the scale] (a float64 scale: a Python float argument would be
float32); the errors start at 0 and are non-negative, so their int64
bits order as their values (Bits: the same memory as int64).  A NaN error is stored as inf.
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
def _scores(
    K,
    k_row,
    q64,
    q32,
    j,
    d,
    Sk,
    D,
    sks,
    skd,
    scale,
    lo,
    hi,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """One block of keys j: the scores in float64 and in the input dtype (bmm, then * scale,
    each rounded), -inf where a key is not allowed (past Sk, outside the band)."""
    ok = j < Sk
    if HAS_LO:
        ok = ok & (j >= lo)
    if HAS_HI:
        ok = ok & (j <= hi)
    k = tl.load(
        K + k_row + j[:, None].to(tl.int64) * sks + d[None, :] * skd,
        mask=(j < Sk)[:, None] & (d < D)[None, :],
        other=0.0,
    )
    k = k.to(tl.float32)
    s64 = tl.sum(k.to(tl.float64) * q64[None, :], 1) * scale  # products exact, summed in float64
    s16 = _rnd(_rnd(tl.sum(k * q32[None, :], 1), IS_BF16) * scale.to(tl.float32), IS_BF16)
    return tl.where(ok, s64, float("-inf")), tl.where(ok, s16, float("-inf"))


@triton.jit
def _guard_check(
    Q, K, V, O, Buf, Bits, Scores,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod,
    n, Sk, D, Dv,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, IS_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    b = tl.load(Buf + 2 + r).to(tl.int64)
    h = tl.load(Buf + 2 + n + r).to(tl.int64)
    i = tl.load(Buf + 2 + 2 * n + r).to(tl.int64)
    kv = tl.load(Buf + 2 + 3 * n + r).to(tl.int64)
    lo = tl.load(Buf + 2 + 5 * n + r).to(tl.int64)
    hi = tl.load(Buf + 2 + 6 * n + r).to(tl.int64)
    scale = tl.load(Buf + 2 + 7 * n)
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    jb = tl.arange(0, BLOCK_N)
    q32 = tl.load(Q + b * sqb + h * sqh + i * sqs + d * sqd, mask=d < D, other=0.0).to(tl.float32)
    q64 = q32.to(tl.float64)  # 16-bit -> float64 through float32 (exact)
    k_row, v_row = b * skb + kv * skh, b * svb + kv * svh
    S64, S16 = Scores + r.to(tl.int64) * Sk, Scores + (n + r).to(tl.int64) * Sk  # this row's scores, kept
    # pass 1 (keys read once): the scores, kept, and the row's max in each precision
    m64 = tl.full((), float("-inf"), tl.float64)
    m16 = tl.full((), float("-inf"), tl.float32)
    for start in range(0, Sk, BLOCK_N):
        j = start + jb
        s64, s16 = _scores(K, k_row, q64, q32, j, d, Sk, D, sks, skd, scale, lo, hi, HAS_LO, HAS_HI, IS_BF16)
        tl.store(S64 + j, s64, mask=j < Sk)
        tl.store(S16 + j, s16.to(tl.float64), mask=j < Sk)
        m64 = tl.maximum(m64, tl.max(s64, 0))
        m16 = tl.maximum(m16, tl.max(s16, 0))
    tl.debug_barrier()  # the kept scores, stored by every thread, read by others below
    # a row without keys, or a non-finite max, shifts by 0
    m64 = tl.where((m64 == m64) & (tl.abs(m64) < float("inf")), m64, 0.0)
    m16 = tl.where((m16 == m16) & (tl.abs(m16) < float("inf")), m16, 0.0)
    # pass 2: the sums (the input dtype's: exp(s - m) rounded step by step, summed in float32, rounded)
    z64 = tl.zeros((), tl.float64)
    z16 = tl.zeros((), tl.float32)
    for start in range(0, Sk, BLOCK_S):
        j = start + tl.arange(0, BLOCK_S)
        s64 = tl.load(S64 + j, mask=j < Sk, other=float("-inf"))
        s16 = tl.load(S16 + j, mask=j < Sk, other=float("-inf")).to(tl.float32)
        z64 += tl.sum(tl.exp(s64 - m64), 0)
        z16 += tl.sum(_rnd(tl.exp(_rnd(s16 - m16, IS_BF16)), IS_BF16), 0)
    z64 = tl.maximum(z64, 1.0)  # >= 1 wherever a key counts (the max's exp is 1); 1 for a row without keys
    z16 = tl.maximum(_rnd(z16, IS_BF16), 1.0)
    # pass 3 (values read once): the outputs (the input dtype's p rounded, p v summed in float32, rounded once)
    o64 = tl.zeros((BLOCK_DV,), tl.float64)
    o16 = tl.zeros((BLOCK_DV,), tl.float32)
    for start in range(0, Sk, BLOCK_N):
        j = start + jb
        s64 = tl.load(S64 + j, mask=j < Sk, other=float("-inf"))
        s16 = tl.load(S16 + j, mask=j < Sk, other=float("-inf")).to(tl.float32)
        v32 = tl.load(
            V + v_row + j[:, None].to(tl.int64) * svs + e[None, :] * svd,
            mask=(j < Sk)[:, None] & (e < Dv)[None, :],
            other=0.0,
        ).to(tl.float32)
        p64 = tl.exp(s64 - m64) / z64
        p16 = _rnd(_rnd(tl.exp(_rnd(s16 - m16, IS_BF16)), IS_BF16) / z16, IS_BF16)
        o64 += tl.sum(p64[:, None] * v32.to(tl.float64), 0)
        o16 += tl.sum(p16[:, None] * v32, 0)
    o16 = _rnd(o16, IS_BF16)
    got = tl.load(O + b * sob + h * soh + i * sos + e * sod, mask=e < Dv, other=0.0).to(tl.float32).to(tl.float64)
    inf = float("inf")
    error = tl.where(got == o64, 0.0, tl.abs(got - o64))  # equal entries (infinities too) count 0
    base = tl.where(o16.to(tl.float64) == o64, 0.0, tl.abs(o16.to(tl.float64) - o64))
    error = tl.max(tl.where(error == error, error, inf), 0)  # NaN is read as inf
    base = tl.max(tl.where(base == base, base, inf), 0)
    tl.atomic_max(Bits, error.to(tl.int64, bitcast=True))
    tl.atomic_max(Bits + 1, base.to(tl.int64, bitcast=True))
