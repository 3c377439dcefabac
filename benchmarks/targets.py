"""What a grid's results read as: a cell's TFLOP/s, each implementation's ratio to the row's
best anchor, policy="fastest" against the best backend it could have chosen, and the issue-5
targets.  Pure Python over bench.json's entries."""

from __future__ import annotations

import math
import statistics

from benchmarks.grid import ANCHORS, BACKEND_COLUMNS, BACKEND_IMPLS, BACKEND_NAMES, MODES, Row


def cell_value(res: dict | None, mode: str) -> float | None:
    m = (res or {}).get(mode) or {}
    return m.get("tflops") if m.get("status") == "ok" else None


def best_anchor(results: dict, mode: str, anchors=ANCHORS) -> tuple[str | None, float | None]:
    best, val = None, None
    for name in anchors:
        v = cell_value(results.get(name), mode)
        if v is not None and (val is None or v > val):
            best, val = name, v
    return best, val


def add_ratios(entry: dict) -> None:
    """Fill ratio_to_best_anchor for every measured implementation of one row entry."""
    results = entry["results"]
    entry["best_anchor"] = {}
    for mode in MODES:
        name, val = best_anchor(results, mode)
        entry["best_anchor"][mode] = name
        for impl, res in results.items():
            m = res.get(mode)
            if not m:
                continue
            v = cell_value(res, mode)
            m["ratio_to_best_anchor"] = (v / val) if (v is not None and val) else None


def ratio_between(entry: dict, a: str, b: str, mode: str) -> float | None:
    va, vb = cell_value(entry["results"].get(a), mode), cell_value(entry["results"].get(b), mode)
    return va / vb if (va is not None and vb) else None


TARGET_MIN_S = 4096  # the targets read dense rows from this S up


def target_rows(entries: list[dict]) -> list[dict]:
    """The dense rows with S >= TARGET_MIN_S, causal and not (by causal, then S)."""
    big = [e for e in entries if e["row"]["feature"] == "dense" and e["row"]["S"] >= TARGET_MIN_S]
    return sorted(big, key=lambda e: (e["row"]["causal"], e["row"]["S"]))


def best_backend(entry: dict, mode: str) -> tuple[str | None, float | None]:
    """The column of the best single backend policy="fastest" could have chosen in this row
    and mode (the forward runs under no_grad, so forward-only backends count there), and its
    TFLOP/s."""
    cell = (entry["results"].get("fastest") or {}).get(mode) or {}
    # A backend that does not claim the row exactly (cuDNN's dropout, cuDNN on varlen) is not
    # one it could choose: only the eligible ones count.  One that failed while timed counts
    # (a user pinning it would get its column); runs before 2026-11-23 recorded only the timed.
    could = cell.get("eligible") or cell.get("measured")
    impls = [i for i in BACKEND_IMPLS if not could or BACKEND_NAMES.get(i, i) in could]
    return best_anchor(entry["results"], mode, impls)


def paired_log_ratio(entry: dict, mode: str, impl: str = "fastest") -> float | None:
    """log(``impl``'s speed (one of PAIRED: policy="fastest" or the default policy's column) / the
    speed of the column it was paired with), read round by
    round from the two turns that ran next to each other (PAIR_FASTEST), or None where they do
    not pair: not paired in this run, different rounds, or more than one timed call per turn
    (cells under ~3.6 ms: host-bound at times, where the lower quartile reads the device's
    floor and a per-round ratio reads host jitter).

    Per round, log(column sample / fastest sample); the median over the rounds where fastest
    went second (even) and over those where it went first (odd), averaged: an ABBA design.
    The turn that goes second runs on the clock state the first left, which after a heavy turn
    is ~3% slower on average and up to ~15% (power-limited clock, docs/experiments/perf-notes.md experiment
    75); with 11 rounds one side goes second once more, and the plain median follows that side."""
    results = entry["results"]
    cell = (results.get(impl) or {}).get(mode) or {}
    column = cell.get("paired_with")
    other = ((results.get(column) or {}).get(mode) or {}) if column else {}
    mine, theirs, rounds = cell.get("samples_ms") or [], other.get("samples_ms") or [], cell.get("rounds") or 0
    if (
        cell.get("status") != "ok"
        or other.get("status") != "ok"
        or rounds < 2
        or other.get("rounds") != rounds
        or len(mine) != rounds
        or len(theirs) != rounds
    ):
        return None
    logs = [math.log(b / a) for a, b in zip(mine, theirs)]
    return (statistics.median(logs[0::2]) + statistics.median(logs[1::2])) / 2


def choice_ratio(entry: dict, mode: str, impl: str = "fastest", paired: bool = True) -> float | None:
    """``impl`` (policy="fastest", or "sdpa": the default policy) against the best single backend it
    could have chosen (best_backend).  Where its turns were paired with its choice's column one call
    a turn (paired_log_ratio), read as (impl / that column, paired) x (that column / the best
    column): the first factor is two measurements of one kernel side by side, the second the choice.
    ``paired=False``: the ratio of the two columns' lower quartiles (the direct reading, also reported)."""
    results = entry["results"]
    v = cell_value(results.get(impl), mode)
    _, best = best_backend(entry, mode)
    if v is None or not best:
        return None
    log_ratio = paired_log_ratio(entry, mode, impl) if paired else None
    if log_ratio is None:
        return v / best
    column = results[impl][mode]["paired_with"]
    return math.exp(log_ratio) * cell_value(results[column], mode) / best


def chosen_column(results: dict, mode: str, impl: str = "fastest") -> str | None:
    """The column running the backend ``impl`` (policy="fastest", or "sdpa": the default policy)
    chose in this mode (its backend name, BACKEND_COLUMNS where the column is named otherwise), or
    None before it chose."""
    backend = ((results.get(impl) or {}).get(mode) or {}).get("backend")
    return BACKEND_COLUMNS.get(backend, backend) if backend else None


def choice_misses(entries: list[dict], mode: str, need: float = 0.97, impl: str = "fastest") -> list[dict]:
    """The rows where ``impl`` (policy="fastest", or "sdpa": the default policy) read below ``need``
    of the best single backend: its ratio, the backend it chose, the best column's backend, and
    whether they are one backend (then the gap is two measurements of one kernel, not a wrong choice)."""
    misses = []
    for e in entries:
        r = choice_ratio(e, mode, impl)
        if r is None or r >= need:
            continue
        chose = ((e["results"].get(impl) or {}).get(mode) or {}).get("backend")
        best, _ = best_backend(e, mode)
        misses.append(
            dict(
                row=Row.from_json(e["row"]).id,
                ratio=round(r, 3),
                direct=round(choice_ratio(e, mode, impl, paired=False), 3),
                paired=paired_log_ratio(e, mode, impl) is not None,
                chose=chose,
                best=BACKEND_NAMES.get(best, best),
                same_backend=chosen_column(e["results"], mode, impl) == best,
            )
        )
    return misses


def find_entry(entries: list[dict], row_id: str) -> dict | None:
    for e in entries:
        if e["row"]["id"] == row_id:
            return e
    return None


def evaluate_targets(entries: list[dict], impl: str = "triton") -> list[dict]:
    """The issue-5 targets, each with its measured ratio(s) and met / not met / not measured."""
    targets = []

    def add(name, ratios, need, **extra):
        vals = [r for r in ratios if r is not None]
        status = "not measured" if not vals or len(vals) < len(ratios) else ("met" if min(vals) >= need else "not met")
        targets.append(
            dict(
                target=name,
                need=need,
                ratios=[None if r is None else round(r, 3) for r in ratios],
                worst=None if not vals else round(min(vals), 3),
                status=status,
                **extra,
            )
        )

    big = target_rows([e for e in entries if e["row"]["dtype"] == "bf16" and e["row"]["D"] == 128])
    if big:
        for mode, need_c, need_f in (("fwd", 0.85, 1.2), ("fwd+bwd", 0.80, 1.1)):
            add(
                f"{mode} >= {need_c}x cuDNN (bf16 d128 S>=4k, causal and not)",
                [ratio_between(e, impl, "cudnn", mode) for e in big],
                need_c,
            )
            add(
                f"{mode} >= {need_f}x Flex (bf16 d128 S>=4k, causal and not)",
                [ratio_between(e, impl, "flex", mode) for e in big],
                need_f,
            )
            add(
                f"{mode} vs flash-attn 4 (reported; long-run aim 1.0)",
                [ratio_between(e, impl, "fa4", mode) for e in big],
                1.0,
            )
    bias = find_entry(entries, "bf16-d128-s4096-full-bias")
    if bias:
        add("bias fwd+bwd >= 1.5x cuDNN's bias path (S=4k)", [ratio_between(bias, impl, "cudnn", "fwd+bwd")], 1.5)
    win, dense = find_entry(entries, "bf16-d128-s16384-full-window"), find_entry(entries, "bf16-d128-s16384-full")
    if win and dense:
        for mode in MODES:
            a = (win["results"].get(impl) or {}).get(mode) or {}
            b = (dense["results"].get(impl) or {}).get(mode) or {}
            r = (b["ms"] / a["ms"]) if a.get("status") == "ok" and b.get("status") == "ok" else None
            add(f"window (1024,0) S=16k {mode}: >= 5x faster than our dense non-causal (time ratio)", [r], 5.0)
    # issue 35: the default policy's choice; policy="fastest" measures its own
    for chooser, name, need in (("sdpa", "default sdpa() (auto)", 0.95), ("fastest", "policy=fastest", 0.97)):
        for mode in MODES:
            cells = [e for e in entries if (e["results"].get(chooser) or {}).get(mode)]
            ratios = [r for e in cells if (r := choice_ratio(e, mode, chooser)) is not None]
            if ratios:
                direct = [r for e in cells if (r := choice_ratio(e, mode, chooser, paired=False)) is not None]
                add(
                    f"{name} {mode} >= {need}x the best single backend, every row ({len(ratios)} rows)",
                    ratios,
                    need,
                    misses=choice_misses(entries, mode, need, chooser),
                    paired_rows=sum(paired_log_ratio(e, mode, chooser) is not None for e in cells),
                    direct_worst=round(min(direct), 3),
                    direct_below=sum(r < need for r in direct),
                )
    return targets
