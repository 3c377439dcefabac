"""sdpa() under torch.autocast casts its inputs as autocast casts F.scaled_dot_product_attention's:
floating tensors of the autocast device other than float64 to the autocast dtype, a float mask too.
So every backend (and sdpa()'s fast paths) runs and returns the dtype F.sdpa would, and inputs of mixed
dtypes that F.sdpa takes under autocast are taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attention_dispatch as ad
from test_capabilities import _available

BACKENDS = list(_available("cpu"))


def _inputs(dtype=torch.float32, grad=False):
    return [torch.randn(2, 3, 7, 16, dtype=dtype, requires_grad=grad) for _ in range(3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_float32_inputs_run_at_the_autocast_dtype(backend, autocast_dtype):
    q, k, v = _inputs(grad=True)
    mask = torch.randn(7, 7)
    if autocast_dtype not in ad.get_backend(backend).capabilities.dtypes:
        pytest.skip(f"{backend} does not take {autocast_dtype}")
    with torch.autocast("cpu", dtype=autocast_dtype):
        want_dtype = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).dtype
        outs = [ad.sdpa(q, k, v, attn_mask=mask, backend=backend) for _ in range(3)]  # decided, prepared, recent
    assert want_dtype == autocast_dtype
    cast = [t.detach().to(autocast_dtype) for t in (q, k, v, mask)]
    want = ad.sdpa(*cast[:3], attn_mask=cast[3], backend=backend)
    for out in outs:
        assert out.dtype == autocast_dtype
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    outs[0].float().sum().backward()  # the casts are on the graph: float32 gradients reach the leaves
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in (q, k, v))
    # the same float32 signature outside autocast is float32 again (no stale fast-path hit)
    assert ad.sdpa(q, k, v, attn_mask=mask, backend=backend).dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_are_taken_under_autocast_as_f_sdpa_takes_them(backend):
    q, k, v = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ad.sdpa(q.bfloat16(), k, v.half(), backend=backend)
        assert F.scaled_dot_product_attention(q.bfloat16(), k, v.half()).dtype == torch.bfloat16
    want = ad.sdpa(q.bfloat16(), k.bfloat16(), v.half().bfloat16(), backend=backend)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="must share one dtype"):  # outside autocast: refused as before
        ad.sdpa(q.bfloat16(), k, v, backend=backend)


def test_float64_and_bool_masks_stay_as_they_are():
    q, k, v = _inputs(torch.float64)
    mask = torch.rand(7, 7) > 0.3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ad.sdpa(q, k, v, attn_mask=mask, backend="math")
        assert F.scaled_dot_product_attention(q, k, v, attn_mask=mask).dtype == torch.float64
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ad.sdpa(q, k, v, attn_mask=mask, backend="math"), rtol=0, atol=0)


def test_explain_shows_the_autocast_dtype():
    q, k, v = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ad.explain(q, k, v).problem.dtype == torch.bfloat16
    assert ad.explain(q, k, v).problem.dtype == torch.float32


def test_autocast_off_changes_nothing():
    q, k, v = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert ad.sdpa(q, k, v).dtype == torch.float32


def test_the_autocast_branch_forwards_every_parameter():
    """sdpa()'s autocast branch calls sdpa() again with the cast tensors and every other parameter in
    its place: one added to the signature but not passed there would be dropped under autocast, silently."""
    import ast
    import inspect

    from attention_dispatch import api

    tree = ast.parse(inspect.getsource(api.sdpa))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "sdpa"]
    assert len(calls) == 1
    positional = [n.value.id if isinstance(n, ast.Starred) else n.id for n in calls[0].args]
    params = [p for p in inspect.signature(api.sdpa).parameters if p != "_keyword_only"]
    assert positional == ["cast", *params[4:8]]  # cast: query, key, value, attn_mask
    assert {k.arg: k.value.id for k in calls[0].keywords} == {p: p for p in params[8:]}


def test_a_bad_query_under_autocast_gets_the_usual_error():
    _, k, v = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="query must be a torch.Tensor"):
        ad.sdpa([[1.0]], k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, *(_available("cuda") if torch.cuda.is_available() else [])])
def test_cuda_autocast_runs_float32_inputs_at_bfloat16(backend):
    """On the GPU: the call is decided at bfloat16 (the default choice a bfloat16 kernel, not a float32
    one), and each backend's result is its result on the cast inputs, with float32 gradients."""
    caps = ad.get_backend(backend).capabilities if backend else None
    if caps is not None and torch.bfloat16 not in caps.dtypes:
        pytest.skip(f"{backend} does not take bfloat16")
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outs = [ad.sdpa(q, k, v, is_causal=True, backend=backend) for _ in range(3)]
        assert F.scaled_dot_product_attention(q, k, v, is_causal=True).dtype == torch.bfloat16
    chosen = ad.last_decision().backend
    assert ad.last_decision().problem.dtype == torch.bfloat16
    want = ad.sdpa(*(t.detach().bfloat16() for t in (q, k, v)), is_causal=True, backend=chosen)
    for out in outs:
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    outs[0].float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_meta_tensors_under_autocast_are_explained_as_before():
    q, k, v = (torch.empty(2, 3, 7, 16, device="meta") for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ad.explain(q, k, v).problem.dtype == torch.float32
