"""Head dim 512 on the GPU (issue 36): our triton kernels against every backend that runs d512.

    COMMIT=$(git rev-parse --short HEAD) python benchmarks/head_dim_512.py [--sweep] [--budget S] [--forward]

bf16, S = 4096, d = 512 (Dqk = Dv), causal and not: the forward (under no_grad) and forward +
backward of ``ad.sdpa(backend="triton")``, PyTorch's memory-efficient and math paths (through
``sdpa_kernel``) and FlexAttention (compiled; a failure is recorded with its error).  FLOPs as
benchmarks/grid.py counts them: 4 * B * H * S^2 * D forward, halved for causal, x3.5 forward +
backward.  Times: the median of ``triton.testing.do_bench``.

``--sweep`` first times the d512 tile candidates of each kernel (non-causal; forced one at a
time by replacing configs.candidate_configs, as sweep_configs.py does): every forward candidate,
then dK/dV and dQ with the best forward fixed; the main table then runs the best of each.
``--budget``: seconds after which the sweep stops trying candidates (the table always runs).
Details (every number, each failure's message) go to $OUT/head_dim_512.json; a short table last.

``--forward`` instead times only our forward, dense and causal: ``ad.sdpa(backend="triton")`` as
routed (the Gluon d512 forward on an H100 with Triton 3.6) and with the d512 route switched off
(the tl forward) in the same process, each with the route explain() gives and its relative
difference from the other (both 16-bit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention_dispatch as ad
from attention_dispatch.caches import clear_cache
from attention_dispatch.kernels import configs as C

BWD_FACTOR = 3.5  # benchmarks/grid.py: forward + backward = 3.5 x the forward's FLOPs
D = 512
SHAPES = ((2, 16, 4096),)  # (B, H, S)

# d512 tile candidates (BM, BN, warps, stages): the configs.py entries first, then neighbours
SWEEP = {
    C.FWD: [(64, 32, 8, 2), (64, 64, 8, 1), (128, 32, 16, 1), (64, 32, 4, 2)],
    C.BWD_DKDV: [(32, 32, 8, 2), (16, 64, 8, 2), (32, 64, 8, 1)],
    C.BWD_DQ: [(64, 32, 8, 1), (32, 32, 8, 2), (64, 16, 8, 2)],
}

_orig_candidates = C.candidate_configs
FORCED: dict[str, C.KernelConfig] = {}


def _candidates(kind, *a, **k):
    return [FORCED[kind]] if kind in FORCED else _orig_candidates(kind, *a, **k)


C.candidate_configs = _candidates


def bench_ms(fn, grad=None) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad, return_mode="median")


def fwd_flops(B, H, S, causal):
    return 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)


def first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


def make_impls(causal: bool, S: int):
    """name -> f(q, k, v) for every implementation measured."""
    impls = {"triton (ours)": lambda q, k, v: ad.sdpa(q, k, v, is_causal=causal, backend="triton")}

    def pinned(backend):
        def f(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return f

    impls["torch efficient"] = pinned(SDPBackend.EFFICIENT_ATTENTION)
    impls["torch math"] = pinned(SDPBackend.MATH)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        mask = None
        if causal:
            mask = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, S, S, device="cuda")
        impls["flex (compiled)"] = lambda q, k, v: compiled(q, k, v, block_mask=mask)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        impls["flex (compiled)"] = e
    return impls


def measure(fn, q, k, v, g, mode):
    if mode == "fwd":
        with torch.no_grad():
            fn(q, k, v)
            return bench_ms(lambda: fn(q, k, v))
    fn(q, k, v).backward(g)
    return bench_ms(lambda: fn(q, k, v).backward(g), grad=[q, k, v])


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def sweep(B, H, S, q, k, v, g, deadline, log):
    """Each kind's candidates, non-causal; FORCED keeps the best of each for the table."""
    f = lambda q, k, v: ad.sdpa(q, k, v, backend="triton")  # noqa: E731
    flops = fwd_flops(B, H, S, False)
    out = []
    for kind in (C.FWD, C.BWD_DKDV, C.BWD_DQ):
        best = None
        for cfg in SWEEP[kind]:
            if time.time() > deadline:
                log(f"sweep: budget spent, {kind} {cfg} not tried")
                break
            FORCED[kind] = C.KernelConfig(*cfg)
            clear_cache()  # chosen configs and sdpa()'s fast paths: no replay of another candidate's launches
            t0 = time.time()
            try:
                ms = measure(f, q, k, v, g, "fwd" if kind == C.FWD else "fwd+bwd")
                tf = flops * (1 if kind == C.FWD else BWD_FACTOR) / ms / 1e9
                rec = dict(kind=kind, cfg=cfg, ms=ms, tflops=tf)
            except Exception as e:  # noqa: BLE001
                rec = dict(kind=kind, cfg=cfg, error=first_line(e))
            rec["seconds"] = round(time.time() - t0, 1)
            out.append(rec)
            log(f"sweep {rec}")
            if "tflops" in rec and (best is None or rec["tflops"] > best[1]):
                best = (cfg, rec["tflops"])
        if best is None:
            FORCED.pop(kind, None)
        else:
            FORCED[kind] = C.KernelConfig(*best[0])
            log(f"sweep: best {kind} {best[0]} ({best[1]:.1f} TFLOP/s {'fwd' if kind == C.FWD else 'fwd+bwd'})")
    clear_cache()
    return out


@contextlib.contextmanager
def d512_route_off():
    """The tl d512 forward: the route's Gluon d512 forward switched off, caches emptied on entry and
    exit (sdpa()'s fast paths replay captured launches)."""
    from attention_dispatch.kernels import entry

    real = entry.serves_head_dims
    entry.serves_head_dims = lambda prob: False
    clear_cache()
    try:
        yield
    finally:
        entry.serves_head_dims = real
        clear_cache()


@contextlib.contextmanager
def d512_route_on():
    """The Gluon d512 forward turned on (route_d512.GPU_VERIFIED) where it is not yet by default."""
    from attention_dispatch.kernels.gluon import route_d512

    real = route_d512.GPU_VERIFIED
    route_d512.GPU_VERIFIED = True
    clear_cache()
    try:
        yield
    finally:
        route_d512.GPU_VERIFIED = real
        clear_cache()


def forward_only(B, H, S) -> int:
    """--forward: our forward as routed and with the d512 route off, dense and causal."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | Triton {triton.__version__} | commit "
        f"{os.environ.get('COMMIT', '?')}",
        flush=True,
    )
    for causal in (False, True):
        kw = dict(is_causal=causal, backend="triton")
        outs, tflops = {}, {}
        for name, scope in (("routed", d512_route_on), ("tl", d512_route_off)):
            with scope(), torch.no_grad():
                route = ad.explain(q, k, v, **kw).route
                outs[name] = ad.sdpa(q, k, v, **kw)
                ms = bench_ms(lambda: ad.sdpa(q, k, v, **kw))
            tflops[name] = fwd_flops(B, H, S, causal) / ms / 1e9
            print(
                f"bf16 B={B} H={H} S={S} d={D} {'causal' if causal else 'dense '} fwd {name:6s} {ms:7.3f} ms "
                f"{tflops[name]:6.1f} TFLOP/s  route: {'; '.join(route.lines())}",
                flush=True,
            )
        print(
            f"  routed / tl {tflops['routed'] / tflops['tl']:.2f}x, |routed - tl| / |tl| = "
            f"{rel_err(outs['routed'], outs['tl']):.1e}",
            flush=True,
        )
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--forward", action="store_true", help="only our forward, as routed and on the tl kernel")
    args = ap.parse_args()
    if args.forward:
        return forward_only(*SHAPES[0])
    t_start = time.time()
    out_dir = os.environ.get("OUT", ".")
    lines = []

    def log(msg):  # also appended to $OUT/head_dim_512.log as it goes (a timeout keeps it)
        print(msg, flush=True)
        lines.append(msg)
        with open(os.path.join(out_dir, "head_dim_512.log"), "a") as fh:
            fh.write(msg + "\n")

    info = dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        commit=os.environ.get("COMMIT", "?"),
        host=platform.node(),
    )
    log(f"env {info}")
    report = dict(info=info, sweep=[], results=[])
    table = []
    for B, H, S in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        if args.sweep:
            report["sweep"] = sweep(B, H, S, q, k, v, g, t_start + args.budget, log)
        report["forced"] = {kind: list(cfg) for kind, cfg in FORCED.items()}
        for causal in (False, True):
            impls = make_impls(causal, S)
            err, against = None, None
            for against in ("torch efficient", "torch math"):  # ours against PyTorch's (bf16 both)
                try:
                    with torch.no_grad():
                        err = rel_err(impls["triton (ours)"](q, k, v), impls[against](q, k, v))
                    break
                except Exception as e:  # noqa: BLE001
                    log(f"accuracy check against {against}: {first_line(e)}")
            log(f"B={B} H={H} S={S} causal={causal}: |ours - {against}| / |{against}| = {err}")
            row = dict(B=B, H=H, S=S, causal=causal, rel_err=err, rel_err_against=against, impls={})
            for name, fn in impls.items():
                cell = {}
                for mode in ("fwd", "fwd+bwd"):
                    if isinstance(fn, Exception):
                        cell[mode] = dict(error=first_line(fn))
                        continue
                    t0 = time.time()
                    try:
                        ms = measure(fn, q, k, v, g, mode)
                        flops = fwd_flops(B, H, S, causal) * (1 if mode == "fwd" else BWD_FACTOR)
                        cell[mode] = dict(ms=ms, tflops=flops / ms / 1e9)
                    except Exception as e:  # noqa: BLE001
                        cell[mode] = dict(error=first_line(e), trace=traceback.format_exc()[-2000:])
                    cell[mode]["seconds"] = round(time.time() - t0, 1)
                    log(f"  {name:16s} {mode:8s} {cell[mode].get('tflops', cell[mode].get('error'))}")
                    torch.cuda.empty_cache()
                row["impls"][name] = cell
            report["results"].append(row)
            table.append(row)
    report["seconds"] = round(time.time() - t_start, 1)
    with open(os.path.join(out_dir, "head_dim_512.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)

    print(
        f"\n{info['gpu']} | torch {info['torch']} | Triton {info['triton']} | commit {info['commit']} | {info['date']}"
    )
    print(f"bf16 d={D}, TFLOP/s (fwd+bwd = 3.5x fwd FLOPs); forced tiles: {report['forced'] or 'table'}")
    print(f"{'B H S causal':18s} {'impl':16s} {'fwd':>9s} {'fwd+bwd':>9s}")
    for row in table:
        best = {
            m: max((c[m].get("tflops", 0) for n, c in row["impls"].items() if n != "triton (ours)"), default=0)
            for m in ("fwd", "fwd+bwd")
        }
        for name, cell in row["impls"].items():
            vals = [f"{cell[m]['tflops']:9.1f}" if "tflops" in cell[m] else f"{'fail':>9s}" for m in ("fwd", "fwd+bwd")]
            print(f"{row['B']} {row['H']} {row['S']} {str(row['causal']):6s} {name:16s} {vals[0]} {vals[1]}")
        ours = row["impls"]["triton (ours)"]
        ratios = [
            f"{ours[m]['tflops'] / best[m]:.2f}x" if "tflops" in ours[m] and best[m] else "n/a"
            for m in ("fwd", "fwd+bwd")
        ]
        print(f"{'':18s} {'ours / best other':16s} {ratios[0]:>9s} {ratios[1]:>9s}")
    print(f"total {report['seconds']} s")


if __name__ == "__main__":
    sys.exit(main())
