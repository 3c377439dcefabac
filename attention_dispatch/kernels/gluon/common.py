"""Warp-specialised Hopper kernels in Gluon (FlashAttention-3's structure): the forward, the
dK/dV pass and the dQ pass.

Triton 3.6 builds no such kernel from ``tl`` code on sm90 (its automatic warp specialisation
deadlocks there, E35); Gluon states the partitions, barriers and tensor-core calls explicitly
(E40-E42):

  * a loader warp streams tiles through a ring of ``STAGES`` TMA buffers (``*_ready``
    barriers: the copy landed; ``*_empty``: both consumers are done with the slot): K and V
    for the forward and the dQ pass (one shared loader, :func:`_ws_loader`), Q and dO for the
    dK/dV pass;
  * two consumer warpgroups own 64 rows each (query rows; keys in the dK/dV pass) and share
    the ring; the warp scheduler runs one's softmax while the other's products occupy the
    tensor cores (the forward can take three, ``NUM_WG``: 192-row programs at head dim 64);
  * inside a consumer the next products are issued before the previous results are needed
    (forward: ``S_j`` and ``P_{j-1} V_{j-1}`` in flight together);
  * ``FUSE_DQ`` (route.fuse_dq_reason picks the calls): the dK/dV pass computes dQ too, FA3's way,
    adding fp32 partials by TMA reduce-add (:func:`_tma_reduce_add`), and no dQ pass runs.

Scope (route.py's ``ws_forward_reason`` says why a call is not served): sm90, fp16/bf16,
Dqk == Dv of configs.WS_*_CONFIGS (the forward: 128, 256 and, for dense calls only, 64; the
dK/dV and dQ passes: 128 and 64), dense, causal or a window (``WINDOW_LEFT`` / ``WINDOW_RIGHT``
constexprs, -1 unbounded; route.WS_MIN_WINDOW keys wide at least) with Sq == Sk (the forward:
causal with Sq < Sk too, and a KV cache, in its LENS_TENSOR mode), no mask or
dropout, lengths multiples of the tiles, positive scale; a float bias of the query's dtype that
TMA can read as a (rows, Sk) matrix (``ws_bias_reason``; not one whose gradient is needed: the
tl backward computes it).  A window skips the key (query) tiles outside the band and masks the
tiles crossing it.  The bias rides in its own ring (forward, dQ) or in the (Q, dO) slot (dK/dV);
with it, scores are ``(q.k * scale + bias) * log2(e)`` and a row it masks whole has output 0
and logsumexp -inf.  Same conventions as tl/forward.py / tl/backward.py: log2-domain scores,
``lse`` in natural log, ``pid_bh = b * Hq + h``, dS = P * (dP - delta).
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
)

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)
# Rows per consumer warpgroup (one wgmma M): a program covers 2 * WG_ROWS query rows (forward,
# dQ) or keys (dK/dV); the dK/dV pass streams WG_ROWS-row query tiles.  The launcher reads it.
WG_ROWS = gl.constexpr(64)
# The forward's KV_LENS modes (0: every key of a dense call): LENS_TENSOR, sequence b's keys the
# first kv_lens[b] + n_new (a KV cache; a dense causal call with Sq < Sk: zeros and L,
# entry.GLUON_LENGTHS).  The launcher reads it.
LENS_TENSOR = gl.constexpr(1)
# The forward's SOFTCAP values: False, True, or SOFTCAP_BOUNDED: a cap c with c log2(e) <= BOUNDED_LOG2_CAP
# (c <= 55.4; the launcher decides), whose scores lie in [-c, c]: the softmax takes the fixed reference
# c log2(e) - BOUNDED_TOP instead of a running max (forward_softmax, E103): P in [2^(64 - 2 c log2 e), 2^64],
# normal float32 and bfloat16 values (>= 2^-96, products with V down to 2^-30 too); O and l overflow only
# for |V| > 2^44 at 2^20 keys.  Not float16 (max 65504): launch.forward_softcap keeps its running max
SOFTCAP_BOUNDED = gl.constexpr(2)
BOUNDED_TOP = gl.constexpr(64.0)
BOUNDED_LOG2_CAP = gl.constexpr(80.0)


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
    return _batch_minor(gl.program_id(1), heads, BATCH_MINOR)


@gluon.jit
def _batch_minor(pid, heads, BATCH_MINOR: gl.constexpr):
    if BATCH_MINOR:
        batch = gl.num_programs(1) // heads
        pid = (pid % batch) * heads + pid // batch
    return pid


@gluon.jit
def _query_block(n_m_blocks, heads, lpt_rows, BATCH_MINOR: gl.constexpr):
    """(query block, ``b * heads + h``) of a forward program of the grid (n_m_blocks, B * heads).
    ``lpt_rows`` > 0 (causal): FA3's longest-processing-time order, the launch in groups of
    ``lpt_rows`` rows (b, h) whose K/V fit in L2, each group's longest blocks first over all its
    rows, so the last wave holds the shortest; 0: a row's blocks together, longest first."""
    if lpt_rows > 0:
        pid = gl.program_id(1) * n_m_blocks + gl.program_id(0)
        per_group = lpt_rows * n_m_blocks
        g = pid // per_group
        r = pid - g * per_group
        width = gl.minimum(lpt_rows, gl.num_programs(1) - g * lpt_rows)
        return n_m_blocks - 1 - r // width, _batch_minor(g * lpt_rows + r % width, heads, BATCH_MINOR)
    return n_m_blocks - 1 - gl.program_id(0), _program_row(heads, BATCH_MINOR)


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
def _cache_tiles(
    pid_m,
    kv_lens,
    n_new,
    b,
    seq_q,
    capacity,
    WINDOW_LEFT: gl.constexpr,
    WINDOW_RIGHT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_WG: gl.constexpr,
    KV_LENS: gl.constexpr,
):
    """:func:`_kv_tiles` of a KV-cache call (KV_LENS; no window, causal or not): sequence ``b``
    attends to its first L = kv_lens[b] + n_new keys of the cache, its Sq queries at their end
    (query i's diagonal is key i + L - Sq).  The key tiles up to L's, the last one partial: its
    keys from L on are masked (causal: every diagonal is below L; else the consumer masks them,
    forward.py) and their V rows zeroed in shared memory (forward_softmax._zero_v_rows): past L
    the cache holds anything, NaN included.  Returns (first, n_tiles, n_full, L - Sq), n_full:
    the tiles no key of which is masked for any row."""
    seq_len = gl.minimum(gl.load(kv_lens + b) + n_new, capacity)
    diag = seq_len - seq_q
    n_tiles = gl.cdiv(seq_len, BLOCK_N)
    n_full = seq_len // BLOCK_N
    if _causal(WINDOW_LEFT, WINDOW_RIGHT):
        row0 = pid_m * NUM_WG * BLOCK_M + diag  # the program's first row's diagonal
        # up to the last row's diagonal; a diagonal below 0 sees no key
        n_tiles = gl.maximum(gl.minimum(n_tiles, gl.cdiv(row0 + NUM_WG * BLOCK_M, BLOCK_N)), 0)
        n_full = gl.maximum(gl.minimum(n_full, (row0 + 1) // BLOCK_N), 0)
    return 0, n_tiles, n_full, diag


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


# A masked pair's score under a softcap alone in the backward passes, in place of -inf: exp2 of it times
# any positive scale is 0 and 1 - its square is finite, so P (1 - tanh^2) is 0, not NaN, and the masked
# tile stands for the tanh tile (the scores and the tanh beside them through the mask's branch spilled
# 296 B in the causal dK/dV pass and 720 B in its dQ pass, E106)
MASKED_TANH = gl.constexpr(-(2.0**60))


@gluon.jit
def _masked(sc, rows, cols, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, FILL: gl.constexpr = float("-inf")):
    """``sc`` with the pairs outside the band at FILL, -inf unless given (``rows``, ``cols``: query and
    key indices broadcast to its shape, whichever its orientation)."""
    if _causal(WINDOW_LEFT, WINDOW_RIGHT):
        ok = cols <= rows
    elif WINDOW_LEFT < 0:
        ok = cols - rows <= WINDOW_RIGHT
    elif WINDOW_RIGHT < 0:
        ok = rows - cols <= WINDOW_LEFT
    else:
        ok = (rows - cols <= WINDOW_LEFT) & (cols - rows <= WINDOW_RIGHT)
    return gl.where(ok, sc, FILL)


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
    FILL: gl.constexpr = float("-inf"),
):
    """Scores (query rows x keys) of step ``t`` of a forward or dQ consumer (key tile first + t;
    its rows ``rows`` from ``q_start``), masked (to FILL, :func:`_masked`) where the tile crosses the band."""
    if _causal(WINDOW_LEFT, WINDOW_RIGHT):
        if t >= n_full:
            cols = t * BLOCK_N + gl.arange(0, BLOCK_N, col_layout)
            sc = _masked(sc, rows[:, None], cols[None, :], WINDOW_LEFT, WINDOW_RIGHT, FILL)
    elif _window(WINDOW_LEFT, WINDOW_RIGHT):
        col0 = (first + t) * BLOCK_N
        if _band_edge(q_start, col0, BLOCK_M, BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT):
            cols = col0 + gl.arange(0, BLOCK_N, col_layout)
            sc = _masked(sc, rows[:, None], cols[None, :], WINDOW_LEFT, WINDOW_RIGHT, FILL)
    return sc


@gluon.jit
def _store_rows(buf, value, desc, row):
    """``value`` to rows ``row..`` of ``desc``'s matrix through the shared buffer ``buf``."""
    buf.store(value)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [row, 0], buf)
    tma.store_wait(0)


# WARP_RELEASE (configs.WsConfig.warp_release, E156): the forward's consumers hand K/V slots back per warp, each
# warp `bar.arrive`s on the slot's named barrier after its own wgmma wait, and the loader `bar.sync`s it before
# refilling the slot. Gluon 3.6's mbarrier.arrive lowers to a warpgroup bar.sync and thread 0's arrive, and inline
# asm gets no mbarrier address. Barriers 10 + slot (K) and 10 + STAGES + slot (V); Triton's partitions use 0-2
SLOT_BARRIER = gl.constexpr(10)
SLOT_THREADS = gl.constexpr(2 * 128 + 32)  # two consumer warpgroups and the loader warp


@gluon.jit
def _release_slot(empty, s, bar_id, WARP_RELEASE: gl.constexpr):
    """A consumer is done with ring slot ``s``: call it after the wgmma wait that retired the products reading
    the slot (a warp passes it once its own reads are complete; bar.arrive orders them before the loader's
    bar.sync returns). ``empty``: the slot's mbarriers, ``bar_id``: its named barrier (WARP_RELEASE)."""
    if WARP_RELEASE:
        gl.inline_asm_elementwise(
            "bar.arrive $1, $2;\nmov.u32 $0, 0;",
            "=r,r,r",
            [bar_id, SLOT_THREADS],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def _slot_sync(bar_id):
    """The loader waits until every consumer warp has released a slot (:func:`_release_slot`)."""
    gl.inline_asm_elementwise(
        "bar.sync $1, $2;\nmov.u32 $0, 0;", "=r,r,r", [bar_id, SLOT_THREADS], dtype=gl.int32, is_pure=False, pack=1
    )


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
def _softmax_step(
    sc, m_i, scale, MAY_EMPTY: gl.constexpr, roff=0.0, ROW_OFF: gl.constexpr = False, EXP2_POLY: gl.constexpr = False
):
    """One key tile of the online softmax: (P, rescale factor of the earlier sums, new max).
    ``sc * scale`` are log2-domain scores; ``m_i`` the running max (scaled), -inf while a row
    has seen no allowed key: with MAY_EMPTY (a bias or a window's left bound can hide a whole
    tile) such a row is exponentiated against 0, so its P and factor are 0 instead of NaN.
    ROW_OFF: the scores are ``sc + roff`` (a row vector, :func:`_alibi_split`), added per row only;
    EXP2_POLY: half of P's exponentials on the FMA pipe (:func:`_exp2_half_poly`)."""
    if ROW_OFF:
        m_new = gl.maximum(m_i, (gl.max(sc, 1) + roff) * scale)
    else:
        m_new = gl.maximum(m_i, gl.max(sc, 1) * scale)
    m_use = m_new
    if MAY_EMPTY:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    m_sub = m_use
    if ROW_OFF:
        m_sub = m_use - roff * scale
    if EXP2_POLY:
        p = _exp2_half_poly(sc * scale - m_sub[:, None])
    else:
        p = gl.exp2(sc * scale - m_sub[:, None])
    return p, gl.exp2(m_i - m_use), m_new


# 2^x for x <= 0 on the FMA pipe (FA4's trick, issue 36): Cody-Waite split x = n + f (n = floor(x)
# by a round-down add of 1.5 * 2^23, f in [0, 1)), 2^f by a degree-3 minimax polynomial
# (flash-attn 4's coefficients: relative error 8.8e-5, bf16's rounding of P is 2^-9), 2^n by adding
# n to the exponent bits; x clamped at -127 (2^-127 + f gives 0 or a denormal below 2^-126)
_EXP2_POLY_ASM = gl.constexpr("""{
.reg .b32 xc, xr, xb, f, q, e;
ex2.approx.ftz.f32 $0, $2;
max.ftz.f32 xc, $3, 0fC2FE0000;
add.rm.ftz.f32 xr, xc, 0f4B400000;
sub.ftz.f32 xb, xr, 0f4B400000;
sub.ftz.f32 f, xc, xb;
fma.rn.ftz.f32 q, f, 0f3D9DF09D, 0f3E6906A4;
fma.rn.ftz.f32 q, q, f, 0f3F31F519;
fma.rn.ftz.f32 q, q, f, 0f3F800000;
shl.b32 e, xr, 23;
add.s32 $1, e, q;
}""")


@gluon.jit
def _exp2_half_poly(x):
    """exp2 of a tile whose elements are <= 0 (or -inf): of each pair of a thread's consecutive
    elements (two adjacent columns of a wgmma tile) one by ex2.approx (MUFU), one by the polynomial
    above (nine FP32/integer ops): a softcap's tanh already takes one MUFU op a score (E87)."""
    return gl.inline_asm_elementwise(_EXP2_POLY_ASM, "=r,=r,r,r", [x], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def _tanh(x):
    """tanh.approx.f32: one MUFU op (max relative error 2^-11, below the 16-bit inputs' rounding;
    FlashAttention's softcap uses it too) where 1 - 2 / (e^{2x} + 1) took two (E87)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


# float32 1.5 * 2^23: MAGIC + n is exact for integers |n| < 2^22 (:func:`_small_int_f32`)
MAGIC = gl.constexpr(12582912.0)


@gluon.jit
def _small_int_f32(n):
    """MAGIC + n as float32 for int32 ``n`` (|n| < 2^22): its bits, with no conversion instruction;
    the difference of two such values is exact."""
    return (n + 0x4B400000).to(gl.float32, bitcast=True)


@gluon.jit
def _score_scales(qk_scale, softcap, alibi_slope, HAS_BIAS: gl.constexpr, SOFTCAP: gl.constexpr):
    """(scale, to_nat, alibi_coef) of issue 36's score transforms (:func:`_score_transform`): the
    softmax takes scores in units of ``scale`` (log2 per unit): the raw products (qk_scale), the
    softcap's tanh (softcap * log2(e): the cap's product folded into the softmax's one FMA), or with
    a bias natural-log scores (log2(e); ``to_nat``: natural log per raw unit); ALiBi's slope in those
    units."""
    scale = qk_scale
    to_nat = qk_scale * LN2
    if SOFTCAP:
        scale = softcap * LOG2E
        to_nat = softcap
    if HAS_BIAS:
        scale = LOG2E
    return scale, to_nat, alibi_slope * LOG2E / scale


@gluon.constexpr_function
def _v_chunk_layout(head_d):
    """Registers of a (16, head_d) 16-bit tile over one warpgroup, 8 contiguous elements a thread."""
    cols = min(32, head_d // 8)
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [4, 1], [1, 0])


@gluon.jit
def _scale_in_place(tile, factor):
    """The shared-memory tile ``tile`` (rows, head dim) times ``factor`` in place (float32, rounded back to its
    dtype), 16 rows at a time, by one warpgroup: a softcap's tanh argument then comes out of the product that
    reads it (the forward's Q, E150; the dK/dV pass's K, E152)."""
    BLOCK_M: gl.constexpr = tile.shape[0]
    HEAD_D: gl.constexpr = tile.shape[1]
    CH: gl.constexpr = 16
    layout: gl.constexpr = _v_chunk_layout(HEAD_D)
    for c in gl.static_range(BLOCK_M // CH):
        chunk = tile.slice(c * CH, CH)
        vals = chunk.load(layout)
        chunk.store((vals.to(gl.float32) * factor).to(vals.dtype))
    fence_async_shared()  # the generic stores before the wgmma's async read


@gluon.jit
def _score_transform(
    sc,
    rows_f,
    cols_f,
    softcap_in,
    to_nat,
    alibi_coef,
    HAS_BIAS: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    ROWLESS: gl.constexpr,
):
    """Raw products -> (scores in :func:`_score_scales`' units before the bias, tanh or 0.0): a
    softcap's tanh(sc * softcap_in) (d score / d(raw) = to_nat * (1 - tanh^2)), times ``to_nat``
    before a bias, minus ALiBi's ``alibi_coef * |i + off - j|`` from ``rows_f`` = MAGIC + i + off -
    origin and ``cols_f`` = MAGIC + j - origin (:func:`_small_int_f32`), broadcast to sc's shape in
    either orientation.  ROWLESS (every allowed key j <= i + off): plus alibi_coef * (j - origin)
    only; the query's term is constant along a softmax row, which the caller restores."""
    t = 0.0
    if SOFTCAP:
        t = _tanh(sc * softcap_in)
        sc = t
    if HAS_BIAS:
        sc = sc * to_nat
    if HAS_ALIBI:
        if ROWLESS:
            sc = sc + alibi_coef * (cols_f - MAGIC)
        else:
            sc = sc - alibi_coef * gl.abs(rows_f - cols_f)
    return sc, t


@gluon.jit
def _alibi_split(sc, cr, ckj, k0, coef, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LEFT: gl.constexpr = False):
    """ALiBi of a (query rows x keys) tile, as (sc', roff) with scores = sc' + roff per row (units of
    ``coef`` = slope log2(e) / scale; E87): with r = i + off - origin in [0, BLOCK_M) (``cr`` = coef r,
    a row vector), k = j - origin = k0 + jj (``ckj`` = coef jj, loop-invariant), a tile left of the
    diagonal (k <= r) has -coef |r - k| = coef k - cr, one right of it cr - coef k: one FFMA a score
    (sc + -+ckj) and a row offset; a tile crossing it adds 2 min(cr - coef k, 0) (two ops more).
    LEFT: every allowed key is left of its row's diagonal (a band with WINDOW_RIGHT = 0): the left
    form in every tile, with no correction (the pairs right of the diagonal are masked after)."""
    if LEFT:
        sc = sc + ckj[None, :]
        roff = coef * k0.to(gl.float32) - cr
    else:
        right = k0 >= BLOCK_M - 1
        sgn = gl.where(right, -1.0, 1.0)
        ck0 = coef * k0.to(gl.float32)
        sc = gl.fma(ckj[None, :], sgn, sc)
        roff = sgn * (ck0 - cr)
        if (not right) & (k0 + BLOCK_N - 1 > 0):
            sc = sc + 2.0 * gl.minimum((cr - ck0)[:, None] - ckj[None, :], 0.0)
    return sc, roff


@gluon.jit
def _lse_log2(lse, MAY_EMPTY: gl.constexpr):
    """Logsumexp rows in the log2 domain for P = exp2(scores - lse); a row with no allowed key
    (lse = -inf, MAY_EMPTY) becomes +inf, so its P is 0 instead of NaN."""
    if MAY_EMPTY:
        lse = gl.where(lse == float("-inf"), float("inf"), lse)
    return lse * LOG2E
