"""Replaying a call's kernel launches: repeated inference forwards (ForwardPlan) and training
calls (TrainingPlan) of one signature relaunch the compiled kernels over new tensors, skipping
the launch logic (~1 ms of host time per forward+backward on the H100 machine, E46)."""

from __future__ import annotations

import torch

from .compiled_cache import COMPILED, hooks_installed
from .entry import attention_backward, attention_forward, lse_pair_buffer
from .launch_replay import Replay
from .tl.launch import natural_lse
from .params import KernelParams


def contiguous(*tensors) -> bool:
    return all(t is not None and t.is_contiguous() for t in tensors)


class ForwardPlan:
    """Repeated inference forwards of one call signature: dense query/key/value with the
    same shapes, strides, dtype, device and 16-byte alignment, no bias, given params.

    The first call runs :func:`attention_forward` and captures its kernel launches; later
    calls allocate the output (no logsumexp is written) and relaunch the compiled kernels with
    the new tensors (:class:`Replay`): none of the launch glue above runs again (the
    dispatcher's fast path caches a plan per signature, E17).  A
    call whose launches touch another tensor (a dropout seed, a dtype conversion) or that
    launches nothing (an empty problem) keeps the full path every time.  Host-built
    descriptors (the tl forward's K/V, every operand of the Gluon forward) are rebuilt over
    the new tensors."""

    __slots__ = ("params", "device", "launch", "out_shape", "out_like_query")

    def __init__(self, query, params: KernelParams):
        self.params, self.device, self.launch = params, query.device, None

    def __call__(self, q, k, v):
        launch = self.launch
        if launch is None or hooks_installed():
            return self._first(q, k, v)
        # empty_like: one C call without torch.empty's argument parsing (~1 us of host time)
        out = (
            torch.empty_like(q)
            if self.out_like_query
            else torch.empty(self.out_shape, device=self.device, dtype=q.dtype)
        )
        launch((q, k, v, out))
        return out

    def _first(self, q, k, v):
        with COMPILED.capture() as launches:
            out, _, _ = attention_forward(q, k, v, None, self.params, need_lse=False)
        if self.launch is None and contiguous(out):
            self.out_shape = tuple(out.shape)
            # the same layout from empty_like: q and out both contiguous of one shape and dtype
            self.out_like_query = out.shape == q.shape and out.dtype == q.dtype and q.is_contiguous()
            self.launch = Replay.capture(launches, (q, k, v, out), self.device)
        return out


# Launch constexprs of kernels that add into a buffer zeroed before them: the dQ pass split over
# keys (fp32 atomics) and the dK/dV pass with dQ fused in (TMA reduce-adds).
ADDS_INTO_ZEROED = ("ATOMIC", "FUSE_DQ")


class TrainingPlan:
    """Repeated training calls of one signature: dense query/key/value with the same shapes,
    strides, dtype, device and 16-byte alignment, no bias, no dropout, given params (the
    dispatcher's fast path keeps one per signature).  The first forward and the first backward
    run the full launch glue and capture their kernel launches; later ones allocate the outputs
    and relaunch them over the new tensors (:class:`Replay`).  The backward
    is replayed for a dO of the captured shape, strides, dtype and alignment, unless one of its
    launches adds into a buffer zeroed before it (:data:`ADDS_INTO_ZEROED`: a replay's fresh
    outputs are not zeroed); anything else keeps the full path."""

    __slots__ = ("params", "device", "fwd", "fwd_outputs", "bwd", "bwd_key", "bwd_outputs")

    def __init__(self, query, params: KernelParams):
        if params.dropout_p > 0:
            raise ValueError("TrainingPlan: dropout draws a seed per call (use triton_attention)")
        self.params, self.device = params, query.device
        self.fwd = self.bwd = self.bwd_key = None

    def _empty(self, outputs):
        return [torch.empty(shape, device=self.device, dtype=dtype) for shape, dtype in outputs]

    def forward(self, q, k, v):
        """(out, lse, the float32 inputs' exact log2 lse pairs or None: entry.lse_pair_buffer)
        as :func:`attention_forward` writes them."""
        pair = lse_pair_buffer(q)
        if self.fwd is not None and not hooks_installed():
            out, lse = self._empty(self.fwd_outputs)
            self.fwd((q, k, v, out, lse) + ((pair,) if pair is not None else ()))
            if pair is not None:  # the launcher's conversion is no captured kernel launch
                natural_lse(pair, lse)
            return out, lse, pair
        with COMPILED.capture() as launches:
            out, lse, _ = attention_forward(q, k, v, None, self.params, lse_pair=pair)
        if self.fwd is None and contiguous(out, lse):
            self.fwd_outputs = ((out.shape, out.dtype), (lse.shape, lse.dtype))
            pool = (q, k, v, out, lse) + ((pair,) if pair is not None else ())
            self.fwd = Replay.capture(launches, pool, self.device)
        return out, lse, pair

    def backward(self, do, q, k, v, out, lse, pair=None):
        """(dq, dk, dv) as :func:`attention_backward` returns them (no bias; ``pair``: forward's)."""
        extra = (pair,) if pair is not None else ()
        key = (do.shape, do.stride(), do.dtype, do.data_ptr() & 15)
        if self.bwd is not None and key == self.bwd_key and not hooks_installed():
            delta, dq, dk, dv = self._empty(self.bwd_outputs)
            self.bwd((q, k, v, out, lse, do, delta, dq, dk, dv) + extra)
            return dq, dk, dv
        delta = torch.empty(lse.shape, device=self.device, dtype=torch.float32)
        with COMPILED.capture() as launches:
            dq, dk, dv, *_ = attention_backward(
                do, q, k, v, None, out, lse, None, self.params, delta=delta, lse_pair=pair
            )
        if (
            self.bwd is None
            and contiguous(dq, dk, dv)
            and not any(constexprs.get(flag, False) for _, _, _, constexprs in launches for flag in ADDS_INTO_ZEROED)
        ):
            self.bwd_outputs = tuple((t.shape, t.dtype) for t in (delta, dq, dk, dv))
            self.bwd_key = key
            self.bwd = Replay.capture(launches, (q, k, v, out, lse, do, delta, dq, dk, dv) + extra, self.device)
        return dq, dk, dv


# --------------------------------------------------------------------------- backward
