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

import dataclasses

from ..higher_order import refuse_create_graph
from .. import registry
from ..call import normalize_call
from ..debug import note_decision
from ..dispatch import decide, use_backends
from . import dq_buffer
from .blocks import span
from .recompute import allgather_backward, ring_backward
from .steps import Setup, block_args, block_pairs, run_forward


def _packable(t, keys: slice) -> bool:
    """Rows ``keys`` of each (batch, head) of the contiguous (B, H, S, D) ``t`` can be moved, head
    after head, to the front of its memory (_pack_rows) without writing rows not yet moved."""
    n, S, o = keys.stop - keys.start, t.shape[2], keys.start
    return t.is_contiguous() and 0 < n < S and (o == 0 or o >= n) and S - n + o >= n


def _pack_rows(t, keys: slice):
    """The rows ``keys`` of t (B, H, S, D), read no more, as a contiguous (B, H, n, D) view of the
    front of t's memory: one head's rows after another, each moved before a later one's
    destination reaches it (_packable), instead of a new copy (block_args' _whole_rows)."""
    B, H, S, D = t.shape
    n = keys.stop - keys.start
    flat, packed = t.view(B * H, S, D), t.view(-1)[: B * H * n * D].view(B * H, n, D)
    for j in range(B * H):
        if j or keys.start:  # head 0's rows at offset 0 are already in place
            packed[j].copy_(flat[j, keys])
    return packed.view(B, H, n, D)


def _unpack_rows(t, packed, keys: slice):
    """_pack_rows undone for their gradients: ``packed`` (the front of t's memory) moved to rows
    ``keys`` of t, last head first, the other rows zeroed; returns t."""
    B, H, S, D = t.shape
    flat, rows = t.view(B * H, S, D), packed.reshape(B * H, -1, D)
    for j in reversed(range(B * H)):
        if j or keys.start:
            flat[j, keys].copy_(rows[j])
    t[..., : keys.start, :].zero_()
    t[..., keys.stop :, :].zero_()
    return t


def _place(total, part, index, shape, spare=None):
    """total[index] += part, total made on first use: ``part`` itself where it covers ``shape``
    (no zero fill), else ``spare`` (a buffer of ``shape`` no longer read; ``part`` may already be
    its ``index`` rows: then only the rest is zeroed) or new, zeroed."""
    if part is None:
        return total
    if total is None:
        if tuple(part.shape) == tuple(shape):
            return part
        if spare is None:
            total = part.new_zeros(shape)
        else:
            rows = spare[index]
            if part.data_ptr() == spare.data_ptr() and part.is_contiguous() and part.shape != spare.shape:
                return _unpack_rows(spare, part, index[-1])  # written over _pack_rows' keys
            if part.data_ptr() == rows.data_ptr() and part.stride() == rows.stride():
                spare[..., : index[-1].start, :].zero_()
                spare[..., index[-1].stop :, :].zero_()
                return spare
            total = spare.zero_()
    total[index].add_(part)
    return total


def _block_backward(setup: Setup, backend: str, q_parts, k_parts, k, v, saved, dq, overwrite=False, **split):
    """(dq of the block's rows or None where added into ``dq``, the rank's accumulator (lse
    dtype) or not needed, dk, dv of its keys) from the block's backend, or None when the block
    holds no allowed pair. ``overwrite``: k and v are read no more after this block; a backend
    declaring ``Capabilities.backward_dkv_out`` writes the block's dk/dv into the keys it read
    (a view of k/v, or the copy block_args made). ``split``: run_backward's ``only`` with its
    ``dq_out`` or ``dkv_out`` (_OwnSplit; the backend declares ``Capabilities.backward_split``)."""
    q, mask, out, lse, dout, dlse = saved
    rows, keys = slice(*span(q_parts)), slice(*span(k_parts))
    # q and dout rows where they lie: the kernels' backward passes read a slice of the shard's rows
    chosen = registry.get_backend(backend)
    in_place = overwrite and chosen.capabilities.backward_dkv_out
    k_b, v_b = k[:, :, keys], v[:, :, keys]
    if in_place and k_b.shape != k.shape and _packable(k, keys) and _packable(v, keys):
        # a part of the received keys: moved to the front of their own memory, not copied
        k_b, v_b = _pack_rows(k, keys), _pack_rows(v, keys)
    args = block_args(setup, q_parts, k_parts, q[:, :, rows], k_b, v_b, mask, q_strided=True)
    if args is None:
        return None
    q_b, k_b, v_b, attn_mask, causal, window, scope = args
    options = {n: a for n, a in setup.sdpa_args.items() if n != "backend"}
    into = dq is not None and chosen.capabilities.backward_dq_accumulator
    with scope:  # the block's dropout stream, as in the forward
        call = normalize_call(q_b, k_b, v_b, attn_mask, setup.dropout_p, causal=causal, window=window, **options)
        grads = chosen.run_backward(
            call.query,
            call.key,
            call.value,
            out[:, :, rows],
            lse[:, :, rows],
            dout[:, :, rows],
            None if dlse is None else dlse[:, :, rows],
            **({"dq_accumulator": dq[:, :, rows]} if into else {}),
            **({"dkv_out": (call.key, call.value)} if in_place else {}),
            **split,
            **call.options,
        )
    if dq is not None and not into:
        dq[:, :, rows].add_(grads[0])
    return grads


def backward_backends(setup: Setup, served: dict) -> dict:
    """(source, q_parts, k_parts) -> the backend running that block's backward from the merged
    output: decided apart from its forward (dispatch.decide on the block's Problem as a training
    call from a given output, among setup.backward_backends; with a table, policy "auto" ranks
    them by their training time), since the merged out and lse do not depend on which backend
    computed a block. With dropout, the forward's backend (its keep-mask). Each decision is
    noted (ad.record() / ad.last_decision() see it) where it differs from the forward's; called
    by the forward (autograd may run the backward in another thread, outside the caller's record())."""
    chosen, decided = {}, {}
    for block, forward in served.items():
        if setup.dropout_p > 0:
            chosen[block] = forward.backend
            continue
        problem = dataclasses.replace(forward.problem, requires_grad=True, backward_from_output=True, return_lse=False)
        if problem not in decided:
            with use_backends(*setup.backward_backends):
                decision = decide(problem, raise_if_none=False)
            decided[problem] = decision
            if decision.backend is not None and decision.backend != forward.backend:
                note_decision(decision)
        chosen[block] = decided[problem].backend or forward.backend
    return chosen


def _own_split(setup: Setup, served, q, k, v, acc_dtype, need):
    """(q parts, k parts, backend) of this rank's own block where its backward runs in two parts
    (own_grads in _MergedAttention.backward: dq at the first ring step, dk/dv after the last, in
    one buffer with dq: dq_buffer), else None. Two ranks on a ring, every gradient needed, 16-bit
    contiguous inputs, the own keys one block over all the rank's rows and keys, its backend
    declaring ``Capabilities.backward_split``, and a banded block: the kernels then run dQ as a
    pass of its own anyway (gluon.route.fuse_dq_reason: causal or window), so the split adds
    none (an unbanded block's dQ is fused into its dK/dV pass: split, it would cost one)."""
    if setup.world != 2 or setup.exchange != "ring" or not all(need[:3]):
        return None
    if not (dq_buffer.halves(q, acc_dtype) and k.is_contiguous() and v.is_contiguous()):
        return None
    blocks = [b for b in block_pairs(setup, setup.rank) if (setup.rank, *b) in served]
    if len(blocks) != 1:
        return None
    (q_parts, k_parts), backend = blocks[0], served[(setup.rank, *blocks[0])]
    if span(q_parts) != (0, q.shape[2]) or span(k_parts) != (0, k.shape[2]):
        return None
    caps = registry.get_backend(backend).capabilities
    if not (caps.backward_split and caps.backward_dkv_out):
        return None
    args = block_args(setup, q_parts, k_parts, q, k, v, None, q_strided=True)
    if args is None or (args[4] is None and args[5] is None):
        return None
    return q_parts, k_parts, backend


class _MergedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, setup, q, k, v, mask):
        ctx.set_materialize_grads(False)
        # merged straight into the inputs' dtype unless the sinks still scale it (api.py)
        out_dtype = q.dtype if setup.sinks is None else None
        served = {}
        with use_backends(*setup.backward_backends):  # blocks on backends with run_backward()
            out, lse, _ = run_forward(setup, q, k, v, mask, False, out_dtype, served)
        # decided here, in the caller's context (ad.record() sees the decisions), not in autograd's thread
        ctx.setup, ctx.served = setup, backward_backends(setup, served)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        refuse_create_graph("context-parallel attention")
        setup, served = ctx.setup, ctx.served
        q, k, v, mask, out, lse = ctx.saved_tensors
        need = ctx.needs_input_grad[1:4]
        if dout is None:
            dout = torch.zeros_like(out)
        saved = (q, mask, out.detach(), lse.detach(), dout, dlse)
        own = _own_split(setup, served, q, k, v, lse.dtype, need)
        # the rank's dq summed over its blocks unrounded (the kernels add into it), rounded once
        if own is not None:  # filled by the own block's dq (dq_buffer.widen): no zero fill
            dq = dq_buffer.new(q, lse.dtype)
        else:
            dq = torch.zeros_like(q, dtype=lse.dtype) if need[0] else None
        result = {}

        def own_grads(k, v):
            """The own block's dq now (the keys travelling), a callable for its dk/dv after the
            last block (ring_backward): dq narrowed in place first, dk/dv in its freed half."""
            q_parts, k_parts, backend = own
            front = dq_buffer.front(dq, q.dtype)
            _block_backward(setup, backend, q_parts, k_parts, k, v, saved, None, only="dq", dq_out=front)
            dq_buffer.widen(dq, q.dtype)

            def finish():
                result["dq"] = dq_buffer.narrow(dq, q.dtype)
                dk, dv = (
                    t if t is not None else torch.empty_like(like)
                    for t, like in zip(dq_buffer.back_views(dq, q.dtype, k, v), (k, v))
                )
                grads = _block_backward(
                    setup, backend, q_parts, k_parts, k, v, saved, None, only="dkv", dkv_out=(dk, dv)
                )
                return [grads[1], grads[2]]

            return finish

        def source_grads(source, k, v, spare):
            if own is not None and source == setup.rank:
                return own_grads(k, v)
            dk = dv = None
            # blocks skipped in the forward (no allowed pair) have no backend
            blocks = [(q_parts, k_parts) for q_parts, k_parts in block_pairs(setup, source)]
            blocks = [(b, served[(source, *b)]) for b in blocks if (source, *b) in served]
            for i, ((q_parts, k_parts), backend) in enumerate(blocks):
                last = spare is not None and i == len(blocks) - 1
                # the keys' buffers may hold their gradients once the source's last block read them
                grads = _block_backward(setup, backend, q_parts, k_parts, k, v, saved, dq, overwrite=last)
                keys = (slice(None), slice(None), slice(*span(k_parts)))
                kept = spare if last else (None, None)
                dk = _place(dk, grads[1] if need[1] else None, keys, k.shape, kept[0])
                dv = _place(dv, grads[2] if need[2] else None, keys, v.shape, kept[1])
            # every source sends a gradient for each needed tensor, zeros where no block read its keys
            dk = k.new_zeros(k.shape) if need[1] and dk is None else dk
            dv = v.new_zeros(v.shape) if need[2] and dv is None else dv
            return [g for g, n in zip((dk, dv), need[1:]) if n]

        run = ring_backward if setup.exchange == "ring" else allgather_backward
        dkv = iter(run(setup, k, v, source_grads))
        dk = next(dkv).to(k.dtype) if need[1] else None
        dv = next(dkv).to(v.dtype) if need[2] else None
        dq = result.get("dq", dq)  # narrowed in place (own_grads), else rounded here
        return None, None if dq is None else dq.to(q.dtype), dk, dv, None


def merged_attention(setup: Setup, q, k, v, mask):
    """This rank's merged (out in the inputs' dtype, or the lse dtype with sinks; lse),
    differentiable through the blocks' backward from the merged output (no mask gradient)."""
    return _MergedAttention.apply(setup, q, k, v, mask)
