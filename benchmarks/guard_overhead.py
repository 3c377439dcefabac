"""What the numerics guard costs per call (issue 38: with sample = 0.01, at most 2% of call time).

    python benchmarks/guard_overhead.py [--device cuda|cpu] [--calls 200] [--rounds 9] [--json FILE]

For each row (bf16 on CUDA, float32 on the CPU; causal; inference and training) sdpa() is timed
with the guard off, in mode "first" (after its first call) and in mode "sample" (sample = 0.01)
with sample_verdict "deferred" (default: the check queued, no host sync) and "immediate" (the
verdict read at once, a sync each), in interleaved rounds of --calls calls each (the order
rotating), on the same tensors, every mode under its own use_config() scope; "off2" (off again)
is the A/A control: its overhead against off is the noise of the measurement.  Reported: the
median ms per call of each and the overhead against off in percent.  A sampled check's share is
~sample x (its device time) / call time; deferred verdicts are flushed before each round's sync.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import attention_dispatch as ad  # noqa: E402

MODES = {
    "off": {"mode": "off"},
    "off2": {"mode": "off"},  # the A/A control (the same config object as off)
    "first": {"mode": "first"},
    "sample": {"mode": "sample", "sample": 0.01},
    "sample_immediate": {"mode": "sample", "sample": 0.01, "sample_verdict": "immediate"},
}
SHOWN = [m for m in MODES if m != "off"]


def rows(device: str):
    if device == "cuda":
        return [(b, 16, s, 128, grad) for b, s in ((4, 1024), (1, 4096), (1, 16384)) for grad in (False, True)]
    return [(1, 4, s, 64, grad) for s in (128, 512) for grad in (False, True)]


def time_mode(mode, fn, calls: int, sync) -> float:
    with ad.use_config({"guard": MODES[mode]}):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        ad.guard_flush()
        sync()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = []
    for b, h, s, d, grad in rows(device):
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))

        def call():
            out = ad.sdpa(q, k, v, is_causal=True)
            if grad:
                out.backward(torch.ones_like(out))

        for mode in MODES:  # warm: compile, decide, the guard's first check
            time_mode(mode, call, 3, sync)
        times = {mode: [] for mode in MODES}
        names = list(MODES)
        for r in range(args.rounds):
            for mode in names[r % len(names) :] + names[: r % len(names)]:
                times[mode].append(time_mode(mode, call, args.calls, sync))
        med = {mode: statistics.median(t) for mode, t in times.items()}
        row = dict(shape=f"B={b} H={h} S={s} D={d}", grad=grad, ms=med)
        row["overhead_pct"] = {m: 100 * (med[m] / med["off"] - 1) for m in SHOWN}
        results.append(row)
        pct = "  ".join(f"{m} {row['overhead_pct'][m]:+.2f}%" for m in SHOWN)
        print(f"{row['shape']:<24} {'fwd+bwd' if grad else 'fwd':<8} off {med['off']:.4f} ms  {pct}", flush=True)
    print(f"\n{'row':<32} {'off ms':>8} " + " ".join(f"{m:>17}" for m in SHOWN))
    for r in results:
        name = f"{r['shape']} {'fwd+bwd' if r['grad'] else 'fwd'}"
        print(f"{name:<32} {r['ms']['off']:>8.4f} " + " ".join(f"{r['overhead_pct'][m]:>+16.2f}%" for m in SHOWN))
    worst = max(r["overhead_pct"]["sample"] for r in results)
    noise = max(abs(r["overhead_pct"]["off2"]) for r in results)
    verdict = "met" if worst <= 2 else "NOT met"
    print(f"worst sample=0.01 (deferred) overhead: {worst:+.2f}% (target <= 2%): {verdict}; A/A noise <= {noise:.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
