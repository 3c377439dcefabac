"""Decode against a KV cache on the GPU: our decode kernel against F.sdpa and flash-attn 4.

    python benchmarks/decode.py [--rows TEXT,...] [--timer events|kernel] [--json out.json] [--commit SHA]

For each row (bf16, d128 unless named): the K/V bytes each call must read (sum over sequences
of L_b x Hkv x D x 2 tensors x 2 bytes) divided by its time, in TB/s, for our kernels
(``ours``: kernels.decode.kv_forward, the triton backend's route, dense or paged; its route is
printed), the whole dispatcher (``ad_kv``: ad.sdpa_with_kvcache; ``ad_sdpa``: plain ad.sdpa on
the cache sliced to the common length, as transformers' DynamicCache calls it), F.sdpa on that
slice (PyTorch picks its kernel; GQA through enable_gqa), and flash-attn 4 where installed; plus
a copy of the same bytes (the bandwidth ceiling).  Rows with many queries (chunked prefill) also
give TFLOP/s (4 x allowed (query, key) pairs x D).  Append rows also print the append apart:
append_kv (one Triton launch) then the decode kernel without k_new, against its fused append.
Median of CUDA-event timed loops after a warm-up (``--timer kernel``: of the kernels' CUPTI durations over
the same bursts, no launch gaps or host time; perf-notes E148), every call of a row in turns whose order changes
each round (timed_in_turns).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.kernels.kv_append import append_kv  # noqa: E402
from attention_dispatch.kernels import KernelParams  # noqa: E402
from attention_dispatch.kernels.decode import kv_forward, kv_route  # noqa: E402
from benchmarks.turns import turn_order  # noqa: E402

# (label, B, Hq, Hkv, Sq, S_cache, page (0: dense), lengths ("full" or "uniform"), causal)
ROWS = [
    ("gqa B=64 Sk=4k", 64, 32, 8, 1, 4096, 0, "full", False),
    ("gqa B=8 Sk=32k", 8, 32, 8, 1, 32768, 0, "full", False),
    ("mha B=64 Sk=4k", 64, 32, 32, 1, 4096, 0, "full", False),
    ("mha B=8 Sk=32k", 8, 32, 32, 1, 32768, 0, "full", False),
    ("gqa B=64 Sk=4k paged16", 64, 32, 8, 1, 4096, 16, "full", False),
    ("gqa B=64 Sk=4k paged256", 64, 32, 8, 1, 4096, 256, "full", False),
    ("gqa B=64 uniform 1..32k", 64, 32, 8, 1, 32768, 0, "uniform", False),
    ("gqa B=64 Sk=4k append", 64, 32, 8, 1, 4096, 0, "append", False),
    ("gqa B=64 Sk=4k paged16 append", 64, 32, 8, 1, 4096, 16, "append", False),
    ("gqa B=4 Sq=512 8k causal", 4, 32, 8, 512, 8192 + 512, 0, "prefill", True),
    ("gqa B=8 Sq=128 16k causal", 8, 32, 8, 128, 16384 + 128, 0, "prefill", True),
    ("mha B=4 Sq=256 4k", 4, 32, 32, 256, 4096 + 256, 0, "prefill", False),
]
NAMES = ("ours", "ad_kv", "ad_sdpa", "sdpa", "fa4", "copy")


def loop_ms(fn, reps: int) -> float:
    """ms per call of one CUDA-event timed loop of ``reps`` back-to-back calls, from an idle GPU."""
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def timed(fn, reps: int = 20, rounds: int = 7) -> float:
    """Median ms per call over ``rounds`` loops of ``reps`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return statistics.median(loop_ms(fn, reps) for _ in range(rounds))


def kernel_ms(fn, reps: int = 15) -> float:
    """ms of GPU time a call: the summed durations of the kernels (and copies) ``reps`` calls ran, as CUPTI
    records them (torch.profiler), the burst started from an idle GPU."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    gpu = torch.autograd.DeviceType.CUDA
    return sum(e.device_time_total for e in prof.events() if e.device_type == gpu) / 1e3 / reps


# looked up at each call (tests replace them)
TIMERS = {"events": lambda fn, reps: loop_ms(fn, reps), "kernel": lambda fn, reps: kernel_ms(fn, reps)}


def timed_in_turns(fns: dict, row_id: str, reps: int = 20, rounds: int = 7, timer: str = "events") -> dict:
    """{name: median ms per call} of ``fns`` (name -> call), each round timing every call's loop of
    ``reps`` once (TIMERS[timer]), in a new order each round (turns.turn_order: a turn's speed follows the
    one before it, E32), so no implementation always runs first, last or after the same one."""
    names = list(fns)
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times = {n: [] for n in names}
    for rnd in range(rounds):
        for i in turn_order(len(names), row_id, rnd, seed=0):
            times[names[i]].append(TIMERS[timer](fns[names[i]], reps))
    return {n: statistics.median(t) for n, t in times.items()}


def fa4():
    try:
        from flash_attn.cute import flash_attn_func

        return flash_attn_func
    except Exception:  # noqa: BLE001 - not installed
        return None


def run_row(row, timer: str = "events") -> dict:
    label, B, Hq, Hkv, Sq, S, page, lengths, causal = row
    D, dt, dev = 128, torch.bfloat16, "cuda"
    gen = torch.Generator(device="cpu").manual_seed(0)
    if lengths == "uniform":
        lens = torch.randint(1, S + 1, (B,), generator=gen)
    elif lengths in ("prefill", "append"):
        lens = torch.full((B,), S - Sq)
    else:
        lens = torch.full((B,), S - (Sq if Sq > 1 else 0))
    n_new = Sq if lengths in ("prefill", "append") else 0
    # "append": k_new/v_new written into the cache by the call (the same keys each call)
    cache_seqlens = lens.int().to(dev)
    q = torch.randn(B, Hq, Sq, D, device=dev, dtype=dt)
    params = KernelParams(scale=D**-0.5, window_right=0 if causal else -1, align_bottom_right=True)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=dt)
    if lengths == "append":
        # the keys the cache already holds there: the result stays comparable with F.sdpa's
        new_kv = (k[:, :, S - Sq :].clone(), v[:, :, S - Sq :].clone())
        kernel_lens = (cache_seqlens,)
    else:
        new_kv, kernel_lens = (), (cache_seqlens + n_new,)
    keys = int(lens.sum()) + B * n_new
    nbytes = keys * Hkv * D * 2 * 2
    res = {"row": label, "bytes": nbytes}
    if page:
        blocks = B * (S // page)
        perm = torch.randperm(blocks, generator=gen)
        table = perm.reshape(B, S // page).int().to(dev)
        kp = torch.empty(blocks, page, Hkv, D, device=dev, dtype=dt)
        vp = torch.empty_like(kp)
        # the same keys, scattered over the pages
        kp[perm.to(dev)] = k.transpose(1, 2).reshape(blocks, page, Hkv, D)
        vp[perm.to(dev)] = v.transpose(1, 2).reshape(blocks, page, Hkv, D)
        ours = lambda: kv_forward(q, kp, vp, *kernel_lens, params, table, *new_kv)  # noqa: E731
        kv_args = (q, kp, vp, *kernel_lens)
        res["route"] = kv_route(q, kp, vp, table, params)[0]
    else:
        ours = lambda: kv_forward(q, k, v, *kernel_lens, params, None, *new_kv)  # noqa: E731
        kv_args = (q, k, v, *kernel_lens)
        res["route"] = kv_route(q, k, v, None, params)[0]
    table_kw = {"block_table": table} if page else {}
    new_kw = dict(zip(("k_new", "v_new"), new_kv))
    ad_kv = lambda: ad.sdpa_with_kvcache(*kv_args, causal=causal, **table_kw, **new_kw)  # noqa: E731
    fns = {"ours": ours, "ad_kv": ad_kv}
    with torch.no_grad():
        ad_kv()
    res["ad_kv_backend"] = ad.last_decision().backend
    if lengths == "append":
        # the append apart (append_kv: one Triton launch) against the decode kernel's fused one
        caches, tbl, longer = (kp, vp) if page else (k, v), table if page else None, cache_seqlens + n_new
        alone = lambda: append_kv(*caches, cache_seqlens, *new_kv, tbl)  # noqa: E731
        fns["append_alone"] = alone
        fns["apart"] = lambda: (alone(), kv_forward(q, *caches, longer, params, tbl))
    if lengths != "uniform":
        L = int(lens[0]) + n_new
        ks, vs = k[:, :, :L], v[:, :, :L]
        align = "bottom_right" if causal else None
        fns["ad_sdpa"] = lambda: ad.sdpa(q, ks, vs, causal=align, enable_gqa=Hq != Hkv)
        with torch.no_grad():
            fns["ad_sdpa"]()
        res["ad_sdpa_backend"] = str(ad.last_decision()).splitlines()[0]
        ref = lambda: F.scaled_dot_product_attention(q, ks, vs, enable_gqa=Hq != Hkv)  # noqa: E731
        if causal:
            mask = torch.ones(Sq, L, device=dev, dtype=torch.bool).tril(L - Sq)
            ref = lambda: F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, enable_gqa=Hq != Hkv)  # noqa: E731
        fns["sdpa"] = ref
        res["max_err_vs_sdpa"] = (ours().float() - ref().float()).abs().max().item()
        flash = fa4()
        if flash is not None and not page:
            qt, kt, vt = q.transpose(1, 2), ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()
            fns["fa4"] = lambda: flash(qt, kt, vt, causal=causal)
    src = torch.empty(nbytes // 2, device=dev, dtype=dt)
    dst = torch.empty_like(src)
    fns["copy"] = lambda: dst.copy_(src)
    # every call in turns, a new order each round: the clock follows the call before (E32, E147)
    for name, ms in timed_in_turns(fns, label, timer=timer).items():
        res[f"{name}_ms"] = ms
    res["copy_ms"] /= 2  # a copy reads and writes: half is the read time
    if Sq > 1:
        pairs = sum(Sq * (int(n) + n_new) - (Sq * (Sq - 1) // 2 if causal else 0) for n in lens)
        res["ours_tflops"] = 4 * pairs * Hq * D / res["ours_ms"] / 1e9
        if "fa4_ms" in res:
            res["fa4_tflops"] = res["ours_tflops"] * res["ours_ms"] / res["fa4_ms"]
    for name in NAMES:
        if f"{name}_ms" in res:
            res[f"{name}_tbs"] = nbytes / res[f"{name}_ms"] / 1e9
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="", help="comma-separated substrings of the row labels to run")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--doc", type=Path, default=None, help="write the Markdown report (docs/decode.md) here")
    p.add_argument("--timer", choices=tuple(TIMERS), default="events", help="events: CUDA-event loops; kernel: CUPTI")
    a = p.parse_args(argv)
    results = []
    for row in ROWS:
        if a.rows and not any(part in row[0] for part in a.rows.split(",")):
            continue
        r = run_row(row, a.timer)
        results.append(r)
        cells = "  ".join(f"{n} {r[f'{n}_tbs']:.2f}" for n in NAMES if f"{n}_tbs" in r)
        flops = "  ".join(f"{n} {r[f'{n}_tflops']:.0f}" for n in ("ours", "fa4") if f"{n}_tflops" in r)
        # rows with per-sequence lengths have no F.sdpa call to compare with
        err = f"{r['max_err_vs_sdpa']:.1e}" if "max_err_vs_sdpa" in r else "-"
        print(
            f"{r['row']:<28} TB/s: {cells}  err {err}  [{r['route']}]" + (f"  TFLOP/s: {flops}" if flops else ""),
            flush=True,
        )
        print(f"    ad_kv ran {r['ad_kv_backend']}; ad.sdpa: {r.get('ad_sdpa_backend', '-')}", flush=True)
        if "apart_ms" in r:
            print(
                f"    append apart: {r['bytes'] / r['apart_ms'] / 1e9:.2f} TB/s (append_kv alone "
                f"{1000 * r['append_alone_ms']:.1f} us, then the decode kernel without k_new)",
                flush=True,
            )
    if a.json:
        a.json.write_text(json.dumps({"commit": a.commit, "device": torch.cuda.get_device_name(), "rows": results}))
    table = markdown(results)
    print(table)
    if a.doc:
        a.doc.write_text(report(table, a.commit, a.timer))
    return 0


def _fa4_version() -> str:
    """', flash-attn X' of the flash-attn 4 the run measured, or '' where it is not installed."""
    from importlib import metadata

    try:
        return f", flash-attn {metadata.version('flash-attn-4')}"
    except metadata.PackageNotFoundError:
        return ""


def report(table: str, commit: str, timer: str = "events") -> str:
    """docs/decode.md: what was measured where, and the table."""
    import datetime

    import triton

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            "# Decode and KV-cache attention",
            "",
            f"Regenerated by `python benchmarks/decode.py --doc docs/decode.md` (do not edit by hand): {date}, "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}{_fa4_version()}, "
            f"commit {commit}.",
            "",
            "bf16, head dim 128. Cells: TB/s of K/V read (sum over sequences of L_b x Hkv x D x 2 tensors x 2 "
            "bytes, divided by the time); rows with many new queries also give TFLOP/s (4 x allowed (query, key) "
            "pairs x D). `ours`: the triton backend's kernels (route in brackets); `ad.sdpa_with_kvcache`: the "
            "whole dispatcher on the same call; `ad.sdpa` and `F.sdpa`: the dense cache sliced to the common "
            "length (paged rows: the dense cache); `copy`: the bandwidth ceiling. "
            + (
                "Median of the kernels' CUPTI durations (torch.profiler) over bursts of back-to-back calls from an "
                "idle GPU: no launch gaps or host time"
                if timer == "kernel"
                else "Median of CUDA-event timed loops of back-to-back calls"
            )
            + ", a row's calls in turns whose order changes each round.",
            "",
            table,
            "",
        ]
    )


def markdown(results) -> str:
    """The rows as docs/benchmarks.md's decode table (TB/s of K/V read; TFLOP/s of many-query rows)."""
    lines = [
        "| row | ours (route) | ad.sdpa_with_kvcache | ad.sdpa | F.sdpa | flash-attn 4 | copy | ours / best of F.sdpa, FA4 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cell = {n: f"{r[n + '_tbs']:.2f}" if n + "_tbs" in r else "-" for n in NAMES}
        rivals = [r[n + "_tbs"] for n in ("sdpa", "fa4") if n + "_tbs" in r]
        ratio = f"{r['ours_tbs'] / max(rivals):.2f}" if rivals else "-"
        ours = f"{cell['ours']} ({r['route']})"
        if "ours_tflops" in r:
            ours += f", {r['ours_tflops']:.0f} TFLOP/s" + (f" (FA4 {r['fa4_tflops']:.0f})" if "fa4_tflops" in r else "")
        lines.append(
            f"| {r['row']} | {ours} | {cell['ad_kv']} | {cell['ad_sdpa']} | {cell['sdpa']} | {cell['fa4']} | "
            f"{cell['copy']} | {ratio} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
