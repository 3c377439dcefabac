"""Warp-specialised Hopper kernels in Gluon (FlashAttention-3's structure): the forward, the
dK/dV pass and the dQ pass.

Triton 3.6 builds no such kernel from ``tl`` code on sm90 (its automatic warp specialisation
deadlocks there, docs/experiments/perf-notes.md experiment 35); Gluon states the partitions, barriers
and tensor-core calls explicitly (experiments 40-42):

  * a loader warp streams tiles through a ring of ``STAGES`` TMA buffers (``*_ready``
    barriers: the copy landed; ``*_empty``: both consumers are done with the slot): K and V
    for the forward and the dQ pass (one shared loader, :func:`_ws_loader`), Q and dO for the
    dK/dV pass;
  * two consumer warpgroups own 64 rows each (query rows; keys in the dK/dV pass) and share
    the ring; the warp scheduler runs one's softmax while the other's products occupy the
    tensor cores (the forward can take three, ``NUM_WG``: 192-row programs at head dim 64);
  * inside a consumer the next products are issued before the previous results are needed
    (forward: ``S_j`` and ``P_{j-1} V_{j-1}`` in flight together);
  * ``FUSE_DQ`` (launch.fuse_dq picks the calls): the dK/dV pass computes dQ too, FA3's way,
    adding fp32 partials by TMA reduce-add (:func:`_tma_reduce_add`), and no dQ pass runs.

Scope (launch.py's ``ws_forward_reason`` says why a call is not served): sm90, fp16/bf16,
Dqk == Dv == 128 or 64 (configs.WS_*_CONFIGS; at 64 the forward serves dense calls only), dense,
causal or a window (``WINDOW_LEFT`` / ``WINDOW_RIGHT`` constexprs, -1 unbounded; launch.WS_MIN_WINDOW keys wide at least) with
Sq == Sk, no mask or dropout, lengths multiples of the tiles, positive scale; a float bias of
the query's dtype that TMA can read as a (rows, Sk) matrix (``ws_bias_reason``; not one whose
gradient is needed: the tl backward computes it).  A window skips the key (query) tiles
outside the band and masks the tiles crossing it.  The bias rides in its own ring (forward,
dQ) or in the (Q, dO) slot (dK/dV); with it, scores are ``(q.k * scale + bias) * log2(e)`` and a
row it masks whole has output 0 and logsumexp -inf.  Same
conventions as forward.py / backward.py: log2-domain scores, ``lse`` in natural log,
``pid_bh = b * Hq + h``, dS = P * (dP - delta).
Row layouts (``Q_ROWS`` / ``KV_ROWS`` / ``DO_ROWS``): 1 = (B, H, S, D) memory seen as
(B*H*S, D), 2 = (B, S, H, D) memory seen as (B*S, H*D), the head's columns at ``h * D``.
Outputs (O, dQ, dK, dV) are written as (B, H, S, D) contiguous.
"""

from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)
# Rows per consumer warpgroup (one wgmma M): a program covers 2 * WG_ROWS query rows (forward,
# dQ) or keys (dK/dV); the dK/dV pass streams WG_ROWS-row query tiles.  The launcher reads it.
WG_ROWS = gl.constexpr(64)


@_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of shared tile ``src`` into the tensor at ``coord`` (cp.reduce.async.bulk;
    Triton 3.6's IR has it, its Gluon API does not): an asynchronous bulk operation that
    :func:`tma.store_wait` waits for, as a TMA store."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _wgmma_layout(n):
    """Accumulator layout of one warpgroup's wgmma with N = ``n`` (64 rows per warpgroup)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _wgmma_operand(n):
    """Register A-operand layout (16-bit elements) of a wgmma whose accumulator has N = ``n``."""
    return gl.DotOperandLayout(operand_index=0, parent=_wgmma_layout(n), k_width=2)


@gluon.jit
def _tile_origin(pid_bh, head_groups, num_heads, seq, ROWS: gl.constexpr, HEAD_D: gl.constexpr):
    """(first row, first column) of head ``pid_bh // head_groups`` of a row-layout matrix."""
    b = pid_bh // num_heads
    h = (pid_bh % num_heads) // head_groups
    if ROWS == 1:
        return (b * (num_heads // head_groups) + h) * seq, 0
    else:
        return b * seq, h * HEAD_D


@gluon.jit
def _program_row(heads, BATCH_MINOR: gl.constexpr):
    """Grid axis 1 as ``b * heads + h``.  BATCH_MINOR launches it batch-fastest: the programs of
    one head in every batch run together, so a bias shared by the batches is read from L2."""
    pid = gl.program_id(1)
    if BATCH_MINOR:
        batch = gl.num_programs(1) // heads
        pid = (pid % batch) * heads + pid // batch
    return pid


@gluon.constexpr_function
def _causal(left, right):
    """The band (key j of query i allowed when i - left <= j <= i + right, -1 unbounded) is causal."""
    return left < 0 and right == 0


@gluon.constexpr_function
def _window(left, right):
    """The band is another window (causal has its own, cheaper tile bounds and mask)."""
    return (left >= 0 or right >= 0) and not (left < 0 and right == 0)


@gluon.jit
def _kv_tiles(
    pid_m,
    seq_k,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_WG: gl.constexpr,
):
    """(first key tile a program of NUM_WG * BLOCK_M query rows reads, how many it reads, how many
    of them need no causal mask): the loader and every consumer must agree on the first two, or
    the ring deadlocks.  A window's tiles are masked where :func:`_band_edge` says."""
    first = 0
    if _causal(WINDOW_LEFT, WINDOW_RIGHT):
        # a last program of three warpgroups can reach past Sq (= Sk): no key tile past Sk
        n_tiles = gl.minimum(gl.cdiv((pid_m + 1) * NUM_WG * BLOCK_M, BLOCK_N), gl.cdiv(seq_k, BLOCK_N))
        n_full = (pid_m * NUM_WG * BLOCK_M) // BLOCK_N  # tiles below the diagonal
    else:
        end = seq_k // BLOCK_N
        if WINDOW_LEFT >= 0:
            lo = pid_m * NUM_WG * BLOCK_M - WINDOW_LEFT
            if lo > 0:
                first = lo // BLOCK_N
        if WINDOW_RIGHT >= 0:
            end = gl.minimum(end, gl.cdiv((pid_m + 1) * NUM_WG * BLOCK_M + WINDOW_RIGHT, BLOCK_N))
        n_tiles = end - first
        n_full = n_tiles
    return first, n_tiles, n_full


@gluon.jit
def _band_edge(
    row0, col0, ROWS: gl.constexpr, COLS: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr
):
    """Whether the tile of query rows row0.. and keys col0.. holds a pair outside the window."""
    edge = row0 < 0  # False, as a runtime value
    if WINDOW_LEFT >= 0:
        edge = edge | (row0 + (ROWS - 1) - col0 > WINDOW_LEFT)
    if WINDOW_RIGHT >= 0:
        edge = edge | (col0 + (COLS - 1) - row0 > WINDOW_RIGHT)
    return edge


@gluon.jit
def _masked(sc, rows, cols, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr):
    """``sc`` with the pairs outside the band at -inf (``rows``, ``cols``: query and key indices
    broadcast to its shape, whichever its orientation)."""
    if _causal(WINDOW_LEFT, WINDOW_RIGHT):
        ok = cols <= rows
    elif WINDOW_LEFT < 0:
        ok = cols - rows <= WINDOW_RIGHT
    elif WINDOW_RIGHT < 0:
        ok = rows - cols <= WINDOW_LEFT
    else:
        ok = (rows - cols <= WINDOW_LEFT) & (cols - rows <= WINDOW_RIGHT)
    return gl.where(ok, sc, float("-inf"))


@gluon.jit
def _q_tiles(
    n0, seq_q, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr, KEYS: gl.constexpr
):
    """(first query tile, how many) the dK/dV program of keys n0..n0 + KEYS reads (loader and
    consumers must agree)."""
    m_lo = 0
    m_hi = seq_q // BLOCK_M
    if WINDOW_RIGHT >= 0:  # queries i >= j - right
        if n0 > WINDOW_RIGHT:
            m_lo = (n0 - WINDOW_RIGHT) // BLOCK_M
    if WINDOW_LEFT >= 0:  # queries i <= j + left
        m_hi = gl.minimum(m_hi, gl.cdiv(n0 + KEYS + WINDOW_LEFT, BLOCK_M))
    return m_lo, m_hi - m_lo


@gluon.jit
def _mask_tile(
    sc,
    rows,
    q_start,
    t,
    first,
    n_full,
    col_layout: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Scores (query rows x keys) of step ``t`` of a forward or dQ consumer (key tile first + t;
    its rows ``rows`` from ``q_start``), masked where the tile crosses the band."""
    if _causal(WINDOW_LEFT, WINDOW_RIGHT):
        if t >= n_full:
            cols = t * BLOCK_N + gl.arange(0, BLOCK_N, col_layout)
            sc = _masked(sc, rows[:, None], cols[None, :], WINDOW_LEFT, WINDOW_RIGHT)
    elif _window(WINDOW_LEFT, WINDOW_RIGHT):
        col0 = (first + t) * BLOCK_N
        if _band_edge(q_start, col0, BLOCK_M, BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT):
            cols = col0 + gl.arange(0, BLOCK_N, col_layout)
            sc = _masked(sc, rows[:, None], cols[None, :], WINDOW_LEFT, WINDOW_RIGHT)
    return sc


@gluon.jit
def _store_rows(buf, value, desc, row):
    """``value`` to rows ``row..`` of ``desc``'s matrix through the shared buffer ``buf``."""
    buf.store(value)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [row, 0], buf)
    tma.store_wait(0)


@gluon.jit
def _kv_ring(q_desc, k_desc, v_desc, STAGES: gl.constexpr, NUM_WG: gl.constexpr):
    """Shared memory of the forward and the dQ pass: one Q tile per consumer warpgroup (NUM_WG), a
    ring of ``STAGES`` K/V slots, and their barriers (q_bar, k_ready, v_ready, k_empty, v_empty); an
    empty barrier completes when every consumer has released the slot."""
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [NUM_WG] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_WG):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    return q_bufs, k_bufs, v_bufs, (q_bar, k_ready, v_ready, k_empty, v_empty)


@gluon.jit
def _bias_ring(bias_desc, bias_batch_rows, bias_head_rows, STAGES: gl.constexpr, NUM_WG: gl.constexpr):
    """Shared memory of the bias tiles (forward and dQ pass): a ring of ``STAGES`` slots beside
    the K/V ring, its barriers (ready; empty: every consumer is done), and the bias matrix's
    rows per batch and per head (row of query i of (b, h): b * batch_rows + h * head_rows + i)."""
    bufs = gl.allocate_shared_memory(bias_desc.dtype, [STAGES] + bias_desc.block_type.shape, bias_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NUM_WG)
    return bias_desc, bufs, ready, empty, bias_batch_rows, bias_head_rows


@gluon.jit
def _bias_row(pid_bh, num_heads, batch_rows, head_rows):
    """The bias matrix's row of query 0 of program row ``pid_bh = b * Hq + h``."""
    return (pid_bh // num_heads) * batch_rows + (pid_bh % num_heads) * head_rows


@gluon.jit
def _load_bias_tile(bias, j, row, col, STAGES: gl.constexpr):
    """Loader side: bias tile ``j`` of the ring, rows ``row..``, columns ``col..``."""
    bias_desc, bufs, ready, empty = bias[0], bias[1], bias[2], bias[3]
    s = j % STAGES
    mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), bias_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(bias_desc, [row, col], ready.index(s), bufs.index(s))


@gluon.jit
def _bias_tile(bias, j, WG: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr, layout: gl.constexpr):
    """Consumer side: this warpgroup's ``ROWS`` rows of bias tile ``j`` in fp32 (natural units:
    the scores become ``sc * sm_scale + bias``, scaled by log2(e) in the softmax's one FMA),
    read while the score product runs.  The caller releases the slot (:func:`_release_bias`)
    once it has used the values."""
    s = j % STAGES
    mbarrier.wait(bias[2].index(s), (j // STAGES) & 1)
    return bias[1].index(s).slice(WG * ROWS, ROWS).load(layout).to(gl.float32)


@gluon.jit
def _release_bias(bias, j, STAGES: gl.constexpr):
    # the slot was read through the generic proxy and the loader's next copy writes it through
    # the async (TMA) proxy: order the two before the barrier hands the slot over
    fence_async_shared()
    mbarrier.arrive(bias[3].index(j % STAGES), count=1)


@gluon.jit
def _softmax_step(sc, m_i, scale, MAY_EMPTY: gl.constexpr):
    """One key tile of the online softmax: (P, rescale factor of the earlier sums, new max).
    ``sc * scale`` are log2-domain scores; ``m_i`` the running max (scaled), -inf while a row
    has seen no allowed key: with MAY_EMPTY (a bias or a window's left bound can hide a whole
    tile) such a row is exponentiated against 0, so its P and factor are 0 instead of NaN."""
    m_new = gl.maximum(m_i, gl.max(sc, 1) * scale)
    m_use = m_new
    if MAY_EMPTY:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc * scale - m_use[:, None])
    return p, gl.exp2(m_i - m_use), m_new


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
):
    """The forward's TMA loader partition (``args``: _attn_fwd_ws's runtime partition arguments)."""
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
    ) = args
    # the tiles follow from the shared memory the kernel allocated
    BLOCK_M: gl.constexpr = WG_ROWS
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_bufs.shape[0]
    NUM_WG: gl.constexpr = q_bufs.shape[0]
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    HEAD_D: gl.constexpr = k_desc.block_type.shape[1]
    pid_m = n_m_blocks - 1 - gl.program_id(0)  # longest causal rows first
    pid_bh = _program_row(num_heads, BATCH_MINOR)
    kv_row, kv_col = _tile_origin(pid_bh, group, num_heads, seq_k, KV_ROWS, HEAD_D)
    first, n_tiles, _ = _kv_tiles(pid_m, seq_k, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, NUM_WG)
    if HAS_BIAS:
        bias_row = _bias_row(pid_bh, num_heads, bias[4], bias[5]) + pid_m * NUM_WG * BLOCK_M
    for j in range(n_tiles):
        key0 = (first + j) * BLOCK_N
        s = j % STAGES
        ph = (j // STAGES) & 1
        # a fresh barrier counts as having completed phase 1: the first lap does not wait
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + key0, kv_col], k_ready.index(s), k_bufs.index(s))
        if HAS_BIAS:  # needed right after S_j, before V_j
            _load_bias_tile(bias, j, bias_row, key0, BIAS_STAGES)
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + key0, kv_col], v_ready.index(s), v_bufs.index(s))


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
    ) = args
    # the tiles follow from the shared memory the kernel allocated
    BLOCK_M: gl.constexpr = WG_ROWS
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_bufs.shape[0]
    NUM_WG: gl.constexpr = q_bufs.shape[0]
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_D)
    p_layout: gl.constexpr = _wgmma_operand(HEAD_D)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_m = n_m_blocks - 1 - gl.program_id(0)
    pid_bh = _program_row(num_heads, BATCH_MINOR)
    q_start = pid_m * NUM_WG * BLOCK_M + WG * BLOCK_M  # this warpgroup's first query row
    q_row, q_col = _tile_origin(pid_bh, 1, num_heads, seq_q, Q_ROWS, HEAD_D)
    q_buf = q_bufs.index(WG)
    mbarrier.expect(q_bar.index(WG), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + q_start, q_col], q_bar.index(WG), q_buf)

    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    first, n_tiles, n_full = _kv_tiles(pid_m, seq_k, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, NUM_WG)
    rows = q_start + gl.arange(0, BLOCK_M, row_s)
    # scores enter the softmax as sc * scale; with a bias, as (sc * sm_scale + bias) * log2(e)
    scale = qk_scale
    if HAS_BIAS:
        scale = LOG2E
        sm_scale = qk_scale * LN2
    mbarrier.wait(q_bar.index(WG), 0)

    # tile 0: its scores start the running max and sum
    mbarrier.wait(k_ready.index(0), 0)
    k_buf = k_bufs.index(0)
    sc = warpgroup_mma(q_buf, k_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if HAS_BIAS:
        b = _bias_tile(bias, 0, WG, BLOCK_M, BIAS_STAGES, s_layout)
    sc, _, _ = warpgroup_mma_wait(0, deps=[sc, q_buf, k_buf])
    mbarrier.arrive(k_empty.index(0), count=1)
    if HAS_BIAS:
        sc = sc * sm_scale + b
        _release_bias(bias, 0, BIAS_STAGES)
    sc = _mask_tile(sc, rows, q_start, 0, first, n_full, col_s, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
    # a bias can mask a whole tile, and so can a window's left bound (the second warpgroup's
    # rows start past the program's first key tile): the running max may still be -inf
    MAY_EMPTY: gl.constexpr = HAS_BIAS or WINDOW_LEFT >= 0
    p, alpha, m_i = _softmax_step(sc, gl.full([BLOCK_M], float("-inf"), gl.float32, row_s), scale, MAY_EMPTY)
    l_i = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(1, n_tiles):
        s = j % STAGES
        sp = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        k_buf = k_bufs.index(s)
        sc_tok = warpgroup_mma(q_buf, k_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
        v_buf = v_bufs.index(sp)
        acc_tok = warpgroup_mma(p_op, v_buf, acc, is_async=True)
        if HAS_BIAS:
            b = _bias_tile(bias, j, WG, BLOCK_M, BIAS_STAGES, s_layout)
        # wgmma groups retire in order: one outstanding = S_j done, P_{j-1} V_{j-1} running
        sc, _, _ = warpgroup_mma_wait(1, deps=[sc_tok, q_buf, k_buf])
        mbarrier.arrive(k_empty.index(s), count=1)
        if HAS_BIAS:
            sc = sc * sm_scale + b
            _release_bias(bias, j, BIAS_STAGES)
        sc = _mask_tile(sc, rows, q_start, j, first, n_full, col_s, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
        p, alpha, m_i = _softmax_step(sc, m_i, scale, MAY_EMPTY)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc, _, _ = warpgroup_mma_wait(0, deps=[acc_tok, p_op, v_buf])
        mbarrier.arrive(v_empty.index(sp), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    sl = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(sl), ((n_tiles - 1) // STAGES) & 1)
    v_buf = v_bufs.index(sl)
    acc_tok = warpgroup_mma(p_op, v_buf, acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(0, deps=[acc_tok, p_op, v_buf])
    mbarrier.arrive(v_empty.index(sl), count=1)

    if HAS_BIAS:  # a row the bias masks whole: output 0, logsumexp -inf
        empty = l_i == 0.0
        l_i = gl.where(empty, 1.0, l_i)
        m_i = gl.where(empty, float("-inf"), m_i)
    acc = acc / gl.convert_layout(l_i, row_o)[:, None]
    # with three warpgroups (Sq a multiple of 64, not of 192) the last program's last ones can
    # start past Sq: they ran on the next head's rows (or TMA's zeros) and store nothing
    if q_start < seq_q:
        if STORE_LSE:
            gl.store(lse_ptr + pid_bh * seq_q + rows, (m_i + gl.log2(l_i)) * LN2)
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
    bias_batch_rows,
    bias_head_rows,
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
):
    """Grid (cdiv(Sq, NUM_WG * 64), B * Hq); one program: NUM_WG * 64 query rows of one (b, h),
    O (B*Hq*Sq, D) rows.  NUM_WG: consumer warpgroups, 2 or 3 (FA3's 192-row tiles at head dim 64,
    where the softmax is as long as the products and a third warpgroup keeps the tensor cores fed).
    ``bias_desc`` (HAS_BIAS): (rows, Sk) bias matrix, tiles (NUM_WG * 64, BLOCK_N); None without.
    A bias needs two warpgroups: a TMA tile's rows are a power of two."""
    BLOCK_M: gl.constexpr = WG_ROWS  # noqa: F841 - the tile height the docstring names
    gl.static_assert(NUM_WG == 2 or (NUM_WG == 3 and not HAS_BIAS))
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
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )


# --------------------------------------------------------------------------- dK / dV


@gluon.jit
def _lse_log2(lse, MAY_EMPTY: gl.constexpr):
    """Logsumexp rows in the log2 domain for P = exp2(scores - lse); a row with no allowed key
    (lse = -inf, MAY_EMPTY) becomes +inf, so its P is 0 instead of NaN."""
    if MAY_EMPTY:
        lse = gl.where(lse == float("-inf"), float("inf"), lse)
    return lse * LOG2E


@gluon.jit
def _q_tile(t, m_lo, n_m, pid_n, ROTATE: gl.constexpr):
    """The query tile of a dK/dV program's step ``t`` (of ``n_m`` tiles from ``m_lo``).  ROTATE
    (the fused dQ): each program starts at its own tile and wraps, so that the programs running
    together add their dQ partials into different rows (experiment 54: 16k 11.2 -> 10.7 ms)."""
    if ROTATE:
        return m_lo + (t + pid_n * 2) % n_m
    return m_lo + t % n_m


@gluon.jit
def _ws_bwd_loader(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dk_desc,
    dv_desc,
    lse_ptr,
    delta_ptr,
    k_bufs,
    v_bufs,
    q_bufs,
    do_bufs,
    bars,
    bias,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    WG: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    DO_ROWS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    FUSE_DQ: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    kv_bar, q_ready, q_empty, lse_bufs, delta_bufs = bars
    HEAD_D: gl.constexpr = k_desc.block_type.shape[1]
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    pid_n = gl.program_id(0)
    n_kv = num_heads // group
    pid_bkv = _program_row(n_kv, BATCH_MINOR)  # b * Hkv + hk
    b = pid_bkv // n_kv
    hk = pid_bkv % n_kv
    n0 = pid_n * 2 * BLOCK_N
    kv_row, kv_col = _tile_origin(b * num_heads + hk * group, group, num_heads, seq_k, KV_ROWS, HEAD_D)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [kv_row + n0 + w * BLOCK_N, kv_col], kv_bar, k_bufs.index(w))
        tma.async_copy_global_to_shared(v_desc, [kv_row + n0 + w * BLOCK_N, kv_col], kv_bar, v_bufs.index(w))
    m_lo, n_m = _q_tiles(n0, seq_q, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, 2 * BLOCK_N)
    for t in range(group * n_m):
        g = t // n_m
        m = _q_tile(t, m_lo, n_m, pid_n, FUSE_DQ) * BLOCK_M
        h = b * num_heads + hk * group + g
        q_row, q_col = _tile_origin(h, 1, num_heads, seq_q, Q_ROWS, HEAD_D)
        do_row, do_col = _tile_origin(h, 1, num_heads, seq_q, DO_ROWS, HEAD_D)
        s = t % STAGES
        mbarrier.wait(q_empty.index(s), ((t // STAGES) & 1) ^ 1)
        if HAS_BIAS:  # the (query tile, 128 keys) bias tile rides in the (Q, dO) slot
            bias_desc, bias_bufs = bias[0], bias[1]
            mbarrier.expect(
                q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes + bias_desc.block_type.nbytes
            )
            tma.async_copy_global_to_shared(
                bias_desc, [_bias_row(h, num_heads, bias[4], bias[5]) + m, n0], q_ready.index(s), bias_bufs.index(s)
            )
        else:
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + m, q_col], q_ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [do_row + m, do_col], q_ready.index(s), do_bufs.index(s))
        # the tile's logsumexp and delta rows: the slot's second arrival (the consumers read
        # them from shared memory instead of waiting on global loads inside each step)
        offs = h * seq_q + m + gl.arange(0, BLOCK_M, row_layout)
        lse_bufs.index(s).store(_lse_log2(gl.load(lse_ptr + offs), HAS_BIAS))
        delta_bufs.index(s).store(gl.load(delta_ptr + offs))
        mbarrier.arrive(q_ready.index(s), count=1)


@gluon.jit
def _ws_bwd_consumer(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dk_desc,
    dv_desc,
    lse_ptr,
    delta_ptr,
    k_bufs,
    v_bufs,
    q_bufs,
    do_bufs,
    bars,
    bias,
    dq_fused,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    WG: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    DO_ROWS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    FUSE_DQ: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    # this warpgroup: BLOCK_N (64) keys; scores transposed (keys x queries) as the tl kernel.
    # FUSE_DQ: dQ too, FA3's way: both warpgroups put their dS^T half in shared memory, then
    # each multiplies the whole (queries x 128 keys) dS by its half of K's columns and adds
    # that (64, HEAD_D / 2) fp32 partial into dQ by TMA reduce-add from a shared slot
    # (experiment 54: per-thread atomics, here or from a reducer partition, cost more)
    kv_bar, q_ready, q_empty, lse_bufs, delta_bufs = bars
    HEAD_D: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    a_layout: gl.constexpr = _wgmma_layout(HEAD_D)
    op_layout: gl.constexpr = _wgmma_operand(HEAD_D)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    pid_n = gl.program_id(0)
    n_kv = num_heads // group
    pid_bkv = _program_row(n_kv, BATCH_MINOR)
    n0 = pid_n * 2 * BLOCK_N
    k_buf = k_bufs.index(WG)
    v_buf = v_bufs.index(WG)
    keys = n0 + WG * BLOCK_N + gl.arange(0, BLOCK_N, row_s)
    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, a_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, a_layout)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    m_lo, n_m = _q_tiles(n0, seq_q, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, 2 * BLOCK_N)
    scale = qk_scale  # with a bias: (st * sm_scale + bias) * log2(e)
    if HAS_BIAS:
        scale = LOG2E
    if FUSE_DQ:
        dq_desc, ds_bufs, ds_ready, kv_done, dq_bufs = dq_fused
        # each warpgroup's share of the tile's dQ: with 64-row tiles the 64 rows x half the columns,
        # with 128-row tiles its 64-row half x every column (experiment 81)
        DQ_SPLIT_ROWS: gl.constexpr = BLOCK_M == 2 * WG_ROWS
        DQ_COLS: gl.constexpr = HEAD_D if DQ_SPLIT_ROWS else HEAD_D // 2
        gl.static_assert(dq_desc.block_type.shape[0] == WG_ROWS and dq_desc.block_type.shape[1] == DQ_COLS)
        gl.static_assert(BLOCK_N == BLOCK_M or DQ_SPLIT_ROWS)
        DQ_STAGES: gl.constexpr = dq_bufs.shape[0] // 2
        n_kv_heads = num_heads // group
        dq_head0 = (pid_bkv // n_kv_heads) * num_heads + (pid_bkv % n_kv_heads) * group
        # the dQ product's (64 queries x DQ_COLS) accumulator: zero_s where it has that shape (d128)
        if DQ_COLS == BLOCK_M and not DQ_SPLIT_ROWS:
            zero_dq = zero_s
        else:
            zero_dq = gl.zeros([WG_ROWS, DQ_COLS], gl.float32, _wgmma_layout(DQ_COLS))
    mbarrier.wait(kv_bar, 0)
    for t in range(group * n_m):
        mi = _q_tile(t, m_lo, n_m, pid_n, FUSE_DQ)
        s = t % STAGES
        mbarrier.wait(q_ready.index(s), (t // STAGES) & 1)
        q_buf = q_bufs.index(s)
        do_buf = do_bufs.index(s)
        st_tok = warpgroup_mma(k_buf, q_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_buf, do_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        offs_m = mi * BLOCK_M + gl.arange(0, BLOCK_M, col_s)
        # the rows' logsumexp and delta (per query column: BLOCK_M / 4 registers each): with 64-row
        # tiles read before the waits, with 128 where used (read early they spilled 732 B at d64,
        # read late at d128 the pass ran 2-4% slower, experiment 79)
        EARLY_ROWS: gl.constexpr = BLOCK_M == WG_ROWS
        if EARLY_ROWS:
            lse2 = lse_bufs.index(s).load(col_s)
            delta = delta_bufs.index(s).load(col_s)
        st = warpgroup_mma_wait(1, deps=[st_tok])
        if HAS_BIAS:  # this warpgroup's keys of the slot's bias tile, transposed as the scores
            bt = bias[1].index(s).slice(WG * BLOCK_N, BLOCK_N, dim=1).permute((1, 0)).load(s_layout)
            st = st * sm_scale + bt.to(gl.float32)
        if _causal(WINDOW_LEFT, WINDOW_RIGHT):
            if mi * BLOCK_M < n0 + 2 * BLOCK_N:
                st = _masked(st, offs_m[None, :], keys[:, None], WINDOW_LEFT, WINDOW_RIGHT)
        elif _window(WINDOW_LEFT, WINDOW_RIGHT):
            if _band_edge(mi * BLOCK_M, n0 + WG * BLOCK_N, BLOCK_M, BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT):
                st = _masked(st, offs_m[None, :], keys[:, None], WINDOW_LEFT, WINDOW_RIGHT)
        if not EARLY_ROWS:
            lse2 = lse_bufs.index(s).load(col_s)
        pt = gl.exp2(st * scale - lse2[None, :])
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv_tok = warpgroup_mma(pt_op, do_buf, dv, is_async=True)
        dpt, _ = warpgroup_mma_wait(1, deps=[dpt_tok, pt_op])
        if not EARLY_ROWS:
            delta = delta_bufs.index(s).load(col_s)
        dst = (pt * (dpt - delta[None, :])).to(dtype)
        if FUSE_DQ:  # this warpgroup's keys of dS^T, for both warpgroups' dQ products and its dK's
            ds_buf = ds_bufs.index(t % 2)
            ds_buf.slice(WG * BLOCK_N, BLOCK_N).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(t % 2), count=1)
            dk_tok = warpgroup_mma(ds_buf.slice(WG * BLOCK_N, BLOCK_N), q_buf, dk, is_async=True)
        else:
            dst_op = gl.convert_layout(dst, op_layout)
            dk_tok = warpgroup_mma(dst_op, q_buf, dk, is_async=True)
        if FUSE_DQ:
            # dQ[rows, cols] = dS (rows x 128 keys) K[keys, cols]: the program's two 64-key K tiles
            mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
            if DQ_SPLIT_ROWS:
                dq_row: gl.constexpr = WG * WG_ROWS
                dq_col: gl.constexpr = 0
                ds_lo = ds_buf.slice(0, BLOCK_N).slice(dq_row, WG_ROWS, dim=1)
                ds_hi = ds_buf.slice(BLOCK_N, BLOCK_N).slice(dq_row, WG_ROWS, dim=1)
                k_lo = k_bufs.index(0)
                k_hi = k_bufs.index(1)
            else:
                dq_row: gl.constexpr = 0
                dq_col: gl.constexpr = WG * DQ_COLS
                ds_lo = ds_buf.slice(0, BLOCK_N)
                ds_hi = ds_buf.slice(BLOCK_N, BLOCK_N)
                k_lo = k_bufs.index(0).slice(dq_col, DQ_COLS, dim=1)
                k_hi = k_bufs.index(1).slice(dq_col, DQ_COLS, dim=1)
            dq_tok = warpgroup_mma(ds_lo.permute((1, 0)), k_lo, zero_dq, use_acc=False, is_async=True)
            dq_tok = warpgroup_mma(ds_hi.permute((1, 0)), k_hi, dq_tok, is_async=True)
            dv, dk, dq, _, _, _ = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok, q_buf, do_buf, ds_buf])
            # the partial leaves through shared memory by TMA reduce-add (FA3's way); the slot's
            # previous reduce, DQ_STAGES steps ago, must have read it first
            tma.store_wait(DQ_STAGES - 1)
            gl.thread_barrier()
            dq_buf = dq_bufs.index((t % DQ_STAGES) * 2 + WG)
            dq_buf.store(dq * sm_scale)
            fence_async_shared()
            row0 = (dq_head0 + t // n_m) * seq_q + mi * BLOCK_M + dq_row
            _tma_reduce_add(dq_desc, [row0, dq_col], dq_buf)
        else:
            dv, dk, _, _, _ = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dst_op, q_buf, do_buf])
        if HAS_BIAS:  # its bias tile was read through the generic proxy (see _release_bias)
            fence_async_shared()
        mbarrier.arrive(q_empty.index(s), count=1)
    if FUSE_DQ:  # the other warpgroup's last dQ products read this one's K tile
        mbarrier.arrive(kv_done, count=1)
        mbarrier.wait(kv_done, 0)
    # dK and dV leave through this warpgroup's K and V buffers
    k_buf.store((dk * sm_scale).to(dtype))
    v_buf.store(dv.to(dtype))
    fence_async_shared()
    out_row = pid_bkv * seq_k + n0 + WG * BLOCK_N
    tma.async_copy_shared_to_global(dk_desc, [out_row, 0], k_buf)
    tma.async_copy_shared_to_global(dv_desc, [out_row, 0], v_buf)
    tma.store_wait(0)


@gluon.jit
def _attn_bwd_dkdv_ws(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dk_desc,
    dv_desc,
    bias_desc,
    lse_ptr,
    delta_ptr,
    dq_desc,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    bias_batch_rows,
    bias_head_rows,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    DO_ROWS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    FUSE_DQ: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """Grid (Sk / 128, B * Hkv); one program: 128 keys of one (b, kv head) in two consumer
    warpgroups of 64, over the query tiles (``q_desc``'s rows: 64 or 128) of every query head of
    its group.
    dK, dV: (B * Hkv * Sk, D) rows; lse, delta: (B, Hq, Sq) contiguous; ``bias_desc``
    (HAS_BIAS): (rows, Sk) bias matrix, tiles (query tile rows, 128); None without.  FUSE_DQ: dQ is added
    into ``dq_desc``, fp32 (B * Hq * Sq, D) rows zeroed beforehand, tiles (64, D / 2) with 64-row
    query tiles and (64, D) with 128; None without."""
    BLOCK_N: gl.constexpr = WG_ROWS  # keys per consumer warpgroup
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]  # query rows per tile
    gl.static_assert(BLOCK_M == WG_ROWS or BLOCK_M == 2 * WG_ROWS)
    dtype: gl.constexpr = k_desc.dtype
    k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    # the (Q, dO) slot's rows of logsumexp (log2 domain) and delta
    row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=2)  # the copies' expect, and the rows' arrival
        mbarrier.init(q_empty.index(i), count=2)
    bars = (kv_bar, q_ready, q_empty, lse_bufs, delta_bufs)
    if HAS_BIAS:  # a bias tile per (Q, dO) slot, under the slot's barriers
        bias_bufs = gl.allocate_shared_memory(bias_desc.dtype, [STAGES] + bias_desc.block_type.shape, bias_desc.layout)
        bias = (bias_desc, bias_bufs, q_ready, q_empty, bias_batch_rows, bias_head_rows)
    else:
        bias = bars  # not read: a stand-in of a type the partitions accept
    if FUSE_DQ:  # dS^T tiles (128 keys x 64 queries), double-buffered: step t + 2 rewrites step t's
        # after both warpgroups passed step t + 1's ds_ready, hence after their step-t dQ products
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, BLOCK_M], dtype)
        ds_bufs = gl.allocate_shared_memory(dtype, [2, 2 * BLOCK_N, BLOCK_M], ds_layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(kv_done, count=2)
        # each warpgroup's (64, HEAD_D / 2) fp32 partials: two slots where shared memory allows,
        # one beside a bias
        DQ_STAGES: gl.constexpr = 1 if HAS_BIAS else 2
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2 * DQ_STAGES] + dq_desc.block_type.shape, dq_desc.layout)
        dq_fused = (dq_desc, ds_bufs, ds_ready, kv_done, dq_bufs)
    else:
        dq_fused = bars  # not read
    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    gl.warp_specialize(
        [
            (
                _ws_bwd_consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dk_desc,
                    dv_desc,
                    lse_ptr,
                    delta_ptr,
                    k_bufs,
                    v_bufs,
                    q_bufs,
                    do_bufs,
                    bars,
                    bias,
                    dq_fused,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    WG0,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    KV_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    FUSE_DQ,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                ),
            ),
            (
                _ws_bwd_consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dk_desc,
                    dv_desc,
                    lse_ptr,
                    delta_ptr,
                    k_bufs,
                    v_bufs,
                    q_bufs,
                    do_bufs,
                    bars,
                    bias,
                    dq_fused,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    WG1,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    KV_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    FUSE_DQ,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                ),
            ),
            (
                _ws_bwd_loader,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dk_desc,
                    dv_desc,
                    lse_ptr,
                    delta_ptr,
                    k_bufs,
                    v_bufs,
                    q_bufs,
                    do_bufs,
                    bars,
                    bias,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    WG0,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    KV_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    FUSE_DQ,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )


# --------------------------------------------------------------------------- dQ


@gluon.jit
def _ws_bwd_dq_consumer(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dq_desc,
    lse_ptr,
    delta_ptr,
    q_bufs,
    do_bufs,
    k_bufs,
    v_bufs,
    bars,
    bias,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    n_m_blocks,
    WG: gl.constexpr,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    DO_ROWS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    BIAS_STAGES: gl.constexpr,
):
    # the forward's consumer with dP = dO V^T and dQ += dS K in place of the output products
    q_bar, k_ready, v_ready, k_empty, v_empty = bars
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_D)
    op_layout: gl.constexpr = _wgmma_operand(HEAD_D)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    pid_m = n_m_blocks - 1 - gl.program_id(0)
    pid_bh = _program_row(num_heads, BATCH_MINOR)
    q_start = pid_m * 2 * BLOCK_M + WG * BLOCK_M
    q_row, q_col = _tile_origin(pid_bh, 1, num_heads, seq_q, Q_ROWS, HEAD_D)
    do_row, do_col = _tile_origin(pid_bh, 1, num_heads, seq_q, DO_ROWS, HEAD_D)
    q_buf = q_bufs.index(WG)
    do_buf = do_bufs.index(WG)
    mbarrier.expect(q_bar.index(WG), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + q_start, q_col], q_bar.index(WG), q_buf)
    tma.async_copy_global_to_shared(do_desc, [do_row + q_start, do_col], q_bar.index(WG), do_buf)

    rows = q_start + gl.arange(0, BLOCK_M, row_s)
    lse2 = _lse_log2(gl.load(lse_ptr + pid_bh * seq_q + rows), HAS_BIAS)
    delta = gl.load(delta_ptr + pid_bh * seq_q + rows)
    scale = qk_scale  # with a bias: (sc * sm_scale + bias) * log2(e)
    if HAS_BIAS:
        scale = LOG2E
    dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    first, n_tiles, n_full = _kv_tiles(pid_m, seq_k, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, 2)
    mbarrier.wait(q_bar.index(WG), 0)
    for j in range(n_tiles):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(s), ph)
        k_buf = k_bufs.index(s)
        s_tok = warpgroup_mma(q_buf, k_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(s), ph)
        v_buf = v_bufs.index(s)
        dp_tok = warpgroup_mma(do_buf, v_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if HAS_BIAS:
            b = _bias_tile(bias, j, WG, BLOCK_M, BIAS_STAGES, s_layout)
        sc = warpgroup_mma_wait(1, deps=[s_tok])
        if HAS_BIAS:
            sc = sc * sm_scale + b
            _release_bias(bias, j, BIAS_STAGES)
        sc = _mask_tile(sc, rows, q_start, j, first, n_full, col_s, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
        p = gl.exp2(sc * scale - lse2[:, None])
        dp, _, _ = warpgroup_mma_wait(0, deps=[dp_tok, do_buf, v_buf])
        mbarrier.arrive(v_empty.index(s), count=1)
        ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), op_layout)
        dq_tok = warpgroup_mma(ds_op, k_buf, dq, is_async=True)
        dq, _, _ = warpgroup_mma_wait(0, deps=[dq_tok, ds_op, k_buf])
        mbarrier.arrive(k_empty.index(s), count=1)
    # dQ leaves through this warpgroup's Q buffer
    _store_rows(q_buf, (dq * sm_scale).to(dtype), dq_desc, pid_bh * seq_q + q_start)


@gluon.jit
def _attn_bwd_dq_ws(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dq_desc,
    bias_desc,
    lse_ptr,
    delta_ptr,
    qk_scale,
    sm_scale,
    seq_q,
    seq_k,
    num_heads,
    group,
    n_m_blocks,
    bias_batch_rows,
    bias_head_rows,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    DO_ROWS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BATCH_MINOR: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    BIAS_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """Grid (Sq / 128, B * Hq); one program: dQ of 128 query rows of one (b, h), the K/V ring, the
    bias ring and their loader shared with the forward (_ws_loader).  dQ: (B * Hq * Sq, D) rows."""
    BLOCK_M: gl.constexpr = WG_ROWS
    NUM_WG: gl.constexpr = 2
    q_bufs, k_bufs, v_bufs, bars = _kv_ring(q_desc, k_desc, v_desc, STAGES, NUM_WG)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    if HAS_BIAS:
        bias = _bias_ring(bias_desc, bias_batch_rows, bias_head_rows, BIAS_STAGES, NUM_WG)
    else:
        bias = bars  # not read: a stand-in of a type the partitions accept
    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    NO_LSE: gl.constexpr = False
    # the forward's loader (its runtime arguments as one tuple): it reads only the K/V descriptors,
    # the rings, the barriers and the sizes
    loader_args = (
        q_desc,
        k_desc,
        v_desc,
        dq_desc,
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
    )
    gl.warp_specialize(
        [
            (
                _ws_bwd_dq_consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dq_desc,
                    lse_ptr,
                    delta_ptr,
                    q_bufs,
                    do_bufs,
                    k_bufs,
                    v_bufs,
                    bars,
                    bias,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    n_m_blocks,
                    WG0,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    BIAS_STAGES,
                ),
            ),
            (
                _ws_bwd_dq_consumer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    do_desc,
                    dq_desc,
                    lse_ptr,
                    delta_ptr,
                    q_bufs,
                    do_bufs,
                    k_bufs,
                    v_bufs,
                    bars,
                    bias,
                    qk_scale,
                    sm_scale,
                    seq_q,
                    seq_k,
                    num_heads,
                    group,
                    n_m_blocks,
                    WG1,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    DO_ROWS,
                    HAS_BIAS,
                    BATCH_MINOR,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    BIAS_STAGES,
                ),
            ),
            (
                _ws_loader,
                (
                    loader_args,
                    WG0,
                    WINDOW_LEFT,
                    WINDOW_RIGHT,
                    Q_ROWS,
                    KV_ROWS,
                    NO_LSE,
                    HAS_BIAS,
                    BATCH_MINOR,
                    BIAS_STAGES,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )
