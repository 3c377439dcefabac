"""Issue 34's chunked-prefill rows timed on the device alone and from an idle GPU: the KV-cache Gluon
forward of the tree it runs from, the dispatcher, plain sdpa() and flash-attn 4 (GPU).

    python benchmarks/kv_device_ab.py [--rows TEXT,...] [--rounds 11] [--reps 10] [--json out.json] [--commit SHA]
    python benchmarks/kv_device_ab.py --across RUN.json [RUN.json ...]

A ratio read in one process can sit a few percent from another process's on the same GPU (E144: the
chunked-prefill row's sdpa_with_kvcache / flash-attn 4 ranged 0.963-0.990 over seven processes), so
the issue's rows are read over several: ``--across`` prints each row's device and idle ratios against
flash-attn 4 as the median (min-max) over the given runs' JSON files (gpu_session.sh kvprocs).

Per round, in an order that rotates, each implementation's ``reps`` back-to-back calls are timed
twice: "device", queued behind a spin kernel (torch.cuda._sleep) that outlasts the host's queueing of
all of them, so the CUDA events time the kernels alone; "idle", from an idle GPU as kv_ab.py and
decode.py time, where the first call's host time before its launch adds 1/reps of itself to every
call (flash-attn 4's public call spends ~130 us there, ours 20-150 us: E107).  Implementations:

- ``ours``: kernels.decode.kv_forward (LENS_TENSOR) as this tree builds it;
- ``ad-kv``: ad.sdpa_with_kvcache (the dispatcher; a hit relaunches CacheRunner's captured launch);
- ``sdpa``: ad.sdpa over the cache, the dispatcher's choice (the line after the row names it);
- ``triton``: the same call with backend="triton" (causal rows: the cache forward with lengths 0 and Sk
  new keys, entry.GLUON_LENGTHS; not causal: the dense Gluon forward, whose loop has no causal split: against
  ``ours``, the cache path's loop on one call);
- ``fa4``: flash_attn.cute.flash_attn_func on (B, S, H, D) copies, where installed.

A kernel change is A/B-timed by running this script in this tree and in a patched scratch copy in
turns (gpu_session.sh e115) and comparing ``ours``'s device medians; flash-attn 4's column, timed in
each turn, shows how much the turns' GPU state moved.  Prints per row the median TFLOP/s on the
device and from idle, the medians of the per-round device and idle ratios against flash-attn 4 (its
time over ours: > 1, faster), each one's host microseconds before its kernels ((idle - device) x
reps), and ours's agreement with F.scaled_dot_product_attention.  The "uneven" row (cache lengths
spread over the capacity) has no flash-attn 4 column.  docs/experiments/perf-notes.md, E107 (the
timing), E111, E115.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.kernels import KernelParams  # noqa: E402
from attention_dispatch.kernels.decode import kv_forward, kv_route  # noqa: E402
from benchmarks.decode import fa4  # noqa: E402
from benchmarks.forward_ab import finish_run  # noqa: E402

IMPLS = ("ours", "ad-kv", "sdpa", "triton", "fa4")
# (label, B, Hq, Hkv, Sq, capacity, causal, lengths: None = every sequence the whole cache)
ROWS = [
    ("gqa B=4 Sq=512 8k causal", 4, 32, 8, 512, 8192 + 512, True, None),
    ("gqa B=8 Sq=128 16k causal", 8, 32, 8, 128, 16384 + 128, True, None),
    ("mha B=4 Sq=256 4k", 4, 32, 32, 256, 4096 + 256, False, None),
    ("gqa B=4 Sq=512 8k causal uneven", 4, 32, 8, 512, 8192 + 512, True, (8704, 6100, 3300, 900)),
]
# --extra: where the chunked-prefill gap to flash-attn 4 comes from. 4096 programs (31 waves on 132 SMs) leave no
# wave floor; no diagonal step; no kv head shared by 4 query heads; one square causal call through the cache path
EXTRA_ROWS = [
    ("gqa B=32 Sq=512 8k causal", 32, 32, 8, 512, 8192 + 512, True, None),
    ("gqa B=4 Sq=512 8k", 4, 32, 8, 512, 8192 + 512, False, None),
    ("mha B=4 Sq=512 8k causal", 4, 32, 32, 512, 8192 + 512, True, None),
    ("gqa B=2 Sq=8k 8k causal", 2, 32, 8, 8192, 8192, True, None),
]
# --program-cost: the same 32,768 key-tile steps (GQA 32/8, not causal) as 8,192 programs of 4 tiles down to 256
# of 128: a cost each program pays beyond its steps shows as a gap to flash-attn 4 growing as 1 / tiles (E142)
PROGRAM_COST_ROWS = [
    ("gqa B=64 Sq=512 over 512", 64, 32, 8, 512, 512, False, None),
    ("gqa B=16 Sq=512 over 2k", 16, 32, 8, 512, 2048, False, None),
    ("gqa B=4 Sq=512 over 8k", 4, 32, 8, 512, 8192, False, None),
    ("gqa B=2 Sq=256 over 16k", 2, 32, 8, 256, 16384, False, None),
]
SPIN_HZ = 2.0e9  # cycles a second torch.cuda._sleep counts, about (H100 boost: 1.98 GHz)


def per_call_ms(fn, reps: int, spin_ms: float) -> tuple[float, float]:
    """(ms a call from the CUDA events, ms of host time a call) over ``reps`` calls; ``spin_ms`` > 0
    queues them behind a spin of that long first (0: from an idle GPU)."""
    torch.cuda.synchronize()
    if spin_ms:
        torch.cuda._sleep(int(spin_ms * 1e-3 * SPIN_HZ))
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, host


def row_inputs(row):
    """A row's bf16 d128 CUDA inputs and work: (q, k, v, lens int32 (B,), forward FLOPs: 4 x Hq x D x the
    allowed (query, key) pairs, each sequence's queries bottom-right against its length when causal)."""
    _, B, Hq, Hkv, Sq, S, causal, lengths = row
    D, dt, dev = 128, torch.bfloat16, "cuda"
    q = torch.randn(B, Hq, Sq, D, device=dev, dtype=dt)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=dt)
    lens_list = list(lengths or [S] * B)
    lens = torch.tensor(lens_list, dtype=torch.int32, device=dev)
    pairs = sum(Sq * n - (Sq * (Sq - 1) // 2 if causal else 0) for n in lens_list)
    return q, k, v, lens, 4 * pairs * Hq * D


def run_row(row, rounds: int, reps: int) -> dict:
    label, B, Hq, Hkv, Sq, S, causal, lengths = row
    D, dev = 128, "cuda"
    q, k, v, lens, flops = row_inputs(row)
    lens_list = lens.tolist()
    params = KernelParams(scale=D**-0.5, window_right=0 if causal else -1, align_bottom_right=True)

    fns = {"ours": lambda: kv_forward(q, k, v, lens, params, None)}
    fns["ad-kv"] = lambda: ad.sdpa_with_kvcache(q, k, v, lens, causal=causal)
    flash = fa4()
    if lengths is None:  # the same keys as a dense call
        dense = dict(causal="bottom_right" if causal else False, enable_gqa=Hq != Hkv)
        fns["sdpa"] = lambda: ad.sdpa(q, k, v, **dense)
        fns["triton"] = lambda: ad.sdpa(q, k, v, **dense, backend="triton")
        if flash is not None:
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            fns["fa4"] = lambda: flash(qt, kt, vt, causal=causal)
    with torch.no_grad():
        ours = fns["ours"]()
    with torch.no_grad():
        ad.sdpa_with_kvcache(q, k, v, lens, causal=causal)
    backend = ad.last_decision().backend
    sdpa_backend = "-"
    if "sdpa" in fns:
        with torch.no_grad():
            fns["sdpa"]()
        sdpa_backend = ad.last_decision().backend
    ref = torch.empty_like(q)
    for b, n in enumerate(lens_list):
        mask = torch.ones(Sq, n, device=dev, dtype=torch.bool).tril(n - Sq) if causal else None
        ref[b] = F.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], attn_mask=mask, enable_gqa=Hq != Hkv
        )[0]
    names = [n for n in IMPLS if n in fns]
    # each one's host time a call, queued behind a long spin: the device spin of its timed loops
    spin = {}
    for n in names:
        for _ in range(3):
            fns[n]()
        _, host = per_call_ms(fns[n], reps, 50.0)
        spin[n] = max(1.0, 2.0 * host * reps)
    dev_ms, idle_ms, host_ms, short = ({n: [] for n in names} for _ in range(4))
    for rnd in range(rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for n in order:
            t, host = per_call_ms(fns[n], reps, spin[n])
            dev_ms[n].append(t)
            host_ms[n].append(host)
            short[n].append(host * reps > spin[n])  # the queue drained: a host-bound sample
            idle_ms[n].append(per_call_ms(fns[n], reps, 0.0)[0])
    med = statistics.median

    def ratios(times, against):
        return {n: med(a / t for a, t in zip(times[against], times[n])) for n in names if n != against}

    tflops = {n: (flops / med(dev_ms[n]) / 1e9, flops / med(idle_ms[n]) / 1e9) for n in names}
    return dict(
        row=label,
        tflops_device={n: t[0] for n, t in tflops.items()},
        tflops_idle={n: t[1] for n, t in tflops.items()},
        device_vs_fa4=ratios(dev_ms, "fa4") if "fa4" in fns else {},
        idle_vs_fa4=ratios(idle_ms, "fa4") if "fa4" in fns else {},
        pre_launch_us={n: 1e3 * reps * (med(idle_ms[n]) - med(dev_ms[n])) for n in names},
        host_us={n: 1e3 * med(host_ms[n]) for n in names},
        host_bound_samples={n: sum(short[n]) for n in names},
        dev_ms=dev_ms,
        idle_ms=idle_ms,
        ad_kv_backend=backend,
        sdpa_backend=sdpa_backend,
        route=kv_route(q, k, v, None, params)[0],
        max_ours_vs_sdpa=(ours.float() - ref.float()).abs().max().item(),
    )


def across(runs: list[dict]) -> dict:
    """{row: {"device" / "idle": {impl: (median, min, max)}}} of the ratios against flash-attn 4
    over ``runs`` (each a --json file's content), rows and implementations in first-seen order."""
    seen: dict = {}
    for run in runs:
        for r in run["results"]:
            for mode in ("device", "idle"):
                for n, x in r[f"{mode}_vs_fa4"].items():
                    seen.setdefault(r["row"], {}).setdefault(mode, {}).setdefault(n, []).append(x)
    return {
        row: {
            mode: {n: (statistics.median(xs), min(xs), max(xs)) for n, xs in impls.items()}
            for mode, impls in by.items()
        }
        for row, by in seen.items()
    }


def print_across(paths: list[Path]) -> None:
    runs = [json.loads(path.read_text()) for path in paths]
    for row, by in across(runs).items():
        for mode, impls in by.items():
            cells = " ".join(f"{n} {m:.3f} ({lo:.3f}-{hi:.3f})" for n, (m, lo, hi) in impls.items())
            print(f"{row:<32} vs fa4 {mode:<6} over {len(runs)} runs: {cells}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--across", type=Path, nargs="+", default=None, help="summarise these runs' JSON files only")
    p.add_argument("--rows", default="", help="comma-separated substrings of the row labels")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--extra", action="store_true", help="also the diagnostic rows (EXTRA_ROWS)")
    p.add_argument("--program-cost", action="store_true", help="also PROGRAM_COST_ROWS (tiles per program varied)")
    a = p.parse_args(argv)
    if a.across:
        print_across(a.across)
        return 0
    results = []
    for row in ROWS + (EXTRA_ROWS if a.extra else []) + (PROGRAM_COST_ROWS if a.program_cost else []):
        if a.rows and not any(part in row[0] for part in a.rows.split(",")):
            continue
        r = run_row(row, a.rounds, a.reps)
        results.append(r)
        print(
            f"{r['row']:<32} TFLOP/s device / idle "
            + " ".join(f"{n} {r['tflops_device'][n]:.0f}/{r['tflops_idle'][n]:.0f}" for n in r["tflops_device"]),
            flush=True,
        )
        if r["device_vs_fa4"]:
            print(
                "    vs fa4 device "
                + " ".join(f"{n} {x:.3f}" for n, x in r["device_vs_fa4"].items())
                + " | idle "
                + " ".join(f"{n} {x:.3f}" for n, x in r["idle_vs_fa4"].items()),
                flush=True,
            )
        print(
            "    host us a call (before its kernels, from idle): "
            + " ".join(f"{n} {r['host_us'][n]:.0f} ({r['pre_launch_us'][n]:.0f})" for n in r["host_us"])
            + f"  host-bound samples {sum(r['host_bound_samples'].values())}"
            + f"  |ours-F.sdpa| {r['max_ours_vs_sdpa']:.1e}"
            + f"  [{r['route']}; ad-kv ran {r['ad_kv_backend']}, sdpa {r['sdpa_backend']}]",
            flush=True,
        )
    finish_run(a, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
