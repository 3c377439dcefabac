"""Threads: 8 threads mixing use_backends() scopes, scoped configs, record(), process-wide config
loads and register_backend / unregister_backend for a few thousand calls: every call's decision
is the one its own scope asked for, no exception, last_decision() per thread right."""

import threading

import torch

import attention_dispatch as ad
from attention_dispatch.backends.math import math_attention

CALLS = 300  # per thread: 2400 calls in all


class Tagged(ad.Backend):
    """Computes through the math reference; counts its runs."""

    def __init__(self, name):
        self.name, self.runs = name, 0

    def run(self, query, key, value, **options):
        self.runs += 1
        return math_attention(query, key, value, **options)


def test_threads_mixing_scopes_configs_records_and_registrations(tmp_path):
    names = [f"t{i}" for i in range(6)]
    for name in names:
        ad.register_backend(Tagged(name), priority="last")
    loaded = tmp_path / "loaded.toml"
    loaded.write_text('[dispatch]\nmath_fallback = "allow"\non_error = "fallback"\n')
    errors, finished = [], {}
    start = threading.Barrier(8)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))

    def check(expected: str, i: int, shape_calls: bool = True):
        # alternate two signatures: one hits the fast path, one decides again after a bump
        x = q if i % 2 or not shape_calls else q[:, :, :3]
        ad.sdpa(x, k, v)
        got = ad.last_decision().backend
        assert got == expected, f"call {i}: {got!r} != {expected!r}"

    def scoped(index):  # use_backends() scopes, nested, with record()
        name, other = names[index], names[(index + 1) % len(names)]
        for i in range(CALLS):
            if i % 3 == 0:
                with ad.use_backends(other, "math"), ad.record() as seen:
                    check(other, i)
                    with ad.use_backends(name):
                        check(name, i)
                    check(other, i)
                assert [d.backend for d in seen] == [other, name, other]
            else:
                with ad.use_backends(name, "math"):
                    check(name, i)
        return name

    def configured(index):  # a scoped config's priority (no use_backends)
        name = names[index]
        for i in range(CALLS):
            with ad.use_config({"dispatch": {"priority": [name, "math"]}}):
                check(name, i)
        return name

    def forced():  # backend= beats every scope
        for i in range(CALLS):
            with ad.use_backends(names[0]):
                ad.sdpa(q, k, v, backend="math")
                assert ad.last_decision().backend == "math"
        return "math"

    def churn():  # process-wide loads and registrations, racing everyone's decisions
        for i in range(CALLS):
            if i % 2:
                ad.load_config(loaded)
            else:
                ad.reset_config()
            flicker = Tagged("flicker")
            ad.register_backend(flicker, priority="last")
            with ad.use_backends("flicker"):
                check("flicker", i, shape_calls=False)
            ad.unregister_backend("flicker")
            if i % 50 == 0:
                ad.clear_cache()
        return "flicker"

    jobs = [
        lambda: scoped(0),
        lambda: scoped(1),
        lambda: scoped(2),
        lambda: configured(3),
        lambda: configured(4),
        lambda: scoped(5),
        forced,
        churn,
    ]

    def worker(index):
        try:
            start.wait()
            finished[index] = (jobs[index](), ad.last_decision().backend)
        except BaseException as exc:  # noqa: BLE001 - reported in the main thread
            errors.append((index, exc))

    mine = ad.last_decision()  # the main thread's (an earlier test's, or None)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors[:3]
    assert len(finished) == 8
    for index, (expected, last) in finished.items():  # each thread's last decision is its own
        assert last == expected, (index, last, expected)
    assert ad.last_decision() is mine  # the main thread made no call: untouched by the others
    assert "flicker" not in ad.list_backends()
