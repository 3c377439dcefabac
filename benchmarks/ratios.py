"""The issue's headline ratios, measured interleaved: our kernel against cuDNN, Flex and FA4.

    python benchmarks/ratios.py [--rounds 5] [--json FILE] [--rows PATTERN ...]

A second measurement of the grid's headline cells, with fewer implementations: every
implementation of a row is timed in each of --rounds rounds, in turns.turn_order's order
(the clock a turn starts with follows the turn before it, docs/experiments/perf-notes.md experiments 32
and 55), with bench.py's inputs, implementations and timing; a cell is the median over
rounds, and the spread (max - min) / median is printed beside it.  Rows: bf16 hdim 128,
S in {4k, 8k, 16k}, causal and not, and the float-bias row.
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

from benchmarks import bench, grid  # noqa: E402
from benchmarks.details_log import Log, first_line  # noqa: E402
from benchmarks.runner import Runner  # noqa: E402
from benchmarks.turns import turn_order  # noqa: E402

IMPLS = ("triton", "cudnn", "flex", "fa4")
MODES = grid.MODES


def headline_rows() -> list[grid.Row]:
    rows = [grid.Row("bf16", 128, s, c) for s in (4096, 8192, 16384) for c in (False, True)]
    return rows + [grid.Row("bf16", 128, 4096, False, "bias")]


def summarise(samples: list[float]) -> dict:
    """Median and relative spread of per-round TFLOP/s."""
    med = statistics.median(samples)
    return dict(tflops=med, spread=(max(samples) - min(samples)) / med if med else 0.0, rounds=samples)


def ratio_lines(results: dict) -> list[str]:
    """Issue 5's targets from the interleaved medians."""
    lines = []
    for mode in MODES:
        for anchor, need in (
            ("cudnn", 0.85 if mode == "fwd" else 0.80),
            ("flex", 1.2 if mode == "fwd" else 1.1),
            ("fa4", 1.0),
        ):
            ratios = []
            for rid, cells in results.items():
                if "bias" in rid:
                    continue
                ours, theirs = cells.get("triton", {}).get(mode), cells.get(anchor, {}).get(mode)
                if ours and theirs:
                    ratios.append(ours["tflops"] / theirs["tflops"])
            if ratios:
                lines.append(
                    f"  triton/{anchor} {mode:8s} worst {min(ratios):.2f}  (rows: "
                    + " ".join(f"{r:.2f}" for r in ratios)
                    + f")  target {need}"
                )
    bias = next((c for rid, c in results.items() if "bias" in rid), {})
    if bias.get("triton", {}).get("fwd+bwd") and bias.get("cudnn", {}).get("fwd+bwd"):
        r = bias["triton"]["fwd+bwd"]["tflops"] / bias["cudnn"]["fwd+bwd"]["tflops"]
        lines.append(f"  bias fwd+bwd triton/cudnn {r:.2f}  target 1.5")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--rows", nargs="+", default=None, metavar="PATTERN")
    p.add_argument("--impls", type=lambda s: tuple(s.split(",")), default=IMPLS)
    p.add_argument("--target-ms", type=float, default=20.0, help="timed work per implementation and round")
    p.add_argument("--commit", default=None, help="git commit to report (default: git rev-parse HEAD)")
    p.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="development check without a GPU: bench.py's tiny CPU rows, our kernel only",
    )
    a = p.parse_args(argv)
    args = bench.parse_args(["--target-ms", str(a.target_ms), "--no-plot"] + (["--smoke-cpu"] if a.smoke_cpu else []))
    rows = [r for r in grid.smoke_grid() if r.feature in ("dense", "bias")] if a.smoke_cpu else headline_rows()
    log = Log(None, echo=False)
    runner = Runner(args, log)
    if not a.smoke_cpu:
        runner.load_fa4()
        runner.load_flex()
    results: dict = {}
    t0 = time.perf_counter()
    for row in grid.select_rows(rows, a.rows):
        inp = runner.make_inputs(row)
        prepared = {}
        for impl in a.impls:
            if (impl == "fa4" and runner.fa4 is None) or (impl == "flex" and runner.flex_fn is None):
                continue
            modes = [m for m in MODES if grid.support(impl, row, m) is None]
            if not modes:
                continue
            try:
                fwd, leaves, go, _, ctx = runner.prepare(impl, row, inp)
            except Exception as e:  # noqa: BLE001
                print(f"  {row.id} {impl}: {first_line(e)}", flush=True)
                continue
            torch = runner.torch

            def fb(fwd=fwd, leaves=leaves, go=go):
                torch.autograd.grad(fwd(), leaves, go)

            def inference(fwd=fwd):
                with torch.no_grad():
                    return fwd()

            prepared[impl] = (ctx, {"fwd": fwd if impl == "flex" else inference, "fwd+bwd": fb}, modes)
        samples: dict = {impl: {m: [] for m in prepared[impl][2]} for impl in prepared}
        for rnd in range(a.rounds):
            for k in turn_order(len(prepared), row.id, rnd, args.seed):
                impl = list(prepared)[k]
                ctx, fns, modes = prepared[impl]
                with ctx():
                    for m in modes:
                        try:
                            ms = runner.time_fn(fns[m])["ms"]
                            samples[impl][m].append(grid.tflops(row, m, ms))
                        except Exception as e:  # noqa: BLE001
                            print(f"  {row.id} {impl} {m}: {first_line(e)}", flush=True)
        results[row.id] = {
            impl: {m: summarise(v) for m, v in by_mode.items() if v} for impl, by_mode in samples.items()
        }
        cells = "  ".join(
            f"{impl} "
            + " / ".join(
                f"{results[row.id][impl][m]['tflops']:.0f}±{results[row.id][impl][m]['spread'] * 100:.0f}%"
                if m in results[row.id][impl]
                else "-"
                for m in MODES
            )
            for impl in prepared
        )
        print(f"{row.id:28s} {cells}", flush=True)
        del inp, prepared
        runner.empty_cache()
    torch = runner.torch
    meta = dict(
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        rounds=a.rounds,
        target_ms=a.target_ms,
        elapsed_s=time.perf_counter() - t0,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        commit=bench.git_commit(a.commit),
    )
    print(f"\n{meta['gpu']} | torch {meta['torch']} | {a.rounds} interleaved rounds | {meta['elapsed_s']:.0f} s")
    print("TFLOP/s median over rounds (fwd / fwd+bwd); targets:")
    for line in ratio_lines(results):
        print(line)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
