"""flash-attn 4 under torch.compile: the flash_attn backend's traced dense call is one forward op
(flash-attn 4's public function) and one backward op (its ``_flash_attn_bwd``), so
fullgraph=True holds; checked against the eager call on the fake flash-attn 4 (tests/fakes),
and on the GPU with the real one (tests/test_compile.py's gpu items)."""

import sys

import pytest
import torch

from attention_dispatch.backends.fa4_compiled import compile_refusal, fa4_dense_forward
from attention_dispatch.backends.flash_attn import FlashAttnBackend
from attention_dispatch.semantics import CausalKind

from tests import fakes
from tests.naive import naive_attention
from tests.test_adapters import _fa4_options


@pytest.fixture
def fa4(monkeypatch):
    calls: list = []
    modules = fakes.make_flash_attn(4, calls)
    for missing in ("flash_attn", "flash_attn_interface", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, missing, raising=False)
    fakes.install(monkeypatch, modules)
    modules["flash_attn.cute.interface"].marked_lse = False
    return FlashAttnBackend(), modules["flash_attn.cute.interface"], calls


CASES = [(None, None), (CausalKind.BOTTOM_RIGHT, None), (None, (5, 3)), (CausalKind.BOTTOM_RIGHT, (6, 0))]


@pytest.mark.parametrize("causal,window", CASES)
def test_traced_flash_attn_4_call_is_one_op_pair(fa4, causal, window):
    """fullgraph=True over backend.run(): output and gradients equal to the eager call's (which
    goes through flash_attn_func and FlashAttnFunc), the backward through _flash_attn_bwd."""
    backend, interface, calls = fa4
    options = _fa4_options(causal, window, 4, 2)
    q = torch.randn(2, 4, 24, 64, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, 64, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def model(q, k, v):
        return backend.run(q, k, v, **options)

    want = model(q, k, v)  # eager first: the backend loads its generations outside the trace, as sdpa() does
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    backwards = len(interface.backwards)
    got_grads = torch.autograd.grad(got, (q, k, v), g)
    assert len(interface.backwards) == backwards + 1  # flash-attn 4's backward, called by the op
    assert interface.backwards[-1]["softcap"] == 0.0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    ref = naive_attention(q, k, v, causal=causal and "bottom_right", window=window, scale=0.3)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_traced_call_returns_the_logsumexp_when_asked(fa4):
    backend, _, _ = fa4
    options = dict(_fa4_options(None, None, 2, 2), return_lse=True)
    q, k, v = (torch.randn(1, 2, 8, 64, dtype=torch.float64) for _ in range(3))
    want_out, want_lse = backend.run(q, k, v, **options)
    torch._dynamo.reset()
    out, lse = torch.compile(lambda q, k, v: backend.run(q, k, v, **options), fullgraph=True, backend="aot_eager")(
        q, k, v
    )
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_fake_of_the_forward_op_matches_its_output_shapes(fa4):
    """register_fake's shapes and dtypes are the real op's (torch.library's own check)."""
    q = torch.randn(2, 24, 4, 16)  # flash-attn's (B, S, H, D)
    k, v = torch.randn(2, 40, 4, 16), torch.randn(2, 40, 4, 8)
    torch.library.opcheck(
        fa4_dense_forward, (q, k, v, 0.3, False, -1, -1, 0.0, False), test_utils=("test_schema", "test_faketensor")
    )


def test_untested_release_and_sinks_keep_the_public_function():
    assert compile_refusal("4.0.0b36", {}) is None
    assert "not a tested release" in compile_refusal("4.1.0", {})
    assert "sinks" in compile_refusal("4.0.0b36", {"learnable_sink": torch.zeros(2)})
