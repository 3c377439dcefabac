"""Decode steps and the decision caches (issue 34): sdpa() with a key length growing by one per
call reuses a proven decision (dispatch.seqlen_k_span, fast_key.length_key); a repeated
sdpa_with_kvcache() call skips normalisation and the decision (kv_fast_key.kv_call_key)."""

import dataclasses
import operator
import random

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import api, caches, dispatch, kv_fast_key, kvcache, perf_table
from attention_dispatch.api import normalize_call
from attention_dispatch.backends.math import math_attention
from attention_dispatch.config import current_config
from attention_dispatch.problem import LengthSpan, TracedLength, trace_seqlen_k

CPU_ORDER = ("torch_cpu", "math")  # fast backends for long sequences of calls (triton interprets)


class Custom(ad.Backend):
    """A backend computing through the math reference, counting its runs, with extra reasons
    from ``rule(problem)``."""

    def __init__(self, name, capabilities=None, rule=None):
        self.name = name
        self.capabilities = capabilities or ad.Capabilities()
        self.rule, self.runs = rule, 0

    def check(self, problem):
        return self.rule(problem) if self.rule else []

    def run(self, query, key, value, **options):
        self.runs += 1
        return math_attention(query, key, value, **options)


def decode(sk, b=1, hq=4, hkv=2, d=16, sq=1):
    q = torch.randn(b, hq, sq, d)
    k, v = torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)
    return q, k, v


def span_stats():
    return caches.cache_stats()["dispatch.span_calls"]


def exact_decision(*args, **kwargs):
    """decide() on the call's own Problem, from empty caches (what the full path decides)."""
    saved = dict(dispatch._cache)
    dispatch._cache.clear()
    try:
        return dispatch.decide(normalize_call(*args, **kwargs).problem)
    finally:
        dispatch._cache.clear()
        dispatch._cache.update(saved)


def assert_same_decision(reused, exact):
    """Field for field, but the Problem's seqlen_k and the span note."""
    assert reused.problem == dataclasses.replace(exact.problem, seqlen_k=reused.problem.seqlen_k)
    assert dataclasses.replace(reused, problem=exact.problem, seqlen_k_span=None) == exact


def count_full_paths(monkeypatch):
    calls = []
    real = api.normalize_call

    def counting(*args, **kwargs):
        calls.append(args[1].shape[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "normalize_call", counting)
    return calls


# ---- sdpa(): the key length growing by one per call ----------------------------------------


def test_growing_key_length_hits_after_two_calls_per_power_of_two(monkeypatch):
    full = count_full_paths(monkeypatch)
    lengths = range(500, 561)  # crosses 512
    with ad.use_backends(*CPU_ORDER):
        decisions = []
        for sk in lengths:
            q, k, v = decode(sk)
            out = ad.sdpa(q, k, v, enable_gqa=True)
            torch.testing.assert_close(out, math_attention(q, k, v, enable_gqa=True, scale=0.25), atol=1e-5, rtol=1e-5)
            decisions.append(ad.last_decision())
        # the first call of each power of two marks its signature, the second proves the span
        assert full == [500, 501, 512, 513]
        assert span_stats() == {"hits": len(lengths) - 4, "proofs": 2, "unprovable": 0}
        for sk, d in zip(lengths, decisions):
            assert d.backend == "torch_cpu"
            if sk not in (500, 501, 512, 513):
                assert d.seqlen_k_span == ((256, 511) if sk < 512 else (512, 1023))
                assert d.seqlen_k_span[0] <= sk <= d.seqlen_k_span[1]
                assert_same_decision(d, exact_decision(*decode(sk), enable_gqa=True))
        assert "the same decision for every Sk in 512..1023" in str(decisions[-1])


def test_hits_equal_the_full_path_under_the_default_order():
    """With the default order (triton first under the interpreter): few calls, each checked."""
    for sk in (509, 510, 511):
        q, k, v = decode(sk, d=32)
        out = ad.sdpa(q, k, v, enable_gqa=True)
        torch.testing.assert_close(out, math_attention(q, k, v, enable_gqa=True, scale=32**-0.5), atol=1e-4, rtol=1e-4)
        d = ad.last_decision()
        assert_same_decision(d, exact_decision(q, k, v, enable_gqa=True))
    assert span_stats()["hits"] == 1 and d.seqlen_k_span is not None


def test_the_exact_key_still_serves_repeated_calls(monkeypatch):
    full = count_full_paths(monkeypatch)
    q, k, v = decode(700)
    with ad.use_backends(*CPU_ORDER):
        for _ in range(3):
            ad.sdpa(q, k, v, enable_gqa=True)
    assert full == [700] and span_stats()["hits"] == 0


@pytest.mark.parametrize("limit", [520, 600])
def test_a_declared_max_seqlen_ends_the_span(limit):
    """A custom backend first, with Capabilities(max_seqlen=limit): the span stops at the limit
    and no call past it reuses the decision."""
    capped = Custom("capped", ad.Capabilities(max_seqlen=limit))
    ad.register_backend(capped, priority="first")
    with ad.use_backends("capped", *CPU_ORDER):
        chosen = {}
        for sk in range(505, limit + 20):
            q, k, v = decode(sk)
            out = ad.sdpa(q, k, v, enable_gqa=True)
            torch.testing.assert_close(out, math_attention(q, k, v, enable_gqa=True, scale=0.25), atol=1e-5, rtol=1e-5)
            chosen[sk] = ad.last_decision()
    for sk, d in chosen.items():
        assert d.backend == ("capped" if sk <= limit else "torch_cpu"), sk
        if d.seqlen_k_span is not None:
            assert d.seqlen_k_span[0] <= sk <= d.seqlen_k_span[1]
            assert d.seqlen_k_span[1] <= limit or d.seqlen_k_span[0] > limit
    assert capped.runs == limit - 505 + 1
    assert chosen[limit].seqlen_k_span == (512, limit)  # proven at 513, up to the limit
    assert span_stats()["hits"] >= limit - 514


def test_a_check_on_a_multiple_of_the_key_length():
    """A custom check (not data): eligible only where Sk is a multiple of 64.  Spans stop
    before each multiple; the multiples themselves are decided on their own."""
    mult = Custom("mult", rule=lambda p: [] if p.seqlen_k % 64 == 0 else ["Sk is not a multiple of 64"])
    ad.register_backend(mult, priority="first")
    with ad.use_backends("mult", *CPU_ORDER):
        for sk in range(570, 715):
            ad.sdpa(*decode(sk), enable_gqa=True)
            d = ad.last_decision()
            assert d.backend == ("mult" if sk % 64 == 0 else "torch_cpu"), sk
            if d.seqlen_k_span is not None:
                lo, hi = d.seqlen_k_span
                assert lo <= sk <= hi and (hi // 64 == (lo - 1) // 64), d.seqlen_k_span
    assert mult.runs == 3  # 576, 640 and 704
    assert span_stats()["hits"] > 100


def test_a_check_memoising_on_the_problem_is_never_reused_and_never_sees_the_probe():
    seen = {}

    def memo(p):
        if p not in seen:  # hashing the probe raises: the proof fails, nothing is stored
            seen[p] = [] if p.seqlen_k < 530 else ["too long"]
        return seen[p]

    def swallowing(p):  # the probe's error swallowed: it still proves nothing
        try:
            return memo(p)
        except TypeError:
            return []

    for rule in (memo, swallowing):
        ad.clear_cache()
        seen.clear()
        ad.register_backend(Custom("memo", rule=rule), priority="first", replace="memo" in ad.list_backends())
        with ad.use_backends("memo", *CPU_ORDER):
            for sk in range(515, 545):
                ad.sdpa(*decode(sk), enable_gqa=True)
                assert ad.last_decision().backend == ("memo" if sk < 530 else "torch_cpu")
        assert span_stats() == {"hits": 0, "proofs": 0, "unprovable": 1}
        assert all(type(p.seqlen_k) is int for p in seen)


def test_a_reason_naming_the_key_length_is_not_reused():
    """A reason whose text holds Sk would be wrong for any other Sk: no span."""
    ad.register_backend(Custom("named", rule=lambda p: [f"Sk={p.seqlen_k} not supported"]), priority="first")
    with ad.use_backends("named", *CPU_ORDER):
        for sk in range(515, 525):
            ad.sdpa(*decode(sk), enable_gqa=True)
            assert ad.last_decision().rejected["named"] == [f"Sk={sk} not supported"]
    assert span_stats()["hits"] == 0


def test_causal_alignment_and_windows_are_decided_per_length():
    """Top-left causal with a backend that aligns bottom-right only: its reason names Sq and Sk
    (no span); Sq == Sk with a window makes both alignments one (a span of one length)."""
    bottom = Custom("bottom", ad.Capabilities(causal_kinds=frozenset({ad.CausalKind.BOTTOM_RIGHT})))
    ad.register_backend(bottom, priority="first")
    with ad.use_backends("bottom", *CPU_ORDER):
        for sk in range(514, 520):
            ad.sdpa(*decode(sk), enable_gqa=True, is_causal=True)
            assert ad.last_decision().backend == "torch_cpu"
        for sk in range(514, 530):  # bottom-right causal: eligible everywhere, reused
            ad.sdpa(*decode(sk), enable_gqa=True, causal="bottom_right")
            assert ad.last_decision().backend == "bottom"
        assert ad.last_decision().seqlen_k_span == (512, 1023)
    top = Custom("top", ad.Capabilities(causal_kinds=frozenset({ad.CausalKind.TOP_LEFT})))
    ad.register_backend(top, priority="first")
    with ad.use_backends("top", *CPU_ORDER):  # a window aligns bottom-right: the same as top-left at Sq == Sk only
        problem = normalize_call(*decode(600, sq=600), window=(8, 0), enable_gqa=True).problem
        decision = dispatch.decide(problem)
        assert decision.backend == "top" and dispatch.seqlen_k_span(decision) == (600, 600)
        assert dispatch.seqlen_k_span(dispatch.decide(dataclasses.replace(problem, seqlen_k=601))) is None


def test_spans_proven_against_the_exact_decision_for_every_length():
    """Brute force: every length of each proven span decides the same (default order, and with
    custom backends whose reasons have thresholds, multiples and equalities)."""
    ad.register_backend(Custom("cap", ad.Capabilities(max_seqlen=700)), priority="first")
    ad.register_backend(Custom("odd", rule=lambda p: ["Sk odd"] if p.seqlen_k % 2 else []), priority=1)
    ad.register_backend(Custom("eq", rule=lambda p: [] if p.seqlen_k != 900 else ["900"]), priority=2)
    ad.register_backend(Custom("band", rule=lambda p: ["mid"] if 3 * p.seqlen_k - 7 >= 2500 else []), priority=3)
    problems = [normalize_call(*decode(sk), enable_gqa=True).problem for sk in (5, 300, 650, 701, 899, 901, 1500)]
    problems += [normalize_call(*decode(sk, sq=4), causal="bottom_right", enable_gqa=True).problem for sk in (40, 77)]
    for order in (None, ("cap", "odd", "eq", "band", *CPU_ORDER), ("band", "eq", "math")):
        for problem in problems:
            if order is None:
                decision, span = dispatch.decide(problem), dispatch.seqlen_k_span(dispatch.decide(problem))
            else:
                with ad.use_backends(*order):
                    decision = dispatch.decide(problem)
                    span = dispatch.seqlen_k_span(decision)
            if span is None:
                continue
            lo, hi = span
            assert lo <= problem.seqlen_k <= hi
            for sk in range(lo, hi + 1):
                other = dataclasses.replace(problem, seqlen_k=sk)
                if order is None:
                    exact = dispatch._decision(other, None, current_config())
                else:
                    with ad.use_backends(*order):
                        exact = dispatch._decision(other, None, current_config())
                assert dataclasses.replace(exact, problem=problem) == decision, (order, problem.seqlen_k, sk)


def test_the_performance_tables_bucket_holds_the_span():
    """policy='auto' picks by perf_table.bucket_key (Sk rounded up to a power of two): the proof
    sees that rounding and keeps the span inside the table's bucket."""
    problem = normalize_call(*decode(600), enable_gqa=True).problem
    probe, span = trace_seqlen_k(problem, 0, 1 << 20)
    assert perf_table.bucket_key(probe) == perf_table.bucket_key(problem)
    assert (span.lo, span.hi, span.opaque) == (513, 1024, False)


def test_a_failure_at_run_time_drops_the_span_and_a_fallback_is_never_reused():
    class Flaky(Custom):
        def run(self, query, key, value, **options):
            if key.shape[2] >= 530:
                raise RuntimeError("flaky")
            return super().run(query, key, value, **options)

    ad.register_backend(Flaky("flaky"), priority="first")
    with ad.use_backends("flaky", *CPU_ORDER):
        for sk in range(515, 530):
            ad.sdpa(*decode(sk), enable_gqa=True)
        hits = span_stats()["hits"]
        assert hits == 13 and ad.last_decision().backend == "flaky"
        with pytest.raises(ad.BackendRunError, match="flaky"):
            ad.sdpa(*decode(530), enable_gqa=True)  # the hit fails: the full path raises, per config
        assert not any(entries for entries, _ in dispatch.span_calls.values())  # dropped
        with ad.use_config({"dispatch": {"on_error": "fallback"}}):
            for sk in range(531, 540):
                ad.sdpa(*decode(sk), enable_gqa=True)
                d = ad.last_decision()
                assert d.backend == "torch_cpu" and "flaky" in d.failures and d.seqlen_k_span is None
    assert span_stats()["hits"] == hits


# ---- the traced key length -------------------------------------------------------------------


def test_traced_length_spans_are_exact_by_brute_force():
    rng = random.Random(0)
    ops = [operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge]
    for _ in range(3000):
        v = rng.randint(0, 300)
        a, b, c = rng.choice([1, 2, -1, 3]), rng.randint(-50, 50), rng.randint(-100, 400)
        m, op = rng.choice([1, 2, 7, 16, -5, 64]), rng.choice(ops)
        kind = rng.choice(["cmp", "mod", "floordiv", "bit_length", "abs", "bool", "float", "max"])

        def f(x):
            e = a * x + b
            return {
                "cmp": lambda: op(e, c),
                "mod": lambda: op(e % m, c % 17),
                "floordiv": lambda: op(e // m, c // 10),
                "bit_length": lambda: e.bit_length(),
                "abs": lambda: op(abs(e), c),
                "bool": lambda: bool(e - c),
                "float": lambda: op(e, c + 0.5),
                "max": lambda: op(max(e, c), c + 3),
            }[kind]()

        span = LengthSpan(v, 0, 400)
        result = f(TracedLength(span))
        assert result == f(v) and not span.opaque
        assert all(f(s) == result for s in range(span.lo, span.hi + 1)), (kind, v, span.lo, span.hi)
        if kind == "cmp":  # as wide as it can be
            assert all(f(s) != result for s in (span.lo - 1, span.hi + 1) if 0 <= s <= 400)


def test_traced_length_collapses_on_uses_it_cannot_follow():
    for use in (
        int,
        float,
        str,
        repr,
        lambda t: f"{t}",
        lambda t: torch.empty(t).shape,
        lambda t: range(t),
        lambda t: t / 2,
    ):
        span = LengthSpan(77, 0, 100)
        use(TracedLength(span))
        assert span.opaque and span.lo == span.hi == 77
    with pytest.raises(TypeError):
        hash(TracedLength(LengthSpan(77, 0, 100)))


# ---- sdpa_with_kvcache(): repeated decode steps ------------------------------------------------


def kv_step(b=2, hq=4, hkv=2, d=16, capacity=64, paged=False):
    q = torch.randn(b, hq, 1, d)
    if paged:
        page = 16
        k_cache, v_cache = (
            torch.randn(2 * b * capacity // page, page, hkv, d),
            torch.randn(2 * b * capacity // page, page, hkv, d),
        )
        table = torch.randperm(k_cache.shape[0])[: b * capacity // page].view(b, -1).to(torch.int32)
        return q, k_cache, v_cache, table
    return q, torch.randn(b, hkv, capacity, d), torch.randn(b, hkv, capacity, d), None


def count_kv_full_paths(monkeypatch):
    calls = []
    real = kvcache.normalize_kvcache

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kvcache, "normalize_kvcache", counting)
    return calls


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("backend", [None, "math"])
def test_kvcache_steps_hit_and_match_the_reference(monkeypatch, paged, backend):
    q, k_cache, v_cache, table = kv_step(paged=paged)
    k_new, v_new = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    math = ad.get_backend("math")
    full = count_kv_full_paths(monkeypatch)
    with ad.use_backends(*CPU_ORDER):
        for step in range(6):
            lens = torch.tensor([10 + step, 3 + 2 * step], dtype=torch.int32)
            expect_k, expect_v = k_cache.clone(), v_cache.clone()
            out = ad.sdpa_with_kvcache(
                q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new, block_table=table, backend=backend
            )
            if step == 0:
                first = ad.last_decision()
            assert ad.last_decision() is first
            expect = math.run_kvcache(
                q,
                expect_k,
                expect_v,
                lens,
                k_new=k_new,
                v_new=v_new,
                block_table=table,
                causal=None,
                window=None,
                scale=0.25,
            )
            torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
            assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)  # appended in place
    assert len(full) == 1  # then hits


def test_kvcache_hits_still_check_values_on_the_cpu():
    q, k_cache, v_cache, _ = kv_step(capacity=32)
    lens = torch.tensor([5, 6], dtype=torch.int32)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens)
    assert len([key for key in kv_fast_key.kv_calls if key is not kv_fast_key.RECENT]) == 1  # one signature
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\]=33 exceeds the cache's capacity 32"):
        ad.sdpa_with_kvcache(q, k_cache, v_cache, torch.tensor([5, 33], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=-1 is negative"):
        ad.sdpa_with_kvcache(q, k_cache, v_cache, torch.tensor([-1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=32 \+ 1 new keys"):
        k_new = torch.randn(2, 2, 1, 16)
        for n in (3, 32):  # the first call makes the signature, the second hits
            ad.sdpa_with_kvcache(q, k_cache, v_cache, torch.tensor([n, 0], dtype=torch.int32), k_new=k_new, v_new=k_new)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, 7)  # flash-attn's int form
    ad.sdpa_with_kvcache(q, k_cache, v_cache, 8)
    with pytest.raises(ValueError, match=r"cache_seqlens=33 is outside the cache's capacity \[0, 32\]"):
        ad.sdpa_with_kvcache(q, k_cache, v_cache, 33)


def test_kvcache_hits_check_the_block_table():
    q, k_cache, v_cache, table = kv_step(paged=True, capacity=32)
    lens = torch.tensor([20, 3], dtype=torch.int32)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, block_table=table)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, block_table=table)
    bad = table.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]=8 is out of range \[0, 8\)"):
        ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, block_table=bad)


def test_kvcache_signature_changes_take_the_full_path(monkeypatch):
    q, k_cache, v_cache, _ = kv_step()
    full = count_kv_full_paths(monkeypatch)
    lens = torch.tensor([5, 6], dtype=torch.int32)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, causal=True)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, window=(4, 0))
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, scale=0.5)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, backend="math")
    with ad.use_backends("math"):
        ad.sdpa_with_kvcache(q, k_cache, v_cache, lens)
    assert len(full) == 6
    with pytest.raises(TypeError, match="causal=1 is not allowed"):
        ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, causal=1)  # never a hit of causal=True
    for _ in range(3):
        ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, causal=True)
    assert len(full) == 7 and ad.last_decision().problem.causal is ad.CausalKind.BOTTOM_RIGHT


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_hit_passes_the_backend_the_full_paths_options(monkeypatch, paged):
    q, k_cache, v_cache, table = kv_step(paged=paged)
    k_new, v_new = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    math = ad.get_backend("math")
    seen = []
    real = type(math).run_kvcache

    def spy(self, *args, **options):
        seen.append(options)
        return real(self, *args, **options)

    monkeypatch.setattr(type(math), "run_kvcache", spy)
    full = count_kv_full_paths(monkeypatch)
    kwargs = dict(k_new=k_new, v_new=v_new, block_table=table, causal=True, window=(3, 0), scale=0.3)
    for step in range(2):
        lens = torch.tensor([10 + step, 3 + step], dtype=torch.int32)
        ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, backend="math", **kwargs)
    assert len(full) == 1 and len(seen) == 2  # the second call was a hit
    assert seen[0].keys() == seen[1].keys()
    for name in seen[0]:
        assert seen[1][name] is seen[0][name] or seen[1][name] == seen[0][name], name


def test_kvcache_inputs_that_require_grad_give_no_graph_on_a_hit():
    q, k_cache, v_cache, _ = kv_step()
    q.requires_grad_()
    lens = torch.tensor([5, 6], dtype=torch.int32)
    for _ in range(2):
        out = ad.sdpa_with_kvcache(q, k_cache, v_cache, lens)
        assert not out.requires_grad


# ---- benchmarks/overhead.py's decode rows ------------------------------------------------------


@pytest.mark.bench_tools
def test_overhead_decode_rows_run(monkeypatch, capsys, tmp_path):
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"
    spec = importlib.util.spec_from_file_location("_bench_overhead_decode", path)
    overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overhead)
    monkeypatch.setenv("ATTENTION_DISPATCH_BACKENDS", ",".join(CPU_ORDER))
    out = tmp_path / "decode.json"
    args = ["--device", "cpu", "--decode-only", "--decode-n", "3", "--repeat", "3", "--decode-sk", "16"]
    overhead.main(args + ["--decode-heads", "4/2", "--decode-dim", "16", "--json", str(out)])
    rows = json.loads(out.read_text())["decode"]
    assert len(rows) == 3 and all(r["backend"] == "torch_cpu" and r["median_us"] > 0 for r in rows.values())
    assert "decode sdpa(), Sk 16+ growing by 1" in capsys.readouterr().out
    probes = json.loads(out.read_text())["decode_new_length"]  # every eligible backend, new key lengths
    assert set(probes) == {*CPU_ORDER, "F.sdpa"} and all(p["calls"] > 0 and p["median_ms"] > 0 for p in probes.values())
    assert span_stats()["hits"] > 0
