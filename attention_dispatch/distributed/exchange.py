"""Moving key/value shards between ranks, differentiably: the ring (one batch_isend_irecv
shift per step) and the all-gather; plus the group checks and the one-time metadata exchange.

Every exchange is an autograd Function whose backward sends the gradients back the way the
tensors came, so the autograd graph of context_parallel_sdpa spans the ranks. Forward
communication is asynchronous (``Pending``): the caller computes on the blocks it already has
and waits only before reading what it receives. Backward communication is synchronous.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ..higher_order import refuse_create_graph

# Which device types a backend can move when the group does not say (older torch).
_BACKEND_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu", "cuda"), "xccl": ("xpu",)}


def check_group(group, device: torch.device):
    """The group's (rank, world size); raise before any communication when torch.distributed is
    not initialised or the group's backend cannot move tensors on ``device``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context_parallel_sdpa needs torch.distributed: call torch.distributed.init_process_group "
            "first (nccl for CUDA tensors, gloo for CPU tensors)"
        )
    pg = dist.group.WORLD if group is None else group
    if dist.get_rank(pg) < 0:
        raise ValueError("group: this process is not a member of the group it passed")
    types = getattr(pg, "_device_types", None)
    backend = dist.get_backend(pg)
    allowed = (
        tuple(t.type for t in types) if types else _BACKEND_DEVICES.get(str(backend).split(":")[-1], (device.type,))
    )
    if device.type not in allowed:
        raise ValueError(
            f"group: its backend {backend!r} cannot send {device.type} tensors (the query is on {device}); "
            f"it moves {', '.join(allowed)} tensors: use nccl for CUDA tensors, gloo for CPU tensors"
        )
    return dist.get_rank(pg), dist.get_world_size(pg)


def fingerprint(value) -> int:
    """A 31-bit checksum of a value's repr, equal across processes (Python's hash() is salted)."""
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


def gather_facts(facts: dict[str, tuple[int, ...]], group, device: torch.device) -> list[dict]:
    """Every rank's ``facts`` (name -> tuple of ints, the same names and lengths on every rank):
    one small all_gather, the only communication before the checks that need all ranks."""
    flat = [v for values in facts.values() for v in values]
    world = dist.get_world_size(group)
    mine = torch.tensor(flat, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    result = []
    for row in every:
        values, i = {}, 0
        row = row.tolist()
        for name, own in facts.items():
            values[name] = tuple(row[i : i + len(own)])
            i += len(own)
        result.append(values)
    return result


def broadcast_seed(seed: torch.Tensor, group) -> torch.Tensor:
    """Group rank 0's ``seed`` on every rank (in place; asynchronous on GPUs, no host sync)."""
    dist.broadcast(seed, _global(group, 0), group=group)
    return seed


class Pending:
    """Asynchronous communication in flight; wait() before reading what it receives."""

    def __init__(self):
        self.works = []
        self.keep = []  # send buffers: they must live until the works complete

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        self.keep = []


def _global(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _shift(tensors, group, send_to: int, recv_from: int):
    """Start sending ``tensors`` to group rank ``send_to`` and receiving as many from
    ``recv_from``; returns (received buffers, works)."""
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, _global(group, send_to), group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, _global(group, recv_from), group) for r in received]
    return received, dist.batch_isend_irecv(ops)


class _RingShift(torch.autograd.Function):
    """Forward: send the tensors to the next rank, receive the previous rank's (asynchronously:
    the outputs are filled once ``pending`` is waited on). Backward: the gradients of what was
    received go back to the previous rank; those of what was sent come from the next rank."""

    @staticmethod
    def forward(ctx, group, rank, world, pending, *tensors):
        ctx.group, ctx.rank, ctx.world = group, rank, world
        sends = [t.contiguous() for t in tensors]
        received, works = _shift(sends, group, (rank + 1) % world, (rank - 1) % world)
        pending.works.extend(works)
        pending.keep.extend(sends)
        return tuple(received)

    @staticmethod
    def backward(ctx, *grads):
        refuse_create_graph("the context-parallel ring shift")
        grads = [g.contiguous() for g in grads]
        back, works = _shift(grads, ctx.group, (ctx.rank - 1) % ctx.world, (ctx.rank + 1) % ctx.world)
        for work in works:
            work.wait()
        return (None, None, None, None, *back)


def start_shift(tensors, group, rank: int, world: int, backwards: bool = False) -> tuple[list[torch.Tensor], Pending]:
    """ring_shift without autograd (``backwards``: to rank - 1, from rank + 1)."""
    step = -1 if backwards else 1
    pending = Pending()
    sends = [t.contiguous() for t in tensors]
    received, works = _shift(sends, group, (rank + step) % world, (rank - step) % world)
    pending.works.extend(works)
    pending.keep.extend(sends)
    return received, pending


def swap_add(into, sends, group, rank: int, world: int, pieces: int = 4) -> None:
    """Two ranks: ``into[i] +=`` the other rank's ``sends[i]`` (shaped as ``into[i]``) while
    ``sends`` go to it, ``pieces`` pieces per tensor one after the other, each received into the
    memory of the piece sent before it (the first into a new one): one piece's buffer more instead
    of a copy of ``sends``, which are overwritten. Pieces by element count alone: both ranks cut
    alike, whatever the strides. 4 pieces: the one piece's buffer is the merged backward's peak
    over its other buffers (a quarter of a key shard); each piece more is one blocking round more."""
    whole = [t if t.is_contiguous() else t.contiguous() for t in into]
    sends = [t.contiguous() for t in sends]
    peer = _global(group, (rank + 1) % world)
    chunks = [(a, b) for t, s in zip(whole, sends) for a, b in zip(t.view(-1).chunk(pieces), s.view(-1).chunk(pieces))]
    sent = None  # the piece sent last: its memory is free once its send completed
    for own, send in chunks:  # the other rank's piece is shaped as this rank's (its sends: these keys')
        n = own.numel()
        recv = sent[:n] if sent is not None and sent.numel() >= n else torch.empty_like(own)
        ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        own.add_(recv)
        sent = send
    for t, w in zip(into, whole):
        if w is not t:
            t.copy_(w)


def start_all_gather(tensors, group, pending: Pending) -> list[list[torch.Tensor]]:
    """all_gather_tensors without autograd, asynchronous: read after ``pending.wait()``."""
    world = dist.get_world_size(group)
    result = []
    for t in tensors:
        send = t.contiguous()
        parts = [torch.empty_like(send) for _ in range(world)]
        pending.works.append(dist.all_gather(parts, send, group=group, async_op=True))
        pending.keep.append(send)
        result.append(parts)
    return result


def reduce_scatter_sum(grads_by_rank, group) -> torch.Tensor:
    """The sum over ranks of each rank's ``grads_by_rank[this rank]`` (entry r: for rank r)."""
    return _reduce_scatter(grads_by_rank, group, dist.get_world_size(group))


def ring_shift(tensors, group, rank: int, world: int) -> tuple[list[torch.Tensor], Pending]:
    """Start one ring step: ``tensors`` go to rank + 1, the returned ones come from rank - 1
    (differentiable); read them only after ``pending.wait()``."""
    pending = Pending()
    received = _RingShift.apply(group, rank, world, pending, *tensors)
    return list(received), pending


def _reduce_scatter(grads_by_rank, group, world: int) -> torch.Tensor:
    """Sum over ranks of each rank's gradient for this rank's tensor (grads_by_rank: W tensors,
    entry r the gradient for rank r's tensor)."""
    grads_by_rank = [g.contiguous() for g in grads_by_rank]
    if str(dist.get_backend(group)).endswith("nccl"):
        out = torch.empty_like(grads_by_rank[0])
        dist.reduce_scatter(out, grads_by_rank, group=group)
        return out
    # gloo has no reduce_scatter: all_to_all then a local sum, as torch.distributed.nn does
    received = [torch.empty_like(g) for g in grads_by_rank]
    dist.all_to_all(received, grads_by_rank, group=group)
    return torch.stack(received).sum(0)


class _AllGather(torch.autograd.Function):
    """Forward: every rank's tensors (asynchronously: read after ``pending.wait()``), as
    n_tensors x world outputs, tensor-major. Backward: each rank's gradient for a gathered
    tensor is summed on the rank that owns it."""

    @staticmethod
    def forward(ctx, group, world, pending, *tensors):
        ctx.group, ctx.world, ctx.n = group, world, len(tensors)
        outs = []
        sends = [t.contiguous() for t in tensors]
        for t in sends:
            parts = [torch.empty_like(t) for _ in range(world)]
            pending.works.append(dist.all_gather(parts, t, group=group, async_op=True))
            outs.extend(parts)
        pending.keep.extend(sends)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        refuse_create_graph("the context-parallel all-gather")
        w = ctx.world
        own = [_reduce_scatter(grads[i * w : (i + 1) * w], ctx.group, w) for i in range(ctx.n)]
        return (None, None, None, *own)


def all_gather_tensors(tensors, group, pending: Pending | None = None) -> list[list[torch.Tensor]]:
    """Every rank's copy of each of ``tensors`` (same shapes on every rank): result[i][r] is
    rank r's tensors[i]; differentiable. With ``pending`` the gather runs asynchronously (wait
    on it before reading); without, it has completed on return."""
    world = dist.get_world_size(group)
    own_pending = pending is None
    pending = Pending() if own_pending else pending
    outs = _AllGather.apply(group, world, pending, *tensors)
    if own_pending:
        pending.wait()
    return [list(outs[i * world : (i + 1) * world]) for i in range(len(tensors))]


class _Anchor(torch.autograd.Function):
    """Returns ``out`` unchanged; the other inputs get zero gradients. Keeps every exchanged
    tensor in the backward graph, so that every rank runs every exchange's backward (its
    communication) even where a rank used none of a step's keys."""

    @staticmethod
    def forward(ctx, out, *others):
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad, *_):  # grad passes through with its graph: right under create_graph too
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


def anchor(out: torch.Tensor, others) -> torch.Tensor:
    """``out``, with the tensors of ``others`` that require grad attached to its graph."""
    others = [o for o in others if o is not None and o.requires_grad]
    if not others or not torch.is_grad_enabled():
        return out
    return _Anchor.apply(out, *others)
