"""One buffer for a rank's dq and its own keys' gradients (the 2-rank merged backward, merged.py):
a float32 dq accumulator over 16-bit inputs is twice the bytes of the 16-bit dq. Its front half
first receives the first block's 16-bit dq, widened in place to the accumulator; after the last
block it is narrowed in place back to the 16-bit dq, and the back half, free then, takes the own
keys' gradients. The accumulator, the own keys' gradients and the received ones are then never
alive together (the step's peak: 5 -> 4 local query shards with the output, issue 40).

In-place casts go chunk by chunk so that no chunk's writes reach bytes not yet read: narrowing
from the front (chunk [a, 2a) writes bytes [2a, 4a) of [4a, 8a)), widening from the back (the
mirror); only the first chunk (1/64 of the elements) goes through a temporary.
"""

from __future__ import annotations

import torch

_FIRST = 64  # the first chunk: 1/64 of the elements (a temporary of that size)


def halves(q: torch.Tensor, dtype: torch.dtype) -> bool:
    """The buffer's scheme applies: q contiguous and ``dtype`` (the accumulator's) twice its bytes."""
    return q.is_contiguous() and torch.empty((), dtype=dtype).element_size() == 2 * q.element_size()


def new(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The accumulator (q's shape, contiguous, ``dtype``), not zeroed: widen() fills it."""
    return torch.empty(q.shape, dtype=dtype, device=q.device)


def front(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The front half of acc's memory as a contiguous tensor of acc's shape in ``dtype``."""
    return acc.view(-1).view(dtype)[: acc.numel()].view(acc.shape)


def widen(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """acc (its front half holding front(acc, dtype)'s values) holding them in its own dtype."""
    n = acc.numel()
    wide, narrow = acc.view(-1), acc.view(-1).view(dtype)[:n]
    b = n
    while b > max(n // _FIRST, 1):
        a = (b + 1) // 2  # writes bytes [4a, 4b) of wide, reads [2a, 2b) of narrow: 2b <= 4a
        wide[a:b].copy_(narrow[a:b])
        b = a
    wide[:b].copy_(narrow[:b].clone())
    return acc


def narrow(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """acc's values in ``dtype``, written in place into the front half of its memory (returned)."""
    n = acc.numel()
    wide, out = acc.view(-1), acc.view(-1).view(dtype)[:n]
    a = max(n // _FIRST, 1)
    out[:a].copy_(wide[:a].to(dtype))
    while a < n:
        b = min(2 * a, n)  # writes bytes [2a, 2b) of out, reads [4a, 4b) of wide: 2b <= 4a
        out[a:b].copy_(wide[a:b])
        a = b
    return out.view(acc.shape)


def back_views(acc: torch.Tensor, dtype: torch.dtype, *like: torch.Tensor) -> list[torch.Tensor | None]:
    """Contiguous tensors shaped as each of ``like`` (in ``dtype``) in the back half of acc's
    memory (free once narrow() ran), one after another; None for those that do not fit."""
    n = acc.numel()
    spare = acc.view(-1).view(dtype)[n:]
    views, at = [], 0
    for t in like:
        fits = t.dtype == dtype and at + t.numel() <= n
        views.append(spare[at : at + t.numel()].view(t.shape) if fits else None)
        at += t.numel() if fits else 0
    return views
