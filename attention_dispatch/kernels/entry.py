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
from .decode import decode_forward
from .decode_plan import DecodePlan, plan_for
from .device import use_descriptors
from .dropout import STREAM_LEN, draw_stream
from .gluon import launch as gluon_launch
from .gluon import launch_d512 as gluon_d512
from .gluon.route import (
    forward_scope_reason,
    fuse_dq_reason,
    one_length,
    score_features_reason,
    ws_backward_reason,
    ws_reason,
)
from .gluon.route_d512 import d512_forward_reason, serves_head_dims
from .params import KernelParams
from .shapes import KernelShapes, check_inputs, last_dim_contiguous, store_dtype
from .static_buffers import int32_zeros
from .tl import launch as tl_launch
from .tl import launch_backward as tl_backward

GLUON, TL, FUSED = "gluon", "tl", "fused"  # FUSED: dQ computed inside the Gluon dK/dV pass
# The Gluon forward as a KV-cache call (lengths 0 in a constant buffer, L new keys): a causal
# call with Sq < Sk, each sequence's keys read up to gluon.route.one_length (0.415 ms against the
# tl forward's 0.513 on the H100: q (4, 32, 512, 128) bf16 over 8704 keys, GQA 32/8,
# bottom-right; issues 34/35).  Its build with the length a scalar, no tensor, ran 1.7-4.9%
# slower with the same loop code (E144)
GLUON_LENGTHS = "gluon one-length"
# The Gluon d512 forward (gluon/forward_d512.py; Dqk = Dv = 512, dense or causal): 452-458 TFLOP/s
# dense at B=2 H=16 S=4096 in its probe on the H100, the tl forward 233 (issue 36)
GLUON_D512 = "gluon d512"
DECODE = "decode"  # the KV-cache decode kernel (tl/decode.py) over the whole key range

# Inference calls with at most this many query rows per kv head (GQA group x Sq: one row tile of
# the decode kernel) over at least DECODE_MIN_KEYS keys run the decode kernel: its key splits keep
# the GPU busy where the forward's query tiles are too few (decode: 2.8-3.1 TB/s on the H100).
DECODE_MAX_ROWS = 64
DECODE_MIN_KEYS = 512


class ForwardRoute(NamedTuple):
    """The forward's kernel (DECODE, GLUON, GLUON_LENGTHS, GLUON_D512 or TL), why not the Gluon one
    (None when it runs), the Gluon kernel's (q rows layout, k/v rows layout), why not the decode
    kernel for a call shaped like decode (few query rows per kv head) that does not take it, and
    which Gluon forward ``why_not_gluon`` speaks of (GLUON_D512 for Dqk = Dv = 512)."""

    kernel: str
    why_not_gluon: str | None
    rows: tuple[int, int] | None
    why_not_decode: str | None = None
    gluon: str = GLUON


def decode_reason(
    q, bias_kind: int, params: KernelParams, prob: KernelShapes, need_lse: bool, has_alibi: bool = False
) -> str | None:
    """None when the decode kernel computes this forward, else why not (one line)."""
    if prob.group * prob.Sq > DECODE_MAX_ROWS:
        return f"{prob.group * prob.Sq} query rows per kv head (GQA group x Sq): more than {DECODE_MAX_ROWS}"
    if prob.Sk < DECODE_MIN_KEYS:
        return f"Sk={prob.Sk} < {DECODE_MIN_KEYS}: the forward's tiles cover it"
    if need_lse:
        return "the call needs its logsumexp (gradients or return_lse): the decode route serves inference"
    if prob.varlen:
        return "varlen: dense calls only (sdpa_with_kvcache takes per-sequence lengths)"
    if bias_kind:
        return "attn_mask: not in the decode kernel"
    if params.dropout_p > 0:
        return "dropout: not in the decode kernel"
    banded = params.window_left >= 0 or params.window_right >= 0
    if banded and not params.align_bottom_right and prob.Sq != prob.Sk:
        return "causal or window aligned top-left with Sq != Sk: the decode kernel aligns bottom-right"
    if has_alibi and not params.align_bottom_right and prob.Sq != prob.Sk:
        return "alibi_slopes aligned top-left with Sq != Sk: the decode kernel aligns bottom-right"
    if prob.Dqk != prob.Dv:
        return f"head dims {prob.Dqk}/{prob.Dv}: equal only"
    if params.block_m or params.block_n:
        return "tiles forced by the call's parameters"
    if store_dtype(q.dtype) != q.dtype:
        return "the CPU interpreter writes bfloat16 results as float32"
    return None


def decode_plan_of(q, k, v, params: KernelParams) -> DecodePlan | None:
    """The plan :func:`attention_forward` runs for this dense inference call without a mask,
    ALiBi or sinks when it takes the decode route (its key length free: the plan's geometry),
    else None; q, k, v with a contiguous last dim."""
    if any(t.dim() != 4 or t.stride(-1) != 1 for t in (q, k, v)):
        return None
    check_inputs(q, k, v)
    prob = KernelShapes(q, k, v, None, None, None, None)
    if _empty(prob, k) or decode_reason(q, 0, params, prob, False) is not None:
        return None
    return plan_for(q, k, v, None, params, None, None, None, None, None, False, 0, 0)


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


def forward_route(
    q,
    k,
    v,
    bias_kind: int,
    bias_t,
    bias_strides,
    params: KernelParams,
    prob: KernelShapes,
    desc: bool,
    need_lse: bool = True,
    alibi=None,
    sinks=None,
):
    """The :class:`ForwardRoute` of a call (``bias_*``: :func:`bias.bias_layout`; ``desc``:
    :func:`use_descriptors` of q, k, v; ``need_lse``: the call writes its logsumexp;
    ``alibi``/``sinks``: the call's slopes and sinks, or None)."""
    not_decode = decode_reason(q, bias_kind, params, prob, need_lse, alibi is not None)
    if not_decode is None:
        return ForwardRoute(DECODE, None, None)
    if prob.group * prob.Sq > DECODE_MAX_ROWS or prob.Sk < DECODE_MIN_KEYS:
        not_decode = None  # not shaped like decode: nothing to report
    if store_dtype(q.dtype) != q.dtype:  # the interpreter writes bf16 as fp32 (no Gluon there)
        return ForwardRoute(TL, "the CPU interpreter writes bfloat16 results as float32", None, not_decode)
    if serves_head_dims(prob):  # d512: its own Gluon forward, or the tl one with the reason
        has_scores = (alibi is not None, sinks is not None)
        reason, rows = d512_forward_reason(q, k, v, bias_kind, params, prob, desc, *has_scores)
        return ForwardRoute(TL if reason else GLUON_D512, reason, rows, not_decode, GLUON_D512)
    lengths = one_length(params, prob) is not None
    part = "one-length forward" if lengths else "forward"
    score_reason = score_features_reason(params, alibi is not None, sinks is not None, part, max(prob.Sq, prob.Sk))
    if score_reason is None and lengths and bias_kind:
        score_reason = f"attn_mask: not in the Gluon {part}"
    if score_reason is not None:
        return ForwardRoute(TL, score_reason, None, not_decode)
    bias_reason = ws_bias_reason(bias_kind, bias_t, bias_strides, q.dtype, desc)
    reason, rows = ws_reason(q, k, v, bias_reason, params, prob, desc, lengths=True)
    if reason is None:
        reason = forward_scope_reason(C.WS_FWD_CONFIGS[prob.Dqk], bias_kind != 0, params)
    if reason:
        return ForwardRoute(TL, reason, None, not_decode)
    return ForwardRoute(GLUON_LENGTHS if lengths else GLUON, None, rows, not_decode)


def backward_route(
    do,
    q,
    k,
    v,
    bias_kind: int,
    bias_t,
    bias_strides,
    bias_grad: bool,
    params: KernelParams,
    prob: KernelShapes,
    desc,
    has_alibi: bool = False,
):
    """The :class:`BackwardRoute` of a call (``desc``: :func:`use_descriptors` of q, k, v, dO)."""
    reason = score_features_reason(params, has_alibi, False, "backward", max(prob.Sq, prob.Sk))
    if reason is not None:
        return BackwardRoute(TL, TL, reason, None, None)
    bias_reason = ws_bias_reason(bias_kind, bias_t, bias_strides, q.dtype, desc, grad=bias_grad)
    reason, rows = ws_backward_reason(do, q, k, v, bias_reason, params, prob, desc)
    if reason is not None:
        return BackwardRoute(TL, TL, reason, None, None)
    not_fused = fuse_dq_reason(params, prob, bias_kind != 0, has_alibi)
    dq = FUSED if not_fused is None else (GLUON if prob.Dqk in C.WS_DQ_CONFIGS else TL)
    return BackwardRoute(GLUON, dq, None, not_fused, rows)


def check_score_inputs(prob: KernelShapes, alibi, sinks):
    """ALiBi slopes: float32 (B, Hq) (a stride-0 batch dim is fine); sinks: (Hq,) of a float dtype."""
    if alibi is not None and (alibi.dtype != torch.float32 or tuple(alibi.shape) != (prob.B, prob.Hq)):
        raise ValueError(
            f"alibi_slopes: float32 of shape ({prob.B}, {prob.Hq}) expected, got {alibi.dtype} {tuple(alibi.shape)}"
        )
    if sinks is not None and (not sinks.dtype.is_floating_point or tuple(sinks.shape) != (prob.Hq,)):
        raise ValueError(
            f"sinks: a float tensor of shape ({prob.Hq},) expected, got {sinks.dtype} {tuple(sinks.shape)}"
        )


def check_stream(stream, prob: KernelShapes, dev) -> None:
    """A given dropout stream: dropout.positioned_stream's, on the call's device, for a dense call."""
    if not isinstance(stream, torch.Tensor) or stream.dtype != torch.int64 or stream.shape != (STREAM_LEN,):
        got = f"{stream.dtype} {tuple(stream.shape)}" if isinstance(stream, torch.Tensor) else type(stream).__name__
        raise ValueError(
            f"dropout stream: an int64 ({STREAM_LEN},) tensor (dropout.positioned_stream) expected, got {got}"
        )
    if stream.device != dev:
        raise ValueError(f"dropout stream on {stream.device}, the call's tensors on {dev}")
    if prob.varlen:
        raise ValueError(
            "a positioned dropout stream with varlen: the stream is keyed by (sequence, position in it), "
            "so a varlen call cannot be a block of a larger one"
        )


def attention_forward(
    q,
    k,
    v,
    bias,
    params: KernelParams,
    cu_q=None,
    cu_k=None,
    max_sq=None,
    max_sk=None,
    need_lse: bool = True,
    alibi=None,
    sinks=None,
    stream=None,
    lse_pair=None,
):
    """Returns (out, lse (fp32, natural log, without the sink; None unless need_lse), the
    dropout stream (int64 (5,), dropout.py; empty without dropout)).  Inference calls pass
    need_lse=False: the kernel then writes no logsumexp.  ``alibi``: fp32 (B, Hq) slopes;
    ``sinks``: (Hq,) logits; either None.  ``stream``: dropout.positioned_stream's (a block of
    a larger call), else a new seed is drawn (dropout.draw_stream).  ``lse_pair``:
    :func:`lse_pair_buffer`'s buffer or None, filled by a tl forward without sinks."""
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    check_inputs(q, k, v)
    prob = KernelShapes(q, k, v, cu_q, cu_k, max_sq, max_sk)
    check_score_inputs(prob, alibi, sinks)
    if sinks is not None and sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    dev = q.device
    if params.dropout_p <= 0:
        seed = torch.empty(0, device=dev, dtype=torch.int64)
    elif stream is None:
        seed = draw_stream(dev)
    else:
        check_stream(stream, prob, dev)
        seed = stream
    if _empty(prob, k):
        out = torch.zeros(prob.out_shape, device=dev, dtype=q.dtype)
        lse = torch.full(prob.lse_shape, -math.inf, device=dev, dtype=torch.float32) if need_lse else None
        return out, lse, seed
    kind, bt, bstr, _ = bias_layout(bias, (prob.B, prob.Hq, prob.Sq, prob.Sk))
    # Q is checked too: it goes through a descriptor beside a bias descriptor (tl/forward.py)
    desc = use_descriptors(params, (q, k, v), dev, loop_len=prob.Sk)
    route = forward_route(q, k, v, kind, bt, bstr, params, prob, desc, need_lse, alibi, sinks)
    if route.kernel == DECODE:  # every sequence as long as the keys: FULL_LENGTH, no lengths tensor
        return decode_forward(q, k, v, None, params, alibi=alibi, sinks=sinks), None, seed
    out = torch.empty(prob.out_shape, device=dev, dtype=store_dtype(q.dtype))
    lse = torch.empty(prob.lse_shape, device=dev, dtype=torch.float32) if need_lse else None
    if route.kernel == GLUON_D512:  # no bias, dropout or score transforms (route_d512)
        gluon_d512.forward(q, k, v, out, lse, params, prob, *route.rows)
        return out, lse, seed
    if route.kernel == GLUON_LENGTHS:  # no bias, sinks or ALiBi (score_features_reason)
        # every cached length 0 and L new keys: a constant buffer, which a plan's replay keeps
        zeros = int32_zeros(dev, prob.B)
        gluon_launch.forward(
            q, k, v, out, lse, params, prob, *route.rows, kv_lens=zeros, n_new=one_length(params, prob)
        )
        return out, lse, seed
    if route.kernel == GLUON:
        ws_bias = gluon_launch.WsBias.of(bt, bstr, prob) if kind else None
        gluon_launch.forward(q, k, v, out, lse, params, prob, *route.rows, bias=ws_bias, sinks=sinks, alibi=alibi)
        return out, lse, seed
    pair = lse_pair if need_lse and sinks is None else None
    out = tl_launch.forward(q, k, v, out, lse, seed, kind, bt, bstr, params, prob, desc, cu_q, cu_k, alibi, sinks, pair)
    return out, lse, seed


def lse_pair_buffer(q, cu_q=None) -> torch.Tensor | None:
    """For float32 inputs a (*lse_shape, 2) float32 buffer where the tl forward keeps the log2
    logsumexp as an exact sum hi + lo for the backward: a single float32 lse carries ~|lse| * eps of
    rounding, which P = exp(s - lse) passes to dV at scores in the hundreds (issue 38).  Else None."""
    if q.dtype != torch.float32:
        return None
    rows = (q.shape[0], q.shape[1]) if cu_q is not None else (q.shape[0], q.shape[1], q.shape[2])
    return torch.empty((*rows, 2), device=q.device, dtype=torch.float32)


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
    alibi=None,
    sinks=None,
    sinks_grad: bool = False,
    grad_lse=None,
    lse_pair=None,
    dq_accumulator=None,
    dk_out=None,
    dv_out=None,
    only=None,
    dq_out=None,
):
    """Returns (dq, dk, dv, dbias or None, dsinks or None).  dbias has bias's shape: summed over
    its size-1 (broadcast) dims; full-size dims (even with stride 0) get the per-element
    gradient.  ``delta``: an fp32 buffer of lse's shape for rowsum(dO * O) (allocated here when
    None).  ``sinks``: the forward's (Hq,) sinks (their gradient, in sinks' dtype, with
    ``sinks_grad``); ``grad_lse``: the gradient flowing into lse (None: none, nothing extra).
    ``dq_accumulator``: a float32 tensor of q's shape (a view of a larger one is fine) that dQ is
    added into, unrounded, instead of being returned (dq None): context parallelism sums a rank's
    blocks' dQ in it (dense calls only).  ``dk_out``/``dv_out``: tensors dK/dV are written into and
    returned as, each k/v itself (the caller reads k/v no more: a ring's received keys) or memory
    shared with no input; cross-tile readers of K/V then run before the dK/dV pass, which writes
    each tile after reading it. ``only``: "dq" runs the dQ pass alone (dk, dv None), "dkv" the
    dK/dV pass alone (dq None; no bias gradient): a caller running them at different times (a
    separate dQ pass where the route fuses it costs that pass). ``dq_out``: a contiguous tensor of
    q's shape and dtype dQ is written into and returned as (no accumulator)."""
    check_only(only, dq_out, q, dq_accumulator)
    check_dq_accumulator(dq_accumulator, q, cu_q)
    check_dkv_out(dk_out, k, v, "dk_out")
    check_dkv_out(dv_out, v, k, "dv_out")
    if dk_out is not None and dv_out is not None and _overlap(dk_out, dv_out):
        raise ValueError("dv_out: overlaps dk_out's memory; give two separate tensors")
    q, k, v, do = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v), last_dim_contiguous(do)
    # written in place of the K/V the kernels read (last_dim_contiguous kept them): dQ reads them first
    overwrites = (dk_out is not None and _same_view(dk_out, k)) or (dv_out is not None and _same_view(dv_out, v))
    prob = KernelShapes(q, k, v, cu_q, cu_k, max_sq, max_sk)
    dev = q.device
    bias_grad = bool(bias_grad) and bias is not None and bias.dtype.is_floating_point
    sinks_grad = bool(sinks_grad) and sinks is not None
    kind, bt, bstr, bcast = bias_layout(bias, (prob.B, prob.Hq, prob.Sq, prob.Sk))
    if _empty(prob, k):
        dq = None if dq_accumulator is not None else _into(dq_out, torch.zeros(q.shape, device=dev, dtype=q.dtype))
        dk = torch.zeros(k.shape, device=dev, dtype=k.dtype)
        dv = torch.zeros(v.shape, device=dev, dtype=v.dtype)
        dbias = torch.zeros(bias.shape, device=dev, dtype=bias.dtype) if bias_grad else None
        dsinks = torch.zeros(sinks.shape, device=dev, dtype=sinks.dtype) if sinks_grad else None
        return dq, _into(dk_out, dk), _into(dv_out, dv), dbias, dsinks

    # sinks with an lse gradient: the passes read dO as the delta pass rescales it (rows the sink outweighs)
    do_scaled = (
        torch.empty(do.shape, device=dev, dtype=do.dtype) if sinks is not None and grad_lse is not None else None
    )
    do_in, do = do, do if do_scaled is None else do_scaled
    desc = use_descriptors(params, (q, k, v, do), dev)
    # the forward's (hi, lo) pairs (lse_pair_buffer): P's normaliser unless a sink joins it
    pair = lse_pair if sinks is None else None
    args = tl_backward.backward_args(
        do, q, kind, bt, bstr, seed, params, prob, desc, cu_q, cu_k, alibi, lse_pair=pair is not None
    )
    if delta is None:
        delta = torch.empty(prob.lse_shape, device=dev, dtype=torch.float32)
    lse_used = dsink_rows = None
    if sinks is not None:  # P's normaliser: the logsumexp with the sink (written by the delta pass)
        sinks = sinks if sinks.stride(0) == 1 else sinks.contiguous()
        lse_used = torch.empty(prob.lse_shape, device=dev, dtype=torch.float32)
        if sinks_grad:
            dsink_rows = torch.empty(prob.lse_shape, device=dev, dtype=torch.float32)
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    tl_backward.delta_pass(do_in, out, delta, prob, args, lse, sinks, grad_lse, lse_used, dsink_rows, do_scaled)
    if lse_used is not None:
        lse = lse_used
    # (B, Hq, Sq) or (total_q, Hq): summed over all but the head dim, in a fixed order
    dsinks = dsink_rows.sum(dim=(0, 2) if not prob.varlen else 0).to(sinks.dtype) if sinks_grad else None
    route = backward_route(do, q, k, v, kind, bt, bstr, bias_grad, params, prob, desc, alibi is not None)
    acc = dq_accumulator
    if route.dkdv == GLUON:
        ws_bias = gluon_launch.WsBias.of(bt, bstr, prob) if kind else None
        fused = route.dq == FUSED and only is None
        gluon_dq = route.dq == GLUON or (route.dq == FUSED and prob.Dqk in C.WS_DQ_CONFIGS)

        def separate_dq():
            """dq, or None once added into ``acc`` (the Gluon pass's bf16 dq is added here)."""
            if not gluon_dq:
                return tl_backward.dq_pass(do, q, k, v, lse, delta, params, prob, args, acc, out=dq_out)
            into = {} if dq_out is None else {"out": dq_out}
            dq = gluon_launch.dq(q, k, v, do, lse, delta, params, prob, *route.rows, bias=ws_bias, alibi=alibi, **into)
            if acc is not None:
                acc.add_(dq)
            return None if acc is not None else dq

        if only == "dq":
            return separate_dq(), None, None, None, dsinks
        # first where dK/dV overwrite the K/V it reads, or where an accumulator takes dq: the Gluon
        # pass's bf16 dq is then freed before dK/dV are allocated (not both alive at the peak)
        early = not fused and only is None and (overwrites or acc is not None)
        dq = separate_dq() if early else None
        dk, dv, fused_dq = gluon_launch.dkdv(
            q, k, v, do, lse, delta, params, prob, *route.rows, bias=ws_bias, fuse_dq=fused, alibi=alibi,
            dq_acc=acc if fused else None, dk_out=dk_out, dv_out=dv_out,
        )  # fmt: skip
        if fused:
            dq = fused_dq
        elif not early and only is None:
            dq = separate_dq()
        return dq, _into(dk_out, dk), _into(dv_out, dv), None, dsinks
    if pair is not None:
        lse = pair
    if only == "dq":
        return (
            tl_backward.dq_pass(do, q, k, v, lse, delta, params, prob, args, acc, out=dq_out),
            None,
            None,
            None,
            dsinks,
        )
    early = only is None and (overwrites or acc is not None)  # the Gluon branch's order (nothing to keep alive here)
    if early:
        dq = tl_backward.dq_pass(do, q, k, v, lse, delta, params, prob, args, acc, out=dq_out)
    dk, dv, dbias = tl_backward.dkdv_pass(
        do, q, k, v, lse, delta, bias, bias_grad, bcast, params, prob, args, dk_out=dk_out, dv_out=dv_out
    )
    if only == "dkv":
        dq = None
    elif not early:
        dq = tl_backward.dq_pass(do, q, k, v, lse, delta, params, prob, args, acc, out=dq_out)
    return dq, _into(dk_out, dk), _into(dv_out, dv), dbias, dsinks


def _shares_memory(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _overlap(a, b) -> bool:
    """The byte ranges a and b span in one storage meet (disjoint views of one buffer may not)."""
    if not _shares_memory(a, b):
        return False

    def extent(t):
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def _same_view(a, b) -> bool:
    """a and b are one view of one memory (same start, shape and strides)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _into(out, result):
    """``result`` in the caller's ``out`` (a kernel that could write it there did: no copy)."""
    if out is None or result is out or _same_view(result, out):
        return result if out is None else out
    return out.copy_(result)


def check_only(only, dq_out, q, acc) -> None:
    """attention_backward's ``only`` and ``dq_out``."""
    if only not in (None, "dq", "dkv"):
        raise ValueError(f'only: None, "dq" or "dkv" expected, got {only!r}')
    if dq_out is None:
        return
    if acc is not None or only == "dkv":
        raise ValueError("dq_out: not with dq_accumulator, nor with only='dkv'")
    if dq_out.dtype != q.dtype or dq_out.shape != q.shape or dq_out.device != q.device or not dq_out.is_contiguous():
        raise ValueError(
            f"dq_out: a contiguous {q.dtype} tensor of the query's shape {tuple(q.shape)} on {q.device} expected, "
            f"got {dq_out.dtype} {tuple(dq_out.shape)} strides {tuple(dq_out.stride())} on {dq_out.device}"
        )


def check_dkv_out(out, t, other, name: str) -> None:
    """attention_backward's ``dk_out``/``dv_out``: t's shape, dtype and device, last dim contiguous,
    ``t`` itself or memory shared with neither ``t`` nor ``other``."""
    if out is None:
        return
    if out.dtype != t.dtype or out.shape != t.shape or out.device != t.device or out.stride(-1) != 1:
        raise ValueError(
            f"{name}: {t.dtype} of shape {tuple(t.shape)} on {t.device} with a contiguous last dim expected, "
            f"got {out.dtype} {tuple(out.shape)} strides {tuple(out.stride())} on {out.device}"
        )
    if out.numel() and not _same_view(out, t) and (_shares_memory(out, t) or _shares_memory(out, other)):
        raise ValueError(f"{name}: shares memory with the keys or values without being the same view of them")


def check_dq_accumulator(acc, q, cu_q) -> None:
    """attention_backward's ``dq_accumulator``: float32, q's shape and device, dense calls."""
    if acc is None:
        return
    if cu_q is not None:
        raise ValueError("dq_accumulator: dense calls only (cu_seqlens_q given)")
    if acc.dtype != torch.float32 or tuple(acc.shape) != tuple(q.shape) or acc.device != q.device:
        raise ValueError(
            f"dq_accumulator: float32 of the query's shape {tuple(q.shape)} on {q.device} expected, "
            f"got {acc.dtype} {tuple(acc.shape)} on {acc.device}"
        )
    if acc.stride(-1) != 1:
        raise ValueError(f"dq_accumulator: the last dim must be contiguous, got strides {tuple(acc.stride())}")


def describe_route(
    q,
    k,
    v,
    bias,
    params: KernelParams,
    cu_q=None,
    cu_k=None,
    max_sq=None,
    max_sk=None,
    backward: bool = False,
    alibi=None,
    sinks=None,
    need_lse: bool = False,
) -> list[tuple[str, str, tuple[tuple[str, str], ...]]]:
    """The route :func:`attention_forward` (and, with ``backward``, :func:`attention_backward`
    for a contiguous dO, the gradient's usual layout) takes for this call, launching nothing:
    (part, kernel, ((faster route not taken, why), ...)) per pass.  ``need_lse``: an inference
    call that returns its logsumexp."""
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    check_inputs(q, k, v)
    prob = KernelShapes(q, k, v, cu_q, cu_k, max_sq, max_sk)
    if _empty(prob, k):
        return [("forward", "none (nothing to compute: zeros)", ())]
    kind, bt, bstr, _ = bias_layout(bias, (prob.B, prob.Hq, prob.Sq, prob.Sk))
    desc = use_descriptors(params, (q, k, v), q.device, prob.Sk)
    fwd = forward_route(q, k, v, kind, bt, bstr, params, prob, desc, backward or need_lse, alibi, sinks)
    passed = ((DECODE, fwd.why_not_decode),) if fwd.why_not_decode else ()
    passed += ((fwd.gluon, fwd.why_not_gluon),) if fwd.why_not_gluon else ()
    steps = [("forward", fwd.kernel, passed)]
    if not backward:
        return steps
    do = torch.empty(prob.out_shape, device=q.device, dtype=q.dtype)
    bias_grad = bias is not None and bias.requires_grad and bias.dtype.is_floating_point
    desc = use_descriptors(params, (q, k, v, do), q.device)
    bwd = backward_route(do, q, k, v, kind, bt, bstr, bias_grad, params, prob, desc, alibi is not None)
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
