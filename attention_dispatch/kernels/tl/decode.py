"""Decode against a KV cache (flash-decoding): a few new query rows per sequence over a long
cache, dense (B, Hkv, S, D) or paged (num_blocks, block_size, Hkv, D) with a block table.

One program per (key split, batch x kv head, row block): the query heads that share the kv
head are packed into the rows of one tile (row r is head ``r // Sq`` of the group, query
``r % Sq``), so each K/V byte is read once per kv head.  Sequence b attends to its first
``L_b = cache_seqlens[b] + n_new`` keys; key j is allowed for query i when
``i + L_b - Sq - wl <= j <= i + L_b - Sq + wr`` (HAS_WL / HAS_WR; causal is wr = 0).  With
several splits each program writes its normalised partial output and logsumexp (log2 domain)
and :func:`_decode_combine` merges them; a program past ``L_b`` writes an empty partial.
With ``APPEND`` the last ``n_new`` keys are read from k_new / v_new (a loop of their own after the
cached keys') and written into the cache by the programs of the first row block, each the new keys
of its split's range (the append fused: no separate pass).
Scores live in the log2 domain as in the other kernels (conventions: common.py); softcap, ALiBi
(diagonal offset L_b - Sq) and the sink as in tl/score.py, the sink added once: after the
combine pass when the keys are split.  STORE_LSE: each row's logsumexp (natural log, without the
sink) into Lse (B, Hq, Sq).  FULL_LENGTH: every
sequence is the whole cache (L_b = capacity; CacheSeqlens is not read).
"""

import triton
import triton.language as tl

from .common import LN2, LOG2E, _dot
from .score import _score_log2, _sink_denominator

LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(LN2)
# the new keys' loops (a few keys a call) in tiles of 16 keys: their (BLOCK_N, D) tiles of 64-bit addresses
# set the append kernel's register peak (sm90 split: dense 147 -> 96, paged 162 -> 128 registers; paged
# append +2.8% on the H100, E123)
NEW_N = tl.constexpr(16)


@triton.jit
def _cache_rows(
    offs_n, key_ok, b64, BlockTable, sbt, skb, sks, svb, svs, num_blocks, PAGED: tl.constexpr, PAGE: tl.constexpr
):
    """(K offsets, V offsets, ok) of keys ``offs_n`` of sequence b in the caches (without the kv head's).
    A block entry outside [0, num_blocks) (an input error, checked where that is free: kvcache._check_values)
    is clamped into the cache, so a read never leaves it; ``ok`` (``key_ok`` less those keys) is what a
    write must mask, as tl/kv_append.py does.  Clamping, not masking, the reads keeps the paged append
    kernel at 4 programs an SM (a masked read: 122 -> 138 registers, 2.8% slower on the H100)."""
    if PAGED:
        blk = tl.load(BlockTable + b64 * sbt + offs_n // PAGE, mask=key_ok, other=0)
        ok = key_ok & (blk >= 0) & (blk < num_blocks)
        blk = tl.maximum(tl.minimum(blk, num_blocks - 1), 0).to(tl.int64)
        slot = (offs_n % PAGE).to(tl.int64)
        return blk * skb + slot * sks, blk * svb + slot * svs, ok
    else:
        return b64 * skb + offs_n.to(tl.int64) * sks, b64 * svb + offs_n.to(tl.int64) * svs, key_ok


@triton.jit
def _attend(
    q, k, v_ptrs, kv_mask, m_i, l_i, acc, offs_n, key_ok, row_ok, qi, diag, seqlen, Sq, qk_scale,
    softcap_in, softcap_out, slope2, window_left, window_right,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    DOT_UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr,
):  # fmt: skip
    """One key tile of the online softmax: the running (max, sum, accumulator) after keys ``offs_n``
    (K tile ``k``; the V tile is loaded from ``v_ptrs`` once the scores are out)."""
    s, _ = _score_log2(
        _dot(q, tl.trans(k), DOT_UPCAST, DOT_IEEE),
        qk_scale,
        softcap_in,
        softcap_out,
        slope2,
        qi,
        offs_n,
        seqlen - Sq,
        SOFTCAP,
        HAS_ALIBI,
        False,
    )
    allowed = key_ok[None, :] & row_ok[:, None]
    if HAS_WR:
        allowed = allowed & (offs_n[None, :] <= diag[:, None] + window_right)
    if HAS_WL:
        allowed = allowed & (offs_n[None, :] >= diag[:, None] - window_left)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_UPCAST, DOT_IEEE)
    return m_new, l_i, acc


@triton.jit
def _decode_split(
    Q,
    K,
    V,
    CacheSeqlens,
    BlockTable,
    Out,
    OPart,
    LPart,
    KNew,
    VNew,
    Alibi,
    Sinks,
    Lse,
    qk_scale,
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
    sbt,
    sob,
    soh,
    sos,
    snb,
    snh,
    sns,
    Hq,
    Hkv,
    Sq,
    keys_per_split,
    n_new,
    capacity,
    num_blocks,
    window_left,
    window_right,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    SPLIT: tl.constexpr,
    APPEND: tl.constexpr,
    BH_AXIS0: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
    HAS_ALIBI: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
    STORE_LSE: tl.constexpr = False,
    FULL_LENGTH: tl.constexpr = False,
):
    # splits on axis 0 keep a sequence's key ranges in flight together (H100, separate runs: MHA B=8
    # 32k 2.85 against 2.72 TB/s); B * Hkv past the y axis' 65535 goes on axis 0 instead
    if BH_AXIS0:
        bh = tl.program_id(0)
        split = tl.program_id(1)
    else:
        split = tl.program_id(0)
        bh = tl.program_id(1)
    b = bh // Hkv
    hkv = bh % Hkv
    b64 = b.to(tl.int64)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * Sq
    head = hkv * GROUP + rows // Sq
    qi = rows % Sq
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D

    if FULL_LENGTH:  # every sequence as long as the cache (plain sdpa()): no lengths tensor
        seqlen = capacity
    else:  # never past the cache (a length past it is an input error, checked where that is free)
        seqlen = tl.minimum(tl.load(CacheSeqlens + b).to(tl.int32) + n_new, capacity)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seqlen)
    # the keys any row of this tile may see (queries sit at the end of the sequence)
    diag = qi + seqlen - Sq
    if HAS_WR:
        hi_key = tl.max(tl.where(row_ok, diag + window_right, -1), 0) + 1
        end = tl.minimum(end, hi_key)
    if HAS_WL:
        lo_key = tl.min(tl.where(row_ok, diag - window_left, seqlen), 0)
        start = tl.maximum(start, lo_key)

    q_ptrs = Q + b64 * sqb + head.to(tl.int64)[:, None] * sqh + qi.to(tl.int64)[:, None] * sqs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_ALIBI:  # each row's head's slope, (BLOCK_M, 1)
        slope2 = (tl.load(Alibi + b64 * sab + head.to(tl.int64) * sah, mask=row_ok, other=0.0) * LOG2E_C)[:, None]
    else:
        slope2 = 0.0
    if APPEND:  # the last n_new keys come from k_new / v_new (B, Hkv, n_new, D), not the cache
        old_end = seqlen - n_new
        new_base = b64 * snb + hkv.to(tl.int64) * snh
        cached_end = tl.minimum(end, old_end)
    else:
        cached_end = end
    # the cached keys: the memory-bound loop, free of the append's selects
    for n0 in range(start, cached_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < cached_end
        k_rows, v_rows, _ = _cache_rows(
            offs_n, key_ok, b64, BlockTable, sbt, skb, sks, svb, svs, num_blocks, PAGED, PAGE
        )
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(K + hkv.to(tl.int64) * skh + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v_ptrs = V + hkv.to(tl.int64) * svh + v_rows[:, None] + offs_d[None, :]
        m_i, l_i, acc = _attend(
            q, k, v_ptrs, kv_mask, m_i, l_i, acc, offs_n, key_ok, row_ok, qi, diag, seqlen, Sq, qk_scale,
            softcap_in, softcap_out, slope2, window_left, window_right,
            SOFTCAP, HAS_ALIBI, HAS_WL, HAS_WR, DOT_UPCAST, DOT_IEEE,
        )  # fmt: skip
    if APPEND:
        # the new keys this program attends to, read from k_new / v_new (another program may be writing them)
        for n0 in range(tl.maximum(start, old_end), end, NEW_N):
            offs_n = n0 + tl.arange(0, NEW_N)
            key_ok = offs_n < end
            kv_mask = key_ok[:, None] & d_ok[None, :]
            new_rows = new_base + (offs_n - old_end).to(tl.int64) * sns
            k = tl.load(KNew + new_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            m_i, l_i, acc = _attend(
                q, k, VNew + new_rows[:, None] + offs_d[None, :], kv_mask, m_i, l_i, acc, offs_n, key_ok, row_ok,
                qi, diag, seqlen, Sq, qk_scale, softcap_in, softcap_out, slope2, window_left, window_right,
                SOFTCAP, HAS_ALIBI, HAS_WL, HAS_WR, DOT_UPCAST, DOT_IEEE,
            )  # fmt: skip
        # the first row block's program writes the new keys of its split's whole range into the cache: its own
        # rows may see only part of them (causal or a right window with Sq past one row block)
        if tl.program_id(2) == 0:
            split_end = tl.minimum(split * keys_per_split + keys_per_split, seqlen)
            for n0 in range(tl.maximum(split * keys_per_split, old_end), split_end, NEW_N):
                offs_n = n0 + tl.arange(0, NEW_N)
                k_rows, v_rows, rows_ok = _cache_rows(
                    offs_n, offs_n < split_end, b64, BlockTable, sbt, skb, sks, svb, svs, num_blocks, PAGED, PAGE
                )
                kv_mask = rows_ok[:, None] & d_ok[None, :]
                new_rows = new_base + (offs_n - old_end).to(tl.int64) * sns
                k = tl.load(KNew + new_rows[:, None] + offs_d[None, :], mask=kv_mask)
                tl.store(K + hkv.to(tl.int64) * skh + k_rows[:, None] + offs_d[None, :], k, mask=kv_mask)
                v = tl.load(VNew + new_rows[:, None] + offs_d[None, :], mask=kv_mask)
                tl.store(V + hkv.to(tl.int64) * svh + v_rows[:, None] + offs_d[None, :], v, mask=kv_mask)

    empty = l_i == 0.0
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # without the sink
    lse_ptrs = Lse + (b64 * Hq + head) * Sq + qi  # (B, Hq, Sq) contiguous
    if SPLIT:  # partials without the sink: _decode_combine adds it once
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
    else:
        if HAS_SINKS:
            sink2 = tl.load(Sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E_C
        else:
            sink2 = 0.0
        out = acc / tl.where(empty, 1.0, _sink_denominator(l_i, m_i, sink2, HAS_SINKS))[:, None]
        if STORE_LSE:
            tl.store(lse_ptrs, lse2 * LN2_C, mask=row_ok)
    if SPLIT:
        # partials laid out (split, B, Hq, Sq, D) and (split, B, Hq, Sq), contiguous
        batch = (tl.num_programs(0) if BH_AXIS0 else tl.num_programs(1)) // Hkv
        part = ((split * batch + b).to(tl.int64) * Hq + head) * Sq + qi
        tl.store(OPart + part[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_ok[:, None])
        tl.store(LPart + part, lse2, mask=row_ok)
    else:
        o_ptrs = Out + b64 * sob + head.to(tl.int64)[:, None] * soh + qi.to(tl.int64)[:, None] * sos + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_combine(
    OPart,
    LPart,
    Out,
    Sinks,
    Lse,
    rows_total,
    num_splits,
    Hq,
    Sq,
    sob,
    soh,
    sos,
    SPLITS_P2: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    STORE_LSE: tl.constexpr = False,
):
    """Out[row] = sum_s w_s * OPart[s, row] / sum_s w_s with w_s = 2^(LPart[s, row] - max)
    (HAS_SINKS: the sink's 2^(sink - max) joins the denominator, once); a row no split saw
    (every LPart -inf) is 0.  STORE_LSE: Lse[row] = the merged logsumexp (natural log, without
    the sink).  One program per (B, Hq, Sq) row.  ``num_splits`` is an argument, not a constexpr:
    the split count grows with the key length, and a constexpr compiled a kernel per count
    (up to MAX_DECODE_SPLITS for one decode loop); SPLITS_P2 keeps the variants to its powers of two."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_P2)
    split_ok = splits < num_splits
    lse = tl.load(LPart + splits.to(tl.int64) * rows_total + row, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_use)
    total = tl.sum(w, 0)
    if STORE_LSE:
        tl.store(Lse + row, tl.where(total == 0.0, float("-inf"), (m_use + tl.log2(total)) * LN2_C))
    if HAS_SINKS:
        sink2 = tl.load(Sinks + (row // Sq) % Hq).to(tl.float32) * LOG2E_C
        total = _sink_denominator(total, m_use, sink2, True)
    offs_d = tl.arange(0, BLOCK_D)
    o = tl.load(
        OPart + (splits.to(tl.int64) * rows_total + row)[:, None] * BLOCK_D + offs_d[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    b = row // (Hq * Sq)
    h = (row // Sq) % Hq
    i = row % Sq
    tl.store(Out + b * sob + h * soh + i * sos + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_D)
