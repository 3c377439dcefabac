"""sdpa() takes what F.scaled_dot_product_attention takes, with its meaning (issue 41):
PyTorch's CausalBias masks, its broadcasting, its degenerate arguments; and where we
differ on purpose (docs/semantics.md, "Where we differ from F.sdpa"), a test each."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attention_dispatch as ad
from cases import leaf_copy
from oracle import assert_matches

CPU_BACKENDS = ["auto", "torch_cpu", "math", "triton"]


def _runs(backend, q, k, v, **kw):
    """Skip a backend that declines the call (it must say why); None for auto."""
    if backend == "auto":
        return None
    d = ad.explain(q, k, v, backend=backend, **kw)
    if d.backend is None:
        pytest.skip(f"{backend} declines: {d.rejected[backend]}")
    return backend


def _compare_with_torch(backend, shapes, dtype=torch.float32, mask_fn=None, grad=True, **kw):
    """ad.sdpa against F.sdpa in float64 and in `dtype`, output and every gradient.
    mask_fn() -> a fresh mask (a CausalBias is rebuilt for each run)."""
    q, k, v = (torch.randn(s, dtype=dtype, requires_grad=grad) for s in shapes)
    mask = mask_fn() if mask_fn else None
    forced = _runs(backend, q, k, v, attn_mask=mask, **kw)
    out = ad.sdpa(q, k, v, attn_mask=mask, backend=forced, **kw)
    grad_out = torch.randn_like(out)
    leaves = [q, k, v]
    ours = [out] + (list(torch.autograd.grad(out, leaves, grad_out)) if grad else [])

    def torch_in(dt):
        copies = [leaf_copy(t, dt) for t in leaves]
        m = mask_fn() if mask_fn else None
        ref = F.scaled_dot_product_attention(*copies, attn_mask=m, **kw)
        return [ref] + (list(torch.autograd.grad(ref, copies, grad_out.to(dt))) if grad else [])

    ref64, ref_low = torch_in(torch.float64), torch_in(dtype)
    for name, got, r64, rlow in zip(["out", "dq", "dk", "dv"], ours, ref64, ref_low):
        assert_matches(got, r64, rlow, f"{backend} {name}")
    return ad.last_decision()


# ---- CausalBias ---------------------------------------------------------------------------

CAUSAL_BIAS = {"upper_left": causal_upper_left, "lower_right": causal_lower_right}
CB_SHAPES = {  # (query, key) shapes, GQA when the heads differ
    "Sq<Sk": ((1, 2, 5, 16), (1, 2, 7, 16)),
    "Sq>Sk": ((2, 2, 9, 16), (2, 2, 6, 16)),
    "Sq=Sk": ((1, 2, 8, 16), (1, 2, 8, 16)),
    "gqa": ((2, 6, 5, 16), (2, 3, 7, 16)),
}


@pytest.mark.parametrize("shape", CB_SHAPES)
@pytest.mark.parametrize("variant", CAUSAL_BIAS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_causal_bias_is_its_causal_kind(backend, variant, shape):
    """causal_upper_left / causal_lower_right as attn_mask mean causal='top_left' /
    'bottom_right': F.sdpa's output and gradients in every backend that runs them."""
    qs, ks = CB_SHAPES[shape]
    make = CAUSAL_BIAS[variant]
    d = _compare_with_torch(backend, (qs, ks, ks), mask_fn=lambda: make(qs[-2], ks[-2]), enable_gqa=qs[1] != ks[1])
    assert d.problem.causal == {"upper_left": "top_left", "lower_right": "bottom_right"}[variant]
    assert d.problem.mask_kind == "none"


@pytest.mark.parametrize("causal", [dict(is_causal=True), dict(causal="bottom_right"), dict(causal="top_left")])
def test_causal_bias_with_causal_raises_as_torch(causal):
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    for fn in (ad.sdpa, ad.explain):
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            fn(q, k, v, attn_mask=causal_upper_left(5, 5), **causal)


def test_causal_bias_of_other_lengths_raises():
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    with pytest.raises(ValueError, match="CausalBias for seq_len_q=4, seq_len_kv=5 but query has 5 positions"):
        ad.sdpa(q, k, v, attn_mask=causal_lower_right(4, 5))


def test_causal_bias_with_varlen_raises():
    parts = [torch.randn(n, 2, 16) for n in (3, 5)]
    nq = torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)
    with pytest.raises(ValueError, match="CausalBias with cu_seqlens/nested inputs: pass causal="):
        ad.sdpa(nq, nq, nq, attn_mask=causal_upper_left(5, 5))


# ---- inputs F.sdpa accepts ------------------------------------------------------------------

BROADCASTS = {  # (query, key, value) shapes, as F.sdpa broadcasts them
    "2-D (L, E)": ((5, 16), (7, 16), (7, 16)),
    "batch 1 vs 2": ((1, 2, 5, 16), (2, 2, 7, 16), (2, 2, 7, 16)),
    "4-D query, 3-D key/value": ((2, 3, 5, 16), (3, 7, 16), (3, 7, 16)),
    "4-D query, 2-D key/value": ((2, 3, 5, 16), (7, 16), (7, 16)),
    "one key/value head": ((2, 3, 5, 16), (2, 1, 7, 16), (2, 1, 7, 16)),
    "one query head": ((2, 1, 5, 16), (2, 3, 7, 16), (2, 3, 7, 16)),
    "5-D batch broadcast": ((2, 1, 3, 5, 16), (1, 4, 3, 7, 16), (1, 4, 3, 7, 8)),
}


@pytest.mark.parametrize("shape", BROADCASTS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_broadcasting_as_torch(backend, shape):
    _compare_with_torch(backend, BROADCASTS[shape])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_broadcast_with_mask_and_causal(backend):
    qs, ks = (1, 2, 6, 16), (3, 1, 6, 16)
    mask = torch.rand(3, 1, 6, 6) > 0.3
    mask[..., 0] = True
    _compare_with_torch(backend, (qs, ks, ks), mask_fn=lambda: mask)
    _compare_with_torch(backend, (qs, ks, ks), is_causal=True)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_dropout_one_gives_zeros_as_torch(backend):
    """dropout_p=1.0 drops every weight: zeros, and zero gradients (F.sdpa's result)."""
    _compare_with_torch(backend, ((2, 3, 5, 16), (2, 3, 7, 16), (2, 3, 7, 16)), dropout_p=1.0)


@pytest.mark.parametrize("dims", ["Dqk=0", "Dqk=0 Dv=0"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_head_dim_zero_as_torch(backend, dims):
    """Head dim 0: every score is 0 (plus the bias), so each row averages its allowed values;
    with Dv = 0 the output is empty."""
    dv = 0 if dims == "Dqk=0 Dv=0" else 16
    _compare_with_torch(backend, ((2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, dv)))


def test_head_dim_zero_is_served_by_math_with_reasons():
    q, k, v = torch.randn(1, 2, 4, 0), torch.randn(1, 2, 4, 0), torch.randn(1, 2, 4, 8)
    d = ad.explain(q, k, v)
    assert d.backend == "math"
    assert any("head_dim_qk=0 <" in r for r in d.rejected["torch_cpu"])


def test_causal_true_means_top_left():
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    assert ad.explain(q, k, v, causal=True).problem.causal == "top_left"
    torch.testing.assert_close(ad.sdpa(q, k, v, causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))


# ---- where we differ on purpose (docs/semantics.md) -----------------------------------------


def test_key_and_value_lengths_must_match():
    """PyTorch's CPU path does not check it; we raise."""
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 6, 16)
    with pytest.raises(ValueError, match="key has 7 positions but value has 6"):
        ad.sdpa(q, k, v)


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_scale_is_rejected(scale):
    """F.sdpa returns NaN (or 0) rows for these; we raise instead of returning NaN."""
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    with pytest.raises(ValueError, match="scale must be None or a finite float"):
        ad.sdpa(q, k, v, scale=scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_float32_bias_keeps_its_precision(backend, dtype):
    """A float32 bias with 16-bit inputs is added at float32, as F.sdpa does: the error is
    that of rounding the inputs and output, not of rounding a bias near 100 (0.25-0.5
    logits in bfloat16)."""
    q, k, v = (torch.randn(1, 2, 6, 16, dtype=dtype) for _ in range(3))
    bias = torch.randn(1, 2, 6, 6) * 2 + 100
    forced = _runs(backend, q, k, v, attn_mask=bias)
    out = ad.sdpa(q, k, v, attn_mask=bias, backend=forced)
    assert ad.last_decision().problem.float32_bias
    exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=bias.double())
    rounded_bias = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=bias.to(dtype).double())
    err, rounding = (out.double() - exact).abs().max().item(), (rounded_bias - exact).abs().max().item()
    assert err < rounding / 4, f"error {err:.3g} is that of a rounded bias ({rounding:.3g})"


def test_float32_bias_rejected_where_it_would_be_rounded():
    caps = ad.Capabilities(float32_bias=False)
    q, k, v = (torch.randn(1, 2, 6, 16, dtype=torch.bfloat16) for _ in range(3))
    problem = ad.explain(q, k, v, attn_mask=torch.randn(6, 6)).problem
    reasons = ad.not_supported_reasons(caps, problem)
    assert reasons == [
        "float32 attn_mask with bfloat16 inputs (the backend would round the bias to bfloat16; "
        "cast the mask to the query's dtype to allow it)"
    ]
    assert not ad.not_supported_reasons(caps, ad.explain(q, k, v, attn_mask=torch.randn(6, 6).bfloat16()).problem)


def test_float32_mask_with_float64_inputs_is_exact():
    q, k, v = (torch.randn(1, 2, 5, 16, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(5, 5)
    torch.testing.assert_close(ad.sdpa(q, k, v, attn_mask=bias), ad.sdpa(q, k, v, attn_mask=bias.double()))


# ---- tensor subclasses: each handled on purpose ----------------------------------------------


class _Tagged(torch.Tensor):
    """A subclass with a meaning of its own (as a quantised or sharded tensor has)."""


class DTensor(torch.Tensor):
    """Stands in for torch.distributed.tensor.DTensor (which needs a process group)."""


@pytest.mark.parametrize("where", ["query", "key", "value", "attn_mask"])
def test_unknown_tensor_subclass_is_rejected(where):
    args = {n: torch.randn(1, 2, 5, 16) for n in ("query", "key", "value")}
    args["attn_mask"] = torch.randn(5, 5)
    args[where] = args[where].as_subclass(_Tagged)
    for fn in (ad.sdpa, ad.explain):
        with pytest.raises(TypeError, match=f"{where} is a .*_Tagged, a torch.Tensor subclass that sdpa"):
            fn(**args)


def test_dtensor_gets_its_own_message():
    q = torch.randn(1, 2, 5, 16).as_subclass(DTensor)
    with pytest.raises(TypeError, match=r"query is a DTensor .* pass query.to_local\(\)"):
        ad.sdpa(q, q, q)


def test_parameters_are_plain_tensors():
    q, k, v = (torch.nn.Parameter(torch.randn(1, 2, 5, 16)) for _ in range(3))
    out = ad.sdpa(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_strided_nested_tensor_gets_our_message():
    nt = torch.nested.nested_tensor([torch.randn(2, 4, 16), torch.randn(2, 6, 16)])
    for fn in (ad.sdpa, ad.explain):
        with pytest.raises(TypeError, match="query is a nested tensor with layout torch.strided; only torch.jagged"):
            fn(nt, nt, nt)


# ---- configuration --------------------------------------------------------------------------


class _Custom(ad.Backend):
    name = "custom_first"

    def run(self, query, key, value, **options):
        return ad.get_backend("math").run(query, key, value, **options)


@pytest.mark.parametrize("text", ["", "[dispatch]\npolicy = \"priority\"\n", "[dispatch]\ndisabled = [\"triton\"]\n"])
def test_config_without_priority_keeps_custom_backends_where_registered(tmp_path, text):
    ad.register_backend(_Custom(), priority="first")
    path = tmp_path / "c.toml"
    path.write_text(text)
    ad.load_config(path)
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    d = ad.explain(q, k, v)
    assert d.backend == "custom_first", str(d)
    assert d.candidates[0] == "custom_first" and "registry order" in d.source


# ---- on a GPU: the same mappings reach every CUDA backend ------------------------------------


def _cuda_backends():
    if not torch.cuda.is_available():
        return []
    return ["auto"] + [
        n
        for n in ad.list_backends()
        if n != "math" and ad.get_backend(n).is_available() and "cuda" in ad.get_backend(n).capabilities.devices
    ]


def _compare_on_gpu(backend, q, k, v, mask_fn, **kw):
    forced = _runs(backend, q, k, v, attn_mask=mask_fn(), **kw)
    out = ad.sdpa(q, k, v, attn_mask=mask_fn(), backend=forced, **kw)
    ref64 = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=mask_fn(), **kw)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        low = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_fn(), **kw)
    assert_matches(out.cpu(), ref64.cpu(), low.cpu(), f"{backend} out")
    return ad.last_decision()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", CAUSAL_BIAS)
@pytest.mark.parametrize("backend", _cuda_backends())
def test_gpu_causal_bias_is_its_causal_kind(backend, variant):
    q = torch.randn(2, 8, 200, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 8, 264, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    d = _compare_on_gpu(backend, q, k, v, lambda: CAUSAL_BIAS[variant](200, 264))
    assert d.problem.mask_kind == "none" and d.problem.causal is not None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _cuda_backends())
def test_gpu_float32_bias_keeps_its_precision(backend):
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(1, 8, 256, 256, device="cuda") * 2 + 100
    forced = _runs(backend, q, k, v, attn_mask=bias)
    out = ad.sdpa(q, k, v, attn_mask=bias, backend=forced)
    exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=bias.double())
    rounded = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=bias.bfloat16().double())
    err, rounding = (out.double() - exact).abs().max().item(), (rounded - exact).abs().max().item()
    assert err < rounding / 4, f"{ad.last_decision().backend}: error {err:.3g}, a rounded bias gives {rounding:.3g}"
