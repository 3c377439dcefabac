"""Which statistic should policy="fastest" judge a backend by?  Replayed from grids.

    python benchmarks/fastest_statistics.py RUN.json[.gz] [...]

Grids from 2026-11-23 (session 18) on record, in each "fastest" cell, every timed backend's
samples (`measured_samples`).  For each statistic this picks, per cell, the backend it would
have chosen from those samples and reads that backend's own grid column against the best
eligible backend's column (bench.best_backend): the same ratio as the grid's fastest/best,
without the noise of the fastest column's own measurement.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench  # noqa: E402


STATISTICS = {"median": statistics.median, "lower quartile": bench.lower_quartile, "minimum": min}


def replay(entry: dict, mode: str, statistic) -> tuple[str, float] | None:
    """(backend the statistic picks, its column / the best eligible column), or None when the
    cell recorded no samples or a column is missing."""
    cell = (entry["results"].get("fastest") or {}).get(mode) or {}
    samples = cell.get("measured_samples")
    if not samples:
        return None
    pick = min(samples, key=lambda name: statistic(samples[name]))
    value = bench.cell_value(entry["results"].get(bench.BACKEND_COLUMNS.get(pick, pick)), mode)
    _, best = bench.best_backend(entry, mode)
    return (pick, value / best) if value and best else None


def summarise(entries: list[dict], need: float = 0.97) -> dict[str, dict]:
    """Per statistic and mode: cells judged, cells below ``need``, the worst ratio, the misses."""
    out: dict[str, dict] = {}
    for label, statistic in STATISTICS.items():
        for mode in bench.MODES:
            got = [(e["row"]["id"], r) for e in entries if (r := replay(e, mode, statistic))]
            misses = [(rid, pick, round(ratio, 3)) for rid, (pick, ratio) in got if ratio < need]
            out[f"{label} {mode}"] = dict(cells=len(got), below=len(misses),
                                          worst=min((r for _, (_, r) in got), default=None), misses=misses)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    args = p.parse_args(argv)
    for path in args.runs:
        entries = bench.read_run(path)["rows"]
        print(path.name)
        for key, s in summarise(entries).items():
            worst = "-" if s["worst"] is None else f"{s['worst']:.3f}"
            print(f"  {key:26s} cells {s['cells']:3d}  below 0.97 {s['below']:2d}  worst {worst}  {s['misses'][:4]}")


if __name__ == "__main__":
    main()
