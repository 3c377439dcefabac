"""The grid's report: the printed table (short_report) and docs/benchmarks.md (markdown_report),
from bench.json's entries and the ratios and targets read from them (targets.py)."""

from __future__ import annotations

from benchmarks.grid import ANCHORS, BWD_FACTOR, HIDDEN, IMPLS, LABELS, MODES, TOKENS, Row
from benchmarks.targets import (
    TARGET_MIN_S,
    choice_ratio,
    ratio_between,
    target_rows,
)


# meta["sampling"] of runs that time as measure_rounds did (session 7) and does now
SAMPLING_ONE_CALL = "gc-off, untimed call per turn"
SAMPLING = "gc-off, untimed calls of at least turn_warm_ms per turn"
SAMPLING_SHUFFLED = SAMPLING + ", turns shuffled each round"
TIMING_QUEUED = (
    "repetitions are enqueued back to back, each between its own CUDA events, with one "
    "synchronisation at the end (device time in steady state, as triton.testing.do_bench; "
    "the host time of one call is benchmarks/overhead.py's); calls under 0.5 ms are grouped; "
)


# The anchors issue 5 states our kernel's ratios against; every row and every dtype and head dim
# reports them, not only the bf16 d128 rows that carry targets.
RATIO_ANCHORS = ("cudnn", "flex", "fa4")


def fmt_num(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}"


def fmt_cell(res: dict | None, mode: str) -> str:
    """TFLOP/s as an integer, '-' unsupported, 'err' failed, 'skip' out of time, '?' missing.
    A '!' marks an output that differed from the reference (see details)."""
    m = (res or {}).get(mode)
    if not m:
        return "?"
    st = m.get("status")
    if st == "ok":
        return f"{m['tflops']:.0f}" + ("!" if (res or {}).get("mismatch") else "")
    return {"unsupported": "-", "error": "err", "skipped": "skip"}.get(st, "?")


def fmt_pair(res: dict | None) -> str:
    return f"{fmt_cell(res, 'fwd')} / {fmt_cell(res, 'fwd+bwd')}"


def fmt_modes(ratio_in) -> str:
    """'fwd / fwd+bwd' of ``ratio_in(mode)`` (a ratio or None), two decimals, '-' for None."""
    return " / ".join(fmt_num(ratio_in(m), 2) for m in MODES)


def fmt_ratio(res: dict | None) -> str:
    return fmt_modes(lambda m: ((res or {}).get(m) or {}).get("ratio_to_best_anchor"))


def anchor_ratio_lines(entries: list[dict], impl: str = "triton") -> tuple[list[str], list[list[str]]]:
    """One line per row: ``impl`` against each of RATIO_ANCHORS, 'fwd / fwd+bwd'."""
    headers = ["row"] + [f"{impl}/{LABELS[a]}" for a in RATIO_ANCHORS]
    lines = [
        [Row.from_json(e["row"]).describe()]
        + [fmt_modes(lambda m, a=a: ratio_between(e, impl, a, m)) for a in RATIO_ANCHORS]
        for e in entries
    ]
    return headers, lines


def config_ratio_lines(entries: list[dict], impl: str = "triton") -> tuple[list[str], list[list[str]]]:
    """Per dtype and head dim, ``impl``'s worst ratio to each of RATIO_ANCHORS over target_rows,
    'fwd / fwd+bwd' ('-' where the anchor ran none of them)."""
    headers = ["config"] + [f"{impl}/{LABELS[a]} (worst)" for a in RATIO_ANCHORS]
    lines = []
    for (dtype, D), es in sorted(group_entries(entries).items()):
        if big := target_rows(es):
            lines.append(
                [f"{dtype} d{D}"]
                + [
                    fmt_modes(
                        lambda m, a=a: min(
                            (r for e in big if (r := ratio_between(e, impl, a, m)) is not None), default=None
                        )
                    )
                    for a in RATIO_ANCHORS
                ]
            )
    return headers, lines


def text_table(headers: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *lines)] if lines else [len(h) for h in headers]
    out = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def md_table(headers: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def row_lines(entries: list[dict], impls: list[str]) -> tuple[list[str], list[list[str]]]:
    """Headers and lines: one line per row, 'fwd / fwd+bwd' TFLOP/s per implementation,
    then the best anchor and triton's ratio to it, and our two policies (default sdpa() and
    policy="fastest") against the best backend each could have chosen (choice_ratio)."""
    headers = (
        ["row"]
        + [LABELS.get(i, i) for i in impls]
        + ["best anchor", "triton/best", "default/best backend", "fastest/best backend"]
    )
    lines = []
    for e in entries:
        row = Row.from_json(e["row"])
        res = e["results"]
        best = e.get("best_anchor", {})
        best_s = " / ".join(LABELS.get(best.get(m) or "", "-") if best.get(m) else "-" for m in MODES)
        lines.append(
            [row.describe()]
            + [fmt_pair(res.get(i)) for i in impls]
            + [
                best_s,
                fmt_ratio(res.get("triton")),
                fmt_modes(lambda m, e=e: choice_ratio(e, m, "sdpa")),
                fmt_modes(lambda m, e=e: choice_ratio(e, m)),
            ]
        )
    return headers, lines


def group_entries(entries: list[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for e in entries:
        groups.setdefault((e["row"]["dtype"], e["row"]["D"]), []).append(e)
    return groups


def split_dense(entries: list[dict]) -> tuple[list[dict], list[dict]]:
    dense = sorted(
        (e for e in entries if e["row"]["feature"] == "dense"), key=lambda e: (e["row"]["causal"], e["row"]["S"])
    )
    feats = [e for e in entries if e["row"]["feature"] != "dense"]
    return dense, feats


def target_note(target: dict) -> str:
    """What explains a target's misses, where the target records them (our policies): each row
    below the bar, and whether the policy chose the best column's backend there."""
    parts = []
    for m in target.get("misses") or []:
        why = "the best column: one kernel timed twice" if m["same_backend"] else f"the best: {m['best']}"
        if m.get("paired"):  # read paired (choice_ratio): what the lower quartiles alone read
            why += f"; read paired, lower quartiles {m['direct']:.2f}"
        parts.append(("below: " if not parts else "") + f"{m['row']} {m['ratio']:.2f} (chose {m['chose']}, {why})")
    if "direct_below" in target:  # our policies: how their rows were read (choice_ratio)
        parts.append(
            f"{target['paired_rows']} rows read paired with the choice's column (one call a turn), "
            f"the others by lower quartiles; lower quartiles alone: worst {target['direct_worst']:.2f}, "
            f"{target['direct_below']} rows below"
        )
    return "; ".join(parts)


def targets_table(targets: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["target", "measured (worst)", "each", "status"]
    lines = [
        [
            t["target"],
            fmt_num(t["worst"], 2),
            ", ".join("-" if r is None else f"{r:.2f}" for r in t["ratios"]),
            t["status"] + (f": {note}" if (note := target_note(t)) else ""),
        ]
        for t in targets
    ]
    return headers, lines


def memory_lines(entries: list[dict], impls: list[str]) -> tuple[list[str], list[list[str]]]:
    headers = ["row"] + [LABELS.get(i, i) for i in impls]
    lines = []
    for e in entries:
        cells = []
        for i in impls:
            m = (e["results"].get(i) or {}).get("fwd+bwd") or {}
            cells.append(fmt_num(m.get("peak_mib")) if m.get("status") == "ok" else "-")
        lines.append([Row.from_json(e["row"]).describe()] + cells)
    return headers, lines


def error_notes(entries: list[dict], limit: int = 40) -> list[str]:
    """One note per (implementation, mode, first line of the error), naming its rows."""
    seen: dict[tuple[str, str, str], list[str]] = {}
    for e in entries:
        for impl, r in e["results"].items():
            for m in MODES:
                x = r.get(m) or {}
                if x.get("status") == "error":
                    seen.setdefault((impl, m, x.get("note", "")), []).append(e["row"]["id"])
    notes = []
    for (impl, m, note), ids in sorted(seen.items()):
        where = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
        notes.append(f"error: {impl} {m} on {where}: {note}")
    return notes[:limit]


def s_label(S: int) -> str:
    """512 -> '512', 4096 -> '4k'."""
    return f"{S // 1024}k" if S >= 1024 and S % 1024 == 0 else str(S)


def short_report(data: dict) -> str:
    """The printed table (last in the output): bf16 hdim 128 in full, the rest as ratios."""
    entries, impls = data["rows"], data["meta"].get("impls", list(IMPLS))
    out = []
    groups = group_entries(entries)
    main = groups.get(("bf16", 128), [])
    if main:
        dense, feats = split_dense(main)
        h, lines = row_lines(dense + feats, impls)
        out.append("bf16 hdim 128: TFLOP/s fwd / fwd+bwd; ratios to the best anchor ('-' unsupported)")
        out.append(text_table(h, lines))
    others = [(k, v) for k, v in groups.items() if k != ("bf16", 128)]
    if others:
        out.append("\nother configs: triton / best anchor, fwd / fwd+bwd, per S (c = causal)")
        for (dtype, D), es in others:
            dense, _ = split_dense(es)
            parts = [
                f"{s_label(e['row']['S'])}{'c' if e['row']['causal'] else ''} {fmt_ratio(e['results'].get('triton'))}"
                for e in dense
            ]
            out.append(f"  {dtype} d{D}: " + "; ".join(parts))
    h, lines = config_ratio_lines(entries)
    if lines:
        out.append(f"\ntriton's worst ratios per config, fwd / fwd+bwd (dense, S >= {s_label(TARGET_MIN_S)}):")
        out.append(text_table(h, lines))
    targets = data.get("targets") or []
    if targets:
        out.append("\ntargets (triton):")
        for t in targets:
            out.append(f"  [{t['status']}] {t['target']}: worst {fmt_num(t['worst'], 2)}")
            if note := target_note(t):
                out.append(f"      {note}")
    meta = data["meta"]
    out.append(
        f"\n{meta.get('gpu', '?')} | torch {meta.get('torch')} | triton {meta.get('triton')} | "
        f"cuDNN {meta.get('cudnn')} | fa4 {meta.get('fa4')} | {meta.get('elapsed_s', 0):.0f} s"
    )
    return "\n".join(out)


def markdown_report(data: dict, plot_links: dict[str, str]) -> str:
    meta, entries = data["meta"], data["rows"]
    impls = meta.get("impls", list(IMPLS))
    lines = [
        "# Benchmarks",
        "",
        "Regenerated by `python benchmarks/bench.py` (do not edit by hand): "
        f"{'quick mode' if meta.get('quick') else 'full grid'}, {meta.get('date', '?')}.",
        "Decode and KV-cache calls (sdpa_with_kvcache, chunked prefill): [decode.md](decode.md), "
        "written by `python benchmarks/decode.py --doc docs/decode.md`.",
        "Context parallelism over several GPUs (context_parallel_sdpa): [distributed.md](distributed.md#measured), "
        "from `python benchmarks/context_parallel.py`.",
        "",
        "| | |",
        "|---|---|",
        f"| GPU | {meta.get('gpu', '?')} |",
        f"| PyTorch | {meta.get('torch', '?')} (CUDA {meta.get('cuda', '?')}) |",
        f"| Triton | {meta.get('triton', '?')} |",
        f"| cuDNN | {meta.get('cudnn', '?')} |",
        f"| flash-attn 4 | {meta.get('fa4', '?')} |",
        f"| commit | {meta.get('commit', '?')} |",
        f"| command | `{meta.get('command', '?')}` |",
        f"| run time | {meta.get('elapsed_s', 0):.0f} s |",
        "",
        f"B*S = {TOKENS} tokens, hidden {HIDDEN} (H = {HIDDEN} / D). TFLOP/s count 4*B*H*S*S*D for the "
        "forward (halved when causal; window and varlen rows count only the allowed (query, key) pairs) "
        f"and {BWD_FACTOR}x that for forward+backward. Cells: forward / forward+backward TFLOP/s; "
        "`-` = the implementation does not support the row (never routed elsewhere), `err` = it failed "
        "(first line in details.log), `skip` = out of time budget, `!` = output differed from the "
        "reference. Ratios are to the best anchor of the row (anchors: "
        + ", ".join(LABELS[a] for a in ANCHORS)
        + "); `default/best backend` and `fastest/best backend` compare default sdpa() and "
        "policy=\"fastest\" with the best of the backends eligible for that row and mode (the ones "
        "claiming it exactly: not cuDNN's dropout, for one; one that failed while timed still counts)"
        + (
            "; where a policy's turns ran next to its choice's column one call a turn (cells over ~3.6 ms), "
            "it is read as policy / that column, paired round by round (the medians of the rounds where the "
            "policy went second and of those where it went first, averaged), times that column / the best "
            "column (docs/experiments/perf-notes.md, experiment 75)"
            if meta.get("pair_fastest")
            else ""
        )
        + ". Timing: CUDA events, "
        + (
            f"the {meta['statistic']} of several repetitions (slowdowns from the clock state and "
            "host hiccups are one-sided; docs/experiments/perf-notes.md, experiment 62)"
            if meta.get("statistic")
            else "median of several repetitions"
        )  # runs before experiment 62 have no statistic
        + " after warm-up, one process; "
        + (
            TIMING_QUEUED
            if meta.get("timing") == "queued"
            else "a repetition is one synchronised call (the anchors' own method), or back-to-back calls "
            "for calls under 0.5 ms; "
        )
        + (
            f"a row's implementations take turns in {meta['rounds']} rounds (order "
            + ("shuffled each round" if meta.get("sampling") == SAMPLING_SHUFFLED else "rotated")
            + "), each turn "
            + (
                f"opening with at least {meta['turn_warm_ms']:g} ms of untimed calls"
                if meta.get("turn_warm_ms")
                else "opening with one untimed call"
            )  # runs before experiment 32 have no turn_warm_ms
            + (f", timing at least {meta['min_per_turn']} calls" if meta.get("min_per_turn", 1) > 1 else "")
            + (
                f"; a turn over {meta['slow_factor']:g}x its row's fastest in the first round stops after "
                f"{meta['slow_rounds']} rounds"
                if meta.get("slow_factor")
                else ""
            )  # runs before experiment 66 time every turn alike
            + (
                "; policy=\"fastest\" takes its turn next to the backend it chose (after it in even rounds, "
                "before it in odd ones"
                + ("; default sdpa() likewise, on the other side" if meta.get("pair_default") else "")
                + ": two measurements of one kernel share the machine's state"
                + (
                    "; rounds 2k and 2k + 1 in one order, so each side goes first after the same turns"
                    if meta.get("pair_rounds")
                    else ""
                )
                + ")"
                if meta.get("pair_fastest")
                else ""
            )
            + ", with Python's garbage collector off while timing; "
            if meta.get("sampling") in (SAMPLING, SAMPLING_ONE_CALL, SAMPLING_SHUFFLED)
            else ""
        )
        + (
            "forward = inference (torch.no_grad(); Flex with grad enabled, its compiled graph depends on it)."
            if meta.get("fwd_timing") == "no_grad"
            else "forward timed with grad enabled (inputs require grad)."
        ),
        "",
    ]
    for i, (name, link) in enumerate(plot_links.items()):  # the first inline, the others linked
        lines += [f"![{name}]({link})" if i == 0 else f"- [{name}]({link})", ""]
    targets = data.get("targets") or []
    if targets:
        h, t = targets_table(targets)
        lines += ["## Targets of issue 5 (triton)", "", md_table(h, t), ""]
    h, t = config_ratio_lines(entries)
    if t:
        lines += [
            f"The same ratios for every dtype and head dim: our kernel's worst over the dense rows with "
            f"S >= {s_label(TARGET_MIN_S)}, causal and not, fwd / fwd+bwd (reported; the targets above "
            "are bf16 d128's):",
            "",
            md_table(h, t),
            "",
        ]
    groups = group_entries(entries)
    order = sorted(groups, key=lambda k: (k != ("bf16", 128), k[0], k[1]))
    for key in order:
        dense, feats = split_dense(groups[key])
        h, t = row_lines(dense + feats, impls)
        lines += [f"## {key[0]}, head dim {key[1]}", "", md_table(h, t), ""]
        rh, rt = anchor_ratio_lines(dense + feats)
        lines += [
            "Our kernel against cuDNN, Flex and flash-attn 4, fwd / fwd+bwd (`-`: one of the two did not run the row):",
            "",
            md_table(rh, rt),
            "",
        ]
        if key == ("bf16", 128):
            mh, mt = memory_lines(dense + feats, impls)
            lines += ["Peak memory of forward+backward beyond the inputs (MiB):", "", md_table(mh, mt), ""]
        decisions = sorted(
            {
                f"{Row.from_json(e['row']).describe()}: {e['results']['sdpa'].get('backend')}"
                for e in dense + feats
                if (e["results"].get("sdpa") or {}).get("backend")
            }
        )
        if decisions:
            chosen = {}
            for e in dense + feats:
                b = (e["results"].get("sdpa") or {}).get("backend")
                if b:
                    chosen.setdefault(b, []).append(Row.from_json(e["row"]).describe())
            lines += ["sdpa() chose: " + "; ".join(f"{b} ({len(v)} rows)" for b, v in chosen.items()), ""]
    notes = meta.get("notes") or []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)
