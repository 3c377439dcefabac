"""Instruction counts of a kernel's main loops, from its sm90 cubin (or cuobjdump -sass text), by class.

    python benchmarks/sass_loop.py KERNEL.cubin [--min-hgmma 8] [--timeline] [--cuobjdump PATH]

A loop is a backward branch (``BRA`` to a lower address) and the instructions from its target to it;
loops holding at least ``--min-hgmma`` HGMMA instructions are reported (for the d128 forwards: the
consumer's step, 8 HGMMA for S = Q K^T and 8 for O += P V), each with its instructions by class
(:data:`CLASSES`) and, with ``--timeline``, the order of the HGMMA groups, waits and barriers with the
count of other instructions between them.  The mbarrier try-wait retry loops ptxas places after the
kernel's EXIT are not in a loop body and not counted (the first try-wait is).

Experiment 114 (docs/experiments/perf-notes.md) uses it on flash-attn 4's sm90 forward and ours:
``--dump-ours DIR`` (run with the Triton 3.6 venv) compiles our Gluon forward's d128 dense and
KV-cache cases with benchmarks/compile_sm90.py and writes their cubins into DIR; ``--dump-fa4 DIR`` (run
with a CPU venv holding flash-attn 4, :func:`dump_fa4`) does the same for flash-attn 4's sm90 forward.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

# (class, regex on the opcode with its modifiers); the first match wins
CLASSES = (
    ("HGMMA", r"HGMMA"),
    ("WARPGROUP arrive/depbar", r"WARPGROUP|WARPSYNC"),
    ("MUFU", r"MUFU"),
    ("FFMA", r"FFMA"),
    ("FMUL", r"FMUL"),
    ("FADD", r"FADD"),
    ("FMNMX", r"FMNMX"),
    ("FSETP/FSEL/FCHK", r"FSETP|FSEL|FCHK"),
    ("SHFL", r"SHFL"),
    ("BAR (named barriers)", r"BAR\."),
    ("SYNCS (mbarrier)", r"SYNCS"),
    ("F2FP (bf16 pack)", r"F2FP"),
    ("other conversions", r"F2F|F2I|I2F|FRND"),
    ("moves MOV/UMOV/R2UR/PRMT", r"MOV|R2UR|S2UR|R2P|P2R|PRMT|CS2R|S2R"),
    ("integer/uniform ALU", r"^U?(IMAD|IADD|LEA|LOP|SHF|ISETP|SEL|IABS|IMNMX|FLO|POPC|BMSK|SGXT|VOTE|PLOP)"),
    ("branches", r"BRA|BSSY|BSYNC|EXIT|RET|CALL"),
    ("memory LD/ST", r"^(LD|ST|LDS|STS|LDG|STG|LDSM|STSM|UTMA|UBLKCP|RED|ATOM)"),
    ("NOP", r"NOP"),
)
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
EVENTS = r"HGMMA|WARPGROUP|BAR\.|SYNCS|USETMAXREG"


def sass_text(path: str, cuobjdump: str | None) -> str:
    if not path.endswith(".cubin"):
        return Path(path).read_text()
    if cuobjdump is None:
        import triton

        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout


def instructions(sass: str):
    """[(address, predicate, opcode, operands)] in address order."""
    return [
        (int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()) for m in LINE.finditer(sass)
    ]


def loops(ins, min_hgmma: int):
    """(start, end) address ranges of the innermost backward branches' bodies that hold an HGMMA and
    no EXIT (a try-wait retry stub past the EXIT branching back into the code), those with >= min_hgmma
    HGMMA.  Innermost among all loops with an HGMMA: an outer loop around steps of fewer HGMMA than
    min_hgmma (the three-consumer forward's 64-key steps: 8 + 4) is not reported as a step."""
    out = []
    for addr, _, op, args in ins:
        m = re.match(r"0x([0-9a-f]+)", args)
        if op.startswith("BRA") and m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            body = [o for a, _, o, _ in ins if start <= a <= addr]
            n_hgmma = sum(o.startswith("HGMMA") for o in body)
            if n_hgmma and "EXIT" not in body:
                out.append((start, addr, n_hgmma))
    return [
        (s, e)
        for s, e, n in out
        if n >= min_hgmma and not any((s, e) != (s2, e2) and s <= s2 and e2 <= e for s2, e2, _ in out)
    ]


def classify(op: str) -> str:
    return next((name for name, rx in CLASSES if re.search(rx, op)), "other")


def timeline(body) -> str:
    """The HGMMA groups, waits and barriers in order, other instructions as counts between them."""
    parts, between, hg = [], Counter(), []

    def flush():
        if between:
            parts.append("  (" + ", ".join(f"{n} {c}" for c, n in between.most_common()) + ")")
            between.clear()

    for _, pred, op, args in body:
        if op.startswith("HGMMA"):
            flush()
            hg.append(("RS" if re.search(r"R\d+, R\d+, gdesc", args) else "SS") + (" gsb0" if "gsb0" in args else ""))
            continue
        if hg:
            parts.append(f"HGMMA x{len(hg)} {hg[0].split()[0]}{' (last gsb0)' if hg[-1].endswith('gsb0') else ''}")
            hg = []
        if re.match(EVENTS, op):
            flush()
            parts.append(f"{pred + ' ' if pred else ''}{op} {args}".strip())
        else:
            between[classify(op).split()[0]] += 1
    flush()
    return "\n".join(parts)


def wait_positions(body) -> str:
    """Where the P V wait (WARPGROUP.DEPBAR.LE gsb0, 0x0) sits after the S wait (0x1): instructions and
    MUFU ops between them, and the MUFU ops after it (the part of the softmax that P V does not hide)."""
    ops = [(op, args) for _, _, op, args in body]
    try:
        s_wait = next(i for i, (o, a) in enumerate(ops) if o.startswith("WARPGROUP.DEPBAR") and a.endswith("0x1"))
        pv_wait = next(i for i, (o, a) in enumerate(ops) if o.startswith("WARPGROUP.DEPBAR") and a.endswith("0x0"))
    except StopIteration:
        return "P V wait: no DEPBAR.LE 0x1 / 0x0 pair"
    mufu = sum(o.startswith("MUFU") for o, _ in ops)
    before = sum(o.startswith("MUFU") for o, _ in ops[s_wait:pv_wait])
    return (
        f"S wait at {s_wait}, P V wait at {pv_wait}: {pv_wait - s_wait - 1} instructions and {before} of {mufu} MUFU "
        f"between them, {len(ops) - pv_wait - 1} instructions after"
    )


def report(path: str, min_hgmma: int, show_timeline: bool, cuobjdump: str | None) -> None:
    sass = sass_text(path, cuobjdump)
    ins = instructions(sass)
    regs = re.findall(r"USETMAXREG\.\S+ (?:UP0, )?(0x[0-9a-f]+)", sass)
    print(f"== {path}: {len(ins)} instructions; setmaxnreg {[int(r, 16) for r in regs]}")
    for start, end in loops(ins, min_hgmma):
        body = [i for i in ins if start <= i[0] <= end]
        counts = Counter(classify(op) for _, _, op, _ in body)
        print(f"-- loop 0x{start:x}..0x{end:x}: {len(body)} instructions")
        for name, _ in CLASSES + (("other", ""),):
            if counts[name]:
                print(f"   {name:28s} {counts[name]:4d}")
        other = Counter(op for _, _, op, _ in body if classify(op) == "other")
        if other:
            print("   other:", ", ".join(f"{o} {n}" for o, n in other.most_common()))
        print("   " + wait_positions(body))
        if show_timeline:
            print(timeline(body))


def dump_ours(out: str) -> None:
    """Compile our Gluon forward (d128, bf16) dense and KV-cache (chunked prefill) cases; write cubins."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import compile_sm90 as c

    want = {
        "ws d=128 dense rows=(1, 1) lse=False": "ours_dense",
        "ws d=128 causal rows=(1, 1) lse=False kv-cache": "ours_chunk",
    }
    os.makedirs(out, exist_ok=True)
    for d, cfg, label, const in c.ws_cases():
        # a launch of its own config carries it in the label (" consumers=2 block_n=128 stages=3")
        name = want.get(label.split(" consumers=")[0])
        if name is not None:
            err, kernel = c.compile_ws_case(d, cfg, const)
            if err is not None:
                raise RuntimeError(f"{label}: {err}")
            Path(out, name + ".cubin").write_bytes(kernel.asm["cubin"])
            print(f"{label} -> {out}/{name}.cubin")


def dump_fa4(out: str) -> None:
    """Compile flash-attn 4's sm90 forward (bf16 d128) for the dense (B2 S8k H16) and chunked-prefill (B4, 512
    queries over 8704 keys, Hq 32 / Hkv 8, causal: pack_gqa) calls without a GPU: torch fake CUDA tensors
    through flash_attn.cute.interface._flash_attn_fwd, FLASH_ATTENTION_ARCH / CUTE_DSL_ARCH naming sm90,
    CUTE_DSL_KEEP=ptx,cubin into DIR.  Run with a CPU venv holding nvidia-cutlass-dsl 4.8.1, flash-attn-4
    4.0.0b36, a CPU torch (docs/experiments/perf-notes.md, experiment 114)."""
    os.environ.update(
        FLASH_ATTENTION_ARCH="sm_90",
        CUTE_DSL_ARCH="sm_90a",
        FLASH_ATTENTION_NUM_SMS="132",
        CUTE_DSL_KEEP="ptx,cubin",
        CUTE_DSL_DUMP_DIR=os.path.abspath(out),
    )
    os.makedirs(out, exist_ok=True)
    import torch
    from flash_attn.cute.interface import _flash_attn_fwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = {"fa4_dense": ((2, 8192, 16), (2, 8192, 16), False), "fa4_chunk": ((4, 512, 32), (4, 8704, 8), True)}
    for name, (q_shape, kv_shape, causal) in cases.items():
        before = set(Path(out).glob("*.cubin"))
        with FakeTensorMode():
            q = torch.empty(*q_shape, 128, dtype=torch.bfloat16, device="cuda")
            k = torch.empty(*kv_shape, 128, dtype=torch.bfloat16, device="cuda")
            _flash_attn_fwd(q, k, torch.empty_like(k), causal=causal)
        (new,) = set(Path(out).glob("*.cubin")) - before
        new.rename(Path(out, name + ".cubin"))
        print(f"{name} -> {out}/{name}.cubin")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernels", nargs="*", help="cubin files (or cuobjdump -sass text)")
    p.add_argument("--min-hgmma", type=int, default=8)
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--cuobjdump", default=None, help="default: the one Triton bundles")
    p.add_argument("--dump-ours", default="", metavar="DIR", help="compile our d128 forwards' cubins into DIR")
    p.add_argument("--dump-fa4", default="", metavar="DIR", help="compile flash-attn 4's sm90 forwards into DIR")
    args = p.parse_args(argv)
    if args.dump_fa4:
        dump_fa4(args.dump_fa4)
    if args.dump_ours:
        dump_ours(args.dump_ours)
    for k in args.kernels:
        report(k, args.min_hgmma, args.timeline, args.cuobjdump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
