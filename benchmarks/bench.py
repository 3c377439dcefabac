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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import gc
import gzip
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script on a machine where the package is not installed
    sys.path.insert(0, str(ROOT))

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp16")
WINDOW = (1024, 0)
VARLEN_SEQS = 16
VARLEN_SEED = 0
GQA_GROUP = 4
DROPOUT = 0.1
FEATURES = ("dense", "bias", "window", "varlen", "gqa", "dropout")
MODES = ("fwd", "fwd+bwd")
BWD_FACTOR = 3.5

IMPLS = ("sdpa", "fastest", "triton", "cudnn", "torch_flash", "torch_efficient", "flex", "fa4")
# Our own columns: attention_dispatch.sdpa() (auto and policy="fastest") and our kernel forced.
OURS = ("sdpa", "fastest", "triton")
# What policy="fastest" can choose from (FlexAttention is an anchor, not a backend of ours).
BACKEND_IMPLS = ("triton", "cudnn", "torch_flash", "torch_efficient", "fa4")
ANCHORS = ("cudnn", "torch_flash", "torch_efficient", "flex", "fa4")
BACKEND_NAMES = {"fa4": "flash_attn"}  # column -> attention_dispatch backend name, where they differ
BACKEND_COLUMNS = {backend: column for column, backend in BACKEND_NAMES.items()}  # backend -> column
LABELS = {
    "sdpa": "sdpa (auto)",
    "fastest": "sdpa (fastest)",
    "triton": "triton (ours)",
    "cudnn": "cuDNN",
    "torch_flash": "torch flash",
    "torch_efficient": "torch eff",
    "flex": "Flex",
    "fa4": "FA4",
}
FA4_HEAD_DIMS = (64, 96, 128)  # flash_attn.cute 4.0 on sm90 (as attention_dispatch.backends.flash_attn)

QUICK_SEQLENS = (4096, 16384)
DEFAULT_BUDGET_S = 550.0  # the full grid, started rows included, within ~9.7 minutes on one H100
QUICK_BUDGET_S = 165.0  # --quick within 3 minutes
DEFAULT_FLEX_BUDGET_S = 200.0  # total seconds of Flex compilation allowed (it is the slowest part)
QUICK_FLEX_BUDGET_S = 95.0
DEFAULT_PRECOMPILE_WORKERS = 8  # compile workers on a GPU machine (16 cores there; ptxas is single-threaded)
TURN_WARM_MS = 0.0  # untimed calls opening each turn beyond the one (experiment 32: 20 ms did not help)
# A cell's time from its repetitions (experiment 62): slowdowns from the clock state a previous
# turn left and from host hiccups are one-sided, so the lower quartile measures the call; a
# quarter of the repetitions must agree on it, so one lucky repetition cannot set it (the minimum).
STATISTIC = "lower quartile"
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
# Implementations whose first call compiles (Triton, Inductor, CuTe DSL): the compile workers run these.
COMPILING_IMPLS = ("sdpa", "triton", "flex", "fa4")
# Seconds of compilation per row, roughly (session-5 logs): the workers' load balance.
COMPILE_WEIGHT = {"sdpa": 1.0, "triton": 0.2, "flex": 4.0, "fa4": 1.0}


# ---------------------------------------------------------------------------------------------
# Rows and FLOPs (pure)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One problem of the grid. For varlen, S is the packed length (= TOKENS) and B the
    number of sequences; `lengths` holds the sequence lengths."""

    dtype: str
    D: int
    S: int
    causal: bool
    feature: str = "dense"
    tokens: int = TOKENS
    hidden: int = HIDDEN
    lengths: tuple[int, ...] = ()

    @property
    def Hq(self) -> int:
        return self.hidden // self.D

    @property
    def Hkv(self) -> int:
        return self.Hq // GQA_GROUP if self.feature == "gqa" else self.Hq

    @property
    def B(self) -> int:
        return len(self.lengths) if self.feature == "varlen" else max(1, self.tokens // self.S)

    @property
    def window(self) -> tuple[int, int] | None:
        return WINDOW if self.feature == "window" else None

    @property
    def dropout_p(self) -> float:
        return DROPOUT if self.feature == "dropout" else 0.0

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths) if self.feature == "varlen" else self.S

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.feature == "varlen":
            return f"{self.dtype}-d{self.D}-varlen{len(self.lengths)}-{mask}"
        tail = mask if self.feature == "dense" else f"{mask}-{self.feature}"
        return f"{self.dtype}-d{self.D}-s{self.S}-{tail}"

    def describe(self) -> str:
        """Short human label used in tables: 'S=4096 causal', 'bias S=4096', ..."""
        mask = " causal" if self.causal else ""
        if self.feature == "dense":
            return f"S={self.S}{mask}"
        if self.feature == "varlen":
            return f"varlen {len(self.lengths)} seqs{mask}"
        if self.feature == "window":
            return f"window ({WINDOW[0]},{WINDOW[1]}) S={self.S}"
        if self.feature == "gqa":
            return f"GQA {self.Hq}/{self.Hkv} S={self.S}{mask}"
        if self.feature == "dropout":
            return f"dropout {DROPOUT} S={self.S}{mask}"
        return f"{self.feature} S={self.S}{mask}"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["lengths"] = list(self.lengths)
        d.update(
            id=self.id,
            B=self.B,
            Hq=self.Hq,
            Hkv=self.Hkv,
            window=self.window,
            dropout_p=self.dropout_p,
            pairs=allowed_pairs(self),
            flops_fwd=flops(self, "fwd"),
            flops_fwd_bwd=flops(self, "fwd+bwd"),
        )
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Row":
        return cls(
            dtype=d["dtype"],
            D=d["D"],
            S=d["S"],
            causal=d["causal"],
            feature=d["feature"],
            tokens=d.get("tokens", TOKENS),
            hidden=d.get("hidden", HIDDEN),
            lengths=tuple(d.get("lengths", ())),
        )


def varlen_lengths(total: int = TOKENS, n: int = VARLEN_SEQS, seed: int = VARLEN_SEED) -> tuple[int, ...]:
    """n random positive lengths summing to total (reproducible: Python's random with `seed`)."""
    if n < 1 or total < n:
        raise ValueError(f"need 1 <= n <= total, got n={n}, total={total}")
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    edges = [0] + cuts + [total]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def window_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """Pairs (i, j) with i + off - left <= j <= i + off + right, off = sk - sq (bottom-right,
    as a window without causal is aligned); -1 = unbounded on that side."""
    off = sk - sq
    total = 0
    for i in range(sq):
        lo = 0 if left < 0 else max(0, i + off - left)
        hi = sk - 1 if right < 0 else min(sk - 1, i + off + right)
        if hi >= lo:
            total += hi - lo + 1
    return total


def allowed_pairs(row: Row) -> float:
    """(query, key) pairs the row computes, summed over the batch (per head).

    Dense: B*S*S, halved when causal (the usual convention, not S(S+1)/2); window: the exact
    count; varlen: sum of L*L over the sequences (halved when causal)."""
    half = 0.5 if row.causal else 1.0
    if row.feature == "varlen":
        return half * sum(n * n for n in row.lengths)
    if row.feature == "window":
        left, right = row.window
        if row.causal:
            right = 0
        return float(row.B * window_pairs(row.S, row.S, left, right))
    return half * row.B * row.S * row.S


def flops(row: Row, mode: str) -> float:
    """4 * Hq * D * pairs for the forward; x3.5 for forward+backward."""
    f = 4.0 * row.Hq * row.D * allowed_pairs(row)
    if mode == "fwd":
        return f
    if mode == "fwd+bwd":
        return BWD_FACTOR * f
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def tflops(row: Row, mode: str, ms: float) -> float:
    return flops(row, mode) / (ms * 1e-3) / 1e12


def build_grid(quick: bool = False) -> list[Row]:
    """Every row, in the order they are measured (most important first, so that a time
    budget that runs out cuts the least important ones): bf16 hdim 128, its feature rows,
    then the other head dims and fp16."""
    seqlens = QUICK_SEQLENS if quick else SEQLENS
    configs = (
        [("bf16", 128)]
        if quick
        else [("bf16", 128), ("bf16", 64), ("bf16", 256), ("fp16", 128), ("fp16", 64), ("fp16", 256)]
    )
    rows: list[Row] = []
    for dtype, D in configs:
        for S in seqlens:
            for causal in (False, True):
                rows.append(Row(dtype, D, S, causal))
        if (dtype, D) == ("bf16", 128):
            rows.extend(feature_rows(dtype, D))
    return rows


def feature_rows(dtype: str = "bf16", D: int = 128) -> list[Row]:
    lengths = varlen_lengths()
    return [
        Row(dtype, D, 4096, False, "bias"),
        Row(dtype, D, 4096, False, "window"),
        Row(dtype, D, 16384, False, "window"),
        Row(dtype, D, TOKENS, False, "varlen", lengths=lengths),
        Row(dtype, D, TOKENS, True, "varlen", lengths=lengths),
        Row(dtype, D, 4096, False, "gqa"),
        Row(dtype, D, 4096, True, "gqa"),
        Row(dtype, D, 4096, False, "dropout"),
    ]


def smoke_grid() -> list[Row]:
    """Tiny rows for --smoke-cpu (checks the pipeline on a machine without a GPU)."""
    kw = dict(tokens=256, hidden=256)
    lengths = varlen_lengths(256, 4, VARLEN_SEED)
    return [
        Row("bf16", 64, 128, False, **kw),
        Row("bf16", 64, 128, True, **kw),
        Row("bf16", 64, 256, False, **kw),
        Row("bf16", 64, 128, False, "bias", **kw),
        Row("bf16", 64, 256, False, "window", **kw),
        Row("bf16", 64, 256, False, "varlen", lengths=lengths, **kw),
        Row("bf16", 64, 256, True, "varlen", lengths=lengths, **kw),
        Row("bf16", 64, 128, False, "gqa", **kw),
        Row("bf16", 64, 128, False, "dropout", **kw),
    ]


def select_rows(rows: list[Row], patterns: list[str] | None) -> list[Row]:
    """Rows whose id matches any fnmatch pattern (a pattern without wildcards matches as a
    substring); no patterns: all rows."""
    if not patterns:
        return list(rows)
    pats = [p if any(c in p for c in "*?[") else f"*{p}*" for p in patterns]
    return [r for r in rows if any(fnmatch.fnmatchcase(r.id, p) for p in pats)]


# ---------------------------------------------------------------------------------------------
# Which implementation supports which row (pure)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlexScope:
    """Where the grid measures FlexAttention, whose compilation is the grid's slowest part: every
    row of ``dtypes`` x ``dims``, and at every dtype and head dim the dense rows with S >=
    ``from_s`` (the rows our kernel's ratios are read on, so each config has its ratio to Flex;
    0: only ``dtypes`` x ``dims``)."""

    dims: tuple[int, ...] = (64, 128)
    dtypes: tuple[str, ...] = ("bf16",)
    from_s: int = 4096

    def why_not(self, row: Row) -> str | None:
        """None when Flex is measured on ``row``; otherwise why not."""
        if row.D in self.dims and row.dtype in self.dtypes:
            return None
        if self.from_s and row.feature == "dense" and row.S >= self.from_s:
            return None
        return f"Flex not measured here: {self.describe()} (compile time; widen with --flex-dims/--flex-dtypes)"

    def describe(self) -> str:
        where = f"{'/'.join(self.dtypes)} hdim {'/'.join(map(str, self.dims))}"
        return where + (
            f", and dense rows with S >= {self.from_s} at every dtype and head dim" if self.from_s else " only"
        )

    def argv(self) -> list[str]:
        """The command-line options that give this scope (for the compile workers)."""
        return [
            "--flex-dims",
            ",".join(map(str, self.dims)),
            "--flex-dtypes",
            ",".join(self.dtypes),
            "--flex-from-s",
            str(self.from_s),
        ]


def support(impl: str, row: Row, mode: str, flex: FlexScope = FlexScope()) -> str | None:
    """None when `impl` runs this row and mode; otherwise why not (shown as "-")."""
    f = row.feature
    if impl in OURS:
        return None
    if impl in ("cudnn", "torch_flash", "torch_efficient"):
        if f == "window":
            return "no sliding window in PyTorch's SDPA kernels"
        if impl == "torch_flash" and f == "bias":
            return "torch flash takes no attn_mask"
        if impl == "torch_efficient" and f == "varlen" and mode == "fwd+bwd":
            return "torch efficient: no training with jagged nested tensors"
        if impl == "cudnn" and f == "varlen" and row.D > 128:
            return "cuDNN nested: head_dim <= 128"
        return None
    if impl == "fa4":
        if row.D not in FA4_HEAD_DIMS:
            return f"flash-attn 4 on sm90: head_dim {row.D} not in {FA4_HEAD_DIMS}"
        if f in ("bias", "dropout"):
            return f"flash-attn 4: no {'attn_mask' if f == 'bias' else 'dropout'}"
        if f in ("window", "varlen") and mode == "fwd+bwd":
            return f"flash-attn 4 on sm90: no {f} backward"
        return None
    if impl == "flex":
        if f == "dropout":
            return "FlexAttention has no dropout"
        return flex.why_not(row)
    raise ValueError(f"unknown implementation {impl!r}")


# ---------------------------------------------------------------------------------------------
# Results, ratios, tables (pure)
# ---------------------------------------------------------------------------------------------


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


def ratio_between(entry: dict, a: str, b: str, mode: str) -> float | None:
    va, vb = cell_value(entry["results"].get(a), mode), cell_value(entry["results"].get(b), mode)
    return va / vb if (va is not None and vb) else None


# The anchors issue 5 states our kernel's ratios against; every row and every dtype and head dim
# reports them, not only the bf16 d128 rows that carry targets.
RATIO_ANCHORS = ("cudnn", "flex", "fa4")
TARGET_MIN_S = 4096  # the targets read dense rows from this S up


def anchor_ratio_lines(entries: list[dict], impl: str = "triton") -> tuple[list[str], list[list[str]]]:
    """One line per row: ``impl`` against each of RATIO_ANCHORS, 'fwd / fwd+bwd'."""
    headers = ["row"] + [f"{impl}/{LABELS[a]}" for a in RATIO_ANCHORS]
    lines = [
        [Row.from_json(e["row"]).describe()]
        + [fmt_modes(lambda m, a=a: ratio_between(e, impl, a, m)) for a in RATIO_ANCHORS]
        for e in entries
    ]
    return headers, lines


def target_rows(entries: list[dict]) -> list[dict]:
    """The dense rows with S >= TARGET_MIN_S, causal and not (by causal, then S)."""
    big = [e for e in entries if e["row"]["feature"] == "dense" and e["row"]["S"] >= TARGET_MIN_S]
    return sorted(big, key=lambda e: (e["row"]["causal"], e["row"]["S"]))


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
    then the best anchor and the ratios of sdpa and triton to it."""
    headers = (
        ["row"]
        + [LABELS.get(i, i) for i in impls]
        + ["best anchor", "sdpa/best", "triton/best", "fastest/best backend"]
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
                fmt_ratio(res.get("sdpa")),
                fmt_ratio(res.get("triton")),
                fmt_modes(lambda m, e=e: fastest_ratio(e, m)),
            ]
        )
    return headers, lines


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


def paired_log_ratio(entry: dict, mode: str) -> float | None:
    """log(policy="fastest"'s speed / the speed of the column it was paired with), read round by
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
    cell = (results.get("fastest") or {}).get(mode) or {}
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


def fastest_ratio(entry: dict, mode: str, paired: bool = True) -> float | None:
    """policy="fastest" against the best single backend it could have chosen (best_backend).
    Where its turns were paired with its choice's column one call a turn (paired_log_ratio),
    read as (fastest / that column, paired) x (that column / the best column): the first factor
    is two measurements of one kernel side by side, the second the choice.  ``paired=False``:
    the ratio of the two columns' lower quartiles (the direct reading, also reported)."""
    results = entry["results"]
    v = cell_value(results.get("fastest"), mode)
    _, best = best_backend(entry, mode)
    if v is None or not best:
        return None
    log_ratio = paired_log_ratio(entry, mode) if paired else None
    if log_ratio is None:
        return v / best
    column = results["fastest"][mode]["paired_with"]
    return math.exp(log_ratio) * cell_value(results[column], mode) / best


def chosen_column(results: dict, mode: str) -> str | None:
    """The column running the backend policy="fastest" chose in this mode (its backend name,
    BACKEND_COLUMNS where the column is named otherwise), or None before it chose."""
    backend = ((results.get("fastest") or {}).get(mode) or {}).get("backend")
    return BACKEND_COLUMNS.get(backend, backend) if backend else None


def fastest_misses(entries: list[dict], mode: str, need: float = 0.97) -> list[dict]:
    """The rows where policy="fastest" read below ``need`` of the best single backend: its
    ratio, the backend it chose, the best column's backend, and whether they are one backend
    (then the gap is two measurements of one kernel, not a wrong choice)."""
    misses = []
    for e in entries:
        r = fastest_ratio(e, mode)
        if r is None or r >= need:
            continue
        chose = ((e["results"].get("fastest") or {}).get(mode) or {}).get("backend")
        best, _ = best_backend(e, mode)
        misses.append(
            dict(
                row=Row.from_json(e["row"]).id,
                ratio=round(r, 3),
                direct=round(fastest_ratio(e, mode, paired=False), 3),
                paired=paired_log_ratio(e, mode) is not None,
                chose=chose,
                best=BACKEND_NAMES.get(best, best),
                same_backend=chosen_column(e["results"], mode) == best,
            )
        )
    return misses


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
    for mode in MODES:
        cells = [e for e in entries if (e["results"].get("fastest") or {}).get(mode)]
        ratios = [r for e in cells if (r := fastest_ratio(e, mode)) is not None]
        if ratios:
            direct = [r for e in cells if (r := fastest_ratio(e, mode, paired=False)) is not None]
            add(
                f"policy=fastest {mode} >= 0.97x the best single backend, every row ({len(ratios)} rows)",
                ratios,
                0.97,
                misses=fastest_misses(entries, mode, 0.97),
                paired_rows=sum(paired_log_ratio(e, mode) is not None for e in cells),
                direct_worst=round(min(direct), 3),
                direct_below=sum(r < 0.97 for r in direct),
            )
    return targets


def target_note(target: dict) -> str:
    """What explains a target's misses, where the target records them (policy="fastest"): each
    row below the bar, and whether fastest chose the best column's backend there."""
    parts = []
    for m in target.get("misses") or []:
        why = "the best column: one kernel timed twice" if m["same_backend"] else f"the best: {m['best']}"
        if m.get("paired"):  # read paired (fastest_ratio): what the lower quartiles alone read
            why += f"; read paired, lower quartiles {m['direct']:.2f}"
        parts.append(("below: " if not parts else "") + f"{m['row']} {m['ratio']:.2f} (chose {m['chose']}, {why})")
    if "direct_below" in target:  # policy="fastest": how its rows were read (fastest_ratio)
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
        + "); `fastest/best backend` compares policy=\"fastest\" "
        "with the best of the backends eligible for that row and mode (the ones claiming it exactly: "
        "not cuDNN's dropout, for one; one that failed while timed still counts)"
        + (
            "; where its turns ran next to its choice's column one call a turn (cells over ~3.6 ms), it is "
            "read as fastest / that column, paired round by round (the medians of the rounds where fastest "
            "went second and of those where it went first, averaged), times that column / the best "
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
                "before it in odd ones: two measurements of one kernel share the machine's state"
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


def make_plots(data: dict, out_dir: Path) -> list[Path]:
    """bench_<dtype>_d<D>.png: TFLOP/s against S, one line per implementation; subplots
    forward / forward+backward x non-causal / causal. Returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - plotting is optional
        data["meta"].setdefault("notes", []).append(f"no plot: matplotlib unavailable ({type(e).__name__})")
        return []
    impls = data["meta"].get("impls", list(IMPLS))
    written = []
    for (dtype, D), es in group_entries(data["rows"]).items():
        dense, _ = split_dense(es)
        if not dense:
            continue
        fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
        for ci, causal in enumerate((False, True)):
            for mi, mode in enumerate(MODES):
                ax = axes[ci][mi]
                for impl in impls:
                    pts = [
                        (e["row"]["S"], cell_value(e["results"].get(impl), mode))
                        for e in dense
                        if e["row"]["causal"] == causal
                    ]
                    pts = [(s, v) for s, v in pts if v is not None]
                    if pts:
                        style = "-" if impl in OURS else "--"
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=LABELS[impl])
                ax.set_xscale("log", base=2)
                xs = sorted({e["row"]["S"] for e in dense})
                ax.set_xticks(xs, [s_label(x) for x in xs])
                ax.minorticks_off()
                ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}")
                ax.set_ylabel("TFLOP/s")
                ax.set_ylim(bottom=0)
                ax.grid(True, alpha=0.3)
                if ci == 1:
                    ax.set_xlabel("sequence length S (B*S = 16k tokens)")
        handles, labels = [], []
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        if not handles:  # every measurement of this group skipped or failed
            plt.close(fig)
            continue
        fig.legend(handles, labels, loc="lower center", ncol=len(labels))
        fig.suptitle(f"{dtype}, head dim {D}, hidden {HIDDEN} - {data['meta'].get('gpu', '')}")
        fig.tight_layout(rect=(0, 0.05, 1, 0.97))
        path = out_dir / f"bench_{dtype}_d{D}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


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
        help="time policy=\"fastest\" in its shuffled place, not next to the backend it chose "
        "(docs/experiments/perf-notes.md, experiment 69)",
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


# ---------------------------------------------------------------------------------------------
# GPU part
# ---------------------------------------------------------------------------------------------


class Log:
    """details.log: every line also printed (flushed), so a killed run leaves its trace."""

    def __init__(self, path: Path | None, echo: bool = True):
        self.f = open(path, "w") if path else None
        self.echo = echo

    def __call__(self, msg: str) -> None:
        if self.f:
            self.f.write(msg + "\n")
            self.f.flush()
        if self.echo:
            print(msg, flush=True)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class Runner:
    """Holds the imported libraries, the Flex compile cache and the clock."""

    def __init__(self, args, log: Log):
        import torch

        self.torch = torch
        self.args, self.log = args, log
        self.t0 = time.perf_counter()
        self.dev = "cpu" if args.smoke_cpu else "cuda"
        self.cuda = self.dev == "cuda"
        self.notes: list[str] = []
        self.flex_compile_s = 0.0
        self.flex_fn = None
        self.flex_error = None
        self.fa4 = None
        self.fa4_error = None
        self.fa4_version = "not importable"
        import attention_dispatch as ad
        from attention_dispatch.api import normalize_call  # noqa: F401 - fail early if the API moved

        self.ad = ad
        self.dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}

    def empty_cache(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    # -- optional libraries -------------------------------------------------------------------
    def load_fa4(self) -> None:
        t = time.perf_counter()
        try:
            from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

            self.fa4 = (flash_attn_func, flash_attn_varlen_func)
            try:
                from importlib.metadata import version

                self.fa4_version = next(
                    (version(n) for n in ("flash-attn-4", "flash_attn_4", "flash-attn") if _has_dist(n)), "present"
                )
            except Exception:  # noqa: BLE001
                self.fa4_version = "present"
            self.log(f"flash_attn.cute imported ({self.fa4_version}) in {time.perf_counter() - t:.1f} s")
        except Exception as e:  # noqa: BLE001
            self.fa4_error = first_line(e)
            self.notes.append(f"flash-attn 4 not measured: `from flash_attn.cute import ...` failed: {self.fa4_error}")
            self.log(f"flash-attn 4 unavailable: {self.fa4_error}")

    def load_flex(self) -> None:
        torch = self.torch
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            cfg = torch._dynamo.config
            for name in (
                "cache_size_limit",
                "recompile_limit",
                "accumulated_cache_size_limit",
                "accumulated_recompile_limit",
            ):
                if hasattr(cfg, name):
                    setattr(cfg, name, 4096)
            self.flex_fn = torch.compile(flex_attention, dynamic=False)
            self.create_block_mask = create_block_mask
        except Exception as e:  # noqa: BLE001
            self.flex_error = first_line(e)
            self.notes.append(f"FlexAttention not measured: {self.flex_error}")
            self.log(f"flex unavailable: {self.flex_error}")

    # -- inputs ------------------------------------------------------------------------------
    def make_inputs(self, row: Row) -> dict:
        torch = self.torch
        dt, dev = self.dtypes[row.dtype], self.dev
        g = torch.Generator(device=dev)
        g.manual_seed(self.args.seed)

        def rnd(*shape):
            return torch.randn(*shape, device=dev, dtype=dt, generator=g)

        if row.feature == "varlen":
            T = sum(row.lengths)
            q, k, v, do = rnd(T, row.Hq, row.D), rnd(T, row.Hkv, row.D), rnd(T, row.Hkv, row.D), rnd(T, row.Hq, row.D)
            cu = [0]
            for n in row.lengths:
                cu.append(cu[-1] + n)
            inp = dict(
                q=q,
                k=k,
                v=v,
                do=do,
                cu=torch.tensor(cu, device=dev, dtype=torch.int32),
                cu_list=cu,
                max_seqlen=row.max_seqlen,
            )
        else:
            q = rnd(row.B, row.Hq, row.S, row.D)
            k, v = rnd(row.B, row.Hkv, row.S, row.D), rnd(row.B, row.Hkv, row.S, row.D)
            inp = dict(q=q, k=k, v=v, do=rnd(row.B, row.Hq, row.S, row.D))
        inp["bias"] = rnd(1, row.Hq, row.S, row.S) if row.feature == "bias" else None
        for name in ("q", "k", "v"):
            inp[name].requires_grad_(True)
        return inp

    # -- one implementation of one row: (fwd, leaves, grad_out, canon, ctx) ----------------------
    def prepare(self, impl: str, row: Row, inp: dict):
        torch = self.torch
        F = torch.nn.functional
        q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
        gqa = row.Hq != row.Hkv
        ident = lambda o: o
        if impl in OURS:
            ad = self.ad
            forced = "triton" if impl == "triton" else None
            kw = dict(
                attn_mask=inp["bias"],
                dropout_p=row.dropout_p,
                is_causal=row.causal,
                enable_gqa=gqa,
                window=row.window,
                backend=forced,
            )
            if row.feature == "varlen":
                kw.update(
                    cu_seqlens_q=inp["cu"],
                    cu_seqlens_k=inp["cu"],
                    max_seqlen_q=inp["max_seqlen"],
                    max_seqlen_k=inp["max_seqlen"],
                )

            def fwd():
                return ad.sdpa(q, k, v, **kw)

            if impl == "fastest":
                return fwd, (q, k, v), do, ident, (lambda: ad.use_config({"dispatch": {"policy": "fastest"}}))
            return fwd, (q, k, v), do, ident, contextlib.nullcontext
        if impl in ("cudnn", "torch_flash", "torch_efficient"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            be = {
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "torch_flash": SDPBackend.FLASH_ATTENTION,
                "torch_efficient": SDPBackend.EFFICIENT_ATTENTION,
            }[impl]

            def ctx():
                return sdpa_kernel([be])

            extra = {"enable_gqa": True} if gqa else {}
            if row.feature == "varlen":
                offsets = inp["cu"].to(torch.int64)
                m = inp["max_seqlen"]

                def nest(t):
                    return torch.nested.nested_tensor_from_jagged(
                        t, offsets, min_seqlen=min(row.lengths), max_seqlen=m
                    ).transpose(1, 2)

                def fwd():
                    o = F.scaled_dot_product_attention(
                        nest(q), nest(k), nest(v), dropout_p=row.dropout_p, is_causal=row.causal, **extra
                    )
                    return o.transpose(1, 2).values()

                return fwd, (q, k, v), do, ident, ctx

            def fwd():
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=inp["bias"], dropout_p=row.dropout_p, is_causal=row.causal, **extra
                )

            return fwd, (q, k, v), do, ident, ctx
        if impl == "fa4":
            func, varlen_func = self.fa4
            window = (None, None) if row.window is None else row.window
            if row.feature == "varlen":
                m = inp["max_seqlen"]

                def fwd():
                    o = varlen_func(
                        q,
                        k,
                        v,
                        cu_seqlens_q=inp["cu"],
                        cu_seqlens_k=inp["cu"],
                        max_seqlen_q=m,
                        max_seqlen_k=m,
                        causal=row.causal,
                        window_size=window,
                    )
                    return o[0] if isinstance(o, tuple) else o

                return fwd, (q, k, v), do, ident, contextlib.nullcontext
            qb, kb, vb = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
            dob = do.transpose(1, 2).contiguous()

            def fwd():
                o = func(qb, kb, vb, causal=row.causal, window_size=window)
                return o[0] if isinstance(o, tuple) else o

            return fwd, (qb, kb, vb), dob, (lambda o: o.transpose(1, 2)), contextlib.nullcontext
        if impl == "flex":
            return self.prepare_flex(row, inp)
        raise ValueError(impl)

    def mode_calls(self, impl: str, fwd, leaves, go) -> dict:
        """What one measurement of each mode calls: the forward as inference (no_grad), except
        Flex whose compiled graph depends on the grad mode, and forward + backward."""
        torch = self.torch

        def fb():
            o = fwd()
            torch.autograd.grad(o, leaves, go)

        def fwd_inference():
            with torch.no_grad():
                return fwd()

        return {"fwd": fwd if impl == "flex" else fwd_inference, "fwd+bwd": fb}

    def prepare_flex(self, row: Row, inp: dict):
        torch = self.torch
        q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
        cbm, dev = self.create_block_mask, self.dev
        score_mod, bm, canon = None, None, (lambda o: o)
        S = row.S
        if row.feature == "varlen":
            lens = torch.tensor(row.lengths, device=dev)
            doc = torch.repeat_interleave(torch.arange(len(row.lengths), device=dev), lens)
            causal = row.causal

            def mask_mod(b, h, qi, ki):
                same = doc[qi] == doc[ki]
                return (same & (qi >= ki)) if causal else same

            bm = cbm(mask_mod, None, None, S, S, device=dev)
            q, k, v = (
                t.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_(t.requires_grad) for t in (q, k, v)
            )
            do = do.transpose(0, 1).unsqueeze(0).contiguous()
            canon = lambda o: o[0].transpose(0, 1)
        elif row.feature == "window":
            left = row.window[0]

            def mask_mod(b, h, qi, ki):
                return (qi >= ki) & (qi - ki <= left)

            bm = cbm(mask_mod, None, None, S, S, device=dev)
        elif row.causal:

            def mask_mod(b, h, qi, ki):
                return qi >= ki

            bm = cbm(mask_mod, None, None, S, S, device=dev)
        if row.feature == "bias":
            bias = inp["bias"]

            def score_mod(score, b, h, qi, ki):
                return score + bias[0, h, qi, ki]

        flex, gqa = self.flex_fn, row.Hq != row.Hkv

        def fwd():
            return flex(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa)

        return fwd, (q, k, v), do, canon, contextlib.nullcontext

    # -- timing ------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def events(self):
        """(start, end) CUDA events; on the CPU (--smoke-cpu) host-clock stand-ins."""
        if self.cuda:
            return self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        return _HostEvent(), _HostEvent()

    def warm(self, fn) -> dict:
        """First call (compile / warm-up), an estimate, one more warm-up: how many calls a
        repetition groups (`inner` > 1 only for calls under 0.5 ms) and how many repetitions
        fit --target-ms."""
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        first = time.perf_counter() - t
        s, e = self.events()
        s.record()
        fn()
        e.record()
        e.synchronize()
        est = max(s.elapsed_time(e), 1e-3)
        if est > 1000.0:  # a very slow path: one measurement is enough
            return dict(est=est, reps=1, inner=1, first_call_s=first)
        inner = max(1, math.ceil(0.5 / est)) if est < 0.5 else 1
        reps = int(min(self.args.max_reps, max(3, self.args.target_ms / (est * inner))))
        fn()
        return dict(est=est, reps=reps, inner=inner, first_call_s=first)

    def sample(self, fn, reps: int, inner: int) -> list[float]:
        """`reps` repetitions of `inner` calls, each between its own pair of CUDA events, all
        enqueued back to back with one synchronisation at the end (as triton.testing.do_bench,
        without its L2 flush): device time of a call in steady state, not the host latency
        before its first kernel (benchmarks/overhead.py measures that).  Milliseconds per call.
        The garbage collector is off meanwhile (as in timeit): a collection of this process's
        large heap stalls the host for milliseconds, and the device idles until the next launch."""
        marks = [self.events() for _ in range(reps)]
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for s, e in marks:
                s.record()
                for _ in range(inner):
                    fn()
                e.record()
            self.sync()
        finally:
            if was_enabled:
                gc.enable()
        return [s.elapsed_time(e) / inner for s, e in marks]

    @staticmethod
    def summarize(w: dict, times: list[float]) -> dict:
        """A cell from its repetitions (ms per call): `ms` is their lower quartile (STATISTIC),
        `ms_median` the median, `spread` (slowest - fastest) / ms."""
        ms = lower_quartile(times)
        return dict(
            ms=ms,
            ms_median=statistics.median(times),
            reps=len(times),
            inner=w["inner"],
            first_call_s=w["first_call_s"],
            spread=(max(times) - min(times)) / ms,
            samples_ms=[round(t, 4) for t in times],
        )

    def time_fn(self, fn) -> dict:
        """One implementation alone: warm(), then all its repetitions (summarize())."""
        w = self.warm(fn)
        if w["est"] > 1000.0:  # a very slow path: the estimate is the measurement
            return dict(ms=w["est"], reps=1, inner=1, first_call_s=w["first_call_s"])
        return self.summarize(w, self.sample(fn, w["reps"], w["inner"]))

    def peak_mib(self, fn) -> float | None:
        torch = self.torch
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    # -- one row -----------------------------------------------------------------------------
    def run_row(self, row: Row, impls: list[str]) -> dict:
        log = self.log
        entry = {"row": row.to_json(), "results": {}}
        if self.left() <= 0:
            for impl in impls:
                entry["results"][impl] = {m: dict(status="skipped", note="time budget") for m in MODES}
            return entry
        log(
            f"\n== {row.id}  B={row.B} Hq={row.Hq} Hkv={row.Hkv} S={row.S} D={row.D} "
            f"fwd {flops(row, 'fwd') / 1e12:.3f} TFLOP  [t={self.elapsed():.0f}s]"
        )
        try:
            inp = self.make_inputs(row)
        except Exception as e:  # noqa: BLE001
            log(f"  inputs failed: {first_line(e)}")
            for impl in impls:
                entry["results"][impl] = {m: dict(status="error", note="inputs: " + first_line(e)) for m in MODES}
            return entry
        ref_holder: dict = {}  # the first checked output of the row: (impl, tensor)
        pending: list = []  # (impl, mode, call, context, warm-up facts)
        for impl in impls:
            res = entry["results"].setdefault(impl, {})
            self.run_impl(impl, row, inp, res, ref_holder, pending)
        self.measure_rounds(row, entry, pending)
        del inp, ref_holder, pending
        self.empty_cache()
        return entry

    def measure_rounds(self, row: Row, entry: dict, pending: list) -> None:
        """Every warmed-up (implementation, mode) of the row is timed in --rounds interleaved
        rounds, in a new order each round (:func:`turn_order`), each turn after untimed calls of at least
        --turn-warm-ms, and reported as the lower quartile of all its repetitions (STATISTIC): the card's clock
        and power state drift by ~10% over a row (a column measured alone could win or lose
        by that much, docs/experiments/perf-notes.md experiments 21 and 24), and a turn's speed depends on
        what ran before it (up to 8% for flash-attn 4, experiment 32; 20 ms of untimed calls
        per turn did not make two columns running the same kernel agree better, so the
        default is one call)."""
        log, rounds = self.log, max(1, self.args.rounds)
        times: dict[int, list[float]] = {i: [] for i in range(len(pending))}
        turns = {i: 0 for i in range(len(pending))}
        failed: dict[int, str] = {}
        slow: set[int] = set()
        turn_names = [(impl, m) for impl, m, *_ in pending]
        chosen = {m: c for m in MODES if self.args.pair_fastest and (c := chosen_column(entry["results"], m))}
        gc.collect()  # sample() keeps the collector off while it times; start from a clean heap
        for rnd in range(rounds):
            if rnd == 1:
                slow = slow_turns(
                    {i: (pending[i][1], times[i][0]) for i in times if times[i] and i not in failed},
                    self.args.slow_factor,
                    keep={i for i, p in enumerate(pending) if p[0] in OURS},
                )
            # paired, rounds 2k and 2k + 1 share one order (only the pair's two turns swap): both
            # sides of the pair go first after the same turn, whose clock state the first inherits
            order = turn_order(len(pending), row.id, rnd // 2 if chosen else rnd, self.args.seed)
            for i in pair_fastest(order, turn_names, chosen, rnd):
                impl, m, fn, ctx, w = pending[i]
                if i in failed or w["est"] > 1000.0 and times[i] or i in slow and rnd >= self.args.slow_rounds:
                    continue
                n = 1 if w["est"] > 1000.0 else max(self.args.min_per_turn, math.ceil(w["reps"] / rounds))
                try:
                    with ctx():
                        if w["est"] <= 1000.0:
                            # untimed calls first: the first call of each turn ran up to ~35% slower
                            # for every implementation alike (experiment 24, samples_ms), and the
                            # clock follows the previous turn's implementation (experiment 32)
                            for _ in range(warm_calls(w["est"], self.args.turn_warm_ms)):
                                fn()
                        times[i] += self.sample(fn, n, w["inner"])
                    turns[i] += 1
                except Exception as e:  # noqa: BLE001
                    failed[i] = first_line(e)
                    with contextlib.suppress(Exception):
                        self.sync()
        for i, (impl, m, fn, ctx, w) in enumerate(pending):
            res = entry["results"][impl]
            if i in failed:
                res[m] = dict(status="error", note=failed[i])
                log(f"  {impl:16s} {m:8s} err: {failed[i]}")
                continue
            r = dict(res[m], **self.summarize(w, times[i]))
            r.update(status="ok", tflops=tflops(row, m, r["ms"]), rounds=turns[i])
            if impl == "fastest" and m in chosen and (chosen[m], m) in turn_names:
                r["paired_with"] = chosen[m]  # its turns ran next to that column's (pair_fastest)
            res[m] = r
            log(
                f"  {impl:16s} {m:8s} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s  peak "
                f"{fmt_num(r.get('peak_mib')):>6s} MiB  reps {r['reps']}x{r['inner']}  first {r['first_call_s']:.2f} s  "
                f"spread {r.get('spread', 0):.2f}"
            )

    def run_impl(self, impl: str, row: Row, inp: dict, res: dict, ref_holder: dict, pending: list) -> None:
        """Prepare one implementation for the row and warm up each supported mode (compile,
        estimate, peak memory, the decision it logged, the output check); the timing itself
        is left to measure_rounds (appended to `pending`)."""
        log, args = self.log, self.args
        reasons = {m: support(impl, row, m, args.flex) for m in MODES}
        if impl == "fa4" and self.fa4 is None:
            reasons = {m: reasons[m] or f"not importable: {self.fa4_error}" for m in MODES}
        if impl == "flex" and self.flex_fn is None:
            reasons = {m: reasons[m] or f"unavailable: {self.flex_error}" for m in MODES}
        if impl == "flex" and all(r is None for r in reasons.values()):
            if self.flex_compile_s >= args.flex_budget_s:
                reasons = {m: "Flex compile budget spent (--flex-budget-s)" for m in MODES}
            elif self.left() < 30:
                reasons = {m: "too little time left to compile Flex" for m in MODES}
        for m in MODES:
            if reasons[m] is not None:
                skipped = "budget" in reasons[m] or "time left" in reasons[m]
                res[m] = dict(status="skipped" if skipped else "unsupported", note=reasons[m])
        todo = [m for m in MODES if reasons[m] is None]
        if not todo:
            log(f"  {impl:16s} -  ({reasons['fwd']})")
            return
        try:
            fwd, leaves, go, canon, ctx = self.prepare(impl, row, inp)
        except Exception as e:  # noqa: BLE001
            for m in todo:
                res[m] = dict(status="error", note="prepare: " + first_line(e))
            log(f"  {impl:16s} err prepare: {first_line(e)}")
            return

        fns = self.mode_calls(impl, fwd, leaves, go)
        with ctx():
            for m in todo:
                if self.left() <= 0:
                    res[m] = dict(status="skipped", note="time budget")
                    continue
                t = time.perf_counter()
                try:
                    w = self.warm(fns[m])
                    r = dict(status="pending", first_call_s=w["first_call_s"], peak_mib=self.peak_mib(fns[m]))
                    if impl in ("sdpa", "fastest"):  # its choice in this mode (forward and fwd+bwd may differ)
                        d = self.ad.last_decision()
                        r["backend"] = getattr(d, "backend", None)
                        if impl == "fastest":  # the backends it could choose in this mode, what it timed
                            timings = getattr(d, "timings", None) or {}
                            r["eligible"] = list(getattr(d, "eligible", ()))
                            r["measured"] = list(timings)
                            r["measured_ms"] = {name: round(ms, 4) for name, ms in timings.items()}
                            # the raw samples: other statistics can be judged from one grid
                            r["measured_samples"] = {
                                n: list(x) for n, x in (getattr(d, "timing_samples", None) or {}).items()
                            }
                            # the host's time per call in those samples (GPU): how near each was to host-bound
                            r["measured_host_ms"] = dict(getattr(d, "host_timings", None) or {})
                            r["failed"] = dict(getattr(d, "failures", None) or {})
                            for name, why in r["failed"].items():
                                log(f"  {'':16s} fastest: {name} failed while timed: {why}")
                    res[m] = r
                    pending.append((impl, m, fns[m], ctx, w))
                except Exception as e:  # noqa: BLE001
                    res[m] = dict(status="error", note=first_line(e))
                    log(f"  {impl:16s} {m:8s} err: {first_line(e)}")
                    if os.environ.get("BENCH_TRACEBACK"):
                        log(traceback.format_exc())
                    with contextlib.suppress(Exception):
                        self.sync()
                if impl == "flex":  # the first call of each mode compiles (forward, then backward)
                    self.flex_compile_s += res[m].get("first_call_s", time.perf_counter() - t)
            warmed = [m for m in todo if res[m].get("status") == "pending"]
            if impl in OURS and warmed:
                try:
                    d = self.ad.last_decision()
                    res["backend"] = getattr(d, "backend", None)
                    if impl != "triton":
                        timings = getattr(d, "timings", None) or {}
                        log(
                            f"  {'':16s} {impl} chose {res['backend']}"
                            + (
                                f" (measured ms: {', '.join(f'{k} {v:.3f}' for k, v in timings.items())})"
                                if timings
                                else ""
                            )
                        )
                except Exception as e:  # noqa: BLE001
                    res["backend"] = f"? ({first_line(e)})"
            if not args.no_check and row.dropout_p == 0 and "fwd" in warmed:
                self.check(impl, fwd, canon, res, ref_holder)

    def compile_row(self, row: Row, impls: list[str]) -> dict:
        """Worker side of --precompile-workers: call each compiling implementation once per
        mode exactly as run_impl will (same inputs, grad modes and contexts), timing nothing;
        errors are reported, not raised (the measuring process meets them again)."""
        t = time.perf_counter()
        errors = []
        inp = self.make_inputs(row)
        for impl in impls:
            if (
                impl not in COMPILING_IMPLS
                or (impl == "fa4" and self.fa4 is None)
                or (impl == "flex" and self.flex_fn is None)
            ):
                continue
            modes = [m for m in MODES if support(impl, row, m, self.args.flex) is None]
            if not modes:
                continue
            try:
                fwd, leaves, go, _canon, ctx = self.prepare(impl, row, inp)
                fns = self.mode_calls(impl, fwd, leaves, go)
                with ctx():
                    for m in modes:
                        fns[m]()
                self.sync()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{impl}: {first_line(e)}")
        del inp
        self.empty_cache()
        return {"row": row.id, "s": round(time.perf_counter() - t, 2), "errors": errors}

    def check(self, impl, fwd, canon, res, ref_holder) -> None:
        """Relative error of this output against the first measured implementation's."""
        try:
            # with grad enabled, as measured: no_grad would recompile Flex and change sdpa()'s Problem
            out = canon(fwd()).detach().float()
            ref = ref_holder.get("ref")
            if ref is None:
                ref_holder["ref"] = (impl, out)
                res["ref"] = impl
                return
            name, r = ref
            err = ((out - r).norm() / r.norm().clamp_min(1e-30)).item()
            res["rel_err"], res["ref"] = err, name
            if not math.isfinite(err) or err > 2e-2:
                res["mismatch"] = True
                self.log(f"  {impl:16s} MISMATCH: relative error {err:.3g} against {name}")
                self.notes.append(f"{impl} output differs from {name} (relative error {err:.3g})")
        except Exception as e:  # noqa: BLE001
            res["check_error"] = first_line(e)


def lower_quartile(times: list[float]) -> float:
    """The first quartile of ``times``: policy="fastest"'s own statistic (one definition)."""
    from attention_dispatch.timing import lower_quartile as statistic

    return statistic(times)


def slow_turns(first: dict[int, tuple[str, float]], factor: float, keep=frozenset()) -> set[int]:
    """The turns whose first-round time (``first``: turn -> (mode, ms)) exceeds ``factor`` times
    the fastest first-round time of the same mode: they cannot be the row's best, so their later
    rounds are skipped (experiment 66).  ``factor`` <= 0 keeps every turn, and so are the turns
    in ``keep``: our own columns, which the targets read (a disturbed first turn had cut
    policy="fastest" to 6 samples in grid efa536c)."""
    if factor <= 0:
        return set()
    best: dict[str, float] = {}
    for mode, ms in first.values():
        best[mode] = min(ms, best.get(mode, ms))
    return {i for i, (mode, ms) in first.items() if ms > factor * best[mode] and i not in keep}


def warm_calls(est_ms: float, warm_ms: float, most: int = 200) -> int:
    """Untimed calls opening a turn: at least one, enough for ``warm_ms`` of device time at
    ``est_ms`` per call, at most ``most`` (host-bound tiny calls)."""
    return max(1, min(most, math.ceil(warm_ms / max(est_ms, 1e-3))))


def pair_fastest(order: list[int], turns: list[tuple[str, str]], chosen: dict[str, str], rnd: int) -> list[int]:
    """``order`` (a round's turn indices) with each policy="fastest" turn moved next to the turn of
    the column running the backend it chose in that mode (``chosen``: mode -> column): right after
    it in even rounds, right before it in odd ones.  ``turns``: (implementation, mode) per index.
    A mode whose choice has no column in the row keeps its place."""
    out = list(order)
    for mode, column in chosen.items():
        if ("fastest", mode) not in turns or (column, mode) not in turns:
            continue
        mine = turns.index(("fastest", mode))
        out.remove(mine)
        at = out.index(turns.index((column, mode)))
        out.insert(at + 1 if rnd % 2 == 0 else at, mine)
    return out


def turn_order(n: int, row_id: str, rnd: int, seed: int) -> list[int]:
    """The order of a row's ``n`` turns in round ``rnd``: the first round as listed, later ones
    shuffled (seeded by the row and round).  A turn's speed depends on the one before it (the
    clock follows the previous implementation, experiment 32); a rotation by one turn per round
    kept almost every predecessor, and the grid's triton column then ran below its sdpa (auto)
    column, the same kernels (experiment 55).  policy="fastest" orders its turns the same way."""
    from attention_dispatch.timing import turn_order as shared  # lazy: --from-json needs no torch

    return shared(n, rnd, f"{seed}-{row_id}")


# meta["sampling"] of runs that time as measure_rounds did (session 7) and does now
SAMPLING_ONE_CALL = "gc-off, untimed call per turn"
SAMPLING = "gc-off, untimed calls of at least turn_warm_ms per turn"
SAMPLING_SHUFFLED = SAMPLING + ", turns shuffled each round"
TIMING_QUEUED = (
    "repetitions are enqueued back to back, each between its own CUDA events, with one "
    "synchronisation at the end (device time in steady state, as triton.testing.do_bench; "
    "the host time of one call is benchmarks/overhead.py's); calls under 0.5 ms are grouped; "
)


class _HostEvent:
    """torch.cuda.Event's timing interface on the host clock (for --smoke-cpu)."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        """Host timestamps are final when taken: nothing to wait for."""

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


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
