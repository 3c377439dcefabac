"""Issue 36's forward rows (plain and softcap 30, dense and causal) timed four ways in one process, with the
GPU's SM clock and power while each way ran (GPU).

    python benchmarks/timing_methods.py [--rounds 12] [--json out.json] [--commit SHA]

The ways: ``b2b`` (100 calls back to back behind a spin, kv_device_ab.per_call_ms, kernel_ab's timer),
``each`` (an event pair around each of 60 calls, the median), ``flushed`` (the same with a 256 MB memset
before each call) and ``do_bench`` (triton.testing.do_bench, features.py's timer). A softcap forward's x of
plain moved from x1.03 (do_bench) to x1.19 (b2b) on one H200 held at its 700 W limit (perf-notes E147): the
ways differ in how long the GPU runs at that limit, so each prints its own clocks and power.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from attention_dispatch.kernels.entry import attention_forward  # noqa: E402
from attention_dispatch.kernels.params import KernelParams  # noqa: E402
from benchmarks.kernel_ab import FWD_ROWS, FWD_SHAPE  # noqa: E402
from benchmarks.kv_device_ab import per_call_ms  # noqa: E402

WAYS = ("b2b", "each", "flushed", "do_bench")


def each_ms(fn, flush_buffer=None, reps: int = 60) -> float:
    """Median ms of ``reps`` calls, each between its own pair of events (after a memset of
    ``flush_buffer`` when given)."""
    events = [(torch.cuda.Event(True), torch.cuda.Event(True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in events:
        if flush_buffer is not None:
            flush_buffer.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


class SmiSampler:
    """nvidia-smi's SM clock (MHz) and power (W) every 50 ms into a file, read back by time window."""

    def __init__(self):
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        query = "--query-gpu=timestamp,clocks.sm,power.draw"
        self.proc = subprocess.Popen(
            [
                "nvidia-smi",
                query,
                "--format=csv,noheader,nounits",
                "-lms",
                "50",
                "-i",
                str(torch.cuda.current_device()),
            ],
            stdout=self.log,
            stderr=subprocess.DEVNULL,
        )

    def samples(self):
        """[(unix time, MHz, W)] so far."""
        if self.proc is None:
            return []
        self.log.flush()
        out = []
        for line in Path(self.log.name).read_text().splitlines():
            try:
                stamp, mhz, watts = (x.strip() for x in line.split(","))
                t = time.mktime(time.strptime(stamp.split(".")[0], "%Y/%m/%d %H:%M:%S")) + float(
                    "0." + stamp.split(".")[1]
                )
                out.append((t, float(mhz), float(watts)))
            except (ValueError, IndexError):
                continue
        return out

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--json", default=None)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args(argv)
    import triton.testing

    B, H, S, D = FWD_SHAPE
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flush_buffer = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    calls = {}
    for label, causal, softcap in FWD_ROWS:
        p = KernelParams(scale=D**-0.5, window_right=0 if causal else -1, align_bottom_right=True, softcap=softcap)
        calls[label] = lambda p=p: attention_forward(q, k, v, None, p, need_lse=False)[0]
        calls[label]()
    torch.cuda.synchronize()
    timers = {
        "b2b": lambda fn: per_call_ms(fn, 100, 0.5)[0],
        "each": lambda fn: each_ms(fn),
        "flushed": lambda fn: each_ms(fn, flush_buffer),
        "do_bench": lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60),
    }
    times = {(label, way): [] for label in calls for way in WAYS}
    windows = {way: [] for way in WAYS}  # (start, end) unix times of each way's timings
    smi = SmiSampler()
    try:
        for _ in range(args.rounds):
            for way in WAYS:
                for label, fn in calls.items():
                    t0 = time.time()
                    times[(label, way)].append(timers[way](fn))
                    windows[way].append((t0, time.time()))
        samples = smi.samples()
    finally:
        smi.stop()
    print(torch.cuda.get_device_name(), f"| torch {torch.__version__} | {args.rounds} rounds | {args.commit}")
    result = {"commit": args.commit, "device": torch.cuda.get_device_name(), "rows": {}, "smi": {}}
    for way in WAYS:
        inside = [(mhz, w) for t, mhz, w in samples if any(a <= t <= b for a, b in windows[way])]
        if inside:
            mhz = statistics.median(m for m, _ in inside)
            watts = statistics.median(w for _, w in inside)
            result["smi"][way] = {"mhz": mhz, "watts": watts, "samples": len(inside)}
    print(f"{'row':20s} " + " ".join(f"{way:>16s}" for way in WAYS) + "   (ms, x of plain)")
    for label in calls:
        plain = label.replace("softcap", "plain")
        cells, row = [], {}
        for way in WAYS:
            ms = statistics.median(times[(label, way)])
            of_plain = ms / statistics.median(times[(plain, way)])
            row[way] = {"ms": ms, "x_of_plain": of_plain, "all_ms": times[(label, way)]}
            cells.append(f"{ms:7.4f} x{of_plain:5.3f}")
        result["rows"][label] = row
        print(f"{label:20s} " + " ".join(f"{c:>16s}" for c in cells))
    print(
        f"{'SM MHz / W':20s} "
        + " ".join(
            f"{'%.0f / %.0f' % (s['mhz'], s['watts']) if (s := result['smi'].get(way)) else '-':>16s}" for way in WAYS
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
