"""The tl backward kernels' code at given tiles, compiled for sm90 without a GPU (issue 36, experiment 105).

    /tmp/t36/bin/python benchmarks/bwd_tile_isa.py [--head-dim 512] [--kinds bwd_dkdv,bwd_dq,bwd_dv,bwd_dk]
        [--configs 'kind:BM,BN,warps,stages;...'] [--features causal,dense] [--const NAME=VALUE,...]

For each (kernel, tiles, feature) bf16 case: registers and spill bytes (ptxas -v), shared memory,
whether Triton emitted wgmma (HGMMA) or mma.sync (HMMA), and the SASS opcodes of the hottest loop
(the backward branch whose body holds the most tensor-core instructions), per loop step.
Then a per-step model (step_model, experiment 105): tensor-core, shared-memory and L2 clocks, spills
charged twice, as a percentage of the tensor-core peak; it ranks tiles, it does not time them.
Without --configs: the configs.py sm90 entries of that head dim and a few neighbours.
bwd_dv / bwd_dk: the dK/dV kernel computing dV alone / dK alone (E108); "clk/pair" (a step's clocks
per query-key pair) adds up across them to compare the two passes with one bwd_dkdv.  --const: kernel
constexprs over the defaults (e.g. DP_IN_BRANCH=0, the layout before E108).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402

import compile_sm90 as cs  # noqa: E402
from attention_dispatch.kernels import configs as C  # noqa: E402

# opcode groups counted in the hot loop
GROUPS = {
    "mma": ("HGMMA", "HMMA"),
    "ldsm": ("LDSM",),
    "lds": ("LDS",),
    "sts": ("STS",),
    "ldg": ("LDG", "LDGSTS", "UTMALDG", "UBLKCP"),
    "stg/red": ("STG", "RED", "ATOM"),
    "bar": ("BAR", "SYNCS", "WARPGROUP", "DEPBAR", "WARPSYNC"),
    "cvt": ("F2FP", "F2F", "I2F", "F2I"),
    "mufu": ("MUFU",),
    "fp32": ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL"),
    "shfl/prmt": ("SHFL", "PRMT", "MOV"),
    "spill": ("STL", "LDL"),
}
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*([^;]*);")

NEIGHBOURS = {
    C.BWD_DKDV: [(32, 32, 8, 2), (32, 32, 8, 1), (32, 32, 4, 2), (32, 64, 8, 1), (64, 32, 8, 1), (16, 64, 8, 2)],
    C.BWD_DQ: [(64, 32, 8, 1), (64, 32, 4, 1), (64, 64, 8, 1), (128, 32, 8, 1), (32, 32, 8, 2), (64, 16, 8, 2)],
    C.BWD_DV: [(32, 64, 8, 2), (32, 64, 8, 1), (64, 64, 8, 1), (16, 64, 8, 2)],
    C.BWD_DK: [(32, 64, 8, 1), (16, 64, 8, 2), (16, 64, 8, 1), (32, 32, 8, 1)],
}
# product units (BM x BN x D multiply-adds) a step needs: dK/dV S, dP, dV, dK; dQ S, dP, dQ; dV alone
# S, dV; dK alone S, dP, dK
UNITS = {C.BWD_DKDV: 4, C.BWD_DQ: 3, C.BWD_DV: 2, C.BWD_DK: 3}


def sass_of(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


def hot_loop(sass: str):
    """(opcode Counter of the whole kernel, of the hot loop's body, tensor-core shapes in the loop,
    the loop's instructions as (address, opcode, modifiers, operands))."""
    insns = [(int(a, 16), op, mod, args) for a, op, mod, args in INSN.findall(sass)]
    whole = collections.Counter(op for _, op, _, _ in insns)
    best, best_mma = [], -1
    for addr, op, _, args in insns:
        m = re.search(r"0x([0-9a-f]+)", args)
        if op == "BRA" and m and int(m.group(1), 16) < addr:
            body = [i for i in insns if int(m.group(1), 16) <= i[0] <= addr]
            mma = sum(1 for i in body if i[1] in ("HGMMA", "HMMA"))
            # the innermost loop with the most tensor-core work (outer loops hold their inner loops)
            if mma > best_mma or (mma == best_mma and len(body) < len(best)):
                best, best_mma = body, mma
    shapes = collections.Counter(op + mod for _, op, mod, _ in best if op in ("HGMMA", "HMMA"))
    return whole, collections.Counter(op for _, op, _, _ in best), shapes, best


# bytes one warp moves per shared-memory / local-memory instruction, by width suffix
WIDTH = {".128": 512, ".64": 256, ".U16": 64, ".U8": 32, ".S16": 64}
SMEM_BW = 128  # shared-memory (and L1) bytes per clock per SM
MMA_MACS = 2048  # dense bf16 multiply-adds per clock per SM, wgmma (989 TFLOP/s at 1.83 GHz over 132 SMs)
HMMA_RATE = 0.67  # mma.sync's share of that peak on the H100 (assumed)
SMEM_MAX = 232448  # sm90's shared memory per block: a larger config never launches
L2_BW = 32  # L2 bytes per clock per SM (~7.4 TB/s over 132 SMs at 1.755 GHz; assumed)


def step_model(loop_insns, warps: int):
    """(tensor-core clocks, shared+local bytes, spill bytes) of one loop step for the whole CTA."""
    mma_clk = smem = spill = 0.0
    for _, op, mod, args in loop_insns:
        if op == "HGMMA":
            n = int(re.match(r"\.64x(\d+)x16", mod).group(1))
            mma_clk += 64 * n * 16 / MMA_MACS * warps / 4
            a_smem = re.match(r"R\w+, gdesc", args) is not None
            smem += (2048 * a_smem + 32 * n) * warps / 4
        elif op == "HMMA":
            mma_clk += 16 * 8 * 16 / (MMA_MACS * HMMA_RATE) * warps
        elif op in ("LDSM", "STSM"):
            smem += {"4": 512, "2": 256, "1": 128}[mod[-1]] * warps
        elif op in ("LDS", "STS", "LDL", "STL"):
            b = next((v for k, v in WIDTH.items() if k in mod), 128) * warps
            smem += b
            spill += b if op in ("LDL", "STL") else 0
    return mma_clk, smem, spill


def usage(ptx: str):
    text = cs.ptxas_usage(ptx)
    return [int(x) if x.isdigit() else -1 for x in re.findall(r"(\d+|\?) (?:registers|bytes)", text)]


def report(kind, cfg, feature, d, extra=None):
    entry = C.ConfigEntry(kind, (9, 0), (9, 9), d, (), C.KernelConfig(*cfg))
    causal = feature == "causal"
    const = dict(cs._feature_constexprs(d, entry.config, causal, 0, False, False), KV_HOST=0)
    const.update(SOFTCAP=0, HAS_ALIBI=False, HAS_SINKS=False, **cs.SPLIT_CONSTEXPRS.get(kind, {}), **(extra or {}))
    err, kernel = cs.compile_case(kind, entry, const)
    name = f"{kind} {'x'.join(map(str, cfg))} {feature}"
    if err:
        print(f"{name}: FAILED {err}", flush=True)
        return
    regs, st, ld = usage(kernel.asm["ptx"])
    whole, loop, shapes, loop_insns = hot_loop(sass_of(kernel))
    ptx = kernel.asm["ptx"]
    mma_clk, smem, spill = step_model(loop_insns, cfg[2])
    bm, bn = cfg[0], cfg[1]
    useful = UNITS[kind] * bm * bn * d  # multiply-adds one step needs
    # the tiles a step streams in: Q and dO (dK/dV, dV, dK) or K and V (dQ), bf16
    gmem = 2 * (bn if kind == C.BWD_DQ else bm) * d * 2
    # a step costs its tensor-core, shared-memory or L2 time, whichever is longest, plus twice the
    # spill traffic (local memory goes through L1 and adds latency): clocks per useful multiply-add
    clk = max(mma_clk, smem / SMEM_BW, gmem / L2_BW) + 2 * spill / SMEM_BW
    groups = " ".join(f"{g}={sum(loop[o] for o in ops)}" for g, ops in GROUPS.items())
    print(
        f"{name}: regs={regs} spill st/ld B={st}/{ld} STL/LDL={whole['STL']}/{whole['LDL']} "
        f"smem={kernel.metadata.shared}{' (over 227 KiB)' if kernel.metadata.shared > SMEM_MAX else ''} wgmma(ptx)={ptx.count('wgmma.mma_async')} "
        f"mma.sync(ptx)={ptx.count('mma.sync')} | loop: {sum(loop.values())} insns/warp "
        f"{groups} | {dict(shapes)} | model/step: mma {mma_clk:.0f} clk, smem {smem / 1024:.0f} KiB "
        f"({smem / SMEM_BW:.0f} clk), L2 {gmem / L2_BW:.0f} clk, spill {spill / 1024:.1f} KiB, useful {useful / MMA_MACS:.0f} clk: "
        f"{100 * useful / MMA_MACS / clk:.0f}% of peak, {clk / (bm * bn):.2f} clk/pair",
        flush=True,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--kinds", default="bwd_dkdv,bwd_dq,bwd_dv,bwd_dk")
    p.add_argument("--configs", default="", help="'kind:BM,BN,warps,stages;...' instead of the defaults")
    p.add_argument("--features", default="dense,causal")
    p.add_argument("--const", default="", help="'NAME=VALUE,...': kernel constexprs (integers) over the defaults")
    args = p.parse_args(argv)
    extra = {k: int(v) for k, v in (c.split("=") for c in args.const.split(",") if c.strip())}
    if args.configs:
        cases = [
            (k, tuple(int(x) for x in c.split(",")))
            for k, c in (s.strip().split(":") for s in args.configs.split(";") if s.strip())
        ]
    else:
        cases = []
        for kind in args.kinds.split(","):
            table = [
                tuple(e.config[:4])
                for e in C.CONFIG_TABLE
                if e.kind == kind and e.min_cc == (9, 0) and e.max_block_d == args.head_dim
            ]
            cases += [(kind, c) for c in dict.fromkeys(table + NEIGHBOURS.get(kind, []))]
    for kind, cfg in cases:
        for feature in args.features.split(","):
            report(kind, cfg, feature, args.head_dim, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
