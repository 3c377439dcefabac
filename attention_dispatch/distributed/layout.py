"""Which global sequence positions each rank holds, and shard()/unshard() to produce and invert it.

The sequence of length S is cut into equal chunks:

- ``"contiguous"``: W chunks of S / W; rank r holds chunk r.
- ``"zigzag"``: 2W chunks of S / (2W); rank r holds chunks r and 2W - 1 - r, in that order
  (PyTorch's head-tail load balancing, ring-flash-attention's zigzag): under causal attention
  every rank then has the same number of allowed (query, key) pairs.

Pure functions on Python ints except shard()/unshard(), which read the group's rank and size
(unshard() gathers, differentiably).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LAYOUTS = ("zigzag", "contiguous")


class Segment(NamedTuple):
    """A run of consecutive global positions held by one rank: global [start, start + length),
    stored at local [local_start, local_start + length) of that rank's shard."""

    start: int
    length: int
    local_start: int


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not allowed; use one of {', '.join(repr(x) for x in LAYOUTS)}")
    return layout


def chunks_per_rank(layout: str) -> int:
    """How many equal chunks of the sequence one rank holds (its local length is a multiple of it)."""
    return 2 if check_layout(layout) == "zigzag" else 1


def check_divisible(total: int, world: int, layout: str, what: str) -> None:
    """Raise unless a global length ``total`` splits into the layout's equal chunks."""
    parts = world * chunks_per_rank(layout)
    if total % parts:
        raise ValueError(
            f"{what}: sequence length {total} is not divisible by {parts} "
            f"(layout={layout!r} over {world} ranks cuts it into {parts} equal chunks)"
        )


def segments(layout: str, rank: int, world: int, total: int) -> tuple[Segment, ...]:
    """The global positions held by ``rank``, in its shard's order; ``total`` divisible as check_divisible."""
    check_divisible(total, world, layout, "segments()")
    if layout == "contiguous":
        size = total // world
        return (Segment(rank * size, size, 0),)
    size = total // (2 * world)
    return (Segment(rank * size, size, 0), Segment((2 * world - 1 - rank) * size, size, size))


def positions(layout: str, rank: int, world: int, total: int, device=None) -> torch.Tensor:
    """The global positions of ``rank``'s shard as an int64 tensor (local_length,)."""
    parts = [torch.arange(s.start, s.start + s.length, device=device) for s in segments(layout, rank, world, total)]
    return torch.cat(parts)


def shard_of(tensor: torch.Tensor, rank: int, world: int, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of a whole-sequence ``tensor`` along ``dim`` (a view for contiguous,
    a new tensor for zigzag). (B, H, S, D) -> (B, H, S / W, D) with the default dim."""
    check_layout(layout)
    total = tensor.shape[dim]
    check_divisible(total, world, layout, f"shard of a tensor of shape {tuple(tensor.shape)} along dim {dim}")
    parts = [tensor.narrow(dim, s.start, s.length) for s in segments(layout, rank, world, total)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard_from(shards, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's shard (a list in rank order): inverts shard_of."""
    check_layout(layout)
    world = len(shards)
    local = shards[0].shape[dim]
    total = local * world
    check_divisible(total, world, layout, f"unshard of shards of shape {tuple(shards[0].shape)} along dim {dim}")
    pieces = {}
    for rank, piece in enumerate(shards):
        if piece.shape != shards[0].shape:
            raise ValueError(
                f"unshard: rank {rank}'s shard has shape {tuple(piece.shape)}, rank 0's {tuple(shards[0].shape)}"
            )
        for s in segments(layout, rank, world, total):
            pieces[s.start] = piece.narrow(dim, s.local_start, s.length)
    return torch.cat([pieces[start] for start in sorted(pieces)], dim=dim)


def _group_rank_and_size(group) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def shard(tensor: torch.Tensor, group=None, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """This rank's shard of the whole-sequence ``tensor`` (the same on every rank) along ``dim``:
    (B, H, S, D) -> (B, H, S / W, D) with the default dim; packed (S, H, D) inputs use dim=0,
    a bias (B, H, Sq, Sk) is sharded along its query rows (dim=-2, the default). No communication."""
    rank, world = _group_rank_and_size(group)
    return shard_of(tensor, rank, world, layout, dim)


def unshard(tensor: torch.Tensor, group=None, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's shard: all-gathers (differentiably: the gradient of
    each position returns to the rank that holds it) and reorders. Inverts shard()."""
    from .exchange import all_gather_tensors

    rank, world = _group_rank_and_size(group)
    gathered = all_gather_tensors([tensor.contiguous()], group)[0]
    return unshard_from(gathered, layout, dim)
