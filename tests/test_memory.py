"""Memory: 10,000 calls on the GPU (inference and training, through the fast path and through
the full path) leave torch.cuda.memory_allocated() where it started."""

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import dispatch


@pytest.mark.gpu
@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "full-path"])
def test_ten_thousand_calls_leave_gpu_memory_where_it_was(fast_path):
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def calls(n):
        for i in range(n):
            if not fast_path:
                dispatch.fast_calls.clear()
            if i % 2:
                with torch.no_grad():
                    ad.sdpa(q, k, v, is_causal=True)
            else:
                ad.sdpa(*leaves, is_causal=True).sum().backward()
                for t in leaves:
                    t.grad = None

    calls(20)  # warm: compiled kernels, workspaces, the caches' first entries
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    calls(10_000)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
