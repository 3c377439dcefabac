"""``--compile-only`` of benchmarks/probe_d512_gluon.py: compile the probe for sm90 without a GPU
(benchmarks/compile_sm90.py's way) and report ptxas's registers and spills, and per partition (from
the SASS) its register cap, the registers it touches, its local-memory instructions, wgmma shapes
and TMA instructions.  Takes the kernel and its arguments from the caller: it imports no kernel.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile

import triton

# wgmma shape -> the partition that issues it
ROLES = {"64x32x16": "S warpgroup", "64x128x16": "P V warpgroup", "64x256x16": "P V warpgroup"}


def compile_sm90(fn, tiles, scalars: dict, consts: dict, options: dict):
    """(error or None, compiled kernel): ``tiles`` (descriptor name, rows, columns, shared layout),
    ``scalars`` the other runtime arguments' types, ``consts`` the constexprs."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.compile_sm90 import _compile

    names = fn.arg_names
    sig = {n: f"tensordesc<bf16[{r}, {c}],{layout!r}>" for n, r, c, layout in tiles}
    sig.update(scalars)
    sig.update({n: "constexpr" for n in consts})
    src = GluonASTSource(
        fn,
        {n: sig[n] for n in names},
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs={(names.index("lse_ptr"),): [["tt.divisibility", 16]]},
    )
    # Triton prints the whole PTX on a ptxas failure: keep ptxas's own message only
    with contextlib.redirect_stdout(io.StringIO()) as out:
        err, kernel = _compile(src, options)
    fatal = re.search(r"ptxas fatal\s*:\s*(\(C\d+\)[^\n]*)", out.getvalue())
    return (f"{err}: {fatal.group(1)}" if err and fatal else err), kernel


def partitions(cubin: bytes, launch_cap: int, loader_regs: int) -> list[dict]:
    """Per partition, from the SASS: its register cap (USETMAXREG), the highest register it
    touches, local-memory (spill) instructions, wgmma shapes and TMA instructions.  A partition's
    code runs from its USETMAXREG to the next; regions with neither a wgmma nor a TMA copy (the
    prologue, the idle workers' loop, padding warps) are left out.  A kernel without USETMAXREG
    (not warp-specialised) is one partition under the launch cap."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    fresh = lambda cap: dict(cap=cap, regs=0, stl=0, ldl=0, wgmma=set(), tma=0)  # noqa: E731
    whole, parts, cur = fresh(launch_cap), [], None
    for text in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass):
        m = re.search(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+)", text)
        if m:
            cur = fresh(int(m.group(1), 16))
            parts.append(cur)
            continue
        for p in (whole,) if cur is None else (whole, cur):
            p["regs"] = max([p["regs"]] + [int(r) + 1 for r in re.findall(r"\bR(\d+)\b", text)])
            p["stl"] += bool(re.search(r"\bSTL\b", text))
            p["ldl"] += bool(re.search(r"\bLDL\b", text))
            p["wgmma"].update(re.findall(r"HGMMA\.(\d+x\d+x\d+)", text))
            p["tma"] += "UTMA" in text
    out = []
    for p in parts or [whole]:
        if p["wgmma"]:
            p["role"] = "/".join(sorted(ROLES.get(w, w) for w in p["wgmma"]))
        elif p["tma"] and p["cap"] == loader_regs:
            p["role"] = "loader"
        else:
            continue
        out.append(p)
    return out


def report(head: str, err, kernel, loader_regs: int, smem_limit: int, shared_table: dict) -> int:
    """Print the compile report of one probe configuration; 1 when it did not compile."""
    from benchmarks.compile_sm90 import ptxas_usage

    if err:
        print(f"{head}: FAILED {err}")
        return 1
    ptx = kernel.asm["ptx"]
    caps = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    launch = re.search(r"\.maxnreg\s+(\d+)", ptx)
    launch_cap = int(launch.group(1)) if launch else 0
    print(f"{head}: compiled for sm90 (triton {triton.__version__})")
    print(
        f"  launch: {kernel.metadata.num_warps} warps, {launch_cap or '?'} registers a thread; "
        f"ptxas -v: {ptxas_usage(ptx)}"
    )
    print(f"  setmaxnreg values in the PTX: {' '.join(v for _, v in caps) or '-'}")
    for p in partitions(kernel.asm["cubin"], launch_cap, loader_regs):
        print(
            f"  {p['role']:<14} cap {p['cap']:>3} registers, touches {p['regs']:>3}; "
            f"spill instructions {p['stl']} STL / {p['ldl']} LDL; wgmma {','.join(sorted(p['wgmma'])) or '-'}; "
            f"TMA instructions {p['tma']}"
        )
    over = " - OVER the limit" if kernel.metadata.shared > smem_limit else ""
    print(f"  shared memory: {kernel.metadata.shared} B of {smem_limit} a block may take{over}")
    for name, b in shared_table.items():
        if b:
            print(f"    {b:>7} B  {name}")
    return 0
