"""KernelParams: everything about one kernel call that is not a tensor (one frozen object)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KernelParams:
    """Everything about one attention call that is not a tensor.

    A key j is allowed for query i when ``j >= i + off - window_left`` (if window_left >= 0)
    and ``j <= i + off + window_right`` (if window_right >= 0), ``off = Sk - Sq`` per
    sequence when ``align_bottom_right`` else 0.  causal top_left == (False, -1, 0);
    causal bottom_right == (True, -1, 0).  ``softcap`` > 0 caps the scaled score:
    ``softcap * tanh(scale * <q, k> / softcap)`` before the bias (0 = off).
    """

    scale: float
    align_bottom_right: bool = False
    window_left: int = -1
    window_right: int = -1
    dropout_p: float = 0.0
    deterministic: bool = False
    softcap: float = 0.0
    # ---- tuning / testing knobs (0 / None = automatic) ----
    block_m: int = 0  # force the query tile of every kernel
    block_n: int = 0  # force the key tile of every kernel
    num_splits: int = 0  # force the dQ key splits (ignored when deterministic)
    max_grid: int = 0  # grid y/z limit for chunking; 0 = MAX_GRID_YZ
    descriptors: int = -1  # TMA tensor-descriptor loads: -1 auto (Hopper+, half, aligned), 0 off, 1 on

    def __post_init__(self):
        if not (0.0 <= self.dropout_p < 1.0):
            raise ValueError(f"dropout_p={self.dropout_p} must be in [0, 1)")
        if self.window_left < -1 or self.window_right < -1:
            raise ValueError(f"window=({self.window_left}, {self.window_right}): -1 or >= 0 expected")
        if not (self.softcap >= 0.0 and math.isfinite(self.softcap)):
            raise ValueError(f"softcap={self.softcap}: a finite float > 0, or 0 (off) expected")
        if self.descriptors not in (-1, 0, 1):
            raise ValueError(f"descriptors={self.descriptors}: -1 (auto), 0 (off) or 1 (on) expected")

    def to_args(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def from_args(cls, args) -> "KernelParams":
        return cls(*args)
