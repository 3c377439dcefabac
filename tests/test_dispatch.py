"""Choosing: order sources, forced backends, custom backends, scopes, cache, policies."""

import dataclasses
import logging
import os
import subprocess
import sys
import types
import threading
import warnings

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import dispatch
from attention_dispatch.api import normalize_call
from attention_dispatch.backends.math import math_attention


class Recording(ad.Backend):
    """A custom backend computing through the math reference and counting its runs."""

    def __init__(self, name, capabilities=None, fail=None, available=True, extra=None):
        self.name = name
        self.capabilities = capabilities or ad.Capabilities()
        self.fail, self.available, self.extra, self.runs = fail, available, extra or [], 0

    def is_available(self):
        return self.available

    def unavailable_reason(self):
        return "" if self.available else f"{self.name} library missing"

    def check(self, problem):
        return list(self.extra)

    def run(self, query, key, value, **options):
        self.runs += 1
        if self.fail:
            raise self.fail
        return math_attention(query, key, value, **options)


def qkv(*shape, grad=False, dtype=torch.float32):
    shape = shape or (1, 2, 8, 16)
    return [torch.randn(shape, dtype=dtype, requires_grad=grad) for _ in range(3)]


def problem_of(*args, **kwargs):
    return normalize_call(*args, **kwargs).problem


def test_default_order_and_reasons():
    names = ad.list_backends()
    assert names[0] == "triton" and names[-1] == "math"
    d = ad.explain(*qkv())
    assert d.backend in names
    assert d.source == "default"
    # Everything before the chosen backend is rejected, each with at least one reason.
    for name in names[: names.index(d.backend)]:
        assert d.rejected[name] and all(isinstance(r, str) and r for r in d.rejected[name])
    text = str(d)
    assert d.backend in text and "chosen" in text and "problem:" in text


def test_custom_backend_first_class_and_priority():
    mine = Recording("mine")
    ad.register_backend(mine, priority="first")
    assert ad.list_backends()[0] == "mine"
    out = ad.sdpa(*qkv())
    assert mine.runs == 1 and ad.last_decision().backend == "mine"
    assert out.shape == (1, 2, 8, 16)
    ad.unregister_backend("mine")
    assert "mine" not in ad.list_backends()
    ad.register_backend(Recording("late"))  # default: just before math
    assert ad.list_backends()[-2:] == ["late", "math"]
    ad.register_backend(Recording("at2"), priority=2)
    assert ad.list_backends()[2] == "at2"


def test_register_errors():
    with pytest.raises(TypeError, match="Backend instance"):
        ad.register_backend(object())
    with pytest.raises(ValueError, match="already registered"):
        ad.register_backend(Recording("math"))
    with pytest.raises(ValueError, match="lowercase"):
        ad.register_backend(Recording("Bad Name"))
    with pytest.raises(ValueError, match="priority"):
        ad.register_backend(Recording("okname"), priority="middle")
    with pytest.raises(KeyError, match="no backend named 'nope'"):
        ad.unregister_backend("nope")


def test_forced_backend_runs_or_raises_with_reasons():
    ad.register_backend(Recording("bf16only", ad.Capabilities(dtypes=frozenset({torch.bfloat16}))))
    q, k, v = qkv()
    with pytest.raises(ad.NoBackendError) as err:
        ad.sdpa(q, k, v, backend="bf16only")
    msg = str(err.value)
    assert "bf16only" in msg and "forced" in msg and "dtype=float32 not in {bfloat16}" in msg
    assert err.value.decision.rejected["bf16only"]
    out = ad.sdpa(q, k, v, backend="math")
    assert ad.last_decision().backend == "math" and ad.last_decision().source == "backend= argument"
    with pytest.raises(ad.NoBackendError, match="not registered"):
        ad.sdpa(q, k, v, backend="nonexistent")
    assert out.shape == q.shape


def test_no_backend_lists_every_candidate_and_reason():
    picky = ad.Capabilities(head_dim_max=8, dtypes=frozenset({torch.float16}))
    ad.register_backend(Recording("picky", picky))
    ad.register_backend(Recording("absent", available=False))
    with ad.use_backends("picky", "absent"):
        with pytest.raises(ad.NoBackendError) as err:
            ad.sdpa(*qkv())
    msg = str(err.value)
    assert "no available backend" in msg
    assert "picky: dtype=float32 not in {float16}; head_dim=16 > 8" in msg
    assert "absent: absent library missing" in msg
    assert "problem: dense B=1 Hq=2" in msg


def test_use_backends_nesting_and_restore():
    a, b = Recording("aa"), Recording("bb")
    ad.register_backend(a)
    ad.register_backend(b)
    with ad.use_backends("aa", "math"):
        ad.sdpa(*qkv())
        assert ad.last_decision().backend == "aa" and ad.last_decision().source == "use_backends()"
        with ad.use_backends("bb"):
            ad.sdpa(*qkv())
            assert ad.last_decision().backend == "bb"
        ad.sdpa(*qkv())
        assert ad.last_decision().backend == "aa"
    ad.sdpa(*qkv())
    assert ad.last_decision().source == "default"
    with pytest.raises(ValueError, match="unknown backend 'zz'"):
        with ad.use_backends("zz"):
            pass


def test_use_backends_and_last_decision_are_thread_isolated():
    ad.register_backend(Recording("aa"))
    ad.register_backend(Recording("bb"))
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name):
        with ad.use_backends(name):
            barrier.wait()
            for _ in range(20):
                ad.sdpa(*qkv())
                assert ad.last_decision().backend == name
            seen[name] = ad.last_decision().backend

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("aa", "bb")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"aa": "aa", "bb": "bb"}
    assert ad.last_decision() is None or ad.last_decision().backend not in ("aa", "bb")


def test_env_order_and_config_order(tmp_path, monkeypatch):
    ad.register_backend(Recording("aa"))
    ad.register_backend(Recording("bb"))
    cfg = tmp_path / "c.toml"
    cfg.write_text('[dispatch]\npriority = ["bb", "math"]\n')
    ad.load_config(cfg)
    d = ad.explain(*qkv())
    assert d.backend == "bb" and d.source == f"config {cfg}"
    monkeypatch.setenv("ATTENTION_DISPATCH_BACKENDS", "aa,math")
    ad.clear_cache()
    d = ad.explain(*qkv())
    assert d.backend == "aa" and d.source == "env ATTENTION_DISPATCH_BACKENDS"
    with ad.use_backends("bb"):  # the scope beats the env
        assert ad.explain(*qkv()).backend == "bb"
    assert ad.explain(*qkv(), backend="math").backend == "math"  # the argument beats all


def test_env_config_path(tmp_path, monkeypatch):
    ad.register_backend(Recording("bb"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dispatch:\n  priority: [bb, math]\n")
    monkeypatch.setenv("ATTENTION_DISPATCH_CONFIG", str(cfg))
    ad.reset_config()
    assert ad.explain(*qkv()).backend == "bb"


def test_disabled_backends_skipped_unless_forced():
    ad.register_backend(Recording("aa"), priority="first")
    with ad.use_config({"dispatch": {"disabled": ["aa"]}}):
        d = ad.explain(*qkv())
        assert d.backend != "aa" and "disabled by config" in d.rejected["aa"][0]
        assert ad.explain(*qkv(), backend="aa").backend == "aa"


def test_cache_hit_and_invalidation():
    mine = Recording("mine")
    ad.register_backend(mine, priority="first")
    p = problem_of(*qkv())
    d1 = dispatch.decide(p)
    assert dispatch.decide(p) is d1  # a hit returns the same object
    ad.register_backend(Recording("other"), priority="first")  # registry change invalidates
    d2 = dispatch.decide(p)
    assert d2 is not d1 and d2.backend == "other"
    with ad.use_config({"dispatch": {"disabled": ["other"]}}):  # config change invalidates
        assert dispatch.decide(p).backend == "mine"
    assert dispatch.decide(p).backend == "other"
    # Availability is part of the decision, so a change needs clear_cache() (documented).
    mine.available = False
    ad.unregister_backend("other")
    ad.clear_cache()
    assert dispatch.decide(p).backend != "mine"


def test_cache_is_thread_safe():
    p = problem_of(*qkv())
    results, errors = [], []

    def worker():
        try:
            for i in range(200):
                if i % 50 == 0:
                    ad.clear_cache()
                results.append(dispatch.decide(p).backend)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(results) == 800


def test_determinism_rejects_nondeterministic_backward():
    nd = Recording("nondet", ad.Capabilities(deterministic_backward=False))
    ad.register_backend(nd, priority="first")
    q, k, v = qkv(grad=True)
    d = ad.explain(q, k, v, deterministic=True)
    assert d.backend != "nondet"
    assert "deterministic algorithms requested but the backward is nondeterministic" in d.rejected["nondet"]
    assert ad.explain(q, k, v, deterministic=False).backend == "nondet"
    with torch.no_grad():  # no backward: determinism of it is moot
        assert ad.explain(q, k, v, deterministic=True).backend == "nondet"
    with ad.use_config({"dispatch": {"deterministic": True}}):
        assert ad.explain(q, k, v).backend != "nondet"


def test_determinism_follows_torch_with_warn_only():
    nd = Recording("nondet", ad.Capabilities(deterministic_backward=False))
    ad.register_backend(nd, priority="first")
    q, k, v = qkv(grad=True)
    prev = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert ad.explain(q, k, v).backend != "nondet"
        torch.use_deterministic_algorithms(True, warn_only=True)
        ad.clear_cache()
        with pytest.warns(UserWarning, match="nondeterministic backward"):
            ad.sdpa(q, k, v)
        assert ad.last_decision().backend == "nondet"
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])


def _cuda_problem(**changes):
    return dataclasses.replace(problem_of(*qkv()), device_type="cuda", compute_capability=(9, 0), **changes)


def test_math_on_cuda_warns_once_or_is_forbidden():
    p = _cuda_problem()
    with ad.use_backends("math"):
        with pytest.warns(RuntimeWarning, match="quadratic"):
            assert dispatch.decide(p).backend == "math"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dispatch.decide(p)  # once only
    ad.clear_cache()  # re-arms the warnings given once
    with ad.use_config({"dispatch": {"math_fallback": "allow"}}), ad.use_backends("math"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dispatch.decide(p).backend == "math"
    with ad.use_config({"dispatch": {"math_fallback": "forbid"}}), ad.use_backends("math"):
        with pytest.raises(ad.NoBackendError, match="forbidden by config"):
            dispatch.decide(p)


def test_on_error_raise_names_backend_and_fallback_records_it():
    broken = Recording("broken", fail=RuntimeError("CUDA error: illegal memory access"))
    ad.register_backend(broken, priority="first")
    q, k, v = qkv()
    with pytest.raises(ad.BackendRunError, match="backend 'broken' failed while running: RuntimeError: CUDA error"):
        ad.sdpa(q, k, v)
    with ad.use_config({"dispatch": {"on_error": "fallback"}}):
        out = ad.sdpa(q, k, v)
        d = ad.last_decision()
    assert d.backend != "broken" and "broken" in d.failures and "illegal memory access" in d.failures["broken"]
    assert "failed: RuntimeError" in str(d)
    ref = ad.sdpa(q, k, v, backend="math")
    torch.testing.assert_close(out, ref)


def test_explain_record_last_decision():
    q, k, v = qkv()
    d = ad.explain(q, k, v, is_causal=True)
    assert isinstance(d, ad.Decision) and d.problem.causal == ad.CausalKind.TOP_LEFT
    with ad.record() as outer:
        ad.sdpa(q, k, v)
        with ad.record() as inner:
            ad.sdpa(q, k, v, backend="math")
    assert [x.backend for x in inner] == ["math"]
    assert len(outer) == 2 and outer[1].backend == "math"
    assert ad.last_decision() is outer[1]
    ad.register_backend(Recording("never", ad.Capabilities(devices=frozenset({"cuda"}))))
    d = ad.explain(q, k, v, backend="never")  # explain does not raise: it explains
    assert d.backend is None and d.rejected["never"] == ["device=cpu not in {cuda}"]


def test_logging_every_new_decision(caplog):
    caplog.set_level(logging.DEBUG, logger="attention_dispatch")
    q, k, v = qkv()
    ad.sdpa(q, k, v, backend="math")
    ad.sdpa(q, k, v, backend="math")  # a cache hit logs nothing new
    logged = [r for r in caplog.records if "new decision" in r.getMessage()]
    assert len(logged) == 1 and "math" in logged[0].getMessage()


def test_log_env_variable_configures_stderr_logging():
    code = (
        "import torch, attention_dispatch as ad\n"
        "ad.sdpa(*(torch.randn(1, 1, 4, 8) for _ in range(3)), backend='math')\n"
    )
    env = dict(os.environ, ATTENTION_DISPATCH_LOG="debug")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "[attention_dispatch] DEBUG new decision" in res.stderr and "math" in res.stderr


class Sleepy(Recording):
    def __init__(self, name, seconds):
        super().__init__(name)
        self.seconds = seconds

    def run(self, query, key, value, **options):
        import time

        time.sleep(self.seconds)
        return super().run(query, key, value, **options)


def _fake_runners(
    monkeypatch, seconds: dict, hiccup: tuple[str, int | set, float] | None = None, long_calls: bool = False
):
    """fastest.runner replaced by host-sleeping calls (`hiccup`: (backend, its call number
    or numbers, extra seconds)); returns the log of turns (one name per turn) and of calls.
    The sleeps are long for a loaded CI machine's sake: unless ``long_calls``, they still count
    as short calls (ROUNDS timed rounds, not LONG_ROUNDS); with it, the warm-up calls' sleeps
    make them long and the timed samples are the nominal times (the test counts rounds)."""
    import time
    from attention_dispatch import fastest

    calls, turns = [], []
    if not long_calls:
        monkeypatch.setattr(fastest, "LONG_CALL_MS", float("inf"))

    def runner(name, call):
        def once():
            calls.append(name)
            if (
                hiccup
                and name == hiccup[0]
                and calls.count(name) in ({hiccup[1]} if isinstance(hiccup[1], int) else hiccup[1])
            ):
                time.sleep(hiccup[2])
            time.sleep(seconds[name])

        once.backend = name
        return once

    real_turn = fastest.turn_ms_host

    def turn(once, n, sync):
        turns.append(once.backend)
        samples = real_turn(once, n, sync)
        if long_calls:  # the calls run; their samples are the nominal times (a loaded host's sleeps
            # overshoot by more than the 2 ms between them: 'a' won a round count test under CI load)
            return [max(seconds[once.backend] * 1e3, 0.01)] * len(samples)
        return samples

    monkeypatch.setattr(fastest, "runner", runner)
    monkeypatch.setattr(fastest, "turn_ms_host", turn)
    return calls, turns


def test_policy_fastest_takes_the_lower_quartile_of_interleaved_short_turns(monkeypatch):
    """Each backend is timed in ROUNDS rounds of short turns, all backends in each round: a
    backend's time is the lower quartile of its samples, so one disturbed call (300 ms: c's
    12th call, the sample of round 5) does not decide.  After PRUNE_AFTER rounds the clear losers stop being timed."""
    from attention_dispatch import fastest

    seconds = {"a": 0.020, "b": 0.040, "c": 0.010}
    calls, turns = _fake_runners(monkeypatch, seconds, hiccup=("c", 12, 0.3))
    call = types.SimpleNamespace(query=torch.empty(1))
    timings = fastest.time_backends(("a", "b", "c"), call, lambda: None)
    assert min(timings, key=timings.get) == "c"
    for name, s in seconds.items():
        assert s * 1e3 <= timings[name] < s * 1e3 + 8, timings
    # a and b are > PRUNE_RATIO x c's median: timed PRUNE_AFTER rounds only (after the warm ones); c every round
    timed = fastest.WARM_ROUNDS + fastest.PRUNE_AFTER
    assert [turns.count(n) for n in "abc"] == [timed, timed, fastest.WARM_ROUNDS + fastest.ROUNDS]
    assert sorted(turns[:3]) == sorted(turns[3:6]) == ["a", "b", "c"]
    # a turn: one untimed call, then SAMPLES_PER_TURN samples of one call (each >= SAMPLE_MS)
    assert calls.count("c") == 2 + (fastest.WARM_ROUNDS + fastest.ROUNDS) * (1 + fastest.SAMPLES_PER_TURN)


def test_policy_fastest_times_long_calls_in_fewer_rounds(monkeypatch):
    """Where every backend's warm-up call takes LONG_CALL_MS or more, LONG_ROUNDS timed rounds
    decide; one short backend among them keeps ROUNDS for all."""
    from attention_dispatch import fastest

    monkeypatch.setattr(fastest, "LONG_CALL_MS", 5.0)
    call = types.SimpleNamespace(query=torch.empty(1))
    for seconds, rounds in (
        ({"a": 0.012, "b": 0.010}, fastest.LONG_ROUNDS),
        ({"a": 0.012, "b": 0.0}, fastest.ROUNDS),
    ):  # a is pruned there
        calls, turns = _fake_runners(monkeypatch, seconds, long_calls=True)
        samples: dict = {}
        timed = fastest.time_backends(tuple(seconds), call, lambda: None, samples_out=samples)
        assert min(timed, key=timed.get) == "b"
        assert len(samples["b"]) == rounds * fastest.SAMPLES_PER_TURN
        assert turns.count("b") == fastest.WARM_ROUNDS + rounds
    assert len(samples["a"]) == fastest.PRUNE_AFTER * fastest.SAMPLES_PER_TURN
    assert fastest.PRUNE_AFTER < fastest.LONG_ROUNDS < fastest.ROUNDS


def test_policy_fastest_does_not_prune_the_winner_on_a_slow_start(monkeypatch):
    """The first (warm) round is not timed, and pruning waits for PRUNE_AFTER timed rounds: the
    fastest backend disturbed in its first two samples (as when the device's clock is still
    ramping up) still wins on its median."""
    from attention_dispatch import fastest

    assert fastest.WARM_ROUNDS == 1 and fastest.PRUNE_AFTER >= 3
    # c's calls: 1 warm-up, 2 estimate, then per round an untimed call and one sample (4, 6, 8, ...)
    _, turns = _fake_runners(monkeypatch, {"a": 0.020, "c": 0.010}, hiccup=("c", {4, 6}, 0.1))
    timings = fastest.time_backends(("a", "c"), types.SimpleNamespace(query=torch.empty(1)), lambda: None)
    assert min(timings, key=timings.get) == "c", timings
    assert 10 <= timings["c"] < 18 and turns.count("c") == fastest.WARM_ROUNDS + fastest.ROUNDS


def test_policy_fastest_resists_a_disturbance_of_most_samples(monkeypatch):
    """Six of the fastest backend's eleven timed samples disturbed (+30 ms, none of two rounds
    in a row, so it is not pruned): its median would lose to a (20 ms), its lower quartile wins
    (grid 751889c, a disturbed machine: one backend's timing read 20-50% above its column)."""
    from attention_dispatch import fastest

    assert fastest.ROUNDS == 11 and fastest.SAMPLES_PER_TURN == 1 and fastest.WARM_ROUNDS == 1
    # c's calls: 1 warm-up, 2 estimate, a warm round (3, 4), then round r's sample is call 4 + 2r
    slow = {8, 10, 14, 18, 22, 26}  # rounds 2, 3, 5, 7, 9 and 11
    _, turns = _fake_runners(monkeypatch, {"a": 0.020, "c": 0.010}, hiccup=("c", slow, 0.03))
    timings = fastest.time_backends(("a", "c"), types.SimpleNamespace(query=torch.empty(1)), lambda: None)
    assert min(timings, key=timings.get) == "c", timings
    assert 10 <= timings["c"] < 18 and turns.count("c") == fastest.WARM_ROUNDS + fastest.ROUNDS


def test_policy_fastest_samples_with_the_collector_off_and_restores_it(monkeypatch):
    """Samples are taken with the garbage collector off (a collection of the caller's heap would
    land on whichever backend runs then); it is on again afterwards, also when timing fails."""
    import gc
    from attention_dispatch import fastest

    seen = []
    real = fastest.turn_ms_host

    def turn(once, n, sync):
        seen.append(gc.isenabled())
        return real(once, n, sync)

    _fake_runners(monkeypatch, {"a": 0.001, "b": 0.002})
    monkeypatch.setattr(fastest, "turn_ms_host", turn)
    assert gc.isenabled()
    fastest.time_backends(("a", "b"), types.SimpleNamespace(query=torch.empty(1)), lambda: None)
    assert seen and not any(seen) and gc.isenabled()

    def failing(once, n, sync):
        raise RuntimeError("device lost")

    monkeypatch.setattr(fastest, "turn_ms_host", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        fastest.time_backends(("a", "b"), types.SimpleNamespace(query=torch.empty(1)), lambda: None)
    assert gc.isenabled()


def test_policy_fastest_shuffles_the_turns_after_the_first_round(monkeypatch):
    """No backend always follows the same one: the turn order changes between rounds."""
    from attention_dispatch import fastest

    monkeypatch.setattr(fastest, "PRUNE_RATIO", 1e9)
    names = ("a", "b", "c", "d")
    _, turns = _fake_runners(monkeypatch, dict.fromkeys(names, 0.001))
    fastest.time_backends(names, types.SimpleNamespace(query=torch.empty(1)), lambda: None)
    rounds = [tuple(turns[i : i + 4]) for i in range(0, len(turns), 4)]
    assert len(rounds) == fastest.WARM_ROUNDS + fastest.ROUNDS and all(sorted(r) == list(names) for r in rounds)
    assert rounds[0] == names and len(set(rounds)) > fastest.ROUNDS // 2


def test_policy_fastest_gives_a_near_tie_to_host_time_to_spare():
    """A leader that spends HOST_HEAVY of its time on the host loses a near-tie (within TIE) to
    the backend with the least host time; a clear lead, or a leader with host time to spare,
    keeps it; without host times (the CPU) the lowest time wins."""
    from attention_dispatch import timing

    pick = timing.pick_winner
    timings = {"fa4": 0.647, "ours": 0.663, "cudnn": 0.695}  # grid c06cc63, d64 S=512 causal
    assert pick(timings, {"fa4": 0.572, "ours": 0.437, "cudnn": 0.352}) == "ours"  # cuDNN: 7% off
    assert pick(timings, {"fa4": 0.40, "ours": 0.437, "cudnn": 0.352}) == "fa4"  # fa4 not host-heavy
    assert pick({"fa4": 0.60, "ours": 0.663}, {"fa4": 0.572, "ours": 0.437}) == "fa4"  # 10% lead
    assert pick(timings, {}) == "fa4"
    heavy = timing.HOST_HEAVY * 0.647
    assert pick(timings, {"fa4": heavy, "ours": 0.1}) == "ours"
    assert pick(timings, {"fa4": heavy * 0.99, "ours": 0.1}) == "fa4"
    edge = {"fa4": 1.0, "ours": 1.0 + timing.TIE}
    assert pick(edge, {"fa4": 0.9, "ours": 0.1}) == "ours"
    assert pick({"fa4": 1.0, "ours": 1.0 + timing.TIE * 1.01}, {"fa4": 0.9, "ours": 0.1}) == "fa4"


def test_policy_fastest_says_why_a_near_tie_went_to_the_host_light_backend(monkeypatch):
    """The decision table names the leader it passed over and both host times."""
    from attention_dispatch import fastest

    fastest.forget()

    def timed(names, call, sync, failures=None, samples_out=None, host_out=None):
        host_out.update(heavy=0.60, light=0.30)
        samples_out.update(heavy=(0.650,), light=(0.660,))
        return {"heavy": 0.650, "light": 0.660}

    monkeypatch.setattr(fastest, "time_backends", timed)
    ad.register_backend(Recording("heavy"), priority="first")
    ad.register_backend(Recording("light"), priority=1)
    with ad.use_config({"dispatch": {"policy": "fastest"}}), ad.use_backends("heavy", "light"):
        ad.sdpa(*qkv())
        d = ad.last_decision()
    fastest.forget()
    assert d.backend == "light"
    assert "heavy led by 1.5% but spends 0.600 of its 0.650 ms on the host; light needs 0.300 ms" in str(d)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_policy_fastest_counts_host_bound_time():
    """On a GPU each sample is timed by CUDA events once an untimed call has started the
    stream; a backend whose calls wait on the host (3 ms each) still pays that time there,
    and the quick one wins."""
    from attention_dispatch import fastest

    fastest.forget()
    slow, quick = Sleepy("slow", 0.003), Sleepy("quick", 0.0)
    ad.register_backend(slow, priority="first")
    ad.register_backend(quick, priority=1)
    q, k, v = (t.cuda() for t in qkv())
    with ad.use_config({"dispatch": {"policy": "fastest"}}), ad.use_backends("slow", "quick"):
        out = ad.sdpa(q, k, v)
        d = ad.last_decision()
    assert d.backend == "quick" and d.timings["slow"] >= 3.0 > d.timings["quick"], d.timings
    # the host's time per call, measured in the same samples: the sleep is all host
    assert set(d.host_timings) == set(d.timings) and d.host_timings["slow"] >= 3.0, d.host_timings
    assert f"host {d.host_timings['slow']:.3f} ms" in str(d)
    torch.testing.assert_close(out, math_attention(q, k, v))


def test_policy_fastest_measures_and_caches(tmp_path):
    from attention_dispatch import fastest

    fastest.forget()
    # 0.25 s: far above the scheduling noise of a loaded CI machine (20 ms flaked)
    slow, quick = Sleepy("slow", 0.25), Sleepy("quick", 0.0)
    ad.register_backend(slow, priority="first")
    ad.register_backend(quick, priority=1)
    cache = tmp_path / "fastest.json"
    q, k, v = qkv(grad=True)
    state = torch.get_rng_state()
    with (
        ad.use_config({"dispatch": {"policy": "fastest", "fastest_cache": str(cache)}}),
        ad.use_backends("slow", "quick"),
    ):
        ad.sdpa(q, k, v).sum().backward()
        d = ad.last_decision()
        assert torch.equal(torch.get_rng_state(), state)  # timing left the RNG alone
        assert d.backend == "quick" and d.timings["slow"] > d.timings["quick"]
        for name, ms in d.timings.items():  # the samples behind each time, as measured
            assert abs(fastest.lower_quartile(list(d.timing_samples[name])) - ms) < 1e-3
        assert "measured fastest" in str(d) and "policy=fastest" in str(d)
        # on the CPU a sample is the host's time: no separate host column
        assert d.host_timings == {} and "host" not in str(d)
        shown = str(dataclasses.replace(d, host_timings={"slow": 250.5, "quick": 0.0123}))
        assert "(measured fastest: " in shown and "; host 0.012 ms)" in shown and "; host 250.500 ms)" in shown
        runs = slow.runs
        ad.sdpa(*qkv(1, 2, 7, 16, grad=True))  # same bucket (7 rounds up to 8): no new timing
        assert slow.runs == runs and ad.last_decision().backend == "quick"
        stored = __import__("json").loads(cache.read_text())
        assert [e["backend"] for e in stored.values()] == ["quick"]
        fastest.forget()  # a new process: the file answers
        ad.sdpa(q, k, v)
        assert slow.runs == runs and ad.last_decision().backend == "quick"
    assert q.grad is not None and q.grad.abs().sum() > 0
    with ad.use_config({"dispatch": {"policy": "priority"}}), ad.use_backends("slow", "quick"):
        ad.sdpa(q, k, v)
        assert ad.last_decision().backend == "slow"


def test_policy_fastest_says_which_backend_failed_while_timed(monkeypatch):
    """A backend that fails while timed loses, and the decision table says why it has no time
    (on the H100 one such failure once hid flash-attn 4 from every varlen timing); the call's
    signature still gets sdpa()'s fast path."""
    from attention_dispatch import fastest

    fastest.forget()
    normalized = _count_normalize(monkeypatch)
    ad.register_backend(Recording("broken", fail=TypeError("needs cu_seqlens_q")), priority="first")
    ad.register_backend(Recording("works"), priority=1)
    q, k, v = qkv()
    with ad.use_config({"dispatch": {"policy": "fastest"}}), ad.use_backends("broken", "works"):
        out = ad.sdpa(q, k, v)
        d = ad.last_decision()
        assert d.backend == "works" and list(d.timings) == ["works"]
        assert d.failures == {"broken": "TypeError: needs cu_seqlens_q"}
        assert "broken" in str(d) and "failed: TypeError: needs cu_seqlens_q" in str(d)
        ad.sdpa(q, k, v)  # the kept measurement keeps the failure too
        assert ad.last_decision().failures == d.failures and len(normalized) == 1  # a fast-path hit
    torch.testing.assert_close(out, math_attention(q, k, v))


# ---- sdpa()'s fast path: a repeated call signature skips normalisation and decide() ----


def _count_normalize(monkeypatch):
    from attention_dispatch import api

    calls = []
    real = api.normalize_call

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(api, "normalize_call", counting)
    return calls


def test_fast_path_hit_runs_new_tensors_and_records_the_decision(monkeypatch):
    mine = Recording("mine")
    ad.register_backend(mine, priority="first")
    calls = _count_normalize(monkeypatch)
    q, k, v = qkv(2, 3, 9, 16)
    out1 = ad.sdpa(q, k, v, is_causal=True, scale=0.3)
    d1 = ad.last_decision()
    q2, k2, v2 = qkv(2, 3, 9, 16)
    with ad.record() as seen:
        out2 = ad.sdpa(q2, k2, v2, is_causal=True, scale=0.3)
    assert len(calls) == 1 and mine.runs == 2  # the second call skipped normalize_call
    assert seen == [d1] and ad.last_decision() is d1
    ref = math_attention(q2.double(), k2.double(), v2.double(), causal=ad.CausalKind.TOP_LEFT, scale=0.3)
    torch.testing.assert_close(out2.double(), ref, atol=2e-6, rtol=1e-5)  # fp32 vs the float64 oracle
    assert not torch.equal(out1, out2)


@pytest.mark.parametrize(
    "change", ["dtype", "shape", "stride", "requires_grad", "scope", "config", "scale", "deterministic_torch"]
)
def test_fast_path_misses_when_anything_the_decision_uses_changes(monkeypatch, change):
    calls = _count_normalize(monkeypatch)
    q, k, v = qkv(1, 2, 8, 16)
    ad.sdpa(q, k, v)
    ad.sdpa(q, k, v)
    assert len(calls) == 1
    kwargs = {}
    if change == "dtype":
        q, k, v = (t.double() for t in (q, k, v))
    elif change == "shape":
        q = torch.randn(1, 2, 7, 16)
    elif change == "stride":
        q = torch.randn(1, 8, 2, 16).transpose(1, 2)
    elif change == "requires_grad":
        q = q.detach().requires_grad_()
    elif change == "scale":
        kwargs["scale"] = 0.5
    if change == "scope":
        with ad.use_backends("math"):
            ad.sdpa(q, k, v)
            assert ad.last_decision().backend == "math"
    elif change == "config":
        with ad.use_config({"dispatch": {"disabled": [ad.last_decision().backend]}}):
            before = ad.last_decision().backend
            ad.sdpa(q, k, v)
            assert ad.last_decision().backend != before
    elif change == "deterministic_torch":
        torch.use_deterministic_algorithms(True)
        try:
            ad.sdpa(q, k, v)
            assert ad.last_decision().problem.deterministic
        finally:
            torch.use_deterministic_algorithms(False)
    else:
        ad.sdpa(q, k, v, **kwargs)
    assert len(calls) == 2


@pytest.mark.parametrize(
    "bad",
    [
        dict(scale=True),
        dict(dropout_p=False),
        dict(enable_gqa=1),
        dict(is_causal=1),
        dict(deterministic=1),
        dict(window=(2.0, 3)),
    ],
)
def test_fast_path_never_skips_validation(bad):
    """Values equal (and hashing equal) to a valid call's, of a type the full path rejects,
    still reach the full path's checks."""
    q, k, v = qkv()
    good = dict(scale=1.0, dropout_p=0.0, enable_gqa=False, is_causal=False, deterministic=True, window=(2, 3))
    valid = {name: good[name] for name in bad}
    ad.sdpa(q, k, v, **valid)
    ad.sdpa(q, k, v, **valid)
    with pytest.raises((TypeError, ValueError)):
        ad.sdpa(q, k, v, **bad)


def test_fast_path_failure_takes_the_full_path_with_fallback():
    flaky = Recording("flaky")
    ad.register_backend(flaky, priority="first")
    q, k, v = qkv()
    with ad.use_config({"dispatch": {"on_error": "fallback"}}):
        ad.sdpa(q, k, v)
        assert ad.last_decision().backend == "flaky"
        flaky.fail = RuntimeError("device lost")
        out = ad.sdpa(q, k, v)  # fast-path runner fails -> full path -> fallback
        d = ad.last_decision()
    assert d.backend != "flaky" and "device lost" in d.failures["flaky"]
    torch.testing.assert_close(out, ad.sdpa(q, k, v, backend="math"))
    with pytest.raises(ad.BackendRunError, match="device lost"):
        ad.sdpa(q, k, v)  # on_error="raise" (default) raises as before


def test_clear_cache_forgets_fast_path_entries():
    mine = Recording("mine")
    ad.register_backend(mine, priority="first")
    q, k, v = qkv()
    ad.sdpa(q, k, v)
    assert dispatch.fast_calls
    mine.available = False  # availability is cached; clear_cache() applies it
    ad.clear_cache()
    assert not dispatch.fast_calls
    ad.sdpa(q, k, v)
    assert ad.last_decision().backend != "mine"


def test_a_failing_prepare_keeps_the_full_path():
    class NoPrepare(Recording):
        def prepare(self, query, key, value, options):
            raise RuntimeError("cannot prepare")

    mine = NoPrepare("mine")
    ad.register_backend(mine, priority="first")
    q, k, v = qkv()
    out = ad.sdpa(q, k, v)  # the call itself succeeds
    assert not dispatch.fast_calls and mine.runs == 1
    torch.testing.assert_close(ad.sdpa(q, k, v), out)
    assert mine.runs == 2


@pytest.mark.parametrize("kind", ["bool", "float", "float_grad"])
def test_fast_path_with_a_mask_uses_each_calls_mask(monkeypatch, kind):
    calls = _count_normalize(monkeypatch)
    q, k, v = qkv(2, 3, 9, 16, grad=kind == "float_grad")

    def mask():
        if kind == "bool":
            return torch.rand(2, 1, 9, 9) > 0.3
        return torch.randn(1, 3, 9, 9, requires_grad=kind == "float_grad")

    m1, m2 = mask(), mask()
    ad.sdpa(q, k, v, attn_mask=m1)
    out = ad.sdpa(q, k, v, attn_mask=m2)
    assert len(calls) == 1  # the second call took the fast path
    ref = math_attention(
        q.double(), k.double(), v.double(), attn_mask=m2 if kind == "bool" else m2.double(), scale=16**-0.5
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    if kind == "float_grad":
        (gm,) = torch.autograd.grad(out.sum(), m2)
        (rm,) = torch.autograd.grad(ref.sum(), m2)
        torch.testing.assert_close(gm.double(), rm.double(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("change", ["mask_shape", "mask_dtype_converted", "mask_3d", "mask_requires_grad", "no_mask"])
def test_fast_path_mask_signature(monkeypatch, change):
    """A mask that normalize_call() would reshape or convert never takes the fast path; any
    change of the mask's shape, kind or grad need misses; a call without a mask is another
    signature."""
    calls = _count_normalize(monkeypatch)
    q, k, v = qkv(1, 2, 8, 16)
    m = torch.randn(1, 2, 8, 8)
    ad.sdpa(q, k, v, attn_mask=m)
    ad.sdpa(q, k, v, attn_mask=m)
    assert len(calls) == 1
    other = {
        "mask_shape": torch.randn(1, 1, 8, 8),
        "mask_dtype_converted": m,
        "mask_3d": m[0],
        "mask_requires_grad": m.clone().requires_grad_(),
        "no_mask": None,
    }[change]
    if change == "mask_dtype_converted":  # a float32 mask with float64 inputs is converted (exactly)
        q, k, v = q.double(), k.double(), v.double()
    ad.sdpa(q, k, v, attn_mask=other)
    ad.sdpa(q, k, v, attn_mask=other)
    cached_twice = change in ("mask_shape", "mask_requires_grad", "no_mask")
    assert len(calls) == (2 if cached_twice else 3)


def test_one_offsets_tensor_means_packed_self_attention():
    """cu_seqlens_q is cu_seqlens_k (or nested query/key sharing their offsets): every
    sequence has as many queries as keys, so the Problem says top-left and bottom-right
    causal coincide; equal offsets in two tensors are not read back (no device sync)."""
    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10])  # int64: converted once, and stays one tensor
    call = normalize_call(q, q, q, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert call.problem.same_offsets and call.problem.sequences_match
    assert call.options["cu_seqlens_q"] is call.options["cu_seqlens_k"]
    apart = normalize_call(q, q, q, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu.clone())
    assert not apart.problem.same_offsets and not apart.problem.sequences_match
    assert apart.problem != call.problem  # the decision cache tells them apart
    dense = normalize_call(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), is_causal=True)
    assert dense.problem.sequences_match and not dense.problem.same_offsets
    offsets = torch.tensor([0, 4, 10])
    nq, nk = (torch.nested.nested_tensor_from_jagged(torch.randn(10, 2, 8), offsets).transpose(1, 2) for _ in range(2))
    assert normalize_call(nq, nk, nk, is_causal=True).problem.same_offsets
    other = torch.nested.nested_tensor_from_jagged(torch.randn(10, 2, 8), offsets.clone()).transpose(1, 2)
    assert not normalize_call(nq, other, other, is_causal=True).problem.same_offsets
    # the result is the same function either way (math backend, top-left per sequence)
    torch.testing.assert_close(
        ad.sdpa(q, q, q, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu),
        ad.sdpa(q, q, q, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu.clone()),
    )


def _packed(lens, h=2, d=16, grad=False):
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), h, d, requires_grad=grad) for _ in range(3))
    return q, k, v, cu


def _varlen_ref(q, k, v, cu):
    """Per-sequence top-left causal attention in float64 (the oracle, one sequence at a time)."""
    outs = []
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        outs.append(
            math_attention(*(t[a:b].double().transpose(0, 1)[None] for t in (q, k, v)), causal=ad.CausalKind.TOP_LEFT)[
                0
            ].transpose(0, 1)
        )
    return torch.cat(outs)


def test_fast_path_varlen_uses_each_calls_offsets(monkeypatch):
    """Packed calls with int32 offsets and int max_seqlen take the fast path: new tensors
    and new offsets (same shapes and max_seqlen) are used, gradients included; one offsets
    tensor for both (packed self-attention) and two of them are different signatures."""
    calls = _count_normalize(monkeypatch)
    q, k, v, cu = _packed([3, 5, 4], grad=True)
    kw = dict(is_causal=True, max_seqlen_q=6, max_seqlen_k=6)
    ad.sdpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    d1 = ad.last_decision()
    q2, k2, v2, cu2 = _packed([6, 2, 4], grad=True)
    out = ad.sdpa(q2, k2, v2, cu_seqlens_q=cu2, cu_seqlens_k=cu2, **kw)
    assert len(calls) == 1 and ad.last_decision() is d1
    ref = _varlen_ref(q2, k2, v2, cu2)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q2, k2, v2), g)
    want = torch.autograd.grad(ref, (q2, k2, v2), g.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=1e-4)
    ad.sdpa(q2, k2, v2, cu_seqlens_q=cu2, cu_seqlens_k=cu2.clone(), **kw)  # two offsets tensors: a miss
    assert len(calls) == 2


@pytest.mark.parametrize("change", ["int64", "no_max_seqlen", "mask"])
def test_fast_path_varlen_keeps_the_full_path_when_normalize_call_would_work(monkeypatch, change):
    """Offsets to convert, a max_seqlen to compute (a device sync) or a mask to broadcast:
    every call goes through normalize_call."""
    calls = _count_normalize(monkeypatch)
    q, k, v, cu = _packed([3, 5, 4])
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    if change == "int64":
        kw.update(cu_seqlens_q=cu.long(), cu_seqlens_k=cu.long())
    elif change == "no_max_seqlen":
        kw.update(max_seqlen_q=None, max_seqlen_k=None)
    else:
        kw["attn_mask"] = torch.ones(3, 2, 5, 5, dtype=torch.bool)
    for _ in range(3):
        ad.sdpa(q, k, v, **kw)
    assert len(calls) == 3


def test_fast_path_varlen_bad_offsets_raise_as_on_the_full_path():
    """On the CPU the full path validates the offsets' values; a hit with bad ones raises
    the same error (the fast path hands the call back to it)."""
    q, k, v, cu = _packed([3, 5, 4])
    kw = dict(max_seqlen_q=5, max_seqlen_k=5)
    ad.sdpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
    for bad, match in (
        (torch.tensor([0, 3, 8, 11], dtype=torch.int32), "must end at the packed length 12"),
        (torch.tensor([0, 6, 8, 12], dtype=torch.int32), "less than its longest sequence"),
        (torch.tensor([1, 3, 8, 12], dtype=torch.int32), "must start at 0"),
    ):
        with pytest.raises(ValueError, match=match):
            ad.sdpa(q, k, v, cu_seqlens_q=bad, cu_seqlens_k=bad, **kw)


def test_fast_path_survives_entering_the_same_scoped_config(monkeypatch):
    """`with ad.use_config(same dict)` around every step: one Config object, nothing
    invalidated by entering or leaving, so the later steps take the fast path; a scope that
    changes the decision still does, and leaving it restores the earlier one."""
    from attention_dispatch import config as config_mod

    calls = _count_normalize(monkeypatch)
    q, k, v = qkv(1, 2, 8, 16)
    seen = set()
    for _ in range(3):
        with ad.use_config({"dispatch": {"on_error": "raise"}}) as cfg:
            seen.add(id(cfg))
            ad.sdpa(q, k, v)
    assert len(seen) == 1 and len(calls) == 1
    outside = ad.last_decision().backend
    with ad.use_config({"dispatch": {"disabled": [outside]}}):
        ad.sdpa(q, k, v)
        assert ad.last_decision().backend != outside
    ad.sdpa(q, k, v)
    assert ad.last_decision().backend == outside
    # ids named by cache keys stay taken: the pinned configs are the scoped ones
    assert config_mod.pinned[next(iter(seen))] is not None


def test_config_pins_are_bounded_and_dropping_them_invalidates_keys(monkeypatch):
    """Past PIN_LIMIT scoped configs the pins are dropped (their ids may be reused) and the
    config version moves, so no cached key naming them can hit again."""
    from attention_dispatch import config as config_mod

    monkeypatch.setattr(config_mod, "PIN_LIMIT", 3)
    monkeypatch.setattr(config_mod, "pinned", {})
    version = config_mod.config_version()
    for name in ("math", "torch_cpu", "triton"):  # three distinct configs: pinned, nothing bumped
        with ad.use_config({"dispatch": {"disabled": [name]}}) as cfg:
            assert config_mod.current_config() is cfg and list(cfg.dispatch.disabled) == [name]
    assert config_mod.config_version() == version and len(config_mod.pinned) == 3
    with ad.use_config({"dispatch": {"disabled": ["xformers"]}}):
        assert config_mod.config_version() == version + 1 and len(config_mod.pinned) == 1


def test_clear_cache_empties_every_registered_cache():
    """Every cache of the package is registered in attention_dispatch.caches; clear_cache()
    empties each one (a stale decision, Problem, fast-path entry or winner cannot survive it)."""
    from attention_dispatch import caches

    q, k, v = qkv()
    ad.sdpa(q, k, v)
    ad.sdpa(q, k, v)
    sizes = caches.cache_sizes()
    for name in ("call.problems", "dispatch.decisions and fast_calls", "fastest.winners"):
        assert name in sizes
    assert sizes["call.problems"] and sizes["dispatch.decisions and fast_calls"]
    ad.clear_cache()
    assert not any(caches.cache_sizes().values()), caches.cache_sizes()


def test_call_facts_are_complete_and_named():
    """normalize_call builds CallFacts positionally (host time): every field present, and the
    Problem made from them carries each one."""
    from attention_dispatch.call import CallFacts, make_problem

    q, k, v = qkv()
    facts = normalize_call(q, k, v, attn_mask=torch.randn(8, 8), is_causal=False, window=(3, 2)).facts
    assert type(facts) is CallFacts and len(facts) == len(CallFacts._fields)
    problem = make_problem(facts)
    assert (problem.window, problem.mask_kind, problem.seqlen_k) == ((3, 2), "float", k.shape[2])
    assert problem.float32_bias is False and problem.device_type == "cpu"
