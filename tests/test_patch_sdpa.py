"""ad.patch_sdpa(): F.scaled_dot_product_attention routed through ad.sdpa in a scope, eager and compiled."""

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import attention_dispatch as ad
from attention_dispatch import patch as ad_patch

TORCH_SDPA = F.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _clean():
    """Every test starts and ends unpatched; PyTorch's CPU kernel (which itself calls F.sdpa: the
    router must not recurse) and the math reference, not the interpreted Triton kernel (~2 s a call)."""
    assert F.scaled_dot_product_attention is TORCH_SDPA and not ad_patch.sdpa_patched()
    torch.manual_seed(0)
    with ad.use_backends("torch_cpu", "math"):
        yield
    assert F.scaled_dot_product_attention is TORCH_SDPA and not ad_patch.sdpa_patched()


class TinyAttention(torch.nn.Module):
    """A model that knows nothing of attention_dispatch: it calls F.scaled_dot_product_attention."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, enable_gqa=True)
        if mask is not None:  # a second call: bool mask, positional arguments, keyword-only scale
            h = h + F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.3, enable_gqa=True)
        return self.o(h.transpose(1, 2).reshape(b, s, -1))


def _inputs():
    x = torch.randn(2, 7, 32)
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True
    return x, mask


def test_eager_routes_every_call_and_restores():
    model, (x, mask) = TinyAttention(), _inputs()
    want = model(x), model(x, mask)
    with ad.record() as ds, ad.patch_sdpa():
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        got = model(x), model(x, mask)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert len(ds) == 3
    assert [d.problem.mask_kind for d in ds] == ["none", "none", "bool"]
    assert ds[0].problem.causal == ad.CausalKind.TOP_LEFT and ds[0].problem.heads_kv == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_gradients_equal():
    model, (x, mask) = TinyAttention(), _inputs()
    model(x, mask).square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with ad.use_backends("math"), ad.patch_sdpa(), ad.record() as ds:
        model(x, mask).square().sum().backward()
    assert {d.backend for d in ds} == {"math"}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n])


@pytest.mark.parametrize("compile_backend", ["eager", "inductor"])
def test_compiled_model_equal_and_recompiled_after_the_scope(compile_backend):
    model, (x, mask) = TinyAttention(), _inputs()
    want = model(x, mask)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=compile_backend)
    with ad.patch_sdpa(), ad.record() as ds:
        got = compiled(x, mask)
    torch.testing.assert_close(got, want)
    assert len(ds) >= 2  # decided while tracing (or run, around graph breaks)
    with ad.record() as ds:  # the graph was guarded on the patched attribute: PyTorch's again
        torch.testing.assert_close(compiled(x, mask), want)
    assert ds == []


def test_compiled_fullgraph_through_the_router():
    """The router (its per-thread flag included) traces without a graph break (math here;
    test_compile.py traces it onto torch_cpu)."""
    model, (x, mask) = TinyAttention(), _inputs()
    want = model(x, mask)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with ad.use_backends("math"), ad.patch_sdpa(), ad.record() as ds:
        got = compiled(x, mask)
        got.sum().backward()
    torch.testing.assert_close(got, want)
    assert [d.backend for d in ds] == ["math", "math"]


def test_restored_after_an_exception_inside_the_block():
    model, (x, _) = TinyAttention(), _inputs()
    with pytest.raises(RuntimeError, match="inside"):
        with ad.patch_sdpa():
            model(x)
            raise RuntimeError("inside")
    assert F.scaled_dot_product_attention is TORCH_SDPA
    bad = torch.randn(2, 3, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError):  # ad.sdpa's own error (3 query heads on 2 kv heads, no enable_gqa)
        with ad.patch_sdpa():
            F.scaled_dot_product_attention(*bad)
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_plain_call_nesting_and_unpatch_without_patch():
    with pytest.raises(RuntimeError, match="not patched"):
        ad.unpatch_sdpa()
    ad.patch_sdpa()
    try:
        with ad.patch_sdpa():  # nested: counted
            assert ad_patch.sdpa_patched()
        assert F.scaled_dot_product_attention is not TORCH_SDPA  # the outer scope is still open
        q = torch.randn(1, 2, 4, 8)
        with ad.record() as ds:
            F.scaled_dot_product_attention(q, q, q)
        assert len(ds) == 1
    finally:
        ad.unpatch_sdpa()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_process_global_across_threads_and_counted():
    q = torch.randn(1, 2, 4, 8)
    seen, opened, release = [], threading.Event(), threading.Event()

    def worker():
        with ad.patch_sdpa():  # a second scope, in another thread
            opened.set()
            release.wait(10)

    with ad.patch_sdpa():
        thread = threading.Thread(target=worker)
        thread.start()
        opened.wait(10)
        caller = threading.Thread(target=lambda: seen.append(F.scaled_dot_product_attention is not TORCH_SDPA))
        caller.start()
        caller.join()
    assert seen == [True]  # a thread that opened no scope is routed too: the patch is process-global
    assert F.scaled_dot_product_attention is not TORCH_SDPA  # the worker's scope is still open
    release.set()
    thread.join()
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with ad.patch_sdpa(), ad.record() as ds:
        F.scaled_dot_product_attention(q, q, q)
    assert len(ds) == 1


def test_a_later_patch_by_someone_else_is_left_in_place():
    def theirs(*args, **kwargs):
        return TORCH_SDPA(*args, **kwargs)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ad.patch_sdpa():
                F.scaled_dot_product_attention = theirs
        assert F.scaled_dot_product_attention is theirs
        assert any("another patch" in str(w.message) for w in caught)
    finally:
        F.scaled_dot_product_attention = TORCH_SDPA


def test_multihead_attention_and_transformers_sdpa_models_are_routed():
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).train()  # train(): not the fused fast path
    x = torch.randn(2, 5, 16)
    want = mha(x, x, x, need_weights=False)[0]
    with ad.patch_sdpa(), ad.record() as ds:
        got = mha(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(got, want)
    assert len(ds) == 1

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 61, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    want = model(input_ids=ids, attention_mask=mask).logits
    with ad.patch_sdpa(), ad.record() as ds:
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
    assert len(ds) == 2
