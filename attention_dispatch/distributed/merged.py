"""backward="merged": one autograd Function whose backward runs each block's backend's backward
from the MERGED output and logsumexp (Backend.run_backward, Capabilities.backward_from_output),
as ring-flash-attention does: no block's own output, merge weights or per-block products.

A block's probabilities in the whole call are ``P_b = exp(s_b - lse)`` with the merged ``lse``,
and its scores' gradient is ``dS_b = P_b (dout V_b^T - delta)``, ``delta = rowsum(dout * out) -
dlse`` (the same for every block of a row; each backend's backward computes it from the rows it
is given). The forward keeps this rank's q, k, v, mask, merged output and logsumexp (O(S / W));
the backward sends the keys round again with their gradients (recompute.py's schedules), which
travel and accumulate in the blocks' gradient dtype (the inputs', as autograd mode adds them).
"""

from __future__ import annotations

import torch

from .. import registry
from ..call import normalize_call
from ..dispatch import use_backends
from .blocks import span
from .recompute import allgather_backward, ring_backward
from .steps import Setup, _whole_rows, block_args, block_pairs, run_forward


def _place(total, part, index, shape):
    """total[index] += part, total made on first use: ``part`` itself where it covers ``shape``
    (no zero fill), else zeros of ``shape`` in part's dtype."""
    if part is None:
        return total
    if total is None:
        if tuple(part.shape) == tuple(shape):
            return part
        total = part.new_zeros(shape)
    total[index].add_(part)
    return total


def _block_backward(setup: Setup, backend: str, q_parts, k_parts, k, v, saved):
    """(dq of the block's rows, dk, dv of its keys) from the block's backend, or None when the
    block holds no allowed pair."""
    q, mask, out, lse, dout, dlse = saved
    rows, keys = slice(*span(q_parts)), slice(*span(k_parts))
    args = block_args(setup, q_parts, k_parts, q[:, :, rows], k[:, :, keys], v[:, :, keys], mask)
    if args is None:
        return None
    q_b, k_b, v_b, attn_mask, causal, window, scope = args
    options = {n: a for n, a in setup.sdpa_args.items() if n != "backend"}
    with scope:  # the block's dropout stream, as in the forward
        call = normalize_call(q_b, k_b, v_b, attn_mask, setup.dropout_p, causal=causal, window=window, **options)
        return registry.get_backend(backend).run_backward(
            call.query,
            call.key,
            call.value,
            out[:, :, rows],
            lse[:, :, rows],
            _whole_rows(dout[:, :, rows]),  # a part of S: whole rows, as the kernels read q (steps.py)
            None if dlse is None else dlse[:, :, rows],
            **call.options,
        )


class _MergedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, setup, q, k, v, mask):
        ctx.set_materialize_grads(False)
        # merged straight into the inputs' dtype unless the sinks still scale it (api.py)
        out_dtype = q.dtype if setup.sinks is None else None
        served = {}
        with use_backends(*setup.backward_backends):  # blocks on backends with run_backward()
            out, lse, _ = run_forward(setup, q, k, v, mask, False, out_dtype, served)
        ctx.setup, ctx.served = setup, served
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        setup, served = ctx.setup, ctx.served
        q, k, v, mask, out, lse = ctx.saved_tensors
        need = ctx.needs_input_grad[1:4]
        if dout is None:
            dout = torch.zeros_like(out)
        saved = (q, mask, out.detach(), lse.detach(), dout, dlse)
        dq = None

        def source_grads(source, k, v):
            nonlocal dq
            dk = dv = None
            for q_parts, k_parts in block_pairs(setup, source):
                backend = served.get((source, q_parts, k_parts))
                if backend is None:  # skipped in the forward: no allowed pair
                    continue
                grads = _block_backward(setup, backend, q_parts, k_parts, k, v, saved)
                rows = (slice(None), slice(None), slice(*span(q_parts)))
                keys = (slice(None), slice(None), slice(*span(k_parts)))
                dq = _place(dq, grads[0] if need[0] else None, rows, q.shape)
                dk = _place(dk, grads[1] if need[1] else None, keys, k.shape)
                dv = _place(dv, grads[2] if need[2] else None, keys, v.shape)
            # every source sends a gradient for each needed tensor, zeros where no block read its keys
            dk = k.new_zeros(k.shape) if need[1] and dk is None else dk
            dv = v.new_zeros(v.shape) if need[2] and dv is None else dv
            return [g for g, n in zip((dk, dv), need[1:]) if n]

        run = ring_backward if setup.exchange == "ring" else allgather_backward
        dkv = iter(run(setup, k, v, source_grads))
        dk = next(dkv).to(k.dtype) if need[1] else None
        dv = next(dkv).to(v.dtype) if need[2] else None
        if need[0] and dq is None:  # no block computed (every row empty)
            dq = torch.zeros_like(q)
        return None, None if dq is None else dq.to(q.dtype), dk, dv, None


def merged_attention(setup: Setup, q, k, v, mask):
    """This rank's merged (out in the inputs' dtype, or the lse dtype with sinks; lse),
    differentiable through the blocks' backward from the merged output (no mask gradient)."""
    return _MergedAttention.apply(setup, q, k, v, mask)
