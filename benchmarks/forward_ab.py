"""The warp-specialised Gluon kernels against the tl kernels, in interleaved rounds (GPU).

    python benchmarks/forward_ab.py [--rounds 5] [--json out.json] [--commit SHA] [--rows TEXT,...]
        [--impls ws,tl,ws-tl-dq] [--ref tl] [--base-module PATH] [--bwd-stages N]

For each row the implementations run through ``triton_attention`` (the kernel's autograd
function, so that no relaunch cache keeps one of them): "ws" as shipped, "tl" with
``gluon.route.WS_MIN_WORK`` raised past every call (that turns off the warp-specialised
forward, dK/dV and dQ passes together), "ws-tl-dq" (forward+backward only) with the tl dQ
pass, "base" with the Gluon kernels of another copy of the kernels/gluon package (``--base-module DIR``,
e.g. ``git archive HEAD~1 attention_dispatch/kernels/gluon | tar -x -C /tmp/base`` and
``--base-module /tmp/base/attention_dispatch/kernels/gluon``) and "ws-bwd-stages" with
``--bwd-stages`` (Q, dO) slots in the dK/dV pass, "ws-no-fuse" with the dQ pass kept apart
from the dK/dV pass (experiments 54 and 78), "ws-fuse-banded" with dQ fused for causal and
windowed calls too (WsConfig.fuse_dq_banded at every head dim) and "ws-bwd-block-m" with
``--bwd-block-m`` query rows per dK/dV tile (experiment 79), "ws-lpt<N>" (e.g. ws-lpt32) with the
causal Gluon forward launched in LPT groups of N (b, h) rows (gluon.launch.lpt_rows; ws-lpt0:
the grid's order, experiment 102).  Prints forward (and forward+backward where asked, not with
``--fwd-only``) TFLOP/s medians and each one's ratio to ``--ref``; docs/experiments/perf-notes.md
experiments 40-43.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from attention_dispatch.kernels import KernelParams, configs as C, triton_attention  # noqa: E402
from attention_dispatch.kernels.gluon import launch as gluon_launch, route as gluon_route  # noqa: E402

# (label, dtype, head dim, S, causal (True / False, or a window (left, right) with -1 unbounded), Hq,
#  Hkv, (B, S, H, D) memory, also forward+backward)
ROWS = [
    ("bf16 d128 512 causal", torch.bfloat16, 128, 512, True, 16, 16, False, True),
    ("bf16 d128 1k causal", torch.bfloat16, 128, 1024, True, 16, 16, False, True),
    ("bf16 d128 2k causal", torch.bfloat16, 128, 2048, True, 16, 16, False, True),
    ("bf16 d128 4k", torch.bfloat16, 128, 4096, False, 16, 16, False, True),
    ("bf16 d128 4k causal", torch.bfloat16, 128, 4096, True, 16, 16, False, True),
    ("bf16 d128 16k", torch.bfloat16, 128, 16384, False, 16, 16, False, True),
    ("bf16 d128 16k causal", torch.bfloat16, 128, 16384, True, 16, 16, False, True),
    ("bf16 d64 4k", torch.bfloat16, 64, 4096, False, 32, 32, False, True),
    ("bf16 d64 4k causal", torch.bfloat16, 64, 4096, True, 32, 32, False, True),
    ("bf16 d64 16k", torch.bfloat16, 64, 16384, False, 32, 32, False, True),
    ("bf16 d64 16k causal", torch.bfloat16, 64, 16384, True, 32, 32, False, True),
    ("fp16 d128 4k", torch.float16, 128, 4096, False, 16, 16, False, False),
    ("fp16 d128 16k causal", torch.float16, 128, 16384, True, 16, 16, False, False),
    ("bf16 d128 GQA 16/4 4k", torch.bfloat16, 128, 4096, False, 16, 4, False, True),
    ("bf16 d128 GQA 16/4 4k causal", torch.bfloat16, 128, 4096, True, 16, 4, False, True),
    ("bf16 d128 BSHD 4k", torch.bfloat16, 128, 4096, False, 16, 16, True, False),
    ("bf16 d128 BSHD 4k causal", torch.bfloat16, 128, 4096, True, 16, 16, True, False),
    ("bf16 d128 4k window 1024/0", torch.bfloat16, 128, 4096, (1024, 0), 16, 16, False, True),
    ("bf16 d128 16k window 1024/0", torch.bfloat16, 128, 16384, (1024, 0), 16, 16, False, True),
    ("bf16 d128 4k window 256/256", torch.bfloat16, 128, 4096, (256, 256), 16, 16, False, True),
    ("bf16 d64 4k window 1024/0", torch.bfloat16, 64, 4096, (1024, 0), 32, 32, False, True),
    ("bf16 d64 16k window 1024/0", torch.bfloat16, 64, 16384, (1024, 0), 32, 32, False, True),
    ("bf16 d64 4k window 256/256", torch.bfloat16, 64, 4096, (256, 256), 32, 32, False, True),
    ("bf16 d256 512 causal", torch.bfloat16, 256, 512, True, 8, 8, False, True),
    ("bf16 d256 4k", torch.bfloat16, 256, 4096, False, 8, 8, False, True),
    ("bf16 d256 4k causal", torch.bfloat16, 256, 4096, True, 8, 8, False, True),
    ("bf16 d256 16k", torch.bfloat16, 256, 16384, False, 8, 8, False, True),
    ("bf16 d256 16k causal", torch.bfloat16, 256, 16384, True, 8, 8, False, True),
    ("fp16 d256 1k causal", torch.float16, 256, 1024, True, 8, 8, False, True),
]
TOKENS = 16384
# "ws": as shipped; "tl": no warp-specialised kernel; "ws-tl-dq": the warp-specialised forward and
# dK/dV pass with the tl dQ pass (forward+backward only: its forward is "ws")
IMPLS = ("ws", "tl", "ws-tl-dq", "base", "ws-bwd-stages", "ws-no-fuse", "ws-fuse-banded", "ws-bwd-block-m")
BWD_ONLY = ("ws-tl-dq", "ws-bwd-stages", "ws-no-fuse", "ws-fuse-banded", "ws-bwd-block-m")  # their forward is "ws"
LPT_IMPL = re.compile(r"ws-lpt(\d+)")  # "ws" with LPT groups of N rows (0: the grid's order)


def load_base(path: Path) -> dict:
    """The Gluon kernels of another copy of the kernels/gluon package (a directory), by
    gluon.launch.KERNELS's names."""
    import importlib
    import importlib.util

    name = "gluon_base"
    spec = importlib.util.spec_from_file_location(name, path / "__init__.py", submodule_search_locations=[str(path)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg  # gluon.jit reads the modules' globals
    spec.loader.exec_module(pkg)
    fwd, dkdv, dq = (importlib.import_module(f"{name}.{m}") for m in ("forward", "dkdv", "dq"))
    return {"fwd_ws": fwd._attn_fwd_ws, "bwd_dkdv_ws": dkdv._attn_bwd_dkdv_ws, "bwd_dq_ws": dq._attn_bwd_dq_ws}


@contextlib.contextmanager
def configured(impl: str, ws_min: int, base: dict | None = None, bwd_stages: int = 0, bwd_block_m: int = 64):
    dq, bwd = C.WS_DQ_CONFIGS.copy(), C.WS_BWD_CONFIGS.copy()
    shipped = dict(gluon_launch.KERNELS)
    shipped_lpt = gluon_launch.lpt_rows
    try:
        if lpt := LPT_IMPL.fullmatch(impl):  # the calls the shipped rule groups (causal, no bias) take N
            n = int(lpt.group(1))
            gluon_launch.lpt_rows = lambda *args: n if shipped_lpt(*args) else 0
        gluon_route.WS_MIN_WORK = 1 << 62 if impl == "tl" else ws_min
        if impl == "ws-tl-dq":
            C.WS_DQ_CONFIGS.clear()
        if impl == "base":
            gluon_launch.KERNELS.update(base)
        # the impls that change one field of every head dim's dK/dV config
        bwd_change = {
            "ws-bwd-stages": dict(stages=bwd_stages),
            "ws-no-fuse": dict(fuse_dq=False),
            "ws-fuse-banded": dict(fuse_dq_banded=True),
            "ws-bwd-block-m": dict(bwd_block_m=bwd_block_m),
        }.get(impl)
        if bwd_change:
            for d, cfg in bwd.items():
                C.WS_BWD_CONFIGS[d] = cfg._replace(**bwd_change)
        yield
    finally:
        gluon_route.WS_MIN_WORK = ws_min
        C.WS_DQ_CONFIGS.update(dq)
        C.WS_BWD_CONFIGS.update(bwd)
        gluon_launch.KERNELS.update(shipped)
        gluon_launch.lpt_rows = shipped_lpt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--rows", default="", help="comma-separated substrings of the row labels to run")
    p.add_argument("--impls", default="ws,tl,ws-tl-dq", help=f"comma-separated, of {', '.join(IMPLS)}")
    p.add_argument("--ref", default="tl", help="the implementation the ratios divide by")
    p.add_argument(
        "--base-module", type=Path, default=None, help="a copy of the kernels/gluon package (directory) for impl 'base'"
    )
    p.add_argument("--bwd-stages", type=int, default=3, help="dK/dV pass slots for impl 'ws-bwd-stages'")
    p.add_argument("--bwd-block-m", type=int, default=64, help="dK/dV query tile rows for impl 'ws-bwd-block-m'")
    p.add_argument("--fwd-only", action="store_true", help="measure the forward only")
    a = p.parse_args(argv)
    impls = tuple(a.impls.split(","))
    unknown = [i for i in impls + (a.ref,) if i not in IMPLS and not LPT_IMPL.fullmatch(i)]
    if unknown or a.ref not in impls or ("base" in impls and a.base_module is None):
        p.error(f"--impls/--ref: unknown {unknown}, or --ref not among --impls, or 'base' without --base-module")
    base = load_base(a.base_module) if "base" in impls else None
    ws_min = gluon_route.WS_MIN_WORK
    results = {}
    for label, dt, d, S, causal, hq, hkv, bshd, with_bwd in ROWS:
        if not any(part in label for part in a.rows.split(",")):
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
        left, right = causal if isinstance(causal, tuple) else (-1, 0 if causal else -1)
        params = KernelParams(scale=d**-0.5, window_left=left, window_right=right)
        pairs = sum(min(S, i + right + 1 if right >= 0 else S) - max(0, i - left if left >= 0 else 0) for i in range(S))
        flops = 4 * B * hq * pairs * d

        def fwd():
            with torch.no_grad():
                return triton_attention(q, k, v, None, params)

        def fwd_bwd():
            torch.autograd.grad(triton_attention(q, k, v, None, params), (q, k, v), do)

        modes = {"fwd": (fwd, 1.0)} | ({"fwd+bwd": (fwd_bwd, 3.5)} if with_bwd and not a.fwd_only else {})
        samples = {(impl, m): [] for impl in impls for m in modes}
        outs = {}
        for impl in impls:
            with configured(impl, ws_min, base, a.bwd_stages, a.bwd_block_m):
                outs[impl] = fwd()
        err = max((outs[i].float() - outs[a.ref].float()).abs().max().item() for i in impls)
        for rnd in range(a.rounds):
            for impl in impls if rnd % 2 == 0 else impls[::-1]:
                with configured(impl, ws_min, base, a.bwd_stages, a.bwd_block_m):
                    for m, (fn, mult) in modes.items():
                        if m == "fwd" and impl in BWD_ONLY:
                            continue
                        ms = triton.testing.do_bench(fn, warmup=10, rep=60)
                        samples[(impl, m)].append(mult * flops / ms / 1e9)
        samples = {key: v for key, v in samples.items() if v}
        med = {f"{impl} {m}": statistics.median(v) for (impl, m), v in samples.items()}
        results[label] = dict(tflops=med, max_abs_diff=err, rounds={f"{i} {m}": v for (i, m), v in samples.items()})
        print(
            f"{label:30s} "
            + "  ".join(
                f"{m}: "
                + " ".join(
                    f"{impl} {med[impl + ' ' + m]:.0f} ({med[impl + ' ' + m] / med[a.ref + ' ' + m]:.3f})"
                    for impl in impls
                    if impl + " " + m in med
                )
                for m in modes
            )
            + f"  forward max |impl - {a.ref}| {err:.1e}",
            flush=True,
        )
        q = k = v = do = outs = None  # free the row's tensors before the next
    finish_run(a, results, impls=impls, ref=a.ref)
    return 0


def finish_run(a, results: list, against: str = "", **extra) -> dict:
    """An A/B run's ending (this script's and kv_ab.py's): its meta (GPU, torch, Triton, rounds,
    commit, ``extra``, date), the summary line printed, and ``results`` with the meta into
    ``a.json`` when given."""
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        rounds=a.rounds,
        commit=a.commit,
        **extra,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    tail = f" against {against}" if against else ""
    print(f"{meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | {a.rounds} rounds | {a.commit}{tail}")
    if a.json:
        a.json.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    return meta


if __name__ == "__main__":
    sys.exit(main())
