"""policy = "fastest": time every eligible backend once per shape bucket, keep the winner.

A bucket is the Problem with its sizes rounded up to powers of two (all feature flags,
dtype and device kept). Winners live in memory and, when `dispatch.fastest_cache` names
a file, in JSON keyed also by the GPU and library versions, so later processes reuse them.
Timing runs on clones of the caller's tensors with the RNG state forked, so the user's
random stream and autograd graph are untouched.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from pathlib import Path

import torch

from . import registry
from .dispatch import Decision, logger
from .problem import Problem

_lock = threading.Lock()
_winners: dict[tuple, tuple[str, dict[str, float]]] = {}
_loaded_files: set[str] = set()
REPEATS = 5
# Each timed sample runs back-to-back calls for about this long.  On a GPU the sample is
# timed by CUDA events after one untimed call has filled the queue, so the first call's
# launch latency (0.1-0.2 ms for flash-attn 4) is not counted: timed from the host, it
# chose our kernel over a 4% faster flash-attn 4 at S=16k causal (experiment 49).
LOOP_SECONDS = 0.010
LOOP_MAX_CALLS = 50


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


def bucket(problem: Problem) -> Problem:
    """The Problem with sizes rounded up to powers of two: one measurement serves them all."""
    return dataclasses.replace(problem, batch=_pow2(problem.batch), seqlen_q=_pow2(problem.seqlen_q),
                               seqlen_k=_pow2(problem.seqlen_k))


def _environment(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    versions = ";".join(f"{n}={registry.get_backend(n).version()}" for n in registry.list_backends())
    return f"{gpu}|torch={torch.__version__}|{versions}"


def _file_key(problem: Problem, device: torch.device) -> str:
    return f"{_environment(device)}|{bucket(problem)!r}"


def _load_file(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("fastest cache %s unreadable (%s); starting afresh", path, exc)
        return {}


def _store_file(path: str, key: str, backend: str, timings: dict[str, float]) -> None:
    data = _load_file(path)
    data[key] = {"backend": backend, "timings_ms": timings}
    tmp = f"{path}.{os.getpid()}.tmp"
    Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)   # atomic: concurrent processes never read half a file


def _runner(name: str, call):
    """One call of backend ``name`` on fresh leaves of ``call``'s inputs (forward, plus the
    backward when the call needs grad), through the backend's prepared runner: the timing
    then counts the per-call host cost that repeated sdpa() calls will pay."""
    backend = registry.get_backend(name)
    grad = call.problem.requires_grad

    def leaf(t):
        return None if t is None else t.detach().clone().requires_grad_(grad and t.requires_grad)

    q, k, v = leaf(call.query), leaf(call.key), leaf(call.value)
    mask = call.options["attn_mask"]
    if mask is not None and mask.is_floating_point():
        mask = leaf(mask)
    options = dict(call.options, attn_mask=mask)
    leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
    with torch.set_grad_enabled(grad):
        run = backend.prepare(q, k, v, options)   # what sdpa()'s fast path runs for the winner
    extra = () if mask is None else (mask,)

    def once():
        with torch.set_grad_enabled(grad):
            out = run(q, k, v, *extra)
            if leaves:
                torch.autograd.grad(out, leaves, torch.ones_like(out))
    return once


def _time_backends(names, call, sync, failures: dict | None = None) -> dict[str, float]:
    """Milliseconds per call of each backend, as a stream of back-to-back calls runs them
    (host overhead counts when it exceeds the GPU time; see :func:`_loop_ms_cuda`).  After one warm-up call each
    (compilation, autotuning), REPEATS rounds time every backend in turn for ~LOOP_SECONDS:
    interleaving exposes all of them to the same clock and power state, and the fastest
    round of each is kept (interference only ever slows a round down)."""
    runs, loops = {}, {}
    for name in names:
        try:
            once = _runner(name, call)
            sync()
            once()
            sync()
            start = time.perf_counter()
            once()
            sync()
            took = max(time.perf_counter() - start, 1e-6)
        except Exception as exc:  # a backend that fails to run simply loses
            if failures is not None:
                failures[name] = f"{type(exc).__name__}: {exc}"
            continue
        runs[name] = once
        loops[name] = max(1, min(LOOP_MAX_CALLS, int(LOOP_SECONDS / took)))
    best = {name: math.inf for name in runs}
    cuda = call.query.device.type == "cuda"
    for _ in range(REPEATS):
        for name, once in runs.items():
            if cuda:
                with torch.cuda.device(call.query.device):
                    took = _loop_ms_cuda(once, loops[name])
            else:
                took = _loop_ms_host(once, loops[name], sync)
            best[name] = min(best[name], took)
    return best


def _loop_ms_host(once, calls: int, sync) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls, by the host clock."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        once()
    sync()
    return (time.perf_counter() - start) / calls * 1e3


def _loop_ms_cuda(once, calls: int) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls in a stream that one untimed call
    has already started: CUDA events time the steady state, where the device idles only when
    the host cannot keep up (so host-bound calls still pay their host time)."""
    torch.cuda.synchronize()
    once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        once()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _time_backend(name: str, call, sync) -> float:
    """Milliseconds per call of one backend (see :func:`_time_backends`)."""
    failures: dict = {}
    timings = _time_backends((name,), call, sync, failures)
    if name not in timings:
        raise RuntimeError(failures.get(name, f"{name} did not run"))
    return timings[name]


def choose_fastest(decision: Decision, call, cache_path: str | None) -> Decision:
    """The Decision with its backend replaced by the measured fastest eligible one."""
    if len(decision.eligible) < 2:
        return decision
    key = (bucket(decision.problem), decision.eligible)
    found = _winners.get(key)
    device = call.query.device
    if found is None and cache_path:
        entry = _load_file(cache_path).get(_file_key(decision.problem, device))
        if entry and entry.get("backend") in decision.eligible:
            found = (entry["backend"], dict(entry.get("timings_ms", {})))
    if found is None:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        failures: dict[str, str] = {}
        devices = [device] if device.type == "cuda" else []
        # On a GPU the math reference never beats a fused kernel and timing it costs seconds
        # at long sequences (0.8-2.6 s per call measured on the H100): it runs only when alone.
        names = decision.eligible
        if device.type == "cuda":
            names = tuple(n for n in names if n != "math") or names
        with torch.random.fork_rng(devices=devices):
            timings = _time_backends(names, call, sync, failures)
        if not timings:
            return decision
        winner = min(timings, key=timings.get)
        found = (winner, timings)
        if cache_path:
            with _lock:
                _store_file(cache_path, _file_key(decision.problem, device), winner, timings)
        logger.debug("measured %s: %s (failed: %s)", bucket(decision.problem).summary(), timings, failures)
    with _lock:
        _winners[key] = found
    winner, timings = found
    return dataclasses.replace(decision, backend=winner, timings=timings,
                               notes=decision.notes + ("policy=fastest: the choice was measured",))


def forget() -> None:
    """Drop the in-memory measurements (the JSON file is kept)."""
    with _lock:
        _winners.clear()
