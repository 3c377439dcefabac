"""Issue 36's forward rows and issue 34's chunked-prefill rows timed several ways in one process, with the
GPU's SM clock and power while each way ran (GPU).

    python benchmarks/timing_methods.py [--cases fwd,train,kv] [--ways b2b,each,flushed,do_bench,sustained,kernel]
        [--rounds 12] [--sustain-ms 300] [--json out.json] [--commit SHA]

Ways: ``b2b`` (100 calls back to back behind a spin, kv_device_ab.per_call_ms, kernel_ab's timer), ``each``
(an event pair around each of 60 calls, the median), ``flushed`` (the same with a 256 MB memset before each
call), ``do_bench`` (triton.testing.do_bench, features.py's timer) and ``sustained`` (back to back for
``--sustain-ms`` a turn, nvidia-smi sampling every 20 ms: the median SM MHz and W inside the turns, and the work
a clock, TFLOP/s per GHz, which a clock that drops under the power limit leaves unchanged) and ``kernel`` (the
kernels' own durations, CUPTI through torch.profiler, over a burst of 15 calls from an idle GPU: no launch gaps, no
host time, and the GPU idle between bursts, so the clock stays near boost; E148 read it within +-0.5% a turn where
b2b's turns spread 18%).

Cases: ``fwd``: features.py's forward (bf16 B4 H16 S=4k d128), plain and softcap 30, dense and causal, and
flash-attn 4 plain and softcap where installed (x of plain; flash-attn 4's x of its plain); ``train``: those
calls' forward and backward (the kernel entry points, x of plain); ``kv``:
kv_device_ab's two full-cache chunked-prefill rows, ours (kv_forward) and flash-attn 4 (x of flash-attn 4's
time: > 1, ours slower).

A softcap forward's x of plain moved from x1.03 (do_bench) to x1.19 (b2b) on one H200 held at its 700 W limit
(perf-notes E147): the ways differ in how long the GPU runs at that limit, so each prints its clocks and power.
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

from attention_dispatch.kernels import decode, entry, params  # noqa: E402
from attention_dispatch.kernels.decode import kv_forward  # noqa: E402
from attention_dispatch.kernels.params import KernelParams  # noqa: E402
from benchmarks.decode import fa4, kernel_ms  # noqa: E402
from benchmarks.gpu_clocks import ClockSampler, window_stats  # noqa: E402
from benchmarks.kernel_ab import FWD_ROWS, FWD_SHAPE, SOFTCAP, dense_calls, fwd_flops, row_params  # noqa: E402
from benchmarks.turns import turn_order  # noqa: E402
from benchmarks.kv_device_ab import ROWS as KV_ROWS  # noqa: E402
from benchmarks.kv_device_ab import per_call_ms, row_inputs  # noqa: E402

WAYS = ("b2b", "each", "flushed", "do_bench", "sustained", "kernel")


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


def sustained_ms(fn, sustain_ms: float, windows: list) -> float:
    """ms a call over back-to-back calls lasting about ``sustain_ms`` (one call times the count first);
    appends the loop's (start, end) unix times to ``windows``."""
    one = per_call_ms(fn, 3, 0.5)[0]
    reps = max(10, int(sustain_ms / max(one, 1e-3)))
    t0 = time.time()
    ms = per_call_ms(fn, reps, 0.5)[0]
    windows.append((t0, time.time()))
    return ms


def fwd_entries(flash) -> list:
    """(label, base label, call, FLOPs) of issue 36's forward rows."""
    B, H, S, D = FWD_SHAPE
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    entries = []
    for label, causal, softcap in FWD_ROWS:
        flops = fwd_flops(FWD_SHAPE, causal)
        base = label.replace("softcap", "plain")
        (ours,) = dense_calls({"ours": (decode, entry, params)}, q, k, v, causal, softcap).values()
        entries.append((label, base, ours, flops))
        if flash is not None:
            kwargs = {"causal": causal, **({"softcap": SOFTCAP} if softcap else {})}
            call = lambda kwargs=kwargs: flash(qt, kt, vt, **kwargs)  # noqa: E731
            entries.append((label.replace("fwd", "fa4"), base.replace("fwd", "fa4"), call, flops))
    return entries


def train_entries() -> list:
    """(label, base label, call, FLOPs) of issue 36's training rows: the forward rows' forward and backward through
    the kernel entry points (entry.attention_forward, then attention_backward of its output and logsumexp)."""
    B, H, S, D = FWD_SHAPE
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    entries = []
    for label, causal, softcap in FWD_ROWS:
        p = row_params(params, D, causal, softcap)

        def step(p=p):
            out, lse, seed = entry.attention_forward(q, k, v, None, p)
            return entry.attention_backward(do, q, k, v, None, out, lse, seed, p)

        train = label.replace("fwd", "train", 1)
        entries.append((train, train.replace("softcap", "plain"), step, 3.5 * fwd_flops(FWD_SHAPE, causal)))
    return entries


def kv_entries(flash) -> list:
    """(label, base label, call, FLOPs) of issue 34's full-cache chunked-prefill rows: ours and flash-attn 4."""
    entries = []
    for row in KV_ROWS:
        label, causal, lengths = row[0], row[6], row[7]
        if lengths is not None or not causal:
            continue
        q, k, v, lens, flops = row_inputs(row)
        p = KernelParams(scale=q.shape[-1] ** -0.5, window_right=0, align_bottom_right=True)
        base = f"{label} fa4" if flash is not None else f"{label} ours"
        entries.append(
            (f"{label} ours", base, lambda q=q, k=k, v=v, lens=lens, p=p: kv_forward(q, k, v, lens, p, None), flops)
        )
        if flash is not None:
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            entries.append((f"{label} fa4", base, lambda qt=qt, kt=kt, vt=vt: flash(qt, kt, vt, causal=True), flops))
    return entries


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="fwd,kv")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--sustain-ms", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    cases = [c for c in args.cases.split(",") if c]
    if set(ways) - set(WAYS) or set(cases) - {"fwd", "train", "kv"}:
        ap.error(f"--ways from {', '.join(WAYS)}; --cases from fwd, train, kv; got {args.ways!r}, {args.cases!r}")
    import triton.testing

    flash = fa4()
    entries = (
        (fwd_entries(flash) if "fwd" in cases else [])
        + (train_entries() if "train" in cases else [])
        + (kv_entries(flash) if "kv" in cases else [])
    )
    for _, _, fn, _ in entries:
        fn()
    torch.cuda.synchronize()
    flush_buffer = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    windows = {(label, way): [] for label, *_ in entries for way in ways}
    timers = {
        "b2b": lambda fn, win: per_call_ms(fn, 100, 0.5)[0],
        "each": lambda fn, win: each_ms(fn),
        "flushed": lambda fn, win: each_ms(fn, flush_buffer),
        "do_bench": lambda fn, win: triton.testing.do_bench(fn, warmup=10, rep=60),
        "sustained": lambda fn, win: sustained_ms(fn, args.sustain_ms, win),
        "kernel": lambda fn, win: kernel_ms(fn),
    }
    times = {(label, way): [] for label, *_ in entries for way in ways}
    with ClockSampler(torch.cuda.current_device()) as clocks:
        for r in range(args.rounds):
            for way in ways:  # a new order each round (turns.turn_order: the clock follows the call before)
                for i in turn_order(len(entries), way, r, seed=0):
                    label, _, fn, _ = entries[i]
                    times[(label, way)].append(timers[way](fn, windows[(label, way)]))
    samples = clocks.samples()
    print(torch.cuda.get_device_name(), f"| torch {torch.__version__} | {args.rounds} rounds | {args.commit}")
    result = {"commit": args.commit, "device": torch.cuda.get_device_name(), "rows": {}}
    print(f"{'row':34s} " + " ".join(f"{w:>15s}" for w in ways) + "   ms x of base; sustained: MHz W TFLOP/s/GHz")
    med = statistics.median
    for label, base, _, flops in entries:
        row, cells = {}, []
        for way in ways:
            ms = med(times[(label, way)])
            x = ms / med(times[(base, way)])
            row[way] = {"ms": ms, "x_of_base": x, "all_ms": times[(label, way)]}
            cells.append(f"{ms:6.3f} x{x:5.3f}")
        if "sustained" in ways:
            smi = window_stats(samples, windows[(label, "sustained")])
            row["sustained"]["smi"] = smi
            if smi:
                per_ghz = flops / row["sustained"]["ms"] / 1e9 / (smi["mhz"] / 1e3)
                cells.append(f"{smi['mhz']:5.0f} {smi['watts']:4.0f} {per_ghz:5.1f}")
        result["rows"][label] = dict(row, base=base)
        print(f"{label:34s} " + " ".join(f"{c:>15s}" for c in cells), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
