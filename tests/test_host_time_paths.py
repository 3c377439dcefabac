"""The CPU paths that cut host time (issues 34/35) compute exactly what the paths they replace
did: GQA folded into rows (torch_sdpa.FOLDED) against the unfolded call and the float64 oracle,
forward and backward; a single decode row with bottom-right causal as a plain call; the torch_cpu
prepared runner's op without its default arguments; the two-flag CPU pin; the KV cache computed
over the longest valid length only (lengths varied, 0 and full included, keys past them
poisoned); and sdpa()'s leaner fast-path key, which must still tell apart what the decision or
the prepared runner depends on."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention_dispatch as ad
from attention_dispatch import dispatch
from attention_dispatch.backends import torch_backends
from attention_dispatch.backends import torch_sdpa as ts
from attention_dispatch.backends.torch_backends import TorchCpuBackend
from attention_dispatch.fast_key import call_key, length_key
from naive import naive_attention
from oracle import assert_matches
from test_kvcache import KvCase, check_kv_call, kv_reference, make_kv_inputs


@pytest.fixture
def one_thread(monkeypatch):
    """ts.fold_pays() asks for B * Hkv >= the thread count: pin it so that folding is decided
    the same way on any machine."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)


def _oracle(q, k, v, causal=None, scale=None):
    group = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(group, 1) for t in (k, v))
    return naive_attention(q.double(), k64, v64, causal=causal, scale=scale)


def _unfolded(q, k, v, scale=None):
    """F.sdpa's own GQA path (enable_gqa), pinned to the CPU flash kernel."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


# (B, Hq, Hkv, Sq, Sk, D)
FOLD_SHAPES = [
    (1, 32, 8, 1, 70, 64),
    (2, 8, 2, 1, 129, 32),
    (3, 6, 1, 4, 33, 16),  # MQA, speculative decoding rows
    (2, 4, 2, 8, 8, 16),
    (1, 16, 2, 2, 300, 40),
]


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d", FOLD_SHAPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_folded_gqa_equals_unfolded_forward_and_backward(one_thread, b, hq, hkv, sq, sk, d, layout):
    backend = TorchCpuBackend()
    q, k, v = torch.randn(b, hq, sq, d), torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)
    if layout == "bshd":  # transformers' layout: the heads inside the rows (q not viewable as folded)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    opts = dict(attn_mask=None, dropout_p=0.0, causal=None, window=None, scale=1 / math.sqrt(d), enable_gqa=True)
    form, _ = backend._form(q, k, opts)
    assert form == ts.FOLDED
    out = backend.run(q, k, v, **opts)
    want = _unfolded(q, k, v)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    ref = _oracle(q, k, v)
    assert_matches(out, ref, want, "folded out")
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(want, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, t, r, name in zip(got, theirs, ref_grads, "qkv"):
        assert a.shape == t.shape
        assert_matches(a, r, t, f"d{name}")


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d", FOLD_SHAPES[:3])
def test_folded_gqa_through_sdpa_first_repeated_and_growing_calls(one_thread, b, hq, hkv, sq, sk, d):
    """sdpa(): the first call (run()), a repeated one (the prepared runner on the folded op) and
    calls whose Sk grows by one (the span path, run()) all equal the oracle; the route says
    FOLDED and the repeat calls take the ATen op."""
    k_all, v_all = torch.randn(b, hkv, sk + 4, d), torch.randn(b, hkv, sk + 4, d)
    decision = ad.explain(
        torch.randn(b, hq, sq, d), k_all[:, :, :sk], v_all[:, :, :sk], enable_gqa=True, backend="torch_cpu"
    )
    assert decision.backend == "torch_cpu"
    assert [s.chosen for s in decision.route.steps] == [ts.FOLDED, f"torch.{TorchCpuBackend.direct_op}"]
    with torch.no_grad():
        for n in (sk, sk, sk, sk + 1, sk + 2, sk + 3):
            q = torch.randn(b, hq, sq, d)
            k, v = k_all[:, :, :n], v_all[:, :, :n]
            out = ad.sdpa(q, k, v, enable_gqa=True, backend="torch_cpu")
            assert ad.last_decision().backend == "torch_cpu"
            assert_matches(out, _oracle(q, k, v), _unfolded(q, k, v), f"Sk={n}")


def test_no_fold_where_it_would_leave_threads_idle(monkeypatch):
    """B * Hkv below the thread count: the unfolded call (G times more tasks), still exact."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    backend = TorchCpuBackend()
    q, k, v = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    opts = dict(attn_mask=None, dropout_p=0.0, causal=None, window=None, scale=0.25, enable_gqa=True)
    assert backend._form(q, k, opts)[0] == ts.PLAIN
    assert_matches(backend.run(q, k, v, **opts), _oracle(q, k, v), _unfolded(q, k, v))


@pytest.mark.parametrize("sq", [2, 40])
def test_no_fold_with_causal_or_many_rows(one_thread, sq):
    """Causal (folding would break the diagonal) and more rows than one query block keep F.sdpa's
    GQA path."""
    backend = TorchCpuBackend()
    q, k, v = torch.randn(2, 4, sq, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    for causal in (ad.CausalKind.TOP_LEFT, ad.CausalKind.BOTTOM_RIGHT, None):
        opts = dict(attn_mask=None, dropout_p=0.0, causal=causal, window=None, scale=0.25, enable_gqa=True)
        form = backend._form(q, k, opts)[0]
        assert form != ts.FOLDED or (causal is None and 2 * sq <= 32)
        ref = _oracle(q, k, v, causal=None if causal is None else str(causal), scale=0.25)
        assert_matches(backend.run(q, k, v, **opts), ref, what=f"{causal} {form}")


@pytest.mark.parametrize("hkv", [4, 2])
def test_one_row_bottom_right_causal_is_a_plain_call(one_thread, hkv):
    """Sq = 1 aligned bottom-right sits at the last key: every key is allowed, so no band mask."""
    q, k, v = torch.randn(3, 4, 1, 16), torch.randn(3, hkv, 37, 16), torch.randn(3, hkv, 37, 16)
    backend = TorchCpuBackend()
    opts = dict(attn_mask=None, dropout_p=0.0, causal=ad.CausalKind.BOTTOM_RIGHT, window=None, scale=0.25)
    assert backend._form(q, k, opts)[0] == (ts.PLAIN if hkv == 4 else ts.FOLDED)
    for _ in range(2):  # the full path, then the prepared runner
        out = ad.sdpa(q, k, v, causal="bottom_right", scale=0.25, enable_gqa=hkv != 4, backend="torch_cpu")
        assert_matches(out, _oracle(q, k, v, causal="bottom_right", scale=0.25))


@pytest.mark.parametrize("d", [1, 3, 16, 64, 80, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_prepared_cpu_runner_without_default_scale_is_bitwise_the_op(d, is_causal):
    """The runner leaves out a scale equal to 1/sqrt(D): the op's default is the same double."""
    q, k, v = torch.randn(2, 3, 5, d), torch.randn(2, 3, 5, d), torch.randn(2, 3, 5, d)
    op = torch._scaled_dot_product_flash_attention_for_cpu
    backend = TorchCpuBackend()
    for scale in (1.0 / math.sqrt(d), 0.3):
        runner = backend._direct_call(op, is_causal, scale, False, head_dim=d)
        assert torch.equal(runner(q, k, v), op(q, k, v, 0.0, is_causal, scale=scale)[0])
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            assert torch.equal(
                runner(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
            )


# ---- the CPU pin ----------------------------------------------------------------------------


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("math_on", [True, False])
def test_cpu_pin_sets_flash_only_and_restores_every_flag(flash, math_on):
    flags = torch.backends.cuda
    getters = [
        flags.flash_sdp_enabled,
        flags.mem_efficient_sdp_enabled,
        flags.math_sdp_enabled,
        flags.cudnn_sdp_enabled,
    ]
    before = [g() for g in getters]
    flags.enable_flash_sdp(flash)
    flags.enable_math_sdp(math_on)
    try:
        state = [g() for g in getters]
        with ts.CpuPinnedKernel():
            assert [g() for g in getters] == [True, state[1], False, state[3]]
        assert [g() for g in getters] == state
        with pytest.raises(RuntimeError, match="inside"):
            with ts.CpuPinnedKernel():
                raise RuntimeError("inside")
        assert [g() for g in getters] == state
    finally:
        flags.enable_flash_sdp(before[0])
        flags.enable_math_sdp(before[2])


def _ops_run(fn) -> set[str]:
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}


@pytest.mark.parametrize("efficient_cudnn", [True, False])
def test_cpu_pin_runs_the_flash_kernel_and_never_falls_back_to_math(efficient_cudnn):
    """Whatever the other flags say (the CPU choice never reads them), under the pin F.sdpa runs
    the fused CPU kernel, and a call that kernel refuses raises instead of running math."""
    flags = torch.backends.cuda
    before = (flags.mem_efficient_sdp_enabled(), flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled())
    flags.enable_mem_efficient_sdp(efficient_cudnn)
    flags.enable_cudnn_sdp(efficient_cudnn)
    flags.enable_flash_sdp(False)
    try:
        q = torch.randn(1, 2, 4, 8)
        with ts.CpuPinnedKernel():
            ran = _ops_run(lambda: F.scaled_dot_product_attention(q, q, q))
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ran
        assert "aten::_scaled_dot_product_attention_math" not in ran
        with ts.CpuPinnedKernel(), warnings.catch_warnings(), pytest.raises(RuntimeError):
            warnings.simplefilter("ignore")  # PyTorch says why the flash kernel was not used
            F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)  # no dropout in the CPU kernel
    finally:
        flags.enable_mem_efficient_sdp(before[0])
        flags.enable_cudnn_sdp(before[1])
        flags.enable_flash_sdp(before[2])


# ---- the KV cache over its valid keys -------------------------------------------------------

KV_LENGTHS = {
    "one length": (37, 37, 37),
    "one length, full": (64, 64, 64),
    "all empty": (0, 0, 0),
    "varied with 0 and full": (64, 0, 21),
    "varied": (5, 33, 12),
    "one sequence": (17,),
}


@pytest.mark.parametrize("lengths", list(KV_LENGTHS.values()), ids=list(KV_LENGTHS))
@pytest.mark.parametrize("sq,causal,append", [(1, False, False), (1, True, True), (3, True, False), (2, False, True)])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_kvcache_over_the_longest_length_matches_the_reference(one_thread, lengths, sq, causal, append, heads):
    """torch_cpu's run_kvcache against the float64 reference of test_kvcache (and the cache after
    the append, exactly), every length from 0 to the capacity."""
    n_new = sq if append else 0
    lengths = tuple(min(n, 64 - n_new) for n in lengths)
    case = KvCase(
        batch=len(lengths),
        heads_q=heads[0],
        heads_kv=heads[1],
        seqlen_q=sq,
        causal=causal,
        append=append,
        lengths=lengths,
    )
    check_kv_call("torch_cpu", case)
    check_kv_call("torch_cpu", case)  # the repeated call (sdpa_with_kvcache's fast path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("lengths", [(40, 40), (40, 3)])
@pytest.mark.parametrize("sq,causal", [(1, True), (2, True), (3, False)])
def test_kvcache_over_the_longest_length_in_every_dtype(one_thread, dtype, lengths, sq, causal):
    case = KvCase(dtype=dtype, batch=2, heads_q=4, heads_kv=2, seqlen_q=sq, causal=causal, append=True, lengths=lengths)
    check_kv_call("torch_cpu", case)


@pytest.mark.parametrize("lengths", [(20, 20), (0, 0), (20, 7), (0, 9)])
def test_kvcache_never_reads_past_the_valid_keys(one_thread, monkeypatch, lengths):
    """The kernel is handed no key past a sequence's length: one length for all, one call over
    it; lengths that differ, one call per non-empty sequence over its own.  Keys and values past
    the lengths hold NaN and the output is still exact (the CPU kernel does not mask a NaN away)."""
    case = KvCase(batch=2, heads_q=4, heads_kv=2, seqlen_q=1, capacity=48, lengths=lengths)
    args = make_kv_inputs(case)
    equal = len(set(lengths)) == 1
    for b, n in enumerate(lengths):
        args["k_cache"][b, :, n:] = math.nan
        args["v_cache"][b, :, n:] = math.nan
    seen = []

    def recording(real):
        def recorder(q, k, v, *a, **kw):
            seen.append(k.shape[2])
            return real(q, k, v, *a, **kw)

        return recorder

    # the CPU op itself (TorchCpuBackend._direct_dense), once or per sequence
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording(F.scaled_dot_product_attention))
    monkeypatch.setattr(torch_backends, "_CPU_FLASH", recording(torch_backends._CPU_FLASH))
    out = ad.sdpa_with_kvcache(**args, backend="torch_cpu")
    assert seen == ([max(lengths)] if equal and max(lengths) else [n for n in lengths if n and not equal])
    ref = kv_reference(args["query"], args["k_cache"].nan_to_num(), args["v_cache"].nan_to_num(), list(lengths))
    assert_matches(out, ref)


def test_kvcache_append_with_one_length_writes_the_same_cache_as_the_scatter():
    """The slice copy (every sequence at one length) and kv_append's scatter leave equal caches."""
    case = KvCase(batch=3, heads_q=4, heads_kv=2, seqlen_q=2, append=True, lengths=(30, 30, 30))
    args = make_kv_inputs(case)
    from attention_dispatch.kernels.kv_append import append_kv

    k_want, v_want = args["k_cache"].clone(), args["v_cache"].clone()
    append_kv(k_want, v_want, args["cache_seqlens"], args["k_new"], args["v_new"])
    ad.sdpa_with_kvcache(**args, backend="torch_cpu")
    assert torch.equal(args["k_cache"], k_want) and torch.equal(args["v_cache"], v_want)


# ---- sdpa()'s fast-path key -----------------------------------------------------------------


def _key(q, k, v, **kw):
    args = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    args.update(kw)
    return call_key(
        q, k, v, args["attn_mask"], args["dropout_p"], args["is_causal"], args["scale"], args["enable_gqa"],
        None, None, None, None,
    )  # fmt: skip


def _offset(t, elements: int):
    """A copy of t whose data starts `elements` past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 16, dtype=t.dtype)
    out = flat[elements : elements + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def test_fast_key_tells_which_tensor_is_misaligned():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    aligned = _key(q, k, v)
    q_off = _key(_offset(q, 1), k, v)
    k_off = _key(q, _offset(k, 1), v)
    assert len({aligned, q_off, k_off}) == 3
    assert length_key(aligned)[0] != length_key(q_off)[0]  # Problem.aligned_16 differs
    assert length_key(q_off)[0] == length_key(k_off)[0]  # the Problem is the same


def test_fast_key_none_for_strided_nested_tensors():
    nested = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)])
    assert _key(nested, nested, nested) is None


def test_fast_key_follows_the_scoped_config_and_the_registry():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    base = _key(q, k, v)
    with ad.use_config({"dispatch": {"policy": "priority"}}):
        scoped = _key(q, k, v)
    assert scoped != base and _key(q, k, v) == base
    with ad.use_backends("math"):
        assert _key(q, k, v) != base
    with torch.no_grad():
        assert _key(q.requires_grad_(), k, v) == base
    assert _key(q, k, v) != base  # q now requires grad


def test_repeated_tiny_call_hits_the_prepared_op(monkeypatch):
    """The tiny call of issue 35 takes the prepared runner, which calls the CPU op with only q, k, v."""
    q, k, v = (torch.randn(1, 1, 16, 64) for _ in range(3))
    ad.sdpa(q, k, v, backend="torch_cpu")
    calls = []
    real = torch._scaled_dot_product_flash_attention_for_cpu
    monkeypatch.setattr(
        torch,
        "_scaled_dot_product_flash_attention_for_cpu",
        lambda *a, **kw: calls.append((len(a), kw)) or real(*a, **kw),
    )
    dispatch.fast_calls.clear()
    ad.sdpa(q, k, v, backend="torch_cpu")  # prepares again with the recording op
    out = ad.sdpa(q, k, v, backend="torch_cpu")
    assert calls[-1] == (3, {})
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=0, rtol=0)


def test_overhead_benchmark_times_ours_and_the_reference_in_every_round():
    """benchmarks/overhead.py's tiny-call row: both functions timed in every round, order
    alternating, us per call (the interleaved figures issue 35's target is about)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"
    spec = importlib.util.spec_from_file_location("overhead_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    order = []
    ref_us, fn_us = mod.paired_times(
        lambda: order.append("ref"), lambda: order.append("fn"), n=2, repeat=3, sync=lambda: None
    )
    assert len(ref_us) == len(fn_us) == 3 and min(ref_us + fn_us) > 0
    assert order[20:] == ["ref"] * 2 + ["fn"] * 2 + ["fn"] * 2 + ["ref"] * 2 + ["ref"] * 2 + ["fn"] * 2


@pytest.mark.parametrize("causal", [None, ad.CausalKind.TOP_LEFT, ad.CausalKind.BOTTOM_RIGHT])
@pytest.mark.parametrize("sq,sk", [(1, 9), (4, 4), (3, 9), (9, 3)])
@pytest.mark.parametrize("hkv", [4, 2])
def test_direct_dense_equals_run_or_declines(one_thread, causal, sq, sk, hkv):
    """TorchCpuBackend._direct_dense (run_kvcache's one-length path) is run()'s result where it
    takes the call, and declines (None) the bottom-right forms that need a mask or a tail."""
    backend = TorchCpuBackend()
    q, k, v = torch.randn(2, 4, sq, 16), torch.randn(2, hkv, sk, 16), torch.randn(2, hkv, sk, 16)
    got = backend._direct_dense(q, k, v, causal, 0.25)
    want = backend.run(q, k, v, causal=causal, scale=0.25)
    declines = causal is ad.CausalKind.BOTTOM_RIGHT and sq not in (1, sk)
    assert (got is None) == declines
    if got is not None:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        ref = _oracle(q, k, v, causal=None if causal is None else str(causal), scale=0.25)
        assert_matches(got, ref, want)
