"""The tl forward's head-dim-chunked key loop (head dims > 256, issue 36): each K/V block enters the
q k^T contraction and the P V product in (BLOCK_N, chunk) pieces, the query tile is a tuple of
(rows, chunk) pieces and the output one accumulator per chunk of Dv.  A smaller load unit lets
the first product start before the whole 64 KiB K block has landed and gives the compiler loads
of a size it can buffer beside the 64 KiB query tile (docs/experiments/head-dim-512.md).
Conventions: see common.py."""

import triton
import triton.language as tl

from .common import _dot, _dropout_keep, _lowp, _qk, _tile_desc
from .forward_io import _fwd_store
from .online_softmax import _fwd_softmax


@triton.jit
def _load_chunk(
    desc_or_ptr,
    base,
    row,
    offs_rows,
    stride,
    rows_ok,
    host_col0,
    C0: tl.constexpr,
    HEAD_D: tl.constexpr,
    CH: tl.constexpr,
    DESC: tl.constexpr,
    KV_HOST: tl.constexpr,
):
    """Columns C0 .. C0 + CH of the rows ``offs_rows`` (= row + arange) of one sequence's Q/K/V:
    through a descriptor of (rows, CH) blocks (KV_HOST 2: this head's columns start at
    ``host_col0``), or masked pointer loads (columns past HEAD_D read as 0)."""
    if KV_HOST == 2:
        return desc_or_ptr.load([row, host_col0 + C0])
    elif DESC:
        return desc_or_ptr.load([row, C0])
    else:
        cols = C0 + tl.arange(0, CH)
        ptrs = base + offs_rows.to(tl.int64)[:, None] * stride + cols[None, :]
        if C0 + CH <= HEAD_D:
            return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=rows_ok[:, None] & (cols < HEAD_D)[None, :], other=0.0)


@triton.jit
def _load_q_chunks(
    Q,
    q_base,
    row0,
    offs_m,
    sq,
    sqs,
    HEAD_DQK: tl.constexpr,
    HALF: tl.constexpr,
    CQ: tl.constexpr,
    VIA_DESC: tl.constexpr,
):
    """The (HALF, HEAD_DQK) query tile at rows ``row0``.. as a tuple of (HALF, CQ) chunks (only
    those holding a column below HEAD_DQK): pointer loads, or with VIA_DESC TMA copies through a
    descriptor built here (forward_io._load_q says why)."""
    NCQ: tl.constexpr = (HEAD_DQK + CQ - 1) // CQ
    desc = _tile_desc(Q, q_base, sq, sqs, HEAD_DQK, HALF, CQ, VIA_DESC)
    qs = ()
    for c in tl.static_range(NCQ):
        qs = qs + (_load_chunk(desc, q_base, row0, offs_m, sqs, offs_m < sq, 0, c * CQ, HEAD_DQK, CQ, VIA_DESC, 0),)
    return qs


@triton.jit
def _fwd_range_dk(
    accs,
    l_i,
    m_i,
    qs,
    m0,
    offs_m,
    rng_rows,
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
    CQ: tl.constexpr,
    CV: tl.constexpr,
    USE_DESC: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    ROUND_P: tl.constexpr,
    KV_HOST: tl.constexpr,
    EXACT_P: tl.constexpr,
):
    """forward._fwd_range (one query tile, SUBTILES=1) over key blocks [n_lo, n_hi) with K in
    (BLOCK_N, CQ) and V in (BLOCK_N, CV) chunks: the scores are the sum of the chunks' products
    (one accumulating chain of dots), then one softmax, then each output chunk's rescale and
    product.  ``accs``: the tuple of (rows, CV) fp32 accumulators."""
    NCQ: tl.constexpr = (HEAD_DQK + CQ - 1) // CQ
    NCV: tl.constexpr = (HEAD_DV + CV - 1) // CV
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + offs_n0
        row = kv_row0 + start_n
        kv_ok = offs_n < sk
        ks = ()
        for c in tl.static_range(NCQ):
            ks = ks + (
                _load_chunk(k_desc, k_base, row, offs_n, sks, kv_ok, k_col0, c * CQ, HEAD_DQK, CQ, USE_DESC, KV_HOST),
            )
        vs = ()
        for c in tl.static_range(NCV):
            vs = vs + (
                _load_chunk(v_desc, v_base, row, offs_n, svs, kv_ok, v_col0, c * CV, HEAD_DV, CV, USE_DESC, KV_HOST),
            )
        s = _qk(qs[0], ks[0], DOT_UPCAST, DOT_IEEE, EXACT_P)
        for c in tl.static_range(1, NCQ):
            if DOT_UPCAST | DOT_IEEE | (EXACT_P != 0):
                s += _qk(qs[c], ks[c], DOT_UPCAST, DOT_IEEE, EXACT_P)
            else:  # one wgmma chain accumulating in place
                s = tl.dot(qs[c], tl.trans(ks[c]), s)
        p, alpha, l_i, m_i = _fwd_softmax(
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
        if HAS_DROPOUT:
            p = tl.where(_dropout_keep(seed, rng_rows, start_n, dropout_p, BLOCK_N, False), p, 0.0)
        p = _lowp(p, vs[0].dtype, ROUND_P)
        new = ()
        for c in tl.static_range(NCV):
            acc = accs[c] * alpha[:, None]
            if DOT_UPCAST | DOT_IEEE:
                acc += _dot(p, vs[c], DOT_UPCAST, DOT_IEEE)
            else:
                acc = tl.dot(p, vs[c], acc)
            new = new + (acc,)
        accs = new
    return accs, l_i, m_i


@triton.jit
def _fwd_store_dk(
    accs,
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
    HEAD_DV: tl.constexpr,
    CV: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    LSE_PAIR: tl.constexpr,
):
    """forward_io._fwd_store of each (rows, CV) accumulator at its columns; the logsumexp once."""
    NCV: tl.constexpr = (HEAD_DV + CV - 1) // CV
    offs = tl.arange(0, CV)
    for c in tl.static_range(NCV):
        if c == 0:
            _fwd_store(
                accs[c],
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
                offs,
                CV if HEAD_DV - c * CV >= CV else HEAD_DV - c * CV,  # this chunk's columns
                CV,
                HAS_DROPOUT,
                STORE_LSE,
                HAS_SINKS,
                LSE_PAIR,
            )
        else:
            _fwd_store(
                accs[c],
                l_i,
                m_i,
                o_base + c * CV,
                lse_base,
                offs_m,
                sq,
                sos,
                sls,
                dropout_p,
                sink2,
                offs,
                CV if HEAD_DV - c * CV >= CV else HEAD_DV - c * CV,  # this chunk's columns
                CV,
                HAS_DROPOUT,
                False,
                HAS_SINKS,
                False,
            )
