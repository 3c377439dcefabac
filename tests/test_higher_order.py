"""Second derivatives (create_graph=True) are right or refused, never silently missing terms.

A backward that computes its gradients with kernels records no graph: autograd would then treat
the gradient as a constant and a gradient penalty built on it would lose every term through q, k
and v without a word. PyTorch's own attention kernels raise there; so must ours."""

from __future__ import annotations

import os

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.distributed.merge import merge_blocks


def _reference_second_derivative(q, k, v, causal):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    (g,) = torch.autograd.grad((torch.softmax(s, -1) @ v).sum(), q, create_graph=True)
    return torch.autograd.grad((g**2).sum(), (k, v))


def _backends():
    names = ["math", "torch_cpu"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    return [n for n in names if ad.get_backend(n).is_available()]


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("backend", _backends())
def test_a_gradient_of_a_gradient_is_right_or_refused(backend, causal):
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    out = ad.sdpa(q, k, v, is_causal=causal, backend=backend)
    try:
        (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        got = torch.autograd.grad((g**2).sum(), (k, v))
    except RuntimeError as exc:  # refused: PyTorch's kernels and ours say so at the create_graph call
        assert "create_graph" in str(exc) or "not implemented" in str(exc), exc
        return
    want = _reference_second_derivative(q, k, v, causal)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-4)


def test_the_triton_backend_refuses_a_gradient_of_its_gradient():
    if "triton" not in _backends():
        pytest.skip("the triton backend runs on the CPU only under TRITON_INTERPRET=1")
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    out = ad.sdpa(q, k, v, backend="triton")
    with pytest.raises(RuntimeError, match="create_graph=True.*backend='math'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    (g,) = torch.autograd.grad(ad.sdpa(q, k, v, backend="triton").sum(), q)  # a plain backward still runs
    assert not g.requires_grad


def test_the_context_parallel_merge_refuses_a_gradient_of_its_gradient():
    outs = [torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(2)]
    lses = [torch.randn(1, 2, 3, requires_grad=True) for _ in range(2)]
    out, _ = merge_blocks([(0, outs[0], lses[0]), (3, outs[1], lses[1])], 6)
    with pytest.raises(RuntimeError, match="the context-parallel merge: gradients of gradients"):
        torch.autograd.grad(out.sum(), outs[0], create_graph=True)
