"""The warp-specialised Gluon kernels against the tl kernels, in interleaved rounds (GPU).

    python benchmarks/forward_ab.py [--rounds 5] [--json out.json] [--commit SHA] [--rows TEXT] [--min-causal N]

For each row both forwards run through ``triton_attention`` (the kernel's autograd
function, so that no relaunch cache keeps one of them): "ws" as shipped, "tl" with
``launch.WS_MIN_WORK`` raised past every call (that turns off the warp-specialised
forward, dK/dV and dQ passes together), and "ws-tl-dq" (forward+backward only) with the tl dQ pass.  Prints forward (and forward+backward where
asked) TFLOP/s medians and the ws / tl ratio per row; docs/perf-notes.md experiment 40.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from attention_dispatch.kernels import KernelParams, configs as C, launch, triton_attention  # noqa: E402

# (label, dtype, head dim, S, causal, Hq, Hkv, (B, S, H, D) memory, also forward+backward)
ROWS = [("bf16 d128 1k causal", torch.bfloat16, 128, 1024, True, 16, 16, False, True),
        ("bf16 d128 2k causal", torch.bfloat16, 128, 2048, True, 16, 16, False, True),
        ("bf16 d128 4k", torch.bfloat16, 128, 4096, False, 16, 16, False, True),
        ("bf16 d128 4k causal", torch.bfloat16, 128, 4096, True, 16, 16, False, True),
        ("bf16 d128 16k", torch.bfloat16, 128, 16384, False, 16, 16, False, True),
        ("bf16 d128 16k causal", torch.bfloat16, 128, 16384, True, 16, 16, False, True),
        ("bf16 d64 4k", torch.bfloat16, 64, 4096, False, 32, 32, False, False),
        ("bf16 d64 4k causal", torch.bfloat16, 64, 4096, True, 32, 32, False, False),
        ("bf16 d64 16k", torch.bfloat16, 64, 16384, False, 32, 32, False, False),
        ("bf16 d64 16k causal", torch.bfloat16, 64, 16384, True, 32, 32, False, False),
        ("fp16 d128 4k", torch.float16, 128, 4096, False, 16, 16, False, False),
        ("fp16 d128 16k causal", torch.float16, 128, 16384, True, 16, 16, False, False),
        ("bf16 d128 GQA 16/4 4k", torch.bfloat16, 128, 4096, False, 16, 4, False, True),
        ("bf16 d128 GQA 16/4 4k causal", torch.bfloat16, 128, 4096, True, 16, 4, False, True),
        ("bf16 d128 BSHD 4k", torch.bfloat16, 128, 4096, False, 16, 16, True, False),
        ("bf16 d128 BSHD 4k causal", torch.bfloat16, 128, 4096, True, 16, 16, True, False)]
TOKENS = 16384
# "ws": as shipped; "tl": no warp-specialised kernel; "ws-tl-dq": the warp-specialised forward and
# dK/dV pass with the tl dQ pass (forward+backward only: its forward is "ws")
IMPLS = ("ws", "tl", "ws-tl-dq")
FWD_IMPLS = ("ws", "tl")


@contextlib.contextmanager
def configured(impl: str, ws_min: int):
    dq = C.WS_DQ_CONFIGS.copy()
    try:
        launch.WS_MIN_WORK = 1 << 62 if impl == "tl" else ws_min
        if impl == "ws-tl-dq":
            C.WS_DQ_CONFIGS.clear()
        yield
    finally:
        launch.WS_MIN_WORK = ws_min
        C.WS_DQ_CONFIGS.update(dq)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--rows", default="", help="substring of the row labels to run")
    p.add_argument("--min-causal", type=int, default=None,
                   help="the warp-specialised kernels' min_causal_seqlen for this run (e.g. 0 to time 1k causal)")
    a = p.parse_args(argv)
    if a.min_causal is not None:
        for d, cfg in C.WS_FWD_CONFIGS.items():
            C.WS_FWD_CONFIGS[d] = cfg._replace(min_causal_seqlen=a.min_causal)
    ws_min = launch.WS_MIN_WORK
    results = {}
    for label, dt, d, S, causal, hq, hkv, bshd, with_bwd in ROWS:
        if a.rows not in label:
            continue
        B = TOKENS // S
        shapes = [(B, hq, S, d), (B, hkv, S, d), (B, hkv, S, d)]
        if bshd:
            q, k, v = (torch.randn(b, s, h, dd, device="cuda", dtype=dt).transpose(1, 2) for b, h, s, dd in shapes)
        else:
            q, k, v = (torch.randn(*sh, device="cuda", dtype=dt) for sh in shapes)
        for t in (q, k, v):
            t.requires_grad_(True)
        do = torch.randn(B, hq, S, d, device="cuda", dtype=dt)
        params = KernelParams(scale=d ** -0.5, window_right=0 if causal else -1)
        flops = 4 * B * hq * S * S * d / (2 if causal else 1)

        def fwd():
            with torch.no_grad():
                return triton_attention(q, k, v, None, params)

        def fwd_bwd():
            torch.autograd.grad(triton_attention(q, k, v, None, params), (q, k, v), do)
        modes = {"fwd": (fwd, 1.0)} | ({"fwd+bwd": (fwd_bwd, 3.5)} if with_bwd else {})
        samples = {(impl, m): [] for impl in IMPLS for m in modes}
        outs = {}
        for impl in IMPLS:
            with configured(impl, ws_min):
                outs[impl] = fwd()
        err = (outs["ws"].float() - outs["tl"].float()).abs().max().item()
        for rnd in range(a.rounds):
            for impl in (IMPLS if rnd % 2 == 0 else IMPLS[::-1]):
                with configured(impl, ws_min):
                    for m, (fn, mult) in modes.items():
                        if m == "fwd" and impl not in FWD_IMPLS:
                            continue
                        ms = triton.testing.do_bench(fn, warmup=10, rep=60)
                        samples[(impl, m)].append(mult * flops / ms / 1e9)
        samples = {key: v for key, v in samples.items() if v}
        med = {f"{impl} {m}": statistics.median(v) for (impl, m), v in samples.items()}
        results[label] = dict(tflops=med, max_abs_diff=err, rounds={f"{i} {m}": v for (i, m), v in samples.items()})
        print(f"{label:30s} " + "  ".join(
            f"{m}: " + " ".join(f"{impl} {med[impl + ' ' + m]:.0f}" for impl in IMPLS if impl + " " + m in med)
            + f" (ws/tl {med['ws ' + m] / med['tl ' + m]:.3f})" for m in modes) + f"  |ws-tl| {err:.1e}", flush=True)
        del q, k, v, do, outs
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                rounds=a.rounds, commit=a.commit, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(f"{meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | {a.rounds} rounds | {a.commit}")
    if a.json:
        a.json.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
