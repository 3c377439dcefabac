"""The project's Triton memory-efficient attention kernels (forward + backward).

Public interface (used by ``attention_dispatch.backends.triton``)::

    out = triton_attention(query, key, value, bias, params,
                           cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           return_lse=False)

* dense: query (B, Hq, Sq, Dqk), key (B, Hkv, Sk, Dqk), value (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv);
  varlen: (total, H, D) with int32 cu_seqlens (B+1,) on the device and python-int max lengths.
  Any strides (the last dim is made contiguous when it is not); Hq % Hkv == 0 (GQA/MQA,
  K/V never repeated).
* bias: None, or a tensor broadcastable to (B, Hq, Sq, Sk) (varlen: (B, Hq, max_sq, max_sk),
  local positions) whose dims are each 1 or full size; a full-size dim may have stride 0 (a
  broadcast view) - it is never materialised.  bool: True = attend; float (any float dtype):
  additive, upcast to fp32.  Gradient of a float bias: same shape as the bias, summed over its
  size-1 dims (in-kernel for the query-row and head dims, then a deterministic torch.sum);
  a full-size stride-0 dim receives its per-element gradient (the caller's expand() then sums).
  Prefer passing a mask that requires grad UN-expanded (e.g. (Sq, Sk) or (B, 1, 1, Sk)): the
  kernel broadcasts it through stride 0 and returns the compact gradient without ever
  allocating (B, Hq, Sq, Sk); an expand()-ed view costs an fp32 (B, Hq, Sq, Sk) workspace.
* return_lse=True also returns the logsumexp (fp32, natural log; -inf for empty rows):
  dense (B, Hq, Sq), varlen (total_q, Hq).
* params: :class:`KernelParams` (scale, band, dropout, determinism, optional tuning knobs:
  block_m/block_n force the tiles, num_splits forces the backward splits, max_grid lowers
  the grid y/z limit used for chunking, descriptors forces (1) or disables (0) the TMA
  tensor-descriptor loads that are automatic on Hopper for aligned fp16/bf16 rows).
* dropout: seed drawn from the device generator inside the op; :func:`dropout_keep_mask`
  reproduces the mask (see its docstring).
"""

from dataclasses import dataclass

from . import configs
from .autograd import prepare_attention, triton_attention
from .configs import KernelConfig
from .launch import (
    MAX_GRID_YZ,
    ForwardPlan,
    KernelParams,
    TrainingPlan,
    attention_backward,
    attention_forward,
    bh_chunks,
    config_reason,
    device_info,
    dropout_keep_mask,
    group_splits_heuristic,
    is_interpreter,
    num_splits_heuristic,
    select_config,
)


@dataclass(frozen=True)
class KernelLimits:
    """What the kernel supports, as data (for the adapter's Capabilities)."""

    dtypes: tuple = configs.SUPPORTED_DTYPES
    min_head_dim: int = configs.MIN_HEAD_DIM
    max_head_dim: int = configs.MAX_HEAD_DIM
    head_dim_qk_ne_v: bool = True  # Dqk != Dv supported
    causal_kinds: tuple = ("top_left", "bottom_right")
    window: bool = True  # (left, right), -1 unbounded, either alignment
    bool_mask: bool = True
    float_bias: bool = True
    bias_grad: bool = True
    dropout: bool = True
    varlen: bool = True  # incl. zero-length sequences
    gqa: bool = True
    deterministic_backward: bool = True  # params.deterministic=True: bitwise repeatable
    default_backward_deterministic: bool = False  # split-keys (fp32 atomics) may be used otherwise
    forward_deterministic: bool = True
    device_types: tuple = ("cuda", "cpu")  # cpu only under TRITON_INTERPRET=1
    min_compute_capability: tuple = configs.MIN_COMPUTE_CAPABILITY
    bf16_min_compute_capability: tuple = configs.BF16_MIN_COMPUTE_CAPABILITY
    max_grid_yz: int = MAX_GRID_YZ  # larger batch*heads are chunked (no user limit)
    cuda_graph_safe: bool = True
    torch_compile: bool = True


KERNEL_LIMITS = KernelLimits()

__all__ = [
    "KERNEL_LIMITS",
    "ForwardPlan",
    "KernelConfig",
    "KernelLimits",
    "KernelParams",
    "MAX_GRID_YZ",
    "TrainingPlan",
    "attention_backward",
    "attention_forward",
    "bh_chunks",
    "config_reason",
    "configs",
    "device_info",
    "dropout_keep_mask",
    "group_splits_heuristic",
    "is_interpreter",
    "num_splits_heuristic",
    "prepare_attention",
    "select_config",
    "triton_attention",
]
