"""One block of context-parallel attention: this rank's queries at some global positions
against the keys at others, and the arguments of the one ad.sdpa() call that computes exactly
the whole call's attention restricted to that block (or None: nothing allowed, skip it).

Global rule (docs/semantics.md): key j is allowed for query i when
``i + off - left <= j <= i + off + right`` (off = Sk - Sq of the whole sequences when aligned
bottom-right, else 0; -1 unbounded). In a block whose queries start at global ``qs`` and keys at
``ks`` this reads ``lo <= j' - i' <= hi`` in block-local positions, with ``d = qs + off - ks``,
``lo = d - left``, ``hi = d + right``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .layout import Segment


class Band(NamedTuple):
    """The whole call's band in global positions: off the diagonal, left/right -1 = unbounded."""

    off: int
    left: int
    right: int

    @property
    def unbounded(self) -> bool:
        return self.left < 0 and self.right < 0


class BlockBand(NamedTuple):
    """How a block expresses the band: sdpa()'s ``causal``/``window`` arguments, or, where those
    cannot (a band that misses the block's own diagonal), a bool mask of the diagonals lo..hi."""

    causal: str | None
    window: tuple[int, int] | None
    mask_diagonals: tuple[float, float] | None


def plan_band(band: Band, q_start: int, q_len: int, k_start: int, k_len: int) -> BlockBand | None:
    """The band of the block (queries at global q_start.., keys at k_start..); None when the
    block holds no allowed pair (skipped, not computed)."""
    if q_len == 0 or k_len == 0:
        return None
    d = q_start + band.off - k_start
    lo = d - band.left if band.left >= 0 else -math.inf
    hi = d + band.right if band.right >= 0 else math.inf
    first, last = -(q_len - 1), k_len - 1  # the block's diagonals j' - i'
    if hi < first or lo > last:
        return None
    lo_bound, hi_bound = lo > first, hi < last  # sides that cut into the block
    if not lo_bound and not hi_bound:
        return BlockBand(None, None, None)
    # sdpa() without causal aligns a window bottom-right: diagonal k_len - q_len, sides >= 0
    diag = k_len - q_len
    left = int(diag - lo) if lo_bound else -1
    right = int(hi - diag) if hi_bound else -1
    if (not lo_bound or left >= 0) and (not hi_bound or right >= 0):
        if right == 0:  # a causal block: backends run causal faster than a window
            return BlockBand("bottom_right", None if left < 0 else (left, -1), None)
        return BlockBand(None, (left, right), None)
    if hi == 0 and (not lo_bound or lo <= 0):  # top-left causal: diagonal 0
        return BlockBand("top_left", None if not lo_bound else (int(-lo), 0), None)
    return BlockBand(None, None, (lo, hi))


def diagonal_mask(lo: float, hi: float, q_len: int, k_len: int, device) -> torch.Tensor:
    """Bool (q_len, k_len): True where lo <= j - i <= hi."""
    rel = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
    return (rel >= lo) & (rel <= hi)


def span(parts: tuple[Segment, ...]) -> tuple[int, int]:
    """The local [start, stop) of consecutive segments of one shard."""
    return parts[0].local_start, parts[0].local_start + sum(p.length for p in parts)


def global_positions(parts: tuple[Segment, ...]) -> torch.Tensor:
    """The global positions of the segments, int64 on the CPU (small: one block's length)."""
    return torch.cat([torch.arange(p.start, p.start + p.length) for p in parts])


class Documents:
    """Varlen: each global position's document and its position inside it (queries shifted by
    their document's diagonal), built on the CPU from the global offsets."""

    def __init__(self, cu_q: list[int], cu_k: list[int], bottom_right: bool):
        self.doc_q, self.pos_q = self._index(cu_q)
        self.doc_k, self.pos_k = self._index(cu_k)
        if bottom_right:  # each document's own Sk - Sq
            lengths_q = torch.tensor(cu_q[1:]) - torch.tensor(cu_q[:-1])
            lengths_k = torch.tensor(cu_k[1:]) - torch.tensor(cu_k[:-1])
            self.pos_q = self.pos_q + (lengths_k - lengths_q)[self.doc_q]

    @staticmethod
    def _index(cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.tensor(cu[:-1])
        lengths = torch.tensor(cu[1:]) - starts
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        return doc, torch.arange(cu[-1]) - starts[doc]

    def allowed(self, q_global: torch.Tensor, k_global: torch.Tensor, left: int, right: int) -> torch.Tensor:
        """Bool (nq, nk) on the CPU: same document and inside the band."""
        rel = self.pos_k[k_global][None, :] - self.pos_q[q_global][:, None]
        ok = self.doc_q[q_global][:, None] == self.doc_k[k_global][None, :]
        if left >= 0:
            ok &= rel >= -left
        if right >= 0:
            ok &= rel <= right
        return ok

    def distance(self, q_global: torch.Tensor, k_global: torch.Tensor) -> torch.Tensor:
        """|pos_q - pos_k| (nq, nk), ALiBi's distance inside a document."""
        return (self.pos_q[q_global][:, None] - self.pos_k[k_global][None, :]).abs()


def combine_masks(bool_parts, float_parts):
    """One attn_mask from bool parts (all must allow) and float parts (added); None if none.
    Each part broadcasts to (B, H, nq, nk)."""
    allowed = None
    for part in bool_parts:
        allowed = part if allowed is None else allowed & part
    bias = None
    for part in float_parts:
        bias = part if bias is None else bias + part
    if bias is None:
        return allowed
    if allowed is None:
        return bias
    return torch.where(allowed, bias, torch.full((), -math.inf, dtype=bias.dtype, device=bias.device))
