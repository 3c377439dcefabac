"""float32 gradients at scores in the hundreds: triton and math backends against float64 (issue 38).

    python benchmarks/large_score_grads.py [--device cuda] [--seqlen 16,256] [--dims 1,16,64,128] [--seeds 1,2]

Inputs: q, k ~ 8 * randn, v, dO ~ randn (B=1, H=2, Sq=Sk), scale 3 / sqrt(D): scores reach the
hundreds, where one key dominates each row.  For each backend the float32 forward and backward on
those inputs; the oracle is the same computation in float64 (plain softmax, on the CPU) of the
same float32 inputs.  Prints one row per (S, D, seed) with the max |error| of dq, dk, dv per
backend and the ratio triton / math of dv; with $OUT set, writes the rows to
$OUT/large_score_grads.json.  Under TRITON_INTERPRET=1 it runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import attention_dispatch as ad  # noqa: E402

BACKENDS = ("triton", "math")


def float64_grads(q, k, v, do, scale):
    """(dq, dk, dv) of softmax(scale q k^T) v in float64 on the CPU."""
    q, k, v = (t.detach().cpu().double().requires_grad_(True) for t in (q, k, v))
    out = torch.softmax(scale * q @ k.transpose(-1, -2), dim=-1) @ v
    out.backward(do.cpu().double())
    return q.grad, k.grad, v.grad


def backend_grads(backend, q, k, v, do, scale):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = ad.sdpa(q, k, v, scale=scale, backend=backend)
    out.backward(do)
    return q.grad, k.grad, v.grad


def row(device, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (8.0 * torch.randn(1, 2, s, d, generator=g) for _ in range(2))
    v, do = (torch.randn(1, 2, s, d, generator=g) for _ in range(2))
    q, k, v, do = (t.to(device) for t in (q, k, v, do))
    scale = 3.0 / math.sqrt(d)
    ref = float64_grads(q, k, v, do, scale)
    result = dict(seqlen=s, head_dim=d, seed=seed, max_score=(scale * q @ k.transpose(-1, -2)).abs().max().item())
    for backend in BACKENDS:
        got = backend_grads(backend, q, k, v, do, scale)
        for name, g_, r in zip(("dq", "dk", "dv"), got, ref):
            result[f"{backend}_{name}"] = (g_.detach().cpu().double() - r).abs().max().item()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqlen", default="16,256")
    ap.add_argument("--dims", default="1,16,64,128")
    ap.add_argument("--seeds", default="1,2")
    a = ap.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    rows = [row(a.device, s, d, seed) for s in ints(a.seqlen) for d in ints(a.dims) for seed in ints(a.seeds)]
    head = f"{'S':>4} {'D':>4} {'seed':>4} {'|s|max':>7}"
    for backend in BACKENDS:
        head += "".join(f" {backend[:6] + ' ' + n:>12}" for n in ("dq", "dk", "dv"))
    print(f"device: {a.device} ({torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}), float32 vs float64")
    print(head + f" {'dv ratio':>9}")
    for r in rows:
        line = f"{r['seqlen']:>4} {r['head_dim']:>4} {r['seed']:>4} {r['max_score']:>7.0f}"
        for backend in BACKENDS:
            line += "".join(f" {r[f'{backend}_{n}']:>12.2e}" for n in ("dq", "dk", "dv"))
        print(line + f" {r['triton_dv'] / max(r['math_dv'], 1e-30):>9.1f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "large_score_grads.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
