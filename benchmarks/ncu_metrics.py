"""What the ncu probe (perf-notes E113) asks Nsight Compute for, and the names its summary reads.

    python benchmarks/ncu_metrics.py sections          # the --section arguments
    python benchmarks/ncu_metrics.py metrics QUERY.txt  # the --metrics list this ncu knows

Sections give the stall sampling (per kernel and per SASS instruction), the launch and the
occupancy; --metrics adds the sm90 pipes the sections leave out.  A metric name ncu does not know
fails the whole profile, so the list passed is filtered against `ncu --query-metrics` on the device
(names drift between ncu versions); with no query output it prints nothing (sections only).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

SECTIONS = (
    "LaunchStats",
    "Occupancy",
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "SchedulerStats",
    "WarpStateStats",
    "SourceCounters",  # per-SASS-instruction stall samples (the source page)
)

# summary column -> metrics that answer it, preferred first (sm90 names first, then older ones)
COLUMNS = {
    "ms": ("gpu__time_duration.sum",),
    "sm%": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "issue%": ("smsp__issue_active.avg.pct_of_peak_sustained_active",),
    "tensor%": (
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    ),
    "xu%": ("sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",),
    "fma%": (
        "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    ),
    "alu%": ("sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",),
    "occ%": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "warps": ("sm__warps_active.avg.per_cycle_active",),
    "elig": ("smsp__warps_eligible.avg.per_cycle_active",),
}
# warp instructions executed, per pipe (counts: softcap's MUFU work against plain's)
COUNTS = {
    "all": ("smsp__inst_executed.sum",),
    "xu": ("smsp__inst_executed_pipe_xu.sum", "sm__inst_executed_pipe_xu.sum"),
    "fma": ("smsp__inst_executed_pipe_fma.sum", "sm__inst_executed_pipe_fma.sum"),
    "alu": ("smsp__inst_executed_pipe_alu.sum", "sm__inst_executed_pipe_alu.sum"),
    "gmma": ("sm__inst_executed_pipe_tensor_op_gmma.sum", "smsp__inst_executed_pipe_tensor_op_gmma.sum"),
}
# the SMs' busy cycles, mean and most: under 1 (avg / max) is a tail, SMs idle while others finish
BALANCE = ("sm__cycles_active.avg", "sm__cycles_active.max")
LAUNCH = {
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "regs": "launch__registers_per_thread",
    "smem": "launch__shared_mem_per_block",
}
# stall reasons: PC-sampling counts (SourceCounters / WarpStateStats), else warp cycles per issued instruction
PCSAMP_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
PCSAMP_TOTAL = "smsp__pcsamp_sample_count"
RATIO_RE = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)_per_issue_active\.ratio$")


def wanted() -> list[str]:
    """Every metric the summary reads that sections may not collect, in a stable order."""
    names = [m for ms in COLUMNS.values() for m in ms] + [m for ms in COUNTS.values() for m in ms] + list(BALANCE)
    return list(dict.fromkeys(names))


def base_name(metric: str) -> str:
    """sm__warps_active.avg.per_cycle_active -> sm__warps_active (the name --query-metrics lists)."""
    return metric.split(".", 1)[0]


def known_bases(query_text: str) -> set[str]:
    """The base metric names in `ncu --query-metrics` output (first word of each table line)."""
    return {m.group(1) for m in re.finditer(r"^\s*([a-z0-9]+__[a-z0-9_]+)\b", query_text, flags=re.M)}


def available(query_text: str) -> list[str]:
    bases = known_bases(query_text)
    return [m for m in wanted() if base_name(m) in bases]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("sections", "metrics"), help="the --section arguments, or the --metrics list")
    ap.add_argument("query", type=Path, nargs="?", help="metrics: a file holding `ncu --query-metrics` output")
    args = ap.parse_args(argv)
    if args.what == "sections":
        print(" ".join(f"--section {s}" for s in SECTIONS))
        return 0
    text = args.query.read_text(errors="replace") if args.query and args.query.exists() else ""
    print(",".join(available(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
