"""What the numerics guard costs per call (issue 38: with sample = 0.01, at most 2% of call time).

    python benchmarks/guard_overhead.py [--device cuda|cpu] [--calls 100] [--budget-s 96] [--json FILE]

For each row (bf16 on CUDA, float32 on the CPU; causal; inference and training) sdpa() is timed
with the guard off, in mode "first" (after its first call), in mode "sample" (sample = 0.01)
with sample_verdict "deferred" (the check queued, no host sync) and "immediate" (a sync each),
and "off2" (off again: the A/A control, whose overhead against off is the measurement's noise).

Paired rounds: each round times one turn of every mode back to back, in an order shuffled per
round (attention_dispatch.timing.turn_order); a turn is its mode's use_config() scope, one
untimed call, then --calls calls enqueued back to back between two CUDA events, then one sync.
A mode's overhead in a round is its turn's time over the same round's "off" turn; reported per
row: the median of those ratios and their interquartile range (IQR), over as many rounds as fit
the row's share of --budget-s (at least --min-rounds).  A turn is read whole, not by the lower
quartile of its calls (bench.py's cell statistic): the checked call is one call of the turn.
The collector is off while a row is timed.

Sampling is a fixed pattern: the guard's random source (policy/guard.py draws one uniform
number per call, a check when it is below `sample`) is replaced by :class:`EveryNth`, which
gives the check to the middle call of each 1/sample calls, so that a turn of --calls calls (a
multiple of 100) checks exactly calls x sample of them; the row picks stay random.

Verdict: the median's uncertainty is a box plot's notch, 1.57 x IQR / sqrt(rounds), with the
larger of the row's sample IQR and its A/A IQR: "met" when every row's median + notch <= 2%,
"not met" when one row's median - notch > 2%, else "within noise".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.policy import guard, guard_triton  # noqa: E402
from attention_dispatch.timing import collector_off, lower_quartile, turn_order  # noqa: E402
from benchmarks.runner import _HostEvent  # noqa: E402

MODES = {
    "off": {"mode": "off"},
    "off2": {"mode": "off"},  # the A/A control (the same config as off)
    "first": {"mode": "first"},
    "sample": {"mode": "sample", "sample": 0.01},
    "sample_immediate": {"mode": "sample", "sample": 0.01, "sample_verdict": "immediate"},
}
SHOWN = [m for m in MODES if m != "off"]
SAMPLED = [m for m in MODES if MODES[m]["mode"] == "sample"]
PERIOD = round(1 / MODES["sample"]["sample"])  # calls per check
TARGET_PCT = 2.0
PASSES = ("fwd", "fwd+bwd")
NOTCH = 1.57  # a box plot's notch: median +- 1.57 IQR / sqrt(n) (~95% interval of the median)


class EveryNth:
    """The guard's random source with random() replaced by a fixed pattern: draw i (since
    :meth:`reset`) is 0.0 (checked) when i % period == period // 2, else 0.5 (not checked, for
    any sample fraction <= 0.5).  Everything else (the row picks) goes to a seeded Random."""

    def __init__(self, real, period: int):
        self.real, self.period = real, period
        self.reset()

    def reset(self) -> None:
        self.draws = self.hits = 0

    def random(self) -> float:
        hit = self.draws % self.period == self.period // 2
        self.draws += 1
        self.hits += hit
        return 0.0 if hit else 0.5

    def __getattr__(self, name):
        return getattr(self.real, name)


@contextlib.contextmanager
def fixed_sampling(period: int = PERIOD, seed: int = 0):
    """guard._rng is an EveryNth while inside, restored after; sdpa()'s fast paths are emptied on
    both sides, since a sampled runner binds the draw it was made with."""
    ad.clear_cache()
    saved, guard._rng = guard._rng, EveryNth(random.Random(seed), period)
    try:
        yield guard._rng
    finally:
        guard._rng = saved
        ad.clear_cache()


def rows(device: str, seqlens: list[int] | None = None, passes: tuple[str, ...] = PASSES):
    """(B, H, S, D, grad): the doc table's rows on CUDA, small ones on the CPU; --seqlens keeps
    the first row's B, H, D at the given lengths; --passes picks fwd and/or fwd+bwd."""
    if device == "cuda":
        shapes = [(4, 16, 1024, 128), (1, 16, 4096, 128), (1, 16, 16384, 128)]
    else:
        shapes = [(1, 4, 128, 64), (1, 4, 512, 64)]
    if seqlens:
        shapes = [(*shapes[0][:2], s, shapes[0][3]) for s in seqlens]
    return [(*shape, p == "fwd+bwd") for shape in shapes for p in PASSES if p in passes]


def quartiles_pct(ratios: list[float]) -> dict:
    """Median and IQR of per-round ratios, as overheads in percent."""
    pct = [100 * (r - 1) for r in ratios]
    q1, med, q3 = statistics.quantiles(pct, n=4, method="inclusive") if len(pct) > 1 else (pct[0],) * 3
    return dict(median=med, q1=q1, q3=q3, iqr=q3 - q1)


def measure_row(call, calls: int, budget_s: float, min_rounds: int, max_rounds: int, salt: str, events, sync, draws):
    """Paired rounds of one row (module doc): ({mode: ms per call of each round}, {mode: checks
    of each round}, [each round's order])."""
    names = list(MODES)
    ms = {m: [] for m in names}
    checks = {m: [] for m in names}
    orders = []
    gc.collect()  # the collector is off while timing: start from a clean heap
    began = time.perf_counter()
    with collector_off():
        rnd = 0
        while rnd < min_rounds or (rnd < max_rounds and time.perf_counter() - began < budget_s):
            order = [names[i] for i in turn_order(len(names), rnd, salt)]
            for mode in order:
                start, end = events()
                with ad.use_config({"guard": MODES[mode]}):
                    call()  # untimed: the scope's first call
                    draws.reset()
                    start.record()
                    for _ in range(calls):
                        call()
                    end.record()
                    checks[mode].append(draws.hits)
                    ad.guard_flush()
                sync()
                ms[mode].append(start.elapsed_time(end) / calls)
            orders.append(order)
            rnd += 1
    return ms, checks, orders


def summarize(ms: dict, checks: dict) -> dict:
    """A row's reading: the off turns' lower quartile (ms per call) and, per shown mode, the
    median and IQR of its per-round overhead against the same round's off turn."""
    out = dict(off_ms=lower_quartile(ms["off"]), rounds=len(ms["off"]), overhead_pct={})
    for m in SHOWN:
        out["overhead_pct"][m] = quartiles_pct([a / b for a, b in zip(ms[m], ms["off"])])
    out["checks_per_turn"] = {m: sorted(set(checks[m])) for m in MODES}
    return out


def verdict(results: list[dict], target: float = TARGET_PCT) -> str:
    """The closing line (module doc): worst sampled median, met / not met / within noise."""

    def notch(r):
        iqr = max(r["overhead_pct"]["sample"]["iqr"], r["overhead_pct"]["off2"]["iqr"])
        return NOTCH * iqr / math.sqrt(r["rounds"])

    worst = max(results, key=lambda r: r["overhead_pct"]["sample"]["median"])
    x = worst["overhead_pct"]["sample"]["median"]
    aa = worst["overhead_pct"]["off2"]
    if all(r["overhead_pct"]["sample"]["median"] + notch(r) <= target for r in results):
        said = "met"
    elif any(r["overhead_pct"]["sample"]["median"] - notch(r) > target for r in results):
        said = "not met"
    else:
        said = "within noise"
    return (
        f"worst sample overhead {x:+.2f}% (target <= {target:g}%): {said} (A/A IQR {aa['iqr']:.2f}%, "
        f"A/A median {aa['median']:+.2f}%; {worst['name']}, {worst['rounds']} rounds, median +- {notch(worst):.2f}%)"
    )


def table(results: list[dict]) -> list[str]:
    cell = 20
    lines = [f"{'row':<32} {'off ms':>8} {'rounds':>6} " + " ".join(f"{m:>{cell}}" for m in SHOWN)]
    lines.append(f"{'':<32} {'':>8} {'':>6} " + " ".join(f"{'median (IQR)':>{cell}}" for _ in SHOWN))
    for r in results:
        cells = [f"{o['median']:+.2f}% ({o['iqr']:.2f})" for o in (r["overhead_pct"][m] for m in SHOWN)]
        lines.append(f"{r['name']:<32} {r['off_ms']:>8.4f} {r['rounds']:>6} " + " ".join(f"{c:>{cell}}" for c in cells))
    return lines


def check_path(q, k, v) -> str:
    """How a sampled check of this row ran: policy/guard_triton.py's one kernel, or torch ops and why."""
    if guard_triton._broken:
        return f"torch ops (the one-kernel check failed to build: {guard_triton._broken[0][:120]})"
    options = dict(attn_mask=None, cu_seqlens_q=None, dropout_p=0.0)
    if q.device.type == "cuda" and guard_triton.supported(q, k, v, options, q, None, None):
        return "one Triton kernel (policy/guard_triton.py)"
    return "torch ops (policy/guard_rows.py: graph or eager)"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=100, help=f"calls per turn, a multiple of {PERIOD}")
    parser.add_argument("--budget-s", type=float, default=96.0, help="seconds of rounds, shared by the rows")
    parser.add_argument("--min-rounds", type=int, default=5)
    parser.add_argument("--max-rounds", type=int, default=400)
    parser.add_argument("--seqlens", default=None, help="comma-separated lengths instead of the default rows")
    parser.add_argument("--passes", default=",".join(PASSES), help="comma-separated: fwd, fwd+bwd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.calls < PERIOD or args.calls % PERIOD:
        parser.error(f"--calls must be a positive multiple of {PERIOD} (1 / sample), got {args.calls}")
    args.passes = tuple(args.passes.split(","))
    if not args.passes or set(args.passes) - set(PASSES):
        parser.error(f"--passes takes {', '.join(PASSES)}, got {','.join(args.passes)}")
    if args.min_rounds < 2 or args.max_rounds < args.min_rounds:
        parser.error(f"need 2 <= --min-rounds <= --max-rounds, got {args.min_rounds} and {args.max_rounds}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    events = (
        (lambda: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        if cuda
        else (lambda: (_HostEvent(), _HostEvent()))
    )
    chosen = rows(device, [int(s) for s in args.seqlens.split(",")] if args.seqlens else None, args.passes)
    began = time.perf_counter()
    results = []
    with fixed_sampling(seed=args.seed) as draws:
        for b, h, s, d, grad in chosen:
            q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))

            def call():
                out = ad.sdpa(q, k, v, is_causal=True)
                if grad:
                    out.backward(torch.ones_like(out))

            for mode in MODES:  # warm: compile, decide, the guard's first check
                with ad.use_config({"guard": MODES[mode]}):
                    for _ in range(3):
                        call()
                    ad.guard_flush()
                sync()
            name = f"B={b} H={h} S={s} D={d} {'fwd+bwd' if grad else 'fwd'}"
            budget = args.budget_s / len(chosen)
            ms, checks, orders = measure_row(
                call, args.calls, budget, args.min_rounds, args.max_rounds, f"{args.seed}-{name}", events, sync, draws
            )
            row = dict(name=name, **summarize(ms, checks), ms=ms, orders=orders, check_path=check_path(q, k, v))
            results.append(row)
            pct = "  ".join(f"{m} {row['overhead_pct'][m]['median']:+.2f}%" for m in SHOWN)
            print(f"{name:<32} off {row['off_ms']:.4f} ms  {row['rounds']} rounds  {pct}", flush=True)
    print(f"\n{len(chosen)} rows in {time.perf_counter() - began:.0f} s; {args.calls} calls a turn, checks a turn:")
    print("  " + ", ".join(f"{m} {sorted({c for r in results for c in r['checks_per_turn'][m]})}" for m in MODES))
    print("  check path: " + "; ".join(sorted({r["check_path"] for r in results})))
    print("\n".join(table(results)))
    print(verdict(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
