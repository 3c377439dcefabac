"""Memory: 10,000 calls on the GPU (inference and training, through the fast path and through
the full path) leave torch.cuda.memory_allocated() where it started; a planted leak (a backend
keeping each output) is caught by the same measurement."""

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import dispatch
from attention_dispatch.backends.math import math_attention


def grown_bytes(calls: int, fast_path: bool, **sdpa_kw) -> int:
    """memory_allocated() after `calls` calls (alternating inference and training) minus before."""
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def run(n):
        for i in range(n):
            if not fast_path:
                dispatch.fast_calls.clear()
            if i % 2:
                with torch.no_grad():
                    ad.sdpa(q, k, v, is_causal=True, **sdpa_kw)
            else:
                ad.sdpa(*leaves, is_causal=True, **sdpa_kw).sum().backward()
                for t in leaves:
                    t.grad = None

    run(20)  # warm: compiled kernels, workspaces, the caches' first entries
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    run(calls)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


@pytest.mark.gpu
@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "full-path"])
def test_ten_thousand_calls_leave_gpu_memory_where_it_was(fast_path):
    assert grown_bytes(10_000, fast_path) == 0


class Leaky(ad.Backend):
    """A planted defect: keeps every output it returns."""

    name = "leaky"

    def __init__(self):
        self.kept = []

    def run(self, query, key, value, **options):
        out = math_attention(query, key, value, **options)
        self.kept.append(out.detach())
        return out


@pytest.mark.gpu
def test_the_measurement_catches_a_planted_leak():
    ad.register_backend(Leaky(), priority="first")  # conftest unregisters it
    assert grown_bytes(200, fast_path=True, backend="leaky") >= 200 * 2 * 8 * 256 * 64 * 2  # every output kept


def _plans():
    """The fast path's replay plans (a runner is the plan or a closure over one)."""
    from attention_dispatch.kernels import ForwardPlan, TrainingPlan

    found = []
    for _, runner in dispatch.fast_calls.values():
        cells = [c.cell_contents for c in getattr(runner, "__closure__", None) or ()]
        found += [r for r in [runner, *cells] if isinstance(r, (ForwardPlan, TrainingPlan))]
    return found


@pytest.mark.gpu
def test_fast_path_plans_keep_no_tensor_of_the_call_they_captured():
    """A plan captured on the fast path (Gluon training and inference at d128: every operand a
    host-built descriptor) keeps nothing of the call it captured: each step's tensors die with
    the step, so a training loop holds no second copy of q/k/v/out (0.76 GiB at S=64k)."""
    import gc
    import weakref

    ad.clear_cache()
    refs = []
    for _ in range(4):
        q, k, v = (
            torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        out = ad.sdpa(q, k, v, is_causal=True, backend="triton")
        out.sum().backward()
        with torch.no_grad():
            inference = ad.sdpa(q, k, v, is_causal=True, backend="triton")
        refs += [weakref.ref(t) for t in (q, k, v, out, inference, q.grad, k.grad, v.grad)]
        del q, k, v, out, inference
    gc.collect()
    plans = _plans()
    descriptors = [
        d
        for p in plans
        for r in (getattr(p, "launch", None), getattr(p, "fwd", None))
        if r
        for _, _, d in r.patches
        if d is not None
    ]
    assert plans and descriptors, "no plan with descriptors captured: the test would prove nothing"
    assert [r() is None for r in refs] == [True] * len(refs)
