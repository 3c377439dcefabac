"""The KV-cache Gluon forward against another tree's and flash-attn 4, in interleaved rounds (GPU).

    python benchmarks/kv_ab.py --base-module DIR [--rows TEXT,...] [--rounds 15] [--json out.json] [--commit SHA]

For benchmarks/decode.py's chunked-prefill rows (many new queries over a dense cache): per round, in
an order that rotates, kernels.decode.kv_forward with this tree's kernels ("ours", the LENS_TENSOR
mode sdpa_with_kvcache's triton route runs), the same with DIR's Gluon forward swapped into
gluon.launch.KERNELS ("base": benchmarks/forward_ab.load_base, e.g. main's kernels beside a patched
scratch copy), ad.sdpa_with_kvcache ("ad-kv": the dispatcher's choice, its backend printed), this
tree's kernels on the cache as a dense call ("slice": kernels.triton_attention, which for causal
rows launches the cache forward with lengths 0 and Sk new keys) and flash-attn 4 on it ("fa4", where
installed).  Prints median TFLOP/s, the medians of the per-round speed ratios ours / each (its time over ours: > 1, ours
faster), and the largest |ours - base| and |ours - F.sdpa|.
docs/experiments/perf-notes.md, E101.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.kernels import KernelParams, triton_attention  # noqa: E402
from attention_dispatch.kernels.decode import kv_forward, kv_route  # noqa: E402
from attention_dispatch.kernels.gluon import launch as gluon_launch  # noqa: E402
from benchmarks.decode import ROWS, fa4, timed  # noqa: E402
from benchmarks.forward_ab import finish_run, load_base  # noqa: E402

IMPLS = ("ours", "base", "ad-kv", "slice", "fa4")


def prefill_rows(select: str):
    """decode.ROWS' dense rows with many new queries whose labels contain one of ``select``'s parts."""
    for row in ROWS:
        label, _, _, _, sq, _, page, lengths, _ = row
        if sq > 1 and not page and lengths == "prefill" and (not select or any(p in label for p in select.split(","))):
            yield row


def run_row(row, base_fwd, rounds: int) -> dict:
    label, B, Hq, Hkv, Sq, S, _, _, causal = row
    D, dt, dev = 128, torch.bfloat16, "cuda"
    L = S  # each sequence's keys: the cache holds S - Sq, the chunk's Sq keys already appended
    q = torch.randn(B, Hq, Sq, D, device=dev, dtype=dt)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    params = KernelParams(scale=D**-0.5, window_right=0 if causal else -1, align_bottom_right=True)
    shipped = gluon_launch.KERNELS["fwd_ws"]

    def with_kernel(kernel):
        def call():
            gluon_launch.KERNELS["fwd_ws"] = kernel
            try:
                return kv_forward(q, k, v, lens, params, None)
            finally:
                gluon_launch.KERNELS["fwd_ws"] = shipped

        return call

    fns = {"ours": with_kernel(shipped), "base": with_kernel(base_fwd)}
    fns["ad-kv"] = lambda: ad.sdpa_with_kvcache(q, k, v, lens, causal=causal)
    fns["slice"] = lambda: triton_attention(q, k, v, None, params)
    flash = fa4()
    if flash is not None:
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        fns["fa4"] = lambda: flash(qt, kt, vt, causal=causal)
    with torch.no_grad():
        outs = {name: fns[name]() for name in ("ours", "base", "slice", "ad-kv")}
    backend = ad.last_decision().backend
    mask = torch.ones(Sq, L, device=dev, dtype=torch.bool).tril(L - Sq) if causal else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hq != Hkv)
    pairs = B * (Sq * L - (Sq * (Sq - 1) // 2 if causal else 0))
    flops = 4 * pairs * Hq * D
    names = [n for n in IMPLS if n in fns]
    ms = {n: [] for n in names}
    for rnd in range(rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for n in order:
            ms[n].append(timed(fns[n], reps=10, rounds=3))
    tflops = {n: statistics.median(flops / t / 1e9 for t in ms[n]) for n in names}
    ratio = {f"ours/{n}": statistics.median(b / a for a, b in zip(ms["ours"], ms[n])) for n in names if n != "ours"}
    return dict(
        row=label,
        tflops=tflops,
        ratios=ratio,
        ms=ms,
        ad_kv_backend=backend,
        route=kv_route(q, k, v, None, params)[0],
        max_ours_vs_base=(outs["ours"].float() - outs["base"].float()).abs().max().item(),
        max_ours_vs_sdpa=(outs["ours"].float() - ref.float()).abs().max().item(),
        max_slice_vs_sdpa=(outs["slice"].float() - ref.float()).abs().max().item(),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-module", type=Path, required=True, help="another copy of the kernels/gluon package")
    p.add_argument("--rows", default="", help="comma-separated substrings of decode.py's row labels")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--commit", default="unknown")
    a = p.parse_args(argv)
    base_fwd = load_base(a.base_module)["fwd_ws"]
    results = []
    for row in prefill_rows(a.rows):
        r = run_row(row, base_fwd, a.rounds)
        results.append(r)
        print(
            f"{r['row']:<28} TFLOP/s "
            + " ".join(f"{n} {t:.0f}" for n, t in r["tflops"].items())
            + "  speed "
            + " ".join(f"{n} {x:.3f}" for n, x in r["ratios"].items())
            + f"  |ours-base| {r['max_ours_vs_base']:.1e} |ours-F.sdpa| {r['max_ours_vs_sdpa']:.1e}"
            + f"  [{r['route']}; ad-kv ran {r['ad_kv_backend']}]",
            flush=True,
        )
    finish_run(a, results, against=str(a.base_module), base=str(a.base_module))
    return 0


if __name__ == "__main__":
    sys.exit(main())
