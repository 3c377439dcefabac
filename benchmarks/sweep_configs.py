"""Sweep the Triton kernel's launch configurations on the GPU (docs/experiments/perf-notes.md, experiment 1).

    python benchmarks/sweep_configs.py        # writes $OUT/sweep.json (or ./sweep.json)

For each head dim (bf16, S = 4096, B*S = 16k tokens, hidden 2048), causal or not: every
forward candidate, then dK/dV and dQ candidates with the best forward fixed; prints the
best of each. Candidates are forced by replacing configs.candidate_configs.
"""

import json
import os
import time

import torch
import triton
import attention_dispatch as ad
from attention_dispatch.kernels import configs as C

orig = C.candidate_configs
FORCED = {}


def cand(kind, *a, **k):
    return [FORCED[kind]] if kind in FORCED else orig(kind, *a, **k)


C.candidate_configs = cand
K = C.KernelConfig
# 5-tuples: two query sub-tiles per program (experiment 22)
FWD = {
    64: [
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 128, 4, 3),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (64, 128, 4, 3),
        (128, 64, 4, 4),
        (128, 128, 4, 3, 2),
        (256, 64, 8, 3, 2),
    ],
    128: [
        (128, 64, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (64, 128, 4, 3),
        (128, 64, 8, 4),
        (128, 128, 4, 2),
        (256, 64, 8, 3, 2),
        (128, 64, 4, 3, 2),
    ],
    256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 3)],
}
DKDV = {
    64: [(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 2), (32, 64, 4, 3)],
    128: [
        (64, 128, 8, 2),
        (64, 128, 8, 3),
        (32, 128, 4, 3),
        (64, 64, 4, 3),
        (32, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 128, 4, 2),
    ],
    256: [(32, 64, 8, 2), (32, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2), (16, 64, 4, 2)],
}
DQ = {
    64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2), (128, 32, 4, 3)],
    128: [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2), (128, 32, 8, 2)],
    256: [(64, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2), (128, 32, 8, 2)],
}
res = []
t0 = time.time()


def bench(fn, grad=None):
    return triton.testing.do_bench(fn, warmup=10, rep=60, grad_to_none=grad)


for d in (128, 64, 256):
    S = 4096
    H = 2048 // d
    B = 16384 // S
    q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    for causal in (False, True):
        flops = 4 * B * H * S * S * d / (2 if causal else 1)
        run = lambda: ad.sdpa(q, k, v, is_causal=causal, backend="triton")
        best = None
        FORCED.clear()
        for cfg in FWD[d]:
            FORCED["fwd"] = K(*cfg)
            try:
                with torch.no_grad():
                    ms = bench(run)
                tf = flops / ms / 1e9
            except Exception as e:
                tf = 0.0
                print("fwd fail", d, cfg, str(e).splitlines()[0][:100])
            res.append(("fwd", d, causal, cfg, round(tf, 1)))
            if best is None or tf > best[1]:
                best = (cfg, tf)
        FORCED["fwd"] = K(*best[0])
        print(f"d={d} causal={causal} best fwd {best}", flush=True)
        for kind, table in (("bwd_dkdv", DKDV), ("bwd_dq", DQ)):
            bestb = None
            for cfg in table[d]:
                FORCED[kind] = K(*cfg)
                try:
                    ms = bench(lambda: run().backward(g), grad=[q, k, v])
                    tf = 3.5 * flops / ms / 1e9
                except Exception as e:
                    tf = 0.0
                    print("bwd fail", kind, d, cfg, str(e).splitlines()[0][:100])
                res.append((kind, d, causal, cfg, round(tf, 1)))
                if bestb is None or tf > bestb[1]:
                    bestb = (cfg, tf)
            FORCED[kind] = K(*bestb[0])
            print(f"d={d} causal={causal} best {kind} {bestb} (fwd+bwd TFLOP/s)", flush=True)
        if time.time() - t0 > 420:
            break
json.dump(res, open(os.environ.get("OUT", ".") + "/sweep.json", "w"))
print("total", time.time() - t0)
