"""Probe of the Gluon d512 forward designed in docs/experiments/head-dim-512.md ("A Gluon d512 forward,
by arithmetic"; issue 36): nothing in the package uses it.

    python benchmarks/probe_d512_gluon.py [--mode s-only|full|both] [--layout loader|no-loader]
        [--k-stages N] [--v-stages N] [--pv-regs R] [--s-regs R] [--pv-n 128|256] [--compile-only] [--baseline]

One program: 64 query rows of one (b, h), dense, non-causal, bf16, Sq = Sk, D = 512.
  * a loader warp streams K in 32-key tiles (eight 32 x 64 TMA chunks a slot, ``K_STAGES`` slots)
    and, in "full", V in two 32 x 256 halves (``V_STAGES`` slots); Q arrives first, through the
    K ring's first two slots;
  * the S warpgroup (the default partition) holds Q in registers as eight 64 x 64 chunks, the A
    operands of a chain of eight register-A wgmmas (S = Q K^T over the chunks), runs the online
    softmax and hands P (bf16) and each row's rescale factor to shared memory, double-buffered,
    then 1 / l the same way; it writes the logsumexp;
  * "full": two P V warpgroups, each owning 256 of Dv (two 64 x 128 fp32 accumulators, or with
    ``--pv-n 256`` one 64 x 256: see :func:`_pv_warpgroup`), rescale, add P V from shared memory
    (SS wgmma) and write their half of O through the K ring.
"s-only" keeps the loader and the S warpgroup, writes P and the factors (nobody reads them) and
the logsumexp; it runs under the register cap the S warpgroup would get in "full" (``--s-regs``).
``--layout no-loader`` drops the loader warp (``SELF_LOAD``): the S warpgroup loads Q and its K
ring, each P V warpgroup its own V half's ring, each refilling a slot right after its wgmmas on it
retired, so only the ready barriers remain.  The kernel has 12 warps instead of 16 (the loader is
padded to a warpgroup): a launch cap of 168 registers, S + 2 x PV <= 504 (16 warps: 24 + S + 2 x PV
<= 512, launch cap 128); s-only is then the S warpgroup alone (4 warps, launch cap ``--s-regs``).

On a GPU: times B=2 H=16 S=4096 and prints TFLOP/s counting the work done (s-only: Q K^T only,
2 B H S^2 D; full: 4 B H S^2 D), after checking the logsumexp (both) and O (full) against float32
torch on a small case.  ``--compile-only`` (no GPU; benchmarks/probe_d512_compile.py): compiles for
sm90 and prints the partitions' register caps (setmaxnreg), ptxas's registers and spills, registers
touched and local-memory instructions per partition (SASS), and the shared memory by buffer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attention_dispatch.kernels.gluon.common import (  # noqa: E402
    LN2,
    LOG2E,
    WG_ROWS,
    _softmax_step,
    _wgmma_layout,
    _wgmma_operand,
)

HEAD_D = gl.constexpr(512)
BLOCK_N = gl.constexpr(32)  # keys per K/V tile: the widest that leaves room for a ring (the design)
CHUNK = gl.constexpr(64)  # Q/K columns per TMA chunk and per wgmma of the S chain: one 128-byte swizzle row
HALF = gl.constexpr(256)  # Dv columns per P V warpgroup
LOADER_REGS = gl.constexpr(24)
SMEM_LIMIT = 232448  # bytes of shared memory a block may take on sm90 (227 KiB)


@gluon.jit
def _q_view(k_bufs, q_desc):
    """Q's eight 64 x 64 chunks in the K ring's first two slots: a 64-row chunk is byte for byte
    two 32-row ones (same 128-byte swizzle), so the ring holds Q until the S warpgroup has it."""
    n: gl.constexpr = k_bufs.shape[0] * k_bufs.shape[2] // (2 * CHUNK)
    return k_bufs._reinterpret(q_desc.dtype, [n] + q_desc.block_type.shape, q_desc.layout)


@gluon.jit
def _k_chunk(k_bufs, s, c: gl.constexpr):
    """Columns c * 64.. of K slot ``s`` (32 x 64): the ring is 32 x 64 buffers (the loader's: one
    TMA copy each) or one 32 x 512 buffer a slot (no loader: one copy a tile)."""
    if k_bufs.shape[2] == HEAD_D:
        return k_bufs.index(s).slice(c * CHUNK, CHUNK, dim=1)
    else:
        return k_bufs.index(s * (HEAD_D // CHUNK) + c)


@gluon.jit
def _load_k_tile(k_desc, k_bufs, k_ready, row, j):
    """Key tile ``j`` into K slot j % K_STAGES as one 32 x 512 copy: Triton's membar pass puts a
    warpgroup barrier before every copy (they share the ready barrier), so one, not eight;
    the lowering spreads its eight 32 x 64 boxes over the warps."""
    gl.static_assert(k_desc.block_type.shape[1] == HEAD_D)
    s = j % k_bufs.shape[0]
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row + j * BLOCK_N, 0], k_ready.index(s), k_bufs.index(s))


@gluon.jit
def _load_v_half(v_desc, v_bufs, v_ready, row, j, H: gl.constexpr):
    """Half ``H`` (columns H * 256..) of key tile ``j``'s V into V slot j % V_STAGES."""
    V_STAGES: gl.constexpr = v_bufs.shape[0] // 2
    vb = 2 * (j % V_STAGES) + H
    mbarrier.expect(v_ready.index(vb), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row + j * BLOCK_N, H * HALF], v_ready.index(vb), v_bufs.index(vb))


@gluon.jit
def _loader(args, FULL: gl.constexpr, V_STAGES: gl.constexpr):
    """Q once, then per key tile its K chunks and (FULL) its two V halves."""
    q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, seq, k_bufs, v_bufs, p_bufs, a_bufs, bars = args
    q_bar, q_free, k_ready, k_empty, v_ready, v_empty, p_ready, p_empty = bars
    CHUNKS: gl.constexpr = HEAD_D // CHUNK
    K_STAGES: gl.constexpr = k_bufs.shape[0] // CHUNKS
    row = gl.program_id(1) * seq
    q_bufs = _q_view(k_bufs, q_desc)
    mbarrier.expect(q_bar.index(0), CHUNKS * q_desc.block_type.nbytes)
    for c in gl.static_range(CHUNKS):
        tma.async_copy_global_to_shared(
            q_desc, [row + gl.program_id(0) * WG_ROWS, c * CHUNK], q_bar.index(0), q_bufs.index(c)
        )
    mbarrier.wait(q_free.index(0), 0)  # Q's slots are the ring's first two
    for j in range(seq // BLOCK_N):
        s = j % K_STAGES
        # a fresh barrier counts as having completed phase 1: the first lap does not wait
        mbarrier.wait(k_empty.index(s), ((j // K_STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), CHUNKS * k_desc.block_type.nbytes)
        for c in gl.static_range(CHUNKS):
            tma.async_copy_global_to_shared(
                k_desc, [row + j * BLOCK_N, c * CHUNK], k_ready.index(s), k_bufs.index(s * CHUNKS + c)
            )
        if FULL:
            sv = j % V_STAGES
            for h in gl.static_range(2):
                mbarrier.wait(v_empty.index(2 * sv + h), ((j // V_STAGES) & 1) ^ 1)
                mbarrier.expect(v_ready.index(2 * sv + h), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    v_desc, [row + j * BLOCK_N, h * HALF], v_ready.index(2 * sv + h), v_bufs.index(2 * sv + h)
                )


@gluon.jit
def _hand_over(p_bufs, a_bufs, p_ready, p_empty, j, p16, factor, FULL: gl.constexpr, WITH_P: gl.constexpr):
    """Step ``j``'s P (``WITH_P``) and per-row factor into slot j % 2 for the P V warpgroups."""
    slot = j % 2
    if FULL:  # s-only: nobody reads the slot, it is overwritten
        mbarrier.wait(p_empty.index(slot), ((j // 2) & 1) ^ 1)
    if WITH_P:
        p_bufs.index(slot).store(p16)
    a_bufs.index(slot).store(factor)
    fence_async_shared()  # generic stores before the wgmma's async-proxy read
    gl.thread_barrier()  # the arrive is thread 0's: every thread's stores first
    if FULL:
        mbarrier.arrive(p_ready.index(slot), count=1)


@gluon.jit
def _s_warpgroup(args, FULL: gl.constexpr, SELF_LOAD: gl.constexpr):
    """S = Q K^T (Q in registers), the online softmax, P and the factors to shared memory.
    SELF_LOAD: no loader; it loads Q, then keeps K_STAGES key tiles in flight itself."""
    q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, seq, k_bufs, v_bufs, p_bufs, a_bufs, bars = args
    q_bar, q_free, k_ready, k_empty, v_ready, v_empty, p_ready, p_empty = bars
    CHUNKS: gl.constexpr = HEAD_D // CHUNK
    K_STAGES: gl.constexpr = k_bufs.shape[0] * k_bufs.shape[2] // HEAD_D
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_bufs = _q_view(k_bufs, q_desc)
    if SELF_LOAD:
        row = gl.program_id(1) * seq
        mbarrier.expect(q_bar.index(0), CHUNKS * q_desc.block_type.nbytes)
        for c in gl.static_range(CHUNKS):
            tma.async_copy_global_to_shared(
                q_desc, [row + gl.program_id(0) * WG_ROWS, c * CHUNK], q_bar.index(0), q_bufs.index(c)
            )
    mbarrier.wait(q_bar.index(0), 0)
    q = ()
    for c in gl.static_range(CHUNKS):
        q = q + (q_bufs.index(c).load(_wgmma_operand(BLOCK_N)),)
    if SELF_LOAD:
        fence_async_shared()  # Q's generic reads before the TMA writes into its slots
        gl.thread_barrier()
        for t in gl.static_range(K_STAGES):
            if t < seq // BLOCK_N:
                _load_k_tile(k_desc, k_bufs, k_ready, row, t)
    else:
        gl.thread_barrier()  # every thread has its Q before the loader overwrites the slots
        mbarrier.arrive(q_free.index(0), count=1)

    zero_s = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, row_s)
    n_tiles = seq // BLOCK_N
    for j in range(n_tiles):
        s = j % K_STAGES
        mbarrier.wait(k_ready.index(s), (j // K_STAGES) & 1)
        acc = warpgroup_mma(q[0], _k_chunk(k_bufs, s, 0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        for c in gl.static_range(1, CHUNKS):
            acc = warpgroup_mma(q[c], _k_chunk(k_bufs, s, c).permute((1, 0)), acc, is_async=True)
        sc = warpgroup_mma_wait(0, deps=[acc])
        if SELF_LOAD:
            # every warp's wgmma reads of the slot retired before its refill (TMA may issue from any warp)
            gl.thread_barrier()
            if j + K_STAGES < n_tiles:  # none past the last: O leaves through the ring's first slots
                _load_k_tile(k_desc, k_bufs, k_ready, row, j + K_STAGES)
        else:
            mbarrier.arrive(k_empty.index(s), count=1)
        p, alpha, m_i = _softmax_step(sc, m_i, qk_scale, False)
        l_i = l_i * alpha + gl.sum(p, 1)
        _hand_over(p_bufs, a_bufs, p_ready, p_empty, j, p.to(dtype), alpha, FULL, True)
    # the last slot carries 1 / l, and no P
    _hand_over(p_bufs, a_bufs, p_ready, p_empty, n_tiles, zero_s.to(dtype), 1.0 / l_i, FULL, False)
    rows = gl.program_id(1) * seq + gl.program_id(0) * WG_ROWS + gl.arange(0, WG_ROWS, row_s)
    gl.store(lse_ptr + rows, (m_i + gl.log2(l_i)) * LN2)


@gluon.jit
def _pv_warpgroup(args, H: gl.constexpr, V_STAGES: gl.constexpr, SELF_LOAD: gl.constexpr):
    """Columns H * 256.. of O: acc = acc * factor + P V_half per key tile, then times 1 / l.  The half
    is one 64 x 256 accumulator when O's tile is 64 x 256 (``--pv-n 256``), else two 64 x 128: ptxas
    refuses an m64n256 fp32 wgmma in a kernel whose launch cap is 128 registers a thread (16 warps),
    whatever setmaxnreg gives the partition.  SELF_LOAD: it keeps V_STAGES of its V halves in flight."""
    q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, seq, k_bufs, v_bufs, p_bufs, a_bufs, bars = args
    q_bar, q_free, k_ready, k_empty, v_ready, v_empty, p_ready, p_empty = bars
    dtype: gl.constexpr = q_desc.dtype
    N: gl.constexpr = o_desc.block_type.shape[1]
    TWO: gl.constexpr = N < HALF
    o_layout: gl.constexpr = _wgmma_layout(N)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if SELF_LOAD:
        row = gl.program_id(1) * seq
        for t in gl.static_range(V_STAGES):
            if t < seq // BLOCK_N:
                _load_v_half(v_desc, v_bufs, v_ready, row, t, H)
    acc0 = gl.zeros([WG_ROWS, N], gl.float32, o_layout)
    if TWO:
        acc1 = gl.zeros([WG_ROWS, N], gl.float32, o_layout)
    n_tiles = seq // BLOCK_N
    for j in range(n_tiles):
        slot = j % 2
        vb = 2 * (j % V_STAGES) + H
        mbarrier.wait(p_ready.index(slot), (j // 2) & 1)
        factor = a_bufs.index(slot).load(row_o)[:, None]
        acc0 = acc0 * factor
        if TWO:
            acc1 = acc1 * factor
        mbarrier.wait(v_ready.index(vb), (j // V_STAGES) & 1)
        v_buf = v_bufs.index(vb)
        if TWO:
            tok0 = warpgroup_mma(p_bufs.index(slot), v_buf.slice(0, N, dim=1), acc0, is_async=True)
            tok1 = warpgroup_mma(p_bufs.index(slot), v_buf.slice(N, N, dim=1), acc1, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(0, deps=[tok0, tok1])
        else:
            tok0 = warpgroup_mma(p_bufs.index(slot), v_buf, acc0, is_async=True)
            acc0 = warpgroup_mma_wait(0, deps=[tok0])
        if SELF_LOAD:
            gl.thread_barrier()  # every warp's wgmma reads of P and V retired (as in _s_warpgroup)
            mbarrier.arrive(p_empty.index(slot), count=1)
            if j + V_STAGES < n_tiles:
                _load_v_half(v_desc, v_bufs, v_ready, row, j + V_STAGES, H)
        else:
            mbarrier.arrive(p_empty.index(slot), count=1)
            mbarrier.arrive(v_empty.index(vb), count=1)
    slot = n_tiles % 2
    mbarrier.wait(p_ready.index(slot), (n_tiles // 2) & 1)
    inv_l = a_bufs.index(slot).load(row_o)[:, None]
    # O leaves through the K ring: the S warpgroup handed over 1 / l after its last K read
    PARTS: gl.constexpr = HALF // N
    o_bufs = k_bufs._reinterpret(dtype, [2 * PARTS] + o_desc.block_type.shape, o_desc.layout)
    o_row = gl.program_id(1) * seq + gl.program_id(0) * WG_ROWS
    o_bufs.index(PARTS * H).store((acc0 * inv_l).to(dtype))
    if TWO:
        o_bufs.index(PARTS * H + 1).store((acc1 * inv_l).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [o_row, H * HALF], o_bufs.index(PARTS * H))
    if TWO:
        tma.async_copy_shared_to_global(o_desc, [o_row, H * HALF + N], o_bufs.index(PARTS * H + 1))
    tma.store_wait(0)


@gluon.jit
def _probe_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    lse_ptr,
    qk_scale,
    seq,
    FULL: gl.constexpr,
    K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr,
    PV_REGS: gl.constexpr,
    SELF_LOAD: gl.constexpr,
):
    """Grid (Sq / 64, B * H); Q, K, V, O as (B*H*S, 512) row matrices; descriptors' tiles: Q 64 x 64,
    K 32 x 64 (SELF_LOAD: 32 x 512), V 32 x 256, O 64 x 128 (or 64 x 256: one P V accumulator);
    ``lse_ptr`` fp32 (B*H*S,).
    SELF_LOAD: no loader warp (the empty barriers and q_free go unused)."""
    gl.static_assert(K_STAGES >= 2)  # Q and O pass through the ring's first two slots
    dtype: gl.constexpr = q_desc.dtype
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    k_per_slot: gl.constexpr = HEAD_D // k_desc.block_type.shape[1]
    k_bufs = gl.allocate_shared_memory(dtype, [K_STAGES * k_per_slot] + k_desc.block_type.shape, k_desc.layout)
    if FULL:
        v_bufs = gl.allocate_shared_memory(dtype, [2 * V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    else:
        v_bufs = k_bufs  # not read: a stand-in the partitions accept
    p_bufs = gl.allocate_shared_memory(dtype, [2, WG_ROWS, BLOCK_N], p_layout)
    a_bufs = gl.allocate_shared_memory(gl.float32, [2, WG_ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2 * V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2 * V_STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    mbarrier.init(q_free.index(0), count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
    for i in gl.static_range(2 * V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_empty.index(i), count=2)  # both P V warpgroups
    bars = (q_bar, q_free, k_ready, k_empty, v_ready, v_empty, p_ready, p_empty)
    # runtime arguments as one tuple, constexprs spelled out (inside a tuple they lose their kind)
    args = (q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, seq, k_bufs, v_bufs, p_bufs, a_bufs, bars)
    H0: gl.constexpr = 0
    H1: gl.constexpr = 1
    if FULL and SELF_LOAD:
        gl.warp_specialize(
            [
                (_s_warpgroup, (args, FULL, SELF_LOAD)),
                (_pv_warpgroup, (args, H0, V_STAGES, SELF_LOAD)),
                (_pv_warpgroup, (args, H1, V_STAGES, SELF_LOAD)),
            ],
            [4, 4],
            [PV_REGS, PV_REGS],
        )
    elif FULL:
        gl.warp_specialize(
            [
                (_s_warpgroup, (args, FULL, SELF_LOAD)),
                (_pv_warpgroup, (args, H0, V_STAGES, SELF_LOAD)),
                (_pv_warpgroup, (args, H1, V_STAGES, SELF_LOAD)),
                (_loader, (args, FULL, V_STAGES)),
            ],
            [4, 4, 1],
            [PV_REGS, PV_REGS, LOADER_REGS],
        )
    elif SELF_LOAD:  # s-only without a loader: the S warpgroup is the whole kernel
        _s_warpgroup(args, FULL, SELF_LOAD)
    else:
        gl.warp_specialize(
            [(_s_warpgroup, (args, FULL, SELF_LOAD)), (_loader, (args, FULL, V_STAGES))], [1], [LOADER_REGS]
        )


# ---------------------------------------------------------------------------------------------
# host side


def _layout(rows: int, cols: int):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


# "full": Triton gives the default (S) partition S_LEFT - 2 x the P V cap registers a thread, what
# the others leave of 16 warps x 128 (the loader padded to a warpgroup of 24) or 12 warps x 168
S_LEFT = {"loader": 4 * 128 - LOADER_REGS.value, "no-loader": 3 * 168}


def tiles(args) -> list[tuple[str, int, int]]:
    """(descriptor, rows, columns) of each descriptor's tile: K's a whole 32-key tile without the
    loader (one copy), O's one P V accumulator's."""
    return [
        ("q_desc", WG_ROWS.value, CHUNK.value),
        ("k_desc", BLOCK_N.value, CHUNK.value if args.layout == "loader" else HEAD_D.value),
        ("v_desc", BLOCK_N.value, HALF.value),
        ("o_desc", WG_ROWS.value, args.pv_n),
    ]


def launch_options(mode: str, args) -> dict:
    """s-only with the loader runs 8 warps (S warpgroup + the loader's, padded): a launch cap of
    (s_regs + 24) / 2 leaves the S warpgroup s_regs (Triton gives the default partition what the
    others leave); without it, the S warpgroup alone runs under a launch cap of s_regs."""
    opts = dict(num_warps=4)
    if mode == "s-only":
        loader = args.layout == "loader"
        opts["maxnreg"] = (args.s_regs + LOADER_REGS.value) // 2 if loader else args.s_regs
    return opts


def constexprs(mode: str, args) -> dict:
    full = mode == "full"  # s-only: V's barriers allocated (one slot), never used
    return dict(
        FULL=full,
        K_STAGES=args.k_stages,
        V_STAGES=args.v_stages if full else 1,
        PV_REGS=args.pv_regs,
        SELF_LOAD=args.layout == "no-loader",
    )


def prepare(q, k, v, mode: str, args):
    """(launch, O, logsumexp) for (B, H, S, 512) bf16 q, k, v: ``launch()`` runs the kernel into O
    (left zero in s-only) and the logsumexp (B, H, S); outputs and descriptors are built once."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, H, S, D = q.shape
    o = torch.zeros_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    descs = [
        TensorDescriptor(t, [B * H * S, D], [D, 1], [r, c], _layout(r, c))
        for t, (_, r, c) in zip((q, k, v, o), tiles(args))
    ]
    consts = dict(constexprs(mode, args), **launch_options(mode, args))

    def launch():
        _probe_kernel[(S // WG_ROWS.value, B * H)](*descs, lse, D**-0.5 * LOG2E.value, S, **consts)

    return launch, o, lse


def check(mode: str, args) -> None:
    """The logsumexp (and O in full) against float32 torch, B=1 H=2 S=256."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, HEAD_D.value, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    launch, o, lse = prepare(q, k, v, mode, args)
    launch()
    torch.cuda.synchronize()
    scale = HEAD_D.value**-0.5
    ref_lse = torch.logsumexp(q.float() @ k.float().transpose(-1, -2) * scale, -1)
    err = (lse - ref_lse).abs().max().item()
    print(f"{mode}: logsumexp max abs error {err:.2e}")
    assert err < 1e-2, err
    if mode == "full":
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        err = (o.float() - ref).abs().max().item()
        print(f"{mode}: O max abs error {err:.2e} (bf16 output)")
        assert err < 2e-2, err


def knobs(mode: str, args) -> str:
    head = f"{mode} layout={args.layout} K_STAGES={args.k_stages}"
    if mode == "s-only":
        return f"{head} S_REGS={args.s_regs}"
    s_regs = S_LEFT[args.layout] - 2 * args.pv_regs
    return f"{head} V_STAGES={args.v_stages} PV_REGS={args.pv_regs} S_REGS={s_regs} PV_N={args.pv_n}"


def bench(mode: str, args) -> None:
    B, H, S = 2, 16, 4096
    q, k, v = (torch.randn(B, H, S, HEAD_D.value, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    launch, _, _ = prepare(q, k, v, mode, args)
    ms = triton.testing.do_bench(launch, warmup=25, rep=100, return_mode="median")
    flops = (2 if mode == "s-only" else 4) * B * H * S * S * HEAD_D.value
    counted = "Q K^T only" if mode == "s-only" else "Q K^T + P V"
    print(
        f"{knobs(mode, args)}: B={B} H={H} S={S} d=512 dense: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s ({counted})",
        flush=True,
    )


def shared_by_buffer(mode: str, k_stages: int, v_stages: int) -> dict:
    """Bytes of each shared buffer the kernel allocates (the compiler adds alignment and scratch)."""
    full = mode == "full"
    return {
        f"K ring ({k_stages} x 32 keys x 512; Q and O pass through it)": k_stages * BLOCK_N.value * HEAD_D.value * 2,
        f"V ring ({v_stages} x 32 keys x 512)": (v_stages * BLOCK_N.value * HEAD_D.value * 2) if full else 0,
        "P (2 x 64 x 32 bf16)": 2 * WG_ROWS.value * BLOCK_N.value * 2,
        "row factors (2 x 64 fp32)": 2 * WG_ROWS.value * 4,
        "mbarriers": 8 * (2 + 2 * k_stages + 4 * (v_stages if full else 1) + 4),
    }


def report_compile(mode: str, args) -> int:
    """Compile for sm90 without a GPU and print registers, spills and shared memory per partition."""
    from benchmarks import probe_d512_compile as pc

    scalars = dict(lse_ptr="*fp32", qk_scale="fp32", seq="i32")
    descs = [(n, r, c, _layout(r, c)) for n, r, c in tiles(args)]
    err, kernel = pc.compile_sm90(_probe_kernel, descs, scalars, constexprs(mode, args), launch_options(mode, args))
    table = shared_by_buffer(mode, args.k_stages, args.v_stages)
    return pc.report(knobs(mode, args), err, kernel, LOADER_REGS.value, SMEM_LIMIT, table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("s-only", "full", "both"), default="both")
    p.add_argument(
        "--layout",
        choices=tuple(S_LEFT),
        default="loader",
        help="loader: a loader warp issues every TMA load (16 warps); no-loader: each warpgroup loads its own ring",
    )
    p.add_argument("--k-stages", type=int, default=3, help="K ring slots of 32 keys x 512 (32 KiB each), >= 2")
    p.add_argument("--v-stages", type=int, default=3, help="full: V ring slots (two 32 x 256 halves each)")
    p.add_argument("--pv-regs", type=int, default=160, help="full: setmaxnreg of each P V warpgroup")
    p.add_argument(
        "--pv-n", type=int, choices=(128, 256), default=128, help="full: a P V warpgroup's accumulator width (N)"
    )
    p.add_argument(
        "--s-regs",
        type=int,
        default=0,
        help="s-only: the S warpgroup's register cap (0: what full leaves it, 488 - 2 x --pv-regs with the "
        "loader, 504 - 2 x --pv-regs without; full gives the default partition what the others leave)",
    )
    p.add_argument("--compile-only", action="store_true", help="compile for sm90 without a GPU and report")
    p.add_argument("--baseline", action="store_true", help="also time the shipped tl forward (ad.sdpa, backend=triton)")
    args = p.parse_args(argv)
    args.s_regs = args.s_regs or S_LEFT[args.layout] - 2 * args.pv_regs
    modes = ("s-only", "full") if args.mode == "both" else (args.mode,)
    if args.compile_only:
        return max(report_compile(m, args) for m in modes)
    if not torch.cuda.is_available():
        print("no GPU: run with --compile-only")
        return 2
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}", flush=True)
    for m in modes:
        check(m, args)
        bench(m, args)
    if args.baseline:
        import attention_dispatch as ad

        B, H, S = 2, 16, 4096
        q, k, v = (torch.randn(B, H, S, HEAD_D.value, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with torch.no_grad():
            ms = triton.testing.do_bench(lambda: ad.sdpa(q, k, v, backend="triton"), warmup=25, rep=100)
        print(
            f"baseline ad.sdpa(backend='triton') forward: {ms:.3f} ms, {4 * B * H * S * S * 512 / ms / 1e9:.1f} TFLOP/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
