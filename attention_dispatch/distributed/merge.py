"""Merging partial attention results by their logsumexp, and the sinks applied once after.

Block b covers rows [r_b, r_b + n_b) of this rank's queries against a subset of the keys and
gives (out_b, lse_b); a row's attention over the union of its blocks' keys is

    lse = log sum_b exp(lse_b),    out = sum_b w_b out_b,    w_b = exp(lse_b - lse)

exact, in float32 (float64 for float64 inputs). Rows no block covers (or whose blocks are all
empty, lse_b = -inf) give out 0 and lse -inf, with zero gradients (no NaN in forward or backward).
The backward is written out (one Function), so that it runs a few elementwise passes per block
instead of autograd's graph of the merge (stacks, float32 copies of every block's output kept
for the backward, slices' zero-filled gradients):

    d out_b = w_b dout,    d lse_b = w_b (<dout, out_b> - <dout, out> + dlse),
    <dout, out> = sum_b w_b <dout, out_b>
"""

from __future__ import annotations

import math

import torch


def block_weights(lse_b: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """w_b = exp(lse_b - lse), 0 on empty rows (exp(-inf - -inf) would be NaN)."""
    return torch.where(torch.isfinite(lse), torch.exp(lse_b - lse), torch.zeros_like(lse))


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, length, starts, *parts):
        ctx.set_materialize_grads(False)
        n = len(starts)
        outs, lses = parts[:n], parts[n:]
        b, h, _, dv = outs[0].shape
        compute = lses[0].dtype
        lse = lses[0].new_full((b, h, length), -math.inf)
        for r0, lse_b in zip(starts, lses):
            rows = lse[:, :, r0 : r0 + lse_b.shape[2]]
            torch.logaddexp(rows, lse_b, out=rows)
        out = outs[0].new_zeros((b, h, length, dv), dtype=compute)
        weights = []
        for r0, out_b, lse_b in zip(starts, outs, lses):
            w = block_weights(lse_b, lse[:, :, r0 : r0 + lse_b.shape[2]])
            out[:, :, r0 : r0 + lse_b.shape[2]].addcmul_(w.unsqueeze(-1), out_b)  # out_b read in its dtype
            weights.append(w)
        ctx.starts, ctx.length = starts, length
        ctx.save_for_backward(*outs, *weights)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        starts, n = ctx.starts, len(ctx.starts)
        saved = ctx.saved_tensors
        outs, weights = saved[:n], saved[n:]
        if dout is None:
            grads_out = [None] * n
            inners = [torch.zeros_like(w) for w in weights]
        else:
            rows = [dout[:, :, r0 : r0 + o.shape[2]] for r0, o in zip(starts, outs)]
            inners = [(d * o).sum(-1) for d, o in zip(rows, outs)]  # <dout, out_b>
            # w_b dout, written once in the block output's dtype (what its backward reads)
            grads_out = [torch.mul(d, w.unsqueeze(-1), out=torch.empty_like(o)) for d, w, o in zip(rows, weights, outs)]
        delta = weights[0].new_zeros(weights[0].shape[:2] + (ctx.length,))  # <dout, out>
        for r0, w, inner in zip(starts, weights, inners):
            delta[:, :, r0 : r0 + w.shape[2]].addcmul_(w, inner)
        if dlse is not None:
            delta = delta - dlse
        grads_lse = [w * (inner - delta[:, :, r0 : r0 + w.shape[2]]) for r0, w, inner in zip(starts, weights, inners)]
        return (None, None, *grads_out, *grads_lse)


def merge_blocks(parts, length: int):
    """parts: list of (first row, out_b (B, H, n_b, Dv), lse_b (B, H, n_b) float32/float64), at
    least one; rows [first, first + n_b) of ``length``. Returns (out (B, H, length, Dv), lse
    (B, H, length)) in the lses' dtype, differentiable in every out_b and lse_b."""
    starts = tuple(r0 for r0, _, _ in parts)
    return _Merge.apply(length, starts, *(o for _, o, _ in parts), *(lse for _, _, lse in parts))


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with one sink logit per head from attention without: out (B, H, S, Dv), lse
    (B, H, S) without the sink, sinks (H,). A sink only enlarges each row's denominator, so
    out_sink = out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink) (0 for lse -inf)."""
    factor = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])
    return out * factor.unsqueeze(-1).to(out.dtype)
