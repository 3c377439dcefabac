"""Activation checkpointing (torch.utils.checkpoint) through sdpa(): the recomputed forward gives the
same output and gradients as the plain call, reentrant or not, dropout included, on every backend and
through sdpa()'s fast paths. Non-reentrant checkpointing ends its recomputation by raising an exception
through the recomputed code: sdpa()'s handlers of a backend's failure must let it through."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import attention_dispatch as ad
from test_capabilities import _available


def _cases(device: str):
    if device == "cuda" and not torch.cuda.is_available():
        return
    for backend in [None, *_available(device)]:
        dropout = backend is None or ad.get_backend(backend).capabilities.dropout
        for p in (0.0, 0.3) if dropout else (0.0,):
            for reentrant in (False, True):
                yield pytest.param(
                    backend,
                    p,
                    reentrant,
                    id=f"{backend or 'default'}-p{p}-{'reentrant' if reentrant else 'non-reentrant'}",
                )


def check_checkpointed_call(backend, dropout_p, reentrant, device):
    """A block ending in sdpa() under checkpoint(): output and gradients equal to the plain call's (on the
    CPU exactly; on the GPU the forward exactly, the gradients within a backward's atomics' rounding). The
    default's reentrant forward runs under no_grad: without dropout an inference call, decided apart from the
    training call as F.sdpa decides it, so on the GPU its output may come from another kernel: within rounding."""
    if device == "cpu":
        shape, dtype = (1, 2, 10, 8), torch.float32
    else:
        dtypes = torch.float32 if backend is None else ad.get_backend(backend).capabilities.dtypes
        shape, dtype = (2, 4, 256, 64), torch.bfloat16 if backend is None or torch.bfloat16 in dtypes else torch.float32
    base = [torch.randn(*shape, device=device, dtype=dtype) for _ in range(3)]

    def block(q, k, v):  # an op that saves nothing after it: the recomputation stops inside sdpa()
        return ad.sdpa(q, k, v, is_causal=True, dropout_p=dropout_p, backend=backend) * 2

    results = []
    for wrapped in (False, True, True):  # then the same signature again: the fast paths
        q, k, v = (t.clone().requires_grad_() for t in base)
        torch.manual_seed(11)
        out = checkpoint(block, q, k, v, use_reentrant=reentrant) if wrapped else block(q, k, v)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    other_kernel = device == "cuda" and backend is None and reentrant and not dropout_p
    for got in results[1:]:
        if other_kernel:
            torch.testing.assert_close(got[0].float(), results[0][0].float(), rtol=2e-2, atol=2e-2)
        else:
            torch.testing.assert_close(got[0], results[0][0], rtol=0, atol=0)
        for a, b in zip(got[1:], results[0][1:]):
            assert not a.isnan().any()
            if device == "cpu":
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            else:
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend,dropout_p,reentrant", list(_cases("cpu")))
def test_a_checkpointed_call_equals_the_plain_one(backend, dropout_p, reentrant):
    check_checkpointed_call(backend, dropout_p, reentrant, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dropout_p,reentrant", list(_cases("cuda")))
def test_a_checkpointed_gpu_call_equals_the_plain_one(backend, dropout_p, reentrant):
    check_checkpointed_call(backend, dropout_p, reentrant, "cuda")


def test_a_dropout_call_under_no_grad_is_decided_as_its_recomputation():
    """Reentrant checkpointing runs the first forward under no_grad and recomputes it with grad: a dropout
    call on inputs that require grad gets the training call's decision both times (one backend, one mask);
    without dropout, or on inputs that do not require grad, a no_grad call stays an inference call."""
    q, k, v = (torch.randn(1, 2, 10, 8, requires_grad=True) for _ in range(3))
    training = ad.explain(q, k, v, dropout_p=0.3)
    with torch.no_grad():
        assert ad.explain(q, k, v, dropout_p=0.3).problem == training.problem
        assert not ad.explain(q, k, v).problem.requires_grad
        assert not ad.explain(*(t.detach() for t in (q, k, v)), dropout_p=0.3).problem.requires_grad
    assert training.problem.requires_grad


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_policy_fastest_timing_inside_a_checkpoint(reentrant):
    """policy="fastest" times every eligible backend at a kind of call's first sight: when that is inside a
    checkpointed forward, the timing's own graphs must not pass through the checkpoint's saved-tensor
    hooks (the recomputation, a cache hit, saves only the winner's) nor move the random stream. Each
    timing may pick another backend (the forward of a reentrant checkpoint is an inference call, its
    recomputation a training one): compared with the math backend's plain call within float32's rounding."""
    base = [torch.randn(1, 2, 10, 8) for _ in range(3)]

    def block(q, k, v, **options):
        return ad.sdpa(q, k, v, is_causal=True, **options) * 2

    results = []
    for wrapped in (True, False):
        q, k, v = (t.clone().requires_grad_() for t in base)
        torch.manual_seed(5)
        if wrapped:
            ad.clear_cache()  # the first call of this kind is timed inside the checkpoint
            with ad.use_config({"dispatch": {"policy": "fastest"}}):
                out = checkpoint(block, q, k, v, use_reentrant=reentrant)
                out.sum().backward()
        else:
            out = block(q, k, v, backend="math")
            out.sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad, torch.rand(1)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
