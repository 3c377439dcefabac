"""One process, two trees: this tree's forward kernels (A) against another tree's (B), timed in
alternating pairs so that the GPU's drift cancels in each pair's ratio (GPU).

    python benchmarks/kernel_ab.py --b DIR [--b DIR2 ...] [--cases kv,fwd] [--rows TEXT,...] [--rounds 31]
        [--reps 10] [--timer b2b|kernel] [--json out.json] [--commit SHA]

Each ``DIR`` holds another tree (e.g. gpu_session.sh's scratch copy with a patch applied); its
``attention_dispatch`` is copied into a temporary folder as the package ``attention_dispatch_b<i>``
and imported beside this one, so every tree's kernels compile and run in this process (B1, B2, ...:
several patches against A in one call).  Only kernel entry points
are called (``kernels.decode.kv_forward``, ``kernels.entry.attention_forward`` and ``attention_backward``):
no autograd and no custom op, which a second copy could not register.  Cases:

- ``kv``: kv_device_ab.py's rows (the chunked-prefill rows of issue 34) through ``kv_forward`` with a
  lengths tensor (the Gluon cache forward); ``program-cost``: its PROGRAM_COST_ROWS the same way (one
  amount of work as programs of 4 to 128 key tiles);
- ``one-length``: the kv rows' causal calls with every cache full as plain dense calls through
  ``entry.attention_forward`` (bottom-right, Sq < Sk: entry.GLUON_LENGTHS);
- ``fwd``: features.py's forward (bf16 B=4 H=16 S=4096 d128), plain and softcap 30, dense and causal
  (issue 36's rows); ``bwd``: the same calls' backward (``entry.attention_backward`` from A's forward
  output and logsumexp, so every tree differentiates the same numbers; max |A - B| over dQ, dK, dV).

Per round A and each B run in turns (the order rotates), each ``reps`` calls on the device alone
(queued behind a spin, kv_device_ab.per_call_ms); the round's ratio is A's time over B's (> 1: B is
faster).  ``--timer kernel`` reads the kernels' CUPTI durations of the ``reps`` calls instead
(decode.kernel_ms; E148: turns within +-0.3-1% where back-to-back ones spread up to 18% on an H200
at its power limit).  Prints per row and B both TFLOP/s, the median ratio with its quartiles, and max
|A - B| of the outputs.  Separate processes in turns (gpu_session.sh patchab) drift by +-3% between turns on the
H200 (perf-notes E142), more than the 1-2% a kernel change is after; pairs inside one process do not
share that drift.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from attention_dispatch.kernels import decode as decode_a  # noqa: E402
from attention_dispatch.kernels import entry as entry_a  # noqa: E402
from attention_dispatch.kernels import params as params_a  # noqa: E402
from benchmarks.forward_ab import finish_run  # noqa: E402
from benchmarks.kv_device_ab import EXTRA_ROWS, PROGRAM_COST_ROWS, ROWS as KV_ROWS  # noqa: E402
from benchmarks.decode import kernel_ms  # noqa: E402
from benchmarks.kv_device_ab import per_call_ms, row_inputs  # noqa: E402

SOFTCAP = 30.0
# (label, causal, softcap): features.py's geometry
FWD_ROWS = [
    ("fwd plain", False, 0.0),
    ("fwd softcap", False, SOFTCAP),
    ("fwd causal plain", True, 0.0),
    ("fwd causal softcap", True, SOFTCAP),
]
FWD_SHAPE = (4, 16, 4096, 128)  # B, H, S, D


def load_other(tree: Path, package: str = "attention_dispatch_b"):
    """(decode, entry, params) modules of ``tree``'s attention_dispatch, imported as ``package``."""
    src = tree / "attention_dispatch"
    if not src.is_dir():
        raise SystemExit(f"--b: {tree} has no attention_dispatch folder")
    tmp = Path(tempfile.mkdtemp(prefix="kernel_ab_"))
    shutil.copytree(src, tmp / package, ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(tmp))
    return tuple(importlib.import_module(f"{package}.kernels.{m}") for m in ("decode", "entry", "params"))


def row_params(params, head_d: int, causal: bool, softcap: float = 0.0):
    """A dense row's ``params.KernelParams`` (``params``: a tree's kernels.params module): bottom-right when causal."""
    return params.KernelParams(
        scale=head_d**-0.5, window_right=0 if causal else -1, align_bottom_right=True, softcap=softcap
    )


def fwd_flops(shape, causal: bool) -> float:
    """features.py's count of a (B, H, S, D) forward: 4 B H S^2 D, causal half the square (the backward's five
    products 2.5 times it, training 3.5 times)."""
    B, H, S, D = shape
    return 4 * B * H * S * S * D / (2 if causal else 1)


def dense_calls(sides, q, k, v, causal: bool, softcap: float = 0.0) -> dict:
    """Each side's ``entry.attention_forward`` on q, k, v (bottom-right when causal), inference."""
    calls = {}
    for name, (_, entry, params) in sides.items():
        p = row_params(params, q.shape[-1], causal, softcap)
        calls[name] = lambda entry=entry, p=p: entry.attention_forward(q, k, v, None, p, need_lse=False)[0]
    return calls


def kv_calls(row, sides):
    causal = row[6]
    q, k, v, lens, flops = row_inputs(row)
    calls = {}
    for name, (decode, _, params) in sides.items():
        p = params.KernelParams(scale=q.shape[-1] ** -0.5, window_right=0 if causal else -1, align_bottom_right=True)
        calls[name] = lambda decode=decode, p=p: decode.kv_forward(q, k, v, lens, p, None)
    return row[0], calls, flops


def one_length_calls(row, sides):
    q, k, v, _, flops = row_inputs(row)
    return row[0] + " dense", dense_calls(sides, q, k, v, causal=True), flops


def fwd_calls(row, sides):
    label, causal, softcap = row
    B, H, S, D = FWD_SHAPE
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return label, dense_calls(sides, q, k, v, causal, softcap), fwd_flops(FWD_SHAPE, causal)


def bwd_calls(row, sides):
    """``fwd_calls``' row as each side's backward (dQ, dK, dV) of A's forward."""
    label, causal, softcap = row
    B, H, S, D = FWD_SHAPE
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    calls = {}
    for name, (_, entry, params) in sides.items():
        p = row_params(params, D, causal, softcap)
        if name == "A":
            out, lse, seed = entry.attention_forward(q, k, v, None, p)
        calls[name] = lambda entry=entry, p=p: entry.attention_backward(do, q, k, v, None, out, lse, seed, p)[:3]
    return label.replace("fwd", "bwd", 1), calls, 2.5 * fwd_flops(FWD_SHAPE, causal)


def _max_abs_diff(a, b) -> float:
    """max |a - b| of two outputs, tensors or tuples of them."""
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return max((x.float() - y.float()).abs().max().item() for x, y in pairs)


# timer(call, reps, spin_ms) -> (ms a call, host ms a call); the kernel way needs no spin and reads no host time
TIMERS = {"b2b": per_call_ms, "kernel": lambda fn, reps, spin_ms: (kernel_ms(fn, reps), 0.0)}


def run_row(label, calls, flops, rounds: int, reps: int, timer=per_call_ms) -> dict:
    """Each B against A (``calls``: name -> call, "A" first) over ``rounds`` rotating turns;
    ``timer(call, reps, spin_ms)`` -> (ms a call, host ms a call)."""
    names = list(calls)
    others = names[1:]
    with torch.no_grad():
        out = {n: fn() for n, fn in calls.items()}
        diff = {n: _max_abs_diff(out["A"], out[n]) for n in others}
        spin = {}
        for n, fn in calls.items():
            for _ in range(3):
                fn()
            _, host = timer(fn, reps, 50.0)
            spin[n] = max(1.0, 2.0 * host * reps)
        times = {n: [] for n in calls}
        for rnd in range(rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for n in order[::-1] if rnd % 2 else order:
                times[n].append(timer(calls[n], reps, spin[n])[0])
    speedup = {}
    for n in others:
        ratios = sorted(a / b for a, b in zip(times["A"], times[n]))
        q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        speedup[n] = dict(median=med, q1=q1, q3=q3)
    return dict(
        row=label,
        tflops={n: flops / statistics.median(t) / 1e9 for n, t in times.items()},
        b_speedup=speedup,
        max_abs_diff=diff,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--b", type=Path, action="append", required=True, help="another tree (a folder holding attention_dispatch)"
    )
    p.add_argument("--cases", default="kv,fwd", help="comma-separated: kv, program-cost, one-length, fwd, bwd")
    p.add_argument("--rows", default="", help="comma-separated substrings of the row labels")
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--timer",
        choices=("b2b", "kernel"),
        default="b2b",
        help="b2b: reps calls behind a spin (per_call_ms); kernel: their CUPTI kernel durations (kernel_ms)",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--commit", default="unknown")
    a = p.parse_args(argv)
    sides = {"A": (decode_a, entry_a, params_a)}
    for i, tree in enumerate(a.b, 1):
        sides[f"B{i}"] = load_other(tree, f"attention_dispatch_b{i}")
        print(f"B{i}: {tree}", flush=True)
    cases = set(a.cases.split(","))
    rows = (
        ([(kv_calls, r) for r in KV_ROWS] if "kv" in cases else [])
        + ([(kv_calls, r) for r in PROGRAM_COST_ROWS] if "program-cost" in cases else [])
        + (
            [(one_length_calls, r) for r in KV_ROWS + EXTRA_ROWS if r[6] and r[7] is None]
            if "one-length" in cases
            else []
        )
        + ([(fwd_calls, r) for r in FWD_ROWS] if "fwd" in cases else [])
        + ([(bwd_calls, r) for r in FWD_ROWS] if "bwd" in cases else [])
    )
    results = []
    for build, row in rows:
        if a.rows and not any(part in row[0] for part in a.rows.split(",")):
            continue
        r = run_row(*build(row, sides), a.rounds, a.reps, TIMERS[a.timer])
        results.append(r)
        for n, s in r["b_speedup"].items():
            print(
                f"{r['row']:<34} {n:<3} TFLOP/s A {r['tflops']['A']:.0f}  {n} {r['tflops'][n]:.0f}  "
                f"A/{n} time {s['median']:.4f} (quartiles {s['q1']:.4f}-{s['q3']:.4f})  "
                f"max|A-{n}| {r['max_abs_diff'][n]:.1e}",
                flush=True,
            )
    finish_run(a, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
