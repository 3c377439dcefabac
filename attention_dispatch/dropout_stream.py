"""Dropout's keep-mask as a function of position: the Philox4x32-7 stream of the tl kernels
(kernels/tl/common.py) in plain PyTorch, and a scoped offset into it.

Element (b, h, i, j) of a call with ``seed`` is kept when lane ``j % 4`` of the Philox4x32-7
draw at counter ``((b * Hq + h) * Sq + i) * ceil(Sk / 4) + j // 4`` (key ``seed``), as a
uniform float32, is ``>= p``; Sq, Sk are the whole call's lengths (varlen: the max lengths,
b the sequence). Being counter-based, any block of the mask can be drawn on its own:
``positioned(stream)`` makes a backend that declares ``Capabilities.dropout_positions`` draw
the mask of its call as that block of a larger call (context parallelism's blocks).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # triton.language.random's Philox4x32 constants
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 7  # kernels/tl/common.py PHILOX_ROUNDS
_UNIFORM_SCALE = 4.6566127342e-10  # triton's uint_to_uniform_float for 32-bit draws


def draw_seed(device, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dropout seed: one int64 drawn from the device's torch generator (no host sync),
    into ``out`` (an int64 (1,) view) when given."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64, out=out)


class DropoutStream(NamedTuple):
    """Where a call's keep-mask sits in a larger call's: its (b, i, j) are that call's
    (batch_offset + b, row_offset + i, col_offset + j), of lengths seqlen_q x seqlen_k."""

    seed: torch.Tensor  # int64 (1,)
    batch_offset: int
    row_offset: int
    col_offset: int
    seqlen_q: int
    seqlen_k: int


_STREAM: contextvars.ContextVar[DropoutStream | None] = contextvars.ContextVar(
    "attention_dispatch_dropout_stream", default=None
)


@contextlib.contextmanager
def positioned(stream: DropoutStream):
    """Within the block, a dropout call draws its keep-mask at ``stream``'s position (only
    backends declaring Capabilities.dropout_positions read it: select those)."""
    token = _STREAM.set(stream)
    try:
        yield
    finally:
        _STREAM.reset(token)


def current() -> DropoutStream | None:
    return _STREAM.get()


def _mulhilo(a: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of a * c for a 32-bit constant a and int64 c in [0, 2^32), without
    overflowing int64: c in 16-bit halves."""
    lo16, hi16 = c & 0xFFFF, c >> 16
    p_lo, p_hi = lo16 * a, hi16 * a  # < 2^48 each
    low = (p_lo + ((p_hi & 0xFFFF) << 16)) & _M32
    high = (p_hi + (p_lo >> 16)) >> 16
    return high, low


def philox4x32(seed: torch.Tensor, counter: torch.Tensor, rounds: int = ROUNDS):
    """triton's tl.randint4x(seed, counter, rounds) for int64 counters: four uint32 draws as
    int64 tensors of counter's shape."""
    seed = seed.reshape(()).to(torch.int64)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1 = counter & _M32, (counter >> 32) & _M32
    c2 = c3 = torch.zeros_like(counter)
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def _uniform(x: torch.Tensor) -> torch.Tensor:
    """triton's uint_to_uniform_float of a 32-bit draw: float32 in [0, 1)."""
    x = torch.where(x >= 2**31, _M32 - x, x)  # bitcast to int32, then ~x where negative
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=x.device)


def keep_mask(
    stream: DropoutStream, dropout_p: float, bh: torch.Tensor, heads_q: int, rows: int, row0: int, cols: int
) -> torch.Tensor:
    """Bool keep-mask (*bh.shape, rows, cols) of the call's queries row0 .. row0 + rows - 1 and
    keys 0 .. cols - 1 (local), ``bh`` the local b * heads_q + h of each (batch, head)."""
    device = bh.device
    heads = bh + stream.batch_offset * heads_q
    per_row = (stream.seqlen_k + 3) // 4
    first = stream.col_offset // 4
    count = (stream.col_offset + cols - 1) // 4 - first + 1 if cols else 0
    i = torch.arange(row0, row0 + rows, device=device, dtype=torch.int64) + stream.row_offset
    row_base = (heads.to(torch.int64)[..., None] * stream.seqlen_q + i) * per_row + first
    counter = row_base[..., None] + torch.arange(count, device=device, dtype=torch.int64)
    lanes = torch.stack(philox4x32(stream.seed.to(device), counter), dim=-1)  # key j: lane j % 4
    start = stream.col_offset - 4 * first
    draws = lanes.flatten(-2)[..., start : start + cols]
    return _uniform(draws) >= torch.tensor(dropout_p, dtype=torch.float32, device=device)
