"""Launching the Gluon kernels: TMA descriptors over (B, H, S, D) or (B, S, H, D) rows, the
bias matrix, the fused dQ's fp32 partials, and one launch per pass through run.launch_one."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .. import configs as C
from .. import run
from ..device import device_info, l2_bytes
from ..bias import batch_minor, ws_bias_rows
from ..params import KernelParams
from ..shapes import KernelShapes, cdiv, row_matrix, seq_rows
from ..tl.common import LOG2E

try:  # Gluon (Triton >= 3.5)
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor

    from . import common as _common
    from .dkdv import _attn_bwd_dkdv_ws
    from .dq import _attn_bwd_dq_ws
    from .forward import _attn_fwd_ws

    WG_ROWS = _common.WG_ROWS.value  # rows per consumer warpgroup; a program covers two
    LENS_TENSOR = _common.LENS_TENSOR.value  # the forward's KV_LENS for a lengths tensor
    SOFTCAP_BOUNDED, BOUNDED_LOG2_CAP = _common.SOFTCAP_BOUNDED.value, _common.BOUNDED_LOG2_CAP.value
    GLUON_IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - a Triton without Gluon: the tl kernels serve every call
    _attn_fwd_ws = _attn_bwd_dkdv_ws = _attn_bwd_dq_ws = None
    WG_ROWS, LENS_TENSOR = 64, 1
    SOFTCAP_BOUNDED, BOUNDED_LOG2_CAP = 2, 80.0
    GLUON_IMPORT_ERROR = str(e)

# The jit kernels the launches below run, by pass (None without Gluon): tools compile them
# (benchmarks/compile_sm90.py) or swap in another copy's (benchmarks/forward_ab.py --base-module).
KERNELS = {"fwd_ws": _attn_fwd_ws, "bwd_dkdv_ws": _attn_bwd_dkdv_ws, "bwd_dq_ws": _attn_bwd_dq_ws}


@functools.lru_cache(maxsize=16)
def smem_layout(rows: int, cols: int, dtype: torch.dtype):
    return _gl.NVMMASharedLayout.get_default_for([rows, cols], _gl.bfloat16 if dtype == torch.bfloat16 else _gl.float16)


def rows_descriptor(t: torch.Tensor, layout: int, block_rows: int):
    """Gluon descriptor over ``t`` (B, H, S, D) as the matrix of its rows layout, tiles of one head
    (a slice of a longer tensor's rows: its sequences seq_rows apart, as the kernel's argument)."""
    rows, width = row_matrix(t, layout)
    D = t.shape[3]
    return _GluonDescriptor(t, [rows, width], [width, 1], [block_rows, D], smem_layout(block_rows, D, t.dtype))


class WsBias(NamedTuple):
    """A bias the warp-specialised kernels read (:func:`bias.ws_bias_reason`): the tensor, its row
    stride, the rows of its (rows, Sk) matrix, its rows per batch and per head, and whether
    the programs run batch-fastest (:func:`bias.batch_minor`)."""

    tensor: torch.Tensor
    row_stride: int
    rows: int
    batch_rows: int
    head_rows: int
    batch_minor: bool

    @classmethod
    def of(cls, bias_t, bias_strides, prob: KernelShapes) -> "WsBias":
        batch_rows, head_rows = ws_bias_rows(bias_strides)
        rows = (prob.B - 1) * batch_rows + (prob.Hq - 1) * head_rows + prob.Sq
        return cls(bias_t, bias_strides[2], rows, batch_rows, head_rows, batch_minor(1, bias_strides, prob))

    def descriptor(self, block_rows: int, block_cols: int, seq_k: int):
        """Gluon descriptor over the bias matrix, tiles of (block_rows, block_cols)."""
        return _GluonDescriptor(
            self.tensor,
            [self.rows, seq_k],
            [self.row_stride, 1],
            [block_rows, block_cols],
            smem_layout(block_rows, block_cols, self.tensor.dtype),
        )


def bias_args(bias: "WsBias | None", block_rows: int, block_cols: int, seq_k: int) -> tuple:
    """(descriptor or None, rows per batch, rows per head): a Gluon kernel's bias arguments."""
    if bias is None:
        return None, 0, 0
    return bias.descriptor(block_rows, block_cols, seq_k), bias.batch_rows, bias.head_rows


# The Gluon kernels' launch: 4 warps in the default (first consumer) partition; their pipelines
# are written out.  Launched through compiled_cache like the tl kernels (Triton's own launch path
# costs ~150 us of host time per call, E44).
WS_WARPS, WS_STAGES = 4, 3  # num_stages: Triton's default, as Triton's own launch had


def ws_constexprs(params: KernelParams, bias: "WsBias | None", **rest) -> dict:
    """Constexprs of a Gluon kernel launch: the band, the bias and ``rest`` (row layouts, tiles)."""
    return dict(
        WINDOW_LEFT=params.window_left,
        WINDOW_RIGHT=params.window_right,
        HAS_BIAS=bias is not None,
        BATCH_MINOR=bias is not None and bias.batch_minor,
        **rest,
    )


def score_args(params: KernelParams, prob: KernelShapes, alibi: torch.Tensor | None, stand_in: torch.Tensor) -> tuple:
    """The score transforms' runtime arguments of every Gluon pass (common._score_transform):
    softcap_in, softcap, the slopes (``stand_in`` without), their strides, ALiBi's diagonal offset."""
    return (
        params.scale / params.softcap if params.softcap else 0.0,
        params.softcap,
        alibi if alibi is not None else stand_in,
        *(alibi.stride() if alibi is not None else (0, 0)),
        prob.Sk - prob.Sq if params.align_bottom_right else 0,
    )


# The part of L2 an LPT group's K and V may fill.  FA3/FA4 size groups to the whole L2, but a group's
# K/V are re-read over all its query blocks while Q and O stream through L2 too: bf16 d256 S=512
# causal's 64-row groups (32 MiB of K/V of H100's 50 MiB) read ~1.45x the K/V from HBM in an LRU
# model, where the memory-bound forward went 0.109 -> 0.128 ms (E102); 32-row groups read 1.0-1.02x.
LPT_L2_SHARE = 0.5


def forward_softcap(softcap: float, dtype: torch.dtype):
    """The forward's SOFTCAP constexpr: False without a cap, SOFTCAP_BOUNDED for a cap up to 55.4
    (its softmax needs no running max: gluon/common.py), True above, and for float16 at any cap:
    the fixed reference puts P in [2^(64 - 2 c log2 e), 2^64], past float16's 65504 (its P operand
    overflowed to inf and the output was NaN), and no fixed reference fits every row there: below
    it a row whose scores all sit near -c would underflow to 0."""
    if softcap <= 0:
        return False
    if dtype == torch.float16:
        return True
    return SOFTCAP_BOUNDED if softcap * LOG2E <= BOUNDED_LOG2_CAP else True


def lpt_rows(params: KernelParams, prob: KernelShapes, bias, k: torch.Tensor, n_m_blocks: int) -> int:
    """The forward's launch order (gluon.common._query_block): for a causal call without a bias,
    groups of (b, h) rows whose K and V fit in LPT_L2_SHARE of L2 (a power of two of kv heads,
    their query heads together), longest query blocks first; 0 (the grid's order) otherwise.
    Where a group as large as the whole L2 holds still runs in one wave (its ``n_m_blocks`` query
    blocks a row on the SMs at once), its programs walk their K/V together, read from HBM once:
    that larger group, FA4's sections, evens the last wave (E155: chunked prefill's busiest SM
    268 -> 266 tile steps)."""
    if bias is not None or not (params.window_left < 0 and params.window_right == 0):
        return 0
    one_kv_head = max(prob.Sk * (prob.Dqk + prob.Dv) * k.element_size(), 1)
    l2 = l2_bytes(k.device)
    in_share = int(l2 * LPT_L2_SHARE) // one_kv_head
    in_one_wave = min(l2 // one_kv_head, device_info(k.device)[2] // max(prob.group * n_m_blocks, 1))
    heads = max(1, in_share, in_one_wave)
    return (1 << (heads.bit_length() - 1)) * prob.group


def forward(
    q,
    k,
    v,
    out,
    lse,
    params: KernelParams,
    prob: KernelShapes,
    q_rows: int,
    kv_rows: int,
    bias: WsBias | None = None,
    kv_lens: torch.Tensor | None = None,
    n_new: int = 0,
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
):
    """The warp-specialised forward.  ``kv_lens`` (int32 (B,)): a KV-cache call, k and v the dense
    cache (prob.Sk its capacity), sequence b's keys the first kv_lens[b] + n_new, causal aligned
    bottom-right (common._cache_tiles: the keys past them in the last tile masked, the cache's
    rows there never used); a dense causal call with Sq < Sk passes lengths 0 and n_new = L
    (kernels/entry.GLUON_LENGTHS).  ``params.softcap``, ``sinks`` ((Hq,) contiguous) and
    ``alibi`` (fp32 (B, Hq)) as the tl forward's (none of them with kv_lens)."""
    mode = LENS_TENSOR if kv_lens is not None else 0
    cfg = C.ws_forward_config(
        prob.Dqk,
        forward_softcap(params.softcap, q.dtype) == SOFTCAP_BOUNDED,
        has_bias=bias is not None,
        has_alibi=alibi is not None,
        window_left=params.window_left,
        window_right=params.window_right,
        kv_lens_mode=mode,
    )
    rows = cfg.consumers * WG_ROWS
    n_m = cdiv(prob.Sq, rows)
    bias_desc, batch_rows, head_rows = bias_args(bias, rows, cfg.block_n, prob.Sk)
    run.launch_one(
        KERNELS["fwd_ws"],
        (n_m, prob.B * prob.Hq),
        (
            rows_descriptor(q, q_rows, WG_ROWS),
            rows_descriptor(k, kv_rows, cfg.block_n),
            rows_descriptor(v, kv_rows, cfg.block_n),
            rows_descriptor(out, 1, WG_ROWS),
            bias_desc,
            lse if lse is not None else out,
            params.scale * LOG2E,
            prob.Sq,
            prob.Sk,
            prob.Hq,
            prob.group,
            n_m,
            lpt_rows(params, prob, bias, k, n_m),
            batch_rows,
            head_rows,
            kv_lens if kv_lens is not None else out,
            n_new,
            sinks if sinks is not None else out,
            *score_args(params, prob, alibi, out),
        ),
        ws_constexprs(
            params,
            bias,
            Q_ROWS=q_rows,
            KV_ROWS=kv_rows,
            STORE_LSE=lse is not None,
            KV_LENS=mode,
            SOFTCAP=forward_softcap(params.softcap, q.dtype),
            HAS_SINKS=sinks is not None,
            HAS_ALIBI=alibi is not None,
            BLOCK_N=cfg.block_n,
            STAGES=cfg.stages,
            BIAS_STAGES=cfg.bias_stages,
            CONSUMER_REGS=cfg.consumer_regs,
            NUM_WG=cfg.consumers,
            OWN_TILES=cfg.forward_own_tiles(params.window_left, params.window_right, bias is not None),
            WARP_RELEASE=cfg.warp_release,
        ),
        WS_WARPS,
        WS_STAGES,
        maxnreg=cfg.max_regs,
    )


# Swizzle (bytes) of the fused dQ's fp32 partial tiles: 64 ran 1-4% faster than 128 (the default
# for fp32, one excess shared-memory wavefront per store) and 32 (none, but 8 TMA boxes per tile)
# (E54)
DQ_ACC_SWIZZLE = 64


def dq_head_rows(dq_acc: torch.Tensor) -> int | None:
    """The rows between two heads' first rows in the fused dQ's fp32 (B, Hq, Sq, D) buffer: Sq
    where it is contiguous, more for a slice of a larger buffer's rows (S); None where its
    memory is not such rows."""
    return seq_rows(dq_acc, 1) if dq_acc.dtype == torch.float32 else None


def dq_acc_descriptor(dq_acc: torch.Tensor, cols: int):
    """Gluon descriptor over the fused dQ's fp32 rows (head h of batch b at row (b * Hq + h) *
    dq_head_rows), tiles of (64, ``cols``): each consumer warpgroup's partial (gluon/dkdv.py,
    FUSE_DQ: D / 2 with 64-row query tiles, D with 128)."""
    B, H, S, D = dq_acc.shape
    rows = (B * H - 1) * dq_head_rows(dq_acc) + S
    layout = _gl.NVMMASharedLayout(DQ_ACC_SWIZZLE, 32, 2)
    return _GluonDescriptor(dq_acc, [rows, D], [D, 1], [WG_ROWS, cols], layout)


def dkdv(
    q,
    k,
    v,
    do,
    lse,
    delta,
    params: KernelParams,
    prob: KernelShapes,
    q_rows: int,
    kv_rows: int,
    do_rows: int,
    bias: WsBias | None = None,
    fuse_dq: bool = False,
    alibi: torch.Tensor | None = None,
    dq_acc: torch.Tensor | None = None,
    dk_out: torch.Tensor | None = None,
    dv_out: torch.Tensor | None = None,
):
    """(dK, dV, dQ or None) of a call the warp-specialised forward serves (same scope, dO in a
    row layout); ``fuse_dq``: dQ too, added by TMA reduce-add into a zeroed fp32 buffer, or into
    ``dq_acc`` (float32, q's shape; then dQ None); ``params.softcap`` and ``alibi`` as the forward's.
    ``dk_out``/``dv_out``: written there where contiguous (k/v themselves included: a program
    stores its dK/dV tile after its only read of that K/V tile), else new."""
    cfg = C.WS_BWD_CONFIGS[prob.Dqk]
    dk, dv = (
        out if out is not None and out.is_contiguous() else torch.empty(t.shape, device=t.device, dtype=t.dtype)
        for out, t in ((dk_out, k), (dv_out, v))
    )
    given = dq_acc
    if fuse_dq and (given is None or dq_head_rows(given) is None):
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    # keys per consumer warpgroup, query rows per tile (a bias tile of 128 rows spills at d64)
    w, m = WG_ROWS, (cfg.bwd_block_m if bias is None else WG_ROWS)
    bias_desc, batch_rows, head_rows = bias_args(bias, m, 2 * w, prob.Sk)
    # a warpgroup's dQ partial: half the columns of a 64-row tile, or every column of its half of 128
    dq_desc = dq_acc_descriptor(dq_acc, prob.Dqk if m == 2 * w else prob.Dqk // 2) if fuse_dq else None
    run.launch_one(
        KERNELS["bwd_dkdv_ws"],
        (prob.Sk // (2 * w), prob.B * prob.Hkv),
        (
            rows_descriptor(q, q_rows, m),
            rows_descriptor(k, kv_rows, w),
            rows_descriptor(v, kv_rows, w),
            rows_descriptor(do, do_rows, m),
            rows_descriptor(dk, 1, w),
            rows_descriptor(dv, 1, w),
            bias_desc,
            lse,
            delta,
            dq_desc,
            dq_head_rows(dq_acc) if fuse_dq else 0,
            seq_rows(q, q_rows),
            seq_rows(do, do_rows),
            params.scale * LOG2E,
            params.scale,
            prob.Sq,
            prob.Sk,
            prob.Hq,
            prob.group,
            batch_rows,
            head_rows,
            *score_args(params, prob, alibi, lse),
        ),
        ws_constexprs(
            params,
            bias,
            Q_ROWS=q_rows,
            KV_ROWS=kv_rows,
            DO_ROWS=do_rows,
            FUSE_DQ=fuse_dq,
            SOFTCAP=params.softcap > 0,
            HAS_ALIBI=alibi is not None,
            STAGES=cfg.stages,
            CONSUMER_REGS=cfg.consumer_regs,
        ),
        WS_WARPS,
        WS_STAGES,
        maxnreg=cfg.max_regs,
    )
    if not fuse_dq or given is dq_acc:
        return dk, dv, None
    if given is not None:  # a layout the descriptor cannot address: added unrounded
        given.add_(dq_acc)
        return dk, dv, None
    return dk, dv, dq_acc.to(q.dtype)


def dq(
    q,
    k,
    v,
    do,
    lse,
    delta,
    params: KernelParams,
    prob: KernelShapes,
    q_rows: int,
    kv_rows: int,
    do_rows: int,
    bias: WsBias | None = None,
    alibi: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dQ of a call the warp-specialised forward serves, over the forward's K/V ring
    (``params.softcap`` and ``alibi`` as the forward's); written into ``out`` where given
    (contiguous, q's shape and dtype)."""
    cfg = C.WS_DQ_CONFIGS[prob.Dqk]
    dq = out if out is not None else torch.empty(q.shape, device=q.device, dtype=q.dtype)
    n_m = prob.Sq // (2 * WG_ROWS)
    bias_desc, batch_rows, head_rows = bias_args(bias, 2 * WG_ROWS, cfg.block_n, prob.Sk)
    run.launch_one(
        KERNELS["bwd_dq_ws"],
        (n_m, prob.B * prob.Hq),
        (
            rows_descriptor(q, q_rows, WG_ROWS),
            rows_descriptor(k, kv_rows, cfg.block_n),
            rows_descriptor(v, kv_rows, cfg.block_n),
            rows_descriptor(do, do_rows, WG_ROWS),
            rows_descriptor(dq, 1, WG_ROWS),
            bias_desc,
            lse,
            delta,
            seq_rows(q, q_rows),
            seq_rows(do, do_rows),
            params.scale * LOG2E,
            params.scale,
            prob.Sq,
            prob.Sk,
            prob.Hq,
            prob.group,
            n_m,
            batch_rows,
            head_rows,
            *score_args(params, prob, alibi, lse),
        ),
        ws_constexprs(
            params,
            bias,
            Q_ROWS=q_rows,
            KV_ROWS=kv_rows,
            DO_ROWS=do_rows,
            SOFTCAP=params.softcap > 0,
            HAS_ALIBI=alibi is not None,
            BLOCK_N=cfg.block_n,
            STAGES=cfg.stages,
            BIAS_STAGES=cfg.bias_stages,
            CONSUMER_REGS=cfg.consumer_regs,
        ),
        WS_WARPS,
        WS_STAGES,
        maxnreg=cfg.max_regs,
    )
    return dq
