"""The forward pass of context-parallel attention: which blocks a rank computes, each block's
ad.sdpa() call, and the ring / all-gather schedules that bring every rank's keys by.

Shared by every backward mode (api.py): "autograd" runs it with differentiable exchanges and
keeps every block's graph; "recompute" (recompute.py) runs it without a graph and recomputes;
"merged" (merged.py) runs it without a graph and runs each block's backend's backward.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..api import sdpa
from ..debug import last_decision
from ..dispatch import use_backends
from ..dropout_stream import DropoutStream, positioned
from ..features import lse_dtype
from . import exchange as _exchange
from .blocks import Band, BlockBand, Documents, combine_masks, diagonal_mask, global_positions, plan_band, span
from .layout import segments
from .merge import merge_blocks


class Setup:
    """The validated call, in dense form: q (B, Hq, Sq_local, D), k/v (B, Hkv, Sk_local, D), mask
    None or (B|1, Hq|1, Sq_local|1, Sk_total|1); everything a block needs."""

    __slots__ = (
        "q", "k", "v", "mask", "packed", "rank", "world", "group", "layout", "exchange", "backward",
        "sq", "sk", "band", "docs", "slopes", "sinks", "sdpa_args", "return_lse",
        "dropout_p", "dropout_seed", "dropout_backends", "backward_reason", "backward_backends",
    )  # fmt: skip

    band: Band
    docs: Documents | None


FULL = BlockBand(None, None, None)


def _fused_plan(setup: Setup, q_parts, k_parts) -> BlockBand | None:
    """The band of a block of several segments as one sdpa() call, or None where one call
    cannot express it: every segment pair inside the band (no mask), or a rank's own shard
    under plain causal with equal lengths (local order is global order: top-left causal)."""
    band = setup.band
    plans = [plan_band(band, qp.start, qp.length, kp.start, kp.length) for qp in q_parts for kp in k_parts]
    if all(p == FULL for p in plans):
        return FULL
    same = [(p.start, p.length) for p in q_parts] == [(p.start, p.length) for p in k_parts]
    if same and band.off == 0 and band.left < 0 and band.right == 0:
        return BlockBand("top_left", None, None)
    return None


def block_pairs(setup: Setup, source: int):
    """(query parts, key parts) of the blocks of this rank's queries against ``source``'s keys.
    Without a bounded band (or dropout, drawn at one row and column offset per block) a rank's
    whole shard is one part. A bounded band is planned per segment pair (those outside it are
    skipped), then the pairs inside it fused into one call where one call expresses them
    (zigzag causal: one call per ring step instead of up to 4)."""
    q_segs = segments(setup.layout, setup.rank, setup.world, setup.sq)
    k_segs = segments(setup.layout, source, setup.world, setup.sk)
    if setup.band.unbounded and setup.dropout_p == 0:
        return [(q_segs, k_segs)]
    pairs = [((qp,), (kp,)) for qp in q_segs for kp in k_segs]
    if setup.docs is None and setup.dropout_p == 0 and not setup.band.unbounded:
        live = [(qp, kp) for (qp,), (kp,) in pairs if plan_band(setup.band, qp.start, qp.length, kp.start, kp.length)]
        if len(live) > 1:
            qs = tuple(x for x in q_segs if any(qp == x for qp, _ in live))
            ks = tuple(x for x in k_segs if any(kp == x for _, kp in live))
            if _fused_plan(setup, qs, ks) is not None:
                return [(qs, ks)]
    return pairs


def block(setup: Setup, q_parts, k_parts, q, k, v, mask):
    """(out (B, Hq, nq, Dv), lse (B, Hq, nq)) of the queries of q at q_parts against the keys
    k/v (one rank's shard) at k_parts, or None when the block holds no allowed pair."""
    q0, q1 = span(q_parts)
    k0, k1 = span(k_parts)
    return block_of_slices(setup, q_parts, k_parts, q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], mask)


def _whole_rows(t):
    """t, or a contiguous copy where it is a slice of a shard's rows in neither (B, H, S, D) nor
    (B, S, H, D) memory (a part of S with H > 1): the triton backend's Gluon forward reads
    whole-row layouts by TMA only and runs such a view on its slower tl kernels (2 H100s, 128k:
    that block's forward took 32.3 ms against 27.7 for the same work contiguous). The copy is
    one read and write of the slice. (Its backward passes read a query or dO slice where it
    lies: kernels.shapes.seq_rows.)"""
    if t.dim() != 4 or t.is_contiguous() or t.transpose(1, 2).is_contiguous():
        return t
    return t.contiguous()


def block_args(setup: Setup, q_parts, k_parts, q, k, v, mask, q_strided: bool = False):
    """The ad.sdpa() arguments of block (q_parts x k_parts) of the already sliced q (the rows of
    q_parts) and k/v (the keys of k_parts) -- (q, k, v, attn_mask, causal, window, scope), the
    scope (enter it around the call) drawing the block's dropout -- or None when the block holds
    no allowed pair. mask: this rank's whole mask (rows and columns are picked here).
    ``q_strided``: q as it is, not _whole_rows (a backward's: its passes read q where it lies)."""
    device, compute = q.device, lse_dtype(q.dtype)
    q, k, v = q if q_strided else _whole_rows(q), _whole_rows(k), _whole_rows(v)
    q_pos, k_pos = global_positions(q_parts), global_positions(k_parts)
    bool_parts, float_parts, causal, window = [], [], None, None
    if setup.docs is not None:  # packed documents: the mask says everything (built on the CPU: no sync)
        allowed = setup.docs.allowed(q_pos, k_pos, setup.band.left, setup.band.right)
        if not bool(allowed.any()):
            return None
        if not bool(allowed.all()):
            bool_parts.append(allowed.to(device))
    elif not setup.band.unbounded:
        if len(q_parts) == 1 and len(k_parts) == 1:
            (qp,), (kp,) = q_parts, k_parts
            plan = plan_band(setup.band, qp.start, qp.length, kp.start, kp.length)
        else:  # fused by block_pairs
            plan = _fused_plan(setup, q_parts, k_parts)
        if plan is None:
            return None
        causal, window = plan.causal, plan.window
        if plan.mask_diagonals is not None:
            bool_parts.append(diagonal_mask(*plan.mask_diagonals, q.shape[2], k.shape[2], device))
    q0, q1 = span(q_parts)
    if mask is not None:
        rows = mask[..., q0:q1, :] if mask.shape[-2] > 1 else mask
        if rows.shape[-1] > 1:  # the columns of these keys, in global order
            cols = [rows[..., p.start : p.start + p.length] for p in k_parts]
            rows = cols[0] if len(cols) == 1 else torch.cat(cols, dim=-1)
        (bool_parts if rows.dtype == torch.bool else float_parts).append(rows)
    if setup.slopes is not None:  # ALiBi by global distance, as a bias: -slope * |i + off - j|
        if setup.docs is None:
            slopes = setup.slopes[:, :, None, None]
            distance = (q_pos[:, None] + setup.band.off - k_pos[None, :]).abs()
        else:
            slopes = setup.slopes[setup.docs.doc_q[q_pos]].T[None, :, :, None]
            distance = setup.docs.distance(q_pos, k_pos)
        float_parts.append(-(slopes.to(compute) * distance.to(device=device, dtype=compute)))
    scope = contextlib.ExitStack()
    if setup.dropout_p > 0:  # this block's part of the whole call's keep-mask (one segment pair)
        (qp,), (kp,) = q_parts, k_parts
        scope.enter_context(use_backends(*setup.dropout_backends))
        scope.enter_context(positioned(DropoutStream(setup.dropout_seed, 0, qp.start, kp.start, setup.sq, setup.sk)))
    return q, k, v, combine_masks(bool_parts, float_parts), causal, window, scope


def block_of_slices(setup: Setup, q_parts, k_parts, q, k, v, mask):
    """block() of the already sliced q (the rows of q_parts) and k/v (the keys of k_parts);
    mask: this rank's whole mask (rows and columns are picked here)."""
    args = block_args(setup, q_parts, k_parts, q, k, v, mask)
    if args is None:
        return None
    q, k, v, attn_mask, causal, window, scope = args
    with scope:
        return sdpa(
            q, k, v, attn_mask, setup.dropout_p, causal=causal, window=window, return_lse=True, **setup.sdpa_args
        )


class Accumulator:
    """Every block's partial result, and which exchanged tensors no block read. Blocks may
    cover different rows (fused blocks): they are merged per segment of this rank's rows."""

    def __init__(self, setup: Setup, q, mask):
        self.setup, self.q, self.mask = setup, q, mask
        self.blocks = []  # (q_parts, out, lse)
        self.served = {}  # (source, q_parts, k_parts) -> the Decision of the block's sdpa() call
        self.unused = []

    def add(self, source: int, k, v, exchanged: bool) -> None:
        used = False
        for q_parts, k_parts in block_pairs(self.setup, source):
            result = block(self.setup, q_parts, k_parts, self.q, k, v, self.mask)
            if result is not None:
                self.blocks.append((q_parts, *result))
                self.served[source, q_parts, k_parts] = last_decision()
                used = True
        if exchanged and not used:
            self.unused += [k, v]

    def result(self, out_dtype=None):
        """(out (B, Hq, Sq_local, Dv) in out_dtype (default: the lse dtype), lse (B, Hq, Sq_local)
        in the lse dtype)."""
        compute = lse_dtype(self.q.dtype)
        if not self.blocks:  # no allowed key for any row: 0 and -inf
            b, hq, sq = self.q.shape[:3]
            out = self.q.new_zeros((b, hq, sq, self.setup.v.shape[-1]), dtype=out_dtype or compute)
            return out, self.q.new_full((b, hq, sq), -math.inf, dtype=compute)
        parts = [(span(q_parts)[0], out, lse) for q_parts, out, lse in self.blocks]
        return merge_blocks(parts, self.q.shape[2], out_dtype)


def run_ring(setup: Setup, acc: Accumulator, k, v, differentiable: bool) -> None:
    """W steps; at step t this rank holds the keys of rank - t, while those of rank - t - 1 arrive."""
    shift = _exchange.ring_shift if differentiable else _exchange.start_shift
    for step in range(setup.world):
        pending = None
        if step < setup.world - 1:
            (next_k, next_v), pending = shift([k, v], setup.group, setup.rank, setup.world)
        # the last received keys feed no further shift: kept in the graph only if a block reads them
        acc.add((setup.rank - step) % setup.world, k, v, exchanged=step == setup.world - 1 and step > 0)
        if pending is not None:
            pending.wait()
            k, v = next_k, next_v


def run_allgather(setup: Setup, acc: Accumulator, k, v, differentiable: bool) -> None:
    """All-gather every rank's keys, computing the local block while they travel."""
    if setup.world == 1:
        acc.add(setup.rank, k, v, exchanged=False)
        return
    pending = _exchange.Pending()
    gather = _exchange.all_gather_tensors if differentiable else _exchange.start_all_gather
    gathered_k, gathered_v = gather([k, v], setup.group, pending)
    acc.add(setup.rank, k, v, exchanged=False)
    pending.wait()
    acc.unused += [gathered_k[setup.rank], gathered_v[setup.rank]]  # the local block read the originals
    for source in range(setup.world):
        if source != setup.rank:
            acc.add(source, gathered_k[source], gathered_v[source], exchanged=True)


def run_forward(setup: Setup, q, k, v, mask, differentiable: bool, out_dtype=None, served=None):
    """This rank's merged (out in out_dtype, default the lse dtype; lse), and the tensors no
    block read (to be tied to the output: exchanged ones, and the inputs where no block ran).
    ``served``: a dict to fill with each computed block's Decision (Accumulator.served)."""
    acc = Accumulator(setup, q, mask)
    (run_ring if setup.exchange == "ring" else run_allgather)(setup, acc, k, v, differentiable)
    out, lse = acc.result(out_dtype)
    if served is not None:
        served.update(acc.served)
    if not acc.blocks:  # no block read q, k, v or the mask: they get zero gradients, not none
        acc.unused += [q, k, v, mask]
    return out, lse, acc.unused
