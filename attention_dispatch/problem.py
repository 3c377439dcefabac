"""Problem: a frozen, hashable description of one sdpa() or sdpa_with_kvcache() call, holding no tensor."""

from __future__ import annotations

import dataclasses
import functools

import torch

from .semantics import CausalKind


KV_LAYOUTS = frozenset({"kvcache", "paged"})  # the layouts of sdpa_with_kvcache()


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
    sequences.  For sdpa_with_kvcache() (layout "kvcache": a dense cache, "paged": a block
    table) seqlen_q is the new queries per sequence and seqlen_k the cache's capacity (dense
    S_cache, paged max_blocks * block_size), never the per-sequence lengths, which live on the
    device: every step of a generation is the same Problem.
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
    layout: str  # "dense" | "varlen" | "kvcache" (dense KV cache) | "paged" (paged KV cache)
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
    # sdpa_with_kvcache(): the paged cache's block size (None for other layouts), and whether
    # k_new/v_new are appended into the cache before attending
    kv_block_size: int | None = None
    kv_append: bool = False

    @property
    def kv_cache(self) -> bool:
        """A call of sdpa_with_kvcache() (layout "kvcache" or "paged")."""
        return self.layout in KV_LAYOUTS

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv if self.heads_kv else 1

    @property
    def sequences_match(self) -> bool:
        """True when top-left and bottom-right causal are the same function: dense with
        Sq == Sk, or varlen whose query and key offsets are the same tensor."""
        if self.layout == "varlen":
            return self.same_offsets
        if self.layout in KV_LAYOUTS:  # each sequence has its own length
            return False
        return self.seqlen_q == self.seqlen_k

    def summary(self) -> str:
        """One readable line, used in errors and decision tables."""
        keys = f"cache={self.seqlen_k}" if self.kv_cache else f"Sk={self.seqlen_k}"
        parts = [
            f"{self.layout} B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} "
            f"Sq={self.seqlen_q} {keys} Dqk={self.head_dim_qk} Dv={self.head_dim_v}",
            f"{str(self.dtype).removeprefix('torch.')} on {self.device_type}"
            + (f" sm{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else ""),
        ]
        if self.kv_block_size is not None:
            parts.append(f"block_size={self.kv_block_size}")
        if self.kv_append:
            parts.append("append k_new/v_new")
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
