"""flash-attn 4's dense call as two torch.library ops, for torch.compile.

flash-attn 4's Python (its CuTe-DSL compile cache, fake-mode probes) cannot be traced by dynamo,
so under torch.compile the flash_attn backend calls :func:`flash_attn_func` here instead of ``flash_attn_func``:
the graph holds one forward op (flash-attn 4's public function, asked for its logsumexp) and one
backward op (``_flash_attn_bwd``, the private function FlashAttnFunc.backward calls, read only
for the releases :mod:`.fa4_relaunch` has checked).  Tensors are in flash-attn's (B, S, H, D)."""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from .fa4_relaunch import INTERFACE, untested_release

_NO_WINDOW = -1  # a side without a bound (flash-attn 4 takes None)


def compile_refusal(version: str, kwargs: dict) -> str | None:
    """Why a traced flash-attn 4 dense call keeps the public function (a graph break), or None."""
    why = untested_release(version)
    if why is not None:
        return why
    if kwargs.get("learnable_sink") is not None:
        return "sinks: the ops here do not carry learnable_sink"
    return None


def _side(w: int) -> int | None:
    return None if w == _NO_WINDOW else w


@torch.library.custom_op("attention_dispatch::fa4_dense_forward", mutates_args=())
def fa4_dense_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Sq, H, Dv), lse float32 (B, H, Sq)) from flash-attn 4's public function."""
    func = importlib.import_module("flash_attn.cute").flash_attn_func
    out, lse = func(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=(_side(window_left), _side(window_right)),
        softcap=softcap,
        deterministic=deterministic,
        return_lse=True,
    )
    return out.contiguous(), lse.contiguous()  # as register_fake says (flash-attn 4's own are)


@fa4_dense_forward.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("attention_dispatch::fa4_dense_backward", mutates_args=())
def fa4_dense_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from flash-attn 4's ``_flash_attn_bwd``, as FlashAttnFunc.backward calls it."""
    backward = importlib.import_module(INTERFACE)._flash_attn_bwd
    extra = {} if dlse is None else {"dlse": dlse}
    dq, dk, dv = backward(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale,
        causal,
        softcap,
        window_size_left=_side(window_left),
        window_size_right=_side(window_right),
        deterministic=deterministic,
        **extra,
    )[:3]
    return dq, dk, dv


@fa4_dense_backward.register_fake
def _(q, k, v, out, dout, lse, dlse, softmax_scale, causal, window_left, window_right, softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = options
    ctx.set_materialize_grads(False)  # no dlse for flash-attn 4 unless the logsumexp was used


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dq, dk, dv = fa4_dense_backward(q, k, v, out, dout, lse, dlse, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None


fa4_dense_forward.register_autograd(_backward, setup_context=_setup_context)


def flash_attn_func(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    softcap=0.0,
    deterministic=False,
    return_lse=False,
):
    """flash-attn 4's ``flash_attn_func`` for the keywords the backend passes (no sinks), through
    the ops: (out, lse); the logsumexp is computed either way (the backward reads it)."""
    del return_lse
    left, right = window_size
    return fa4_dense_forward(
        q,
        k,
        v,
        softmax_scale,
        bool(causal),
        _NO_WINDOW if left is None else int(left),
        _NO_WINDOW if right is None else int(right),
        float(softcap or 0.0),
        bool(deterministic),
    )


__all__ = ["flash_attn_func", "compile_refusal", "fa4_dense_forward", "fa4_dense_backward"]
