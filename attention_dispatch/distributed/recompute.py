"""backward="recompute": one autograd Function over the whole context-parallel attention whose
backward recomputes each block and sends the keys and values round again with their gradients
(as ring-flash-attention does), so that no rank keeps other ranks' keys for the backward:
activations of O(S / W) instead of the whole sequence's keys and values.

Per row, with the merged (out, lse) of the forward and the loss's gradients (dout, dlse), block
b's share is ``w_b = exp(lse_b - lse)`` (0 for an empty row), and the merge's gradient is

    dL/d out_b = w_b dout,    dL/d lse_b = w_b (<dout, out_b> - <dout, out> + dlse)

which autograd turns into the block's dq, dk, dv (and bias) gradients through ad.sdpa's
differentiable logsumexp, one block at a time. Gradients are accumulated in the lse dtype
(float32, float64 for float64 inputs), keys' gradients travelling with them.
"""

from __future__ import annotations

import torch

from ..higher_order import refuse_create_graph
from . import exchange as _exchange
from .blocks import span
from .merge import block_weights
from .steps import Setup, block_of_slices, block_pairs, run_forward


class _Saved:
    """What every block's backward reads: q and the mask, the forward's result and the gradients
    (lse dtype), and delta = <dout, out> per row."""

    def __init__(self, q, mask, lse, dout, dlse, delta):
        self.q, self.mask, self.lse, self.dout, self.dlse, self.delta = q, mask, lse, dout, dlse, delta


def _block_grads(setup: Setup, q_parts, k_parts, k, v, saved: _Saved, need):
    """Block (q_parts x k_parts)'s gradients (dq, dk, dv of the block's rows and keys only,
    dmask full-sized), None where not needed. None when the block holds no allowed pair."""
    rows, keys = slice(*span(q_parts)), slice(*span(k_parts))
    with torch.enable_grad():
        leaves = (
            saved.q[:, :, rows].detach().requires_grad_(need[0]),
            k[:, :, keys].detach().requires_grad_(need[1]),
            v[:, :, keys].detach().requires_grad_(need[2]),
            None if saved.mask is None else saved.mask.detach().requires_grad_(need[3]),
        )
        result = block_of_slices(setup, q_parts, k_parts, *leaves)
        if result is None:
            return None
        out_b, lse_b = result
        lse = saved.lse[:, :, rows]
        weight = block_weights(lse_b.detach(), lse)
        dout = saved.dout[:, :, rows]
        grad_out = torch.mul(dout, weight.unsqueeze(-1), out=torch.empty_like(out_b))  # in out_b's dtype
        inner = (dout * out_b.detach()).sum(-1)  # promoted to dout's dtype as it multiplies: no copy
        grad_lse = weight * (inner - saved.delta[:, :, rows] + saved.dlse[:, :, rows])
        wanted = [t for t, n in zip(leaves, need) if t is not None and n]
        grads = iter(torch.autograd.grad((out_b, lse_b), wanted, (grad_out, grad_lse), allow_unused=True))
    return tuple(next(grads) if t is not None and n else None for t, n in zip(leaves, need))


def _add(total, part, index=None):
    """total[index] += part where part may be None (unused); total None means not needed."""
    if total is None or part is None:
        return total
    target = total if index is None else total[index]
    target.add_(part)  # add_ converts part to total's dtype as it adds: no float32 copy
    return total


class _RecomputedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, setup, q, k, v, mask):
        out, lse, _ = run_forward(setup, q, k, v, mask, differentiable=False)
        ctx.setup = setup
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        refuse_create_graph("context-parallel attention")
        setup = ctx.setup
        q, k, v, mask, out, lse = ctx.saved_tensors
        need = ctx.needs_input_grad[1:5]
        compute = lse.dtype
        dout, dlse = dout.to(compute), dlse.to(compute)
        # the saved outputs carry this Function as grad_fn: detached, no graph is built through them
        saved = _Saved(q, mask, lse.detach(), dout, dlse, (dout * out).sum(-1))
        dq = torch.zeros_like(q, dtype=compute) if need[0] else None
        dmask = torch.zeros_like(mask, dtype=compute) if need[3] else None

        def source_grads(source, k_src, v_src, spare):
            """dk, dv (lse dtype, None where not needed) of source's keys from this rank's blocks
            (``spare`` unused: they are kept in the lse dtype)."""
            dk = torch.zeros_like(k_src, dtype=compute) if need[1] else None
            dv = torch.zeros_like(v_src, dtype=compute) if need[2] else None
            for q_parts, k_parts in block_pairs(setup, source):
                grads = _block_grads(setup, q_parts, k_parts, k_src, v_src, saved, need)
                if grads is not None:
                    rows = (slice(None), slice(None), slice(*span(q_parts)))
                    keys = (slice(None), slice(None), slice(*span(k_parts)))
                    for total, part, index in zip((dq, dk, dv, dmask), grads, (rows, keys, keys, None)):
                        _add(total, part, index)
            return [g for g in (dk, dv) if g is not None]

        run = ring_backward if setup.exchange == "ring" else allgather_backward
        dkv = run(setup, k, v, source_grads)
        dkv = iter(dkv)
        dk = next(dkv).to(k.dtype) if need[1] else None
        dv = next(dkv).to(v.dtype) if need[2] else None
        return (
            None,
            None if dq is None else dq.to(q.dtype),
            dk,
            dv,
            None if dmask is None else dmask.to(mask.dtype),
        )


def ring_backward(setup: Setup, k, v, source_grads):
    """The keys go round again (W - 1 shifts), their gradients with them one step behind (W
    shifts: after the last, each rank holds its own keys' gradients summed over every rank). On
    two ranks a rank's own keys' gradients stay here and the other rank's part comes back once,
    after the last step, in pieces (exchange.swap_add: one piece's buffer, not a whole copy), and
    no gradient buffer is in flight during that step.
    ``source_grads(source, k, v, spare)``: the gradients of source's keys from this rank's blocks;
    ``spare``: None, or the received k and v, not read again once its blocks ran (their buffers
    may hold the gradients). On two ranks the own source's may be a callable giving them, called
    after the last step's blocks (merged.py computes them then)."""
    rank, world, group = setup.rank, setup.world, setup.group
    home = world == 2
    own, travelling, pending_grads = None, None, None
    for step in range(world):
        last = step == world - 1
        pending_keys = None
        if not last:
            (next_k, next_v), pending_keys = _exchange.start_shift([k, v], group, rank, world)
        grads = source_grads((rank - step) % world, k, v, [k, v] if last and step > 0 else None)
        k = v = None  # not read again: a received buffer is freed before the next shift
        if pending_grads is not None:  # the gradients of these keys from the ranks before
            pending_grads.wait()
            grads = [g.add_(t) for g, t in zip(grads, travelling)]
        if home and step == 0:
            own = grads
        elif home and own:  # the other rank's part of this rank's keys' gradients, piece by piece
            if callable(own):  # computed only now (merged.py: after the last block's)
                own = own()
            _exchange.swap_add(own, grads, group, rank, world)
            travelling = None
        elif grads and world > 1:
            travelling, pending_grads = _exchange.start_shift(grads, group, rank, world)
        elif grads:
            travelling, pending_grads = grads, None
        if pending_keys is not None:
            pending_keys.wait()
            # the only references: the received keys are freed once their blocks ran
            k, v, next_k, next_v = next_k, next_v, None, None
    if pending_grads is not None:
        pending_grads.wait()
    if own:  # two ranks: the other rank's part of this rank's keys' gradients was added
        return own
    return travelling or []


def allgather_backward(setup: Setup, k, v, source_grads):
    """Gather the keys again (the local block's gradients computed while they travel), then
    reduce-scatter every source's key gradients to their owner."""
    rank, world, group = setup.rank, setup.world, setup.group
    if world == 1:
        return source_grads(rank, k, v, None)
    pending = _exchange.Pending()
    gathered_k, gathered_v = _exchange.start_all_gather([k, v], group, pending)
    by_source = {rank: source_grads(rank, k, v, None)}
    pending.wait()
    for source in range(world):
        if source != rank:
            by_source[source] = source_grads(source, gathered_k[source], gathered_v[source], None)
    count = len(by_source[rank])
    return [_exchange.reduce_scatter_sum([by_source[s][i] for s in range(world)], group) for i in range(count)]


def recomputed_attention(setup: Setup, q, k, v, mask):
    """This rank's merged (out, lse) in the lse dtype, differentiable through the recomputing backward."""
    return _RecomputedAttention.apply(setup, q, k, v, mask)
