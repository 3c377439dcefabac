"""Host-side launch logic: argument normalisation, configuration choice, grids, chunking
past the launch-grid limit, the split-keys heuristic and its workspace, empty edge cases.

Everything here only reads shapes/strides and python ints: no host synchronisation and no
allocation whose size depends on tensor data, so it is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton

from ..caches import register_cache
from . import configs as C
from .bias import batch_minor, bias_constexprs, bias_layout, ws_bias_reason, ws_bias_rows
from .limits import MAX_GRID_YZ
from .params import KernelParams
from .compiled_cache import COMPILED, DirectLaunch, TensorDescriptor, _hooks_installed, is_descriptor, rebase, relaunch
from .backward import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess
from .forward import LOG2E, _attn_fwd, _dropout_mask_kernel

try:  # Gluon (Triton >= 3.5): the warp-specialised sm90 forward
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
    from .forward_ws import WG_ROWS, _attn_bwd_dkdv_ws, _attn_bwd_dq_ws, _attn_fwd_ws

    _WG_ROWS = WG_ROWS.value  # rows per consumer warpgroup; a program covers two
except ImportError:  # pragma: no cover - a Triton without Gluon: the tl forward serves every call
    _attn_fwd_ws = _attn_bwd_dkdv_ws = _attn_bwd_dq_ws = None
    _WG_ROWS = 64

# Upper bound on the number of key splits of the dQ pass.
MAX_SPLITS = 16
# Under the CPU interpreter, keep P and dS in fp32 for the second matmuls of fp16/bf16
# inputs (the interpreter is a correctness harness: its half-precision results then match
# PyTorch's CPU math path, which upcasts).  False reproduces the GPU rounding exactly.
INTERPRETER_FP32_PRODUCTS = True


# --------------------------------------------------------------------------- device facts


def is_interpreter() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1
    set before triton was imported)."""
    return type(_attn_fwd).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=None)
def _cuda_info(index: int) -> tuple[tuple[int, int], int, int]:
    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 0
    if not smem:
        try:
            smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
        except Exception:  # pragma: no cover
            smem = 48 * 1024
    return cc, int(smem), int(props.multi_processor_count)


def device_info(device: torch.device) -> tuple[tuple[int, int], int, int]:
    """(compute capability, shared memory per block (opt-in), SM count)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())
    return (0, 0), 1 << 30, 1


# In-kernel TMA descriptors need a small global scratch buffer per launch, which Triton
# asks from the allocator in its context variable.  When the caller has not set one, the
# launch sets ours for its own duration only (restored in finally).
try:
    from triton.runtime._allocation import NullAllocator as _NullAllocator
    from triton.runtime._allocation import _allocator as _TRITON_ALLOCATOR
except ImportError:  # pragma: no cover - Triton without in-kernel descriptors
    _TRITON_ALLOCATOR = _NullAllocator = None
_HAS_DESCRIPTORS = hasattr(_TRITON_ALLOCATOR, "reset") and hasattr(triton.language, "make_tensor_descriptor")


class _ScratchAllocator:
    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=self.device)


def _tma_compatible(t: torch.Tensor) -> bool:
    """TMA reads rows at 16-byte aligned addresses: the base, every stride but the last and
    the row length must be multiples of 16 bytes."""
    es = t.element_size()
    if t.data_ptr() % 16 or (t.shape[-1] * es) % 16:
        return False
    for st in t.stride()[:-1]:
        if (st * es) % 16:
            return False
    return True


def use_descriptors(params: "KernelParams", tensors, device: torch.device, loop_len: int | None = None) -> bool:
    """Whether the kernels load tiles through TMA tensor descriptors (Hopper and newer,
    fp16/bf16, 16-byte aligned rows); ``params.descriptors`` forces it (1) or turns it off (0).
    ``loop_len``: rows of the loop the descriptors feed; in auto mode one 64-row tile or less
    leaves nothing for TMA to pipeline, and pointer loads spare the descriptors' scratch
    allocation (host) and creation (device) on tiny calls."""
    if params.descriptors == 0:
        return False
    if params.descriptors == 1:
        if not (_HAS_DESCRIPTORS and all(_tma_compatible(t) for t in tensors)):
            raise ValueError(
                "descriptors=1: TMA descriptors need Triton's make_tensor_descriptor and "
                "16-byte aligned rows (base, strides and head dim); got "
                + ", ".join(f"{tuple(t.shape)}/{t.stride()}" for t in tensors)
            )
        return True
    if (
        not _HAS_DESCRIPTORS
        or device.type != "cuda"
        or is_interpreter()
        or (loop_len is not None and loop_len <= 64)
        or tensors[0].dtype not in (torch.float16, torch.bfloat16)
        or device_info(device)[0] < (9, 0)
    ):
        return False
    for t in tensors:
        if not _tma_compatible(t):
            return False
    return True


def _run_with_scratch(device: torch.device, uses_descriptors: bool, fn, *args):
    """``fn(*args)`` (kernel launches) with a scratch allocator for in-kernel descriptors."""
    if not uses_descriptors or not isinstance(_TRITON_ALLOCATOR.get(), _NullAllocator):
        return fn(*args)
    token = _TRITON_ALLOCATOR.set(_ScratchAllocator(device))
    try:
        return fn(*args)
    finally:
        _TRITON_ALLOCATOR.reset(token)


# Opt-in shared memory per block by compute capability, used when the device cannot be queried.
_SMEM_BY_CC = {
    (7, 5): 64 * 1024,
    (8, 0): 163 * 1024,
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024,
    (12, 0): 99 * 1024,
}


def config_reason(
    head_dim_qk: int, head_dim_v: int, dtype: torch.dtype, device, compute_capability: tuple[int, int] | None = None
) -> str | None:
    """Why the kernel cannot run this (head dims, dtype, device), or None when it can.

    ``device``: a torch.device or a device string/type ("cuda", "cuda:1", "cpu");
    ``compute_capability``: optional, else queried from the device."""
    r = C.static_reason(head_dim_qk, head_dim_v, dtype)
    if r:
        return r
    device = torch.device(device)
    if device.type == "cpu":
        if not is_interpreter():
            return "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
        return None
    if device.type != "cuda":
        return f"device type {device.type!r} not supported (cuda, or cpu under TRITON_INTERPRET=1)"
    if getattr(torch.version, "hip", None):
        return "ROCm is not supported by this kernel's configuration table"
    if is_interpreter():
        return None
    if torch.cuda.is_available():
        cc, smem, _ = device_info(device)
        if compute_capability is not None and tuple(compute_capability) != cc:
            cc = tuple(compute_capability)
            smem = _SMEM_BY_CC.get(cc, 99 * 1024)
    elif compute_capability is not None:
        cc = tuple(compute_capability)
        smem = _SMEM_BY_CC.get(cc, 99 * 1024)
    else:
        return "no CUDA device"
    return C.arch_reason(head_dim_qk, head_dim_v, dtype, cc, smem)


def select_config(
    kind: str,
    head_dim_qk: int,
    head_dim_v: int,
    dtype: torch.dtype,
    device,
    params: KernelParams | None = None,
    extras: bool = False,
    grouped: bool = False,
) -> list[C.KernelConfig]:
    """Candidate configurations, best first (a forced block_m/block_n replaces the tiles, in
    one tile: no sub-tiles).  ``extras``: a bias, mask or dropout; ``grouped``: GQA / MQA."""
    if is_interpreter() or torch.device(device).type != "cuda":
        cands = [C.INTERPRETER_CONFIGS[kind]]
    else:
        cc, smem, _ = device_info(device)
        banded = params is not None and (params.window_left >= 0 or params.window_right >= 0)
        cands = C.candidate_configs(kind, head_dim_qk, head_dim_v, dtype, cc, smem, banded, extras, grouped)
        if not cands:
            raise RuntimeError(C.arch_reason(head_dim_qk, head_dim_v, dtype, cc, smem) or f"no {kind} configuration")
    if params is not None and (params.block_m or params.block_n):
        cands = list(
            dict.fromkeys(
                C.KernelConfig(params.block_m or c.block_m, params.block_n or c.block_n, c.num_warps, c.num_stages)
                for c in cands
            )
        )
    return cands


_CHOSEN: dict = {}
register_cache("kernels.launch.chosen_configs", _CHOSEN.clear, _CHOSEN.__len__)


def _table_traits(bias_kind: int, params: KernelParams, prob: "_Problem") -> dict:
    """What the config table keys a call on besides dtype, head dims and band (which
    select_config reads from params), the same for every pass: ``extras`` (a bias, a mask or
    dropout) and ``grouped`` (GQA / MQA)."""
    return dict(extras=bias_kind != 0 or params.dropout_p > 0, grouped=prob.group > 1)


def _out_of_resources(e: Exception) -> bool:
    return type(e).__name__ in ("OutOfResources", "OutOfResourcesError") or "out of resource" in str(e).lower()


def _launch_one(kernel, grid, args, constexprs, num_warps, num_stages, **options):
    """One launch: compiled kernels are relaunched directly (compiled_cache.py); the
    interpreter always goes through Triton."""
    if is_interpreter():
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **options)
    else:
        COMPILED.launch(kernel, grid, args, constexprs, num_warps, num_stages, **options)


def _launch(kind, kernel, grid, args, kw, cands, key, tail=None):
    """Launch with the first candidate that compiles within the device's resources
    (PyTorch-style loop over candidate kernels); the winner is remembered per key and
    constexpr values (a bias tile or dropout changes what fits).  ``tail(cfg)``: the
    (last positional arguments, their constexprs) that depend on the candidate beyond its
    tiles (the forward's sub-tiles and host-built descriptors)."""
    key = key + (tuple(cands), tuple(kw.values()))
    start = _CHOSEN.get(key, 0)
    last = None
    for idx in range(start, len(cands)):
        cfg = cands[idx]
        try:
            constexprs = dict(kw, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
            cfg_args = args
            if tail is not None:
                extra_args, extra_kw = tail(cfg)
                cfg_args = args + extra_args
                constexprs.update(extra_kw)
            _run_with_scratch(
                args[0].device,
                kw.get("USE_DESC", False),
                _launch_one,
                kernel,
                grid(cfg),
                cfg_args,
                constexprs,
                cfg.num_warps,
                cfg.num_stages,
            )
            _CHOSEN[key] = idx
            return cfg
        except Exception as e:  # noqa: BLE001
            if not _out_of_resources(e):
                raise
            last = e
    raise RuntimeError(f"no {kind} configuration fits this device: {last}")


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a ConstexprFunction in recent Triton: ~6 us per host-side call (3.9, CPU)
    return -(-a // b)


def bh_chunks(n: int, inner: int, limit: int):
    """Split the flattened (batch x heads) grid axis of length n into launches of at most
    `limit` programs; chunks are whole batches (multiples of `inner`) when inner <= limit.
    Yields (start, count)."""
    step = (limit // inner) * inner if inner <= limit else limit
    step = max(1, step)
    start = 0
    while start < n:
        cnt = min(step, n - start)
        yield start, cnt
        start += cnt


def num_splits_heuristic(
    batch_heads: int,
    num_m_blocks: int,
    num_n_blocks: int,
    num_sms: int,
    deterministic: bool,
    max_splits: int = MAX_SPLITS,
) -> int:
    """How many ways to split the key range of the dQ pass (fp32 workspace + atomics).

    1 when deterministic; else split only when batch*heads*query-tiles fills less than two
    waves of the SMs, keeping at least two key tiles per split."""
    if deterministic or num_n_blocks <= 1:
        return 1
    ctas = max(1, batch_heads * num_m_blocks)
    target = 2 * max(1, num_sms)
    if ctas >= target:
        return 1
    s = min(_cdiv(target, ctas), num_n_blocks // 2, max_splits)
    return max(1, s)


def group_splits_heuristic(
    batch_kv_heads: int, num_n_blocks: int, group: int, num_sms: int, deterministic: bool = False
) -> int:
    """How many ways to split the query heads of a GQA/MQA group in the dK/dV pass (each
    split writes an fp32 partial dK/dV, summed in a fixed order).  1 when deterministic or
    when batch*kv_heads*key-tiles already fills two waves of the SMs."""
    if deterministic or group <= 1:
        return 1
    ctas = max(1, batch_kv_heads * num_n_blocks)
    target = 2 * max(1, num_sms)
    if ctas >= target:
        return 1
    return max(1, min(group, _cdiv(target, ctas)))


# --------------------------------------------------------------------------- argument prep


class _Problem:
    """Shapes and strides of one call (dense or varlen), normalised for the kernels."""

    def __init__(self, q, k, v, cu_q, cu_k, max_sq, max_sk):
        self.varlen = cu_q is not None
        if self.varlen:
            if cu_k is None or q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
                raise ValueError("varlen: query/key/value must be (total, H, D) with cu_seqlens_q and cu_seqlens_k")
            self.B = cu_q.numel() - 1
            self.Hq, self.Dqk = q.shape[1], q.shape[2]
            self.Hkv, self.Dv = k.shape[1], v.shape[2]
            if max_sq is None or max_sk is None:
                raise ValueError("varlen: max_seqlen_q and max_seqlen_k are required (python ints)")
            self.Sq, self.Sk = int(max_sq), int(max_sk)
            self.q_strides = (0, q.stride(1), q.stride(0))
            self.k_strides = (0, k.stride(1), k.stride(0))
            self.v_strides = (0, v.stride(1), v.stride(0))
            self.out_shape = (q.shape[0], self.Hq, self.Dv)
            self.lse_shape = (q.shape[0], self.Hq)
            self.total_q = q.shape[0]
        else:
            if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
                raise ValueError("dense: query/key/value must be (B, H, S, D)")
            self.B, self.Hq, self.Sq, self.Dqk = q.shape
            self.Hkv, self.Sk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
            self.q_strides = q.stride()[:3]
            self.k_strides = k.stride()[:3]
            self.v_strides = v.stride()[:3]
            self.out_shape = (self.B, self.Hq, self.Sq, self.Dv)
            self.lse_shape = (self.B, self.Hq, self.Sq)
            if k.shape[0] != self.B or v.shape[0] != self.B or v.shape[2] != self.Sk or v.shape[1] != self.Hkv:
                raise ValueError(f"inconsistent shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
        if k.shape[-1] != self.Dqk:
            raise ValueError(f"key head dim {k.shape[-1]} != query head dim {self.Dqk}")
        if self.Hkv == 0 or self.Hq % self.Hkv != 0:
            if not (self.Hq == 0 and self.Hkv == 0):
                raise ValueError(f"query heads {self.Hq} not a multiple of key/value heads {self.Hkv}")
        self.group = self.Hq // self.Hkv if self.Hkv else 1

    def lse_strides(self):
        if self.varlen:
            return (0, 1, self.Hq)
        return (self.Hq * self.Sq, self.Sq, 1)

    def out_strides(self, o):
        if self.varlen:
            return (0, o.stride(1), o.stride(0))
        return (o.stride(0), o.stride(1), o.stride(2))

    def empty(self) -> bool:
        if self.varlen:
            return self.B == 0 or self.Hq == 0 or self.total_q == 0 or self.Sq == 0
        return self.B == 0 or self.Hq == 0 or self.Sq == 0 or self.Sk == 0


def _last_contig(t):
    if t is None:
        return None
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return t


def _common(q, params, prob):
    """Constexpr arguments shared by every kernel of a call (memoised: built on every launch)."""
    return _common_constexprs(
        q.dtype,
        prob.Dqk,
        prob.Dv,
        prob.varlen,
        bool(params.align_bottom_right),
        params.window_left >= 0,
        params.window_right >= 0,
        INTERPRETER_FP32_PRODUCTS,
    )


@functools.lru_cache(maxsize=256)
def _common_constexprs(dtype, dqk, dv, varlen, align_br, has_wl, has_wr, fp32_products):
    interp = is_interpreter()
    return dict(
        HEAD_DQK=dqk,
        HEAD_DV=dv,
        IS_VARLEN=varlen,
        ALIGN_BR=align_br,
        HAS_WL=has_wl,
        HAS_WR=has_wr,
        BLOCK_DQK=C.block_d(dqk),
        BLOCK_DV=C.block_d(dv),
        DOT_UPCAST=interp and dtype != torch.float32,
        DOT_IEEE=dtype == torch.float32,
        ROUND_P=not (interp and fp32_products),
    )


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest even):
    there, bf16 results are written as fp32 and rounded by torch on the host."""
    return torch.float32 if dtype == torch.bfloat16 and is_interpreter() else dtype


def draw_seed(device) -> torch.Tensor:
    """The dropout seed: one int64 drawn from the device's torch generator (no host sync)."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


def _grid_limit(params: KernelParams) -> int:
    return params.max_grid or MAX_GRID_YZ


# Host-built descriptors cost ~20-30 us of host time per call on the H100 machine (Triton's
# launcher encodes each tensormap): used only for calls whose kernel runs long enough to hide
# that, at least this many query-key-dim products B * Hq * Sq * Sk * D (~40 us; experiment 30).
HOST_KV_MIN_WORK = 1 << 32


def _rows_layout(*tensors) -> int:
    """1: every tensor is (B, H, S, D) in memory (contiguous), 2: (B, S, H, D) memory seen as
    (B, H, S, D), the layout of a model that keeps tokens first; 0: anything else."""
    if all(t.is_contiguous() for t in tensors):
        return 1
    if all(t.transpose(1, 2).is_contiguous() for t in tensors):
        return 2
    return 0


def _row_matrix(t: torch.Tensor, rows_layout: int) -> tuple[int, int]:
    """(rows, row length) of ``t`` (B, H, S, D) seen as the matrix of its rows layout (see
    _rows_layout): (B * H * S, D) for 1, (B * S, H * D) for 2 (a head's columns at h * D)."""
    B, H, S, D = t.shape
    return (B * H * S, D) if rows_layout == 1 else (B * S, H * D)


def host_kv_descriptors(k, v, prob: "_Problem", uses_descriptors: bool, block_dqk: int, block_dv: int):
    """For dense K/V read through descriptors, with D equal to its block, laid out as
    (B, Hkv, Sk, D) or (B, Sk, Hkv, D) in memory, in a call of at least HOST_KV_MIN_WORK:
    ``descriptors(cfg)`` -> (K descriptor, V descriptor, KV_HOST) built here over the rows of
    K/V as a matrix ((B * Hkv * Sk, D), KV_HOST=1, or (B * Sk, Hkv * D), KV_HOST=2), or None
    when the configuration keeps in-kernel ones or Sk is not a multiple of its key tile (a
    tile would reach into the next head or sequence).  None when K/V are not read that way.
    A host descriptor saves each program the tensormap write and fence of an in-kernel one
    (experiment 30)."""
    if (
        not uses_descriptors
        or TensorDescriptor is None
        or prob.varlen
        or prob.Dqk != block_dqk
        or prob.Dv != block_dv
        or prob.B * prob.Hkv * prob.Sk >= 2**31
        or prob.B * prob.Hq * prob.Sq * prob.Sk * max(prob.Dqk, prob.Dv) < HOST_KV_MIN_WORK
    ):
        return None
    layout = _rows_layout(k, v)
    if layout == 0:
        return None
    (k_rows, k_len), (v_rows, v_len) = _row_matrix(k, layout), _row_matrix(v, layout)

    def descriptors(cfg):
        block_n = cfg.block_n
        if not cfg.host_kv or prob.Sk % block_n:
            return None
        # the base is k / v itself (Triton reads only its address and dtype): a relaunch
        # recognises it (ForwardPlan)
        return (
            TensorDescriptor(k, [k_rows, k_len], [k_len, 1], [block_n, prob.Dqk]),
            TensorDescriptor(v, [v_rows, v_len], [v_len, 1], [block_n, prob.Dv]),
            layout,
        )

    return descriptors


# The warp-specialised forward (forward_ws.py) runs calls of at least this much work, as the
# host-built descriptors above (it builds four of them per call).
WS_MIN_WORK = HOST_KV_MIN_WORK


# The Gluon kernels are written for, compiled and verified with Triton 3.6's Gluon API (the H100
# machine's Triton).  Gluon is experimental and changes between releases: Triton 3.9 removed
# tma.async_copy_global_to_shared (async_load replaces it), so the kernels do not compile there.
# Other versions keep the tl kernels until the Gluon ones are ported and verified on them.
GLUON_TRITON_VERSIONS = ("3.6.",)


def gluon_reason() -> str | None:
    """None when this Triton runs the Gluon kernels, else why not."""
    if _attn_fwd_ws is None:
        return "this Triton has no Gluon"
    if not triton.__version__.startswith(GLUON_TRITON_VERSIONS):
        tested = ", ".join(v.rstrip(".") for v in GLUON_TRITON_VERSIONS)
        return (
            f"Triton {triton.__version__}: the Gluon kernels are written for Triton {tested}'s Gluon API, "
            "which changes between releases"
        )
    return None


# Narrower windows keep the tl kernels: (256, 256) ran 0.99x forward and 0.89x forward+backward
# on the Gluon kernels, (1024, 0) 1.10x / 1.20x (H100, experiment 53).
WS_MIN_WINDOW = 1024


def ws_forward_reason(
    prob: "_Problem",
    bias_reason: str | None,
    params: KernelParams,
    dtype: torch.dtype,
    cc: tuple[int, int],
    uses_descriptors: bool,
    q_rows: int,
    kv_rows: int,
) -> str | None:
    """None when the warp-specialised sm90 kernels (forward, dK/dV, dQ; the forward only where
    :func:`ws_forward_serves` says) compute this call, else why not (one line).
    ``bias_reason``: :func:`ws_bias_reason` of the call's bias; ``uses_descriptors``:
    :func:`use_descriptors` of q, k, v; ``q_rows`` / ``kv_rows``: :func:`_rows_layout` of q and
    of (k, v)."""
    banded = params.window_left >= 0 or params.window_right >= 0
    cfg = C.WS_FWD_CONFIGS.get(prob.Dqk)
    gluon = gluon_reason()
    if gluon is not None:
        return gluon
    if cc != (9, 0):
        return f"compute capability {cc[0]}.{cc[1]}: the warp-specialised forward is sm90 only"
    if not uses_descriptors:
        return "no TMA descriptors for this call (dtype, 16-byte alignment, interpreter or descriptors=0)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype}: float16 or bfloat16 only"
    if cfg is None or prob.Dv != prob.Dqk:
        return f"head dims {prob.Dqk}/{prob.Dv}: equal and one of {sorted(C.WS_FWD_CONFIGS)} only"
    if prob.varlen:
        return "varlen: dense calls only"
    if bias_reason is not None:
        return bias_reason
    if params.dropout_p > 0:
        return "dropout: not in the warp-specialised kernels"
    if banded and prob.Sq != prob.Sk:
        return "window or causal with Sq != Sk: banded calls with Sq == Sk only"
    width = (
        math.inf if params.window_left < 0 or params.window_right < 0 else params.window_left + params.window_right + 1
    )
    if width < WS_MIN_WINDOW:
        return (
            f"window ({params.window_left}, {params.window_right}): narrower than {WS_MIN_WINDOW} keys, "
            "the tl kernels' smaller tiles waste less"
        )
    if params.scale <= 0:
        return f"scale {params.scale}: positive only (the running max is taken before scaling)"
    if params.block_m or params.block_n:
        return "tiles forced by the call's parameters"
    # a program's rows (forward, dQ) and keys (dK/dV), and the forward's key tile, cover whole heads
    rows, keys = 2 * _WG_ROWS, math.lcm(2 * _WG_ROWS, cfg.block_n)
    if prob.Sq % rows or prob.Sk % keys:
        return f"Sq={prob.Sq}, Sk={prob.Sk}: multiples of {rows} and {keys} only"
    if q_rows == 0 or kv_rows == 0:
        return "memory layout: query and key/value each (B, H, S, D) or (B, S, H, D) contiguous"
    if prob.B * prob.Hq > _grid_limit(params) or prob.B * prob.Hq * prob.Sq >= 2**31:
        return "grid or row count past the kernel's 32-bit limits"
    if prob.B * prob.Hq * prob.Sq * prob.Sk * prob.Dqk < WS_MIN_WORK:
        return f"below WS_MIN_WORK ({WS_MIN_WORK} query-key-dim products): the host descriptors cost more"
    return None


def _ws_route(q, k, v, bias_reason: str | None, params: KernelParams, prob: "_Problem", uses_descriptors: bool):
    """(q rows layout, k/v rows layout) when the warp-specialised kernels serve this call, else None.
    ``bias_reason``: :func:`ws_bias_reason` of the call's bias."""
    if not uses_descriptors:
        return None
    q_rows, kv_rows = _rows_layout(q), _rows_layout(k, v)
    if (
        ws_forward_reason(
            prob, bias_reason, params, q.dtype, device_info(q.device)[0], uses_descriptors, q_rows, kv_rows
        )
        is not None
    ):
        return None
    return q_rows, kv_rows


@functools.lru_cache(maxsize=16)
def _ws_smem_layout(rows: int, cols: int, dtype: torch.dtype):
    return _gl.NVMMASharedLayout.get_default_for([rows, cols], _gl.bfloat16 if dtype == torch.bfloat16 else _gl.float16)


def _rows_descriptor(t: torch.Tensor, rows_layout: int, block_rows: int):
    """Gluon descriptor over ``t`` (B, H, S, D) as the matrix of its rows layout, tiles of one head."""
    rows, width = _row_matrix(t, rows_layout)
    D = t.shape[3]
    return _GluonDescriptor(t, [rows, width], [width, 1], [block_rows, D], _ws_smem_layout(block_rows, D, t.dtype))


class _WsBias(NamedTuple):
    """A bias the warp-specialised kernels read (:func:`ws_bias_reason`): the tensor, its row
    stride, the rows of its (rows, Sk) matrix, its rows per batch and per head, and whether
    the programs run batch-fastest (:func:`batch_minor`)."""

    tensor: torch.Tensor
    row_stride: int
    rows: int
    batch_rows: int
    head_rows: int
    batch_minor: bool

    @classmethod
    def of(cls, bias_t, bias_strides, prob: "_Problem") -> "_WsBias":
        batch_rows, head_rows = ws_bias_rows(bias_strides)
        rows = (prob.B - 1) * batch_rows + (prob.Hq - 1) * head_rows + prob.Sq
        return cls(bias_t, bias_strides[2], rows, batch_rows, head_rows, batch_minor(1, bias_strides, prob))

    def descriptor(self, block_rows: int, block_cols: int, seq_k: int):
        """Gluon descriptor over the bias matrix, tiles of (block_rows, block_cols)."""
        return _GluonDescriptor(
            self.tensor,
            [self.rows, seq_k],
            [self.row_stride, 1],
            [block_rows, block_cols],
            _ws_smem_layout(block_rows, block_cols, self.tensor.dtype),
        )


def _bias_args(bias: "_WsBias | None", block_rows: int, block_cols: int, seq_k: int) -> tuple:
    """(descriptor or None, rows per batch, rows per head): a Gluon kernel's bias arguments."""
    if bias is None:
        return None, 0, 0
    return bias.descriptor(block_rows, block_cols, seq_k), bias.batch_rows, bias.head_rows


# The Gluon kernels' launch: 4 warps in the default (first consumer) partition; their pipelines
# are written out.  Launched through compiled_cache like the tl kernels:
# Triton's own launch path costs ~150 us of host time per call (probe of session 12).
_WS_WARPS, _WS_STAGES = 4, 3  # num_stages: Triton's default, as Triton's own launch had


def _ws_constexprs(params: KernelParams, bias: "_WsBias | None", **rest) -> dict:
    """Constexprs of a Gluon kernel launch: the band, the bias and ``rest`` (row layouts, tiles)."""
    return dict(
        WINDOW_LEFT=params.window_left,
        WINDOW_RIGHT=params.window_right,
        HAS_BIAS=bias is not None,
        BATCH_MINOR=bias is not None and bias.batch_minor,
        **rest,
    )


def _forward_ws(
    q, k, v, out, lse, params: KernelParams, prob: "_Problem", q_rows: int, kv_rows: int, bias: _WsBias | None = None
):
    cfg = C.WS_FWD_CONFIGS[prob.Dqk]
    rows = cfg.consumers * _WG_ROWS
    n_m = _cdiv(prob.Sq, rows)
    bias_desc, batch_rows, head_rows = _bias_args(bias, rows, cfg.block_n, prob.Sk)
    _launch_one(
        _attn_fwd_ws,
        (n_m, prob.B * prob.Hq),
        (
            _rows_descriptor(q, q_rows, _WG_ROWS),
            _rows_descriptor(k, kv_rows, cfg.block_n),
            _rows_descriptor(v, kv_rows, cfg.block_n),
            _rows_descriptor(out, 1, _WG_ROWS),
            bias_desc,
            lse if lse is not None else out,
            params.scale * LOG2E,
            prob.Sq,
            prob.Sk,
            prob.Hq,
            prob.group,
            n_m,
            batch_rows,
            head_rows,
        ),
        _ws_constexprs(
            params,
            bias,
            Q_ROWS=q_rows,
            KV_ROWS=kv_rows,
            STORE_LSE=lse is not None,
            BLOCK_N=cfg.block_n,
            STAGES=cfg.stages,
            BIAS_STAGES=cfg.bias_stages,
            CONSUMER_REGS=cfg.consumer_regs,
            NUM_WG=cfg.consumers,
        ),
        _WS_WARPS,
        _WS_STAGES,
        maxnreg=cfg.max_regs,
    )


def ws_forward_serves(cfg: "C.WsConfig", has_bias: bool, params: KernelParams) -> bool:
    """Whether the warp-specialised forward runs a call on its route (ws_forward_reason): its
    config's ``forward`` and ``forward_scope`` ("dense": no bias, not causal, no window)."""
    banded = params.window_left >= 0 or params.window_right >= 0
    return cfg.forward and (cfg.forward_scope == "all" or not (has_bias or banded))


# Swizzle (bytes) of the fused dQ's fp32 partial tiles: 64 ran 1-4% faster than 128 (the default
# for fp32, one excess shared-memory wavefront per store) and 32 (none, but 8 TMA boxes per tile)
# (experiment 54)
DQ_ACC_SWIZZLE = 64


def _dq_acc_descriptor(dq_acc: torch.Tensor, cols: int):
    """Gluon descriptor over the fused dQ's fp32 (B * Hq * Sq, D) rows, tiles of (64, ``cols``):
    each consumer warpgroup's partial (forward_ws.py, FUSE_DQ: D / 2 with 64-row query tiles, D
    with 128)."""
    D = dq_acc.shape[-1]
    layout = _gl.NVMMASharedLayout(DQ_ACC_SWIZZLE, 32, 2)
    return _GluonDescriptor(dq_acc, [dq_acc.numel() // D, D], [D, 1], [_WG_ROWS, cols], layout)


# The fused dQ against the separate dQ pass, whole backward, bf16 d128, H100, 7 interleaved rounds
# (experiment 54): dense 1k 0.96x, 2k 1.01x, 4k 1.04x, 8k 1.05x, 16k 1.09x, GQA 16/4 4k 1.04x and
# 8k 1.10x; causal 0.96-0.97x; not timed with a bias or a window.
FUSE_DQ_MIN_KEYS = 4096


def fuse_dq(params: KernelParams, prob: "_Problem", bias: "_WsBias | None") -> bool:
    """Whether the warp-specialised backward computes dQ inside its dK/dV pass: where it was
    measured faster (no bias, Sk >= FUSE_DQ_MIN_KEYS, no band unless the head dim's config says
    so) and the call does not ask for determinism (its reduce-adds land in any order)."""
    cfg = C.WS_BWD_CONFIGS[prob.Dqk]
    banded = params.window_left >= 0 or params.window_right >= 0
    return (
        cfg.fuse_dq
        and (cfg.fuse_dq_banded or not banded)
        and not params.deterministic
        and bias is None
        and prob.Sk >= FUSE_DQ_MIN_KEYS
    )


def _dkdv_ws(
    q,
    k,
    v,
    do,
    lse,
    delta,
    params: KernelParams,
    prob: "_Problem",
    q_rows: int,
    kv_rows: int,
    do_rows: int,
    bias: _WsBias | None = None,
    fuse_dq: bool = False,
):
    """(dK, dV, dQ or None) of a call the warp-specialised forward serves (same scope, dO in a
    row layout); ``fuse_dq``: dQ too, added by TMA reduce-add into a zeroed fp32 buffer."""
    cfg = C.WS_BWD_CONFIGS[prob.Dqk]
    dk, dv = torch.empty(k.shape, device=k.device, dtype=k.dtype), torch.empty(v.shape, device=v.device, dtype=v.dtype)
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if fuse_dq else None
    # keys per consumer warpgroup, query rows per tile (a bias tile of 128 rows spills at d64)
    w, m = _WG_ROWS, (cfg.bwd_block_m if bias is None else _WG_ROWS)
    bias_desc, batch_rows, head_rows = _bias_args(bias, m, 2 * w, prob.Sk)
    # a warpgroup's dQ partial: half the columns of a 64-row tile, or every column of its half of 128
    dq_desc = _dq_acc_descriptor(dq_acc, prob.Dqk if m == 2 * w else prob.Dqk // 2) if fuse_dq else None
    _launch_one(
        _attn_bwd_dkdv_ws,
        (prob.Sk // (2 * w), prob.B * prob.Hkv),
        (
            _rows_descriptor(q, q_rows, m),
            _rows_descriptor(k, kv_rows, w),
            _rows_descriptor(v, kv_rows, w),
            _rows_descriptor(do, do_rows, m),
            _rows_descriptor(dk, 1, w),
            _rows_descriptor(dv, 1, w),
            bias_desc,
            lse,
            delta,
            dq_desc,
            params.scale * LOG2E,
            params.scale,
            prob.Sq,
            prob.Sk,
            prob.Hq,
            prob.group,
            batch_rows,
            head_rows,
        ),
        _ws_constexprs(
            params,
            bias,
            Q_ROWS=q_rows,
            KV_ROWS=kv_rows,
            DO_ROWS=do_rows,
            FUSE_DQ=fuse_dq,
            STAGES=cfg.stages,
            CONSUMER_REGS=cfg.consumer_regs,
        ),
        _WS_WARPS,
        _WS_STAGES,
        maxnreg=cfg.max_regs,
    )
    return dk, dv, (dq_acc.to(q.dtype) if fuse_dq else None)


def _dq_ws(
    q,
    k,
    v,
    do,
    lse,
    delta,
    params: KernelParams,
    prob: "_Problem",
    q_rows: int,
    kv_rows: int,
    do_rows: int,
    bias: _WsBias | None = None,
) -> torch.Tensor:
    """dQ of a call the warp-specialised forward serves, over the forward's K/V ring."""
    cfg = C.WS_DQ_CONFIGS[prob.Dqk]
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    n_m = prob.Sq // (2 * _WG_ROWS)
    bias_desc, batch_rows, head_rows = _bias_args(bias, 2 * _WG_ROWS, cfg.block_n, prob.Sk)
    _launch_one(
        _attn_bwd_dq_ws,
        (n_m, prob.B * prob.Hq),
        (
            _rows_descriptor(q, q_rows, _WG_ROWS),
            _rows_descriptor(k, kv_rows, cfg.block_n),
            _rows_descriptor(v, kv_rows, cfg.block_n),
            _rows_descriptor(do, do_rows, _WG_ROWS),
            _rows_descriptor(dq, 1, _WG_ROWS),
            bias_desc,
            lse,
            delta,
            params.scale * LOG2E,
            params.scale,
            prob.Sq,
            prob.Sk,
            prob.Hq,
            prob.group,
            n_m,
            batch_rows,
            head_rows,
        ),
        _ws_constexprs(
            params,
            bias,
            Q_ROWS=q_rows,
            KV_ROWS=kv_rows,
            DO_ROWS=do_rows,
            BLOCK_N=cfg.block_n,
            STAGES=cfg.stages,
            BIAS_STAGES=cfg.bias_stages,
            CONSUMER_REGS=cfg.consumer_regs,
        ),
        _WS_WARPS,
        _WS_STAGES,
        maxnreg=cfg.max_regs,
    )
    return dq


def _check_inputs(q, k, v):
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query/key/value dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    r = C.static_reason(q.shape[-1], v.shape[-1], q.dtype)
    if r:
        raise ValueError(r)


# --------------------------------------------------------------------------- forward


def attention_forward(
    q, k, v, bias, params: KernelParams, cu_q=None, cu_k=None, max_sq=None, max_sk=None, need_lse: bool = True
):
    """Returns (out, lse (fp32, natural log; None unless need_lse), seed (int64 (1,) or empty)).
    Inference calls pass need_lse=False: the kernel then writes no logsumexp."""
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    _check_inputs(q, k, v)
    prob = _Problem(q, k, v, cu_q, cu_k, max_sq, max_sk)
    dev = q.device
    seed = draw_seed(dev) if params.dropout_p > 0 else torch.empty(0, device=dev, dtype=torch.int64)
    out = torch.empty(prob.out_shape, device=dev, dtype=_store_dtype(q.dtype))
    lse = torch.empty(prob.lse_shape, device=dev, dtype=torch.float32) if need_lse else None
    if prob.empty() or prob.Sk == 0 or prob.Hkv == 0 or (prob.varlen and k.shape[0] == 0):
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        return _as_dtype(out, q.dtype), lse, seed
    kind, bt, bstr, _ = bias_layout(bias, (prob.B, prob.Hq, prob.Sq, prob.Sk))
    # Q is checked too: it goes through a descriptor beside a bias descriptor (forward.py)
    desc = use_descriptors(params, (q, k, v), dev, loop_len=prob.Sk)
    # (out is q's dtype except for bf16 under the CPU interpreter, which runs no Gluon kernel)
    bias_reason = ws_bias_reason(kind, bt, bstr, q.dtype, desc)
    route = _ws_route(q, k, v, bias_reason, params, prob, desc) if out.dtype == q.dtype else None
    if route is not None and ws_forward_serves(C.WS_FWD_CONFIGS[prob.Dqk], kind != 0, params):
        _forward_ws(q, k, v, out, lse, params, prob, *route, bias=_WsBias.of(bt, bstr, prob) if kind else None)
        return out, lse, seed
    cands = select_config(C.FWD, prob.Dqk, prob.Dv, q.dtype, dev, params, **_table_traits(kind, params, prob))
    # A row whose first key block may be entirely masked needs the -inf-safe running max.
    may_empty = (
        kind != 0
        or params.window_left >= 0
        or (
            params.window_right >= 0
            and params.align_bottom_right
            and (prob.varlen or prob.Sk - prob.Sq + params.window_right < 0)
        )
    )
    dummy = q
    args = (
        q,
        k,
        v,
        bt if bt is not None else dummy,
        out,
        lse if need_lse else out,
        seed if seed.numel() else dummy,
        cu_q if cu_q is not None else dummy,
        cu_k if cu_k is not None else dummy,
        params.scale * LOG2E,
        float(params.dropout_p),
        *prob.q_strides,
        *prob.k_strides,
        *prob.v_strides,
        *bstr,
        *prob.out_strides(out),
        *(prob.lse_strides() if need_lse else (0, 0, 0)),
        prob.Hq,
        prob.B,
        prob.group,
        prob.Sq,
        prob.Sk,
    )
    kw = dict(
        _common(q, params, prob),
        **bias_constexprs(kind, bt, bstr, prob, desc),
        HAS_DROPOUT=params.dropout_p > 0,
        USE_DESC=desc,
        MAY_EMPTY=may_empty,
        SCALE_POS=params.scale > 0,
        STORE_LSE=need_lse,
    )
    n_bh = prob.B * prob.Hq
    key = ("fwd", dev, q.dtype, prob.Dqk, prob.Dv, desc)
    kv_descriptors = host_kv_descriptors(k, v, prob, desc, kw["BLOCK_DQK"], kw["BLOCK_DV"])

    def fwd_tail(cfg):
        kv = kv_descriptors(cfg) if kv_descriptors is not None else None
        return (kv[:2] if kv else (0, 0)), {"SUBTILES": cfg.subtiles, "KV_HOST": kv[2] if kv else 0}

    for start, cnt in bh_chunks(n_bh, prob.Hq, _grid_limit(params)):

        def grid(cfg, cnt=cnt):
            return (_cdiv(prob.Sq, cfg.block_m), cnt)

        cfg = _launch(
            C.FWD, _attn_fwd, grid, args + (start, params.window_left, params.window_right), kw, cands, key, fwd_tail
        )
        cands = [cfg]
    return _as_dtype(out, q.dtype), lse, seed


class _Replay:
    """Kernel launches captured during one call (``COMPILED.capture``), relaunched over the
    tensors of a later call of the same signature.  Every tensor argument and every host-built
    descriptor's base is found by identity in the call's ``pool`` (its inputs and outputs in a
    fixed order); :meth:`capture` returns None when a launch cannot be repeated that way (a
    tensor outside the pool: a dropout seed, a workspace, a converted output; or a launch
    without a relaunch entry).  Outputs are the caller's to allocate: each replay gets fresh
    ones, which the captured kernels must write whole."""

    __slots__ = ("steps", "device", "addresses")

    def __init__(self, steps: tuple, device: torch.device, addresses: bool):
        self.steps, self.device, self.addresses = steps, device, addresses

    @classmethod
    def capture(cls, launches: list, pool: tuple, device: torch.device) -> "_Replay | None":
        def index(t):
            return next((i for i, x in enumerate(pool) if x is t), None)

        steps = []
        for entry, grid, args, constexprs in launches:
            if entry is None:
                return None
            sources = []  # the leading tensors, as pool indices
            for a in args:
                if not isinstance(a, torch.Tensor):
                    break
                idx = index(a)
                if idx is None:
                    return None
                sources.append(idx)
            # (argument position, pool index, descriptor or None for the tensor itself): host-built
            # descriptors (the tl forward's K/V, every Gluon operand) and pointers after the leading ones
            patches = []
            for pos, a in enumerate(args[len(sources) :], len(sources)):
                desc = is_descriptor(a)
                if desc or isinstance(a, torch.Tensor):
                    idx = index(a.base if desc else a)
                    if idx is None:
                        return None
                    patches.append((pos, idx, a if desc else None))
            direct = (
                None
                if is_interpreter()
                else DirectLaunch.build(
                    entry,
                    grid,
                    tuple(args),
                    dict(enumerate(sources)) | {pos: i for pos, i, d in patches if d is None},
                    {pos: i for pos, i, d in patches if d is not None},
                )
            )
            steps.append(
                (
                    entry,
                    tuple(grid),
                    tuple(sources),
                    tuple(args[len(sources) :]),
                    tuple(patches),
                    constexprs.get("USE_DESC", False),
                    direct,
                )
            )
        # addresses as ints for the compiled launcher; the interpreter (CPU tests) needs tensors
        return cls(tuple(steps), device, not is_interpreter()) if steps else None

    @property
    def patches(self) -> tuple:
        """Every step's patches (tests read which descriptors are rebuilt)."""
        return tuple(p for step in self.steps for p in step[4])

    def __call__(self, pool: tuple) -> None:
        # Triton's launcher takes an int as the address itself; for a tensor it calls data_ptr()
        # and cuPointerGetAttribute, once per pointer argument (the dummies repeat q)
        addrs = [t.data_ptr() for t in pool] if self.addresses else pool
        for entry, grid, sources, rest, patches, desc, direct in self.steps:
            if direct is not None:  # descriptors' tensormaps kept per address (compiled_cache.DirectLaunch)
                direct(addrs, pool)
                continue
            args = (*[addrs[i] for i in sources], *rest)
            if patches:  # descriptors and later pointers: the same ones over the new tensors
                args = list(args)
                for pos, i, d in patches:
                    args[pos] = addrs[i] if d is None else rebase(d, pool[i])
            _run_with_scratch(self.device, desc, relaunch, entry, grid, args)


def _contiguous(*tensors) -> bool:
    return all(t is not None and t.is_contiguous() for t in tensors)


class ForwardPlan:
    """Repeated inference forwards of one call signature: dense query/key/value with the
    same shapes, strides, dtype, device and 16-byte alignment, no bias, given params.

    The first call runs :func:`attention_forward` and captures its kernel launches; later
    calls allocate the output (no logsumexp is written) and relaunch the compiled kernels with
    the new tensors (:class:`_Replay`): none of the launch glue above runs again (the
    dispatcher's fast path caches a plan per signature, docs/experiments/perf-notes.md experiment 17).  A
    call whose launches touch another tensor (a dropout seed, a dtype conversion) or that
    launches nothing (an empty problem) keeps the full path every time.  Host-built
    descriptors (the tl forward's K/V, every operand of the Gluon forward) are rebuilt over
    the new tensors."""

    __slots__ = ("params", "device", "launch", "out_shape", "out_like_query")

    def __init__(self, query, params: KernelParams):
        self.params, self.device, self.launch = params, query.device, None

    def __call__(self, q, k, v):
        launch = self.launch
        if launch is None or _hooks_installed():
            return self._first(q, k, v)
        # empty_like: one C call without torch.empty's argument parsing (~1 us of host time)
        out = (
            torch.empty_like(q)
            if self.out_like_query
            else torch.empty(self.out_shape, device=self.device, dtype=q.dtype)
        )
        launch((q, k, v, out))
        return out

    def _first(self, q, k, v):
        with COMPILED.capture() as launches:
            out, _, _ = attention_forward(q, k, v, None, self.params, need_lse=False)
        if self.launch is None and _contiguous(out):
            self.out_shape = tuple(out.shape)
            # the same layout from empty_like: q and out both contiguous of one shape and dtype
            self.out_like_query = out.shape == q.shape and out.dtype == q.dtype and q.is_contiguous()
            self.launch = _Replay.capture(launches, (q, k, v, out), self.device)
        return out


# Launch constexprs of kernels that add into a buffer zeroed before them: the dQ pass split over
# keys (fp32 atomics) and the dK/dV pass with dQ fused in (TMA reduce-adds).
_ADDS_INTO_ZEROED = ("ATOMIC", "FUSE_DQ")


class TrainingPlan:
    """Repeated training calls of one signature: dense query/key/value with the same shapes,
    strides, dtype, device and 16-byte alignment, no bias, no dropout, given params (the
    dispatcher's fast path keeps one per signature).  The first forward and the first backward
    run the full launch glue and capture their kernel launches; later ones allocate the outputs
    and relaunch them over the new tensors (:class:`_Replay`; the glue cost ~1 ms of host time
    per forward+backward on the H100 machine, docs/experiments/perf-notes.md experiment 46).  The backward
    is replayed for a dO of the captured shape, strides, dtype and alignment, unless one of its
    launches adds into a buffer zeroed before it (:data:`_ADDS_INTO_ZEROED`: a replay's fresh
    outputs are not zeroed); anything else keeps the full path."""

    __slots__ = ("params", "device", "fwd", "fwd_outputs", "bwd", "bwd_key", "bwd_outputs")

    def __init__(self, query, params: KernelParams):
        if params.dropout_p > 0:
            raise ValueError("TrainingPlan: dropout draws a seed per call (use triton_attention)")
        self.params, self.device = params, query.device
        self.fwd = self.bwd = self.bwd_key = None

    def _empty(self, outputs):
        return [torch.empty(shape, device=self.device, dtype=dtype) for shape, dtype in outputs]

    def forward(self, q, k, v):
        """(out, lse) as :func:`attention_forward` returns them."""
        if self.fwd is not None and not _hooks_installed():
            out, lse = self._empty(self.fwd_outputs)
            self.fwd((q, k, v, out, lse))
            return out, lse
        with COMPILED.capture() as launches:
            out, lse, _ = attention_forward(q, k, v, None, self.params)
        if self.fwd is None and _contiguous(out, lse):
            self.fwd_outputs = ((out.shape, out.dtype), (lse.shape, lse.dtype))
            self.fwd = _Replay.capture(launches, (q, k, v, out, lse), self.device)
        return out, lse

    def backward(self, do, q, k, v, out, lse):
        """(dq, dk, dv) as :func:`attention_backward` returns them (no bias)."""
        key = (do.shape, do.stride(), do.dtype, do.data_ptr() & 15)
        if self.bwd is not None and key == self.bwd_key and not _hooks_installed():
            delta, dq, dk, dv = self._empty(self.bwd_outputs)
            self.bwd((q, k, v, out, lse, do, delta, dq, dk, dv))
            return dq, dk, dv
        delta = torch.empty(lse.shape, device=self.device, dtype=torch.float32)
        with COMPILED.capture() as launches:
            dq, dk, dv, _ = attention_backward(do, q, k, v, None, out, lse, None, self.params, delta=delta)
        if (
            self.bwd is None
            and _contiguous(dq, dk, dv)
            and not any(constexprs.get(flag, False) for _, _, _, constexprs in launches for flag in _ADDS_INTO_ZEROED)
        ):
            self.bwd_outputs = tuple((t.shape, t.dtype) for t in (delta, dq, dk, dv))
            self.bwd_key = key
            self.bwd = _Replay.capture(launches, (q, k, v, out, lse, do, delta, dq, dk, dv), self.device)
        return dq, dk, dv


# --------------------------------------------------------------------------- backward


def _reduce_dbias(ws: torch.Tensor, bcast, bias: torch.Tensor) -> torch.Tensor:
    shape4 = [1 if bcast[d] else ws.shape[d] for d in range(4)]
    dims = [d for d in range(4) if bcast[d] and ws.shape[d] != 1]
    if dims:
        ws = ws.sum(dim=dims, keepdim=True)
    return ws.reshape(shape4).reshape(bias.shape).to(bias.dtype)


def _dq_pass(
    do,
    q,
    k,
    v,
    bias_t,
    bstr,
    lse,
    delta,
    seed_t,
    cu_q_t,
    cu_k_t,
    params: KernelParams,
    prob: "_Problem",
    common: dict,
    traits: dict,
    limit: int,
    num_sms: int,
    lse_str,
    do_str,
) -> torch.Tensor:
    """dQ: query-tile parallel, optionally split over keys (fp32 workspace + atomics)."""
    dev = q.device
    cands = select_config(C.BWD_DQ, prob.Dqk, prob.Dv, q.dtype, dev, params, **traits)
    bm, bn = cands[0].block_m, cands[0].block_n
    if params.deterministic:
        splits = 1
    elif params.num_splits > 0:
        splits = min(params.num_splits, max(1, _cdiv(prob.Sk, bn)))
    else:
        splits = num_splits_heuristic(
            prob.B * prob.Hq, _cdiv(prob.Sq, bm), _cdiv(prob.Sk, bn), num_sms, params.deterministic
        )
    atomic = splits > 1
    if atomic:
        dq_ws = torch.zeros(q.shape, device=dev, dtype=torch.float32)
    else:
        dq_ws = torch.empty(q.shape, device=dev, dtype=_store_dtype(q.dtype))
    dq_str = (
        (0, dq_ws.stride(1), dq_ws.stride(0)) if prob.varlen else (dq_ws.stride(0), dq_ws.stride(1), dq_ws.stride(2))
    )
    args = (
        q,
        k,
        v,
        bias_t,
        do,
        lse,
        delta,
        seed_t,
        cu_q_t,
        cu_k_t,
        dq_ws,
        params.scale * LOG2E,
        params.scale,
        float(params.dropout_p),
        *prob.q_strides,
        *prob.k_strides,
        *prob.v_strides,
        *bstr,
        *do_str,
        *lse_str,
        *dq_str,
        prob.Hq,
        prob.B,
        prob.group,
        prob.Sq,
        prob.Sk,
    )
    kw = dict(common, ATOMIC=atomic)
    key = ("dq", dev, q.dtype, prob.Dqk, prob.Dv, common["USE_DESC"])
    for start, cnt in bh_chunks(prob.B * prob.Hq, prob.Hq, limit):

        def grid(cfg, cnt=cnt):
            return (_cdiv(prob.Sq, cfg.block_m), cnt, splits)

        cfg = _launch(
            C.BWD_DQ,
            _attn_bwd_dq,
            grid,
            args + (start, params.window_left, params.window_right, splits),
            kw,
            cands,
            key,
        )
        cands = [cfg]
    return _as_dtype(dq_ws, q.dtype)


def _ws_backward_route(
    do, q, k, v, bias_reason: str | None, params: KernelParams, prob: "_Problem", uses_descriptors: bool
):
    """(q rows layout, k/v rows layout, dO rows layout) when the warp-specialised dK/dV pass
    serves this backward (the dQ pass too where configs.WS_DQ_CONFIGS has the head dim), else None.
    ``bias_reason``: :func:`ws_bias_reason` of the call's bias and whether its gradient is
    needed; ``uses_descriptors``: :func:`use_descriptors` of q, k, v and dO."""
    if prob.Dqk not in C.WS_BWD_CONFIGS:
        return None
    route = _ws_route(q, k, v, bias_reason, params, prob, uses_descriptors)
    do_rows = _rows_layout(do) if route is not None else 0
    return (*route, do_rows) if do_rows else None


def attention_backward(
    do,
    q,
    k,
    v,
    bias,
    out,
    lse,
    seed,
    params: KernelParams,
    cu_q=None,
    cu_k=None,
    max_sq=None,
    max_sk=None,
    bias_grad: bool = False,
    delta: torch.Tensor | None = None,
):
    """Returns (dq, dk, dv, dbias or None).  dbias has bias's shape: summed over its size-1
    (broadcast) dims; full-size dims (even with stride 0) get the per-element gradient.
    ``delta``: an fp32 buffer of lse's shape for rowsum(dO * O) (allocated here when None)."""
    q, k, v, do = _last_contig(q), _last_contig(k), _last_contig(v), _last_contig(do)
    prob = _Problem(q, k, v, cu_q, cu_k, max_sq, max_sk)
    dev = q.device
    bias_grad = bool(bias_grad) and bias is not None and bias.dtype.is_floating_point
    kind, bt, bstr, bcast = bias_layout(bias, (prob.B, prob.Hq, prob.Sq, prob.Sk))
    empty = prob.empty() or prob.Sk == 0 or prob.Hkv == 0 or (prob.varlen and k.shape[0] == 0)
    if empty:
        dq = torch.zeros(q.shape, device=dev, dtype=q.dtype)
        dk = torch.zeros(k.shape, device=dev, dtype=k.dtype)
        dv = torch.zeros(v.shape, device=dev, dtype=v.dtype)
        dbias = torch.zeros(bias.shape, device=dev, dtype=bias.dtype) if bias_grad else None
        return dq, dk, dv, dbias

    desc = use_descriptors(params, (q, k, v, do), dev)
    common = dict(
        _common(q, params, prob),
        **bias_constexprs(kind, bt, bstr, prob, desc),
        USE_DESC=desc,
        HAS_DROPOUT=params.dropout_p > 0,
    )
    dummy = q
    seed_t = seed if seed is not None and seed.numel() else dummy
    cu_q_t = cu_q if cu_q is not None else dummy
    cu_k_t = cu_k if cu_k is not None else dummy
    bias_t = bt if bt is not None else dummy
    limit = _grid_limit(params)
    lse_str = prob.lse_strides()
    do_str = prob.out_strides(do)
    o_str = prob.out_strides(out)
    _, _, num_sms = device_info(dev)

    # 1) delta = rowsum(dO * O)
    if delta is None:
        delta = torch.empty(prob.lse_shape, device=dev, dtype=torch.float32)
    bm_pre = 16 if is_interpreter() else 64
    for start, cnt in bh_chunks(prob.B * prob.Hq, prob.Hq, limit):
        _launch_one(
            _attn_bwd_preprocess,
            (_cdiv(prob.Sq, bm_pre), cnt),
            (out, do, delta, cu_q_t, *o_str, *do_str, *lse_str, prob.Hq, prob.Sq, start),
            dict(HEAD_DV=prob.Dv, IS_VARLEN=prob.varlen, BLOCK_M=bm_pre, BLOCK_DV=common["BLOCK_DV"]),
            4,
            3,
        )

    # 2) dK, dV (+ d(bias)) : key-tile parallel, loops over the query heads of the group
    traits = _table_traits(kind, params, prob)
    bias_reason = ws_bias_reason(kind, bt, bstr, q.dtype, desc, grad=bias_grad)
    route = _ws_backward_route(do, q, k, v, bias_reason, params, prob, desc)
    if route is not None:
        ws_bias = _WsBias.of(bt, bstr, prob) if kind else None
        dk, dv, dq = _dkdv_ws(
            q, k, v, do, lse, delta, params, prob, *route, bias=ws_bias, fuse_dq=fuse_dq(params, prob, ws_bias)
        )
        if dq is not None:
            return dq, dk, dv, None
        if prob.Dqk in C.WS_DQ_CONFIGS:
            return _dq_ws(q, k, v, do, lse, delta, params, prob, *route, bias=ws_bias), dk, dv, None
        return (
            _dq_pass(
                do,
                q,
                k,
                v,
                bias_t,
                bstr,
                lse,
                delta,
                seed_t,
                cu_q_t,
                cu_k_t,
                params,
                prob,
                common,
                traits,
                limit,
                num_sms,
                lse_str,
                do_str,
            ),
            dk,
            dv,
            None,
        )
    sum_rows = sum_heads = False
    if bias_grad:
        sum_rows = bcast[2] and prob.Sq > 1
        sum_heads = bcast[1] and prob.group > 1
        ws_shape = (prob.B, prob.Hkv if sum_heads else prob.Hq, 1 if sum_rows else prob.Sq, prob.Sk)
        db_ws = torch.zeros(ws_shape, device=dev, dtype=torch.float32)
        db_str = db_ws.stride()
    else:
        db_ws = dummy
        db_str = (0, 0, 0, 0)
    cands = select_config(C.BWD_DKDV, prob.Dqk, prob.Dv, q.dtype, dev, params, **traits)
    # group split (GQA/MQA): query heads of a kv head spread over grid axis 2, partial
    # dK/dV in an fp32 workspace summed in a fixed order (never with a head-summed d(bias)).
    if params.deterministic or prob.group == 1 or (bias_grad and sum_heads):
        gsplits = 1
    elif params.num_splits > 0:
        gsplits = min(params.num_splits, prob.group)
    else:
        gsplits = group_splits_heuristic(prob.B * prob.Hkv, _cdiv(prob.Sk, cands[0].block_n), prob.group, num_sms)
    per_split = _cdiv(prob.group, gsplits)
    gsplits = _cdiv(prob.group, per_split)
    if gsplits > 1:
        dk_out = torch.empty((gsplits,) + tuple(k.shape), device=dev, dtype=torch.float32)
        dv_out = torch.empty((gsplits,) + tuple(v.shape), device=dev, dtype=torch.float32)
        dk0, dv0 = dk_out[0], dv_out[0]
        split_str = (dk_out.stride(0), dv_out.stride(0))
    else:
        dk_out = dk0 = torch.empty(k.shape, device=dev, dtype=_store_dtype(k.dtype))
        dv_out = dv0 = torch.empty(v.shape, device=dev, dtype=_store_dtype(v.dtype))
        split_str = (0, 0)
    if prob.varlen:
        dk_str = (0, dk0.stride(1), dk0.stride(0))
        dv_str = (0, dv0.stride(1), dv0.stride(0))
    else:
        dk_str = (dk0.stride(0), dk0.stride(1), dk0.stride(2))
        dv_str = (dv0.stride(0), dv0.stride(1), dv0.stride(2))
    args = (
        q,
        k,
        v,
        bias_t,
        do,
        lse,
        delta,
        seed_t,
        cu_q_t,
        cu_k_t,
        dk_out,
        dv_out,
        db_ws,
        params.scale * LOG2E,
        params.scale,
        float(params.dropout_p),
        *prob.q_strides,
        *prob.k_strides,
        *prob.v_strides,
        *bstr,
        *do_str,
        *lse_str,
        *dk_str,
        *dv_str,
        *db_str,
        prob.Hq,
        prob.B,
        prob.group,
        prob.Hkv,
        prob.Sq,
        prob.Sk,
    )
    kw = dict(common, BIAS_GRAD=bias_grad, DB_SUM_ROWS=sum_rows, DB_SUM_HEADS=sum_heads)
    key = ("dkdv", dev, q.dtype, prob.Dqk, prob.Dv, common["USE_DESC"])
    for start, cnt in bh_chunks(prob.B * prob.Hkv, prob.Hkv, limit):

        def grid(cfg, cnt=cnt):
            return (_cdiv(prob.Sk, cfg.block_n), cnt, gsplits)

        cfg = _launch(
            C.BWD_DKDV,
            _attn_bwd_dkdv,
            grid,
            args + (start, params.window_left, params.window_right, per_split, *split_str),
            kw,
            cands,
            key,
        )
        cands = [cfg]
    if gsplits > 1:
        dk, dv = dk_out.sum(0).to(k.dtype), dv_out.sum(0).to(v.dtype)
    else:
        dk, dv = _as_dtype(dk_out, k.dtype), _as_dtype(dv_out, v.dtype)

    # 3) dQ : query-tile parallel, optionally split over keys (fp32 workspace + atomics)
    dq = _dq_pass(
        do,
        q,
        k,
        v,
        bias_t,
        bstr,
        lse,
        delta,
        seed_t,
        cu_q_t,
        cu_k_t,
        params,
        prob,
        common,
        traits,
        limit,
        num_sms,
        lse_str,
        do_str,
    )

    dbias = _reduce_dbias(db_ws, bcast, bias) if bias_grad else None
    return dq, dk, dv, dbias


# --------------------------------------------------------------------------- dropout mask


def dropout_keep_mask(
    batch: int,
    num_heads: int,
    seqlen_q: int,
    seqlen_k: int,
    dropout_p: float,
    device=None,
    *,
    seed: torch.Tensor | None = None,
    max_grid: int = 0,
) -> torch.Tensor:
    """Bool keep-mask (batch, num_heads, seqlen_q, seqlen_k) that a forward call with the same
    shapes and ``dropout_p`` uses right after the same ``torch.manual_seed``.

    Varlen: pass batch = number of sequences and seqlen_q/k = max_seqlen_q/k; element
    [b, h, i, j] is the mask of local query i / local key j of sequence b.  The seed is drawn
    exactly like the forward draws it (one int64 from the device generator), unless ``seed``
    (the forward's seed tensor) is given."""
    device = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() and not is_interpreter() else "cpu")
    )
    out = torch.empty((batch, num_heads, seqlen_q, seqlen_k), device=device, dtype=torch.uint8)
    if dropout_p <= 0:
        return out.fill_(1).bool()
    if seed is None:
        seed = draw_seed(device)
    if out.numel() == 0:
        return out.bool()
    bm, bn = (16, 32) if is_interpreter() else (64, 64)
    n_bh = batch * num_heads
    for start, cnt in bh_chunks(n_bh, num_heads, max_grid or MAX_GRID_YZ):
        _dropout_mask_kernel[(_cdiv(seqlen_q, bm), cnt)](
            out,
            seed,
            float(dropout_p),
            seqlen_q * seqlen_k,
            seqlen_k,
            num_heads,
            seqlen_q,
            seqlen_k,
            start,
            BLOCK_M=bm,
            BLOCK_N=bn,
        )
    return out.bool()
