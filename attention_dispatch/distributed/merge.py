"""Merging partial attention results by their logsumexp, and the sinks applied once after.

Block b covers rows [r_b, r_b + n_b) of this rank's queries against a subset of the keys and
gives (out_b, lse_b); a row's attention over the union of its blocks' keys is

    lse = log sum_b exp(lse_b),    out = sum_b w_b out_b,    w_b = exp(lse_b - lse)

exact, summed in float32 (float64 for float64 inputs); the output is written once, in the lse
dtype or the inputs' (one rounding), with no zero fill or float32 copy of it. Rows no block
covers (or whose blocks are all empty, lse_b = -inf) give out 0 and lse -inf, with zero gradients (no NaN in forward or backward).
The backward is written out (one Function), so that it runs a few elementwise passes per block
instead of autograd's graph of the merge (stacks, float32 copies of every block's output kept
for the backward, slices' zero-filled gradients):

    d out_b = w_b dout,    d lse_b = w_b (<dout, out_b> - <dout, out> + dlse),
    <dout, out> = sum_b w_b <dout, out_b>
"""

from __future__ import annotations

import math

import torch

from ..higher_order import refuse_create_graph


def block_weights(lse_b: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """w_b = exp(lse_b - lse), 0 on empty rows (exp(-inf - -inf) would be NaN)."""
    return torch.where(torch.isfinite(lse), torch.exp(lse_b - lse), torch.zeros_like(lse))


def _pieces(starts, lengths, length: int):
    """The rows [0, length) cut at every block's first and last row: (first, end, the indices of
    the blocks covering them, in order)."""
    cuts = sorted({0, length, *starts, *(r0 + n for r0, n in zip(starts, lengths))})
    return [
        (a, b, [i for i, (r0, n) in enumerate(zip(starts, lengths)) if r0 <= a and b <= r0 + n])
        for a, b in zip(cuts, cuts[1:])
    ]


# A sum of several blocks' outputs is formed in float32 (twice a bf16 output's bytes) in at most
# _SUM_PARTS row ranges of at least _SUM_PART_ELEMENTS elements each: whole, it was the step's
# peak of a rank whose two blocks cover all its rows (2-rank causal zigzag, rank 1: issue 40).
_SUM_PARTS = 4
_SUM_PART_ELEMENTS = 1 << 20


def _sum_parts(a: int, c: int, per_row: int):
    """Rows [a, c) (``per_row`` elements each) as consecutive ranges of about equal length whose
    float32 sums are formed one after another: up to _SUM_PARTS, fewer for a small piece."""
    parts = max(1, min(_SUM_PARTS, c - a, (c - a) * per_row // _SUM_PART_ELEMENTS))
    step = -(-(c - a) // parts)
    return [(r, min(r + step, c)) for r in range(a, c, step)]


def _sum_into(target, terms) -> None:
    """target = w_1 out_1 + ... (``terms``: (w, out) pairs) summed in the lse dtype, the last
    term written into the target in its dtype (one rounding); one term is one pass. The float32
    sum is freed on return, before the next part's."""
    if len(terms) == 1:
        torch.mul(terms[0][1], terms[0][0], out=target)
        return
    total = torch.mul(terms[0][1], terms[0][0])  # in the lse dtype (w's)
    for w, o in terms[1:-1]:
        total.addcmul_(w, o)
    torch.addcmul(total, *terms[-1], out=target)


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, length, starts, out_dtype, *parts):
        ctx.set_materialize_grads(False)
        n = len(starts)
        outs, lses = parts[:n], parts[n:]
        b, h, _, dv = outs[0].shape
        lse = lses[0].new_full((b, h, length), -math.inf)
        for r0, lse_b in zip(starts, lses):
            rows = lse[:, :, r0 : r0 + lse_b.shape[2]]
            torch.logaddexp(rows, lse_b, out=rows)
        weights = [block_weights(lse_b, lse[:, :, r0 : r0 + lse_b.shape[2]]) for r0, lse_b in zip(starts, lses)]
        out = outs[0].new_empty((b, h, length, dv), dtype=out_dtype)
        # per piece of rows, a sum of several blocks in parts (_sum_parts)
        for a, c, covering in _pieces(starts, [o.shape[2] for o in outs], length):
            if not covering:  # rows no block covers
                out[:, :, a:c].zero_()
                continue
            for r0, r1 in _sum_parts(a, c, b * h * dv) if len(covering) > 1 else [(a, c)]:
                terms = [
                    (
                        weights[i][:, :, r0 - starts[i] : r1 - starts[i]].unsqueeze(-1),
                        outs[i][:, :, r0 - starts[i] : r1 - starts[i]],
                    )
                    for i in covering
                ]
                _sum_into(out[:, :, r0:r1], terms)
        ctx.starts, ctx.length = starts, length
        ctx.save_for_backward(*outs, *weights)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        refuse_create_graph("the context-parallel merge")
        starts, n = ctx.starts, len(ctx.starts)
        saved = ctx.saved_tensors
        outs, weights = saved[:n], saved[n:]
        compute = weights[0].dtype
        if dout is None:
            grads_out = [None] * n
            inners = [torch.zeros_like(w) for w in weights]
        else:
            rows = [(r0, r0 + o.shape[2]) for r0, o in zip(starts, outs)]
            # w_b dout, written once in the block output's dtype (what its backward reads)
            grads_out = [
                torch.mul(dout[:, :, r0:r1], w.unsqueeze(-1), out=torch.empty_like(o))
                for (r0, r1), w, o in zip(rows, weights, outs)
            ]
            # <dout, out_b> with products in the lse dtype (dout is in the output's dtype: cast once)
            wide = dout.to(compute)
            inners = [(wide[:, :, r0:r1] * o).sum(-1) for (r0, r1), o in zip(rows, outs)]
        delta = weights[0].new_zeros(weights[0].shape[:2] + (ctx.length,))  # <dout, out>
        for r0, w, inner in zip(starts, weights, inners):
            delta[:, :, r0 : r0 + w.shape[2]].addcmul_(w, inner)
        if dlse is not None:
            delta = delta - dlse
        grads_lse = [w * (inner - delta[:, :, r0 : r0 + w.shape[2]]) for r0, w, inner in zip(starts, weights, inners)]
        return (None, None, None, *grads_out, *grads_lse)


def merge_blocks(parts, length: int, out_dtype: torch.dtype | None = None):
    """parts: list of (first row, out_b (B, H, n_b, Dv), lse_b (B, H, n_b) float32/float64), at
    least one; rows [first, first + n_b) of ``length``. Returns (out (B, H, length, Dv) in
    ``out_dtype`` (default: the lses' dtype; summed in it either way), lse (B, H, length) in the
    lses' dtype), differentiable in every out_b and lse_b."""
    starts = tuple(r0 for r0, _, _ in parts)
    out_dtype = parts[0][2].dtype if out_dtype is None else out_dtype
    return _Merge.apply(length, starts, out_dtype, *(o for _, o, _ in parts), *(lse for _, _, lse in parts))


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with one sink logit per head from attention without: out (B, H, S, Dv), lse
    (B, H, S) without the sink, sinks (H,). A sink only enlarges each row's denominator, so
    out_sink = out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink) (0 for lse -inf)."""
    factor = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])
    return out * factor.unsqueeze(-1).to(out.dtype)
