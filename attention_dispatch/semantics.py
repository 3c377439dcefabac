"""The meaning of one call (DESIGN.md section 3): causal alignment and the sliding window.

Everything here is pure Python on small values; no tensor is touched.
"""

from __future__ import annotations

import enum


class CausalKind(str, enum.Enum):
    """Where the causal diagonal sits when Sq != Sk.

    TOP_LEFT (PyTorch's ``is_causal=True``): key j allowed for query i when j <= i.
    BOTTOM_RIGHT (flash-attn, xformers' FromBottomRight): j <= i + (Sk - Sq).
    """

    TOP_LEFT = "top_left"
    BOTTOM_RIGHT = "bottom_right"

    def __str__(self) -> str:  # reasons read "causal=top_left", not "CausalKind.TOP_LEFT"
        return self.value


def normalize_causal(is_causal: bool, causal) -> CausalKind | None:
    """Merge PyTorch's ``is_causal`` with our ``causal=`` into one CausalKind (or None)."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    kind: CausalKind | None
    if causal is None or causal is False:
        kind = None
    elif causal is True:
        kind = CausalKind.TOP_LEFT
    elif isinstance(causal, CausalKind):
        kind = causal
    elif isinstance(causal, str):
        try:
            kind = CausalKind(causal)
        except ValueError:
            raise ValueError(
                f"causal={causal!r} is not allowed; use None, 'top_left', 'bottom_right' or True (= 'top_left')"
            ) from None
    else:
        raise TypeError(
            f"causal must be None, 'top_left', 'bottom_right', a CausalKind or a bool "
            f"(True = 'top_left'), got {type(causal).__name__}"
        )
    if is_causal:
        if kind is CausalKind.BOTTOM_RIGHT:
            raise ValueError(
                "is_causal=True means causal='top_left' but causal='bottom_right' was given; pass only one of them"
            )
        kind = CausalKind.TOP_LEFT
    return kind


def normalize_window(window) -> tuple[int, int] | None:
    """(left, right) with -1 = unbounded; (-1, -1) and None both mean no window."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a (left, right) pair of ints, got {window!r}")
    left, right = window
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"window {side} must be an int, got {type(value).__name__} ({value!r})")
        if value < -1:
            raise ValueError(f"window {side}={value} is negative; allowed: >= 0, or -1 for unbounded")
    if left == -1 and right == -1:
        return None
    return (int(left), int(right))


def band(causal: CausalKind | None, window: tuple[int, int] | None) -> tuple[bool, int, int]:
    """Fold causal + window into (align_bottom_right, left, right), -1 = unbounded.

    Key j is allowed for query i when i + off - left <= j <= i + off + right, with
    off = Sk - Sq when align_bottom_right else 0. Causal is right = 0; a window without
    causal is aligned bottom-right, as in flash-attn.
    """
    bottom_right = causal is not CausalKind.TOP_LEFT
    left, right = window if window is not None else (-1, -1)
    if causal is not None:
        right = 0
    return bottom_right, left, right
