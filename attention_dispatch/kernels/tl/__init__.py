"""The tl (triton.language) kernels: every feature, every CUDA GPU from sm80 and the CPU interpreter."""

from .backward import _attn_bwd_dkdv, _attn_bwd_dq
from .backward_delta import _attn_bwd_preprocess
from .decode import _decode_combine, _decode_split
from .dropout import _dropout_mask_kernel
from .forward import _attn_fwd
from .kv_append import _kv_append

# The jit kernels by pass, for tools that compile or launch one directly (benchmarks/compile_sm90.py,
# benchmarks/fwd_variants.py, tests that watch launches); the launch logic imports them from their modules.
KERNELS = {
    "fwd": _attn_fwd,
    "bwd_preprocess": _attn_bwd_preprocess,
    "bwd_dkdv": _attn_bwd_dkdv,
    "bwd_dq": _attn_bwd_dq,
    "dropout_mask": _dropout_mask_kernel,
    "decode_split": _decode_split,
    "decode_combine": _decode_combine,
    "kv_append": _kv_append,
}
