"""Attention on the GPU, side by side in one process: attention_dispatch against the anchors.

    python benchmarks/bench.py [--quick] [--out DIR] [--doc PATH] [--commit SHA] [--rows PATTERN ...]

Implementations (columns):
  sdpa      attention_dispatch.sdpa(), automatic choice (the chosen backend is logged)
  fastest   attention_dispatch.sdpa() under policy = "fastest" (each shape bucket's first call
            times every eligible backend; that first call is the warm-up, not measured)
  triton    attention_dispatch.sdpa(backend="triton"): this project's kernel
  cudnn, torch_flash, torch_efficient
            PyTorch's own kernels, called directly: F.scaled_dot_product_attention under
            torch.nn.attention.sdpa_kernel([SDPBackend.X]) (varlen through jagged nested tensors)
  flex      torch.compile(flex_attention, dynamic=False) with create_block_mask (causal,
            window, varlen documents) or a score_mod (bias); compiled once per shape and mask
  fa4       flash-attn 4, flash_attn.cute.flash_attn_func / flash_attn_varlen_func (B, S, H, D)
Anchors (the "best anchor" of a row): cudnn, torch_flash, torch_efficient, flex, fa4.

Grid (issue 5): bf16 and fp16; head dims 64/128/256; B*S = 16384 tokens with S in
512 .. 16384; hidden 2048 (H = 2048 / D); causal and not; plus, at bf16 hdim 128: float bias
(1, H, S, S), sliding window (left 1024, right 0), varlen (16 sequences of random lengths
summing to 16384, fixed seed), GQA (Hq = 4 Hkv) and dropout 0.1.

FLOPs: 4 * Hq * D * (allowed (query, key) pairs) for the forward, where dense rows count
B*S*S pairs, halved when causal, and window / varlen rows count the pairs they allow
(varlen causal: half of each sequence's L*L); forward+backward is 3.5x the forward.

Forward is timed under torch.no_grad() (inference; Flex excepted, its compiled graph depends on
the grad mode); forward+backward with grad.  An implementation that does not support a row's feature shows "-" (it is never routed to
something else); a failure shows "err" and its first line goes to details.log. Everything
is written under --out: bench.json, details.log, bench_<dtype>_d<D>.png; the Markdown
report goes to --doc. `--from-json FILE` re-renders table, plots and report without a GPU.

The parts: grid.py (rows, columns, FLOPs, support), runner.py and implementations.py (the
measurement), turns.py (the rounds' turns), targets.py (ratios and targets), report.py and
plots.py (the outputs); this file is the command line, the compile workers and bench.json's
runs.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script on a machine where the package is not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.details_log import Log
from benchmarks.grid import ANCHORS, COMPILING_IMPLS, DTYPES, IMPLS, MODES, FlexScope, Row, build_grid
from benchmarks.grid import select_rows, smoke_grid, support
from benchmarks.plots import make_plots
from benchmarks.report import SAMPLING_SHUFFLED, error_notes, markdown_report, short_report
from benchmarks.targets import add_ratios, chosen_column, evaluate_targets

if TYPE_CHECKING:
    from benchmarks.runner import Runner

DEFAULT_BUDGET_S = 550.0  # the full grid, started rows included, within ~9.7 minutes on one H100
QUICK_BUDGET_S = 165.0  # --quick within 3 minutes
DEFAULT_FLEX_BUDGET_S = 200.0  # total seconds of Flex compilation allowed (it is the slowest part)
QUICK_FLEX_BUDGET_S = 95.0
DEFAULT_PRECOMPILE_WORKERS = 8  # compile workers on a GPU machine (16 cores there; ptxas is single-threaded)
TURN_WARM_MS = 0.0  # untimed calls opening each turn beyond the one (experiment 32: 20 ms did not help)
# Turns the first round finds SLOW_FACTOR times slower than their row's fastest (same mode) stop
# after SLOW_ROUNDS rounds, and every turn times at least MIN_PER_TURN calls (experiment 66: 1.5
# with 2 calls did not make same-kernel columns agree better).  At 3x (experiment 68) it only
# trims columns that cannot be a row's best or decide a target (torch efficient, cuDNN and torch
# flash on varlen): ~38 s of a grid that had reached its 500 s budget with one row left.
SLOW_FACTOR = 3.0
SLOW_ROUNDS = 3
MIN_PER_TURN = 1
# policy="fastest"'s turn runs next to the turn of the column whose backend it chose, after it in
# even rounds and before it in odd ones (experiment 69): the fastest target compares two
# measurements of one kernel, and adjacent turns share the host's and the clock's state, which
# drift over milliseconds to seconds; the order stays symmetric, so neither side gains from it.
# Rounds 2k and 2k + 1 then share one shuffled order (experiment 75): the turn that goes first
# inherits the clock state of the turn before the pair (a light one leaves a clock up to 15%
# faster), and so each side goes first after the same turns.
PAIR_FASTEST = True
# Seconds of compilation per row, roughly (session-5 logs): the workers' load balance.
COMPILE_WEIGHT = {"sdpa": 1.0, "triton": 0.2, "flex": 4.0, "fa4": 1.0}


def write_outputs(data: dict, out_dir: Path, doc: Path | None, plot: bool = True) -> str:
    """bench.json, plots and the Markdown report; returns the short printed table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for e in data["rows"]:
        add_ratios(e)
    data["targets"] = evaluate_targets(data["rows"])
    pngs = make_plots(data, out_dir) if plot else []
    (out_dir / "bench.json").write_text(json.dumps(data, indent=1, default=str))
    if doc is not None:
        doc.parent.mkdir(parents=True, exist_ok=True)
        pngs = sorted(pngs, key=lambda p: p.name != "bench_bf16_d128.png")
        links = {p.stem: os.path.relpath(p, doc.parent).replace(os.sep, "/") for p in pngs}
        doc.write_text(markdown_report(data, links))
    return short_report(data)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def _csv(kind):
    def parse(text):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Row ids look like bf16-d128-s4096-causal, bf16-d128-s4096-full-bias, "
        "bf16-d128-varlen16-full (see --list-rows).",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="bf16 hdim 128 only, S in {4096, 16384}, plus the feature rows (< 3 minutes)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for bench.json, details.log and the plots (default: benchmarks/results; "
        "with --smoke-cpu, benchmarks/results/smoke-cpu, which git ignores)",
    )
    p.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="Markdown report to regenerate (default: docs/benchmarks.md; with --smoke-cpu, "
        "benchmarks.md in --out, so that a CPU check never replaces the GPU report)",
    )
    p.add_argument("--no-doc", action="store_true", help="do not write the Markdown report")
    p.add_argument("--commit", default=None, help="git commit to report (default: git rev-parse HEAD if possible)")
    p.add_argument(
        "--rows",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="only rows whose id matches one of these fnmatch patterns (plain text = substring)",
    )
    p.add_argument(
        "--impls", type=_csv(str), default=IMPLS, help=f"comma-separated implementations (default: {','.join(IMPLS)})"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"stop measuring after this many seconds from start (default {DEFAULT_BUDGET_S:.0f}, "
        f"--quick {QUICK_BUDGET_S:.0f}); rows left are marked skip",
    )
    p.add_argument(
        "--flex-budget-s",
        type=float,
        default=None,
        help=f"total seconds of Flex compilation (default {DEFAULT_FLEX_BUDGET_S:.0f}, "
        f"--quick {QUICK_FLEX_BUDGET_S:.0f})",
    )
    p.add_argument("--flex-dims", type=_csv(int), default=(64, 128), help="head dims where Flex is measured")
    p.add_argument("--flex-dtypes", type=_csv(str), default=("bf16",), help="dtypes where Flex is measured")
    p.add_argument(
        "--flex-from-s",
        type=int,
        default=FlexScope.from_s,
        help="Flex also measured at every dtype and head dim on dense rows with S >= this (0: only "
        "--flex-dims x --flex-dtypes): our kernel's ratio to Flex for every config",
    )
    p.add_argument("--target-ms", type=float, default=40.0, help="time spent per measurement after warm-up (ms)")
    p.add_argument("--max-reps", type=int, default=15, help="most timed repetitions per measurement")
    p.add_argument(
        "--rounds",
        type=int,
        default=11,
        help="interleaved rounds over a row's implementations, in a new order each round (the "
        "repetitions are split over them)",
    )
    p.add_argument(
        "--turn-warm-ms",
        type=float,
        default=TURN_WARM_MS,
        help="untimed calls opening each turn of a round, at least this long (ms; 0: one call): "
        "the chip's clock follows what ran before (docs/experiments/perf-notes.md, experiment 32)",
    )
    p.add_argument(
        "--slow-factor",
        type=float,
        default=SLOW_FACTOR,
        help="a turn slower than this times its row's fastest in the first round stops after "
        "--slow-rounds rounds (0: never; docs/experiments/perf-notes.md, experiment 66)",
    )
    p.add_argument("--slow-rounds", type=int, default=SLOW_ROUNDS, help="rounds a slow turn takes")
    p.add_argument(
        "--min-per-turn",
        type=int,
        default=MIN_PER_TURN,
        help="fewest timed calls in one turn (long calls would otherwise time one)",
    )
    p.add_argument(
        "--no-pair-fastest",
        dest="pair_fastest",
        action="store_false",
        default=PAIR_FASTEST,
        help="time policy=\"fastest\" and default sdpa() in their shuffled places, not next to the "
        "backend each chose (docs/experiments/perf-notes.md, experiment 69)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--no-check", action="store_true", help="skip the output comparison against the reference")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="re-render table, plots and report from existing bench.json files (no GPU needed); "
        "several files (a grid run in parts with --rows) are merged row by row",
    )
    p.add_argument("--list-rows", action="store_true", help="print the selected row ids and exit")
    p.add_argument(
        "--precompile-workers",
        type=int,
        default=None,
        metavar="N",
        help="compile every kernel of the selected rows in N worker processes before anything is "
        "timed (their disk caches then serve this process; default 8 on a GPU, 0 with --smoke-cpu)",
    )
    p.add_argument(
        "--precompile-s",
        type=float,
        default=240.0,
        help="stop the compile workers after this many seconds (default 240)",
    )
    p.add_argument("--compile-only", nargs="+", default=None, metavar="ROW_ID", help=argparse.SUPPRESS)
    p.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="development check without a GPU: tiny rows on the CPU, host timers (numbers meaningless)",
    )
    a = p.parse_args(argv)
    unknown = [i for i in a.impls if i not in IMPLS]
    if unknown:
        p.error(f"unknown implementation(s) {', '.join(unknown)}; known: {', '.join(IMPLS)}")
    bad = [d for d in a.flex_dtypes if d not in DTYPES]
    if bad:
        p.error(f"--flex-dtypes: unknown {', '.join(bad)}; known: {', '.join(DTYPES)}")
    if a.flex_from_s < 0:
        p.error(f"--flex-from-s must be >= 0, got {a.flex_from_s}")
    a.flex = FlexScope(tuple(a.flex_dims), tuple(a.flex_dtypes), a.flex_from_s)
    # a CPU smoke run never replaces the committed GPU grid (bench.json, plots, report)
    if a.out is None:
        a.out = Path("benchmarks/results/smoke-cpu" if a.smoke_cpu else "benchmarks/results")
    if a.doc is None:
        a.doc = a.out / "benchmarks.md" if a.smoke_cpu else Path("docs/benchmarks.md")
    if a.budget_s is None:
        a.budget_s = QUICK_BUDGET_S if a.quick else DEFAULT_BUDGET_S
    if a.flex_budget_s is None:
        a.flex_budget_s = QUICK_FLEX_BUDGET_S if a.quick else DEFAULT_FLEX_BUDGET_S
    if a.precompile_workers is None:
        a.precompile_workers = 0 if a.smoke_cpu else DEFAULT_PRECOMPILE_WORKERS
    if a.precompile_workers < 0:
        p.error(f"--precompile-workers must be >= 0, got {a.precompile_workers}")
    for name in ("slow_rounds", "min_per_turn"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def compile_groups(
    rows: list[Row], impls, flex: FlexScope = FlexScope(), workers: int = DEFAULT_PRECOMPILE_WORKERS
) -> list[list[Row]]:
    """Rows split over compile workers.  Rows that share kernels (same dtype, head dim,
    causal and feature: only S differs, and Triton does not specialise on it) go to the same
    worker, so that the second of them is a cache hit instead of a concurrent duplicate
    compile; groups are then spread greedily by their estimated compile seconds."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.dtype, r.D, r.causal, r.feature), []).append(r)

    def weight(rs):
        return sum(
            COMPILE_WEIGHT[i] * (1 if i != "flex" else len(rs))
            for i in impls
            if i in COMPILE_WEIGHT and any(support(i, r, m, flex) is None for r in rs for m in MODES)
        )

    buckets: list[list[Row]] = [[] for _ in range(max(1, workers))]
    loads = [0.0] * len(buckets)
    for rs in sorted(groups.values(), key=weight, reverse=True):
        i = loads.index(min(loads))
        buckets[i].extend(rs)
        loads[i] += weight(rs)
    return [b for b in buckets if b]


def _ok_cells(entry: dict) -> int:
    return sum(1 for r in entry["results"].values() for m in MODES if (r.get(m) or {}).get("status") == "ok")


def read_run(path: Path) -> dict:
    """A bench.json, plain or gzipped (raw grids under results/runs are kept as .json.gz: the
    device tool carries the tracked tree, at most 64 MiB with flash-attn 4's wheels)."""
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    if data.get("meta", {}).get("pair_fastest"):
        for e in data["rows"]:  # runs before experiment 75 paired without saying with which column
            for mode in MODES:
                cell = (e["results"].get("fastest") or {}).get(mode) or {}
                column = chosen_column(e["results"], mode)
                if (
                    cell.get("status") == "ok"
                    and "paired_with" not in cell
                    and column
                    and ((e["results"].get(column) or {}).get(mode) or {}).get("status") == "ok"
                ):
                    cell["paired_with"] = column
    return data


def merge_runs(runs: list[dict]) -> dict:
    """One report from a grid measured in parts (bench.py --rows ... per device call): rows
    in first-seen order; a row measured in several parts keeps the entry with the most
    measured cells; meta from the first part, with every part listed under "parts"."""
    if len(runs) == 1:
        return runs[0]
    rows: dict[str, dict] = {}
    for run in runs:
        for e in run["rows"]:
            rid = Row.from_json(e["row"]).id
            if rid not in rows or _ok_cells(e) > _ok_cells(rows[rid]):
                rows[rid] = e
    meta = dict(runs[0]["meta"])
    parts = [
        dict(
            commit=r["meta"].get("commit"),
            date=r["meta"].get("date"),
            elapsed_s=r["meta"].get("elapsed_s"),
            rows=sum(1 for e in r["rows"] if _ok_cells(e)),
        )
        for r in runs
    ]
    meta["parts"] = parts
    commits = list(dict.fromkeys(str(p["commit"]) for p in parts))
    meta["commit"] = " + ".join(commits)
    meta["elapsed_s"] = sum(p["elapsed_s"] or 0 for p in parts)
    meta["notes"] = list(dict.fromkeys(n for r in runs for n in r["meta"].get("notes", [])))
    meta["notes"].append(
        f"merged from {len(runs)} runs: "
        + "; ".join(f"{p['commit']} {p['date']} ({p['rows']} rows measured)" for p in parts)
    )
    return {"meta": meta, "rows": list(rows.values())}


def git_commit(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            or "unknown"
        )
    except Exception:  # noqa: BLE001 - the GPU machine's copy may have no .git
        return "unknown"


def environment(runner: Runner) -> dict:
    torch = runner.torch
    meta = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version())
    try:
        meta["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        meta["cudnn"] = "?"
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        meta["triton"] = f"absent ({type(e).__name__})"
    if runner.cuda:
        meta["gpu"] = torch.cuda.get_device_name()
        meta["sm"] = ".".join(map(str, torch.cuda.get_device_capability()))
    else:
        meta["gpu"], meta["sm"] = f"CPU smoke test ({platform.processor() or platform.machine()})", None
    meta["fa4"] = runner.fa4_version
    meta["attention_dispatch"] = getattr(runner.ad, "__version__", "?")
    return meta


def _worker_argv(args, row_ids: list[str]) -> list[str]:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--compile-only",
        *row_ids,
        "--impls",
        ",".join(i for i in args.impls if i in COMPILING_IMPLS),
        "--seed",
        str(args.seed),
        *args.flex.argv(),
    ]
    if args.smoke_cpu:
        argv.append("--smoke-cpu")
    if args.quick:
        argv.append("--quick")
    return argv


def precompile(args, rows: list[Row], log) -> dict:
    """Compile every kernel the selected rows will call, in worker processes, before anything
    is timed: a worker is this script with --compile-only.  Triton's, Inductor's and (with
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED) flash-attn 4's disk caches then serve the
    measuring process, whose first calls load instead of compile (compilation filled most of
    the 10-minute budget: docs/experiments/perf-notes.md, experiment 20).  Workers past --precompile-s are
    killed; what they compiled is kept."""
    impls = [i for i in args.impls if i in COMPILING_IMPLS]
    if not impls or args.precompile_workers == 0:
        return {"workers": 0}
    t0 = time.perf_counter()
    parts = compile_groups(rows, impls, args.flex, args.precompile_workers)
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for i, part in enumerate(parts):
        err = open(args.out / f"precompile-{i}.log", "w")
        procs.append(
            (
                subprocess.Popen(
                    _worker_argv(args, [r.id for r in part]),
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=env,
                    cwd=ROOT,
                ),
                err,
            )
        )
    done, errors, killed = [], [], 0
    for proc, err in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, args.precompile_s - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            killed += 1
        err.close()
        for line in out.splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                done.append(rec)
                errors.extend(f"{rec['row']}: {e}" for e in rec["errors"])
    summary = {
        "workers": len(parts),
        "rows": len(done),
        "of": len(rows),
        "killed": killed,
        "s": round(time.perf_counter() - t0, 1),
        "errors": errors[:20],
    }
    log(
        f"precompile: {summary['rows']}/{len(rows)} rows compiled by {len(parts)} workers in {summary['s']} s"
        + (f", {killed} killed at --precompile-s" if killed else "")
        + (f"; {len(errors)} errors (first: {errors[0]})" if errors else "")
    )
    return summary


def compile_only(args) -> int:
    """--compile-only ROW_ID ...: the worker of precompile(); one JSON line per row."""
    rows = {r.id: r for r in (smoke_grid() if args.smoke_cpu else build_grid(args.quick))}
    unknown = [i for i in args.compile_only if i not in rows]
    if unknown:
        print(f"unknown row ids: {', '.join(unknown)}", file=sys.stderr)
        return 2
    from benchmarks.runner import Runner  # here: --help, --list-rows and --from-json import no torch

    runner = Runner(args, Log(None, echo=False))
    if "fa4" in args.impls and runner.cuda:
        runner.load_fa4()
    if "flex" in args.impls:
        runner.load_flex()
    for rid in args.compile_only:
        print(json.dumps(runner.compile_row(rows[rid], list(args.impls))), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    doc = None if args.no_doc else args.doc
    if args.from_json:
        data = merge_runs([read_run(f) for f in args.from_json])
        print(write_outputs(data, args.out, doc, plot=not args.no_plot))
        return 0
    # flash-attn 4 then keeps its compiled kernels on disk: what the compile workers built
    # is loaded by the measuring process (set before flash_attn.cute is imported)
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    # One Triton cache directory for this process and the compile workers, fixed before
    # anything runs: Inductor points TRITON_CACHE_DIR at its own folder when Flex first
    # compiles, and our kernels compiled after that in a worker were then invisible here.
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
    if args.compile_only:
        return compile_only(args)
    rows = select_rows(smoke_grid() if args.smoke_cpu else build_grid(args.quick), args.rows)
    if args.list_rows:
        for r in rows:
            print(r.id)
        return 0
    if not rows:
        print("no row matches --rows", file=sys.stderr)
        return 2
    import torch

    from benchmarks.runner import STATISTIC, Runner

    if not torch.cuda.is_available() and not args.smoke_cpu:
        print(
            "bench.py measures on a CUDA GPU; none is available here (--list-rows, --from-json and --help "
            "work without one).",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "details.log")
    runner = Runner(args, log)
    impls = list(args.impls)
    log(
        f"bench.py: {len(rows)} rows x {len(impls)} implementations, budget {args.budget_s:.0f} s "
        f"(Flex compile {args.flex_budget_s:.0f} s); out {args.out}"
    )
    if "fa4" in impls:
        runner.load_fa4()
    if "flex" in impls:
        runner.load_flex()
    meta = environment(runner)
    meta.update(
        fwd_timing="no_grad",
        timing="queued",
        rounds=args.rounds,
        sampling=SAMPLING_SHUFFLED,
        statistic=STATISTIC,
        turn_warm_ms=args.turn_warm_ms,
        slow_factor=args.slow_factor,
        slow_rounds=args.slow_rounds,
        min_per_turn=args.min_per_turn,
        pair_fastest=args.pair_fastest,
        pair_rounds=args.pair_fastest,
        pair_default=args.pair_fastest,  # default sdpa() paired with its choice too (issue 35's target)
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        commit=git_commit(args.commit),
        quick=args.quick,
        impls=impls,
        anchors=list(ANCHORS),
        command="python benchmarks/bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        budget_s=args.budget_s,
        flex_budget_s=args.flex_budget_s,
        flex_dims=list(args.flex_dims),
        flex_dtypes=list(args.flex_dtypes),
        flex_from_s=args.flex_from_s,
    )
    meta["precompile"] = precompile(args, rows, log)
    log(json.dumps(meta))
    entries = []
    data = {"meta": meta, "rows": entries}
    for row in rows:
        entries.append(runner.run_row(row, impls))
        meta["elapsed_s"] = runner.elapsed()
        if len(entries) % 8 == 0:  # a partial bench.json survives a killed run
            (args.out / "bench.json").write_text(json.dumps(data, indent=1, default=str))
    meta["elapsed_s"] = runner.elapsed()
    meta["flex_compile_s"] = round(runner.flex_compile_s, 1)
    skipped = sum(
        1
        for e in entries
        for r in e["results"].values()
        for m in MODES
        if (r.get(m) or {}).get("status") == "skipped" and "budget" in (r.get(m) or {}).get("note", "")
    )
    if skipped:
        runner.notes.append(
            f"{skipped} measurements skipped by the time budgets (--budget-s {args.budget_s:.0f}, "
            f"--flex-budget-s {args.flex_budget_s:.0f})"
        )
    runner.notes.append(
        f"Flex compile time in this run: {runner.flex_compile_s:.0f} s; Flex measured at {args.flex.describe()}"
    )
    runner.notes.extend(error_notes(entries))
    meta["notes"] = runner.notes
    log(f"\nmeasured in {runner.elapsed():.0f} s")
    table = write_outputs(data, args.out, doc, plot=not args.no_plot)
    log(f"\nwrote {args.out / 'bench.json'}" + (f", {doc}" if doc else "") + "\n")
    log(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
