"""The warp-specialised forward: a K/V loader warp and two or three consumer warpgroups
(conventions and scope: common.py)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .common import (
    LENS_TENSOR,
    LN2,
    LOG2E,
    SLOT_BARRIER,
    WG_ROWS,
    _bias_ring,
    _bias_row,
    _cache_tiles,
    _kv_ring,
    _kv_tiles,
    _load_bias_tile,
    _query_block,
    _slot_sync,
    _store_rows,
    _tile_origin,
    _wgmma_layout,
)
from .forward_softmax import _consume, _own_tiles, _pass_tiles


@gluon.jit
def _ws_loader(
    args,
    WG: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    STORE_LSE: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    BIAS_STAGES: gl.constexpr,
    KV_LENS: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    WARP_RELEASE: gl.constexpr = False,
):
    """The forward's TMA loader partition (``args``: _attn_fwd_ws's runtime partition arguments; the dQ pass's
    too, whose consumers release slots on the mbarriers); WARP_RELEASE: the consumers release them per warp
    (common._release_slot)."""
    (
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        lse_ptr,
        q_bufs,
        k_bufs,
        v_bufs,
        bars,
        bias,
        qk_scale,
        seq_q,
        seq_k,
        num_heads,
        group,
        n_m_blocks,
        lpt_rows,
        kv_lens,
        n_new,
        sinks_ptr,
        softcap_in,
        softcap,
        alibi_ptr,
        alibi_sb,
        alibi_sh,
        alibi_off,
    ) = args
    # the tiles follow from the shared memory the kernel allocated
    BLOCK_M: gl.constexpr = WG_ROWS
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_bufs.shape[0]
    NUM_WG: gl.constexpr = q_bufs.shape[0]
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    HEAD_D: gl.constexpr = k_desc.block_type.shape[1]
    pid_m, pid_bh = _query_block(n_m_blocks, num_heads, lpt_rows, BATCH_MINOR)
    kv_row, kv_col = _tile_origin(pid_bh, group, num_heads, seq_k, KV_ROWS, HEAD_D)
    if KV_LENS:
        b = pid_bh // num_heads
        first, n_tiles, _, _ = _cache_tiles(
            pid_m, kv_lens, n_new, b, seq_q, seq_k, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, NUM_WG, KV_LENS
        )
    else:
        first, n_tiles, _ = _kv_tiles(pid_m, seq_k, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, NUM_WG)
    if HAS_BIAS:
        bias_row = _bias_row(pid_bh, num_heads, bias[4], bias[5]) + pid_m * NUM_WG * BLOCK_M
    for j in range(n_tiles):
        key0 = (first + j) * BLOCK_N
        s = j % STAGES
        ph = (j // STAGES) & 1
        # a fresh barrier counts as having completed phase 1: the first lap does not wait
        if WARP_RELEASE:
            if j >= STAGES:
                _slot_sync(SLOT_BARRIER + s)
        else:
            mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + key0, kv_col], k_ready.index(s), k_bufs.index(s))
        if HAS_BIAS:  # needed right after S_j, before V_j
            _load_bias_tile(bias, j, bias_row, key0, BIAS_STAGES)
        if WARP_RELEASE:
            if j >= STAGES:
                _slot_sync(SLOT_BARRIER + STAGES + s)
        else:
            mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + key0, kv_col], v_ready.index(s), v_bufs.index(s))
    if WARP_RELEASE:  # the last lap's releases waited on too: no named barrier is left half-arrived at exit
        for j in range(gl.maximum(n_tiles - STAGES, 0), n_tiles):
            _slot_sync(SLOT_BARRIER + j % STAGES)
            _slot_sync(SLOT_BARRIER + STAGES + j % STAGES)


@gluon.jit
def _ws_consumer(
    args,
    WG: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    STORE_LSE: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    BIAS_STAGES: gl.constexpr,
    KV_LENS: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    OWN_TILES: gl.constexpr,
    WARP_RELEASE: gl.constexpr,
):
    """Consumer warpgroup ``WG`` of the forward (``args``: _attn_fwd_ws's runtime partition arguments)."""
    (
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        lse_ptr,
        q_bufs,
        k_bufs,
        v_bufs,
        bars,
        bias,
        qk_scale,
        seq_q,
        seq_k,
        num_heads,
        group,
        n_m_blocks,
        lpt_rows,
        kv_lens,
        n_new,
        sinks_ptr,
        softcap_in,
        softcap,
        alibi_ptr,
        alibi_sb,
        alibi_sh,
        alibi_off,
    ) = args
    # the tiles follow from the shared memory the kernel allocated
    BLOCK_M: gl.constexpr = WG_ROWS
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    NUM_WG: gl.constexpr = q_bufs.shape[0]
    q_bar = bars[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    o_layout: gl.constexpr = _wgmma_layout(HEAD_D)
    row_s: gl.constexpr = gl.SliceLayout(1, _wgmma_layout(BLOCK_N))
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_m, pid_bh = _query_block(n_m_blocks, num_heads, lpt_rows, BATCH_MINOR)
    q_start = pid_m * NUM_WG * BLOCK_M + WG * BLOCK_M  # this warpgroup's first query row
    q_row, q_col = _tile_origin(pid_bh, 1, num_heads, seq_q, Q_ROWS, HEAD_D)
    q_buf = q_bufs.index(WG)
    mbarrier.expect(q_bar.index(WG), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + q_start, q_col], q_bar.index(WG), q_buf)

    if KV_LENS:
        first, n_tiles, n_full, diag = _cache_tiles(
            pid_m,
            kv_lens,
            n_new,
            pid_bh // num_heads,
            seq_q,
            seq_k,
            WINDOW_LEFT,
            WINDOW_RIGHT,
            BLOCK_M,
            BLOCK_N,
            NUM_WG,
            KV_LENS,
        )
    else:
        first, n_tiles, n_full = _kv_tiles(pid_m, seq_k, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, NUM_WG)
        diag = 0
    # a row's keys are masked against its diagonal: query row + diag (bottom-right for a KV cache)
    rows = q_start + diag + gl.arange(0, BLOCK_M, row_s)
    # a bias can mask a whole tile, and so can a window's left bound (the second warpgroup's
    # rows start past the program's first key tile), and a cache shorter than Sq all of a row's
    # keys: the running max may still be -inf
    LENS: gl.constexpr = KV_LENS == LENS_TENSOR
    MAY_EMPTY: gl.constexpr = HAS_BIAS or WINDOW_LEFT >= 0 or LENS
    mbarrier.wait(q_bar.index(WG), 0)
    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = gl.load(alibi_ptr + (pid_bh // num_heads) * alibi_sb + (pid_bh % num_heads) * alibi_sh)
    # what this warpgroup's pass reads. A KV cache: each sequence's first L keys as a causal band from row q_start +
    # diag (not causal: every row's diagonal at key L - 1, masking the keys past L in the last tile), the V rows past
    # L zeroed. Otherwise the call's band; OWN_TILES (causal): only this warpgroup's key tiles, up to its own
    # diagonal, the ring's other slots released unread (E151; a bias ring's slots are released by every consumer)
    gl.static_assert(not (OWN_TILES and (HAS_BIAS or KV_LENS)))
    BAND_LEFT: gl.constexpr = -1 if KV_LENS else WINDOW_LEFT
    BAND_RIGHT: gl.constexpr = 0 if KV_LENS else WINDOW_RIGHT
    n_use = n_tiles
    n_full_use = n_full
    v_keys = 0
    if KV_LENS:
        v_keys = diag + seq_q
    if OWN_TILES:
        n_use, n_full_use = _own_tiles(q_start, seq_q, n_tiles, n_full, BLOCK_N)
    if n_use > 0 or not (KV_LENS or OWN_TILES):
        band_rows = rows
        if KV_LENS and WINDOW_LEFT < 0 and WINDOW_RIGHT < 0:
            band_rows = gl.full([BLOCK_M], v_keys - 1, gl.int32, row_s)
        acc, m_i, l_i = _consume(
            q_buf,
            k_bufs,
            v_bufs,
            bars,
            bias,
            qk_scale,
            band_rows,
            q_start + diag,
            first,
            n_use,
            n_full_use,
            WG,
            BAND_LEFT,
            BAND_RIGHT,
            HAS_BIAS,
            BIAS_STAGES,
            MAY_EMPTY,
            softcap_in,
            softcap,
            SOFTCAP,
            alibi_slope,
            alibi_off,
            HAS_ALIBI,
            v_keys,
            LENS,
            WARP_RELEASE,
        )
    else:  # no key tile: a cache row before its first key (L = 0 too; made 0 below), or OWN_TILES rows before
        # their first key or past Sq (a sum of 1: 0 out, -inf logsumexp, and nothing stored past Sq)
        acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l_i = gl.full([BLOCK_M], 0.0 if KV_LENS else 1.0, gl.float32, row_s)
    if OWN_TILES:
        _pass_tiles(bars, n_use, n_tiles, k_bufs.shape[0])

    if HAS_BIAS or LENS:  # a row with no allowed key: output 0, logsumexp -inf
        empty = l_i == 0.0
        l_i = gl.where(empty, 1.0, l_i)
        m_i = gl.where(empty, float("-inf"), m_i)
    denominator = l_i
    if HAS_SINKS:  # the sink's 2^(sink - max) (log2 domain): in the denominator, not in the logsumexp
        sink2 = gl.load(sinks_ptr + pid_bh % num_heads).to(gl.float32) * LOG2E
        denominator = l_i + gl.exp2(sink2 - gl.where(m_i == float("-inf"), sink2, m_i))
        if HAS_BIAS or LENS:
            denominator = gl.where(empty, 1.0, denominator)
    acc = acc / gl.convert_layout(denominator, row_o)[:, None]
    # with three warpgroups (Sq a multiple of 64, not of 192) the last program's last ones can
    # start past Sq: they ran on the next head's rows (or TMA's zeros) and store nothing
    if q_start < seq_q:
        if STORE_LSE:
            gl.store(lse_ptr + pid_bh * seq_q + rows - diag, (m_i + gl.log2(l_i)) * LN2)
        # the output leaves through this warpgroup's Q buffer (Q is no longer read)
        _store_rows(q_buf, acc.to(dtype), o_desc, pid_bh * seq_q + q_start)


@gluon.jit
def _attn_fwd_ws(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    bias_desc,
    lse_ptr,
    qk_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    n_m_blocks,
    lpt_rows,
    bias_batch_rows,
    bias_head_rows,
    kv_lens,
    n_new,
    sinks_ptr,
    softcap_in,
    softcap,
    alibi_ptr,
    alibi_sb,
    alibi_sh,
    alibi_off,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    STORE_LSE: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    BIAS_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    NUM_WG: gl.constexpr,
    KV_LENS: gl.constexpr,
    SOFTCAP: gl.constexpr = False,
    HAS_SINKS: gl.constexpr = False,
    HAS_ALIBI: gl.constexpr = False,
    OWN_TILES: gl.constexpr = False,
    WARP_RELEASE: gl.constexpr = False,
):
    """Grid (cdiv(Sq, NUM_WG * 64), B * Hq); one program: NUM_WG * 64 query rows of one (b, h),
    O (B*Hq*Sq, D) rows.  NUM_WG: consumer warpgroups, 2 or 3 (FA3's 192-row tiles at head dim 64,
    where the softmax is as long as the products and a third warpgroup keeps the tensor cores fed).
    ``bias_desc`` (HAS_BIAS): (rows, Sk) bias matrix, tiles (NUM_WG * 64, BLOCK_N); None without.
    A bias needs two warpgroups: a TMA tile's rows are a power of two.  SOFTCAP: scores
    ``softcap * tanh(q k^T * softcap_in)`` (softcap_in = scale / softcap) before the bias;
    HAS_SINKS: the head's sink (``sinks_ptr``, (Hq,)) joins each row's denominator, not its
    logsumexp (not with KV_LENS: gluon/route.score_features_reason); HAS_ALIBI: minus
    ``slope[b, h] * |i + alibi_off - j|`` (``alibi_ptr`` fp32 (B, Hq), strides alibi_sb / alibi_sh;
    not with KV_LENS).  KV_LENS: 0 (every key) or LENS_TENSOR (common.py; ``kv_lens``,
    ``n_new``: the keys each sequence reads, its queries aligned to their end).  OWN_TILES (causal, no
    bias, no KV_LENS): each consumer reads only its key tiles up to its own diagonal and releases the
    rest of the ring's slots unread (configs.WsConfig.forward_own_tiles).  WARP_RELEASE (two consumers, no
    OWN_TILES): K/V slots released per warp on named barriers (common._release_slot, configs.WsConfig.warp_release)."""
    BLOCK_M: gl.constexpr = WG_ROWS  # noqa: F841 - the tile height the docstring names
    gl.static_assert(NUM_WG == 2 or (NUM_WG == 3 and not HAS_BIAS))
    # common.SLOT_THREADS counts two consumers; 16 named barriers; _pass_tiles releases on the mbarriers
    gl.static_assert(not WARP_RELEASE or (NUM_WG == 2 and SLOT_BARRIER + 2 * STAGES <= 16 and not OWN_TILES))
    q_bufs, k_bufs, v_bufs, bars = _kv_ring(q_desc, k_desc, v_desc, STAGES, NUM_WG)
    if HAS_BIAS:
        bias = _bias_ring(bias_desc, bias_batch_rows, bias_head_rows, BIAS_STAGES, NUM_WG)
    else:
        bias = bars  # not read: a stand-in of a type the partitions accept
    # every partition takes the runtime arguments as one tuple; the constexprs are spelled out in
    # each (inside a tuple they lose their kind, Gluon 3.6), as is each (function, arguments)
    # pair (held in a variable it does not compile)
    args = (
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        lse_ptr,
        q_bufs,
        k_bufs,
        v_bufs,
        bars,
        bias,
        qk_scale,
        seq_q,
        seq_k,
        num_heads,
        group,
        n_m_blocks,
        lpt_rows,
        kv_lens,
        n_new,
        sinks_ptr,
        softcap_in,
        softcap,
        alibi_ptr,
        alibi_sb,
        alibi_sh,
        alibi_off,
    )
    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    WG2: gl.constexpr = 2
    if NUM_WG == 3:
        gl.warp_specialize(
            [
                (
                    _ws_consumer,
                    (
                        args,
                        WG0,
                        WINDOW_LEFT,
                        WINDOW_RIGHT,
                        Q_ROWS,
                        KV_ROWS,
                        STORE_LSE,
                        HAS_BIAS,
                        BATCH_MINOR,
                        BIAS_STAGES,
                        KV_LENS,
                        SOFTCAP,
                        HAS_SINKS,
                        HAS_ALIBI,
                        OWN_TILES,
                        WARP_RELEASE,
                    ),
                ),
                (
                    _ws_consumer,
                    (
                        args,
                        WG1,
                        WINDOW_LEFT,
                        WINDOW_RIGHT,
                        Q_ROWS,
                        KV_ROWS,
                        STORE_LSE,
                        HAS_BIAS,
                        BATCH_MINOR,
                        BIAS_STAGES,
                        KV_LENS,
                        SOFTCAP,
                        HAS_SINKS,
                        HAS_ALIBI,
                        OWN_TILES,
                        WARP_RELEASE,
                    ),
                ),
                (
                    _ws_consumer,
                    (
                        args,
                        WG2,
                        WINDOW_LEFT,
                        WINDOW_RIGHT,
                        Q_ROWS,
                        KV_ROWS,
                        STORE_LSE,
                        HAS_BIAS,
                        BATCH_MINOR,
                        BIAS_STAGES,
                        KV_LENS,
                        SOFTCAP,
                        HAS_SINKS,
                        HAS_ALIBI,
                        OWN_TILES,
                        WARP_RELEASE,
                    ),
                ),
                (
                    _ws_loader,
                    (
                        args,
                        WG0,
                        WINDOW_LEFT,
                        WINDOW_RIGHT,
                        Q_ROWS,
                        KV_ROWS,
                        STORE_LSE,
                        HAS_BIAS,
                        BATCH_MINOR,
                        BIAS_STAGES,
                        KV_LENS,
                        SOFTCAP,
                        HAS_SINKS,
                        HAS_ALIBI,
                        WARP_RELEASE,
                    ),
                ),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, 24],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _ws_consumer,
                    (
                        args,
                        WG0,
                        WINDOW_LEFT,
                        WINDOW_RIGHT,
                        Q_ROWS,
                        KV_ROWS,
                        STORE_LSE,
                        HAS_BIAS,
                        BATCH_MINOR,
                        BIAS_STAGES,
                        KV_LENS,
                        SOFTCAP,
                        HAS_SINKS,
                        HAS_ALIBI,
                        OWN_TILES,
                        WARP_RELEASE,
                    ),
                ),
                (
                    _ws_consumer,
                    (
                        args,
                        WG1,
                        WINDOW_LEFT,
                        WINDOW_RIGHT,
                        Q_ROWS,
                        KV_ROWS,
                        STORE_LSE,
                        HAS_BIAS,
                        BATCH_MINOR,
                        BIAS_STAGES,
                        KV_LENS,
                        SOFTCAP,
                        HAS_SINKS,
                        HAS_ALIBI,
                        OWN_TILES,
                        WARP_RELEASE,
                    ),
                ),
                (
                    _ws_loader,
                    (
                        args,
                        WG0,
                        WINDOW_LEFT,
                        WINDOW_RIGHT,
                        Q_ROWS,
                        KV_ROWS,
                        STORE_LSE,
                        HAS_BIAS,
                        BATCH_MINOR,
                        BIAS_STAGES,
                        KV_LENS,
                        SOFTCAP,
                        HAS_SINKS,
                        HAS_ALIBI,
                        WARP_RELEASE,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )
