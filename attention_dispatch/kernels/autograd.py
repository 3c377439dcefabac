"""torch.library integration: one forward op and one backward op, tied together with
``register_autograd`` so that ``torch.compile(fullgraph=True)`` sees a single opaque op per
direction (no graph break) and eager autograd works the same way.

The Python-level parameters travel as one frozen :class:`KernelParams`; the op schema gets
them flattened to primitives (``KernelParams.to_args()`` order).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

import torch
from torch import Tensor

from ..higher_order import refuse_create_graph
from .dropout import STREAM_LEN
from .decode_plan import DecodeRunner
from .entry import DECODE_MIN_KEYS, attention_backward, attention_forward, decode_plan_of, lse_pair_buffer
from .replay import ForwardPlan, TrainingPlan
from .params import KernelParams

_FWD = "attention_dispatch::triton_attention_fwd"
_BWD = "attention_dispatch::triton_attention_bwd"


def _custom_op(name):
    # The forward draws its dropout seed from the torch generator: tag it like torch's
    # random ops so compilers never CSE / recompute it (tags exist since torch 2.5-ish).
    try:
        return torch.library.custom_op(name, mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
    except TypeError:  # pragma: no cover - older torch
        return torch.library.custom_op(name, mutates_args=())


def _params(*args) -> KernelParams:
    return KernelParams.from_args(args)


def _opt(x: int):
    return None if x < 0 else x


@_custom_op(_FWD)
def _fwd_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: Optional[Tensor],
    sinks: Optional[Tensor],
    dropout_stream: Optional[Tensor],
    scale: float,
    align_bottom_right: bool,
    window_left: int,
    window_right: int,
    dropout_p: float,
    deterministic: bool,
    softcap: float,
    block_m: int,
    block_n: int,
    num_splits: int,
    max_grid: int,
    descriptors: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, dropout stream, the float32 exact lse pairs (entry.lse_pair_buffer) or empty)."""
    p = _params(
        scale,
        align_bottom_right,
        window_left,
        window_right,
        dropout_p,
        deterministic,
        softcap,
        block_m,
        block_n,
        num_splits,
        max_grid,
        descriptors,
    )
    pair = _op_pair(query, cu_seqlens_q, sinks)
    out, lse, seed = attention_forward(
        query,
        key,
        value,
        bias,
        p,
        cu_seqlens_q,
        cu_seqlens_k,
        _opt(max_seqlen_q),
        _opt(max_seqlen_k),
        alibi=alibi_slopes,
        sinks=sinks,
        # an op's outputs never alias its inputs: the stream it returns is a copy
        stream=None if dropout_stream is None else dropout_stream.clone(),
        lse_pair=pair,
    )
    return out, lse, seed, pair if pair is not None else query.new_empty((0,), dtype=torch.float32)


def _op_pair(query, cu_q, sinks):
    """The forward op's lse pair buffer: float32 inputs without sinks (what the tl forward fills)."""
    return lse_pair_buffer(query, cu_q) if sinks is None else None


@_fwd_op.register_fake
def _fwd_fake(
    query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi, sinks, stream, *pargs
):
    dropout_p = KernelParams.from_args(pargs).dropout_p
    if cu_seqlens_q is None:
        b, hq, sq, _ = query.shape
        out = query.new_empty((b, hq, sq, value.shape[-1]))
        lse = query.new_empty((b, hq, sq), dtype=torch.float32)
    else:
        t, hq, _ = query.shape
        out = query.new_empty((t, hq, value.shape[-1]))
        lse = query.new_empty((t, hq), dtype=torch.float32)
    seed = query.new_empty((STREAM_LEN if dropout_p > 0 else 0,), dtype=torch.int64)
    pair = _op_pair(query, cu_seqlens_q, sinks)
    return out, lse, seed, pair if pair is not None else query.new_empty((0,), dtype=torch.float32)


@_custom_op(_BWD)
def _bwd_op(
    grad_out: Tensor,
    grad_lse: Optional[Tensor],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    sinks: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    lse_pair: Tensor,
    seed: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    align_bottom_right: bool,
    window_left: int,
    window_right: int,
    dropout_p: float,
    deterministic: bool,
    softcap: float,
    block_m: int,
    block_n: int,
    num_splits: int,
    max_grid: int,
    descriptors: int,
    bias_grad: bool,
    sinks_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    p = _params(
        scale,
        align_bottom_right,
        window_left,
        window_right,
        dropout_p,
        deterministic,
        softcap,
        block_m,
        block_n,
        num_splits,
        max_grid,
        descriptors,
    )
    dq, dk, dv, db, dsinks = attention_backward(
        grad_out,
        query,
        key,
        value,
        bias,
        out,
        lse,
        seed,
        p,
        cu_seqlens_q,
        cu_seqlens_k,
        _opt(max_seqlen_q),
        _opt(max_seqlen_k),
        bias_grad=bias_grad,
        alibi=alibi_slopes,
        sinks=sinks,
        sinks_grad=sinks_grad,
        grad_lse=grad_lse,
        lse_pair=lse_pair if lse_pair.numel() else None,
    )
    # absent gradients as empty tensors: an op returns tensors only
    if db is None:
        db = query.new_empty((0,))
    if dsinks is None:
        dsinks = query.new_empty((0,))
    return dq, dk, dv, db, dsinks


@_bwd_op.register_fake
def _bwd_fake(grad_out, grad_lse, query, key, value, bias, alibi, sinks, *rest):
    bias_grad, sinks_grad = rest[-2:]
    dq = query.new_empty(query.shape)
    dk = key.new_empty(key.shape)
    dv = value.new_empty(value.shape)
    if bias_grad and bias is not None and bias.dtype.is_floating_point:
        db = bias.new_empty(bias.shape)
    else:
        db = query.new_empty((0,))
    dsinks = sinks.new_empty(sinks.shape) if sinks_grad and sinks is not None else query.new_empty((0,))
    return dq, dk, dv, db, dsinks


_N_PARAMS = len(fields(KernelParams))  # KernelParams.to_args()
_N_TENSOR_ARGS = 11  # query .. dropout_stream: the forward op's arguments before the parameters


def _setup_context(ctx, inputs, output):
    query, key, value, bias, cu_q, cu_k, max_sq, max_sk, alibi, sinks, _ = inputs[:_N_TENSOR_ARGS]
    out, lse, seed, pair = output
    ctx.save_for_backward(query, key, value, bias, out, lse, seed, cu_q, cu_k, alibi, sinks, pair)
    ctx.extra = (max_sq, max_sk, tuple(inputs[_N_TENSOR_ARGS : _N_TENSOR_ARGS + _N_PARAMS]))
    ctx.mark_non_differentiable(seed, pair)


def _backward_inputs(ctx, grad_out, sinks_index: int):
    """(saved tensors, grad_out made last-dim contiguous, whether the float bias needs a grad,
    whether the sinks (input ``sinks_index``) need one): what both backward paths (op and eager
    Function) start from."""
    saved = ctx.saved_tensors
    bias, out, sinks = saved[3], saved[4], saved[10]
    bias_grad = bool(bias is not None and ctx.needs_input_grad[3] and bias.dtype.is_floating_point)
    sinks_grad = bool(sinks is not None and ctx.needs_input_grad[sinks_index])
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    return saved, grad_out, bias_grad, sinks_grad


def _backward(ctx, grad_out, grad_lse, grad_seed, grad_pair):
    saved, grad_out, bias_grad, sinks_grad = _backward_inputs(ctx, grad_out, 9)
    query, key, value, bias, out, lse, seed, cu_q, cu_k, alibi, sinks, pair = saved
    max_sq, max_sk, pargs = ctx.extra
    dq, dk, dv, db, dsinks = _bwd_op(
        grad_out,
        grad_lse,
        query,
        key,
        value,
        bias,
        alibi,
        sinks,
        out,
        lse,
        pair,
        seed,
        cu_q,
        cu_k,
        max_sq,
        max_sk,
        *pargs,
        bias_grad,
        sinks_grad,
    )
    grads = (dq, dk, dv, db if bias_grad else None, None, None, None, None, None, dsinks if sinks_grad else None, None)
    return grads + (None,) * _N_PARAMS


torch.library.register_autograd(_FWD, _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager mode: the same forward and backward as the two ops, without torch.library's
    per-call dispatch (~200 us of host time per call, E6).  torch.compile traces the ops
    instead.  ``plan``: a
    :class:`TrainingPlan` of this call's signature (the dispatcher's fast path), which
    relaunches the kernels its first call captured."""

    @staticmethod
    def forward(
        ctx, query, key, value, bias, cu_q, cu_k, max_sq, max_sk, params, plan=None, alibi=None, sinks=None, stream=None
    ):
        # An unused output's gradient stays None: materialised, lse's would cost a zeros kernel
        # and an allocation every backward (E67), and it would run the logsumexp-gradient path
        ctx.set_materialize_grads(False)
        if plan is not None:
            (out, lse, pair), seed = plan.forward(query, key, value), None
        else:
            pair = lse_pair_buffer(query, cu_q)  # float32: the exact log2 logsumexp (issue 38)
            out, lse, seed = attention_forward(
                query,
                key,
                value,
                bias,
                params,
                cu_q,
                cu_k,
                _opt(max_sq),
                _opt(max_sk),
                alibi=alibi,
                sinks=sinks,
                stream=stream,
                lse_pair=pair,
            )
        ctx.save_for_backward(query, key, value, bias, out, lse, seed, cu_q, cu_k, alibi, sinks, pair)
        ctx.extra = (max_sq, max_sk, params, plan)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        refuse_create_graph("the triton backend's attention")
        saved, grad_out, bias_grad, sinks_grad = _backward_inputs(ctx, grad_out, 11)
        query, key, value, bias, out, lse, seed, cu_q, cu_k, alibi, sinks, pair = saved
        max_sq, max_sk, params, plan = ctx.extra
        dsinks = None
        if plan is not None:
            (dq, dk, dv), db = plan.backward(grad_out, query, key, value, out, lse, pair), None
        else:
            dq, dk, dv, db, dsinks = attention_backward(
                grad_out,
                query,
                key,
                value,
                bias,
                out,
                lse,
                seed,
                params,
                cu_q,
                cu_k,
                _opt(max_sq),
                _opt(max_sk),
                bias_grad=bias_grad,
                alibi=alibi,
                sinks=sinks,
                sinks_grad=sinks_grad,
                grad_lse=grad_lse,
                lse_pair=pair,
            )
        return dq, dk, dv, (db if bias_grad else None), None, None, None, None, None, None, None, dsinks, None


def _last_dim_contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    if t is not None and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        return t.contiguous()
    return t


def triton_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: Optional[Tensor],
    params: KernelParams,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    *,
    return_lse: bool = False,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_stream: Optional[Tensor] = None,
):
    """Attention with the Triton kernels (see package docstring for layouts and semantics).

    Returns the output (query's dtype), or (output, logsumexp fp32, without the sink) when
    ``return_lse``.  Differentiable w.r.t. query, key, value, a floating ``bias`` and ``sinks``;
    the logsumexp is differentiable too.  ``alibi_slopes``: fp32 (B, Hq) (a stride-0 batch dim
    is fine), no gradient; ``sinks``: (Hq,) of any float dtype; ``dropout_stream``:
    :func:`dropout.positioned_stream`'s (the keep-mask of a block of a larger call; dense calls),
    else each call draws a seed."""
    query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
    if cu_seqlens_q is not None:
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("varlen: max_seqlen_q and max_seqlen_k (python ints) are required")
        msq, msk = int(max_seqlen_q), int(max_seqlen_k)
    else:
        msq = msk = -1
    if torch.compiler.is_compiling():
        out, lse, _, _ = _fwd_op(
            query,
            key,
            value,
            bias,
            cu_seqlens_q,
            cu_seqlens_k,
            msq,
            msk,
            alibi_slopes,
            sinks,
            dropout_stream,
            *params.to_args(),
        )
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, bias, sinks)):
        out, lse = _EagerAttention.apply(
            query,
            key,
            value,
            bias,
            cu_seqlens_q,
            cu_seqlens_k,
            msq,
            msk,
            params,
            None,
            alibi_slopes,
            sinks,
            dropout_stream,
        )
    else:  # inference: no autograd node to build
        out, lse, _ = attention_forward(
            query,
            key,
            value,
            bias,
            params,
            cu_seqlens_q,
            cu_seqlens_k,
            _opt(msq),
            _opt(msk),
            need_lse=return_lse,
            alibi=alibi_slopes,
            sinks=sinks,
            stream=dropout_stream,
        )
    return (out, lse) if return_lse else out


def prepare_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: Optional[Tensor],
    params: KernelParams,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
):
    """A callable ``(query, key, value[, bias], *, cu_seqlens_q, cu_seqlens_k) -> out`` for
    repeated calls whose tensors have these shapes, strides, dtype, device and alignment,
    under the same grad mode: a :class:`DecodeRunner` for dense inference calls that take the
    decode route (any key length), a :class:`ForwardPlan` (captured kernel launches, relaunched)
    for other dense inference calls without a bias, a :class:`TrainingPlan` behind the autograd function
    for dense training calls without a bias or dropout, else :func:`triton_attention` with
    these parameters (``bias`` only says whether the calls have one: each call passes its
    own; varlen calls pass their own offsets, of these shapes and max_seqlen)."""
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, bias))
    if bias is None and cu_seqlens_q is None and query.dim() == 4:
        if not needs_grad:
            plan = decode_plan_of(query, key, value, params)
            if plan is not None:  # also serves other key lengths (sdpa()'s span hits)
                fallback = lambda q, k, v: triton_attention(q, k, v, None, params)  # noqa: E731
                return DecodeRunner(plan, query, key, value, DECODE_MIN_KEYS, fallback)
            return ForwardPlan(query, params)
        if params.dropout_p == 0:
            plan = TrainingPlan(query, params)

            def run_planned(query, key, value):
                return _EagerAttention.apply(
                    _last_dim_contiguous(query),
                    _last_dim_contiguous(key),
                    _last_dim_contiguous(value),
                    None,
                    None,
                    None,
                    -1,
                    -1,
                    params,
                    plan,
                )[0]

            return run_planned

    def run(query, key, value, bias=None, *, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k):
        return triton_attention(query, key, value, bias, params, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    return run
