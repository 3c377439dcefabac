"""Launching the Gluon d512 forward (gluon/forward_d512.py): TMA descriptors over the rows of q,
k, v (common.py's row layouts) and of O, one launch through run.launch_one."""

from __future__ import annotations

import torch

from .. import run
from ..params import KernelParams
from ..shapes import KernelShapes, row_matrix
from ..tl.common import LOG2E
from .launch import WS_STAGES, smem_layout
from .route_d512 import HEAD_DIM, KEYS, ROWS

try:  # Gluon (Triton >= 3.5); without it route_d512 never picks this launch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor

    from .forward_d512 import _attn_fwd_d512
except ImportError:  # pragma: no cover - a Triton without Gluon
    _attn_fwd_d512 = None

# The jit kernel (None without Gluon): tools compile it (benchmarks/compile_sm90.py)
KERNELS = {"fwd_d512": _attn_fwd_d512}

# The probe's measured layout (docs/experiments/head-dim-512.md, "Probe"): 3 K and 3 V slots of
# 32 keys (205,584 B of shared memory; a fourth of either does not fit), 160 registers a P V
# warpgroup, which leaves the S warpgroup 504 - 2 x 160 = 184 (no spill; 168 spilled a Q fragment
# and cost 41% of its rate); the default partition is the S warpgroup's 4 warps
K_STAGES, V_STAGES, PV_REGS = 3, 3, 160
WARPS = 4
HALF = HEAD_DIM // 2  # Dv columns per P V warpgroup: O's tile is 64 x 256
CHUNK = 64  # Q's columns per TMA chunk


def descriptor(t: torch.Tensor, layout: int, block_rows: int, block_cols: int):
    """Gluon descriptor over ``t`` (B, H, S, D) as the matrix of its rows layout, tiles of
    (block_rows, block_cols)."""
    rows, width = row_matrix(t, layout)
    return _GluonDescriptor(
        t, [rows, width], [width, 1], [block_rows, block_cols], smem_layout(block_rows, block_cols, t.dtype)
    )


def tiles() -> dict:
    """(rows, columns) of each descriptor's tile: Q in 64 x 64 chunks (the S chain's A operands),
    K as whole 32-key tiles (one copy a tile), V in 32 x 256 halves (one per P V warpgroup),
    O as one P V warpgroup's 64 x 256."""
    return {"q": (ROWS, CHUNK), "k": (KEYS, HEAD_DIM), "v": (KEYS, HALF), "o": (ROWS, HALF)}


def constexprs(q_rows: int, kv_rows: int, causal: bool, store_lse: bool) -> dict:
    return dict(
        Q_ROWS=q_rows,
        KV_ROWS=kv_rows,
        CAUSAL=causal,
        STORE_LSE=store_lse,
        K_STAGES=K_STAGES,
        V_STAGES=V_STAGES,
        PV_REGS=PV_REGS,
    )


def forward(q, k, v, out, lse, params: KernelParams, prob: KernelShapes, q_rows: int, kv_rows: int) -> None:
    """O into ``out`` ((B, Hq, Sq, 512) contiguous) and, where ``lse`` is given ((B, Hq, Sq) fp32),
    the logsumexp as the tl forward writes it, for a call route_d512 serves."""
    causal = params.window_left < 0 and params.window_right == 0
    diag = prob.Sk - prob.Sq if causal and params.align_bottom_right else 0
    t = tiles()
    run.launch_one(
        KERNELS["fwd_d512"],
        (prob.Sq // ROWS, prob.B * prob.Hq),
        (
            descriptor(q, q_rows, *t["q"]),
            descriptor(k, kv_rows, *t["k"]),
            descriptor(v, kv_rows, *t["v"]),
            descriptor(out, 1, *t["o"]),
            lse if lse is not None else out,
            params.scale * LOG2E,
            prob.Sq,
            prob.Sk,
            prob.Hq,
            prob.group,
            diag,
        ),
        constexprs(q_rows, kv_rows, causal, lse is not None),
        WARPS,
        WS_STAGES,
    )
