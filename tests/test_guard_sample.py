"""The numerics guard's sampled calls (issue 38): with sample_verdict "deferred" (default) a
sampled call's check is queued without a host sync and its verdict applied on a later call
(or at guard_flush()); "immediate" judges before the call returns and re-runs it."""

import collections
import contextlib
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attention_dispatch as ad
from attention_dispatch.api import normalize_call
from attention_dispatch.backends.math import math_attention
from attention_dispatch.policy import guard, guard_graph, guard_rows, guard_triton

from cases import Case, make_inputs
from naive import naive_attention
from test_guard import Drifting, guarded


def drifting_setup():
    ad.register_backend(Drifting(), priority="first")
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    return (q, k, v), naive_attention(q.double(), k.double(), v.double()).float()


def test_deferred_verdict_quarantines_on_a_later_call_and_logs_it(caplog):
    (q, k, v), ref = drifting_setup()
    with guarded("sample", "drifting", sample=1.0), caplog.at_level(logging.ERROR, "attention_dispatch"):
        torch.testing.assert_close(ad.sdpa(q, k, v), ref)  # first call: checked at once, right
        wrong = ad.sdpa(q, k, v)  # fast path, sampled: its verdict is deferred, its output returned
        assert not torch.allclose(wrong, ref, atol=0.1)
        assert ad.last_decision().backend == "drifting" and guard.quarantined() == {}
        torch.testing.assert_close(ad.sdpa(q, k, v), ref)  # applies the verdict, then the next candidate
        assert ad.last_decision().backend != "drifting"
        assert "sampled call" in guard.quarantined()["drifting"][0]
        notes = " ".join(ad.explain(q, k, v).notes)
        assert "drifting" in " ".join(ad.explain(q, k, v).rejected) or "drifting" in notes
        assert "sample_verdict='deferred'" in notes
    logged = [r.getMessage() for r in caplog.records if "numerics guard" in r.getMessage()]
    assert len(logged) == 1 and "'drifting'" in logged[0] and "already returned" in logged[0], logged


def test_guard_flush_applies_pending_verdicts():
    (q, k, v), _ = drifting_setup()
    with guarded("sample", "drifting", sample=1.0):
        ad.sdpa(q, k, v)
        ad.sdpa(q, k, v)  # wrong, deferred
        reasons = ad.guard_flush()
        assert len(reasons) == 1 and reasons[0].startswith("drifting quarantined: max error")
        assert "drifting" in guard.quarantined() and ad.guard_flush() == []


def test_deferred_verdict_passes_a_right_backend():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with guarded("sample", "torch_cpu", sample=1.0):
        for _ in range(4):
            ad.sdpa(q, k, v)
        assert ad.guard_flush() == [] and guard.quarantined() == {}


def test_clear_cache_drops_pending_verdicts():
    (q, k, v), _ = drifting_setup()
    with guarded("sample", "drifting", sample=1.0):
        ad.sdpa(q, k, v)
        ad.sdpa(q, k, v)
    ad.clear_cache()
    assert ad.guard_flush() == [] and guard.quarantined() == {}


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def no_host_reads():
    """Every way of reading a tensor on the host (a sync on a device) raises inside."""

    def forbid(name):
        def read(*args, **kwargs):
            raise AssertionError(f"host read: Tensor.{name}")

        return read

    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, forbid(name))
        patch.setattr(torch, "equal", forbid("equal"))
        yield


SYNC_CASES = [
    Case(causal="bottom_right", seqlen_q=5, seqlen_k=9, heads_q=4, heads_kv=2),
    Case(mask="bool", mask_shape="keys", seqlen_q=6, seqlen_k=6),
    Case(varlen=(3, 0, 5, 1), extra_k=(2, 4, 0, 0), mask="float", window=(1, 1), return_lse=True),
    Case(alibi="batch", sinks="fixed", softcap=5.0, return_lse=True, causal="top_left"),
]


@pytest.mark.parametrize("case", SYNC_CASES, ids=str)
def test_the_deferred_measurement_reads_nothing_on_the_host(case):
    q, k, v, mask, sdpa_kw, _ = make_inputs(case, requires_grad=False)
    call = normalize_call(q, k, v, mask, **sdpa_kw)
    out = math_attention(call.query, call.key, call.value, **call.options)
    args = (call.problem, call.query, call.key, call.value, call.options)
    with no_host_reads():
        measured = guard.payload(*args, out, rows=4096)
    found = guard._read(measured.tolist(), case.dtype, 2.0, bool(case.return_lse))
    assert found is None and guard.check(*args, out, rows=4096) is None
    with no_host_reads(), pytest.raises(AssertionError, match="host read"):
        guard.check(*args, out, rows=4096)  # the immediate verdict reads it: the fixture can fail


def test_a_sampled_call_reads_nothing_on_the_host():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    call = normalize_call(q, k, v)
    out = math_attention(call.query, call.key, call.value, **call.options)
    decision = ad.explain(q, k, v, backend="math")
    for verdict in ("deferred", "immediate"):
        with ad.use_config({"guard": {"mode": "sample", "sample": 1.0, "sample_verdict": verdict}}) as cfg:
            runner = guard.sampled(lambda *args, **kwargs: out, decision, call.options, cfg.guard)
            with no_host_reads():
                if verdict == "deferred":
                    assert runner(q, k, v) is out
                else:  # the immediate verdict reads the check on the host: the patch would see a sync
                    with pytest.raises(AssertionError, match="host read"):
                        runner(q, k, v)
        assert len(guard._pending) == (verdict == "deferred")
        assert ad.guard_flush() == []  # nothing left pending for the next verdict's run


class DeviceOps(TorchDispatchMode):
    """Counts the aten ops a check runs on the tensors' device: views (no kernel) and the host's
    own (the picks' host tensor, a Python scalar's) left out; on a GPU each is a launch."""

    HOST = frozenset({"lift_fresh", "scalar_tensor", "_pin_memory", "is_pinned", "empty"})  # empty: no kernel

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in self.HOST:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# (case, most device ops of one check, 8 rows): the first is benchmarks/guard_overhead.py's row
# (bf16 causal d128; on a GPU one more: the picks' copy to the device); 82 before issue 38's rework
# (e768bbd^), 38 before the packed float64 copy, one-op float64 softmax and no stack (this limit)
OP_LIMITS = [
    (Case(causal="bottom_right", dtype=torch.bfloat16, seqlen_q=64, seqlen_k=64, head_dim=128), 29),
    (Case(mask="bool", mask_shape="keys", window=(3, 2), heads_q=4, heads_kv=2, return_lse=True), 53),
    (Case(alibi="batch", sinks="fixed", softcap=5.0, return_lse=True, causal="top_left"), 69),
    (Case(varlen=(3, 0, 5, 1), extra_k=(2, 4, 0, 0), mask="float", window=(1, 1), return_lse=True), 97),
]


@pytest.mark.parametrize(("case", "limit"), OP_LIMITS, ids=[str(c) for c, _ in OP_LIMITS])
def test_sampled_check_launches_at_most_N_ops(case, limit):
    """A sampled check's cost is its launches (~1% of calls, each a few microseconds): counted
    here so that it cannot creep up; the check still catches a wrong entry."""
    q, k, v, mask, sdpa_kw, _ = make_inputs(case, requires_grad=False)
    call = normalize_call(q, k, v, mask, **sdpa_kw)
    out = math_attention(call.query, call.key, call.value, **call.options)
    args = (call.problem, call.query, call.key, call.value, call.options)
    guard.payload(*args, out)  # made once: the positions kept on the device
    with DeviceOps() as counted:
        measured = guard.payload(*args, out)
    total = sum(counted.ops.values())
    assert 0 < total <= limit, dict(counted.ops.most_common())
    assert guard._read(measured.tolist(), case.dtype, 2.0, bool(case.return_lse)) is None
    bad = (out[0] if case.return_lse else out).clone()
    bad.view(-1)[::7] += 0.5  # every 7th entry: some in any 8 rows
    assert guard.check(*args, (bad, out[1]) if case.return_lse else bad) is not None


EMPTY_ROW_CASES = [
    Case(causal="bottom_right", seqlen_q=9, seqlen_k=4),
    Case(mask="bool", seqlen_q=6, seqlen_k=6, dtype=torch.bfloat16),
    Case(window=(1, 0), causal="bottom_right", seqlen_q=12, seqlen_k=3, dtype=torch.float16),
]


@pytest.mark.parametrize("case", EMPTY_ROW_CASES, ids=str)
def test_rows_without_keys_are_judged_through_the_one_op_softmax(case):
    """The float64 reference without lse is one softmax (NaN in a row without keys, made 0):
    math's zeros there pass, NaN or any other value there is caught."""
    q, k, v, mask, sdpa_kw, _ = make_inputs(case, requires_grad=False)
    if mask is not None:
        mask = mask.clone()
        mask[..., 0, :] = False  # query row 0 sees no key
    call = normalize_call(q, k, v, mask, **sdpa_kw)
    out = math_attention(call.query, call.key, call.value, **call.options)
    args = (call.problem, call.query, call.key, call.value, call.options)
    empty = out.abs().sum(-1) == 0
    assert empty.any() and guard.check(*args, out, rows=4096) is None
    for wrong in (float("nan"), 0.5):
        bad = out.clone()
        bad[empty] = wrong
        assert guard.check(*args, bad, rows=4096) is not None, wrong


def test_picks_spread_over_batch_and_heads():
    """The sampled rows are random across batch, heads and rows (and the kv head follows GQA)."""
    q, k = torch.empty(3, 4, 5, 8), torch.empty(3, 2, 6, 8)
    options = dict(cu_seqlens_q=None, causal=None, window=None)
    seen = set()
    for _ in range(200):
        b, h, i, kv, diag, _, _ = guard._picks(q, k, options, 8).tolist()
        assert kv == [x // 2 for x in h] and diag == [r + 1 for r in i]  # bottom-right: Sk - Sq = 1
        seen.update(zip(b, h, i))
    assert len(seen) == 3 * 4 * 5


def test_first_mode_checks_nothing_after_the_first_call(monkeypatch):
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    measured = []
    monkeypatch.setattr(guard, "payload", lambda *a, **kw: measured.append(1))
    with guarded("first", "torch_cpu"):
        for _ in range(5):
            ad.sdpa(q, k, v)
    assert measured == [1]


def test_sample_verdict_is_validated_and_named_in_explain():
    with pytest.raises(ad.ConfigError, match="sample_verdict"):
        with ad.use_config({"guard": {"mode": "sample", "sample_verdict": "later"}}):
            pass
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    for verdict in ("deferred", "immediate"):
        with ad.use_config({"guard": {"mode": "sample", "sample_verdict": verdict}}):
            assert f"sample_verdict={verdict!r}" in " ".join(ad.explain(q, k, v).notes)
    assert not any("sample_verdict" in n for n in ad.explain(q, k, v).notes)


@pytest.mark.gpu
def test_deferred_on_cuda_syncs_nothing_and_quarantines_later():
    """On the GPU: the sampled call queues its check without a sync (torch's sync debug mode
    raises on one; the immediate verdict is caught by it), and a later call applies the verdict."""
    q, k, v = (torch.randn(2, 4, 200, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = normalize_call(q, k, v, None, 0.0, True)
    out = math_attention(call.query, call.key, call.value, **call.options)
    decision = ad.explain(q, k, v, is_causal=True, backend="math")
    for verdict in ("deferred", "immediate"):
        with ad.use_config({"guard": {"mode": "sample", "sample": 1.0, "sample_verdict": verdict}}) as cfg:
            runner = guard.sampled(lambda *args, **kwargs: out, decision, call.options, cfg.guard)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                if verdict == "deferred":
                    runner(q, k, v)
                else:
                    with pytest.raises(RuntimeError, match="synchroniz"):
                        runner(q, k, v)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert ad.guard_flush() == []
    ad.register_backend(Drifting(), priority="first")
    ref = naive_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), causal="top_left")  # on the CPU
    with guarded("sample", "drifting", sample=1.0):
        ad.sdpa(q, k, v, is_causal=True)
        ad.sdpa(q, k, v, is_causal=True)  # wrong, its verdict deferred
        torch.cuda.synchronize()
        right = ad.sdpa(q, k, v, is_causal=True)  # the verdict is in: quarantined, the next candidate runs
        assert ad.last_decision().backend != "drifting" and "drifting" in guard.quarantined()
        torch.testing.assert_close(right.double().cpu(), ref, atol=2e-2, rtol=0)


GRAPH_CASES = [
    OP_LIMITS[0][0],
    OP_LIMITS[1][0],
    OP_LIMITS[2][0],
    Case(mask="float", dtype=torch.float16, causal="top_left"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GRAPH_CASES, ids=str)
def test_the_cuda_graph_check_matches_the_eager_one_in_a_few_launches(case, monkeypatch):
    """A dense CUDA check replays its signature's graph: the same payload as the eager check for
    the same picks (new picks each time), another layout gets its own graph, at most 10 device
    ops outside the graph, and a wrong entry is caught through it (the one-kernel check off:
    it would take the first case, tests/test_guard_triton.py)."""
    ad.clear_cache()
    monkeypatch.setattr(guard_triton, "supported", lambda *a: False)
    q, k, v, mask, sdpa_kw, _ = make_inputs(case, device="cuda", requires_grad=False)
    for layout in ("contiguous", "strided"):
        if layout == "strided":  # the same values, other strides: another signature
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        call = normalize_call(q, k, v, mask, **sdpa_kw)
        out = math_attention(call.query, call.key, call.value, **call.options)
        args = (call.problem, call.query, call.key, call.value, call.options)
        for step in range(3):  # the capture, then replays
            state = guard._rng.getstate()
            with DeviceOps() as counted:
                graphed = guard.payload(*args, out)
            if step:
                assert sum(counted.ops.values()) <= 10, dict(counted.ops)
            guard._rng.setstate(state)
            with monkeypatch.context() as patch:
                patch.setattr(guard_graph, "capturable", lambda *a: False)
                eager = guard.payload(*args, out)
            count = guard_rows.stat_count(bool(case.return_lse))
            assert torch.equal(graphed[count:], eager[count:])  # the same rows
            torch.testing.assert_close(graphed[:count], eager[:count], rtol=0.05, atol=1e-7)
        bad = (out[0] if case.return_lse else out).clone()  # its strides kept: the same signature
        bad[..., ::7] += 0.5
        assert guard.check(*args, (bad, out[1]) if case.return_lse else bad) is not None
    graphs = [g for g in guard_graph._graphs.values() if g is not None]
    assert len(graphs) == 2, "each layout is captured once"
