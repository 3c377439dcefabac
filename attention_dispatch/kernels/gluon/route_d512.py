"""Which calls the Gluon d512 forward (gluon/forward_d512.py) serves, the answer a reason:
Dqk = Dv = 512 in fp16/bf16 on sm90, dense or causal (either alignment), GQA; everything else
keeps the tl d512 forward, which computes every feature.  The backward of every d512 call is
the tl one, reading the logsumexp either forward writes.  Importable without Gluon;
kernels/entry.py acts on the answer and the triton backend's route() reports it."""

from __future__ import annotations

import torch

from . import route as ws_route
from ..device import device_info
from ..params import KernelParams
from ..shapes import KernelShapes, grid_limit, rows_layout

HEAD_DIM = 512
# On since its GPU tests passed on an H100 (tests/test_gluon_d512.py, gpu_session.sh d512fwd, 2026-11-27);
# a kernel change turns it off here until they pass again
GPU_VERIFIED = True
# query rows per program (the S warpgroup's) and keys per K/V tile: the lengths must be whole
# multiples, the kernel masks no tail
ROWS, KEYS = 64, 32


def serves_head_dims(prob: KernelShapes) -> bool:
    """The call's head dims are the d512 forward's (otherwise the d<=256 Gluon routes decide)."""
    return prob.Dqk == HEAD_DIM and prob.Dv == HEAD_DIM


def keys_read(params: KernelParams, prob: KernelShapes) -> int:
    """The most keys a row reads: Sq for causal top-left with Sq < Sk, else Sk."""
    causal = params.window_left < 0 and params.window_right == 0
    return prob.Sq if causal and not params.align_bottom_right and prob.Sq < prob.Sk else prob.Sk


def d512_forward_reason(
    q,
    k,
    v,
    bias_kind: int,
    params: KernelParams,
    prob: KernelShapes,
    uses_descriptors: bool,
    has_alibi: bool = False,
    has_sinks: bool = False,
) -> tuple[str | None, tuple[int, int] | None]:
    """(None, (q rows layout, k/v rows layout)) when the Gluon d512 forward computes this call,
    else (why not, one line; None).  ``bias_kind``: bias.bias_layout's (0: no mask);
    ``uses_descriptors``: device.use_descriptors of q, k, v."""
    gluon = ws_route.gluon_reason()
    if gluon is not None:
        return gluon, None
    cc = device_info(q.device)[0]
    if cc != (9, 0):
        return f"compute capability {cc[0]}.{cc[1]}: the Gluon d512 forward is sm90 only", None
    if not uses_descriptors:
        return "no TMA descriptors for this call (dtype, 16-byte alignment, interpreter or descriptors=0)", None
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}: float16 or bfloat16 only", None
    if not serves_head_dims(prob):
        return f"head dims {prob.Dqk}/{prob.Dv}: 512/512 only", None
    if not GPU_VERIFIED:
        return "not yet verified on a GPU (route_d512.GPU_VERIFIED): the tl forward serves d512", None
    for present, what in (
        (prob.varlen, "varlen"),
        (bias_kind != 0, "attn_mask"),
        (params.dropout_p > 0, "dropout"),
        (params.softcap > 0, "softcap"),
        (has_alibi, "alibi_slopes"),
        (has_sinks, "sinks"),
    ):
        if present:
            return f"{what}: not in the Gluon d512 forward (dense or causal calls only)", None
    causal = params.window_left < 0 and params.window_right == 0
    if (params.window_left >= 0 or params.window_right >= 0) and not causal:
        return f"window ({params.window_left}, {params.window_right}): not in the Gluon d512 forward", None
    if causal and params.align_bottom_right and prob.Sq > prob.Sk:
        # the kernel's rows all see key 0: its running max is finite from the first tile
        return "causal bottom-right with Sq > Sk: rows without keys, not in the Gluon d512 forward", None
    if params.scale <= 0:
        return f"scale {params.scale}: positive only (the running max is taken before scaling)", None
    if params.block_m or params.block_n:
        return "tiles forced by the call's parameters", None
    if prob.Sq % ROWS or prob.Sk % KEYS:
        return f"Sq={prob.Sq}, Sk={prob.Sk}: multiples of {ROWS} and {KEYS} only (no partial tiles)", None
    rows = (rows_layout(q), rows_layout(k, v))
    if 0 in rows:
        return "memory layout: query and key/value each (B, H, S, D) or (B, S, H, D) contiguous", None
    if prob.B * prob.Hq > grid_limit(params) or max(prob.B * prob.Hq * prob.Sq, prob.B * prob.Hkv * prob.Sk) >= 2**31:
        return "grid or row count past the kernel's 32-bit limits", None
    if prob.B * prob.Hq * prob.Sq * keys_read(params, prob) * HEAD_DIM < ws_route.WS_MIN_WORK:
        return (
            f"below WS_MIN_WORK ({ws_route.WS_MIN_WORK} query-key-dim products): the host descriptors cost more",
            None,
        )
    return None, rows
