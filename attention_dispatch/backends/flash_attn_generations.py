"""The flash-attn generations' declarations for the ``flash_attn`` backend (flash_attn.py): each
generation's Capabilities (FA2_CAPS, FA3_CAPS, FA4_CAPS, with their KV-cache and feature
flags from flash_attn_kvcache / flash_attn_features), their labels, the records select()
works with (Implementation, Choice) and the union the backend declares (caps_union).  Data,
no imports of flash-attn itself."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from ..semantics import CausalKind
from .base import Capabilities
from . import flash_attn_features as features
from . import flash_attn_kvcache as kv

_HALF = frozenset({torch.float16, torch.bfloat16})
INSTALL_HINT = "not installed: pip install flash-attn (or flash-attn-4 for flash_attn.cute)"

FA2_CAPS = Capabilities(
    devices=frozenset({"cuda"}),
    min_compute_capability=(8, 0),
    dtypes=_HALF,
    head_dim_max=256,
    different_head_dims=False,
    causal_kinds=frozenset({CausalKind.BOTTOM_RIGHT}),
    window=True,
    bool_mask=False,
    float_bias=False,
    bias_grad=False,
    float32_bias=False,
    dropout=True,
    varlen=True,
    gqa=True,
    deterministic_backward=True,
    needs_last_dim_contiguous=False,
    notes="flash-attn 2; KV cache: flash_attn_with_kvcache (appends in place)",
    **kv.FA2_KV,
    **features.declared_flags("fa2"),
)
FA3_CAPS = dataclasses.replace(
    FA2_CAPS,
    min_compute_capability=(9, 0),
    max_compute_capability=(9, 0),
    head_dim_multiple=8,
    dropout=False,
    notes="flash-attn 3 (hopper); KV cache: flash_attn_with_kvcache (appends in place)",
    **kv.FA3_KV,
    **features.declared_flags("fa3"),
)
FA4_CAPS = dataclasses.replace(
    FA2_CAPS,
    min_compute_capability=(9, 0),
    max_compute_capability=(11, 9),
    head_dim_multiple=8,
    dropout=False,
    backward_from_output=True,  # run_backward (flash_attn_backward.py), a tested release only
    notes="flash-attn 4 (flash_attn.cute); KV cache: declined (it reads rows past seqused_k: FA4_KV_DECLINED)",
    first_call_per_shape=(
        "flash-attn 4 is relaunched from a call recorded per exact shape: each new length goes through "
        "its public call first (H100, a decode step over a new key length: 189 us of host time, 36 us relaunched)"
    ),
    **kv.FA4_KV,
    **features.declared_flags("fa4"),
)
FA4_HEAD_DIMS = (64, 96, 128)  # what flash_attn.cute 4.0 compiles and we verified; others rejected
LABELS = {"fa2": "flash-attn 2", "fa3": "flash-attn 3", "fa4": "flash-attn 4"}


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One importable flash-attn generation."""

    key: str  # "fa2" | "fa3" | "fa4"
    label: str  # "flash-attn 2"
    version: str
    func: Callable
    varlen_func: Callable | None
    caps: Capabilities
    kv_func: Callable | None = None  # sdpa_with_kvcache()'s (flash_attn_kvcache.KV_FUNCTION)


@dataclasses.dataclass(frozen=True)
class Choice:
    """FlashAttnBackend.select's answer: the implementation a call runs (None: none can) and,
    for each generation preferred to it that does not run it, (label, why) in preference order
    (not installed, import failed, or its reasons for this call); ``refusals``: "label: reason"
    for each reason of each installed generation that refused the call (check()'s reasons)."""

    impl: Implementation | None
    passed_over: tuple[tuple[str, str], ...] = ()
    refusals: tuple[str, ...] = ()


def caps_union(caps: list[Capabilities]) -> Capabilities:
    """The loosest declaration covering every implementation (for tables and the first filter)."""
    if not caps:
        return FA2_CAPS
    if len(caps) == 1:
        return caps[0]
    lows = [c.min_compute_capability for c in caps]
    highs = [c.max_compute_capability for c in caps]
    return Capabilities(
        devices=frozenset().union(*(c.devices for c in caps)),
        min_compute_capability=None if None in lows else min(lows),
        max_compute_capability=None if None in highs else max(highs),
        dtypes=frozenset().union(*(c.dtypes for c in caps)),
        head_dim_min=min(c.head_dim_min for c in caps),
        head_dim_max=None if any(c.head_dim_max is None for c in caps) else max(c.head_dim_max for c in caps),
        head_dim_multiple=math.gcd(*(c.head_dim_multiple for c in caps)),
        different_head_dims=any(c.different_head_dims for c in caps),
        causal_kinds=frozenset().union(*(c.causal_kinds for c in caps)),
        **{
            f: any(getattr(c, f) for c in caps)
            for f in (
                "window",
                "bool_mask",
                "float_bias",
                "bias_grad",
                "float32_bias",
                "mask_with_causal",
                "dropout",
                "dense",
                "varlen",
                "gqa",
                "backward",
                "deterministic_backward",
                "backward_from_output",
                *features.FLAGS,
            )
        },
        needs_last_dim_contiguous=all(c.needs_last_dim_contiguous for c in caps),
        first_call_per_shape=next((c.first_call_per_shape for c in caps if c.first_call_per_shape), ""),
        notes=" / ".join(c.notes for c in caps),
        **kv.kv_union(caps),
    )
