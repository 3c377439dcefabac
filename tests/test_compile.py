"""torch.compile(fullgraph=True) traces a model calling sdpa(): the decision is taken once
while tracing, outside the graph, and the graph holds only the chosen backend's ops.

fullgraph=True turns any graph break into an error, so each test passing is the claim
"no graph break" for its path; each also compares forward and backward with eager."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental import symbolic_shapes

import attention_dispatch as ad

CPU_BACKENDS = ["math", "torch_cpu", "triton"]  # triton: under TRITON_INTERPRET=1
GPU_BACKENDS = ["triton", "cudnn", "torch_flash", "torch_efficient", "flash_attn"]


def _fullgraph(fn, backend="aot_eager", **options):
    """fn compiled with fullgraph=True from a clean dynamo state, and its frame counter."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, fullgraph=True, backend=counter, **options), counter


def _leaves(*shapes, dtype=torch.float32, device="cpu"):
    return [torch.randn(*s, dtype=dtype, device=device, requires_grad=True) for s in shapes]


def _grads(out, tensors):
    """Gradients of a fixed random projection of out with respect to tensors (cleared after)."""
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    (out * weights).sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


def _assert_compiled_equals_eager(fn, compiled, tensors, backend, **tol):
    with ad.record() as decisions:
        got = compiled(*tensors)
    assert [d.backend for d in decisions] == [backend]  # decided once, while tracing
    got_grads = _grads(got, tensors)
    want = fn(*tensors)
    want_grads = _grads(want, tensors)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tol)
    return decisions[0]


def _skip_unless_chosen(backend, *args, **kwargs):
    decision = ad.explain(*args, backend=backend, **kwargs)
    if decision.backend != backend:  # the reasons name what is missing (not installed, no GPU...)
        pytest.skip(f"{backend} cannot serve this call here: {'; '.join(decision.rejected.get(backend, []))}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fullgraph_forward_and_backward_each_cpu_backend(backend):
    """Causal GQA without a mask: the call every CPU backend serves, torch_cpu included (its
    pin is traced as sdpa_kernel, not as the flag getters that broke the graph)."""
    q, k, v = _leaves((2, 4, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16))
    _skip_unless_chosen(backend, q, k, v, is_causal=True, enable_gqa=True)

    def model(q, k, v):
        return ad.sdpa(q, k, v, is_causal=True, enable_gqa=True, backend=backend)

    compiled, counter = _fullgraph(model)
    _assert_compiled_equals_eager(model, compiled, (q, k, v), backend, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fullgraph_new_shapes_each_decided_for_its_size(backend):
    """After a shape changes dynamo traces sizes symbolically; the decision still takes
    constants (a size is specialised, so each shape gets its own graph and decision)."""
    _skip_unless_chosen(backend, *_leaves((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), is_causal=True)

    def model(q, k, v):
        return ad.sdpa(q, k, v, is_causal=True, backend=backend)

    compiled, counter = _fullgraph(model)
    for batch, seqlen in ((1, 8), (2, 12)):
        tensors = _leaves(*[(batch, 2, seqlen, 16)] * 3)
        decision = _assert_compiled_equals_eager(model, compiled, tensors, backend, atol=1e-5, rtol=1e-5)
        assert (decision.problem.batch, decision.problem.seqlen_q) == (batch, seqlen)
    assert counter.frame_count == 2


needs_hints = pytest.mark.skipif(
    not hasattr(symbolic_shapes, "optimization_hint"),
    reason="this torch has no symbolic_shapes.optimization_hint: a symbolic length is specialised (tracing.py)",
)


@needs_hints
@pytest.mark.parametrize("how", ["mark_dynamic", "dynamic=True"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fullgraph_dynamic_length_one_graph(backend, how):
    """A symbolic sequence length (Sq = Sk) stays symbolic: decided once while tracing and
    proven the same for every length (the decision's note says so), one graph serves lengths
    across powers of two, forward and backward equal to eager."""
    _skip_unless_chosen(backend, *_leaves(*[(2, 2, 8, 16)] * 3), is_causal=True)

    def model(q, k, v):
        return ad.sdpa(q, k, v, is_causal=True, backend=backend)

    compiled, counter = _fullgraph(model, dynamic=True if how == "dynamic=True" else None)
    decisions, frames = [], []
    for seqlen in (8, 12, 20):
        tensors = _leaves(*[(2, 2, seqlen, 16)] * 3)
        if how == "mark_dynamic":  # dynamo refuses to specialise a marked size: an error if we did
            for t in tensors:
                torch._dynamo.mark_dynamic(t, 2)
        with ad.record() as recorded:
            got = compiled(*tensors)
        decisions.append(recorded)
        frames.append(counter.frame_count)
        got_grads = _grads(got, tensors)
        torch.testing.assert_close(got, model(*tensors), atol=1e-5, rtol=1e-5)
        for g, w in zip(got_grads, _grads(model(*tensors), tensors)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # one graph, traced at length 8 (dynamic=True traces it twice: dynamo restarts once to
    # specialise the scale, a float of the symbolic head dim); nothing traced or decided after
    assert frames == [1, 1, 1] if how == "mark_dynamic" else frames[1:] == frames[:1] * 2
    assert decisions[1:] == [[], []] and {d.backend for d in decisions[0]} == {backend}
    decision = decisions[0][-1]
    assert decision.problem.seqlen_q == decision.problem.seqlen_k == 8
    assert "torch.compile: decided while tracing, for Sq=Sk=8 traced symbolically" in str(decision)
    assert "the same decision for every length from 1 (proven)" in str(decision)


@needs_hints
@pytest.mark.parametrize("backend", ["math", "torch_cpu"])
def test_fullgraph_dynamic_length_with_a_mask(backend):
    """A (B, 1, S, S) boolean mask whose dims are the same symbol as the length: one graph."""

    def model(q, k, v, mask):
        return ad.sdpa(q, k, v, attn_mask=mask, backend=backend)

    compiled, counter = _fullgraph(model)
    for seqlen in (9, 14, 23):
        q, k, v = _leaves(*[(2, 2, seqlen, 16)] * 3)
        mask = torch.rand(2, 1, seqlen, seqlen) > 0.3
        mask[..., 0] = True  # no empty row (each backend's own convention there is tested elsewhere)
        for t, dims in ((q, (2,)), (k, (2,)), (v, (2,)), (mask, (2, 3))):
            for dim in dims:
                torch._dynamo.mark_dynamic(t, dim)
        _skip_unless_chosen(backend, q, k, v, attn_mask=mask)
        got = compiled(q, k, v, mask)
        torch.testing.assert_close(got, model(q, k, v, mask), atol=1e-5, rtol=1e-5)
        want = torch.softmax((q @ k.transpose(-1, -2) / 4).masked_fill(~mask, -torch.inf), -1) @ v
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


def test_fullgraph_static_shapes_say_so():
    q, k, v = _leaves(*[(1, 2, 8, 16)] * 3)
    compiled, _ = _fullgraph(lambda q, k, v: ad.sdpa(q, k, v, backend="math"))
    with ad.record() as decisions:
        compiled(q, k, v)
    assert "torch.compile: decided while tracing, for these sizes (another size traces again)" in str(decisions[0])


@pytest.mark.parametrize("backend", ["math", "triton"])
def test_fullgraph_bias_with_gradient(backend):
    """A float bias that requires grad (torch_cpu rejects those: PyTorch's CPU kernel does)."""
    q, k, v, bias = _leaves((2, 4, 16, 32), (2, 4, 16, 32), (2, 4, 16, 32), (1, 4, 16, 16))
    _skip_unless_chosen(backend, q, k, v, attn_mask=bias)

    def model(q, k, v, bias):
        return ad.sdpa(q, k, v, attn_mask=bias, backend=backend).sum(dim=-1)

    compiled, _ = _fullgraph(model)
    _assert_compiled_equals_eager(model, compiled, (q, k, v, bias), backend, atol=1e-5, rtol=1e-5)


def test_fullgraph_through_patch_sdpa_on_the_cpu_kernel():
    """A model calling F.scaled_dot_product_attention, routed by patch_sdpa() to torch_cpu."""

    def model(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, k, v = _leaves((2, 4, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16))
    compiled, _ = _fullgraph(model)
    with ad.use_backends("torch_cpu"), ad.patch_sdpa():
        _assert_compiled_equals_eager(model, compiled, (q, k, v), "torch_cpu", atol=1e-5, rtol=1e-5)


def test_fullgraph_through_the_transformers_integration():
    """A tiny Llama under attn_implementation="attention_dispatch", on the default CPU path
    (torch_cpu for the unpadded batch), two sequence lengths, forward and backward."""
    transformers = pytest.importorskip("transformers")
    from attention_dispatch.integrations import transformers as ad_hf

    name = ad_hf.register()
    cfg = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    compiled, _ = _fullgraph(model, backend="eager")  # dynamo's graph only: AOT-tracing a model costs ~10 s
    for length in (9, 13):
        ids = torch.randint(3, 61, (2, length))
        with ad.use_backends("torch_cpu", "math"), ad.record() as decisions:
            got = compiled(input_ids=ids).logits
            got.square().sum().backward()
        got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        with ad.use_backends("torch_cpu", "math"):
            want = model(input_ids=ids).logits
            want.square().sum().backward()
        assert [d.backend for d in decisions] == ["torch_cpu"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(got_grads[n], p.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        model.zero_grad(set_to_none=True)


def test_compile_varlen_needs_max_seqlen():
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    torch._dynamo.reset()
    f = torch.compile(
        lambda q: ad.sdpa(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="math"),
        fullgraph=True,
        backend="aot_eager",
    )
    with pytest.raises(Exception, match="pass max_seqlen_q and max_seqlen_k"):
        f(q)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_fullgraph_forward_and_backward_each_gpu_backend(backend, compile_backend):
    """The same claim on the GPU, in bfloat16, for each GPU backend that is installed."""
    q, k, v = _leaves(*[(2, 4, 256, 64)] * 3, dtype=torch.bfloat16, device="cuda")
    _skip_unless_chosen(backend, q, k, v, is_causal=True)

    def model(q, k, v):
        return ad.sdpa(q, k, v, is_causal=True, backend=backend)

    compiled, counter = _fullgraph(model, backend=compile_backend)
    _assert_compiled_equals_eager(model, compiled, (q, k, v), backend, atol=2e-2, rtol=2e-2)
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_fullgraph_new_shapes_each_gpu_backend(backend):
    q, k, v = _leaves(*[(1, 4, 128, 64)] * 3, dtype=torch.bfloat16, device="cuda")
    _skip_unless_chosen(backend, q, k, v, is_causal=True)

    def model(q, k, v):
        return ad.sdpa(q, k, v, is_causal=True, backend=backend)

    compiled, _ = _fullgraph(model)
    for batch, seqlen in ((1, 128), (2, 192), (1, 320)):
        tensors = _leaves(*[(batch, 4, seqlen, 64)] * 3, dtype=torch.bfloat16, device="cuda")
        decision = _assert_compiled_equals_eager(model, compiled, tensors, backend, atol=2e-2, rtol=2e-2)
        assert decision.problem.seqlen_q == seqlen
