"""sdpa() is a drop-in for torch.nn.functional.scaled_dot_product_attention on the CPU:
same output and gradients for every argument combination torch accepts, whichever
backend serves the call (auto, or each CPU backend that says it can)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import attention_dispatch as ad
from cases import leaf_copy
from oracle import assert_matches

CPU_BACKENDS = ["auto", "torch_cpu", "math", "triton"]

SHAPES = {  # (query shape, key shape)
    "4d": ((2, 4, 12, 32), (2, 4, 20, 32)),
    "3d": ((3, 12, 16), (3, 9, 16)),
    "5d": ((2, 2, 3, 10, 16), (2, 2, 3, 10, 16)),
    "gqa": ((2, 8, 12, 32), (2, 2, 12, 32)),
}
MASKS = ["none", "bool", "bool-2d", "float", "float-grad-heads"]


def _combos():
    for shape, mask, causal, scale, dtype in itertools.product(
        SHAPES, MASKS, [False, True], [None, 0.3], [torch.float32, torch.float64, torch.bfloat16]
    ):
        if causal and mask != "none":
            continue  # torch refuses attn_mask together with is_causal
        if dtype != torch.float32 and (scale is not None or shape in ("3d", "5d")):
            continue  # keep the grid small: dtypes on the main shapes
        yield pytest.param(
            shape, mask, causal, scale, dtype, id=f"{shape}-{mask}-causal{int(causal)}-scale{scale}-{str(dtype)[6:]}"
        )


def _inputs(shape, mask, dtype):
    qs, ks = SHAPES[shape]
    vs = ks
    q = torch.randn(qs, dtype=dtype, requires_grad=True)
    k = torch.randn(ks, dtype=dtype, requires_grad=True)
    v = torch.randn(vs, dtype=dtype, requires_grad=True)
    target = qs[:-1] + (ks[-2],)
    m = None
    if mask == "bool":
        m = torch.rand(target) > 0.3
    elif mask == "bool-2d":
        m = torch.rand(target[-2:]) > 0.3
    elif mask == "float":
        m = torch.randn(target, dtype=dtype)
    elif mask == "float-grad-heads":
        m = torch.randn((1,) * (len(target) - 3) + target[-3:], dtype=dtype, requires_grad=True)
    return q, k, v, m


def _run(fn, q, k, v, m, grad_out, **kw):
    out = fn(q, k, v, attn_mask=m, **kw)
    out.backward(grad_out)
    grads = [t.grad for t in (q, k, v, m) if t is not None and t.requires_grad]
    return [out] + grads


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape,mask,causal,scale,dtype", list(_combos()))
def test_same_as_torch_sdpa(backend, shape, mask, causal, scale, dtype):
    q, k, v, m = _inputs(shape, mask, dtype)
    gqa = shape == "gqa"
    kw = dict(is_causal=causal, scale=scale, enable_gqa=gqa)
    if backend != "auto":
        d = ad.explain(q, k, v, attn_mask=m, backend=backend, **kw)
        if d.backend is None:
            pytest.skip(f"{backend} declines: {d.rejected[backend]}")
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=dtype)
    ours = _run(ad.sdpa, q, k, v, m, grad_out, backend=None if backend == "auto" else backend, **kw)
    if backend == "auto":
        assert ad.last_decision().backend in ad.list_backends()

    def torch_in(dt):
        leaves = [leaf_copy(t, dt if t.is_floating_point() else None) if t is not None else None for t in (q, k, v, m)]
        return _run(F.scaled_dot_product_attention, *leaves, grad_out.to(dt), **kw)

    ref64, ref_low = torch_in(torch.float64), torch_in(dtype)
    names = ["out", "dq", "dk", "dv", "dmask"]
    for name, got, r64, rlow in zip(names, ours, ref64, ref_low):
        assert_matches(got, r64, rlow, f"{backend} {name}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nested_jagged_same_as_torch(backend):
    lengths = [3, 7, 5]
    parts = [torch.randn(n, 2, 16) for n in lengths]

    def make():
        return torch.nested.nested_tensor([p.clone() for p in parts], layout=torch.jagged, requires_grad=True)

    q, k, v = make(), make(), make()
    if backend != "auto":
        d = ad.explain(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend=backend)
        if d.backend is None:
            pytest.skip(f"{backend} declines: {d.rejected[backend]}")
    out = ad.sdpa(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend=None if backend == "auto" else backend
    )
    assert out.is_nested and out.shape[0] == 3
    q2, k2, v2 = make(), make(), make()
    ref = F.scaled_dot_product_attention(q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2))
    for a, b in zip(out.transpose(1, 2).unbind(), ref.transpose(1, 2).unbind()):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    out.transpose(1, 2).values().sum().backward()
    ref.transpose(1, 2).values().sum().backward()
    torch.testing.assert_close(q.grad.values(), q2.grad.values(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(v.grad.values(), v2.grad.values(), atol=2e-5, rtol=1e-4)


def test_dropout_accepted_like_torch_and_unbiased():
    """torch's dropout stream differs from ours, so compare what must agree: shapes, the
    expectation (mean over many draws approaches the dropout-free output)."""
    torch.manual_seed(0)  # a statistical check: fixed draws so it cannot flake
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    exact = ad.sdpa(q, k, v)
    draws = torch.stack([ad.sdpa(q, k, v, dropout_p=0.3) for _ in range(400)])
    assert draws.shape[1:] == exact.shape
    err = (draws.mean(0) - exact).abs().max().item()
    assert err < 0.15, err
    assert (draws.std(0) > 0).all()
