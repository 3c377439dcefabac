"""flash-attn 4 on its own layout against the views our adapter passes it (GPU; a diagnostic).

    python benchmarks/fa4_layout.py [--rounds 9] [--json out.json]

The grid's "fa4" column feeds flash_attn.cute (B, S, H, D) contiguous tensors; sdpa() takes
(B, H, S, D) and its flash_attn adapter passes ``transpose(1, 2)`` views.  At d64 S=16k the
policy="fastest" column (flash-attn 4 through the adapter) read ~2% slower than the fa4 column
in eight grids (docs/experiments/perf-notes.md, experiment 67).  Each row times, in interleaved rounds
(a new order each round, one untimed call per turn, CUDA events, median of all repetitions):

- ``bshd``: flash_attn.cute on (B, S, H, D) contiguous tensors (the grid's column);
- ``views``: flash_attn.cute on transposed views of (B, H, S, D) contiguous tensors;
- ``views+out``: the same, writing into a (B, H, S, D) contiguous output (``out=`` of the
  internal ``_flash_attn_fwd``; forward only);
- ``sdpa``: ``attention_dispatch.sdpa(..., backend="flash_attn")`` on (B, H, S, D).

and lists the CUDA kernels one ``sdpa`` forward+backward launches (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import attention_dispatch as ad  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
# (dtype, head dim, S, causal, window): the window rows forward only (flash-attn 4 has no windowed backward on sm90);
# bf16 window (1024, 0) S=16k read 0.93 through sdpa against the fa4 column in the grid of 2026-11-27 (1.01 on 11-26)
ROWS = [
    ("bf16", 64, 16384, False, None),
    ("fp16", 64, 16384, False, None),
    ("bf16", 128, 16384, True, None),
    ("bf16", 128, 8192, False, None),
    ("bf16", 128, 16384, False, (1024, 0)),
    ("bf16", 128, 4096, False, (1024, 0)),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = ("bshd", "views", "views+out", "sdpa")


def calls(func, fwd_into, dtype, D, S, causal, window=None):
    B, H = TOKENS // S, HIDDEN // D
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    qb, kb, vb = (t.transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    dob = do.transpose(1, 2).contiguous()
    for t in (q, k, v):
        t.requires_grad_(True)
    out_bhsd = torch.empty(B, H, S, D, device="cuda", dtype=dtype)

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    kw = dict(causal=causal, window_size=window) if window else dict(causal=causal)
    # the internal forward takes the window's sides apart
    kw_into = dict(causal=causal, window_size_left=window[0], window_size_right=window[1]) if window else kw
    fwd = {
        "bshd": lambda: first(func(qb, kb, vb, **kw)),
        "views": lambda: first(func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)),
        "views+out": lambda: first(
            fwd_into(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw_into, out=out_bhsd.transpose(1, 2))
        ),
        "sdpa": lambda: ad.sdpa(q, k, v, is_causal=causal, window=window, backend="flash_attn"),
    }
    # (leaves, gradient of the output in its layout) of the differentiable ones: out= exists only
    # on the internal forward, which has no autograd
    training = {} if window else {"bshd": ((qb, kb, vb), dob), "views": ((q, k, v), dob), "sdpa": ((q, k, v), do)}
    out = {}
    for name, f in fwd.items():

        def inference(f=f):
            with torch.no_grad():
                f()

        out[(name, "fwd")] = inference
        if name in training:

            def fb(f=f, lv_go=training[name]):
                torch.autograd.grad(f(), *lv_go)

            out[(name, "fwd+bwd")] = fb
    return out


def time_rounds(fns: dict, rounds: int, per_turn: int) -> dict:
    keys = list(fns)
    samples = {k: [] for k in keys}
    for fn in fns.values():  # compile / warm up
        fn()
        fn()
    torch.cuda.synchronize()
    for rnd in range(rounds):
        order = keys[:] if rnd == 0 else random.Random(rnd).sample(keys, len(keys))
        for k in order:
            fns[k]()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(per_turn)]
            for s, e in ev:
                s.record()
                fns[k]()
                e.record()
            torch.cuda.synchronize()
            samples[k] += [s.elapsed_time(e) for s, e in ev]
    return {k: statistics.median(v) for k, v in samples.items()}


def kernels_of(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        f"{e.key[:90]} x{e.count} {e.device_time_total / e.count:.1f} us"
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--per-turn", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    from flash_attn.cute import flash_attn_func as func
    from flash_attn.cute.interface import _flash_attn_fwd as fwd_into

    report = []
    for dt, D, S, causal, window in ROWS:
        label = f"{dt} d{D} S={S}{' causal' if causal else ''}{f' window {window}' if window else ''}"
        fns = calls(func, fwd_into, DTYPES[dt], D, S, causal, window)
        med = time_rounds(fns, a.rounds, a.per_turn)
        kern = kernels_of(fns[("sdpa", "fwd" if window else "fwd+bwd")])
        report.append(
            {"row": label, "median_ms": {f"{n} {m}": ms for (n, m), ms in med.items()}, "sdpa_fwd_bwd_kernels": kern}
        )
        for m in ("fwd",) if window else ("fwd", "fwd+bwd"):
            base = med[("bshd", m)]
            cells = "  ".join(f"{n} {med[(n, m)]:.3f} ms ({base / med[(n, m)]:.3f})" for n in IMPLS if (n, m) in med)
            print(f"{label:22s} {m:8s} {cells}", flush=True)
        print(f"  sdpa {'fwd' if window else 'fwd+bwd'} kernels: " + "; ".join(kern), flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(
            json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": report}, indent=1)
        )


if __name__ == "__main__":
    main()
