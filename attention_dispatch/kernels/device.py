"""Device facts the launch logic reads: interpreter or GPU, compute capability, shared memory,
SM count, and whether a call's tiles can load through TMA tensor descriptors."""

from __future__ import annotations

import functools

import torch
import triton

from .params import KernelParams
from .tl.forward import _attn_fwd


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


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or 0)


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache in bytes (0 off CUDA or where torch does not say)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return _l2_bytes(device.index if device.index is not None else torch.cuda.current_device())


# In-kernel TMA descriptors need a small global scratch buffer per launch, which Triton
# asks from the allocator in its context variable.  When the caller has not set one, the
# launch sets ours for its own duration only (restored in finally).
try:
    from triton.runtime._allocation import NullAllocator as _NullAllocator
    from triton.runtime._allocation import _allocator as _TRITON_ALLOCATOR
except ImportError:  # pragma: no cover - Triton without in-kernel descriptors
    _TRITON_ALLOCATOR = _NullAllocator = None
HAS_DESCRIPTORS = hasattr(_TRITON_ALLOCATOR, "reset") and hasattr(triton.language, "make_tensor_descriptor")


class _ScratchAllocator:
    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=self.device)


def tma_compatible(t: torch.Tensor) -> bool:
    """TMA reads rows at 16-byte aligned addresses: the base, every stride but the last and
    the row length must be multiples of 16 bytes."""
    es = t.element_size()
    if t.data_ptr() % 16 or (t.shape[-1] * es) % 16:
        return False
    for st in t.stride()[:-1]:
        if (st * es) % 16:
            return False
    return True


def use_descriptors(params: KernelParams, tensors, device: torch.device, loop_len: int | None = None) -> bool:
    """Whether the kernels load tiles through TMA tensor descriptors (Hopper and newer,
    fp16/bf16, 16-byte aligned rows); ``params.descriptors`` forces it (1) or turns it off (0).
    ``loop_len``: rows of the loop the descriptors feed; in auto mode one 64-row tile or less
    leaves nothing for TMA to pipeline, and pointer loads spare the descriptors' scratch
    allocation (host) and creation (device) on tiny calls."""
    if params.descriptors == 0:
        return False
    if params.descriptors == 1:
        if not (HAS_DESCRIPTORS and all(tma_compatible(t) for t in tensors)):
            raise ValueError(
                "descriptors=1: TMA descriptors need Triton's make_tensor_descriptor and "
                "16-byte aligned rows (base, strides and head dim); got "
                + ", ".join(f"{tuple(t.shape)}/{t.stride()}" for t in tensors)
            )
        return True
    if (
        not HAS_DESCRIPTORS
        or device.type != "cuda"
        or is_interpreter()
        or (loop_len is not None and loop_len <= 64)
        or tensors[0].dtype not in (torch.float16, torch.bfloat16)
        or device_info(device)[0] < (9, 0)
    ):
        return False
    for t in tensors:
        if not tma_compatible(t):
            return False
    return True


def run_with_scratch(device: torch.device, uses_descriptors: bool, fn, *args):
    """``fn(*args)`` (kernel launches) with a scratch allocator for in-kernel descriptors."""
    if not uses_descriptors or not isinstance(_TRITON_ALLOCATOR.get(), _NullAllocator):
        return fn(*args)
    token = _TRITON_ALLOCATOR.set(_ScratchAllocator(device))
    try:
        return fn(*args)
    finally:
        _TRITON_ALLOCATOR.reset(token)


# Opt-in shared memory per block by compute capability, used when the device cannot be queried.
SMEM_BY_CC = {
    (7, 5): 64 * 1024,
    (8, 0): 163 * 1024,
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024,
    (12, 0): 99 * 1024,
}
