"""torch.compile(fullgraph=True) traces a model calling sdpa(): the decision is taken once
while tracing, outside the graph, and the graph holds only the chosen backend's ops."""

import pytest
import torch

import attention_dispatch as ad


@pytest.mark.parametrize("backend", [None, "math", "torch_cpu", "triton"])
def test_fullgraph_compile_matches_eager(backend):
    q, k, v = (torch.randn(2, 4, 16, 32, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 4, 16, 16, requires_grad=True)
    if ad.explain(q, k, v, attn_mask=bias, backend=backend).backend is None:
        pytest.skip(f"{backend} cannot serve this call here")

    def model(q, k, v, bias):
        return ad.sdpa(q, k, v, attn_mask=bias, backend=backend).sum(dim=-1)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with ad.record() as decisions:
        out = compiled(q, k, v, bias)
    assert len(decisions) == 1 and decisions[0].backend == (backend or decisions[0].backend)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None
    ref = model(q, k, v, bias)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, t in zip(grads, (q, k, v, bias)):
        torch.testing.assert_close(g, t.grad, atol=1e-5, rtol=1e-5)


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
