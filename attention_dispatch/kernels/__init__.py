"""The project's Triton memory-efficient attention kernels (forward + backward).

Public interface (used by ``attention_dispatch.backends.triton``)::

    out = triton_attention(query, key, value, bias, params,
                           cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           return_lse=False, alibi_slopes=None, sinks=None)

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
* return_lse=True also returns the logsumexp (fp32, natural log, without the sink; -inf for empty
  rows): dense (B, Hq, Sq), varlen (total_q, Hq); differentiable (d lse_i / d s_ij = P_ij without
  the sink and dropout).
* score transforms (issue 36): ``params.softcap`` > 0: ``softcap * tanh(scale <q, k> / softcap)``
  before the bias; ``alibi_slopes``: fp32 (B, Hq) (a stride-0 batch dim is fine), adds
  ``-slope * |i + off - j|`` with the band's diagonal offset, no gradient; ``sinks``: (Hq,), any
  float dtype, one extra logit per head in each row's softmax denominator, differentiable.
* params: :class:`KernelParams` (scale, band, dropout, determinism, softcap, optional tuning knobs:
  block_m/block_n force the tiles, num_splits forces the backward splits, max_grid lowers
  the grid y/z limit used for chunking, descriptors forces (1) or disables (0) the TMA
  tensor-descriptor loads that are automatic on Hopper for aligned fp16/bf16 rows).
* dropout: seed drawn from the device generator inside the op; :func:`dropout_keep_mask`
  reproduces the mask (see its docstring).
"""

import importlib

from .limits import KERNEL_LIMITS, MAX_GRID_YZ, KernelLimits

# Everything else imports Triton: loaded on first use, so that the triton backend can read
# KERNEL_LIMITS (and the dispatcher can be imported) without a compiler.
_LAZY = {
    "configs": None,
    "KernelConfig": ".configs",
    "prepare_attention": ".autograd",
    "triton_attention": ".autograd",
    "ForwardPlan": ".replay",
    "KernelParams": ".params",
    "TrainingPlan": ".replay",
    "attention_backward": ".entry",
    "attention_forward": ".entry",
    "describe_route": ".entry",
    "bh_chunks": ".shapes",
    "config_reason": ".run",
    "device_info": ".device",
    "dropout_keep_mask": ".dropout",
    "group_splits_heuristic": ".tl.launch_backward",
    "is_interpreter": ".device",
    "num_splits_heuristic": ".tl.launch_backward",
    "select_config": ".run",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _LAZY[name]
    value = importlib.import_module(f".{name}" if where is None else where, __name__)
    if where is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


__all__ = ["KERNEL_LIMITS", "KernelLimits", "MAX_GRID_YZ", *_LAZY]
