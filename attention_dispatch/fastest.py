"""policy = "fastest": time every eligible backend once per shape bucket, keep the winner.

A bucket is the Problem with its sizes rounded up to powers of two (all feature flags,
dtype and device kept). Winners live in memory and, when `dispatch.fastest_cache` names
a file, in JSON keyed also by the GPU and library versions, so later processes reuse them;
on a GPU each measurement then also refines the user's performance table for policy="auto"
(perf_table.refine).
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
from typing import NamedTuple

import torch

from . import perf_table, registry
from .caches import register_cache
from .dispatch import Decision, logger
from .problem import Problem
from .torch_private import checkpoint_stop
from .timing import calls_per_sample, collector_off, lower_quartile, pick_winner, tie_note, turn_order


class Measured(NamedTuple):
    """What timing a bucket found (or the JSON file kept of it)."""

    winner: str
    timings: dict[str, float]  # ms per call (lower quartile)
    failures: dict[str, str]  # backends that failed while timed: why
    samples: dict[str, tuple[float, ...]]  # ms, behind each timing (this process only)
    host: dict[str, float]  # host ms per call in those samples (GPU)


_lock = threading.Lock()
_winners: dict[tuple, Measured] = {}
# How a backend is timed (experiment 56): in ROUNDS interleaved rounds, each backend's turn
# is one untimed call and SAMPLES_PER_TURN samples of about SAMPLE_MS each; a backend's
# time is the lower quartile of all its samples (the median until experiment 65).  Short
# turns among other backends' turns are how a model calls attention (between other kernels)
# and how benchmarks/bench.py measures a row; the device's clock holds within a turn and
# moves by up to 10-20% between turns, so more turns of one sample each beat fewer, longer
# ones.  (Before: five loops of ~10 ms back-to-back calls per backend, keeping each one's
# best loop.)
ROUNDS = 11
SAMPLES_PER_TURN = 1
SAMPLE_MS = 0.5
# The first WARM_ROUNDS rounds run the same turns untimed: the clock ramps up from the idle
# device and first calls pay for cold caches (in grid 5e3d454 a measurement with both led
# to flash-attn 4 being pruned at 0.66 ms, where it runs 0.26: experiment 60).
WARM_ROUNDS = 1
# After PRUNE_AFTER timed rounds a backend whose fastest sample is PRUNE_RATIO times the
# leader's lower quartile stops being timed: it cannot win, and a slow one would cost
# seconds per bucket.
PRUNE_AFTER = 3
PRUNE_RATIO = 1.5
# Where every backend's call takes at least LONG_CALL_MS (its warm-up call, timed from the
# host), LONG_ROUNDS timed rounds decide (experiment 72): replayed from the samples that 8 grids
# recorded, choices with the leader at >= 1 ms on the device were as good from 3 to 11 rounds
# (none below 0.97 of the grid's best column in 665), while the rounds of calls of 2 ms or more
# were ~40 s of each grid's ~55 s of timing.  Shorter calls, host-bound ones included, keep ROUNDS.
LONG_CALL_MS = 2.0
LONG_ROUNDS = 6


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


def bucket(problem: Problem) -> Problem:
    """The Problem with sizes rounded up to powers of two: one measurement serves them all."""
    return dataclasses.replace(
        problem, batch=_pow2(problem.batch), seqlen_q=_pow2(problem.seqlen_q), seqlen_k=_pow2(problem.seqlen_k)
    )


def _environment(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    versions = ";".join(f"{n}={registry.get_backend(n).version()}" for n in registry.list_backends())
    return f"{gpu}|torch={torch.__version__}|{versions}"


def _file_key(problem: Problem, device: torch.device) -> str:
    return f"{_environment(device)}|{bucket(problem)!r}"


def _load_file(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("fastest cache %s unreadable (%s); starting afresh", path, exc)
        return {}
    if not isinstance(data, dict):  # valid JSON but not this cache (a list, a string): rebuilt
        logger.warning("fastest cache %s holds a JSON %s, not an object; starting afresh", path, type(data).__name__)
        return {}
    return data


def _store_file(
    path: str, key: str, backend: str, timings: dict[str, float], host: dict[str, float] | None = None
) -> None:
    data = _load_file(path)
    data[key] = {"backend": backend, "timings_ms": timings}
    if host:
        data[key]["host_ms"] = host
    tmp = f"{path}.{os.getpid()}.tmp"
    Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: concurrent processes never read half a file


def runner(name: str, call):
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
        run = backend.prepare(q, k, v, options)  # what sdpa()'s fast path runs for the winner
    extra = () if mask is None else (mask,)
    grad_out: list = []  # made once: a model's dO exists before its backward (a fill is ~25 us at S=512)

    def once():
        with torch.set_grad_enabled(grad):
            out = run(q, k, v, *extra)
            if leaves:
                if not grad_out:
                    grad_out.append(torch.ones_like(out))
                torch.autograd.grad(out, leaves, grad_out[0])

    return once


def time_backends(
    names, call, sync, failures: dict | None = None, samples_out: dict | None = None, host_out: dict | None = None
) -> dict[str, float]:
    """Milliseconds per call of each backend: after one warm-up call each (compilation,
    autotuning) and WARM_ROUNDS untimed rounds, ROUNDS interleaved rounds of short turns (see
    ROUNDS; LONG_ROUNDS where every call is long) in :func:`turn_order`; the lower quartile of
    each backend's samples (kept in ``samples_out`` when given).  On a GPU samples are timed by
    CUDA events once the turn's untimed call has started the stream (:func:`turn_ms_cuda`),
    and ``host_out`` gets the lower quartile of the host's time per call in the same samples."""
    runs, calls = {}, {}
    shortest_ms = math.inf  # the quickest warm-up call: LONG_ROUNDS only where it is long
    for name in names:
        try:
            once = runner(name, call)
            sync()
            once()
            sync()
            start = time.perf_counter()
            once()
            sync()
            took_ms = max(time.perf_counter() - start, 1e-6) * 1e3
        except checkpoint_stop:  # activation checkpointing ends its recomputation: not a failure
            raise
        except Exception as exc:  # a backend that fails to run simply loses
            if failures is not None:
                failures[name] = f"{type(exc).__name__}: {exc}"
            continue
        runs[name], shortest_ms = once, min(shortest_ms, took_ms)
        calls[name] = calls_per_sample(took_ms, SAMPLE_MS)
    rounds = LONG_ROUNDS if LONG_CALL_MS <= shortest_ms < math.inf else ROUNDS
    # The collector is off while samples are taken (as in timeit and benchmarks/bench.py): a
    # collection of the caller's heap stalls the host for milliseconds, and at S <= 1k a
    # training call's 0.5-0.8 ms of host time is most of its turn, so whichever backend it
    # lands on loses (our kernel 0.79 ms with it, 0.70 without, at S=1k causal: experiment 60).
    with collector_off():
        samples, host = _rounds(runs, calls, call.query.device, sync, rounds)
    if samples_out is not None:
        samples_out.update((name, tuple(round(x, 4) for x in s)) for name, s in samples.items())
    if host_out is not None:
        host_out.update((name, round(lower_quartile(s), 4)) for name, s in host.items() if s)
    return {name: lower_quartile(s) for name, s in samples.items()}


def _rounds(runs: dict, calls: dict, device: torch.device, sync, rounds: int = ROUNDS) -> tuple[dict, dict]:
    """The warm and ``rounds`` timed rounds of :func:`time_backends`: each backend's timed
    samples (ms), and on a GPU the host's time per call in each of them (ms; empty lists on the
    CPU, where the samples are the host's time)."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    host: dict[str, list[float]] = {name: [] for name in runs}
    cuda = device.type == "cuda"
    active = list(runs)
    for rnd in range(WARM_ROUNDS + rounds):
        for name in [active[i] for i in turn_order(len(active), rnd)]:
            enqueued: list[float] = []
            if cuda:
                with torch.cuda.device(device):
                    got, enqueued = turn_ms_cuda(runs[name], calls[name])
            else:
                got = turn_ms_host(runs[name], calls[name], sync)
            if rnd >= WARM_ROUNDS:
                samples[name] += got
                host[name] += enqueued
        if rnd + 1 == WARM_ROUNDS + PRUNE_AFTER and len(active) > 1:
            lead = min(lower_quartile(samples[n]) for n in active)
            active = [n for n in active if min(samples[n]) < PRUNE_RATIO * lead]
    return samples, host


def turn_ms_host(once, calls: int, sync) -> list[float]:
    """SAMPLES_PER_TURN samples of ``calls`` calls each after one untimed call, by the host
    clock: milliseconds per call."""
    once()
    sync()
    out = []
    for _ in range(SAMPLES_PER_TURN):
        start = time.perf_counter()
        for _ in range(calls):
            once()
        sync()
        out.append((time.perf_counter() - start) / calls * 1e3)
    return out


def turn_ms_cuda(once, calls: int) -> tuple[list[float], list[float]]:
    """SAMPLES_PER_TURN samples of ``calls`` calls each, enqueued back to back behind one
    untimed call and bracketed by CUDA events: milliseconds per call.  The untimed call
    hides the first call's launch latency (0.1-0.2 ms for flash-attn 4: timed from the host,
    it chose our kernel over a 4% faster flash-attn 4 at S=16k causal, experiment 49); the
    device idles, and the sample pays, only where the host cannot keep up.  (Taking the
    host's time where it was longer, experiment 56, charged cuDNN's S=512 forward 0.17 ms
    against the 0.13 ms it runs in the grid.)  Also returned: the host's time per call while
    enqueueing each sample (ms), which the decision table shows: where it approaches the
    device's, a slower host makes the call host-bound."""
    torch.cuda.synchronize()
    once()
    marks = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(SAMPLES_PER_TURN)
    ]
    enqueued = []
    for start, end in marks:
        began = time.perf_counter()
        start.record()
        for _ in range(calls):
            once()
        end.record()
        enqueued.append((time.perf_counter() - began) * 1e3 / calls)
    marks[-1][1].synchronize()
    return [start.elapsed_time(end) / calls for start, end in marks], enqueued


def _time_backend(name: str, call, sync) -> float:
    """Milliseconds per call of one backend (see :func:`time_backends`)."""
    failures: dict = {}
    timings = time_backends((name,), call, sync, failures)
    if name not in timings:
        raise RuntimeError(failures.get(name, f"{name} did not run"))
    return timings[name]


def _kept(tensor):
    """A saved-tensor hook that keeps the tensor as it is (autograd's own default)."""
    return tensor


def choose_fastest(decision: Decision, call, cache_path: str | None) -> Decision:
    """The Decision with its backend replaced by the measured fastest eligible one."""
    if len(decision.eligible) < 2:
        return decision
    key = (bucket(decision.problem), decision.eligible)
    found = _winners.get(key)
    device = call.query.device
    if found is None and cache_path:
        entry = _load_file(cache_path).get(_file_key(decision.problem, device))
        if isinstance(entry, dict) and entry.get("backend") in decision.eligible:
            found = Measured(
                entry["backend"], dict(entry.get("timings_ms", {})), {}, {}, dict(entry.get("host_ms", {}))
            )
    if found is None:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        failures: dict[str, str] = {}
        samples: dict[str, tuple[float, ...]] = {}
        host: dict[str, float] = {}
        devices = [device] if device.type == "cuda" else []
        # On a GPU the math reference never beats a fused kernel and timing it costs seconds
        # at long sequences (0.8-2.6 s per call measured on the H100): it runs only when alone.
        names = decision.eligible
        if device.type == "cuda":
            names = tuple(n for n in names if not registry.get_backend(n).reference) or names
        # the user's random stream untouched, and the timing's own graphs kept from an enclosing activation
        # checkpoint's saved-tensor hooks (its recomputation, a cache hit, saves only the winner's tensors)
        with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
            timings = time_backends(names, call, sync, failures, samples, host)
        if not timings:
            return decision
        winner = pick_winner(timings, host)
        # kept with the winner: the decision table says why an eligible backend has no time
        found = Measured(winner, timings, failures, samples, host)
        if cache_path:
            with _lock:
                _store_file(cache_path, _file_key(decision.problem, device), winner, timings, host)
                # later processes' policy="auto" ranks this bucket by the measurement too
                perf_table.refine(decision.problem, device, timings, host, failures)
        logger.debug("measured %s: %s (failed: %s)", bucket(decision.problem).summary(), timings, failures)
    with _lock:
        _winners[key] = found
    why = tie_note(found.winner, found.timings, found.host, "policy=fastest")
    notes = ("policy=fastest: the choice was measured",) + ((why,) if why else ())
    return dataclasses.replace(
        decision,
        backend=found.winner,
        timings=found.timings,
        failures={**decision.failures, **found.failures},
        timing_samples=found.samples,
        host_timings=found.host,
        notes=decision.notes + notes,
    )


def forget() -> None:
    """Drop the in-memory measurements (the JSON file is kept)."""
    with _lock:
        _winners.clear()


register_cache("fastest.winners", forget, _winners.__len__)
