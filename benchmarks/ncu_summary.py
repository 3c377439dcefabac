"""The ncu probe's files (perf-notes E113) as a short table: per case its kernels' time, pipes, issue,
occupancy and top stall reasons, the SASS instructions with the most stall samples, the consumers' main
loop alone (its stall reasons and opcodes, from the source view's execution counts), and the pairs that
issues 34 and 36 compare, their loops' stall samples a step side by side.  CPU only.

    python benchmarks/ncu_summary.py DIR/ncu_CASE.csv [DIR/ncu_CASE.source.csv DIR/ncu_CASE.log ...]

Per case CASE: ncu_CASE.csv (`ncu -i REP --page raw --csv --print-units base`), ncu_CASE.source.csv
(`ncu -i REP --page source --csv --print-source sass`) and ncu_CASE.log (the profiling run's output:
why a case has no data).  Any of a case's files names the case; the others are found beside it.  The
short table comes last.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.ncu_metrics import (  # noqa: E402
    BALANCE,
    COLUMNS,
    COUNTS,
    LAUNCH,
    PCSAMP_PREFIX,
    PCSAMP_TOTAL,
    RATIO_RE,
)
from benchmarks.ncu_target import CASES  # noqa: E402

# (label, case, against): the comparisons the issues ask for, where both cases ran
PAIRS = (
    ("softcap / plain", "softcap", "plain"),
    ("softcap / plain causal", "softcap-causal", "plain-causal"),
    ("ours / fa4 chunk", "kv-chunk", "fa4-chunk"),
    ("fa4 softcap / plain", "fa4-softcap", "fa4"),
    ("softcap / plain training", "softcap-train", "plain-train"),
)
PATCHED = "@patch"  # a case name's suffix for its profile in the patched tree
TOP_INSTRUCTIONS = 15
# unit -> factor to nanoseconds, for a duration ncu printed in other units than base
TIME_UNITS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}


@dataclass
class Kernel:
    name: str
    metrics: dict[str, float | str]
    units: dict[str, str] = field(default_factory=dict)

    def get(self, *names: str) -> float | None:
        """The first of ``names`` this kernel has as a number."""
        for n in names:
            v = self.metrics.get(n)
            if isinstance(v, float):
                return v
        return None

    def duration_ms(self) -> float | None:
        ns = self.get(*COLUMNS["ms"])
        if ns is None:
            return None
        return ns * TIME_UNITS.get(self.units.get(COLUMNS["ms"][0], "nsecond"), 1.0) / 1e6

    def column(self, label: str) -> float | None:
        return self.duration_ms() if label == "ms" else self.get(*COLUMNS[label])

    def stalls(self) -> tuple[str, list[tuple[str, float]]]:
        """(the basis, [(reason, share)] largest first): PC-sampling shares in %, else warp cycles per
        issued instruction from the ratio metrics."""
        samples = {
            n[len(PCSAMP_PREFIX) :]: v
            for n, v in self.metrics.items()
            if n.startswith(PCSAMP_PREFIX) and not n.endswith("_not_issued") and isinstance(v, float)
        }
        total = self.get(PCSAMP_TOTAL) or sum(samples.values())
        if samples and total:
            return "% of samples", sorted(((r, 100 * v / total) for r, v in samples.items()), key=lambda x: -x[1])
        ratios = {}
        for n, v in self.metrics.items():
            m = RATIO_RE.match(n)
            if m and isinstance(v, float):
                ratios[m.group(1)] = v
        return "cycles per issue", sorted(ratios.items(), key=lambda x: -x[1])


def short_name(name: str, width: int = 40) -> str:
    """A kernel's name without its argument list or template arguments, cut to ``width``."""
    name = re.sub(r"^void\s+", "", re.sub(r"\(.*$", "", name.strip()))
    while "<" in name:  # innermost template arguments first
        stripped = re.sub(r"<[^<>]*>", "", name)
        if stripped == name:
            break
        name = stripped
    name = name.split("::")[-1] or name
    return name if len(name) <= width else name[: width - 2] + ".."


def number(text: str) -> float | str:
    """A CSV cell as a float where it is one ("1,234.5" too), else the text."""
    t = text.strip().replace(",", "")
    try:
        return float(t)
    except ValueError:
        return text.strip()


def csv_rows(text: str) -> list[list[str]]:
    """CSV rows of ncu output, without its ==PROF==/==WARNING== lines."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("==")]
    return list(csv.reader(io.StringIO("\n".join(lines))))


def parse_raw(text: str) -> list[Kernel]:
    """Kernels of a `--page raw --csv` export: a header row of metric names, a units row, a row a kernel."""
    rows = csv_rows(text)
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        return []
    header = rows[start]
    name_at = header.index("Kernel Name")
    units: dict[str, str] = {}
    kernels = []
    for row in rows[start + 1 :]:
        if len(row) != len(header):
            continue
        if not row[name_at]:  # the units row: no kernel in it
            units = {h: u for h, u in zip(header, row) if u}
            continue
        metrics = {h: number(v) for h, v in zip(header, row)}
        kernels.append(Kernel(row[name_at], metrics, units))
    return kernels


@dataclass
class Instruction:
    address: str
    sass: str
    samples: float
    reasons: dict[str, float]
    executed: float = 0.0  # warp-level executions ("Instructions Executed")

    @property
    def opcode(self) -> str:
        words = [w for w in self.sass.split() if not w.startswith("@")]  # drop a predicate guard
        return words[0].rstrip(";") if words else "?"


def not_issued(column: str) -> bool:
    """A not-issued twin of a stall column ("stall_math (Not Issued)"): a subset, not a reason of its own."""
    return "not issued" in column.lower().replace("_", " ").replace("-", " ")


def parse_source(text: str) -> list[tuple[str, list[Instruction]]]:
    """[(kernel name or '', instructions)] of a `--page source --csv --print-source sass` export: a header
    row (Address, Source, Warp Stall Sampling ...) starts each kernel's block; a row naming a kernel or
    function before it names the block."""
    blocks: list[tuple[str, list[Instruction]]] = []
    header: list[str] | None = None
    name = ""
    for row in csv_rows(text):
        if "Source" in row and any(c.startswith("Warp Stall Sampling (All") for c in row):
            header = row
            blocks.append((name, []))
            name = ""
            continue
        if header is None or len(row) != len(header):
            if row and row[0].strip().endswith("Name") and len(row) > 1:
                name = row[-1]
            continue
        cells = dict(zip(header, row))
        samples = number(next(v for c, v in cells.items() if c.startswith("Warp Stall Sampling (All")))
        if not isinstance(samples, float):
            continue
        reasons = {
            c[len("stall_") :]: v
            for c, v in ((c, number(v)) for c, v in cells.items() if c.startswith("stall_") and not not_issued(c))
            if isinstance(v, float) and v > 0
        }
        executed = number(cells.get("Instructions Executed", "0"))
        blocks[-1][1].append(
            Instruction(
                cells.get("Address", "?"),
                cells.get("Source", "").strip(),
                samples,
                reasons,
                executed if isinstance(executed, float) else 0.0,
            )
        )
    return blocks


@dataclass
class Case:
    name: str
    kernels: list[Kernel]
    source: list[tuple[str, list[Instruction]]]
    why_empty: str

    def main_kernel(self) -> Kernel | None:
        """The kernel the case is about: the longest of its call's kernels."""
        return max(self.kernels, key=lambda k: k.duration_ms() or 0.0, default=None)


def log_reason(log: str) -> str:
    """Why a profiling run left no data, from its output: the target's own last error (a Python exception,
    a case it refused), ncu's last error or warning, the exit status; else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]

    def last(pattern: str) -> str:
        return next((ln for ln in reversed(lines) if re.search(pattern, ln)), "")

    own = last(r"^(?!==).*(Error\b|Exception\b|not importable|skipped)")
    tool = last(r"^==(ERROR|WARNING)==")
    status = last(r"^ncu rc \d+$")
    parts = [p for p in (own, tool, status) if p]
    pick = " | ".join(parts) if parts else (lines[-1] if lines else "no output (did ncu run?)")
    return pick[:300]


def case_files(paths: list[Path]) -> dict[str, dict[str, Path]]:
    """case -> {"raw", "source", "log": path} from any of each case's files."""
    cases: dict[str, dict[str, Path]] = {}
    for p in paths:
        m = re.match(r"^ncu_(.+?)(\.source\.csv|\.csv|\.log)$", p.name)
        if not m:
            continue
        case = m.group(1)
        cases.setdefault(case, {})
        for kind, suffix in (("raw", ".csv"), ("source", ".source.csv"), ("log", ".log")):
            cases[case][kind] = p.with_name(f"ncu_{case}{suffix}")
    return cases


def read(path: Path | None) -> str:
    return path.read_text(errors="replace") if path and path.exists() else ""


def load_case(name: str, files: dict[str, Path]) -> Case:
    kernels = parse_raw(read(files.get("raw")))
    source = parse_source(read(files.get("source")))
    why = "" if kernels else log_reason(read(files.get("log")))
    return Case(name, kernels, source, why)


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def stall_text(k: Kernel, top: int = 4) -> str:
    basis, pairs = k.stalls()
    if not pairs:
        return "no stall data"
    digits = 0 if basis.startswith("%") else 2
    return ", ".join(f"{r} {v:.{digits}f}" for r, v in pairs[:top]) + f" ({basis})"


def hex_address(i: Instruction) -> int | None:
    try:
        return int(i.address, 16)
    except ValueError:
        return None


def instruction_lines(instructions: list[Instruction]) -> list[str]:
    total = sum(i.samples for i in instructions)
    if not total:
        return ["    source view: no stall samples"]
    base = min((a for a in map(hex_address, instructions) if a is not None), default=None)
    out = [f"    top {TOP_INSTRUCTIONS} SASS instructions by stall samples (of {total:.0f}; offset in the kernel):"]
    for i in sorted(instructions, key=lambda i: -i.samples)[:TOP_INSTRUCTIONS]:
        a = hex_address(i)
        where = f"{a - base:05x}" if a is not None and base is not None else i.address[-8:]
        why = ", ".join(
            f"{r} {100 * v / i.samples:.0f}%" for r, v in sorted(i.reasons.items(), key=lambda x: -x[1])[:2]
        )
        out.append(f"      {where:>8} {i.opcode:18s} {100 * i.samples / total:5.1f}%  {why:34s} {i.sass[:60]}")
    by_op = Counter()
    for i in instructions:
        by_op[i.opcode.split(".")[0]] += i.samples
    out.append("    by opcode: " + ", ".join(f"{op} {100 * s / total:.1f}%" for op, s in by_op.most_common(8)))
    return out


LOOP_MIN = 100  # instructions: a run executed this often with fewer is a retry loop or a branch, not a step


def main_loop(instructions: list[Instruction]) -> list[Instruction]:
    """The consumers' main loop: every instruction executed as often as the most executed run (a
    contiguous stretch with one execution count) of at least LOOP_MIN instructions.  Each consumer
    warpgroup's copy of the loop counts (ours compiles one a warpgroup, flash-attn 4 one for both), and
    so do short stretches of the same count between (a loop body split by a branch)."""
    runs: list[list[Instruction]] = []
    for i in instructions:
        if runs and runs[-1][-1].executed == i.executed:
            runs[-1].append(i)
        else:
            runs.append([i])
    top = max((r[0].executed for r in runs if len(r) >= LOOP_MIN and r[0].executed > 0), default=0.0)
    return [i for i in instructions if top and i.executed == top]


def loop_steps(loop: list[Instruction]) -> float:
    """Warp-steps of a main loop: its executions summed over its code copies (one count a copy)."""
    if not loop:
        return 0.0
    copies = max(1, sum(1 for a, b in zip(loop, loop[1:]) if (hex_address(b) or 0) - (hex_address(a) or 0) > 0x100) + 1)
    return loop[0].executed * copies


def loop_reasons(loop: list[Instruction]) -> Counter:
    total: Counter = Counter()
    for i in loop:
        total.update(i.reasons)
    return total


def loop_lines(instructions: list[Instruction]) -> list[str]:
    loop = main_loop(instructions)
    if not loop:
        return ["    main loop: none found (no execution counts in the source view)"]
    samples = sum(i.samples for i in loop)
    kernel = sum(i.samples for i in instructions) or 1.0
    reasons = loop_reasons(loop)
    selected = reasons.get("selected", 0.0)
    per_issue = f", samples per issued instruction {samples / selected:.2f}" if selected else ""
    out = [
        f"    main loop: {len(loop)} instructions (all copies), {loop_steps(loop):.0f} warp-steps, "
        f"{100 * samples / kernel:.1f}% of the samples{per_issue}",
        "      stalls: " + ", ".join(f"{r} {100 * v / samples:.1f}%" for r, v in reasons.most_common(8) if samples),
    ]
    count: Counter = Counter()
    share: Counter = Counter()
    why: dict[str, Counter] = {}
    for i in loop:
        op = i.opcode.split(".")[0]
        count[op] += 1
        share[op] += i.samples
        why.setdefault(op, Counter()).update(i.reasons)
    for op, s in share.most_common(8):
        top = ", ".join(f"{r} {v:.0f}" for r, v in why[op].most_common(3))
        out.append(f"      {op:12s} x{count[op]:<4d} {100 * s / samples:5.1f}% of the loop's samples  ({top})")
    return out


def loop_pair_line(label: str, a: list[Instruction], b: list[Instruction]) -> str | None:
    """Two cases' main loops: stall samples a warp-step and the reasons that grew most (a - b).  Per-warp
    sampling rates differ where the resident warps differ (flash-attn 4 exits three loader warps): compare
    shares within a kernel first."""
    la, lb = main_loop(a), main_loop(b)
    sa, sb = loop_steps(la), loop_steps(lb)
    if not (sa and sb):
        return None
    ra, rb = loop_reasons(la), loop_reasons(lb)
    per_a, per_b = sum(ra.values()) / sa * 1000, sum(rb.values()) / sb * 1000
    diff = sorted(((r, ra[r] / sa * 1000 - rb[r] / sb * 1000) for r in set(ra) | set(rb)), key=lambda x: -abs(x[1]))
    moved = ", ".join(f"{r} {d:+.1f}" for r, d in diff[:5])
    return f"{label} loop: stall samples per 1000 warp-steps {per_a:.1f} vs {per_b:.1f} (x{per_a / per_b:.3f}); by reason {moved}"


def case_lines(case: Case) -> list[str]:
    out = [f"== {case.name}"]
    if not case.kernels:
        return out + [f"  no ncu data: {case.why_empty}"]
    for n, k in enumerate(case.kernels):
        launch = " ".join(f"{lab} {fmt(k.get(m), 0)}" for lab, m in LAUNCH.items())
        out.append(f"  kernel {short_name(k.name)}  ({launch})")
        out.append("    " + "  ".join(f"{lab} {fmt(k.column(lab), 3 if lab == 'ms' else 1)}" for lab in COLUMNS))
        counts = {lab: k.get(*ms) for lab, ms in COUNTS.items()}
        busy, most = (k.get(m) for m in BALANCE)
        balance = f"  SM busy avg/max {busy / most:.3f}" if busy and most else ""
        out.append(
            "    warp inst (M): " + "  ".join(f"{lab} {fmt(v and v / 1e6, 2)}" for lab, v in counts.items()) + balance
        )
        out.append(f"    stalls: {stall_text(k, 6)}")
        block = source_for(case, n, k)
        out += instruction_lines(block) + loop_lines(block) if block is not None else ["    source view: none"]
    return out


def source_for(case: Case, index: int, kernel: Kernel) -> list[Instruction] | None:
    """The source block of a case's kernel: by name where the export names blocks, else by order."""
    for name, block in case.source:
        if name and (name == kernel.name or short_name(name) == short_name(kernel.name)):
            return block
    if len(case.source) == len(case.kernels):
        return case.source[index][1]
    return None


def short_table(cases: list[Case]) -> list[str]:
    labels = list(COLUMNS)
    head = f"{'case':15s} {'kernel':28s} " + " ".join(f"{lab:>7s}" for lab in labels) + "  top stalls"
    out = [head]
    for c in cases:
        k = c.main_kernel()
        if k is None:
            out.append(f"{c.name:15s} no data: {c.why_empty[:100]}")
            continue
        cells = " ".join(f"{fmt(k.column(lab), 3 if lab == 'ms' else 1):>7s}" for lab in labels)
        out.append(f"{c.name:15s} {short_name(k.name, 28):28s} {cells}  {stall_text(k, 3)}")
    by_name = {c.name: c.main_kernel() for c in cases}
    by_case = {c.name: c for c in cases}
    # a case profiled in a patched tree too ("softcap@patch", gpu_session.sh ncu with PATCH=) against its base
    patched = [(f"{c.name} / {c.name[: -len(PATCHED)]}", c.name, c.name[: -len(PATCHED)]) for c in cases]
    patched = [t for t in patched if t[1].endswith(PATCHED) and t[2] in by_case]
    for label, a, b in PAIRS + tuple(patched):
        ka, kb = by_name.get(a), by_name.get(b)
        if ka is None or kb is None:
            continue
        parts = []
        ma, mb = ka.duration_ms(), kb.duration_ms()
        if ma and mb:
            parts.append(f"time x{ma / mb:.3f}")
        for lab in ("tensor%", "xu%", "fma%", "issue%"):
            va, vb = ka.column(lab), kb.column(lab)
            if va is not None and vb is not None:
                parts.append(f"{lab} {va:.1f} vs {vb:.1f}")
        xa, xb = ka.get(*COUNTS["xu"]), kb.get(*COUNTS["xu"])
        if xa and xb:
            parts.append(f"xu inst x{xa / xb:.2f}")
        out.append(f"{label}: " + ", ".join(parts))
        ca, cb = by_case[a], by_case[b]
        sa, sb = source_for(ca, ca.kernels.index(ka), ka), source_for(cb, cb.kernels.index(kb), kb)
        line = loop_pair_line(label, sa, sb) if sa is not None and sb is not None else None
        if line:
            out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    found = case_files(args.files)
    if not found:
        print("no ncu_<case> files among the arguments: the probe made none (see its log)")
        return 1

    def rank(c: str) -> tuple:
        base = c.removesuffix(PATCHED)
        return (CASES.index(base) if base in CASES else len(CASES), c)

    order = sorted(found, key=rank)
    cases = [load_case(name, found[name]) for name in order]
    for c in cases:
        print("\n".join(case_lines(c)))
    print()
    print("\n".join(short_table(cases)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
