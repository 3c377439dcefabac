"""The GPU's multi-function unit (MUFU) rates that softcap's forward leans on (issue 36, perf-notes E110):
tanh.approx.f32 (softcap's tanh), ex2.approx.ftz.f32 (the softmax's exponential) and the two in a row
(a softcap score), each beside one FFMA that keeps the chain bounded, and the FFMA alone.

    python benchmarks/mufu_rate.py [--iters 512] [--waves 8]

Each thread runs independent chains of the op (16 elements a thread, 8 programs of 4 warps an SM), so the
pipe, not latency, sets the time.  Prints each op's ms, ns per warp instruction per SM (16 MUFU results a
clock an SM: 2 clocks, ~1.0-1.2 ns at 1.7-2.0 GHz) and its time over the ex2 row: tanh at ~1.0 shares ex2's
rate; ~2.0 would make tanh half rate (then a tanh moved to the FMA pipe frees twice the MUFU time an ex2
does, E106).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

# (name, PTX of one step on float32 $1 -> $0): each keeps |x| < 2, so no input hits a special case
OPS = {
    "fma": "fma.rn.ftz.f32 $0, $1, 0f3F000000, 0f3E800000;",
    "tanh": "{ .reg .f32 t; tanh.approx.f32 t, $1; fma.rn.ftz.f32 $0, t, 0f3F000000, 0f3E800000; }",
    "ex2": "{ .reg .f32 t; ex2.approx.ftz.f32 t, $1; fma.rn.ftz.f32 $0, t, 0fBF000000, 0f3F800000; }",
    "tanh+ex2": "{ .reg .f32 t; tanh.approx.f32 t, $1; ex2.approx.ftz.f32 t, t; "
    "fma.rn.ftz.f32 $0, t, 0fBF000000, 0f3F800000; }",
}
BLOCK, WARPS = 2048, 4  # 16 chains a thread


@triton.jit
def _chains(out_ptr, ITERS: tl.constexpr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = (offs % 1024).to(tl.float32) * (1.0 / 1024.0)
    for _ in range(ITERS):
        x = tl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(out_ptr + offs, x)


def rates(iters: int, waves: int) -> dict[str, float]:
    """Median ms of one launch per op: waves * 132-ish programs of BLOCK chains, ``iters`` steps each."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = sms * waves * BLOCK
    out = torch.empty(n, device="cuda", dtype=torch.float32)
    grid = (sms * waves,)
    return {
        name: do_bench(lambda asm=asm: _chains[grid](out, iters, asm, BLOCK, num_warps=WARPS), warmup=25, rep=200)
        for name, asm in OPS.items()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=512)
    ap.add_argument("--waves", type=int, default=8, help="programs of 4 warps per SM")
    args = ap.parse_args(argv)
    ms = rates(args.iters, args.waves)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    warp_instructions = args.waves * BLOCK // 32 * args.iters  # per SM, one op of the chain each
    print(torch.cuda.get_device_name(), f"{sms} SMs, {args.iters} steps, {args.waves} programs an SM", flush=True)
    for name, t in ms.items():
        per = t * 1e6 / warp_instructions
        print(f"mufu_rate {name:9s} {t:8.3f} ms  {per:6.3f} ns a warp step an SM  x{t / ms['ex2']:5.2f} of ex2")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
