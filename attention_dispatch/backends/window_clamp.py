"""flash-attn 2/3's window convention, shared by the adapters whose kernels follow it (flash-attn 2 and
3 themselves, xformers' half-precision operator on PyTorch's copy of flash-attn 2).

Their ``set_params_fprop`` makes a window side >= Sk unbounded, then an unbounded side beside a
bounded one Sk (flash-attn 3: each side at most Sk, both at Sk meaning no window: the same). The left
side loses nothing by that (no row needs more than Sk - 1 to its left), but the right side, aligned
bottom-right, needs up to Sq - 1: the first rows of a call with Sq > Sk + 1 can lose keys, or gain them."""

from __future__ import annotations

import math

from ..semantics import band


def right_bound_cut(sq: int, sk: int, causal, window, library: str = "flash-attn 2/3") -> str:
    """Why ``library`` (flash-attn 2/3's convention) would compute another band than (causal, window) for a
    dense (Sq, Sk) call (for varlen the longest lengths; for a KV cache Sk is its capacity), "" when it
    computes it exactly."""
    if window is None:
        return ""
    bottom_right, left, right = band(causal, window)
    intended = math.inf if right < 0 else right
    bounded_left = 0 <= left < sk
    if right < 0 or right >= sk:
        taken = sk if bounded_left else math.inf
    else:
        taken = right
    # row 0 (the most keys to its right) is the only one a right bound >= Sq - 1 leaves whole
    if not bottom_right or taken == intended or min(taken, intended) >= sq - 1:
        return ""
    side = "unbounded" if taken == math.inf else f"Sk={sk}"
    return (
        f"window={tuple(window)} with Sq={sq}, Sk={sk}: {library} takes its right side as {side}, "
        f"which {'drops keys of' if taken < intended else 'adds keys to'} the first rows"
    )


__all__ = ["right_bound_cut"]
