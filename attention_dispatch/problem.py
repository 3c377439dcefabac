"""Problem: a frozen, hashable description of one sdpa() call, holding no tensor."""

from __future__ import annotations

import dataclasses
import functools

import torch

from .semantics import CausalKind


@functools.lru_cache(maxsize=None)
def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None elsewhere; cached since it never changes."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """Everything a backend needs to decide whether it can compute a call.

    Shapes are canonical: batch, heads and sequence lengths as in (B, H, S, D); for
    varlen inputs seqlen_q/k are the maximum sequence lengths and batch the number of
    sequences.
    """

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim_qk: int
    head_dim_v: int
    dtype: torch.dtype
    device_type: str
    compute_capability: tuple[int, int] | None
    layout: str  # "dense" | "varlen"
    mask_kind: str  # "none" | "bool" | "float"
    mask_shape: tuple[int, ...] | None  # the mask's own 4-D shape (1 on broadcast dims)
    mask_requires_grad: bool
    causal: CausalKind | None
    window: tuple[int, int] | None
    dropout: bool
    requires_grad: bool
    deterministic: bool
    deterministic_warn_only: bool
    last_dim_contiguous: bool
    aligned_16: bool  # data pointers and non-unit strides allow 16-byte vector loads
    # varlen whose cu_seqlens_q and cu_seqlens_k are one tensor: every sequence has as many
    # queries as keys, so top-left and bottom-right causal coincide (packed self-attention)
    same_offsets: bool = False
    # a float32 bias with float16/bfloat16 inputs: added at float32, as F.sdpa does
    float32_bias: bool = False

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv if self.heads_kv else 1

    @property
    def sequences_match(self) -> bool:
        """True when top-left and bottom-right causal are the same function: dense with
        Sq == Sk, or varlen whose query and key offsets are the same tensor."""
        if self.layout == "varlen":
            return self.same_offsets
        return self.seqlen_q == self.seqlen_k

    def summary(self) -> str:
        """One readable line, used in errors and decision tables."""
        parts = [
            f"{self.layout} B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} "
            f"Sq={self.seqlen_q} Sk={self.seqlen_k} Dqk={self.head_dim_qk} Dv={self.head_dim_v}",
            f"{str(self.dtype).removeprefix('torch.')} on {self.device_type}"
            + (f" sm{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else ""),
        ]
        if self.mask_kind != "none":
            parts.append(
                f"{'float32' if self.float32_bias else self.mask_kind} mask {self.mask_shape}"
                + (" (grad)" if self.mask_requires_grad else "")
            )
        if self.causal is not None:
            parts.append(f"causal={self.causal}")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.dropout:
            parts.append("dropout")
        if self.requires_grad:
            parts.append("grad")
        if self.deterministic:
            parts.append("deterministic" + (" (warn only)" if self.deterministic_warn_only else ""))
        return ", ".join(parts)


def _aligned_16(t: torch.Tensor, tracing: bool = False) -> bool:
    """16-byte aligned start and strides. While tracing (torch.compile: no data pointer),
    only the strides count."""
    elem = t.dtype.itemsize
    if not tracing and t.data_ptr() % 16:
        return False
    for stride in t.stride()[:-1]:
        if (stride * elem) % 16:
            return False
    return True
