"""The kernels' entry points: choose the route of a call (the Gluon kernels or the tl kernels,
dQ fused into the dK/dV pass or not), then launch it.

The route functions return their reasons, so the same answer that picks the kernels at run
time is what the triton backend reports in ``explain()`` (:func:`describe_route`).
Everything here reads shapes, strides and python ints: no host synchronisation and no
allocation whose size depends on tensor data, so it is CUDA-graph capturable.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import configs as C
from .bias import bias_layout, ws_bias_reason
from .device import use_descriptors
from .dropout import draw_seed
from .gluon import launch as gluon_launch
from .gluon.route import forward_scope_reason, fuse_dq_reason, ws_backward_reason, ws_reason
from .params import KernelParams
from .shapes import KernelShapes, as_dtype, check_inputs, last_dim_contiguous, store_dtype
from .tl import launch as tl_launch

GLUON, TL, FUSED = "gluon", "tl", "fused"  # FUSED: dQ computed inside the Gluon dK/dV pass


class ForwardRoute(NamedTuple):
    """The forward's kernel (GLUON or TL), why not the Gluon one (None when it runs) and the
    Gluon kernel's (q rows layout, k/v rows layout)."""

    kernel: str
    why_not_gluon: str | None
    rows: tuple[int, int] | None


class BackwardRoute(NamedTuple):
    """The dK/dV pass's kernel (GLUON or TL), the dQ pass's (FUSED, GLUON or TL), why not the
    Gluon dK/dV pass, why dQ is not fused, and the Gluon passes' (q, k/v, dO) rows layouts."""

    dkdv: str
    dq: str
    why_not_gluon: str | None
    why_not_fused: str | None
    rows: tuple[int, int, int] | None


def _empty(prob: KernelShapes, k) -> bool:
    return prob.empty() or prob.Sk == 0 or prob.Hkv == 0 or (prob.varlen and k.shape[0] == 0)


def forward_route(q, k, v, bias_kind: int, bias_t, bias_strides, params: KernelParams, prob: KernelShapes, desc: bool):
    """The :class:`ForwardRoute` of a call (``bias_*``: :func:`bias.bias_layout`; ``desc``:
    :func:`use_descriptors` of q, k, v)."""
    if store_dtype(q.dtype) != q.dtype:  # the interpreter writes bf16 as fp32 (no Gluon there)
        return ForwardRoute(TL, "the CPU interpreter writes bfloat16 results as float32", None)
    bias_reason = ws_bias_reason(bias_kind, bias_t, bias_strides, q.dtype, desc)
    reason, rows = ws_reason(q, k, v, bias_reason, params, prob, desc)
    if reason is None:
        reason = forward_scope_reason(C.WS_FWD_CONFIGS[prob.Dqk], bias_kind != 0, params)
    return ForwardRoute(TL, reason, None) if reason else ForwardRoute(GLUON, None, rows)


def backward_route(
    do, q, k, v, bias_kind: int, bias_t, bias_strides, bias_grad: bool, params: KernelParams, prob: KernelShapes, desc
):
    """The :class:`BackwardRoute` of a call (``desc``: :func:`use_descriptors` of q, k, v, dO)."""
    bias_reason = ws_bias_reason(bias_kind, bias_t, bias_strides, q.dtype, desc, grad=bias_grad)
    reason, rows = ws_backward_reason(do, q, k, v, bias_reason, params, prob, desc)
    if reason is not None:
        return BackwardRoute(TL, TL, reason, None, None)
    not_fused = fuse_dq_reason(params, prob, bias_kind != 0)
    dq = FUSED if not_fused is None else (GLUON if prob.Dqk in C.WS_DQ_CONFIGS else TL)
    return BackwardRoute(GLUON, dq, None, not_fused, rows)


def attention_forward(
    q, k, v, bias, params: KernelParams, cu_q=None, cu_k=None, max_sq=None, max_sk=None, need_lse: bool = True
):
    """Returns (out, lse (fp32, natural log; None unless need_lse), seed (int64 (1,) or empty)).
    Inference calls pass need_lse=False: the kernel then writes no logsumexp."""
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    check_inputs(q, k, v)
    prob = KernelShapes(q, k, v, cu_q, cu_k, max_sq, max_sk)
    dev = q.device
    seed = draw_seed(dev) if params.dropout_p > 0 else torch.empty(0, device=dev, dtype=torch.int64)
    out = torch.empty(prob.out_shape, device=dev, dtype=store_dtype(q.dtype))
    lse = torch.empty(prob.lse_shape, device=dev, dtype=torch.float32) if need_lse else None
    if _empty(prob, k):
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        return as_dtype(out, q.dtype), lse, seed
    kind, bt, bstr, _ = bias_layout(bias, (prob.B, prob.Hq, prob.Sq, prob.Sk))
    # Q is checked too: it goes through a descriptor beside a bias descriptor (tl/forward.py)
    desc = use_descriptors(params, (q, k, v), dev, loop_len=prob.Sk)
    route = forward_route(q, k, v, kind, bt, bstr, params, prob, desc)
    if route.kernel == GLUON:
        ws_bias = gluon_launch.WsBias.of(bt, bstr, prob) if kind else None
        gluon_launch.forward(q, k, v, out, lse, params, prob, *route.rows, bias=ws_bias)
        return out, lse, seed
    out = tl_launch.forward(q, k, v, out, lse, seed, kind, bt, bstr, params, prob, desc, cu_q, cu_k)
    return out, lse, seed


def attention_backward(
    do,
    q,
    k,
    v,
    bias,
    out,
    lse,
    seed,
    params: KernelParams,
    cu_q=None,
    cu_k=None,
    max_sq=None,
    max_sk=None,
    bias_grad: bool = False,
    delta: torch.Tensor | None = None,
):
    """Returns (dq, dk, dv, dbias or None).  dbias has bias's shape: summed over its size-1
    (broadcast) dims; full-size dims (even with stride 0) get the per-element gradient.
    ``delta``: an fp32 buffer of lse's shape for rowsum(dO * O) (allocated here when None)."""
    q, k, v, do = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v), last_dim_contiguous(do)
    prob = KernelShapes(q, k, v, cu_q, cu_k, max_sq, max_sk)
    dev = q.device
    bias_grad = bool(bias_grad) and bias is not None and bias.dtype.is_floating_point
    kind, bt, bstr, bcast = bias_layout(bias, (prob.B, prob.Hq, prob.Sq, prob.Sk))
    if _empty(prob, k):
        dq = torch.zeros(q.shape, device=dev, dtype=q.dtype)
        dk = torch.zeros(k.shape, device=dev, dtype=k.dtype)
        dv = torch.zeros(v.shape, device=dev, dtype=v.dtype)
        dbias = torch.zeros(bias.shape, device=dev, dtype=bias.dtype) if bias_grad else None
        return dq, dk, dv, dbias

    desc = use_descriptors(params, (q, k, v, do), dev)
    args = tl_launch.backward_args(do, q, kind, bt, bstr, seed, params, prob, desc, cu_q, cu_k)
    if delta is None:
        delta = torch.empty(prob.lse_shape, device=dev, dtype=torch.float32)
    tl_launch.delta_pass(do, out, delta, prob, args)
    route = backward_route(do, q, k, v, kind, bt, bstr, bias_grad, params, prob, desc)
    if route.dkdv == GLUON:
        ws_bias = gluon_launch.WsBias.of(bt, bstr, prob) if kind else None
        dk, dv, dq = gluon_launch.dkdv(
            q, k, v, do, lse, delta, params, prob, *route.rows, bias=ws_bias, fuse_dq=route.dq == FUSED
        )
        if route.dq == GLUON:
            dq = gluon_launch.dq(q, k, v, do, lse, delta, params, prob, *route.rows, bias=ws_bias)
        elif route.dq == TL:
            dq = tl_launch.dq_pass(do, q, k, v, lse, delta, params, prob, args)
        return dq, dk, dv, None
    dk, dv, dbias = tl_launch.dkdv_pass(do, q, k, v, lse, delta, bias, bias_grad, bcast, params, prob, args)
    dq = tl_launch.dq_pass(do, q, k, v, lse, delta, params, prob, args)
    return dq, dk, dv, dbias


def describe_route(
    q, k, v, bias, params: KernelParams, cu_q=None, cu_k=None, max_sq=None, max_sk=None, backward: bool = False
) -> list[tuple[str, str, tuple[tuple[str, str], ...]]]:
    """The route :func:`attention_forward` (and, with ``backward``, :func:`attention_backward`
    for a contiguous dO, the gradient's usual layout) takes for this call, launching nothing:
    (part, kernel, ((faster route not taken, why), ...)) per pass."""
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    check_inputs(q, k, v)
    prob = KernelShapes(q, k, v, cu_q, cu_k, max_sq, max_sk)
    if _empty(prob, k):
        return [("forward", "none (nothing to compute: zeros)", ())]
    kind, bt, bstr, _ = bias_layout(bias, (prob.B, prob.Hq, prob.Sq, prob.Sk))
    fwd = forward_route(q, k, v, kind, bt, bstr, params, prob, use_descriptors(params, (q, k, v), q.device, prob.Sk))
    steps = [("forward", fwd.kernel, ((GLUON, fwd.why_not_gluon),) if fwd.why_not_gluon else ())]
    if not backward:
        return steps
    do = torch.empty(prob.out_shape, device=q.device, dtype=q.dtype)
    bias_grad = bias is not None and bias.requires_grad and bias.dtype.is_floating_point
    desc = use_descriptors(params, (q, k, v, do), q.device)
    bwd = backward_route(do, q, k, v, kind, bt, bstr, bias_grad, params, prob, desc)
    if bwd.dkdv == TL:
        steps.append(("dK/dV", TL, ((GLUON, bwd.why_not_gluon),)))
        steps.append(("dQ", TL, ((GLUON, bwd.why_not_gluon),)))
        return steps
    steps.append(("dK/dV", GLUON, ()))
    passed = () if bwd.dq == FUSED else ((FUSED, bwd.why_not_fused),)
    if bwd.dq == TL:
        passed += ((GLUON, f"head dim {prob.Dqk}: the Gluon dQ pass has configs for {sorted(C.WS_DQ_CONFIGS)}"),)
    steps.append(("dQ", bwd.dq, passed))
    return steps
