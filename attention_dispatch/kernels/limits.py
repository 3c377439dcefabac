"""What this project's kernels support: the one declaration.

The triton backend's Capabilities and the kernels' own checks (configs.static_reason,
arch_reason) are derived from KERNEL_LIMITS; this module imports no Triton, so the backend can
declare its capabilities without importing a compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_GRID_YZ = 65535  # CUDA's grid y/z limit: larger batch*heads are launched in chunks


@dataclass(frozen=True)
class KernelLimits:
    """What the kernels compute exactly, tested by the capability claims (tests/test_capabilities.py)."""

    dtypes: tuple = (torch.float16, torch.bfloat16, torch.float32)
    min_head_dim: int = 1  # padded to 16 inside (tl.dot's minimum)
    max_head_dim: int = 512  # Dqk and Dv; 257..512 on the tl kernels only (configs.py, issue 36)
    head_dim_qk_ne_v: bool = True  # Dqk != Dv
    causal_kinds: tuple = ("top_left", "bottom_right")
    window: bool = True  # (left, right), -1 unbounded, either alignment
    bool_mask: bool = True
    float_bias: bool = True
    bias_grad: bool = True
    float32_bias: bool = True  # a float32 bias with 16-bit inputs is loaded and added at float32
    dropout: bool = True
    # a dropout call drawn as a block of a larger call (dropout.positioned_stream): its column
    # offset a multiple of 4, the keys one Philox draw covers
    dropout_column_multiple: int = 4
    varlen: bool = True  # zero-length sequences included
    gqa: bool = True
    deterministic_backward: bool = True  # params.deterministic=True: bitwise repeatable
    default_backward_deterministic: bool = False  # split-keys (fp32 atomics) may be used otherwise
    forward_deterministic: bool = True
    # issue 36: softcap * tanh(score / softcap), ALiBi slopes (B, Hq) or (Hq,), attention sinks
    # (Hq,) with their gradient, the rows' logsumexp returned and differentiable; forward and
    # backward with every feature above, and in the decode kernel (forward only: it has none)
    softcap: bool = True
    alibi: bool = True
    sinks: bool = True
    sinks_grad: bool = True
    return_lse: bool = True
    lse_grad: bool = True
    device_types: tuple = ("cuda", "cpu")  # cpu only under TRITON_INTERPRET=1
    min_compute_capability: tuple = (8, 0)  # tested on sm90; sm80 as Triton's tl kernels support it
    bf16_min_compute_capability: tuple = (8, 0)
    max_grid_yz: int = MAX_GRID_YZ
    # the decode kernel (sdpa_with_kvcache): dense and paged caches, block sizes powers of two from
    # 16, append, Sq > 1; every head dim, dtype, band and GQA ratio above
    kv_cache: tuple = ("dense", "paged")
    paged_block_size_min: int = 16
    paged_block_size_pow2: bool = True
    cuda_graph_safe: bool = True
    torch_compile: bool = True


KERNEL_LIMITS = KernelLimits()
