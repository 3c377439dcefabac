"""The numerics guard (policy/guard.py): a backend wrong on some calls is caught, quarantined
for that kind of call and routed around; strict raises; off costs nothing."""

import contextlib
import logging

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import dispatch
from attention_dispatch.api import normalize_call
from attention_dispatch.backends.math import math_attention
from attention_dispatch.policy import guard, guard_rows

from cases import Case, make_inputs
from naive import naive_attention


class Sloppy(ad.Backend):
    """Claims windows but ignores them when Sk > 64 (the bug of 'Done when')."""

    name = "sloppy"

    def __init__(self):
        self.runs = 0

    def run(self, query, key, value, **options):
        self.runs += 1
        if key.shape[-2] > 64:
            options = dict(options, window=None)
        return math_attention(query, key, value, **options)


class Drifting(ad.Backend):
    """Right on its first call, then off by 0.5 (only a sampled later call can see it)."""

    name = "drifting"

    def __init__(self):
        self.runs = 0

    def run(self, query, key, value, **options):
        self.runs += 1
        out = math_attention(query, key, value, **options)
        return out if self.runs == 1 else out + 0.5


@contextlib.contextmanager
def guarded(mode, first="sloppy", **options):
    """The guard on, with the custom backend first and the CPU backends after it (the triton
    kernel is left out to keep these tests fast under the interpreter)."""
    with ad.use_config({"guard": {"mode": mode, **options}}), ad.use_backends(first, "torch_cpu", "math"):
        yield


def window_call(sk, requires_grad=False):
    q = torch.randn(2, 4, 16, 32, requires_grad=requires_grad)
    k = torch.randn(2, 4, sk, 32, requires_grad=requires_grad)
    v = torch.randn(2, 4, sk, 32, requires_grad=requires_grad)
    ref = naive_attention(q.double(), k.double(), v.double(), window=(8, 0)).float()
    return (q, k, v), dict(window=(8, 0)), ref


def test_first_mode_quarantines_a_backend_wrong_on_some_calls(caplog):
    sloppy = Sloppy()
    ad.register_backend(sloppy, priority="first")
    with guarded("first"):
        args, kw, ref = window_call(32)
        torch.testing.assert_close(ad.sdpa(*args, **kw), ref)  # right where Sk <= 64: kept
        assert ad.last_decision().backend == "sloppy"
        args, kw, ref = window_call(128)
        with caplog.at_level(logging.ERROR, logger="attention_dispatch"):
            out = ad.sdpa(*args, **kw)
        torch.testing.assert_close(out, ref)  # the user gets the right answer
        d = ad.last_decision()
        assert d.backend != "sloppy" and any("sloppy quarantined: max error" in n for n in d.notes)
        (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "'sloppy'" in record.getMessage() and "Sk=128" in record.getMessage()
        assert "max error" in record.getMessage() and "window=(8, 0)" in record.getMessage()
        # later decisions of this kind skip it, with the reason, even for lengths it gets right
        for sk in (128, 32):
            args, kw, ref = window_call(sk)
            e = ad.explain(*args, **kw)
            (reason,) = e.rejected["sloppy"]
            assert reason.startswith("quarantined: max error ") and "numerics guard" in reason
            assert "no: quarantined: max error" in str(e)
            runs = sloppy.runs
            torch.testing.assert_close(ad.sdpa(*args, **kw), ref)
            torch.testing.assert_close(ad.sdpa(*args, **kw), ref)  # the fast path too
            assert sloppy.runs == runs
        # another kind of call (no window) still goes to it
        q, k, v = window_call(128)[0]
        ad.sdpa(q, k, v)
        assert ad.last_decision().backend == "sloppy"
        assert list(guard.quarantined()) == ["sloppy"]
    ad.clear_cache()  # forgets the quarantine (a reinstalled library may be fixed)
    assert guard.quarantined() == {}


def test_first_mode_checks_the_training_call_and_its_rerun_keeps_the_graph():
    ad.register_backend(Sloppy(), priority="first")
    with guarded("first"):
        args, kw, _ = window_call(100, requires_grad=True)
        out = ad.sdpa(*args, **kw)
        assert ad.last_decision().backend != "sloppy"
        out.sum().backward()
        ref_args = [t.detach().double().requires_grad_() for t in args]
        naive_attention(*ref_args, window=(8, 0)).sum().backward()
        for t, r in zip(args, ref_args):
            torch.testing.assert_close(t.grad, r.grad.float(), atol=1e-5, rtol=1e-4)


def test_strict_mode_raises_naming_the_backend_and_quarantines_nothing():
    ad.register_backend(Sloppy(), priority="first")
    args, kw, _ = window_call(128)
    with guarded("strict"):
        with pytest.raises(guard.GuardError, match=r"backend 'sloppy' gives wrong results: max error .* Sk=128"):
            ad.sdpa(*args, **kw)
        ok_args, ok_kw, ref = window_call(32)
        for _ in range(3):  # strict checks every call, never from a cached fast path
            torch.testing.assert_close(ad.sdpa(*ok_args, **ok_kw), ref)
    assert guard.quarantined() == {}
    assert ad.explain(*args, **kw).backend == "sloppy"


def test_off_by_default_checks_nothing(monkeypatch):
    ad.register_backend(Sloppy(), priority="first")
    monkeypatch.setattr(guard, "check", lambda *a, **k: pytest.fail("the guard ran while off"))
    args, kw, ref = window_call(128)
    out = ad.sdpa(*args, **kw)
    assert ad.last_decision().backend == "sloppy"
    assert not torch.allclose(out, ref, atol=1e-3)  # the bug the guard exists for
    monkeypatch.undo()
    with guarded("first"):  # first: nothing after the first call of a decision
        args = window_call(32)[0]
        ad.sdpa(*args)
        monkeypatch.setattr(guard, "check", lambda *a, **k: pytest.fail("checked after the first call"))
        ad.sdpa(*args)  # the fast path
        ad.sdpa(*window_call(32)[0])  # other tensors, the same Problem
        dispatch.fast_calls.clear()
        ad.sdpa(*args)  # the full path, the same decision


def test_sample_mode_immediate_catches_a_later_call_on_the_fast_path():
    drifting = Drifting()
    ad.register_backend(drifting, priority="first")
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    ref = naive_attention(q.double(), k.double(), v.double()).float()
    with guarded("sample", "drifting", sample=1.0, sample_verdict="immediate"):
        torch.testing.assert_close(ad.sdpa(q, k, v), ref)  # first call: checked, right
        assert ad.last_decision().backend == "drifting"
        torch.testing.assert_close(ad.sdpa(q, k, v), ref)  # fast path, sampled: caught, re-run
        assert ad.last_decision().backend != "drifting"
        assert "drifting" in guard.quarantined()
    drifting.runs = 0
    ad.clear_cache()
    with guarded("first", "drifting"):  # first: later calls are not checked
        ad.sdpa(q, k, v)
        assert not torch.allclose(ad.sdpa(q, k, v), ref, atol=0.1)


def test_the_guard_does_not_move_the_users_random_stream():
    ad.register_backend(Sloppy(), priority="first")
    calls = [window_call(sk) for sk in (32, 128, 128)]
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with guarded("sample", sample=1.0):
        for args, kw, _ in calls:  # checked, quarantined and re-run, then sampled on the fast path
            ad.sdpa(*args, **kw)
    assert "sloppy" in guard.quarantined()
    assert torch.equal(torch.rand(4), expected)


# ---- check(): no false alarm on right answers, an alarm on a wrong row ------------------------

CASES = [
    Case(),
    Case(heads_q=8, heads_kv=2, seqlen_q=5, seqlen_k=9, causal="bottom_right"),
    Case(seqlen_q=9, seqlen_k=5, causal="top_left", window=(2, 1)),
    Case(seqlen_q=7, seqlen_k=12, window=(3, -1)),
    Case(mask="bool", mask_shape="keys", seqlen_q=6, seqlen_k=6),  # fully masked rows likely
    Case(mask="float", mask_shape="heads", head_dim=7, head_dim_v=5),
    Case(varlen=(3, 0, 5, 1), extra_k=(2, 4, 0, 0), heads_q=4, heads_kv=2, causal="bottom_right"),
    Case(varlen=(4, 2), extra_k=(0, 3), mask="float", window=(1, 1)),
    Case(batch=1, heads_q=1, seqlen_q=1, seqlen_k=1, head_dim=1),
    Case(dtype=torch.float16, seqlen_k=40, causal="top_left", seqlen_q=40),
    Case(dtype=torch.bfloat16, mask="float", mask_dtype=torch.float32),
    Case(dtype=torch.float64, heads_kv=1, heads_q=4),
]


def guarded_call(case):
    q, k, v, mask, sdpa_kw, _ = make_inputs(case, requires_grad=False)
    call = normalize_call(q, k, v, mask, **sdpa_kw)
    out = math_attention(call.query, call.key, call.value, **call.options)
    return call, out


@pytest.mark.parametrize("case", CASES, ids=str)
def test_check_passes_right_rows_and_catches_one_wrong_entry(case):
    call, out = guarded_call(case)
    args = (call.problem, call.query, call.key, call.value, call.options)
    assert guard.check(*args, out, rows=4096) is None  # every row: the row mapping is right
    if out.numel() == 0:
        return
    bad = out.clone()
    flat = bad.view(-1)
    flat[torch.randint(flat.numel(), ())] += 0.05 if case.dtype != torch.bfloat16 else 0.2
    found = guard.check(*args, bad, rows=4096)
    assert found is not None and found.error > found.allowed
    nan = out.clone()
    nan.view(-1)[0] = float("nan")
    assert guard.check(*args, nan, rows=4096) is not None


def test_check_passes_the_cpu_backends_in_half_precision():
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(2, 4, 64, 64, dtype=dtype) * 3 for _ in range(3))
        call = normalize_call(q, k, v, is_causal=True)
        for name in ("torch_cpu", "math"):
            out = ad.get_backend(name).run(call.query, call.key, call.value, **call.options)
            assert guard.check(call.problem, call.query, call.key, call.value, call.options, out, rows=512) is None


def test_calls_it_cannot_judge_are_named():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    call = normalize_call(q, k, v, dropout_p=0.3)
    assert not guard.judgeable(call.problem, call.options)
    assert "torch_cpu" in guard.unjudged(call.problem, call.options, ad.get_backend("torch_cpu"))
    assert guard.judgeable(call.problem, dict(call.options, dropout_p=0.0, softcap=30.0))
    assert "'paged'" in guard.unjudged(call.problem, dict(call.options, dropout_p=0.0, paged=True))


def test_guard_config_is_validated():
    for bad in ({"mode": "always"}, {"sample": 1.5}, {"rows": 0}, {"stict": True}, {"sample_verdict": "later"}):
        with pytest.raises(ad.ConfigError, match="guard"):
            with ad.use_config({"guard": bad}):
                pass


def test_quarantine_kind_reads_no_sequence_length():
    """A quarantine reason leaves a decision's seqlen_k span provable (dispatch.seqlen_k_span)."""
    ad.register_backend(Sloppy(), priority="first")
    q = torch.randn(1, 2, 1, 16)
    k = torch.randn(1, 2, 40, 16)
    p = normalize_call(q, k, k, window=(8, 0)).problem
    guard.quarantine("sloppy", p, "quarantined: test")
    d = dispatch.decide(p)
    assert d.rejected["sloppy"] == ["quarantined: test"]
    assert dispatch.seqlen_k_span(d) is not None


class WrongBackward(ad.Backend):
    """Right forward, dq 1.5x too large (the value of query kept, its gradient scaled)."""

    name = "wrong_backward"

    def run(self, query, key, value, **options):
        query = query + (query * 0.5 - (query * 0.5).detach())
        return math_attention(query, key, value, **options)


def test_strict_mode_checks_the_backward():
    ad.register_backend(WrongBackward(), priority="first")
    q, k, v = (torch.randn(2, 4, 12, 16, requires_grad=True) for _ in range(3))
    with guarded("first", "wrong_backward"):
        ad.sdpa(q, k, v, is_causal=True)  # the forward is right: first mode keeps it
        assert ad.last_decision().backend == "wrong_backward"
    with guarded("strict", "wrong_backward"):
        with pytest.raises(guard.GuardError, match=r"'wrong_backward' gives wrong results: dq max error"):
            ad.sdpa(q, k, v, is_causal=True)
        with torch.no_grad():  # no backward asked: nothing to check
            ad.sdpa(q, k, v, is_causal=True)


@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
@pytest.mark.parametrize("case", CASES[:10], ids=str)
def test_strict_mode_passes_right_backwards_and_leaves_the_graph_usable(backend, case):
    q, k, v, mask, sdpa_kw, naive_kw = make_inputs(case)
    with ad.use_config({"guard": {"mode": "strict", "rows": 64}}):
        try:
            out = ad.sdpa(q, k, v, attn_mask=mask, backend=backend, **sdpa_kw)
        except ad.NoBackendError:
            pytest.skip(f"{backend} does not take {case}")
    out.backward(torch.ones_like(out))  # the caller's backward after the guard's own
    assert q.grad is not None and not torch.isnan(q.grad).any()


@pytest.mark.parametrize("case", [CASES[1], CASES[6], CASES[7]], ids=str)
def test_check_in_chunks_of_one_row(monkeypatch, case):
    """Long sequences are checked a few rows at a time (CHUNK_ELEMENTS): every chunk counts."""
    monkeypatch.setattr(guard_rows, "CHUNK_ELEMENTS", 1)
    call, out = guarded_call(case)
    args = (call.problem, call.query, call.key, call.value, call.options)
    assert guard.check(*args, out, rows=4096) is None
    bad = out.clone()
    bad.view(-1)[-1] += 0.05  # the last row: in the last chunk
    assert guard.check(*args, bad, rows=4096) is not None
