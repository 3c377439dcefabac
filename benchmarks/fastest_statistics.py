"""Which statistic should policy="fastest" judge a backend by?  Replayed from grids.

    python benchmarks/fastest_statistics.py RUN.json[.gz] [...]

Grids from 2026-11-23 (session 18) on record, in each "fastest" cell, every timed backend's
samples (`measured_samples`).  For each statistic this picks, per cell, the backend it would
have chosen from those samples and reads that backend's own grid column against the best
eligible backend's column (targets.best_backend): the same ratio as the grid's fastest/best,
without the noise of the fastest column's own measurement.

Then the agreement of two measurements of one kernel (experiment 69): the fastest cell
against the column of the backend it chose, by cell length (under 1 ms, 1-3.6 ms, longer):
cells, median |log ratio| and how many read below 0.97.

Where the grid recorded the host's time per call of each timed backend (`measured_host_ms`,
session 21), the lower quartile is also replayed with a host margin: a backend costs the larger
of its lower quartile and the margin times its host time (HOST_MARGINS), and with the library's
own rule since experiment 73 (a near-tie with a host-heavy leader goes to the backend with the
least host time: attention_dispatch.timing.pick_winner).  And the choice from
the first k timed rounds only, by the leader's time (experiment 72: how many rounds decide).
Several runs: each is printed, then (with more than one) all of them together.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attention_dispatch.timing import lower_quartile  # noqa: E402
from benchmarks import bench, grid, targets  # noqa: E402


STATISTICS = {"median": statistics.median, "lower quartile": lower_quartile, "minimum": min}


# Host margins replayed with the lower quartile: a backend costs max(its statistic, margin x
# the host's time per call recorded with its samples), so one whose host time nears its device
# time loses to a host-light one of about the same speed (grids from session 21 on record it).
# Rejected as a choice rule on grid d37c60e (experiment 71: 1 / 5 / 11 misses at margins 1 /
# 1.25 / 1.5 against 1 without); kept here to re-check on later grids.
HOST_MARGINS = (1.0, 1.25, 1.5)


def replay(
    entry: dict, mode: str, statistic, host_margin: float | None = None, host_tie: bool = False
) -> tuple[str, float] | None:
    """(backend the statistic picks, its column / the best eligible column), or None when the
    cell recorded no samples (or, with ``host_margin`` or ``host_tie``, no host times) or a
    column is missing.  ``host_tie``: the library's rule, a near-tie to host time to spare
    (timing.pick_winner, experiment 73)."""
    cell = (entry["results"].get("fastest") or {}).get(mode) or {}
    samples = cell.get("measured_samples")
    host = cell.get("measured_host_ms") or {}
    if not samples or (host_margin is not None or host_tie) and not host:
        return None

    def cost(name: str) -> float:
        own = statistic(samples[name])
        return max(own, host_margin * host[name]) if host_margin is not None and name in host else own

    if host_tie:
        from attention_dispatch.timing import pick_winner

        pick = pick_winner({name: statistic(x) for name, x in samples.items()}, host)
    else:
        pick = min(samples, key=cost)
    value = targets.cell_value(entry["results"].get(grid.BACKEND_COLUMNS.get(pick, pick)), mode)
    _, best = targets.best_backend(entry, mode)
    return (pick, value / best) if value and best else None


def summarise(entries: list[dict], need: float = 0.97) -> dict[str, dict]:
    """Per statistic and mode: cells judged, cells below ``need``, the worst ratio, the misses."""
    out: dict[str, dict] = {}
    variants = [(label, statistic, None, False) for label, statistic in STATISTICS.items()]
    variants += [(f"lower quartile, host x{m:g}", STATISTICS["lower quartile"], m, False) for m in HOST_MARGINS]
    variants += [("lower quartile, near-tie to host", STATISTICS["lower quartile"], None, True)]
    for label, statistic, margin, tie in variants:
        for mode in grid.MODES:
            got = [(e["row"]["id"], r) for e in entries if (r := replay(e, mode, statistic, margin, tie))]
            misses = [(rid, pick, round(ratio, 3)) for rid, (pick, ratio) in got if ratio < need]
            out[f"{label} {mode}"] = dict(
                cells=len(got), below=len(misses), worst=min((r for _, (_, r) in got), default=None), misses=misses
            )
    return out


LENGTHS = ((1.0, "under 1 ms"), (3.6, "1-3.6 ms"), (math.inf, "longer"))
# Experiment 72: the choice from the first k timed rounds only, by the leader's time (its lower
# quartile over all rounds); fastest.LONG_ROUNDS is read off this.
ROUND_COUNTS = (3, 4, 5, 6, 8, 11)
LEADER_BANDS = ((1.0, "leader under 1 ms"), (2.0, "leader 1-2 ms"), (math.inf, "leader 2 ms or more"))


def by_rounds(entries: list[dict], counts=ROUND_COUNTS, need: float = 0.97) -> dict[str, dict[int, dict]]:
    """Per leader band and round count k: the lower quartile of each backend's first k samples
    (one per round) picks; cells judged, cells below ``need`` of the best column, the worst."""
    out: dict[str, dict[int, dict]] = {label: {} for _, label in LEADER_BANDS}
    for e in entries:
        for mode in grid.MODES:
            samples = (((e["results"].get("fastest") or {}).get(mode) or {}).get("measured_samples")) or {}
            if not samples:
                continue
            lead = min(lower_quartile(list(x)) for x in samples.values())
            band = next(label for limit, label in LEADER_BANDS if lead < limit)
            for k in counts:
                got = replay(e, mode, lambda x, k=k: lower_quartile(list(x[:k])))
                if got is None:
                    continue
                cell = out[band].setdefault(k, dict(cells=0, below=0, worst=None))
                cell["cells"] += 1
                cell["below"] += got[1] < need
                cell["worst"] = got[1] if cell["worst"] is None else min(cell["worst"], got[1])
    return out


def agreement(entries: list[dict], need: float = 0.97) -> dict[str, dict]:
    """The fastest cell against its choice's own column (the same kernel), per cell length
    (the column's ms, LENGTHS): cells, median |log(fastest ms / column ms)|, cells below
    ``need`` (fastest slower).  Also, where both recorded one sample per round (the grid pairs
    their turns: turns.pair_fastest), the paired estimate the target reads there
    (targets.paired_log_ratio: per round log(column sample / fastest sample), the medians of even
    and odd rounds averaged), then its median |.| and the cells below ``need`` (experiment 75)."""
    logs: dict[str, list[float]] = {label: [] for _, label in LENGTHS}
    paired: dict[str, list[float]] = {label: [] for _, label in LENGTHS}
    for e in entries:
        for mode in grid.MODES:
            cell = (e["results"].get("fastest") or {}).get(mode) or {}
            column = targets.chosen_column(e["results"], mode)
            other = ((e["results"].get(column) or {}).get(mode) or {}) if column else {}
            if cell.get("status") != "ok" or other.get("status") != "ok":
                continue
            label = next(lab for limit, lab in LENGTHS if other["ms"] < limit)
            logs[label].append(math.log(other["ms"] / cell["ms"]))  # < 0: fastest slower
            if (log_ratio := targets.paired_log_ratio(e, mode)) is not None:
                paired[label].append(log_ratio)

    def median_abs(v):
        return statistics.median([abs(x) for x in v]) if v else None

    return {
        label: dict(
            cells=len(v),
            median_abs=median_abs(v),
            below=sum(x < math.log(need) for x in v),
            paired_cells=len(paired[label]),
            paired_median_abs=median_abs(paired[label]),
            paired_below=sum(x < math.log(need) for x in paired[label]),
        )
        for label, v in logs.items()
    }


def report(name: str, entries: list[dict]) -> None:
    print(name)
    for key, s in summarise(entries).items():
        worst = "-" if s["worst"] is None else f"{s['worst']:.3f}"
        print(f"  {key:34s} cells {s['cells']:3d}  below 0.97 {s['below']:2d}  worst {worst}  {s['misses'][:4]}")
    for band, ks in by_rounds(entries).items():
        print(
            f"  first k rounds, {band:20s} "
            + "  ".join(f"k={k}: {c['below']}/{c['cells']} below" for k, c in ks.items())
        )
    for label, a in agreement(entries).items():
        med, pmed = ("-" if x is None else f"{x:.4f}" for x in (a["median_abs"], a["paired_median_abs"]))
        print(
            f"  fastest vs its choice's column, {label:10s} cells {a['cells']:3d}  median |log ratio| {med}  "
            f"below 0.97 {a['below']:2d}  paired: cells {a['paired_cells']:3d} median {pmed} "
            f"below 0.97 {a['paired_below']:2d}"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    args = p.parse_args(argv)
    every: list[dict] = []
    for path in args.runs:
        entries = bench.read_run(path)["rows"]
        every += entries
        report(path.name, entries)
    if len(args.runs) > 1:
        report(f"all {len(args.runs)} runs", every)


if __name__ == "__main__":
    main()
