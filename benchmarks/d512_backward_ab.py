"""d512 training time of the tree it runs in, by backward variant (issue 36, perf-notes E108; GPU).

    python benchmarks/d512_backward_ab.py [--variants table,...] [--bands dense,causal] [--forwards tl,gluon]
        [--ref] [--label L]

bf16 B=2 H=16 S=4096 d=512 through ``ad.sdpa(backend="triton")``: the forward (under no_grad) and
forward + backward (``triton.testing.do_bench`` medians), the backward as their difference, in ms and
TFLOP/s as benchmarks/grid.py counts them (4 B H S^2 D forward, halved for causal, x3.5 training).
One line a run: "LABEL VARIANT BAND FORWARD fwd_ms train_ms bwd_ms train_TFLOP/s".
``--forwards``, run in that order, each over every band: "tl" with the d512 Gluon forward's route off
(the tl forward: between trees only the backward differs), "gluon" with it on (route_d512.GPU_VERIFIED
set, as head_dim_512.py --forward does; where the tree has no such forward, the tree's own).
``--ref`` adds PyTorch's memory-efficient kernel (the best other backend at d512: FlexAttention fails
there) as variant "efficient", forward "-", last.  Variants force the backward's config-table
candidates (configs.py) as benchmarks/head_dim_512.py's sweep does; those naming the split dK/dV kinds
of E108's patch (configs.SPLIT_KINDS) are skipped in a tree without them:
  table      the tree's own choices
  dk16       dK pass 16x64x8x2 (two stages, products N = 8 a warpgroup)
  dv1        dV pass 32x64x8x1 (one stage)
  combined2  one dK/dV pass, 32x32x8x2 (the split kinds given no candidate)
  combined1  one dK/dV pass, 32x32x8x1
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention_dispatch as ad
from attention_dispatch.caches import clear_cache
from attention_dispatch.kernels import configs as C
from attention_dispatch.kernels import entry

try:
    from attention_dispatch.kernels.gluon import route_d512
except ImportError:  # a tree without the Gluon d512 forward
    route_d512 = None

B, H, S, D = 2, 16, 4096, 512
DV, DK = getattr(C, "BWD_DV", None), getattr(C, "BWD_DK", None)
# variant -> {kind: forced (BM, BN, warps, stages), or None: no candidate}
VARIANTS = {
    "table": {},
    "dk16": {DK: (16, 64, 8, 2)},
    "dv1": {DV: (32, 64, 8, 1)},
    "combined2": {DV: None, C.BWD_DKDV: (32, 32, 8, 2)},
    "combined1": {DV: None, C.BWD_DKDV: (32, 32, 8, 1)},
}
FORCED: dict = {}
_table = C.candidate_configs


def _forced(kind, *a, **k):
    if kind in FORCED:
        return [] if FORCED[kind] is None else [C.KernelConfig(*FORCED[kind])]
    return _table(kind, *a, **k)


C.candidate_configs = _forced
ROUTE = (getattr(entry, "serves_head_dims", None), getattr(route_d512, "GPU_VERIFIED", None))


def set_forward(mode: str) -> None:
    """ "tl": the d512 Gluon forward's route off; "gluon": on; "tree": as the tree has it."""
    serves, verified = ROUTE
    if serves is not None:
        entry.serves_head_dims = (lambda prob: False) if mode == "tl" else serves
    if verified is not None:
        route_d512.GPU_VERIFIED = True if mode == "gluon" else verified
    clear_cache()  # sdpa()'s decisions and fast paths: no replay of another route's launches


def bench_ms(fn, grad=None) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad, return_mode="median")


def times(fn, q, k, v, g):
    """(forward ms, forward + backward ms)."""
    with torch.no_grad():
        fn(q, k, v)
        fwd = bench_ms(lambda: fn(q, k, v))
    fn(q, k, v).backward(g)
    return fwd, bench_ms(lambda: fn(q, k, v).backward(g), grad=[q, k, v])


def efficient(causal: bool):
    def fn(q, k, v):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return fn


def ours(causal: bool):
    def fn(q, k, v):
        return ad.sdpa(q, k, v, is_causal=causal, backend="triton")

    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="table")
    ap.add_argument("--bands", default="dense,causal")
    ap.add_argument("--forwards", default="tl")
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--label", default="tree")
    args = ap.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    bands = args.bands.split(",")
    # forward-major: a Gluon forward that fails or hangs (its timeout) comes after every tl-forward line
    runs = [(m, b, n) for m in args.forwards.split(",") for b in bands for n in args.variants.split(",")]
    runs += [("-", b, "efficient") for b in bands] if args.ref else []
    for mode, band, name in runs:
        causal = band == "causal"
        flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0) * 3.5
        tag = f"{args.label} {name} {band} {mode}"
        if name == "efficient":
            fn = efficient(causal)
        elif None in VARIANTS[name]:
            print(f"{tag} skipped: no split dK/dV kinds in this tree", flush=True)
            continue
        else:
            FORCED.clear()
            FORCED.update(VARIANTS[name])
            set_forward(mode)
            fn = ours(causal)
        try:
            fwd, train = times(fn, q, k, v, g)
            print(f"{tag} {fwd:.3f} {train:.3f} {train - fwd:.3f} {flops / train / 1e9:.1f}", flush=True)
        except Exception as e:  # noqa: BLE001 - a run that fails is a finding, the others still run
            print(f"{tag} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        torch.cuda.empty_cache()
    FORCED.clear()
    set_forward("tree")


if __name__ == "__main__":
    main()
