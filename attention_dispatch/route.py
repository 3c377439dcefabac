"""Route: which implementation a backend runs inside, and why not a faster one.

A backend with several implementations (our kernel's tl and Gluon paths, flash-attn 2/3/4,
PyTorch's ATen ops) says through ``Backend.route`` which one a call takes; ``explain()`` puts
it in the Decision.  Kernels never import this: they return (chosen, reason) pairs that the
backend turns into a Route.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RouteStep:
    """One choice: ``part`` of the call (e.g. "forward", "dQ") runs ``chosen`` (e.g.
    "gluon"); ``passed_over``: (faster route not taken, why) pairs."""

    part: str
    chosen: str
    passed_over: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.chosen} {self.part}"


@dataclasses.dataclass(frozen=True)
class Route:
    """The implementation choices of one call inside its backend, in the order they run."""

    steps: tuple[RouteStep, ...]
    note: str = ""  # e.g. an assumption the route was worked out under

    def __str__(self) -> str:
        return ", ".join(str(s) for s in self.steps)

    def lines(self) -> list[str]:
        """One line per step, with why each faster route was not taken (for Decision's table)."""
        out = []
        for s in self.steps:
            why = "; ".join(f"not {alt}: {reason}" for alt, reason in s.passed_over)
            out.append(f"{s} ({why})" if why else str(s))
        if self.note:
            out.append(f"({self.note})")
        return out
