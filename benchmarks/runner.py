"""The measuring side of bench.py: each row's implementations warmed up, timed in interleaved
rounds of turns (turns.py) and checked against each other; the compile workers' side too."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
import traceback

from attention_dispatch.timing import calls_per_sample, collector_off, lower_quartile
from benchmarks.details_log import Log, first_line
from benchmarks.grid import COMPILING_IMPLS, MODES, OURS, Row, flops, support, tflops
from benchmarks.implementations import Implementations
from benchmarks.report import fmt_num
from benchmarks.targets import chosen_column
from benchmarks.turns import PAIRED, pair_choices, slow_turns, turn_order, warm_calls


# A cell's time from its repetitions (experiment 62): slowdowns from the clock state a previous
# turn left and from host hiccups are one-sided, so the lower quartile measures the call; a
# quarter of the repetitions must agree on it, so one lucky repetition cannot set it (the minimum).
STATISTIC = "lower quartile"


class _HostEvent:
    """torch.cuda.Event's timing interface on the host clock (for --smoke-cpu)."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        """Host timestamps are final when taken: nothing to wait for."""

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


class Runner(Implementations):
    """Measures rows: the implementations (Implementations), the Flex compile cache and the
    clock of the time budget."""

    def __init__(self, args, log: Log):
        self.t0 = time.perf_counter()
        super().__init__(args, log)
        self.flex_compile_s = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    # -- timing ------------------------------------------------------------------------------
    def events(self):
        """(start, end) CUDA events; on the CPU (--smoke-cpu) host-clock stand-ins."""
        if self.cuda:
            return self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        return _HostEvent(), _HostEvent()

    def _one_call_ms(self, fn) -> float:
        s, e = self.events()
        s.record()
        fn()
        e.record()
        e.synchronize()
        return max(s.elapsed_time(e), 1e-3)

    def warm(self, fn) -> dict:
        """First call (compile / warm-up), an estimate, one more warm-up: how many calls a
        repetition groups (`inner` > 1 only for calls under 0.5 ms) and how many repetitions
        fit --target-ms."""
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        first = time.perf_counter() - t
        est = self._one_call_ms(fn)
        if est > 1000.0:
            # sdpa()'s second call prepares its fast path (flash-attn 4's relaunch records and
            # compiles there: ~1-2 s once); a third call tells a slow path from that
            est = self._one_call_ms(fn)
        if est > 1000.0:  # a very slow path: one measurement is enough
            return dict(est=est, reps=1, inner=1, first_call_s=first)
        inner = calls_per_sample(est, 0.5)
        reps = int(min(self.args.max_reps, max(3, self.args.target_ms / (est * inner))))
        fn()
        return dict(est=est, reps=reps, inner=inner, first_call_s=first)

    def sample(self, fn, reps: int, inner: int) -> list[float]:
        """`reps` repetitions of `inner` calls, each between its own pair of CUDA events, all
        enqueued back to back with one synchronisation at the end (as triton.testing.do_bench,
        without its L2 flush): device time of a call in steady state, not the host latency
        before its first kernel (benchmarks/overhead.py measures that).  Milliseconds per call.
        The garbage collector is off meanwhile (as in timeit): a collection of this process's
        large heap stalls the host for milliseconds, and the device idles until the next launch."""
        marks = [self.events() for _ in range(reps)]
        with collector_off():
            for s, e in marks:
                s.record()
                for _ in range(inner):
                    fn()
                e.record()
            self.sync()
        return [s.elapsed_time(e) / inner for s, e in marks]

    @staticmethod
    def summarize(w: dict, times: list[float]) -> dict:
        """A cell from its repetitions (ms per call): `ms` is their lower quartile (STATISTIC),
        `ms_median` the median, `spread` (slowest - fastest) / ms."""
        ms = lower_quartile(times)
        return dict(
            ms=ms,
            ms_median=statistics.median(times),
            reps=len(times),
            inner=w["inner"],
            first_call_s=w["first_call_s"],
            spread=(max(times) - min(times)) / ms,
            samples_ms=[round(t, 4) for t in times],
        )

    def time_fn(self, fn) -> dict:
        """One implementation alone: warm(), then all its repetitions (summarize())."""
        w = self.warm(fn)
        if w["est"] > 1000.0:  # a very slow path: the estimate is the measurement
            return dict(ms=w["est"], reps=1, inner=1, first_call_s=w["first_call_s"])
        return self.summarize(w, self.sample(fn, w["reps"], w["inner"]))

    def peak_mib(self, fn) -> float | None:
        torch = self.torch
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    # -- one row -----------------------------------------------------------------------------
    def run_row(self, row: Row, impls: list[str]) -> dict:
        log = self.log
        entry = {"row": row.to_json(), "results": {}}
        if self.left() <= 0:
            for impl in impls:
                entry["results"][impl] = {m: dict(status="skipped", note="time budget") for m in MODES}
            return entry
        log(
            f"\n== {row.id}  B={row.B} Hq={row.Hq} Hkv={row.Hkv} S={row.S} D={row.D} "
            f"fwd {flops(row, 'fwd') / 1e12:.3f} TFLOP  [t={self.elapsed():.0f}s]"
        )
        try:
            inp = self.make_inputs(row)
        except Exception as e:  # noqa: BLE001
            log(f"  inputs failed: {first_line(e)}")
            for impl in impls:
                entry["results"][impl] = {m: dict(status="error", note="inputs: " + first_line(e)) for m in MODES}
            return entry
        ref_holder: dict = {}  # the first checked output of the row: (impl, tensor)
        pending: list = []  # (impl, mode, call, context, warm-up facts)
        for impl in impls:
            res = entry["results"].setdefault(impl, {})
            self.run_impl(impl, row, inp, res, ref_holder, pending)
        self.measure_rounds(row, entry, pending)
        del inp, ref_holder, pending
        self.empty_cache()
        return entry

    def measure_rounds(self, row: Row, entry: dict, pending: list) -> None:
        """Every warmed-up (implementation, mode) of the row is timed in --rounds interleaved
        rounds, in a new order each round (:func:`turn_order`), each turn after untimed calls of at least
        --turn-warm-ms, and reported as the lower quartile of all its repetitions (STATISTIC): the card's clock
        and power state drift by ~10% over a row (a column measured alone could win or lose
        by that much, docs/experiments/perf-notes.md experiments 21 and 24), and a turn's speed depends on
        what ran before it (up to 8% for flash-attn 4, experiment 32; 20 ms of untimed calls
        per turn did not make two columns running the same kernel agree better, so the
        default is one call)."""
        log, rounds = self.log, max(1, self.args.rounds)
        times: dict[int, list[float]] = {i: [] for i in range(len(pending))}
        turns = {i: 0 for i in range(len(pending))}
        failed: dict[int, str] = {}
        slow: set[int] = set()
        turn_names = [(impl, m) for impl, m, *_ in pending]
        chosen = {
            (impl, m): c
            for impl in PAIRED
            for m in MODES
            if self.args.pair_fastest and (c := chosen_column(entry["results"], m, impl))
        }
        gc.collect()  # sample() keeps the collector off while it times; start from a clean heap
        for rnd in range(rounds):
            if rnd == 1:
                slow = slow_turns(
                    {i: (pending[i][1], times[i][0]) for i in times if times[i] and i not in failed},
                    self.args.slow_factor,
                    keep={i for i, p in enumerate(pending) if p[0] in OURS},
                )
            # paired, rounds 2k and 2k + 1 share one order (only the pair's two turns swap): both
            # sides of the pair go first after the same turn, whose clock state the first inherits
            order = turn_order(len(pending), row.id, rnd // 2 if chosen else rnd, self.args.seed)
            for i in pair_choices(order, turn_names, chosen, rnd):
                impl, m, fn, ctx, w = pending[i]
                if i in failed or w["est"] > 1000.0 and times[i] or i in slow and rnd >= self.args.slow_rounds:
                    continue
                n = 1 if w["est"] > 1000.0 else max(self.args.min_per_turn, math.ceil(w["reps"] / rounds))
                try:
                    with ctx():
                        if w["est"] <= 1000.0:
                            # untimed calls first: the first call of each turn ran up to ~35% slower
                            # for every implementation alike (experiment 24, samples_ms), and the
                            # clock follows the previous turn's implementation (experiment 32)
                            for _ in range(warm_calls(w["est"], self.args.turn_warm_ms)):
                                fn()
                        times[i] += self.sample(fn, n, w["inner"])
                    turns[i] += 1
                except Exception as e:  # noqa: BLE001
                    failed[i] = first_line(e)
                    with contextlib.suppress(Exception):
                        self.sync()
        for i, (impl, m, fn, ctx, w) in enumerate(pending):
            res = entry["results"][impl]
            if i in failed:
                res[m] = dict(status="error", note=failed[i])
                log(f"  {impl:16s} {m:8s} err: {failed[i]}")
                continue
            r = dict(res[m], **self.summarize(w, times[i]))
            r.update(status="ok", tflops=tflops(row, m, r["ms"]), rounds=turns[i])
            if (column := chosen.get((impl, m))) and (column, m) in turn_names:
                r["paired_with"] = column  # its turns ran next to that column's (pair_choices)
            res[m] = r
            log(
                f"  {impl:16s} {m:8s} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s  peak "
                f"{fmt_num(r.get('peak_mib')):>6s} MiB  reps {r['reps']}x{r['inner']}  first {r['first_call_s']:.2f} s  "
                f"spread {r.get('spread', 0):.2f}"
            )

    def run_impl(self, impl: str, row: Row, inp: dict, res: dict, ref_holder: dict, pending: list) -> None:
        """Prepare one implementation for the row and warm up each supported mode (compile,
        estimate, peak memory, the decision it logged, the output check); the timing itself
        is left to measure_rounds (appended to `pending`)."""
        log, args = self.log, self.args
        reasons = {m: support(impl, row, m, args.flex) for m in MODES}
        if impl == "fa4" and self.fa4 is None:
            reasons = {m: reasons[m] or f"not importable: {self.fa4_error}" for m in MODES}
        if impl == "flex" and self.flex_fn is None:
            reasons = {m: reasons[m] or f"unavailable: {self.flex_error}" for m in MODES}
        if impl == "flex" and all(r is None for r in reasons.values()):
            if self.flex_compile_s >= args.flex_budget_s:
                reasons = {m: "Flex compile budget spent (--flex-budget-s)" for m in MODES}
            elif self.left() < 30:
                reasons = {m: "too little time left to compile Flex" for m in MODES}
        for m in MODES:
            if reasons[m] is not None:
                skipped = "budget" in reasons[m] or "time left" in reasons[m]
                res[m] = dict(status="skipped" if skipped else "unsupported", note=reasons[m])
        todo = [m for m in MODES if reasons[m] is None]
        if not todo:
            log(f"  {impl:16s} -  ({reasons['fwd']})")
            return
        try:
            fwd, leaves, go, canon, ctx = self.prepare(impl, row, inp)
        except Exception as e:  # noqa: BLE001
            for m in todo:
                res[m] = dict(status="error", note="prepare: " + first_line(e))
            log(f"  {impl:16s} err prepare: {first_line(e)}")
            return

        fns = self.mode_calls(impl, fwd, leaves, go)
        with ctx():
            for m in todo:
                if self.left() <= 0:
                    res[m] = dict(status="skipped", note="time budget")
                    continue
                t = time.perf_counter()
                try:
                    w = self.warm(fns[m])
                    r = dict(status="pending", first_call_s=w["first_call_s"], peak_mib=self.peak_mib(fns[m]))
                    if impl in ("sdpa", "fastest"):  # its choice in this mode (forward and fwd+bwd may differ)
                        d = self.ad.last_decision()
                        r["backend"] = getattr(d, "backend", None)
                        if impl == "fastest":  # the backends it could choose in this mode, what it timed
                            timings = getattr(d, "timings", None) or {}
                            r["eligible"] = list(getattr(d, "eligible", ()))
                            r["measured"] = list(timings)
                            r["measured_ms"] = {name: round(ms, 4) for name, ms in timings.items()}
                            # the raw samples: other statistics can be judged from one grid
                            r["measured_samples"] = {
                                n: list(x) for n, x in (getattr(d, "timing_samples", None) or {}).items()
                            }
                            # the host's time per call in those samples (GPU): how near each was to host-bound
                            r["measured_host_ms"] = dict(getattr(d, "host_timings", None) or {})
                            r["failed"] = dict(getattr(d, "failures", None) or {})
                            for name, why in r["failed"].items():
                                log(f"  {'':16s} fastest: {name} failed while timed: {why}")
                    res[m] = r
                    pending.append((impl, m, fns[m], ctx, w))
                except Exception as e:  # noqa: BLE001
                    res[m] = dict(status="error", note=first_line(e))
                    log(f"  {impl:16s} {m:8s} err: {first_line(e)}")
                    if os.environ.get("BENCH_TRACEBACK"):
                        log(traceback.format_exc())
                    with contextlib.suppress(Exception):
                        self.sync()
                if impl == "flex":  # the first call of each mode compiles (forward, then backward)
                    self.flex_compile_s += res[m].get("first_call_s", time.perf_counter() - t)
            warmed = [m for m in todo if res[m].get("status") == "pending"]
            if impl in OURS and warmed:
                try:
                    d = self.ad.last_decision()
                    res["backend"] = getattr(d, "backend", None)
                    if impl != "triton":
                        timings = getattr(d, "timings", None) or {}
                        log(
                            f"  {'':16s} {impl} chose {res['backend']}"
                            + (
                                f" (measured ms: {', '.join(f'{k} {v:.3f}' for k, v in timings.items())})"
                                if timings
                                else ""
                            )
                        )
                except Exception as e:  # noqa: BLE001
                    res["backend"] = f"? ({first_line(e)})"
            if not args.no_check and row.dropout_p == 0 and "fwd" in warmed:
                self.check(impl, fwd, canon, res, ref_holder)

    def compile_row(self, row: Row, impls: list[str]) -> dict:
        """Worker side of --precompile-workers: call each compiling implementation once per
        mode exactly as run_impl will (same inputs, grad modes and contexts), timing nothing;
        errors are reported, not raised (the measuring process meets them again)."""
        t = time.perf_counter()
        errors = []
        inp = self.make_inputs(row)
        for impl in impls:
            if (
                impl not in COMPILING_IMPLS
                or (impl == "fa4" and self.fa4 is None)
                or (impl == "flex" and self.flex_fn is None)
            ):
                continue
            modes = [m for m in MODES if support(impl, row, m, self.args.flex) is None]
            if not modes:
                continue
            try:
                fwd, leaves, go, _canon, ctx = self.prepare(impl, row, inp)
                fns = self.mode_calls(impl, fwd, leaves, go)
                with ctx():
                    for m in modes:
                        fns[m]()
                self.sync()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{impl}: {first_line(e)}")
        del inp
        self.empty_cache()
        return {"row": row.id, "s": round(time.perf_counter() - t, 2), "errors": errors}

    def check(self, impl, fwd, canon, res, ref_holder) -> None:
        """Relative error of this output against the first measured implementation's."""
        try:
            # with grad enabled, as measured: no_grad would recompile Flex and change sdpa()'s Problem
            out = canon(fwd()).detach().float()
            ref = ref_holder.get("ref")
            if ref is None:
                ref_holder["ref"] = (impl, out)
                res["ref"] = impl
                return
            name, r = ref
            err = ((out - r).norm() / r.norm().clamp_min(1e-30)).item()
            res["rel_err"], res["ref"] = err, name
            if not math.isfinite(err) or err > 2e-2:
                res["mismatch"] = True
                self.log(f"  {impl:16s} MISMATCH: relative error {err:.3g} against {name}")
                self.notes.append(f"{impl} output differs from {name} (relative error {err:.3g})")
        except Exception as e:  # noqa: BLE001
            res["check_error"] = first_line(e)
