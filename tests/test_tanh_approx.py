"""The GPU's tanh.approx.f32, which the kernels' softcap takes for 16-bit inputs (tl/launch.
TANH_APPROX_DTYPES, the Gluon kernels always): its largest absolute error over every float32 argument
must stay within oracle.TANH_APPROX_ABS_ERR, the constant the tests' budgets for a float32 result of
such a call (the logsumexp) are built on.  GPU only (the interpreter has no inline asm).
"""

import os
import sys

import pytest
import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle import TANH_APPROX_ABS_ERR  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tanh_approx_kernel():
    import triton.language as tl

    @triton.jit
    def tanh_approx(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        tl.store(y_ptr + offs, y, mask=offs < n)

    return tanh_approx


def largest_tanh_approx_error(chunk: int = 1 << 26) -> tuple[float, float]:
    """(max |tanh.approx(x) - tanh(x)|, the x where it is) over every non-negative float32 x up to
    +inf (tanh is odd; the approximation is symmetric in sign), tanh in float64."""
    kernel = _tanh_approx_kernel()
    stop = 0x7F800000 + 1  # +inf's bits, included
    worst, where = 0.0, 0.0
    for start in range(0, stop, chunk):
        bits = torch.arange(start, min(start + chunk, stop), device="cuda", dtype=torch.int32)
        x = bits.view(torch.float32)
        y = torch.empty_like(x)
        kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        err = (y.double() - torch.tanh(x.double())).abs()
        i = int(err.argmax())
        if err[i].item() > worst:
            worst, where = err[i].item(), x[i].item()
    return worst, where


@gpu
@needs_cuda
def test_tanh_approx_error_is_within_the_budgets_constant():
    worst, where = largest_tanh_approx_error()
    print(f"tanh.approx.f32: largest absolute error {worst:.3e} at x = {where!r} ({torch.cuda.get_device_name()})")
    assert worst <= TANH_APPROX_ABS_ERR, f"tanh.approx.f32 error {worst:.3e} at x = {where!r} > {TANH_APPROX_ABS_ERR}"
