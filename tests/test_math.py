"""The math backend (the oracle) against the independent naive float64 reference."""

import subprocess
import sys

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.backends import math as math_backend
from cases import Case, make_inputs
from oracle import compare_backend, math_keep_mask


FEATURES = [
    Case(),
    Case(causal="top_left", seqlen_q=20, seqlen_k=31),
    Case(causal="top_left", seqlen_q=31, seqlen_k=20),
    Case(causal="bottom_right", seqlen_q=20, seqlen_k=31),
    Case(causal="bottom_right", seqlen_q=31, seqlen_k=20),  # first rows fully masked
    Case(window=(5, 3), seqlen_q=20, seqlen_k=31),
    Case(window=(4, -1)),
    Case(window=(-1, 2)),
    Case(window=(0, 0)),
    Case(causal="top_left", window=(6, -1), seqlen_q=28, seqlen_k=17),
    Case(mask="bool"),
    Case(mask="bool", mask_shape="keys", causal="bottom_right"),
    Case(mask="float"),
    Case(mask="float_grad", mask_shape="heads"),
    Case(mask="float_grad", mask_shape="keys"),
    Case(mask="float_grad", mask_shape="square", window=(3, 3)),
    Case(heads_q=8, heads_kv=2),
    Case(heads_q=6, heads_kv=1, causal="bottom_right", seqlen_k=40),
    Case(head_dim=24, head_dim_v=40),
    Case(dropout_p=0.3),
    Case(dropout_p=0.2, heads_q=4, heads_kv=2, mask="float_grad", causal="top_left"),
    Case(varlen=(5, 0, 13, 9)),
    Case(varlen=(7, 3, 11), extra_k=(4, 0, 9), causal="bottom_right"),
    Case(varlen=(7, 3, 11), extra_k=(4, 2, 9), causal="top_left", window=(3, -1), heads_q=4, heads_kv=2),
    Case(varlen=(6, 9), mask="float_grad", mask_shape="full", dropout_p=0.25),
    Case(dtype=torch.float64, causal="top_left", mask="float_grad", mask_shape="keys"),
    Case(dtype=torch.bfloat16, causal="bottom_right", seqlen_k=40),
    Case(dtype=torch.float16, mask="bool", heads_q=4, heads_kv=2),
]


@pytest.mark.parametrize("case", FEATURES, ids=str)
def test_math_matches_naive(case):
    compare_backend(case, "math", keep_fn=math_keep_mask)


@pytest.mark.parametrize(
    "case",
    [
        Case(seqlen_q=37, seqlen_k=29, causal="bottom_right", mask="float_grad"),
        Case(seqlen_q=37, dropout_p=0.3, heads_q=4, heads_kv=2),
    ],
    ids=str,
)
def test_math_chunked_equals_naive(case, monkeypatch):
    # 4 query rows per chunk: many chunks, each checkpointed under autograd.
    rows = 4
    monkeypatch.setattr(math_backend, "CHUNK_ELEMENTS", case.batch * case.heads_q * case.seqlen_k * rows)
    compare_backend(case, "math", keep_fn=math_keep_mask)  # the mask ignores the chunking


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask_shape", [(1, 4, 12, 20), (1, 1, 12, 20), (3, 4, 1, 20)], ids=str)
def test_math_half_mask_gradient_is_rounded_once(dtype, mask_shape):
    """A float mask broadcast over batch, heads or rows: its 16-bit gradient is the float32 sum
    rounded once, within half an ulp of float64's at every element, as F.sdpa's (it was the
    rounded shares summed: ~1 ulp off, at the test_torch_equivalence tolerance's edge)."""
    q, k, v = (torch.randn(3, 4, n, 32, dtype=dtype, requires_grad=True) for n in (12, 20, 20))
    mask = torch.randn(mask_shape, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(3, 4, 12, 32, dtype=dtype)
    ad.sdpa(q, k, v, attn_mask=mask, backend="math").backward(grad_out)
    q64, k64, v64, mask64 = (t.detach().double().requires_grad_() for t in (q, k, v, mask))
    torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask64).backward(grad_out.double())
    exact = mask64.grad
    ulp = torch.finfo(dtype).eps * torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 1)
    err = (mask.grad.double() - exact).abs()
    assert not mask.grad.isnan().any()
    computed = 64 * torch.finfo(torch.float32).eps * exact.abs().max()  # float32's own error, tiny elements
    assert (err <= 0.5 * ulp + computed).all(), f"{((err - computed) / ulp).max():.2f} ulp"


def test_math_dropout_repeatable_and_rate():
    case = Case(dropout_p=0.4, seqlen_q=64, seqlen_k=64)
    q, k, v, _, kw, _ = make_inputs(case)
    torch.manual_seed(7)
    a = ad.sdpa(q, k, v, backend="math", **kw)
    torch.manual_seed(7)
    b = ad.sdpa(q, k, v, backend="math", **kw)
    torch.manual_seed(8)
    c = ad.sdpa(q, k, v, backend="math", **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.manual_seed(7)
    keep = math_keep_mask(case, q, k, None, None)
    rate = keep.float().mean().item()
    n = keep.numel()
    assert abs(rate - 0.6) < 5 * (0.6 * 0.4 / n) ** 0.5, rate


def test_math_fully_masked_rows_zero_not_nan():
    q, k, v = (torch.randn(1, 2, 6, 16, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 2, :] = False
    bias = torch.zeros(1, 1, 6, 6).masked_fill(~mask, float("-inf")).requires_grad_()
    for m in (mask, bias):
        out = ad.sdpa(q, k, v, attn_mask=m, backend="math")
        assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
        out.sum().backward()
        for t in (q, k, v):
            assert not torch.isnan(t.grad).any()
        assert torch.equal(q.grad[..., 2, :], torch.zeros_like(q.grad[..., 2, :]))
        q.grad = k.grad = v.grad = None
    assert not torch.isnan(bias.grad).any()


@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (2, 0, 5, 8), (2, 2, 0, 8)])
def test_math_empty_gives_zeros(shape):
    q = torch.randn(shape, requires_grad=True)
    k = torch.randn(shape[0], shape[1], 7, 8, requires_grad=True)
    v = torch.randn(shape[0], shape[1], 7, 8, requires_grad=True)
    out = ad.sdpa(q, k, v, backend="math")
    assert out.shape == shape[:3] + (8,)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_math_no_keys_gives_zeros():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8)
    out = ad.sdpa(q, k, v, backend="math")
    assert torch.equal(out, torch.zeros(1, 2, 5, 8))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_math_32k_bounded_memory():
    """S = 32k, D = 64, B = H = 1 without an S x S matrix (4 GiB in fp32): peak RSS of a
    fresh process stays far below that."""
    code = (
        "import resource, torch, attention_dispatch as ad\n"
        "torch.manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 1, 32768, 64) for _ in range(3))\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "with torch.no_grad():\n"
        "    out = ad.sdpa(q, k, v, is_causal=True, backend='math')\n"
        "assert out.shape == (1, 1, 32768, 64) and not out.isnan().any()\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    grown_mib = int(res.stdout.strip().splitlines()[-1])
    assert grown_mib < 1024, f"peak RSS grew by {grown_mib} MiB (an S x S fp32 matrix is 4096 MiB)"
