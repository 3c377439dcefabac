"""The PyTorch kernels as backends: cuDNN, flash and memory-efficient (CUDA) and the fused CPU
kernel, each a :class:`torch_sdpa.TorchSdpaBackend` pinned to one ``SDPBackend`` with its own
capabilities and checks."""

from __future__ import annotations

import math

import torch

from ..problem import Problem
from ..semantics import CausalKind
from .base import Capabilities
from ..kernels.kv_append import append_kv
from .torch_sdpa import (
    HALF_DTYPES,
    CpuPinnedKernel,
    TorchSdpaBackend,
    deterministic_flag,
    fold_pays,
    fold_rows,
    unfold_rows,
)

_CPU_FLASH = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None)


class CudnnBackend(TorchSdpaBackend):
    """cuDNN attention (``SDPBackend.CUDNN_ATTENTION``)."""

    name = "cudnn"
    sdp_backend = "CUDNN_ATTENTION"
    fix_empty_rows = True
    direct_op = "_scaled_dot_product_cudnn_attention"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        min_compute_capability=(8, 0),
        max_compute_capability=(12, 1),
        dtypes=HALF_DTYPES,
        head_dim_max=256,
        head_dim_multiple=8,
        causal_kinds=frozenset(CausalKind),
        window=False,
        bias_grad=False,  # check_attn_mask_shape: a mask requiring grad disables cuDNN
        float32_bias=False,  # not shown to add a float32 bias unrounded
        dropout=False,  # p must be a multiple of 1/16, none on cuDNN 9.11-9.13: not expressible here
        varlen=False,  # nested needs TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1, sm90/100, Sq > 128
        deterministic_backward=False,
        max_batch_heads=None,
        kv_cache=frozenset({"dense"}),  # F.sdpa with a bool mask from cache_seqlens
        notes="bottom-right causal as a folded bool mask; head dim 256 only on sm90 with cuDNN >= 9.19 or sm10x with cuDNN > 9.22",
        plans_per_length=(
            "PyTorch keys its cuDNN graphs by exact sizes: each new sequence length builds one "
            "(H100, torch 2.11, a decode step over a new key length: 62 ms median, 0.35 ms once built)"
        ),
    )

    def _built(self) -> str:
        if not torch.backends.cudnn.is_available():
            return "PyTorch was built without cuDNN"
        v = torch.backends.cudnn.version() or 0
        if v < 90000:
            return f"cuDNN {v} < 9.0.0 (PyTorch needs 9 for cuDNN attention)"
        return ""

    def version(self) -> str:
        v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return f"torch {torch.__version__}" + (f", cuDNN {v}" if v else "")

    @staticmethod
    def _cudnn_version() -> int:
        try:
            return int(torch.backends.cudnn.version() or 0) if torch.backends.cudnn.is_available() else 0
        except Exception:  # pragma: no cover - a broken cuDNN install
            return 0

    def _direct_call(self, op, is_causal: bool, scale, grad: bool, **_):
        def runner(query, key, value):
            # the log-sum-exp is what its backward reads: computed when the signature needs grad
            return op(query, key, value, None, grad, 0.0, is_causal, False, scale=scale)[0]

        return runner

    def _kernel_checks(self, p: Problem) -> list[str]:
        reasons = []
        on, warn_only = deterministic_flag()
        if on and not warn_only:
            reasons.append(
                "torch.use_deterministic_algorithms(True) is on: PyTorch refuses cuDNN attention "
                "(check_cudnn_deterministic)"
            )
        if p.batch > 65535 or p.heads_q > 65535:
            reasons.append(f"batch={p.batch} or heads={p.heads_q} > 65535 (cuDNN limit)")
        if p.layout in ("dense", "kvcache") and p.seqlen_k == 1:
            reasons.append("Sk=1 not supported by cuDNN attention")
        cc = p.compute_capability or (0, 0)
        ver = self._cudnn_version()
        sm90_10x = cc == (9, 0) or cc[0] == 10
        # head dim 256: cuDNN > 9.22 on sm90/sm10x; also 9.19+ on sm90, where it was verified
        # forward and backward against the float64 oracle (tests/test_capabilities.py on an
        # H100, cuDNN 9.19, docs/experiments/perf-notes.md)
        d256 = (sm90_10x and ver > 92200 and not (cc == (10, 7) and ver <= 92500)) or (cc == (9, 0) and ver >= 91900)
        dqk, dv = p.head_dim_qk, p.head_dim_v
        if d256:
            limit = 256
        elif sm90_10x and ver >= 91100 and (dqk, dv) == (192, 128):
            limit = 192
        else:
            limit = 128
        if max(dqk, dv) > limit and max(dqk, dv) <= 256:
            reasons.append(f"head_dim={max(dqk, dv)} > {limit} (cuDNN {ver or 'unknown'} on sm{cc[0]}{cc[1]})")
        if d256 and p.requires_grad and not (max(dqk, dv) <= 128 or (dqk, dv) in ((192, 128), (256, 256))):
            reasons.append(f"backward with head dims ({dqk}, {dv}) not supported by cuDNN on sm{cc[0]}{cc[1]}")
        return reasons


class TorchFlashBackend(TorchSdpaBackend):
    """PyTorch's FlashAttention-2 (``SDPBackend.FLASH_ATTENTION``) on CUDA."""

    name = "torch_flash"
    sdp_backend = "FLASH_ATTENTION"
    determinism_from_global_flag = True
    native_lower_right = True
    varlen_causal = CausalKind.BOTTOM_RIGHT
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        min_compute_capability=(8, 0),
        max_compute_capability=(12, 1),
        dtypes=HALF_DTYPES,
        head_dim_max=256,
        different_head_dims=False,
        causal_kinds=frozenset({CausalKind.BOTTOM_RIGHT}),  # is_causal with Sq != Sk is refused
        window=False,
        bool_mask=False,
        float_bias=False,
        bias_grad=False,
        float32_bias=False,
        notes="deterministic backward only under torch.use_deterministic_algorithms(True)",
    )

    def _built(self) -> str:
        if not torch.backends.cuda.is_flash_attention_available():
            return "PyTorch was built without flash attention"
        return ""

    def _kernel_checks(self, p: Problem) -> list[str]:
        reasons = []
        cc = p.compute_capability or (0, 0)
        if p.requires_grad and ((8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)):
            d = p.head_dim_qk
            if 192 < d <= 224 or (d > 224 and p.dropout):
                reasons.append(
                    f"backward with head_dim={d}{' and dropout' if p.dropout else ''} not supported on sm{cc[0]}{cc[1]}"
                )
        if p.layout == "varlen" and p.head_dim_qk % 8:
            reasons.append(f"head_dim={p.head_dim_qk} is not a multiple of 8 (nested inputs)")
        return reasons


class TorchEfficientBackend(TorchSdpaBackend):
    """PyTorch's memory-efficient kernel (``SDPBackend.EFFICIENT_ATTENTION``) on CUDA."""

    name = "torch_efficient"
    sdp_backend = "EFFICIENT_ATTENTION"
    determinism_from_global_flag = True
    native_lower_right = True
    fix_empty_rows = True
    varlen_causal = CausalKind.TOP_LEFT
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        min_compute_capability=(5, 0),
        max_compute_capability=(12, 1),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        causal_kinds=frozenset(CausalKind),
        window=False,
        float32_bias=False,  # not shown to add a float32 bias unrounded
        gqa=False,  # PyTorch 2.11 refuses dense Hq != Hkv for this kernel ("No available kernel", seen on an H100)
        kv_cache=frozenset({"dense"}),  # F.sdpa with a bool mask from cache_seqlens
        notes="varlen: causal top-left, forward only; deterministic backward only under "
        "torch.use_deterministic_algorithms(True)",
    )

    def _built(self) -> str:
        if not torch.backends.cuda.is_flash_attention_available() and not hasattr(
            torch.ops.aten, "_efficient_attention_forward"
        ):
            return "PyTorch was built without memory-efficient attention"
        return ""

    def _kernel_checks(self, p: Problem) -> list[str]:
        reasons = []
        cc = p.compute_capability or (0, 0)
        half = p.dtype in HALF_DTYPES
        if cc < (8, 0) and p.dtype == torch.bfloat16:
            reasons.append(f"dtype=bfloat16 needs sm80+ (got sm{cc[0]}{cc[1]})")
        # minimum_gemm_alignment(): tensor cores need 16-byte rows of the head dim
        if cc >= (8, 0):
            align = 8 if half else 4
        elif cc >= (7, 0):
            align = 8 if half else 1
        else:
            align = 1
        for label, d in (("head_dim_qk", p.head_dim_qk), ("head_dim_v", p.head_dim_v)):
            if d % align:
                reasons.append(
                    f"{label}={d} is not a multiple of {align} (efficient attention, "
                    f"{str(p.dtype).removeprefix('torch.')})"
                )
        if p.layout in ("dense", "kvcache") and cc >= (8, 0) and not p.aligned_16:
            reasons.append("query/key/value not 16-byte aligned (efficient attention on sm80+)")
        if p.layout == "varlen" and p.requires_grad:
            reasons.append("backward with varlen/nested inputs not supported (PyTorch: check_requires_grad_and_nested)")
        if p.dropout and p.requires_grad and p.batch > 65535:
            reasons.append(f"dropout backward with batch={p.batch} > 65535 not supported")
        return reasons


class TorchCpuBackend(TorchSdpaBackend):
    """PyTorch's fused CPU flash kernel (``SDPBackend.FLASH_ATTENTION`` on CPU tensors).

    Host time (issues 34/35): pinned with the two flags PyTorch's CPU choice reads
    (``CpuPinnedKernel``); GQA without mask or causal folded into rows where that pays
    (``torch_sdpa.FOLDED``); repeated plain calls call the kernel's ATen op with only the
    arguments that differ from its defaults; a KV cache computed over the keys its lengths
    allow, read on the host where they are (``run_kvcache``)."""

    name = "torch_cpu"
    sdp_backend = "FLASH_ATTENTION"
    device_type = "cpu"
    direct_op = "_scaled_dot_product_flash_attention_for_cpu"
    direct_gqa = True  # the CPU kernel reads kv head h // G itself (F.sdpa passes enable_gqa calls to it as they are)
    fold_gqa = True
    capabilities = Capabilities(
        devices=frozenset({"cpu"}),
        different_head_dims=False,
        causal_kinds=frozenset(CausalKind),
        window=False,
        bias_grad=False,  # check_attn_mask_shape: a mask requiring grad falls back to math
        dropout=False,  # check_for_dropout
        varlen=False,  # check_nested_tensor
        kv_cache=frozenset({"dense"}),  # F.sdpa with a bool mask from cache_seqlens
        notes="bottom-right causal as a folded bool mask",
    )

    def _eager_pin(self):
        return CpuPinnedKernel()

    def _direct_call(self, op, is_causal: bool, scale, grad: bool, fold: bool = False, head_dim: int = 0):
        """The op with only the arguments that differ from its defaults (a keyword costs the
        tiny call ~1 us of argument parsing): its default scale is 1 / sqrt(D), the same double
        as the normalised call's (sdp::calculate_scale), so an equal scale is left out."""
        default = scale is None or (head_dim > 0 and scale == 1.0 / math.sqrt(head_dim))
        if fold:
            extra = {} if default else {"scale": scale}

            def folded(query, key, value):
                heads_q = query.shape[1]
                return unfold_rows(op(fold_rows(query, key.shape[1]), key, value, **extra)[0], heads_q)

            return folded
        if is_causal:
            if default:
                return lambda query, key, value: op(query, key, value, 0.0, True)[0]
            return lambda query, key, value: op(query, key, value, 0.0, True, scale=scale)[0]
        if default:
            runner = lambda query, key, value: op(query, key, value)[0]  # noqa: E731
            runner.first_of = op  # Backend.prepare: sdpa()'s recent hits call op themselves
            return runner
        return lambda query, key, value: op(query, key, value, scale=scale)[0]

    def run_kvcache(self, query, k_cache, v_cache, cache_seqlens, *, k_new, v_new, block_table, causal, window, scale):
        """A dense KV cache on the CPU, where its lengths cost nothing to read: the append (one
        slice copy per tensor when every sequence has the same length, else kv_append's
        scatter), then attention over the keys up to the longest L_b only, never the whole
        capacity.  One length L for every sequence: a dense call over the first L keys (causal
        is bottom-right against L, which a single query row never needs): the CPU op itself
        where run() would call F.sdpa without a mask (GQA folded where that pays;
        _direct_dense), else run().  Lengths that differ: the same per sequence over its own
        L_b keys, so no row past a length is read (a cache from torch.empty may hold NaN there,
        which a mask does not remove: 0 x NaN); as fast as one masked call over the longest
        or faster (the CPU kernel's masked path is the slow one; docs/decisions.md)."""
        if block_table is not None or window is not None:
            raise ValueError(f"{self.name}: a paged KV cache or a window is not supported (rejected by check())")
        b, hq, sq, _ = query.shape
        capacity = k_cache.shape[2]
        lengths = cache_seqlens.tolist()
        shortest, longest = (min(lengths), max(lengths)) if lengths else (0, 0)
        n_new = 0
        if k_new is not None:
            n_new = sq
            if shortest == longest and 0 <= longest <= capacity - sq:
                k_cache.narrow(2, longest, sq).copy_(k_new)
                v_cache.narrow(2, longest, sq).copy_(v_new)
            else:
                append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new)
        keys = min(longest + n_new, capacity)  # capacity: validate=False leaves the lengths unchecked
        if 0 in (b, hq, sq) or keys <= 0:
            return query.new_zeros(b, hq, sq, v_cache.shape[-1])
        if shortest + n_new == keys:  # every sequence has `keys` keys
            return self._exact_keys(query, k_cache, v_cache, keys, causal, scale)
        out = query.new_empty(b, hq, sq, v_cache.shape[-1])
        for i, n in enumerate(lengths):
            n = min(n + n_new, capacity)
            rows = slice(i, i + 1)
            if n <= 0:
                out[rows] = 0
            else:
                out[rows] = self._exact_keys(query[rows], k_cache[rows], v_cache[rows], n, causal, scale)
        return out

    def _exact_keys(self, query, k_cache, v_cache, keys, causal, scale):
        """Attention over the first `keys` keys of every sequence (the CPU op where it applies)."""
        k, v = k_cache.narrow(2, 0, keys), v_cache.narrow(2, 0, keys)
        out = self._direct_dense(query, k, v, causal, scale)
        return self.run(query, k, v, causal=causal, scale=scale) if out is None else out

    def _direct_dense(self, query, key, value, causal, scale):
        """run()'s result for a non-empty dense call without mask or dropout where run() would
        call F.sdpa without a mask (PLAIN, IS_CAUSAL, FOLDED): the op F.sdpa pinned to flash calls
        for it (prepare()'s equivalence), with the cheap checks inline; None for any other call."""
        b, hq, sq, d = query.shape
        hkv, keys = key.shape[1], key.shape[2]
        if causal is None:
            is_causal = False
        elif causal is CausalKind.TOP_LEFT or sq == keys:
            is_causal = True  # top-left, or bottom-right on a square: the same
        elif sq == 1:
            is_causal = False  # one row, bottom-right: every key (call_form)
        else:
            return None  # bottom-right with Sq != Sk > 1: TAIL or BAND_MASK
        if d == 0 or query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
            return None
        op = _CPU_FLASH
        if op is None:
            return None
        extra = {} if scale == 1.0 / math.sqrt(d) else {"scale": scale}
        if is_causal or hkv == hq or not fold_pays(b, hkv, hq // hkv * sq):
            return op(query, key, value, 0.0, is_causal, **extra)[0]
        return unfold_rows(op(fold_rows(query, hkv), key, value, **extra)[0], hq)
