"""Issue 36's features in the reference and the public API: softcap, ALiBi slopes, attention
sinks and a differentiable logsumexp, against tests/naive.py and torch.autograd.gradcheck;
fully masked rows; bad input. Each backend's own claims run in tests/test_capabilities.py."""

import math

import pytest
import torch

import attention_dispatch as ad
from naive import naive_attention


def _inputs(b=2, hq=4, hkv=2, sq=5, sk=7, d=8, dtype=torch.float64, grad=True):
    q = torch.randn(b, hq, sq, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, hkv, sk, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, hkv, sk, d, dtype=dtype, requires_grad=grad)
    return q, k, v


def _repeat(t, hq):
    return t.repeat_interleave(hq // t.shape[1], 1)


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(5, 7), (7, 5)])
def test_every_feature_together_matches_the_naive_reference(causal, sq, sk):
    q, k, v = _inputs(sq=sq, sk=sk)
    slopes = torch.rand(2, 4) * 0.5
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    kw = dict(causal=causal, window=(3, -1), softcap=2.5)
    out, lse = ad.sdpa(
        q, k, v, enable_gqa=True, alibi_slopes=slopes, sinks=sinks, return_lse=True, backend="math", **kw
    )
    ref, ref_lse = naive_attention(
        q, _repeat(k, 4), _repeat(v, 4), alibi_slopes=slopes.double(), sinks=sinks, return_lse=True, **kw
    )
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref * g_out).sum() + (ref_lse * g_lse).sum(), (q, k, v, sinks))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_gradcheck_of_the_math_backend_through_out_lse_sinks_and_bias():
    q, k, v = _inputs(b=1, hq=2, hkv=1, sq=3, sk=4, d=3)
    bias = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.3, 0.7])

    def f(q, k, v, bias, sinks):
        out, lse = ad.sdpa(
            q,
            k,
            v,
            bias,
            enable_gqa=True,
            causal="bottom_right",
            softcap=1.5,
            alibi_slopes=slopes,
            sinks=sinks,
            return_lse=True,
            backend="math",
        )
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, bias, sinks))


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse_without_nan():
    q, k, v = _inputs(b=1, hq=2, hkv=2, sq=4, sk=6)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[..., 1, :] = False  # row 1 attends to nothing
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    out, lse = ad.sdpa(q, k, v, mask, sinks=sinks, return_lse=True, softcap=4.0, backend="math")
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.isneginf(lse[:, :, 1]).all() and torch.isfinite(lse[:, :, [0, 2, 3]]).all()
    torch.autograd.backward([out, lse], [torch.randn_like(out), torch.randn_like(lse)])  # into the -inf rows too
    for t in (q, k, v, sinks):
        assert not t.grad.isnan().any()
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))


def test_a_gradient_into_an_empty_row_lse_is_ignored_not_nan():
    q, k, v = _inputs(b=1, hq=1, hkv=1, sq=2, sk=3)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    out, lse = ad.sdpa(q, k, v, mask, return_lse=True, backend="math")
    lse.backward(torch.ones_like(lse))
    assert not q.grad.isnan().any() and not k.grad.isnan().any()
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))


def test_sinks_of_minus_infinity_are_no_sinks_and_large_ones_do_not_overflow():
    q, k, v = _inputs(b=1, hq=2, hkv=2, sq=3, sk=4, dtype=torch.float32, grad=False)
    plain = ad.sdpa(q, k, v, backend="math")
    none = ad.sdpa(q, k, v, sinks=torch.full((2,), -math.inf), backend="math")
    torch.testing.assert_close(none, plain)
    huge = ad.sdpa(q, k, v, sinks=torch.full((2,), 1e4), backend="math")  # all weight on the sink
    assert torch.isfinite(huge).all() and huge.abs().max() < 1e-30


def test_lse_layouts_for_nested_rank_3_and_varlen_inputs():
    q, k, v = (torch.randn(3, 5, 8) for _ in range(3))  # (N, S, D): lse (N, S)
    out, lse = ad.sdpa(q, k, v, return_lse=True, backend="math")
    assert out.shape == (3, 5, 8) and lse.shape == (3, 5)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    q, k, v = (torch.randn(5, 2, 8) for _ in range(3))
    out, lse = ad.sdpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True, backend="math")
    assert lse.shape == (2, 5)  # (Hq, total_q), as flash-attn's varlen
    ref = torch.cat(
        [
            naive_attention(
                q[a:b].transpose(0, 1)[None],
                k[a:b].transpose(0, 1)[None],
                v[a:b].transpose(0, 1)[None],
                return_lse=True,
            )[1][0]
            for a, b in ((0, 2), (2, 5))
        ],
        dim=1,
    )
    torch.testing.assert_close(lse, ref)
    parts = [torch.randn(n, 2, 8) for n in (2, 3)]
    nq = torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)
    out, lse = ad.sdpa(nq, nq, nq, return_lse=True, backend="math")
    assert lse.is_nested and lse.shape[0] == 2 and lse.shape[1] == 2


def test_explain_names_each_feature_a_backend_lacks():
    q, k, v = _inputs(grad=False)
    d = ad.explain(
        q, k, v, enable_gqa=True, softcap=1.0, alibi_slopes=torch.rand(4), sinks=torch.zeros(4), return_lse=True
    )
    assert d.backend == "math"
    reasons = d.rejected["torch_cpu"]
    for words in (
        "softcap not supported",
        "alibi_slopes not supported",
        "sinks not supported",
        "return_lse not supported",
    ):
        assert words in reasons
    assert "softcap + alibi + sinks + return_lse" in d.problem.summary()


class _NoFeatures(ad.Backend):
    name = "no_features"
    capabilities = ad.Capabilities()  # a custom backend that never heard of issue 36

    def run(self, query, key, value, **options):
        raise AssertionError("never chosen for a call with softcap")


def test_a_custom_backend_does_not_claim_features_it_never_declared():
    ad.register_backend(_NoFeatures(), priority="first")
    q, k, v = _inputs(grad=False)
    assert ad.explain(q, k, v, enable_gqa=True, softcap=2.0).backend == "math"
    assert ad.explain(q, k, v, enable_gqa=True).backend == "no_features"


def test_lse_gradient_needs_a_backend_whose_lse_is_differentiable():
    import dataclasses

    class _ForwardLse(ad.Backend):
        name = "forward_lse"
        capabilities = dataclasses.replace(ad.get_backend("math").capabilities, lse_grad=False)

        def run(self, query, key, value, **options):
            return ad.get_backend("math").run(query, key, value, **options)

    ad.register_backend(_ForwardLse(), priority="first")
    q, k, v = _inputs()
    d = ad.explain(q, k, v, enable_gqa=True, return_lse=True)
    assert "return_lse with gradients: the returned logsumexp is not differentiable" in d.rejected["forward_lse"]
    with torch.no_grad():
        assert ad.explain(q, k, v, enable_gqa=True, return_lse=True).backend == "forward_lse"


@pytest.mark.parametrize(
    "kw,error,words",
    [
        (dict(softcap=0.0), ValueError, "softcap must be a finite float > 0"),
        (dict(softcap=-1.0), ValueError, "softcap must be a finite float > 0"),
        (dict(softcap=math.inf), ValueError, "softcap must be a finite float > 0"),
        (dict(softcap=math.nan), ValueError, "softcap must be a finite float > 0"),
        (dict(softcap=True), TypeError, "softcap must be None or a float > 0"),
        (dict(softcap="1"), TypeError, "softcap must be None or a float > 0"),
        (dict(alibi_slopes=torch.rand(3)), ValueError, "alibi_slopes of shape (3,); allowed: (4,) or (2, 4)"),
        (dict(alibi_slopes=torch.rand(2, 4, 1)), ValueError, "alibi_slopes of shape (2, 4, 1)"),
        (
            dict(alibi_slopes=torch.rand(4, dtype=torch.float64)),
            TypeError,
            "alibi_slopes.dtype=float64; allowed: float32",
        ),
        (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be None or a float32 tensor"),
        (dict(alibi_slopes=torch.rand(4, requires_grad=True)), ValueError, "no gradient is computed"),
        (dict(sinks=torch.zeros(2)), ValueError, "sinks of shape (2,); allowed: (4,)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, "sinks.dtype=int64"),
        (dict(sinks=1.0), TypeError, "sinks must be None or a tensor of shape (4,)"),
        (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    ],
)
def test_bad_feature_arguments_get_a_clear_error(kw, error, words):
    q, k, v = _inputs(grad=False)
    with pytest.raises(error) as info:
        ad.sdpa(q, k, v, enable_gqa=True, **kw)
    assert words in str(info.value)


def test_head_dim_past_the_kernel_limit_is_a_reason_naming_it():
    from attention_dispatch.kernels import KERNEL_LIMITS

    d = KERNEL_LIMITS.max_head_dim + 8
    q = torch.randn(1, 1, 2, d)
    reasons = ad.get_backend("triton").reasons(ad.api.normalize_call(q, q, q).problem)
    assert f"head_dim={d} > {KERNEL_LIMITS.max_head_dim}" in reasons
