"""The head-dim-512 forward (Dqk = Dv = 512, sm90) in Gluon: docs/experiments/head-dim-512.md's
design in the probe's no-loader layout (benchmarks/probe_d512_gluon.py ``--layout no-loader``:
452-458 TFLOP/s dense at B=2 H=16 S=4096 on the H100, the tl forward 233).

One program: 64 query rows of one (b, h), three warpgroups (12 warps), no loader warp:
  * the S warpgroup (the default partition) loads Q as eight 64 x 64 TMA chunks through the K
    ring's first two slots into registers (the A operands of a chain of eight register-A
    wgmmas), then keeps K_STAGES 32-key K tiles (32 x 512, one copy each) in flight; per tile
    S = Q K^T, the causal mask on the tiles crossing the diagonal, the online softmax; it hands P
    (16-bit) and each row's rescale factor to the P V warpgroups through shared memory,
    double-buffered, then 1 / l the same way, and writes the logsumexp in the tl forward's form
    (natural log, (B, H, Sq) fp32: the tl backward reads it);
  * two P V warpgroups, each owning 256 columns of Dv as one 64 x 256 fp32 accumulator, keep
    V_STAGES of their V halves (32 x 256) in flight, rescale, add P V (SS wgmma), and write their
    half of O through the K ring's first two slots after the last hand-over.
Each warpgroup refills a slot right after its own wgmmas on it retired (a warpgroup barrier
first: a TMA copy's boxes issue from every warp), so besides P's two only ready barriers remain.
Registers: Triton gives the S warpgroup 504 - 2 x PV_REGS (184 at 160, none spilled in the probe).

Scope (route_d512.py says why a call is not served): fp16/bf16, dense (not varlen), no mask,
dropout, softcap, ALiBi or sinks; no band, or causal in either alignment (``diag``: the key
offset of query 0's diagonal, Sk - Sq bottom-right or 0 top-left, never negative, so that every
row sees key 0 and no row is empty); Sq a multiple of 64 and Sk of 32; GQA; positive scale.
Q, K and V in common.py's row layouts (Q_ROWS / KV_ROWS); O (B, H, Sq, D) contiguous.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import LN2, WG_ROWS, _masked, _softmax_step, _tile_origin, _wgmma_layout, _wgmma_operand

HEAD_D = gl.constexpr(512)
BLOCK_N = gl.constexpr(32)  # keys per K/V tile: the widest that leaves room for a ring (the design)
CHUNK = gl.constexpr(64)  # Q columns per TMA chunk and per wgmma of the S chain: one 128-byte swizzle row
HALF = gl.constexpr(256)  # Dv columns per P V warpgroup


@gluon.jit
def _program(
    seq_q, seq_k, num_heads, head_groups, diag, Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr, CAUSAL: gl.constexpr
):
    """What every partition derives alike from the program id: (query block, ``b * Hq + h``, Q's
    first row and column, K/V's first row and column, key tiles read, tiles below the diagonal).
    Causal blocks run longest first (the grid's last programs are the shortest)."""
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    pid_bh = gl.program_id(1)
    q_row, q_col = _tile_origin(pid_bh, 1, num_heads, seq_q, Q_ROWS, HEAD_D)
    kv_row, kv_col = _tile_origin(pid_bh, head_groups, num_heads, seq_k, KV_ROWS, HEAD_D)
    n_tiles = seq_k // BLOCK_N
    n_full = n_tiles
    if CAUSAL:
        # up to the block's last row's diagonal; tiles wholly left of its first row's need no mask
        n_tiles = gl.minimum(n_tiles, gl.cdiv(pid_m * WG_ROWS + WG_ROWS + diag, BLOCK_N))
        n_full = (pid_m * WG_ROWS + diag + 1) // BLOCK_N
    return pid_m, pid_bh, q_row + pid_m * WG_ROWS, q_col, kv_row, kv_col, n_tiles, n_full


@gluon.jit
def _q_view(k_bufs, q_desc):
    """Q's eight 64 x 64 chunks in the K ring's first two slots: the ring holds Q until the S
    warpgroup has it in registers (a 64 x 64 chunk is 8 KiB, a 32 x 512 slot 32 KiB)."""
    n: gl.constexpr = k_bufs.shape[0] * k_bufs.shape[2] // (2 * CHUNK)
    return k_bufs._reinterpret(q_desc.dtype, [n] + q_desc.block_type.shape, q_desc.layout)


@gluon.jit
def _load_k_tile(k_desc, k_bufs, k_ready, row, col, j):
    """Key tile ``j`` into K slot j % K_STAGES as one 32 x 512 copy: Triton's membar pass puts a
    warpgroup barrier before every copy op, so one op, not eight (its boxes spread over the warps)."""
    s = j % k_bufs.shape[0]
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row + j * BLOCK_N, col], k_ready.index(s), k_bufs.index(s))


@gluon.jit
def _load_v_half(v_desc, v_bufs, v_ready, row, col, j, H: gl.constexpr):
    """Half ``H`` (columns H * 256..) of key tile ``j``'s V into V slot j % V_STAGES."""
    V_STAGES: gl.constexpr = v_bufs.shape[0] // 2
    vb = 2 * (j % V_STAGES) + H
    mbarrier.expect(v_ready.index(vb), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row + j * BLOCK_N, col + H * HALF], v_ready.index(vb), v_bufs.index(vb))


@gluon.jit
def _hand_over(p_bufs, a_bufs, p_ready, p_empty, j, p16, factor, WITH_P: gl.constexpr):
    """Step ``j``'s P (``WITH_P``) and per-row factor into slot j % 2 for the P V warpgroups, once
    both have freed it."""
    slot = j % 2
    mbarrier.wait(p_empty.index(slot), ((j // 2) & 1) ^ 1)  # a fresh barrier: the first lap passes
    if WITH_P:
        p_bufs.index(slot).store(p16)
    a_bufs.index(slot).store(factor)
    fence_async_shared()  # generic stores before the wgmma's async-proxy read
    gl.thread_barrier()  # the arrive is thread 0's: every thread's stores first
    mbarrier.arrive(p_ready.index(slot), count=1)


@gluon.jit
def _s_warpgroup(args, Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr, CAUSAL: gl.constexpr, STORE_LSE: gl.constexpr):
    """S = Q K^T (Q in registers), the mask, the online softmax, P and the factors to shared
    memory, the logsumexp; it loads Q and keeps K_STAGES key tiles in flight itself."""
    (q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, seq_q, seq_k, num_heads, head_groups, diag) = args[0]
    k_bufs, v_bufs, p_bufs, a_bufs, bars = args[1]
    q_bar, k_ready, v_ready, p_ready, p_empty = bars
    CHUNKS: gl.constexpr = HEAD_D // CHUNK
    K_STAGES: gl.constexpr = k_bufs.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    pid_m, pid_bh, q_row, q_col, kv_row, kv_col, n_tiles, n_full = _program(
        seq_q, seq_k, num_heads, head_groups, diag, Q_ROWS, KV_ROWS, CAUSAL
    )
    q_bufs = _q_view(k_bufs, q_desc)
    mbarrier.expect(q_bar.index(0), CHUNKS * q_desc.block_type.nbytes)
    for c in gl.static_range(CHUNKS):
        tma.async_copy_global_to_shared(q_desc, [q_row, q_col + c * CHUNK], q_bar.index(0), q_bufs.index(c))
    mbarrier.wait(q_bar.index(0), 0)
    q = ()
    for c in gl.static_range(CHUNKS):
        q = q + (q_bufs.index(c).load(_wgmma_operand(BLOCK_N)),)
    fence_async_shared()  # Q's generic reads before the TMA writes into its slots
    gl.thread_barrier()
    for t in gl.static_range(K_STAGES):
        if t < n_tiles:
            _load_k_tile(k_desc, k_bufs, k_ready, kv_row, kv_col, t)

    # each row's diagonal key (causal): key j is allowed where j <= it
    diag_rows = pid_m * WG_ROWS + diag + gl.arange(0, WG_ROWS, row_s)
    zero_s = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, row_s)
    for j in range(n_tiles):
        s = j % K_STAGES
        mbarrier.wait(k_ready.index(s), (j // K_STAGES) & 1)
        k_slot = k_bufs.index(s)
        acc = warpgroup_mma(q[0], k_slot.slice(0, CHUNK, dim=1).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        for c in gl.static_range(1, CHUNKS):
            acc = warpgroup_mma(q[c], k_slot.slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)), acc, is_async=True)
        sc = warpgroup_mma_wait(0, deps=[acc])
        # every warp's wgmma reads of the slot retired before its refill (TMA may issue from any warp)
        gl.thread_barrier()
        if j + K_STAGES < n_tiles:  # none past the last: O leaves through the ring's first slots
            _load_k_tile(k_desc, k_bufs, k_ready, kv_row, kv_col, j + K_STAGES)
        if CAUSAL:
            if j >= n_full:
                cols = j * BLOCK_N + gl.arange(0, BLOCK_N, col_s)
                sc = _masked(sc, diag_rows[:, None], cols[None, :], -1, 0)
        # every row sees key 0 (diag >= 0): the running max is finite from the first tile on
        p, alpha, m_i = _softmax_step(sc, m_i, qk_scale, False)
        l_i = l_i * alpha + gl.sum(p, 1)
        _hand_over(p_bufs, a_bufs, p_ready, p_empty, j, p.to(dtype), alpha, True)
    # the last slot carries 1 / l, and no P
    _hand_over(p_bufs, a_bufs, p_ready, p_empty, n_tiles, zero_s.to(dtype), 1.0 / l_i, False)
    if STORE_LSE:
        rows = pid_bh * seq_q + pid_m * WG_ROWS + gl.arange(0, WG_ROWS, row_s)
        gl.store(lse_ptr + rows, (m_i + gl.log2(l_i)) * LN2)


@gluon.jit
def _pv_warpgroup(
    args, H: gl.constexpr, V_STAGES: gl.constexpr, Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr, CAUSAL: gl.constexpr
):
    """Columns H * 256.. of O: acc = acc * factor + P V_half per key tile, then times 1 / l; it keeps
    V_STAGES of its V halves in flight itself."""
    (q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, seq_q, seq_k, num_heads, head_groups, diag) = args[0]
    k_bufs, v_bufs, p_bufs, a_bufs, bars = args[1]
    q_bar, k_ready, v_ready, p_ready, p_empty = bars
    dtype: gl.constexpr = q_desc.dtype
    o_layout: gl.constexpr = _wgmma_layout(HALF)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    pid_m, pid_bh, q_row, q_col, kv_row, kv_col, n_tiles, n_full = _program(
        seq_q, seq_k, num_heads, head_groups, diag, Q_ROWS, KV_ROWS, CAUSAL
    )
    for t in gl.static_range(V_STAGES):
        if t < n_tiles:
            _load_v_half(v_desc, v_bufs, v_ready, kv_row, kv_col, t, H)
    acc = gl.zeros([WG_ROWS, HALF], gl.float32, o_layout)
    for j in range(n_tiles):
        slot = j % 2
        vb = 2 * (j % V_STAGES) + H
        mbarrier.wait(p_ready.index(slot), (j // 2) & 1)
        acc = acc * a_bufs.index(slot).load(row_o)[:, None]
        mbarrier.wait(v_ready.index(vb), (j // V_STAGES) & 1)
        tok = warpgroup_mma(p_bufs.index(slot), v_bufs.index(vb), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[tok])
        gl.thread_barrier()  # every warp's wgmma reads of P and V retired (as in _s_warpgroup)
        mbarrier.arrive(p_empty.index(slot), count=1)
        if j + V_STAGES < n_tiles:
            _load_v_half(v_desc, v_bufs, v_ready, kv_row, kv_col, j + V_STAGES, H)
    slot = n_tiles % 2
    mbarrier.wait(p_ready.index(slot), (n_tiles // 2) & 1)
    inv_l = a_bufs.index(slot).load(row_o)[:, None]
    # O leaves through the K ring: the S warpgroup handed over 1 / l after its last K read
    o_bufs = k_bufs._reinterpret(dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    o_bufs.index(H).store((acc * inv_l).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [pid_bh * seq_q + pid_m * WG_ROWS, H * HALF], o_bufs.index(H))
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_d512(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    lse_ptr,
    qk_scale,
    seq_q,
    seq_k,
    num_heads,
    head_groups,
    diag,
    Q_ROWS: gl.constexpr,
    KV_ROWS: gl.constexpr,
    CAUSAL: gl.constexpr,
    STORE_LSE: gl.constexpr,
    K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr,
    PV_REGS: gl.constexpr,
):
    """Grid (Sq / 64, B * Hq).  Descriptors' tiles: Q 64 x 64, K 32 x 512, V 32 x 256 over q's, k's
    and v's row matrices (Q_ROWS / KV_ROWS), O 64 x 256 over (B * Hq * Sq, 512); ``lse_ptr``: fp32
    (B * Hq * Sq,) (STORE_LSE); ``qk_scale``: the softmax scale times log2(e); ``num_heads``: Hq,
    ``head_groups``: Hq / Hkv; ``diag``: causal's diagonal offset (>= 0)."""
    gl.static_assert(K_STAGES >= 2)  # Q and O pass through the ring's first two slots
    gl.static_assert(o_desc.block_type.shape[1] == HALF)
    dtype: gl.constexpr = q_desc.dtype
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    k_bufs = gl.allocate_shared_memory(dtype, [K_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2 * V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    p_bufs = gl.allocate_shared_memory(dtype, [2, WG_ROWS, BLOCK_N], p_layout)
    a_bufs = gl.allocate_shared_memory(gl.float32, [2, WG_ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2 * V_STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
    for i in gl.static_range(2 * V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_empty.index(i), count=2)  # both P V warpgroups
    bars = (q_bar, k_ready, v_ready, p_ready, p_empty)
    # runtime arguments as one tuple, constexprs spelled out (inside a tuple they lose their kind)
    runtime = (q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, seq_q, seq_k, num_heads, head_groups, diag)
    args = (runtime, (k_bufs, v_bufs, p_bufs, a_bufs, bars))
    H0: gl.constexpr = 0
    H1: gl.constexpr = 1
    gl.warp_specialize(
        [
            (_s_warpgroup, (args, Q_ROWS, KV_ROWS, CAUSAL, STORE_LSE)),
            (_pv_warpgroup, (args, H0, V_STAGES, Q_ROWS, KV_ROWS, CAUSAL)),
            (_pv_warpgroup, (args, H1, V_STAGES, Q_ROWS, KV_ROWS, CAUSAL)),
        ],
        [4, 4],
        [PV_REGS, PV_REGS],
    )
