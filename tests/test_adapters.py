"""Backend adapters: flash_attn (2/3/4), PyTorch's SDPA kernels, xformers.

On the CPU the third-party libraries are replaced by fakes (tests/fakes) that compute
with their own library's semantics through the float64 oracle and record what they get;
the adapters' `run` is called directly, and rejection reasons are checked on Problems
built for a CUDA device. `torch_cpu` runs for real. GPU tests (marked `gpu`) run cuDNN,
PyTorch flash / efficient and flash-attn 4 for real against the oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import random
import sys
import textwrap
import types

import pytest
import torch

import attention_dispatch
from attention_dispatch.backends import base
from attention_dispatch.backends.fa4_relaunch import ForwardRelauncher, VarlenRelauncher, refusal
from attention_dispatch.backends.flash_attn import INSTALL_HINT as FA_HINT, FlashAttnBackend
from attention_dispatch.backends.torch_backends import (
    CudnnBackend,
    TorchCpuBackend,
    TorchEfficientBackend,
    TorchFlashBackend,
)
from attention_dispatch.backends.torch_sdpa import TorchSdpaBackend
from attention_dispatch.backends.window_clamp import right_bound_cut
from attention_dispatch.backends.xformers import INSTALL_HINT as XF_HINT, XformersBackend, parse_no_operator
from attention_dispatch.problem import Problem
from attention_dispatch.semantics import CausalKind
from tests import fakes
from tests.naive import naive_attention
from tests.oracle import assert_matches

TL, BR = CausalKind.TOP_LEFT, CausalKind.BOTTOM_RIGHT


def problem(**kw) -> Problem:
    base_fields = dict(
        batch=2,
        heads_q=4,
        heads_kv=4,
        seqlen_q=64,
        seqlen_k=64,
        head_dim_qk=64,
        head_dim_v=64,
        dtype=torch.bfloat16,
        device_type="cuda",
        compute_capability=(9, 0),
        layout="dense",
        mask_kind="none",
        mask_shape=None,
        mask_requires_grad=False,
        causal=None,
        window=None,
        dropout=False,
        requires_grad=False,
        deterministic=False,
        deterministic_warn_only=False,
        last_dim_contiguous=True,
        aligned_16=True,
    )
    base_fields.update(kw)
    return Problem(**base_fields)


def _str(c):
    return None if c is None else str(c)


def inputs(b, hq, hkv, sq, sk, d, dv=None, dtype=torch.float64, device="cpu", grad=True):
    dv = dv or d
    mk = lambda *s: torch.randn(*s, dtype=dtype, device=device).requires_grad_(grad)  # noqa: E731
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, dv)


def packed(lq, lk, hq, hkv, d, dtype=torch.float64, device="cpu"):
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32).to(device)
    cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32).to(device)
    mk = lambda n, h: torch.randn(n, h, d, dtype=dtype, device=device, requires_grad=True)  # noqa: E731
    return mk(sum(lq), hq), mk(sum(lk), hkv), mk(sum(lk), hkv), cu_q, cu_k


def grads(out, tensors):
    g = torch.randn_like(out)
    return torch.autograd.grad(out, tensors, g, allow_unused=True), g


# ------------------------------------------------------------------ flash-attn ------
@pytest.fixture
def fa(monkeypatch):
    """fa(2|3|4, ...) installs those fake generations and returns (backend, calls)."""

    def make(*versions):
        calls: list = []
        modules: dict = {}
        for v in versions:
            for name, mod in fakes.make_flash_attn(v, calls).items():
                if name == "flash_attn" and "flash_attn" in modules:  # fa2 + fa4: one package with both
                    mod = modules["flash_attn"]
                modules[name] = mod
            if v == 4 and 2 in versions:
                modules["flash_attn"].cute = modules["flash_attn.cute"]
        for missing in ("flash_attn", "flash_attn_interface", "flash_attn.cute"):
            if missing not in modules:
                monkeypatch.delitem(sys.modules, missing, raising=False)
        fakes.install(monkeypatch, modules)
        return FlashAttnBackend(), calls

    return make


def test_flash_attn_missing_and_broken(monkeypatch, tmp_path):
    for name in ("flash_attn", "flash_attn_interface", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert FlashAttnBackend().unavailable_reason() == FA_HINT
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(
        "raise ImportError('/x/flash_attn_2_cuda.so: undefined symbol: _ZN3c105ErrorC2E\\nmore')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = FlashAttnBackend().unavailable_reason()
    assert reason.startswith("import failed: ")
    assert "fa2: ImportError: /x/flash_attn_2_cuda.so: undefined symbol: _ZN3c105ErrorC2E" in reason
    assert "more" not in reason


@pytest.mark.parametrize(
    "versions,expect",
    [((2,), ["fa2"]), ((3,), ["fa3"]), ((4,), ["fa4"]), ((2, 4), ["fa4", "fa2"]), ((2, 3, 4), ["fa3", "fa4", "fa2"])],
)
def test_flash_attn_detects_generations(fa, versions, expect):
    backend, _ = fa(*versions)
    assert [i.key for i in backend.implementations()] == expect
    assert backend.unavailable_reason() in ("", "no CUDA device (torch.cuda.is_available() is False)")
    assert "flash-attn" in backend.version()


DENSE_CASES = [  # (sq, sk, causal, window, hq, hkv)
    (8, 8, None, None, 4, 4),
    (5, 9, BR, None, 4, 2),
    (9, 5, BR, None, 4, 4),
    (7, 7, TL, None, 6, 2),
    (6, 10, None, (2, 1), 4, 4),
    (10, 6, BR, (3, -1), 4, 1),
    (8, 8, TL, (2, -1), 4, 4),
    (5, 12, None, (-1, 0), 2, 2),
    (
        12,
        5,
        None,
        (1, 5),
        2,
        2,
    ),  # right = Sk: flash-attn 2/3 keep it (past Sk: test_flash_attn_2_3_window_right_past_sk)
]


@pytest.mark.parametrize("version", [2, 4])
@pytest.mark.parametrize("sq,sk,causal,window,hq,hkv", DENSE_CASES[:4] + DENSE_CASES[-2:])
def test_flash_attn_prepared_runner_matches_run(fa, version, sq, sk, causal, window, hq, hkv):
    """prepare() chooses the implementation and its arguments once; the runner then calls it
    with the new tensors exactly as run() would (same arguments, same result, gradients)."""
    backend, calls = fa(version)
    q, k, v = inputs(2, hq, hkv, sq, sk, 64)
    options = dict(
        attn_mask=None,
        dropout_p=0.0,
        causal=causal,
        window=window,
        scale=0.3,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        enable_gqa=hkv != hq,
        deterministic=True,
    )
    runner = backend.prepare(q, k, v, options)
    q2, k2, v2 = (torch.randn_like(t).requires_grad_() for t in (q, k, v))
    got = runner(q2, k2, v2)

    def recorded():  # the arguments flash-attn received, tensors left out
        return {n: x for n, x in calls[-1].items() if not isinstance(x, torch.Tensor)}

    via_runner = recorded()
    assert calls[-1]["q_ptr"] == q2.data_ptr()
    want = backend.run(q2, k2, v2, **options)
    assert via_runner == recorded()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    (gq, gk, gv), g = grads(got, (q2, k2, v2))
    assert torch.equal(gq, torch.autograd.grad(want, q2, g)[0])


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("lse", [False, True], ids=["out", "lse"])
def test_flash_attn_refuses_a_gradient_of_its_gradient(fa, version, varlen, lse):
    """flash-attn's Functions compute gradients with kernels and let create_graph=True pass: a
    gradient penalty would silently lose every term through q, k, v. The adapter refuses (the
    fakes' Functions are differentiable; a hook on the returned tensors must raise first), through
    run() and the prepared runner, from the output or the logsumexp; a plain backward still runs."""
    backend, _ = fa(version)
    if varlen:
        q, k, v, cu_q, cu_k = packed([3, 7, 1], [5, 4, 6], 4, 2, 64)
        options = _varlen_options(BR, None, cu_q, cu_k)
    else:
        q, k, v = inputs(2, 4, 2, 5, 6, 64)
        options = _varlen_options(BR, None, None, None) | dict(max_seqlen_q=None, max_seqlen_k=None)
    if lse:
        if not backend.capabilities.lse_grad:
            pytest.skip(f"flash-attn {version}'s logsumexp has no gradient")
        options["return_lse"] = True
    runner = backend.prepare(q, k, v, options)
    for run in (functools.partial(backend.run, **options), runner, runner):  # flash-attn 4: recorded, relaunched
        result = run(q, k, v)
        target = result[1] if lse else result
        with pytest.raises(RuntimeError, match="flash.attn.* attention: gradients of gradients"):
            torch.autograd.grad(target.sum(), q, create_graph=True)
    result = backend.run(q, k, v, **options)
    (gq,) = torch.autograd.grad((result[1] if lse else result).sum(), q)
    assert torch.isfinite(gq).all()


@pytest.mark.parametrize("version", [2, 4])
@pytest.mark.parametrize("grad", [False, True])
def test_flash_attn_prepared_varlen_runner_without_offsets_uses_the_prepared_ones(fa, version, grad):
    """Backend.prepare's contract: a varlen call passing no offsets runs with the prepared
    call's.  policy="fastest" times runners so; flash-attn 4's inference relauncher once
    required the offsets, and every varlen timing of flash-attn 4 failed on the H100."""
    backend, calls = fa(version)
    q, k, v, cu_q, cu_k = packed([3, 7, 1], [5, 4, 6], 4, 2, 64)
    options = _varlen_options(BR, None, cu_q, cu_k)
    with torch.set_grad_enabled(grad):
        runner = backend.prepare(q, k, v, options)
        want = backend.run(q, k, v, **options)
        for _ in range(2):  # flash-attn 4 inference: the recording call, then a relaunch
            got = runner(q, k, v)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert calls[-1]["cu_seqlens_q"] is cu_q and calls[-1]["cu_seqlens_k"] is cu_k
    ref = naive_attention(q, k, v, causal="bottom_right", scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    if grad:
        (gq, gk, gv), g = grads(got, (q, k, v))
        torch.testing.assert_close(gq, torch.autograd.grad(ref, q, g)[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("version", [2, 4])
@pytest.mark.parametrize("causal,same", [(None, False), (BR, False), (TL, True)])
def test_flash_attn_prepared_varlen_runner_takes_each_calls_offsets(fa, version, causal, same):
    """Varlen: the runner passes the call's own offsets (max_seqlen bound) and otherwise
    exactly run()'s arguments; result equal to run() and to the oracle."""
    backend, calls = fa(version)
    lq, lk = ([3, 7, 1], [3, 7, 1]) if same else ([3, 7, 1], [5, 4, 6])
    q, k, v, cu_q, cu_k = packed(lq, lk, 4, 2, 64)
    cu_k = cu_q if same else cu_k
    options = dict(
        attn_mask=None,
        dropout_p=0.0,
        causal=causal,
        window=None,
        scale=0.3,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=8,
        max_seqlen_k=8,
        enable_gqa=True,
        deterministic=True,
    )
    runner = backend.prepare(q, k, v, options)
    lq2, lk2 = ([8, 1, 2], [8, 1, 2]) if same else ([8, 1, 2], [2, 8, 5])
    q2, k2, v2, cu_q2, cu_k2 = packed(lq2, lk2, 4, 2, 64)
    cu_k2 = cu_q2 if same else cu_k2
    got = runner(q2, k2, v2, cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k2)
    via_runner = {n: x for n, x in calls[-1].items() if not isinstance(x, torch.Tensor)}
    assert calls[-1]["cu_seqlens_q"] is cu_q2 and calls[-1]["cu_seqlens_k"] is cu_k2
    want = backend.run(q2, k2, v2, **dict(options, cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k2))
    assert via_runner == {n: x for n, x in calls[-1].items() if not isinstance(x, torch.Tensor)}
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = naive_attention(q2, k2, v2, causal=_str(causal), scale=0.3, cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k2)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def _fa4_options(causal, window, hq, hkv):
    return dict(
        attn_mask=None,
        dropout_p=0.0,
        causal=causal,
        window=window,
        scale=0.3,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        enable_gqa=hkv != hq,
        deterministic=False,
    )


@pytest.mark.parametrize("sq,sk,causal,window,hq,hkv", DENSE_CASES)
def test_fa4_inference_runner_relaunches_the_recorded_compiled_call(fa, sq, sk, causal, window, hq, hkv):
    """Without autograd, the flash-attn 4 runner's first call goes through flash_attn_func and
    records the compiled call it makes; later calls repeat that call with their own tensors
    and a fresh output, without flash_attn_func: results equal to run() (and so to the oracle,
    test_flash_attn_dense_mapping), the module's compile cache put back."""
    backend, calls = fa(4)
    iface = sys.modules["flash_attn.cute.interface"]
    cache = iface._flash_attn_fwd.compile_cache
    options = _fa4_options(causal, window, hq, hkv)
    with torch.no_grad():
        q, k, v = inputs(2, hq, hkv, sq, sk, 64)  # leaves that require grad, used without autograd
        runner = backend.prepare(q, k, v, options)
        assert isinstance(runner, ForwardRelauncher)
        first = runner(q, k, v)
        assert runner.launch is not None, runner.refused
        assert iface._flash_attn_fwd.compile_cache is cache
        torch.testing.assert_close(first, backend.run(q, k, v, **options), rtol=0, atol=0)
        outs = []
        for _ in range(2):
            q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
            publics, launches = len(calls), len(iface.launches)
            got = runner(q2, k2, v2)
            assert len(calls) == publics and len(iface.launches) == launches + 1  # relaunched, not the public call
            assert iface.launches[-1]["q_ptr"] == q2.data_ptr() and iface.launches[-1]["out_ptr"] == got.data_ptr()
            assert got.shape == q2.shape and not got.requires_grad
            torch.testing.assert_close(got, backend.run(q2, k2, v2, **options), rtol=0, atol=0)
            outs.append(got)
        assert outs[0].data_ptr() != outs[1].data_ptr()  # a fresh output per call


@pytest.mark.parametrize("sq,sk,causal,window,hq,hkv", DENSE_CASES[:4] + DENSE_CASES[-2:])
def test_fa4_training_runner_relaunches_the_forward_and_runs_flash_attn_4s_backward(
    fa, sq, sk, causal, window, hq, hkv
):
    """With autograd the first call goes through flash_attn_func (recording); later calls
    relaunch the compiled forward with a fresh output and LSE, and their backward is flash-attn
    4's _flash_attn_bwd on that output and LSE: outputs and gradients equal to run()'s."""
    backend, calls = fa(4)
    iface = sys.modules["flash_attn.cute.interface"]
    options = _fa4_options(causal, window, hq, hkv)
    q, k, v = inputs(2, hq, hkv, sq, sk, 64)
    runner = backend.prepare(q, k, v, options)
    assert isinstance(runner, ForwardRelauncher) and runner.training
    first = runner(q, k, v)
    assert runner.launch is not None, runner.refused
    (gq, _, _), g = grads(first, (q, k, v))
    for _ in range(2):
        q2, k2, v2 = (torch.randn_like(t).requires_grad_() for t in (q, k, v))
        publics, launches, backwards = len(calls), len(iface.launches), len(iface.backwards)
        got = runner(q2, k2, v2)
        assert len(calls) == publics and len(iface.launches) == launches + 1 and got.requires_grad
        want = backend.run(q2, k2, v2, **options)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        g = torch.randn_like(got)
        ours = torch.autograd.grad(got, (q2, k2, v2), g)
        assert len(iface.backwards) == backwards + 1
        bwd = iface.backwards[-1]
        assert bwd["q_ptr"] == q2.data_ptr() and bwd["out_ptr"] == got.data_ptr()
        assert bwd["softcap"] == 0.0 and bwd["deterministic"] is False
        for a, b_ in zip(ours, torch.autograd.grad(want, (q2, k2, v2), g)):
            torch.testing.assert_close(a, b_, rtol=0, atol=0)
        ref = naive_attention(q2, k2, v2, causal=_str(causal), window=window, scale=0.3)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "trouble,reason",
    [
        ("extra_tensor", "beyond query, key, value, output"),
        ("copy_query", "no compiled call took the caller's query"),
        ("no_interface", "not found"),
    ],
)
def test_fa4_inference_runner_keeps_the_public_call_when_the_record_is_not_understood(fa, monkeypatch, trouble, reason):
    backend, calls = fa(4)
    iface = sys.modules["flash_attn.cute.interface"]
    if trouble == "no_interface":
        monkeypatch.delitem(sys.modules, "flash_attn.cute.interface")
    else:
        setattr(iface, trouble, True)
    options = _fa4_options(BR, None, 4, 2)
    with torch.no_grad():
        q, k, v = inputs(2, 4, 2, 6, 9, 64, grad=False)
        runner = backend.prepare(q, k, v, options)
        runner(q, k, v)
        assert runner.launch is None and reason in runner.refused
        q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
        publics = len(calls)
        got = runner(q2, k2, v2)
        assert len(calls) == publics + 1 and calls[-1]["q_ptr"] == q2.data_ptr()
        torch.testing.assert_close(got, backend.run(q2, k2, v2, **options), rtol=0, atol=0)


def test_fa4_training_runner_keeps_the_public_call_without_a_returned_lse(fa):
    """A training recording needs the log-sum-exp the public call returned (its backward reads
    it); a flash_attn_func that returns only the output keeps the public path, gradients and all."""
    backend, calls = fa(4)
    public = sys.modules["flash_attn.cute"].flash_attn_func
    runner = ForwardRelauncher(
        lambda *a, **kw: public(*a, **kw)[0],
        dict(softmax_scale=0.3, causal=False, window_size=(None, None), deterministic=False),
        training=True,
    )
    q, k, v = inputs(2, 4, 2, 6, 9, 64)
    for _ in range(2):
        out = runner(q, k, v)
        assert runner.launch is None and runner.refused == "the public call returned no log-sum-exp"
    (gq, gk, gv), g = grads(out, (q, k, v))
    ref = naive_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(gq, torch.autograd.grad(ref, q, g)[0], rtol=0, atol=1e-10)
    assert len(calls) == 2


def test_fa4_recording_puts_the_compile_cache_back_when_the_call_fails(fa):
    fa(4)
    iface = sys.modules["flash_attn.cute.interface"]
    cache = iface._flash_attn_fwd.compile_cache

    def failing(*args, **kwargs):
        assert iface._flash_attn_fwd.compile_cache is not cache  # recording
        raise RuntimeError("boom")

    runner = ForwardRelauncher(failing, {})
    q, k, v = inputs(1, 2, 2, 4, 4, 64, grad=False)
    with pytest.raises(RuntimeError, match="boom"):
        runner(q, k, v)
    assert iface._flash_attn_fwd.compile_cache is cache and runner.launch is None


def _varlen_options(causal, window, cu_q, cu_k):
    return dict(
        attn_mask=None,
        dropout_p=0.0,
        causal=causal,
        window=window,
        scale=0.3,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=8,
        max_seqlen_k=8,
        enable_gqa=True,
        deterministic=False,
    )


def _aligned_copy(cu):
    """The same offsets in a fresh (allocator-aligned) tensor."""
    return cu.clone()


def _misaligned_copy(cu):
    """The same offsets at an address 4 bytes past a 16-byte boundary."""
    room = torch.zeros(cu.numel() + 4, dtype=torch.int32)
    view = room[1 : 1 + cu.numel()]
    view.copy_(cu)
    assert view.data_ptr() % 16 == 4
    return view


@pytest.mark.parametrize(
    "causal,window,same", [(None, None, False), (BR, None, False), (TL, None, True), (BR, (2, 0), False)]
)
def test_fa4_varlen_inference_runner_relaunches_with_each_calls_offsets(fa, causal, window, same):
    """Varlen inference: the flash-attn 4 runner records the compiled call of its first call
    (which takes the call's offsets) and repeats it with each later call's tensors and offsets,
    without flash_attn_varlen_func: results equal to run() with those offsets and to the oracle."""
    backend, calls = fa(4)
    iface = sys.modules["flash_attn.cute.interface"]
    lq, lk = ([3, 7, 1], [3, 7, 1]) if same else ([3, 7, 1], [5, 4, 6])
    with torch.no_grad():
        q, k, v, cu_q, cu_k = packed(lq, lk, 4, 2, 64)
        cu_k = cu_q if same else cu_k
        options = _varlen_options(causal, window, cu_q, cu_k)
        runner = backend.prepare(q, k, v, options)
        assert isinstance(runner, VarlenRelauncher)
        first = runner(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        assert runner.launch is not None, runner.refused
        torch.testing.assert_close(first, backend.run(q, k, v, **options), rtol=0, atol=0)
        for lq2, lk2 in (([8, 1, 2], [2, 8, 5]), ([1, 1, 9], [6, 6, 3])):
            lk2 = lq2 if same else lk2
            q2, k2, v2, cu_q2, cu_k2 = packed(lq2, lk2, 4, 2, 64)
            cu_k2 = cu_q2 if same else cu_k2
            publics, launches = len(calls), len(iface.launches)
            got = runner(q2, k2, v2, cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k2)
            assert len(calls) == publics and len(iface.launches) == launches + 1  # relaunched
            launch = iface.launches[-1]
            assert launch["q_ptr"] == q2.data_ptr() and launch["cu_q"] is cu_q2 and launch["cu_k"] is cu_k2
            torch.testing.assert_close(
                got, backend.run(q2, k2, v2, **dict(options, cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k2)), rtol=0, atol=0
            )
            ref = naive_attention(
                q2, k2, v2, causal=_str(causal), window=window, scale=0.3, cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k2
            )
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", ["shared_then_two", "misaligned", "copied_offsets", "two_views_of_one"])
def test_fa4_varlen_runner_takes_the_public_call_where_the_record_does_not_fit(fa, case):
    """Calls a recorded varlen launch cannot serve go through flash_attn_varlen_func: offsets
    recorded as one tensor for queries and keys then given as two, offsets at an address that
    is not 16-byte aligned (flash-attn 4 copies those), a library that copied the offsets
    while recording, two tensor objects over the same offsets (which one the compiled call
    takes is unknown).  Every result equal to the oracle."""
    backend, calls = fa(4)
    iface = sys.modules["flash_attn.cute.interface"]
    iface.copy_offsets = case == "copied_offsets"
    lq = [3, 7, 1]
    with torch.no_grad():
        q, k, v, cu_q, _ = packed(lq, lq, 4, 2, 64)
        cu_k = cu_q.view(-1) if case == "two_views_of_one" else cu_q
        options = _varlen_options(None, None, cu_q, cu_k)
        runner = backend.prepare(q, k, v, options)
        runner(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        if case in ("copied_offsets", "two_views_of_one"):
            assert runner.launch is None and ("offsets" in runner.refused), runner.refused
        else:
            assert runner.launch is not None, runner.refused
        q2, k2, v2, cu_q2, _ = packed([8, 1, 2], [8, 1, 2], 4, 2, 64)
        if case == "shared_then_two":
            cu_q2, cu_k2 = cu_q2, _aligned_copy(cu_q2)
        elif case == "misaligned":
            cu_q2 = cu_k2 = _misaligned_copy(cu_q2)
        else:
            cu_k2 = cu_q2
        publics = len(calls)
        got = runner(q2, k2, v2, cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k2)
        assert len(calls) == publics + 1 and calls[-1]["cu_seqlens_q"] is cu_q2  # the public function
        ref = naive_attention(q2, k2, v2, scale=0.3, cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k2)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_fa4_varlen_training_keeps_the_public_varlen_function(fa):
    """With autograd the varlen signature keeps flash_attn_varlen_func (its backward is not
    relaunched)."""
    backend, _ = fa(4)
    q, k, v, cu_q, cu_k = packed([3, 7, 1], [5, 4, 6], 4, 2, 64)
    runner = backend.prepare(q, k, v, _varlen_options(None, None, cu_q, cu_k))
    assert not isinstance(runner, VarlenRelauncher)


def test_fa4_recorder_passes_every_call_through_and_records_only_ours():
    """While a recording runs, the module's cache is the recorder for every thread: lookups,
    stores and compiled calls reach the real cache; only calls on our query are recorded."""
    from attention_dispatch.backends.fa4_relaunch import _Recorder

    ours, theirs = torch.randn(2, 3), torch.randn(2, 3)
    made = []
    cache = {"k": lambda *args: made.append(args) or "ran"}
    recorder = _Recorder(cache, ours.data_ptr())
    assert "k" in recorder and "other" not in recorder
    recorder["new"] = cache["k"]
    assert cache["new"] is cache["k"]
    assert recorder["k"](theirs, 1) == "ran" and recorder.calls == []  # another caller's call
    assert recorder["k"](ours, 2) == "ran" and [a for _, a in recorder.calls] == [(ours, 2)]
    assert [a[1] for a in made] == [1, 2]
    assert recorder.keys() == cache.keys()  # the rest of the cache's API


def test_fa4_refusal_of_two_compiled_calls_and_of_a_foreign_output():
    q, k, v, out = (torch.randn(1, 4, 2, 8) for _ in range(4))
    compiled = object()
    one = (compiled, (q, k, v, out, None, 0.5))
    assert refusal([one], q, k, v, out) is None
    assert "2 compiled calls" in refusal([one, one], q, k, v, out)
    assert "not the output" in refusal([(compiled, (q, k, v, torch.empty_like(out), None))], q, k, v, out)
    assert "beyond" in refusal([(compiled, (q, k, v, out, [None, (torch.ones(1),)]))], q, k, v, out)
    lse = torch.randn(1, 2, 4)
    assert refusal([(compiled, (q, k, v, out, lse, 0.5, None))], q, k, v, out, lse) is None
    assert "beyond" in refusal([(compiled, (q, k, v, out, lse, 0.5, None))], q, k, v, out)  # inference: no LSE
    assert "log-sum-exp" in refusal([(compiled, (q, k, v, out, lse.clone(), 0.5))], q, k, v, out, lse)
    assert "beyond" in refusal([(compiled, (q, k, v, out, lse, torch.ones(1)))], q, k, v, out, lse)
    assert "beyond" in refusal([(compiled, (q, k, v, out, None, object()))], q, k, v, out)  # not plain data
    assert refusal([(compiled, (q, k, v, out, None, {"a": (1, "x", None)}))], q, k, v, out) is None
    cu_q, cu_k = torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 1, 4], dtype=torch.int32)
    varlen = (compiled, (q, k, v, out, None, 0.5, cu_q, cu_k, None))
    assert refusal([varlen], q, k, v, out, None, (cu_q, cu_k)) is None
    assert "beyond" in refusal([varlen], q, k, v, out)  # offsets not declared
    assert "offsets" in refusal(
        [(compiled, (q, k, v, out, None, 0.5, cu_q.clone(), cu_k))], q, k, v, out, None, (cu_q, cu_k)
    )  # a copy is another tensor
    assert "does not take the caller's offsets" in refusal(
        [(compiled, (q, k, v, out, None, 0.5))], q, k, v, out, None, (cu_q, cu_k)
    )


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("sq,sk,causal,window,hq,hkv", DENSE_CASES)
def test_flash_attn_dense_mapping(fa, version, sq, sk, causal, window, hq, hkv):
    backend, calls = fa(version)
    q, k, v = inputs(2, hq, hkv, sq, sk, 64)
    scale = 0.3
    out = backend.run(q, k, v, causal=causal, window=window, scale=scale, deterministic=True, enable_gqa=hkv != hq)
    ref = naive_attention(q, k, v, causal=_str(causal), window=window, scale=scale)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    (gq, gk, gv), g = grads(out, (q, k, v))
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), g)
    for a, b_ in ((gq, rq), (gk, rk), (gv, rv)):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-10)
    call = calls[-1]
    assert call["q_shape"] == (2, sq, hq, 64) and call["q_ptr"] == q.data_ptr()  # BSHD view, no copy
    assert call["softmax_scale"] == scale and call["deterministic"] is True
    assert call["causal"] is (causal is not None)
    unbounded = None if version == 4 else -1
    if window is None:
        assert call["window_size"] == (unbounded, unbounded)
    else:
        left, right = window
        right = 0 if causal is not None else right
        assert call["window_size"] == tuple(unbounded if w < 0 else w for w in (left, right))
    assert ("dropout_p" in call and call["dropout_p"] == 0.0) or version != 2


def _fa2_band(sq, sk, left, right):
    """Each row's allowed keys as flash-attn 2's set_params_fprop leaves the window (bottom-right)."""
    left, right = (-1 if w >= sk else w for w in (left, right))
    if left < 0 and right >= 0:
        left = sk
    if left >= 0 and right < 0:
        right = sk
    return _band_rows(sq, sk, left, right)


def _band_rows(sq, sk, left, right):
    off = sk - sq
    return [
        tuple(j for j in range(sk) if (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right))
        for i in range(sq)
    ]


def test_right_bound_cut_is_exactly_where_flash_attn_2_computes_another_band():
    """window_clamp.right_bound_cut against flash_api.cpp's rules applied row by row, every small case."""
    for sq, sk in itertools.product(range(1, 9), range(1, 9)):
        for left, right in itertools.product(range(-1, 11), range(-1, 11)):
            if (left, right) == (-1, -1):
                continue
            differs = _fa2_band(sq, sk, left, right) != _band_rows(sq, sk, left, right)
            assert bool(right_bound_cut(sq, sk, None, (left, right))) == differs, (sq, sk, left, right)


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("window", [(1, -1), (-1, 6), (1, 5), (2, 0)])
def test_flash_attn_2_3_window_right_past_sk(fa, version, window):
    """flash-attn 2/3 bound a right side past Sk at Sk (or drop the window): with Sq > Sk + 1 that changes
    the first rows (the fake follows flash_api.cpp), so those generations refuse; flash-attn 4 runs it."""
    backend, _ = fa(version)
    q, k, v = inputs(2, 2, 2, 12, 5, 64)
    options = dict(window=window, scale=0.3, deterministic=True)
    cut = version in (2, 3) and window in ((1, -1), (-1, 6))
    reasons = backend.reasons(problem(seqlen_q=12, seqlen_k=5, window=window, head_dim_qk=64, head_dim_v=64))
    assert any("flash-attn 2/3 takes its right side" in r for r in reasons) == cut, reasons
    if cut:
        with pytest.raises(RuntimeError, match="takes its right side as"):
            backend.run(q, k, v, **options)
        return
    ref = naive_attention(q, k, v, window=window, scale=0.3)
    torch.testing.assert_close(backend.run(q, k, v, **options), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("causal,window", [(None, None), (BR, None), (BR, (2, -1)), (None, (1, 2))])
def test_flash_attn_varlen_mapping(fa, version, causal, window):
    backend, calls = fa(version)
    q, k, v, cu_q, cu_k = packed([3, 7, 1], [5, 4, 6], 4, 2, 64)
    out = backend.run(
        q,
        k,
        v,
        causal=causal,
        window=window,
        scale=0.5,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=7,
        max_seqlen_k=6,
        enable_gqa=True,
    )
    ref = naive_attention(q, k, v, causal=_str(causal), window=window, scale=0.5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    call = calls[-1]
    assert call["fn"] == "varlen" and call["cu_seqlens_q"] is cu_q and call["max_seqlen_k"] == 6
    assert call["q_ptr"] == q.data_ptr()


@pytest.mark.parametrize("version", [2, 4])
@pytest.mark.parametrize("window", [None, (2, -1)])
def test_flash_attn_varlen_top_left_with_one_offsets_tensor(fa, version, window):
    """Packed self-attention (cu_seqlens_q and cu_seqlens_k one tensor): every sequence has
    Sq == Sk, so PyTorch's top-left causal is flash-attn's bottom-right one: accepted and
    equal to the top-left oracle.  Equal offsets in two tensors are not looked at (that would
    read them back from the GPU): still rejected, with the reason."""
    backend, calls = fa(version)
    q, k, v, cu, _ = packed([3, 7, 1], [3, 7, 1], 4, 2, 64)
    out = backend.run(
        q,
        k,
        v,
        causal=TL,
        window=window,
        scale=0.5,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=7,
        max_seqlen_k=7,
        enable_gqa=True,
    )
    ref = naive_attention(q, k, v, causal="top_left", window=window, scale=0.5, cu_seqlens_q=cu, cu_seqlens_k=cu)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert calls[-1]["fn"] == "varlen" and calls[-1]["causal"] is True
    with pytest.raises(RuntimeError, match="causal=top_left with varlen"):
        backend.run(
            q,
            k,
            v,
            causal=TL,
            window=window,
            scale=0.5,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu.clone(),
            max_seqlen_q=7,
            max_seqlen_k=7,
            enable_gqa=True,
        )
    p = backend.problem_of(q, k, v, causal=TL, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
    assert p.same_offsets and p.sequences_match
    assert not backend.problem_of(
        q, k, v, causal=TL, cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=7, max_seqlen_k=7
    ).sequences_match


def test_flash_attn_dropout_goes_to_fa2_only(fa):
    backend, calls = fa(2, 4)
    p_plain = problem(compute_capability=(9, 0))
    p_drop = dataclasses.replace(p_plain, dropout=True)
    assert backend.choose(p_plain)[0].key == "fa4"
    assert backend.choose(p_drop)[0].key == "fa2"
    q, k, v = inputs(1, 2, 2, 6, 6, 8)
    torch.manual_seed(0)
    a = backend.run(q, k, v, dropout_p=0.25, scale=0.3)
    torch.manual_seed(0)
    b = backend.run(q, k, v, dropout_p=0.25, scale=0.3)
    assert calls[-1]["dropout_p"] == 0.25 and calls[-1]["fn"] == "dense"
    torch.testing.assert_close(a, b)


def test_flash_attn_rejections(fa):
    backend, _ = fa(2)
    r = backend.reasons
    assert "float attn_mask (bias) not supported" in r(problem(mask_kind="float", mask_shape=(1, 1, 64, 64)))
    assert "bool attn_mask not supported" in r(problem(mask_kind="bool", mask_shape=(1, 1, 64, 64)))
    assert "compute capability sm75 < sm80" in r(problem(compute_capability=(7, 5)))
    assert "dtype=float32 not in {bfloat16, float16}" in r(problem(dtype=torch.float32))
    assert "head_dim=320 > 256" in r(problem(head_dim_qk=320, head_dim_v=320))
    assert any("head_dim_qk=64 != head_dim_v=32" in x for x in r(problem(head_dim_v=32)))
    assert "causal=top_left with Sq=3 != Sk=5 (the backend aligns causal bottom_right)" in r(
        problem(seqlen_q=3, seqlen_k=5, causal=TL)
    )
    assert any("varlen" in x for x in r(problem(layout="varlen", causal=TL)))
    assert not any("causal" in x for x in r(problem(layout="varlen", causal=TL, same_offsets=True)))
    assert "device=cpu not in {cuda}" in r(problem(device_type="cpu", compute_capability=None))
    assert r(problem(causal=TL)) == []  # square: top-left == bottom-right
    assert r(problem(causal=BR, window=(4, 0), dropout=True, heads_kv=1, requires_grad=True)) == []
    assert any(
        "dropout" in x and "sm80/sm90" in x
        for x in r(
            problem(compute_capability=(8, 6), head_dim_qk=256, head_dim_v=256, dropout=True, requires_grad=True)
        )
    )


def test_flash_attn_generation_specific_rejections(fa):
    backend, _ = fa(4)
    r = backend.reasons
    assert "dropout_p > 0 not supported" in r(problem(dropout=True))
    assert "compute capability sm80 < sm90" in r(problem(compute_capability=(8, 0)))
    assert any("flash-attn 4: head_dim=80 not in {64, 96, 128}" == x for x in r(problem(head_dim_qk=80, head_dim_v=80)))
    assert any(
        "backward with a window not supported on sm90" in x for x in r(problem(window=(8, 0), requires_grad=True))
    )
    assert r(problem(window=(8, 0), requires_grad=True, compute_capability=(10, 0))) == []
    assert any("varlen backward" in x for x in r(problem(layout="varlen", requires_grad=True)))
    assert any("deterministic" in x for x in r(problem(deterministic=True, requires_grad=True)))
    backend3, _ = fa(3)
    assert "compute capability sm100 > sm90" in backend3.reasons(problem(compute_capability=(10, 0)))
    backend24, _ = fa(2, 4)
    # on sm90 with head_dim 80: flash-attn 4 refuses it, flash-attn 2 takes it
    assert backend24.reasons(problem(head_dim_qk=80, head_dim_v=80)) == []
    assert backend24.choose(problem(head_dim_qk=80, head_dim_v=80))[0].key == "fa2"


def test_flash_attn_empty_inputs(fa):
    backend, calls = fa(2)
    q, k, v = inputs(2, 2, 2, 4, 0, 8)
    out = backend.run(q, k, v, scale=0.1)
    assert out.shape == (2, 2, 4, 8) and not out.any() and not calls
    (gq, _, _), _ = grads(out, (q, k, v))
    assert not gq.any()


# ------------------------------------------------------------------ xformers -------
@pytest.fixture
def xf(monkeypatch):
    def make(**kw):
        calls: list = []
        fakes.install(monkeypatch, fakes.make_xformers(calls, **kw))
        return XformersBackend(), calls

    return make


def _broken_package(monkeypatch, tmp_path, name, body):
    for mod in list(sys.modules):
        if mod.split(".")[0] == name:
            monkeypatch.delitem(sys.modules, mod)
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_xformers_refuses_a_gradient_of_its_gradient(xf, varlen):
    """xformers' Function computes gradients with kernels and lets create_graph=True pass: the
    adapter refuses (the fake's Function is differentiable: the hook must raise first)."""
    backend, _ = xf()
    if varlen:
        q, k, v, cu_q, cu_k = packed([3, 7, 1], [5, 4, 6], 4, 2, 64)
        options = _varlen_options(BR, None, cu_q, cu_k)
    else:
        q, k, v = inputs(2, 4, 2, 5, 6, 64)
        options = dict(causal=BR, scale=0.3, enable_gqa=True)
    out = backend.run(q, k, v, **options)
    with pytest.raises(RuntimeError, match="the xformers backend's attention: gradients of gradients"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    (gq,) = torch.autograd.grad(backend.run(q, k, v, **options).sum(), q)
    assert torch.isfinite(gq).all()


def test_xformers_missing(monkeypatch):
    for mod in list(sys.modules):
        if mod.split(".")[0] == "xformers":
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" in p or p.endswith(".zip")])
    b = XformersBackend()
    assert not b.is_available() and b.unavailable_reason() == XF_HINT


def test_xformers_abi_mismatch_is_unavailable(monkeypatch, tmp_path):
    _broken_package(
        monkeypatch,
        tmp_path,
        "xformers",
        """
        raise ImportError("/site-packages/xformers/_C.so: undefined symbol: _ZN2at4_ops10zeros_like4callE\\nsecond line")
    """,
    )
    b = XformersBackend()
    assert not b.is_available()
    assert b.unavailable_reason() == (
        "import failed: ImportError: /site-packages/xformers/_C.so: undefined symbol: _ZN2at4_ops10zeros_like4callE"
    )
    assert b.check(problem()) == []  # nothing to ask; availability already says why


def test_xformers_without_flash_attn_interface_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    _broken_package(monkeypatch, tmp_path, "xformers", "import flash_attn_interface\n")
    reason = XformersBackend().unavailable_reason()
    assert reason == "import failed: ModuleNotFoundError: No module named 'flash_attn_interface'"


XF_DENSE = [  # (sq, sk, causal, window, hq, hkv, mask)
    (8, 8, None, None, 4, 4, None),
    (6, 9, TL, None, 4, 2, None),
    (9, 9, BR, None, 2, 2, None),
    (5, 9, BR, None, 4, 4, None),
    (6, 10, None, (2, 1), 4, 4, None),
    (6, 10, BR, (2, -1), 4, 1, None),
    (8, 8, TL, (1, -1), 2, 2, None),
    (7, 9, None, None, 4, 2, "bool"),
    (7, 9, TL, None, 4, 4, "float"),
    (9, 7, BR, (2, -1), 4, 4, "float"),
    (7, 9, TL, (1, -1), 4, 2, "bool_empty_rows"),
]


@pytest.mark.parametrize("sq,sk,causal,window,hq,hkv,mask", XF_DENSE)
def test_xformers_dense_mapping(xf, sq, sk, causal, window, hq, hkv, mask):
    backend, calls = xf()
    q, k, v = inputs(2, hq, hkv, sq, sk, 8)
    m = None
    if mask == "float":
        m = torch.randn(2, 1, sq, sk, dtype=torch.float64).requires_grad_()
    elif mask and mask.startswith("bool"):
        m = torch.rand(1, hq, sq, sk) > 0.3
        if mask == "bool_empty_rows":
            m[:, :, 2] = False
    out = backend.run(q, k, v, attn_mask=m, causal=causal, window=window, scale=0.4, enable_gqa=hq != hkv)
    ref = naive_attention(q, k, v, mask=m, causal=_str(causal), window=window, scale=0.4)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    tensors = (q, k, v) + ((m,) if m is not None and m.requires_grad else ())
    got, g = grads(out, tensors)
    want = torch.autograd.grad(ref, tensors, g)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-10)
    call = calls[-1]
    assert call["q_ptr"] == q.data_ptr() and call["scale"] == 0.4
    bias = call["attn_bias"]
    if m is None:
        expected = {None: type(None), TL: fakes.LowerTriangularMask, BR: fakes.LowerTriangularFromBottomRightMask}
        want_type = fakes.LocalAttentionFromBottomRightMask if window else expected[causal]
        if causal is TL and window is None:
            want_type = fakes.LowerTriangularMask
        assert type(bias) is want_type
    else:
        assert isinstance(bias, torch.Tensor)
    assert call["q"].dim() == (5 if hq != hkv else 4)


@pytest.mark.parametrize("causal,window", [(None, None), (TL, None), (TL, (2, -1))])
def test_xformers_varlen_mapping(xf, causal, window):
    backend, calls = xf()
    q, k, v, cu_q, cu_k = packed([3, 7, 2], [5, 4, 6], 4, 2, 8)
    out = backend.run(
        q,
        k,
        v,
        causal=causal,
        window=window,
        scale=0.5,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=7,
        max_seqlen_k=6,
        enable_gqa=True,
    )
    ref = naive_attention(q, k, v, causal=_str(causal), window=window, scale=0.5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert calls[-1]["attn_bias"].q_seqlen == [3, 7, 2] and calls[-1]["attn_bias"].kv_seqlen == [5, 4, 6]


@pytest.mark.parametrize(
    "lq,lk,causal,window",
    [
        ([3, 0, 4], [0, 2, 2], None, None),  # a sequence without keys (and one without queries)
        ([0, 2, 3], [0, 2, 0], TL, None),
        ([6, 2], [2, 3], TL, (1, 0)),  # top-left window: local rows 3.. of the first see no key
    ],
)
def test_xformers_varlen_rows_without_keys(xf, lq, lk, causal, window):
    """xformers leaves the gradient of a varlen row without an allowed key unspecified (the H200 gave dq
    errors up to 3.7e19; the fake gives NaN): those rows output 0 and their gradients are 0."""
    backend, _ = xf()
    q, k, v, cu_q, cu_k = packed(lq, lk, 4, 2, 8)
    options = _varlen_options(causal, window, cu_q, cu_k)
    out = backend.run(q, k, v, **options)
    ref = naive_attention(q, k, v, causal=_str(causal), window=window, scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    got, g = grads(out, (q, k, v))
    for a, b_ in zip(got, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-10)


def test_xformers_copies_strides_its_kernels_refuse(xf):
    """xformers' dispatcher is asked on stride-0 stand-ins; its kernels refuse a strided last dim (the H200
    fuzz: value every other element): run() copies such inputs."""
    backend, calls = xf()
    q, k, v = inputs(2, 4, 4, 6, 7, 8)
    wide_v = torch.randn(2, 4, 7, 16, dtype=torch.float64)[..., ::2].requires_grad_()
    out = backend.run(q, k, wide_v, scale=0.4)
    torch.testing.assert_close(out, naive_attention(q, k, wide_v, scale=0.4), rtol=0, atol=1e-12)
    assert calls[-1]["q_ptr"] == q.data_ptr()  # q's strides are taken as they are
    # one head and one key: contiguous to PyTorch, yet xformers reads its head stride of 11 (H200 fuzz)
    q1, k1, v1 = (torch.randn(1, 1, 1, 11, dtype=torch.float64)[..., :8].requires_grad_() for _ in range(3))
    assert k1.is_contiguous() and k1.stride() == (11, 11, 11, 1)
    out = backend.run(q1, k1, v1, scale=0.4)
    torch.testing.assert_close(out, naive_attention(q1, k1, v1, scale=0.4), rtol=0, atol=1e-12)


def test_xformers_rejections(xf):
    backend, _ = xf()
    r = backend.reasons
    assert "dropout_p > 0 not supported" in r(problem(dropout=True))
    assert any("bottom_right with varlen" in x for x in r(problem(layout="varlen", causal=BR)))
    assert any(
        "attn_mask with varlen" in x for x in r(problem(layout="varlen", mask_kind="bool", mask_shape=(1, 1, 64, 64)))
    )
    assert any("no xformers mask type" in x for x in r(problem(seqlen_q=5, seqlen_k=9, causal=TL, window=(2, 0))))
    assert r(problem(seqlen_q=9, seqlen_k=5, causal=BR)) == []  # rows without keys: as a tensor bias
    assert r(problem(dtype=torch.float32, window=(2, 1))) == []  # no float32 local mask type: as a tensor bias
    assert "deterministic algorithms requested but the backward is nondeterministic" in r(
        problem(deterministic=True, requires_grad=True)
    )
    # xformers' own "no operator" answer, one reason per operator
    reasons = r(problem(head_dim_qk=160, head_dim_v=160))
    assert reasons == [
        "xformers cutlassF-pt: max(query.shape[-1], value.shape[-1]) > 128",
        "xformers fa2F@2.8.3: xFormers wasn't build with CUDA support",
    ]
    assert (
        r(
            problem(
                heads_kv=2,
                causal=BR,
                seqlen_q=32,
                mask_kind="float",
                mask_shape=(2, 1, 32, 64),
                mask_requires_grad=True,
                requires_grad=True,
            )
        )
        == []
    )


@pytest.mark.parametrize(
    "sq,sk,causal,window,dtype,form",
    [
        (9, 5, BR, None, torch.bfloat16, "tensor"),  # the first 4 rows have no key
        (9, 5, None, (1, 0), torch.bfloat16, "tensor"),  # a band left of every key for the first rows
        (6, 10, None, (2, 1), torch.float32, "tensor"),  # float32: cutlass has no two-sided local mask
        (6, 10, BR, (2, -1), torch.float32, "tensor"),
        (6, 10, None, (2, 1), torch.bfloat16, "LocalAttentionFromBottomRightMask"),
        (12, 5, None, (1, -1), torch.bfloat16, "tensor"),  # flash-attn 2 would bound its right side at Sk
        (6, 5, None, (1, -1), torch.float16, "LocalAttentionFromBottomRightMask"),  # Sq <= Sk + 1: exact
        (9, 5, BR, None, torch.float32, "tensor"),
        (5, 9, BR, None, torch.float32, "LowerTriangularFromBottomRightMask"),
    ],
)
def test_xformers_runs_what_its_mask_types_cannot_as_a_tensor_band(xf, sq, sk, causal, window, dtype, form):
    """Rows without an allowed key (xformers leaves them unspecified: the fake gives NaN) and float32
    windows (no operator takes them as a mask type) go as a tensor bias: accepted, right, route says so."""
    backend, calls = xf()
    p = problem(seqlen_q=sq, seqlen_k=sk, causal=causal, window=window, dtype=dtype, requires_grad=True)
    assert backend.reasons(p) == []
    q, k, v = inputs(2, 4, 2, sq, sk, 8, dtype=dtype)
    options = dict(causal=causal, window=window, scale=0.4, enable_gqa=True)
    route = backend.route(q, k, v, options)
    assert route.steps[0].part == "attn_bias" and route.steps[0].chosen.startswith(form)
    out = backend.run(q, k, v, **options)
    assert isinstance(calls[-1]["attn_bias"], torch.Tensor) == (form == "tensor")
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(*wide, causal=_str(causal), window=window, scale=0.4)
    assert_matches(out, ref, ref_lowp=naive_attention(q, k, v, causal=_str(causal), window=window, scale=0.4))
    got, g = grads(out, (q, k, v))
    for a, b_ in zip(got, torch.autograd.grad(ref, wide, g.double())):
        assert_matches(a, b_, what=f"xformers {form} gradient", factor=4.0, extra=1e-2)


@pytest.mark.parametrize("shape", [(0, 4, 6, 8), (2, 4, 0, 8), (2, 4, 6, 0)], ids=["batch", "queries", "head_dim"])
def test_xformers_empty_dimension_is_zeros_without_a_kernel(xf, shape):
    backend, calls = xf()
    b, h, sq, d = shape
    q, k, v = inputs(b, h, h, sq, 5, d)
    mask = torch.randn(b, 1, sq, 5, dtype=torch.float64, requires_grad=True)
    if d:  # a zero head dim is refused by the declared head_dim_min before xformers is asked
        assert backend.reasons(problem(batch=b, seqlen_q=sq, head_dim_qk=d, head_dim_v=d)) == []
    assert str(backend.route(q, k, v, {})) == "zeros output"
    out = backend.run(q, k, v, attn_mask=mask)
    assert out.shape == (b, h, sq, d) and not out.any() and calls == []
    grads_ = torch.autograd.grad(out.sum(), (q, k, v, mask), allow_unused=True)
    assert all(x is not None and not x.any() for x in grads_)


@pytest.mark.parametrize("no_operator", [False, True])
def test_xformers_without_any_operator_is_unavailable(xf, fake_gpu, monkeypatch, no_operator):
    """An xformers whose C++/CUDA extensions did not load (built for another PyTorch or CUDA) imports with
    a warning and then refuses every call: unavailable, saying why."""
    monkeypatch.setattr("attention_dispatch.backends.xformers.PROBE_DEVICE", "meta")
    backend, _ = xf(no_operator=no_operator)
    reason = backend.unavailable_reason()
    if not no_operator:
        assert reason == "" and backend.is_available()
    else:
        assert not backend.is_available()
        assert reason == (
            "xformers 0.0.35 has no operator for a plain bfloat16 call (xformers cutlassF-pt: xFormers wasn't "
            "build with CUDA support; xformers fa2F@2.8.3: xFormers wasn't build with CUDA support); "
            "`python -m xformers.info` says whether its C++/CUDA extensions loaded"
        )


def test_parse_no_operator_plain_message():
    assert parse_no_operator("something odd\nmore") == ["xformers: something odd"]


# ------------------------------------------------------------- PyTorch SDPA -------
def _cpu_cases():
    rng = random.Random(1234)
    caps = TorchCpuBackend.capabilities
    cases = []
    for dtype in sorted(caps.dtypes, key=str):
        for causal in [None, TL, BR]:
            for mask in ["none", "bool", "float"]:
                sq, sk = rng.choice([(7, 7), (5, 11), (11, 5), (1, 9)])
                hq, hkv = rng.choice([(4, 4), (4, 2), (3, 1)])
                cases.append((dtype, sq, sk, hq, hkv, rng.choice([8, 16, 20]), causal, mask))
    return cases


@pytest.mark.parametrize("dtype,sq,sk,hq,hkv,d,causal,mask", _cpu_cases())
def test_torch_cpu_matches_oracle(dtype, sq, sk, hq, hkv, d, causal, mask):
    backend = TorchCpuBackend()
    p = problem(
        batch=2,
        heads_q=hq,
        heads_kv=hkv,
        seqlen_q=sq,
        seqlen_k=sk,
        head_dim_qk=d,
        head_dim_v=d,
        dtype=dtype,
        device_type="cpu",
        compute_capability=None,
        causal=causal,
        mask_kind=mask,
        mask_shape=None if mask == "none" else (2, 1, sq, sk),
        requires_grad=True,
    )
    assert backend.reasons(p) == []
    q, k, v = inputs(2, hq, hkv, sq, sk, d, dtype=torch.float64)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, sq, sk) > 0.4
        m[0, 0, 0] = False  # a row without any allowed key
    elif mask == "float":
        m = torch.randn(2, 1, sq, sk, dtype=torch.float64)
        m[1, 0, -1] = -math.inf
    lo = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    m_lo = m if m is None or m.dtype == torch.bool else m.to(dtype)
    out = backend.run(*lo, attn_mask=m_lo, causal=causal, scale=1 / math.sqrt(d), enable_gqa=hq != hkv)
    ref = naive_attention(q, k, v, mask=m, causal=_str(causal))
    naive_lo = naive_attention(*lo, mask=m_lo, causal=_str(causal))
    assert out.dtype == dtype and out.shape == ref.shape
    assert_matches(out, ref, naive_lo)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, lo, g.to(dtype))
    want = torch.autograd.grad(ref, (q, k, v), g)
    low = torch.autograd.grad(naive_lo, lo, g.to(dtype))
    for a, b_, c, name in zip(got, want, low, "qkv"):
        assert_matches(a, b_, c, what=f"d{name}")


def test_torch_cpu_rejections():
    r = TorchCpuBackend().reasons
    cpu = dict(device_type="cpu", compute_capability=None)
    assert "dropout_p > 0 not supported" in r(problem(dropout=True, **cpu))
    assert "gradient of a float attn_mask not supported" in r(
        problem(mask_kind="float", mask_shape=(1, 1, 64, 64), mask_requires_grad=True, **cpu)
    )
    assert "varlen (cu_seqlens / nested) inputs not supported" in r(problem(layout="varlen", **cpu))
    assert any("head_dim_qk=64 != head_dim_v=32" in x for x in r(problem(head_dim_v=32, **cpu)))
    assert "window=(4, 0) not supported" in r(problem(window=(4, 0), **cpu))
    assert "device=cuda not in {cpu}" in r(problem())
    assert r(problem(dtype=torch.float64, causal=BR, seqlen_q=3, **cpu)) == []
    assert r(problem(deterministic=True, requires_grad=True, **cpu)) == []
    assert TorchCpuBackend().is_available()


CUDNN_DIRECT_CASES = [  # (hq, hkv, sq, sk, causal, mask, window, last-dim stride 1, op expected)
    (4, 4, 8, 8, None, None, None, True, True),
    (4, 4, 8, 8, TL, None, None, True, True),
    (4, 4, 8, 8, BR, None, None, True, True),
    (4, 4, 5, 9, BR, None, None, True, False),
    (4, 4, 9, 5, TL, None, None, True, True),
    (4, 2, 8, 8, None, None, None, True, False),
    (4, 4, 8, 8, None, "bool", None, True, False),
    (4, 4, 8, 8, None, None, None, False, False),
]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("hq,hkv,sq,sk,causal,mask,window,unit_stride,direct", CUDNN_DIRECT_CASES)
def test_cudnn_prepared_runner_calls_the_aten_op_for_plain_calls(
    monkeypatch, grad, hq, hkv, sq, sk, causal, mask, window, unit_stride, direct
):
    """cuDNN's runner calls torch._scaled_dot_product_cudnn_attention itself for calls without
    mask, GQA or bottom-right offset (faked here: it records its arguments and computes with the
    oracle): is_causal, scale and the log-sum-exp flag (only when the signature needs grad)
    mapped; every other call goes through run() (F.sdpa pinned to cuDNN)."""
    seen = []

    def fake_op(q, k, v, bias, lse, dropout_p, is_causal, debug, *, scale=None):
        seen.append(dict(bias=bias, lse=lse, dropout_p=dropout_p, is_causal=is_causal, debug=debug, scale=scale))
        return naive_attention(q, k, v, causal="top_left" if is_causal else None, scale=scale), None

    monkeypatch.setattr(torch, "_scaled_dot_product_cudnn_attention", fake_op)
    ran = []
    backend = CudnnBackend()
    monkeypatch.setattr(backend, "run", lambda *a, **kw: ran.append(kw) or "run()")
    q, k, v = inputs(2, hq, hkv, sq, sk, 8, grad=grad)
    if not unit_stride:
        q = q.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(grad)
    m = torch.rand(2, 1, sq, sk) > 0.5 if mask else None
    options = dict(
        attn_mask=m,
        dropout_p=0.0,
        causal=causal,
        window=window,
        scale=0.3,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        enable_gqa=hq != hkv,
        deterministic=False,
    )
    runner = backend.prepare(q, k, v, options)
    q2, k2, v2 = (torch.randn_like(t).requires_grad_(grad) for t in (q, k, v))
    args = (q2, k2, v2) if m is None else (q2, k2, v2, m)
    out = runner(*args)
    if not direct:
        assert out == "run()" and not seen and ran[-1]["causal"] is causal
        return
    assert not ran and seen == [
        dict(bias=None, lse=grad, dropout_p=0.0, is_causal=causal is not None, debug=False, scale=0.3)
    ]
    want = naive_attention(q2, k2, v2, causal=_str(causal), scale=0.3)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


# the CPU op takes GQA itself (F.sdpa hands it enable_gqa calls as they are), so GQA is direct there
TORCH_CPU_DIRECT_CASES = [
    c[:-1] + (True,) if c[:2] == (4, 2) and c[4:6] == (None, None) else c for c in CUDNN_DIRECT_CASES
]


@pytest.mark.parametrize("threads", [1, 64])  # GQA folded into rows (ts.fold_pays) or not
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,sq,sk,causal,mask,window,unit_stride,direct", TORCH_CPU_DIRECT_CASES)
def test_torch_cpu_prepared_runner_calls_the_flash_op_for_plain_calls(
    monkeypatch, threads, dtype, hq, hkv, sq, sk, causal, mask, window, unit_stride, direct
):
    """On the CPU for real: plain calls' runner calls torch._scaled_dot_product_flash_attention_for_cpu
    (what F.sdpa pinned to flash calls), bit-equal to run() in output and gradients, GQA included
    (folded or not); masks, a bottom-right offset or a strided last dim keep run()."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    backend = TorchCpuBackend()
    q, k, v = inputs(2, hq, hkv, sq, sk, 16, dtype=dtype)
    if not unit_stride:
        q = q.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
    m = torch.rand(2, 1, sq, sk) > 0.3 if mask else None
    options = dict(
        attn_mask=m,
        dropout_p=0.0,
        causal=causal,
        window=window,
        scale=0.3,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        enable_gqa=hq != hkv,
        deterministic=False,
    )
    runner = backend.prepare(q, k, v, options)
    op = torch._scaled_dot_product_flash_attention_for_cpu
    assert any(c.cell_contents is op for c in runner.__closure__ or ()) is direct
    q2, k2, v2 = (torch.randn_like(t).requires_grad_() for t in (q, k, v))
    got = runner(q2, k2, v2) if m is None else runner(q2, k2, v2, m)
    want = backend.run(q2, k2, v2, **options)
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    for a, b_ in zip(torch.autograd.grad(got, (q2, k2, v2), g), torch.autograd.grad(want, (q2, k2, v2), g)):
        assert torch.equal(a, b_)


class _CpuPinned(TorchSdpaBackend):
    """The shared code path pinned to a CPU kernel, to test the CUDA-only branches here."""

    name = "cpu_pinned"
    device_type = "cpu"
    sdp_backend = "FLASH_ATTENTION"
    capabilities = base.Capabilities()


@pytest.mark.parametrize("fix_empty_rows", [False, True])
@pytest.mark.parametrize(
    "sq,sk,causal,mask",
    [(11, 5, BR, None), (5, 11, BR, None), (9, 9, BR, None), (6, 8, TL, "bool"), (8, 6, BR, "float")],
)
def test_shared_sdpa_path(sq, sk, causal, mask, fix_empty_rows):
    backend = _CpuPinned()
    backend.fix_empty_rows = fix_empty_rows
    q, k, v = inputs(2, 4, 2, sq, sk, 8)
    m = None
    if mask == "bool":
        m = torch.rand(2, 4, sq, sk) > 0.5
        m[:, :, 1] = False
    elif mask == "float":
        m = torch.randn(1, 4, sq, sk, dtype=torch.float64)
        m[0, 0, 3] = -math.inf
    out = backend.run(q, k, v, attn_mask=m, causal=causal, scale=0.3, enable_gqa=True)
    ref = naive_attention(q, k, v, mask=m, causal=_str(causal), scale=0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    got, g = grads(out, (q, k, v))
    for a, b_ in zip(got, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-10)


class _CpuMathPinned(_CpuPinned):
    sdp_backend = "MATH"


@pytest.mark.parametrize("lq,lk", [([3, 7, 2], [5, 4, 6]), ([3, 0, 4, 2], [2, 5, 0, 3])])
def test_shared_sdpa_varlen_path(lq, lk):
    backend = _CpuMathPinned()
    q, k, v, cu_q, cu_k = packed(lq, lk, 4, 2, 8)
    out = backend.run(
        q,
        k,
        v,
        scale=0.3,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(lq),
        max_seqlen_k=max(lk),
        enable_gqa=True,
    )
    ref = naive_attention(q, k, v, scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    got, g = grads(out, (q, k, v))
    for a, b_ in zip(got, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-10)


def test_shared_sdpa_empty_inputs():
    q, k, v = inputs(2, 2, 1, 0, 5, 8)
    out = _CpuPinned().run(q, k, v, scale=0.1, enable_gqa=True)
    assert out.shape == (2, 2, 0, 8)
    q, k, v = inputs(2, 2, 2, 4, 0, 8)
    out = _CpuPinned().run(q, k, v, scale=0.1)
    assert out.shape == (2, 2, 4, 8) and not out.any()


def test_cuda_sdpa_rejections(monkeypatch):
    cudnn, flash, eff = CudnnBackend().reasons, TorchFlashBackend().reasons, TorchEfficientBackend().reasons
    monkeypatch.setattr(CudnnBackend, "_cudnn_version", staticmethod(lambda: 91900))
    # cuDNN
    assert "dropout_p > 0 not supported" in cudnn(problem(dropout=True))
    assert any("Sk=1" in x for x in cudnn(problem(seqlen_k=1)))
    assert cudnn(problem(head_dim_qk=256, head_dim_v=256, requires_grad=True)) == []  # sm90, verified on an H100
    assert "head_dim=256 > 128 (cuDNN 91900 on sm100)" in cudnn(
        problem(head_dim_qk=256, head_dim_v=256, compute_capability=(10, 0))
    )
    assert cudnn(problem(head_dim_qk=192, head_dim_v=128)) == []
    assert "gradient of a float attn_mask not supported" in cudnn(
        problem(mask_kind="float", mask_shape=(1, 1, 64, 64), mask_requires_grad=True)
    )
    assert "deterministic algorithms requested but the backward is nondeterministic" in cudnn(
        problem(deterministic=True, requires_grad=True)
    )
    assert "compute capability sm75 < sm80" in cudnn(problem(compute_capability=(7, 5)))
    assert cudnn(problem(causal=BR, seqlen_q=32, mask_kind="bool", mask_shape=(2, 1, 32, 64))) == []
    monkeypatch.setattr(CudnnBackend, "_cudnn_version", staticmethod(lambda: 91800))
    assert "head_dim=256 > 128 (cuDNN 91800 on sm90)" in cudnn(problem(head_dim_qk=256, head_dim_v=256))
    monkeypatch.setattr(CudnnBackend, "_cudnn_version", staticmethod(lambda: 92300))
    assert cudnn(problem(head_dim_qk=256, head_dim_v=256, requires_grad=True)) == []
    assert cudnn(problem(head_dim_qk=256, head_dim_v=256, compute_capability=(10, 0))) == []
    assert any(
        "backward with head dims (256, 128)" in x
        for x in cudnn(problem(head_dim_qk=256, head_dim_v=128, requires_grad=True))
    )
    # PyTorch flash
    assert "bool attn_mask not supported" in flash(problem(mask_kind="bool", mask_shape=(1, 1, 64, 64)))
    assert "causal=top_left with Sq=32 != Sk=64 (the backend aligns causal bottom_right)" in flash(
        problem(seqlen_q=32, causal=TL)
    )
    assert flash(problem(seqlen_q=32, causal=BR, heads_kv=2, dropout=True)) == []
    assert any(
        "head_dim=200" in x
        for x in flash(problem(compute_capability=(8, 6), head_dim_qk=200, head_dim_v=200, requires_grad=True))
    )
    assert any("multiple of 8" in x for x in flash(problem(layout="varlen", head_dim_qk=60, head_dim_v=60)))
    assert any(
        "torch.use_deterministic_algorithms(True)" in x for x in flash(problem(deterministic=True, requires_grad=True))
    )
    assert "window=(8, 0) not supported" in flash(problem(window=(8, 0)))
    assert any("causal=top_left with varlen" in x for x in flash(problem(layout="varlen", causal=TL)))
    assert flash(problem(layout="varlen", causal=TL, same_offsets=True)) == []  # packed self-attention
    # PyTorch efficient
    assert any("head_dim_qk=20 is not a multiple of 8" in x for x in eff(problem(head_dim_qk=20, head_dim_v=20)))
    assert eff(problem(head_dim_qk=20, head_dim_v=20, dtype=torch.float32)) == []
    assert any("varlen" in x and "backward" in x for x in eff(problem(layout="varlen", requires_grad=True)))
    assert any("bottom_right with varlen" in x for x in eff(problem(layout="varlen", causal=BR)))
    assert eff(problem(layout="varlen", causal=BR, same_offsets=True)) == []
    assert any("16-byte aligned" in x for x in eff(problem(aligned_16=False)))
    assert "dtype=float64 not in {bfloat16, float16, float32}" in eff(problem(dtype=torch.float64))
    assert (
        eff(
            problem(
                causal=TL,
                seqlen_q=32,
                mask_kind="float",
                mask_shape=(1, 4, 32, 64),
                mask_requires_grad=True,
                requires_grad=True,
                dropout=True,
            )
        )
        == []
    )


def test_cuda_sdpa_unavailable_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    for b in (CudnnBackend(), TorchFlashBackend(), TorchEfficientBackend()):
        assert not b.is_available() and "no CUDA device" in b.unavailable_reason()


# --------------------------------------------------------------------- GPU --------
def _sample_gpu_problems(caps: base.Capabilities, n: int, seed: int, extra=None):
    """Random problems the capabilities claim, kept small."""
    rng = random.Random(seed)
    dims = [d for d in (32, 64, 128) if (caps.head_dim_max or 512) >= d and d % caps.head_dim_multiple == 0]
    out = []
    for _ in range(n):
        sq, sk = rng.choice([(128, 128), (64, 192), (192, 64), (100, 130)])
        hq, hkv = rng.choice([(4, 4), (4, 2)] if caps.gqa else [(4, 4)])
        d = rng.choice(dims)
        dv = rng.choice([d, 64]) if caps.different_head_dims and 64 <= (caps.head_dim_max or 512) else d
        causal = rng.choice([None] + sorted(caps.causal_kinds, key=str))
        if causal is TL and CausalKind.BOTTOM_RIGHT in caps.causal_kinds and TL not in caps.causal_kinds:
            causal = BR
        mask = rng.choice(["none"] + (["bool"] if caps.bool_mask else []) + (["float"] if caps.float_bias else []))
        window = rng.choice([None, (16, 8), (32, -1)]) if caps.window else None
        dtype = rng.choice(sorted(caps.dtypes & {torch.float16, torch.bfloat16, torch.float32}, key=str))
        case = dict(
            sq=sq,
            sk=sk,
            hq=hq,
            hkv=hkv,
            d=d,
            dv=dv,
            causal=causal,
            mask=mask,
            window=window,
            dtype=dtype,
            mask_grad=mask == "float" and caps.bias_grad and rng.random() < 0.5,
        )
        if extra:
            case.update(extra(rng))
        out.append(case)
    return out


def _gpu_check(backend, c):
    dev = torch.device("cuda")
    cc = torch.cuda.get_device_capability()
    b = 2
    p = problem(
        batch=b,
        heads_q=c["hq"],
        heads_kv=c["hkv"],
        seqlen_q=c["sq"],
        seqlen_k=c["sk"],
        head_dim_qk=c["d"],
        head_dim_v=c["dv"],
        dtype=c["dtype"],
        compute_capability=cc,
        causal=c["causal"],
        window=c["window"],
        mask_kind=c["mask"],
        mask_shape=None if c["mask"] == "none" else (b, 1, c["sq"], c["sk"]),
        mask_requires_grad=c["mask_grad"],
        requires_grad=True,
    )
    if backend.reasons(p):
        pytest.skip(f"not claimed: {backend.reasons(p)}")
    q, k, v = inputs(b, c["hq"], c["hkv"], c["sq"], c["sk"], c["d"], c["dv"], dtype=torch.float64, device="cpu")
    m = None
    if c["mask"] == "bool":
        m = torch.rand(b, 1, c["sq"], c["sk"]) > 0.3
        m[0, 0, 1] = False
    elif c["mask"] == "float":
        m = torch.randn(b, 1, c["sq"], c["sk"], dtype=torch.float64)
        m[1, 0, 2] = -math.inf
        m.requires_grad_(c["mask_grad"])
    dt = c["dtype"]
    lo = [t.detach().to(dev, dt).requires_grad_() for t in (q, k, v)]
    m_lo = (
        None
        if m is None
        else (m.to(dev) if m.dtype == torch.bool else m.detach().to(dev, dt).requires_grad_(c["mask_grad"]))
    )
    out = backend.run(
        *lo,
        attn_mask=m_lo,
        causal=c["causal"],
        window=c["window"],
        scale=1 / math.sqrt(c["d"]),
        enable_gqa=c["hq"] != c["hkv"],
        deterministic=False,
    )
    ref = naive_attention(q, k, v, mask=m, causal=_str(c["causal"]), window=c["window"])
    cpu_lo = [t.detach().cpu().requires_grad_() for t in lo]
    m_cpu = None if m_lo is None else m_lo.detach().cpu().requires_grad_(c["mask_grad"])
    naive_lo = naive_attention(*cpu_lo, mask=m_cpu, causal=_str(c["causal"]), window=c["window"])
    assert_matches(out.cpu(), ref, naive_lo)
    g = torch.randn_like(ref)
    ins = lo + ([m_lo] if c["mask_grad"] else [])
    got = torch.autograd.grad(out, ins, g.to(dev, dt))
    want = torch.autograd.grad(ref, [q, k, v] + ([m] if c["mask_grad"] else []), g)
    low = torch.autograd.grad(naive_lo, cpu_lo + ([m_cpu] if c["mask_grad"] else []), g.to(dt))
    for a, b_, l_ in zip(got, want, low):
        assert_matches(a.cpu(), b_, l_, what="gradient")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cudnn", "torch_flash", "torch_efficient"])
@pytest.mark.parametrize("seed", range(12))
def test_gpu_torch_kernels_match_oracle(name, seed):
    backend = {"cudnn": CudnnBackend, "torch_flash": TorchFlashBackend, "torch_efficient": TorchEfficientBackend}[
        name
    ]()
    assert backend.is_available(), backend.unavailable_reason()
    (case,) = _sample_gpu_problems(backend.capabilities, 1, seed * 7 + len(name))
    _gpu_check(backend, case)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(12))
def test_gpu_flash_attn_4_matches_oracle(seed):
    pytest.importorskip("flash_attn.cute")
    backend = FlashAttnBackend(versions=("fa4",))
    assert backend.is_available(), backend.unavailable_reason()
    (case,) = _sample_gpu_problems(backend.capabilities, 1, seed, extra=lambda rng: dict(d=rng.choice([64, 128])))
    case["dv"] = case["d"]
    if torch.cuda.get_device_capability()[0] == 9:
        case["window"] = None  # flash-attn 4 has no windowed backward on sm90 (rejected)
    _gpu_check(backend, case)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "b,h,sq,sk,d,causal,dtype,grad",
    [
        (2, 4, 512, 512, 128, None, torch.bfloat16, False),
        (2, 4, 512, 512, 128, TL, torch.float16, True),
        (3, 8, 300, 700, 64, TL, torch.bfloat16, True),
        (2, 2, 640, 640, 256, BR, torch.bfloat16, False),
        (1, 16, 1000, 1000, 96, None, torch.float16, True),
    ],
)
def test_gpu_cudnn_prepared_runner_equals_pinned_sdpa(b, h, sq, sk, d, causal, dtype, grad):
    """The prepared cuDNN runner (the ATen op called directly) is bit-equal to run() (F.sdpa
    pinned to cuDNN), forward and gradients, and sdpa()'s fast path uses it."""
    backend = CudnnBackend()
    assert backend.is_available(), backend.unavailable_reason()
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype).requires_grad_(grad) for s in (sq, sk, sk))
    options = dict(
        attn_mask=None,
        dropout_p=0.0,
        causal=causal,
        window=None,
        scale=1 / math.sqrt(d),
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        enable_gqa=False,
        deterministic=False,
    )
    runner = backend.prepare(q, k, v, options)
    assert any(c.cell_contents is torch._scaled_dot_product_cudnn_attention for c in runner.__closure__ or ())
    q2, k2, v2 = (torch.randn_like(t).requires_grad_(grad) for t in (q, k, v))
    got, want = runner(q2, k2, v2), backend.run(q2, k2, v2, **options)
    assert torch.equal(got, want)
    if grad:
        g = torch.randn_like(got)
        ours = torch.autograd.grad(got, (q2, k2, v2), g)
        theirs = torch.autograd.grad(want, (q2, k2, v2), g, retain_graph=True)
        again = torch.autograd.grad(want, (q2, k2, v2), g)  # cuDNN's backward may sum in any order
        for a, b_, c, name in zip(ours, theirs, again, "qkv"):
            noise = (b_.float() - c.float()).abs().max().item()
            diff = (a.float() - b_.float()).abs().max().item()
            assert diff <= 2 * noise, f"d{name}: {diff} from run()'s, which differs from itself by {noise}"
    for _ in range(2):
        out = attention_dispatch.sdpa(q2, k2, v2, causal=_str(causal), scale=options["scale"], backend="cudnn")
    assert torch.equal(out, want)
    assert any(
        r.__code__ is runner.__code__ for _, r in attention_dispatch.api.fast_calls.values() if hasattr(r, "__code__")
    )


FA4_RELAUNCH_CASES = [  # (b, hq, hkv, sq, sk, d, causal, window, dtype, memory layout of the inputs)
    (2, 4, 4, 512, 512, 128, None, None, torch.bfloat16, "bhsd"),
    (3, 8, 2, 300, 700, 64, BR, None, torch.float16, "bhsd"),
    (2, 4, 4, 1024, 1024, 128, TL, None, torch.float16, "bshd"),
    (1, 6, 2, 777, 777, 96, None, (128, 0), torch.bfloat16, "bshd"),
    (2, 4, 1, 640, 1000, 128, BR, (200, -1), torch.bfloat16, "bhsd"),
    (4, 16, 16, 256, 256, 64, None, (64, 64), torch.float16, "bhsd"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,window,dtype,layout", FA4_RELAUNCH_CASES)
def test_gpu_flash_attn_4_inference_relaunch_equals_flash_attn_func(
    b, hq, hkv, sq, sk, d, causal, window, dtype, layout
):
    """Without autograd the prepared flash-attn 4 runner (sdpa()'s fast path) records the
    compiled forward once and relaunches it: every call bit-equal to flash_attn_func on the
    same inputs, the relaunch engaged on the real library, and sdpa() using it."""
    pytest.importorskip("flash_attn.cute")
    from flash_attn.cute import flash_attn_func

    backend = FlashAttnBackend(versions=("fa4",))
    assert backend.is_available(), backend.unavailable_reason()

    def make(h, s):
        if layout == "bshd":
            return torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, device="cuda", dtype=dtype)

    options = dict(_fa4_options(causal, window, hq, hkv), scale=1 / math.sqrt(d))
    with torch.no_grad():
        q, k, v = make(hq, sq), make(hkv, sk), make(hkv, sk)
        runner = backend.prepare(q, k, v, options)
        assert isinstance(runner, ForwardRelauncher)
        is_causal, window_size = backend.window_args(backend.implementations()[0], causal, window)
        for i in range(3):
            if i:
                q, k, v = (torch.randn_like(t) for t in (q, k, v))
            got = runner(q, k, v)
            want = flash_attn_func(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                softmax_scale=options["scale"],
                causal=is_causal,
                window_size=window_size,
            )
            want = (want[0] if isinstance(want, tuple) else want).transpose(1, 2)
            assert runner.launch is not None, runner.refused
            assert torch.equal(got, want), (got - want).abs().max()
        ad_causal = None if causal is None else str(causal)
        for _ in range(2):
            out = attention_dispatch.sdpa(
                q,
                k,
                v,
                causal=ad_causal,
                window=window,
                scale=options["scale"],
                enable_gqa=hkv != hq,
                backend="flash_attn",
            )
        hits = [r for _, r in attention_dispatch.api.fast_calls.values() if isinstance(r, ForwardRelauncher)]
        assert any(r.launch is not None for r in hits)
        assert torch.equal(out, got)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lq,lk,hq,hkv,d,causal,window,dtype,same",
    [
        ([700, 33, 1000, 291], [700, 33, 1000, 291], 8, 2, 128, TL, None, torch.bfloat16, True),
        ([100, 900, 24], [1000, 20, 4], 4, 4, 64, BR, None, torch.float16, False),
        ([512] * 6, [512] * 6, 16, 16, 96, None, (128, 0), torch.bfloat16, True),
    ],
)
def test_gpu_flash_attn_4_varlen_relaunch_equals_flash_attn_varlen_func(
    lq, lk, hq, hkv, d, causal, window, dtype, same
):
    """Varlen inference: the prepared flash-attn 4 runner records the compiled forward once and
    relaunches it with each call's offsets (other lengths, same totals): every call bit-equal
    to flash_attn_varlen_func on the same inputs, the relaunch engaged on the real library, and
    sdpa() using it."""
    pytest.importorskip("flash_attn.cute")
    from flash_attn.cute import flash_attn_varlen_func

    backend = FlashAttnBackend(versions=("fa4",))
    assert backend.is_available(), backend.unavailable_reason()
    max_q, max_k = max(lq), max(lk)
    options = dict(
        _varlen_options(causal, window, None, None),
        scale=1 / math.sqrt(d),
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        enable_gqa=hkv != hq,
    )
    is_causal, window_size = backend.window_args(backend.implementations()[0], causal, window)
    with torch.no_grad():
        for i in range(3):
            # the same totals and longest sequence, other lengths from the second call on
            perm = (lambda xs: xs) if i == 0 else (lambda xs: xs[::-1] if i == 1 else xs[1:] + xs[:1])
            q, k, v, cu_q, cu_k = (
                t.to("cuda", dtype) if t.is_floating_point() else t.cuda()
                for t in packed(perm(lq), perm(lk), hq, hkv, d)
            )
            cu_k = cu_q if same else cu_k
            if i == 0:
                runner = backend.prepare(q, k, v, dict(options, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
                assert isinstance(runner, VarlenRelauncher)
            got = runner(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
            want = flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max_q,
                max_seqlen_k=max_k,
                softmax_scale=options["scale"],
                causal=is_causal,
                window_size=window_size,
            )
            want = want[0] if isinstance(want, tuple) else want
            assert runner.launch is not None, runner.refused
            assert torch.equal(got, want), (got - want).abs().max()
        ad_causal = None if causal is None else str(causal)
        for _ in range(2):
            out = attention_dispatch.sdpa(
                q,
                k,
                v,
                causal=ad_causal,
                window=window,
                scale=options["scale"],
                enable_gqa=hkv != hq,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max_q,
                max_seqlen_k=max_k,
                backend="flash_attn",
            )
        hits = [r for _, r in attention_dispatch.api.fast_calls.values() if isinstance(r, VarlenRelauncher)]
        assert any(r.launch is not None for r in hits)
        assert torch.equal(out, got)
        # policy="fastest" times the prepared runner as it is (no offsets passed): flash-attn 4 runs
        from attention_dispatch import fastest

        fastest.forget()
        with attention_dispatch.use_config({"dispatch": {"policy": "fastest"}}):
            attention_dispatch.sdpa(
                q,
                k,
                v,
                causal=ad_causal,
                window=window,
                scale=options["scale"],
                enable_gqa=hkv != hq,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max_q,
                max_seqlen_k=max_k,
            )
        decision = attention_dispatch.last_decision()
        assert "flash_attn" in decision.timings and not decision.failures, str(decision)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "b,hq,hkv,sq,sk,d,causal,window,dtype,layout", [c for c in FA4_RELAUNCH_CASES if c[7] is None]
)  # sm90: no windowed backward
def test_gpu_flash_attn_4_training_relaunch_equals_flash_attn_func(
    b, hq, hkv, sq, sk, d, causal, window, dtype, layout
):
    """With autograd the prepared flash-attn 4 runner relaunches the recorded forward (output
    bit-equal to flash_attn_func's) and runs flash-attn 4's backward on its output and LSE:
    gradients equal to flash_attn_func's within that backward's own run-to-run spread."""
    pytest.importorskip("flash_attn.cute")
    from flash_attn.cute import flash_attn_func

    backend = FlashAttnBackend(versions=("fa4",))

    def make(h, s):
        t = (
            torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
            if layout == "bshd"
            else torch.randn(b, h, s, d, device="cuda", dtype=dtype)
        )
        return t.requires_grad_()

    options = dict(_fa4_options(causal, window, hq, hkv), scale=1 / math.sqrt(d))
    q, k, v = make(hq, sq), make(hkv, sk), make(hkv, sk)
    runner = backend.prepare(q, k, v, options)
    assert isinstance(runner, ForwardRelauncher) and runner.training
    is_causal, window_size = backend.window_args(backend.implementations()[0], causal, window)

    def public():
        o = flash_attn_func(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            softmax_scale=options["scale"],
            causal=is_causal,
            window_size=window_size,
        )
        return (o[0] if isinstance(o, tuple) else o).transpose(1, 2)

    for i in range(3):
        if i:
            q, k, v = (torch.randn_like(t).requires_grad_() for t in (q, k, v))
        got = runner(q, k, v)
        assert runner.launch is not None, runner.refused
        want = public()
        assert torch.equal(got, want)
        g = torch.randn_like(got)
        ours = torch.autograd.grad(got, (q, k, v), g)
        theirs = torch.autograd.grad(want, (q, k, v), g)
        # flash-attn 4's backward adds dQ with atomics: its own spread over three more runs, and
        # at least two units in the last place of the largest gradient (two runs can agree bit for
        # bit by chance where a third does not)
        again = [torch.autograd.grad(public(), (q, k, v), g) for _ in range(3)]
        for j, (a, b_, name) in enumerate(zip(ours, theirs, "qkv")):
            noise = max((b_.float() - c[j].float()).abs().max().item() for c in again)
            floor = 2 * torch.finfo(dtype).eps * b_.float().abs().max().item()
            diff = (a.float() - b_.float()).abs().max().item()
            assert diff <= max(2 * noise, floor), (
                f"d{name}: {diff} from flash_attn_func's, which differs from itself by {noise} (floor {floor})"
            )


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch_flash", "torch_efficient"])
def test_gpu_torch_kernels_varlen(name):
    backend = {"torch_flash": TorchFlashBackend, "torch_efficient": TorchEfficientBackend}[name]()
    lq, lk = [70, 3, 130], [90, 40, 130]
    q, k, v, cu_q, cu_k = packed(lq, lk, 4, 2, 64)
    lo = [t.detach().cuda().half() for t in (q, k, v)]
    causal = BR if name == "torch_flash" else TL
    out = backend.run(
        *lo,
        causal=causal,
        scale=0.125,
        cu_seqlens_q=cu_q.cuda(),
        cu_seqlens_k=cu_k.cuda(),
        max_seqlen_q=max(lq),
        max_seqlen_k=max(lk),
        enable_gqa=True,
    )
    ref = naive_attention(q, k, v, causal=str(causal), scale=0.125, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    naive_lo = naive_attention(
        *[t.cpu() for t in lo], causal=str(causal), scale=0.125, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
    )
    assert_matches(out.cpu(), ref.detach(), naive_lo.detach())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch_flash", "torch_efficient"])
def test_gpu_dropout_mask_is_consistent(name):
    """With V = identity the output exposes the kept probabilities: check them and the backward."""
    backend = {"torch_flash": TorchFlashBackend, "torch_efficient": TorchEfficientBackend}[name]()
    s, p = 64, 0.25
    q = torch.randn(1, 2, s, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 2, s, 64, device="cuda", dtype=torch.float16)
    v = torch.eye(s, 64, device="cuda", dtype=torch.float16).expand(1, 2, s, 64).contiguous().requires_grad_()
    torch.manual_seed(3)
    out = backend.run(q, k, v, dropout_p=p, scale=0.125)
    torch.manual_seed(3)
    again = backend.run(q, k, v, dropout_p=p, scale=0.125)
    assert torch.equal(out, again)
    keep = out.detach().double().cpu() != 0
    ref = naive_attention(
        q.double().cpu(), k.double().cpu(), v.detach().double().cpu(), scale=0.125, keep=keep, dropout_p=p
    )
    assert (out.double().cpu() - ref).abs().max() < 2e-2
    assert 0.6 < keep.double().mean() < 0.9
    g = torch.randn_like(out)
    (gv,) = torch.autograd.grad(out, (v,), g)
    # out is linear in v: <out, g> == <v, dv> only if the backward replays the forward's mask
    assert abs((out.double() * g.double()).sum() - (v.double() * gv.double()).sum()) < 1e-1


def test_pinning_context_sets_and_restores_the_flags():
    from attention_dispatch.backends.torch_sdpa import PinnedKernel

    flags = torch.backends.cuda
    getters = [
        flags.flash_sdp_enabled,
        flags.mem_efficient_sdp_enabled,
        flags.math_sdp_enabled,
        flags.cudnn_sdp_enabled,
    ]
    before = [g() for g in getters]
    flags.enable_math_sdp(False)  # a non-default state must come back too
    try:
        with PinnedKernel("FLASH_ATTENTION"):
            assert [g() for g in getters] == [True, False, False, False]
        assert [g() for g in getters] == [before[0], before[1], False, before[3]]
        with pytest.raises(RuntimeError):
            with PinnedKernel("CUDNN_ATTENTION"):
                assert [g() for g in getters] == [False, False, False, True]
                raise RuntimeError("inside")
        assert [g() for g in getters] == [before[0], before[1], False, before[3]]
    finally:
        flags.enable_math_sdp(before[2])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,causal,heads_kv",
    [("flash_attn", "top_left", 2), ("torch_flash", "top_left", 2), ("torch_efficient", "bottom_right", 4)],
)
def test_gpu_packed_self_attention_on_kernels_of_the_other_alignment(name, causal, heads_kv):
    """Causal on packed sequences with one offsets tensor: kernels aligning causal the other
    way (flash: bottom-right, efficient's nested path: top-left) take it (each sequence is
    square) and match the oracle.  (PyTorch's efficient nested path has no GQA: 4 kv heads.)"""
    if name == "flash_attn":
        pytest.importorskip("flash_attn.cute")
    lens = [70, 3, 130, 64]
    q, k, v, cu, _ = packed(lens, lens, 4, heads_kv, 64)
    cu_dev = cu.cuda()
    lo = [t.detach().cuda().bfloat16() for t in (q, k, v)]
    out = attention_dispatch.sdpa(
        *lo,
        causal=causal,
        cu_seqlens_q=cu_dev,
        cu_seqlens_k=cu_dev,
        max_seqlen_q=max(lens),
        max_seqlen_k=max(lens),
        enable_gqa=True,
        backend=name,
    )
    assert attention_dispatch.last_decision().backend == name
    ref = naive_attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    naive_lo = naive_attention(*[t.cpu() for t in lo], causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert_matches(out.cpu(), ref.detach(), naive_lo.detach())


def test_xformers_fake_has_the_real_private_signatures():
    """The fake's private xformers functions take what the installed xformers' take, so the
    fake cannot drift from the library again (the adapter's one private call site is
    `xformers.dispatch_backward`)."""
    xformers = pytest.importorskip("xformers.ops.fmha.dispatch")
    fake = fakes.make_xformers([])["xformers.ops.fmha.dispatch"]
    for name in ("_dispatch_fw", "_dispatch_bw"):
        real = list(inspect.signature(getattr(xformers, name)).parameters)
        assert list(inspect.signature(getattr(fake, name)).parameters) == real, name


def test_xformers_backward_dispatch_follows_the_signature():
    """dispatch_backward passes the forward operator's LSE layout where _dispatch_bw takes it."""
    from attention_dispatch.backends.xformers import dispatch_backward

    class Op:
        VARLEN_LSE_PACKED = False

    new = types.SimpleNamespace(_dispatch_bw=lambda inp, varlen_lse_packed: ("new", inp, varlen_lse_packed))
    old = types.SimpleNamespace(_dispatch_bw=lambda inp: ("old", inp))
    assert dispatch_backward(new, "inp", Op) == ("new", "inp", False)
    assert dispatch_backward(old, "inp", Op) == ("old", "inp")


def test_flash_attn_4_relaunch_only_on_tested_releases():
    """fa4_relaunch reads flash-attn 4's private compile cache only on releases it was checked
    on; any other keeps the public function, with the reason."""
    from attention_dispatch.backends.fa4_relaunch import untested_release

    assert untested_release("4.0.0b36") is None
    assert "4.1.0 is not a tested release" in untested_release("4.1.0")
    assert "(unknown version)" in untested_release("")


def test_flash_attn_4_fake_has_the_real_private_signatures():
    """The adapter's call of flash-attn 4's private ``_flash_attn_bwd`` (positional q, k, v, out,
    dout, lse, softmax_scale, causal, softcap; window and determinism by keyword) binds to the
    installed flash-attn 4's signature with the same meaning, as it does to the fake's."""
    real = pytest.importorskip("flash_attn.cute.interface")
    fake = fakes._fa4_interface(None, None)
    positional = ["q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap"]
    # dlse and learnable_sink: what flash_attn_features reads to declare lse_grad and sinks_grad
    keywords = dict(window_size_left=None, window_size_right=None, deterministic=False, dlse=None, learnable_sink=None)
    for module in (fake, real):
        signature = inspect.signature(module._flash_attn_bwd)
        assert list(signature.parameters)[: len(positional)] == positional, module
        signature.bind(*positional, **keywords)
        assert torch.float32 in module._LEARNABLE_SINK_DTYPES, module
    assert hasattr(real._flash_attn_fwd, "compile_cache")


def test_fa4_placeholder_version_reads_the_wheels(fa, monkeypatch):
    """flash_attn.cute 4.0.0b36 reports "0.0.0" (its __version__ asks for another distribution
    name): the backend reads the installed wheel's version instead."""
    from attention_dispatch.backends import fa4_relaunch

    backend, _ = fa(4)
    monkeypatch.setattr(sys.modules["flash_attn.cute"], "__version__", "0.0.0", raising=False)
    monkeypatch.setattr(fa4_relaunch, "dist_version", lambda *names: "4.0.0b36" if "flash-attn-4" in names else "")
    assert FlashAttnBackend().version() == "flash-attn 4 4.0.0b36"
    # the relauncher reads the same version (it read "0.0.0" and never relaunched before)
    assert fa4_relaunch._release() == "4.0.0b36" and fa4_relaunch.untested_release(fa4_relaunch._release()) is None
    monkeypatch.setattr(fa4_relaunch, "dist_version", lambda *names: "")
    assert FlashAttnBackend().version() == "flash-attn 4 0.0.0"
    assert "not a tested release" in fa4_relaunch.untested_release(fa4_relaunch._release())


@pytest.mark.gpu
def test_installed_flash_attn_4_is_relaunched():
    """The relauncher reads the version the backend reports, and the installed release is one it
    relaunches (4.0.0b36's placeholder "0.0.0" once kept every call on the public path, 246 us
    against 41 us a call on the H100): a new release fails here until it has been checked."""
    pytest.importorskip("flash_attn.cute")
    from attention_dispatch.backends import fa4_relaunch

    version = fa4_relaunch._release()
    assert FlashAttnBackend().version().endswith(version), version
    assert fa4_relaunch.untested_release(version) is None, version


@pytest.mark.parametrize("packed", [True, False])
def test_empty_call_output_with_grouped_heads(packed):
    """An empty call's exact zeros with fewer key/value heads than query heads, packed (total, H, D)
    as (B, H, S, D) (the GPU fuzz found the packed case grouping along the token axis)."""
    from attention_dispatch.backends.torch_sdpa import _empty_like_call

    shape_q, shape_kv = ((0, 4, 8), (0, 2, 8)) if packed else ((1, 4, 0, 8), (1, 2, 0, 8))
    q = torch.randn(shape_q, requires_grad=True)
    k, v = (torch.randn(shape_kv, requires_grad=True) for _ in range(2))
    out = _empty_like_call(q, k, v)
    assert out.shape == q.shape and out.requires_grad
    assert all(g.shape == t.shape for g, t in zip(torch.autograd.grad(out.sum(), (q, k, v)), (q, k, v)))


def test_empty_call_gives_a_float_mask_requiring_grad_its_zero_gradient():
    """An empty call (batch 0) with a float mask that requires grad: the mask's gradient is
    zeros, as for q, k, v (the GPU fuzz found None from torch_efficient)."""
    from attention_dispatch.backends.torch_backends import TorchEfficientBackend

    q, k, v = (torch.randn(0, 1, 4, 8, requires_grad=True) for _ in range(3))
    mask = torch.randn(0, 1, 4, 4, requires_grad=True)
    out = TorchEfficientBackend().run(q, k, v, attn_mask=mask, dropout_p=0.0, causal=None, window=None, scale=None)
    (dmask,) = torch.autograd.grad(out.sum(), (mask,))
    assert dmask.shape == mask.shape and not dmask.any()
