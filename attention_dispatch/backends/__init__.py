"""Built-in backend adapters, one module each; `base` holds Backend and Capabilities.

Optional libraries are imported lazily inside each adapter, so importing this package
never fails because one of them is missing or broken.
"""

from .base import Backend, Capabilities, not_supported_reasons

# Default priority: our kernel first, the reference last.
BUILTIN_ORDER = ("triton", "flash_attn", "cudnn", "torch_flash", "torch_efficient", "xformers", "torch_cpu", "math")


def builtin_backends() -> list[Backend]:
    """Fresh instances of every built-in backend, in default priority order."""
    from .flash_attn import FlashAttnBackend
    from .math import MathBackend
    from .torch_backends import CudnnBackend, TorchCpuBackend, TorchEfficientBackend, TorchFlashBackend
    from .triton import TritonBackend
    from .xformers import XformersBackend

    found = [
        TritonBackend(),
        FlashAttnBackend(),
        CudnnBackend(),
        TorchFlashBackend(),
        TorchEfficientBackend(),
        XformersBackend(),
        TorchCpuBackend(),
        MathBackend(),
    ]
    assert tuple(b.name for b in found) == BUILTIN_ORDER
    return found


__all__ = ["Backend", "Capabilities", "not_supported_reasons", "builtin_backends", "BUILTIN_ORDER"]
