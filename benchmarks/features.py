"""Issue 36's features against the plain call, same run (GPU): softcap, ALiBi, sinks and a
logsumexp gradient at bf16 d128 (default S=4k), forward and forward+backward.

    python benchmarks/features.py [--seq 4096] [--batch 4] [--heads 16] [--causal] [--rounds 3]
        [--budget 150] [--timer do_bench|kernel]

Variants, each through ``triton_attention`` (the kernels' autograd function): "plain" as shipped
(the Gluon kernels where they serve), "plain-tl" with the Gluon kernels off (gluon.route.WS_MIN_WORK
raised), "softcap" (30.0, as shipped: the GPU's tanh.approx), "softcap-exact" (tl/launch.TANH_APPROX_DTYPES
emptied: the tl kernels' exact tanh; the Gluon kernels keep tanh.approx), "softcap-large" (softcap with q
times LARGE_Q: logits past the Gluon forward's tanh polynomial in every warp, perf-notes E129), "alibi" (slopes (B, Hq)),
"sinks" (requiring grad) and "lse-grad" (the loss reads the returned logsumexp too); flash-attn 4
beside them where it is installed: "fa4", "fa4-softcap", "fa4-sinks" (its ``learnable_sink``), their
ratios to "fa4".  Rounds are interleaved, their order turned each round; each prints the median milliseconds,
the ratio to "plain" (FA4's to "fa4") and, where it ran, to "plain-tl", then the median (min-max) of each
round's own ratio to "plain" ("paired").
Also prints the softcap's error against float64 with each tanh (S=512), beside bf16's own.
Timer: triton.testing.do_bench (default), or ``kernel``: the GPU time of the kernels a call runs, CUPTI
durations over a burst of 10 calls from an idle GPU (decode.kernel_ms; steadier on a GPU at its power
limit, perf-notes E148).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from attention_dispatch.kernels import KernelParams, triton_attention  # noqa: E402
from attention_dispatch.kernels.gluon import route as gluon_route  # noqa: E402
from attention_dispatch.kernels.tl import launch as tl_launch  # noqa: E402
from benchmarks.decode import kernel_ms  # noqa: E402

VARIANTS = ("plain", "plain-tl", "softcap", "softcap-exact", "softcap-large", "alibi", "sinks", "lse-grad")
# softcap-large's q scale: randn logits x 16, so a warp's 512 scores of a pack (E129) all stay within the
# polynomial's 0.75 x SOFTCAP = 22.5 with probability P(|z| < 1.4)^512 ~ 1e-39, at x 8 with ~8%
LARGE_Q = 16.0
FA4_VARIANTS = ("fa4", "fa4-softcap", "fa4-sinks")
SOFTCAP = 30.0


@contextlib.contextmanager
def variant_setting(name: str):
    saved = (gluon_route.WS_MIN_WORK, tl_launch.TANH_APPROX_DTYPES)
    if name == "plain-tl":
        gluon_route.WS_MIN_WORK = 1 << 62
    if name == "softcap-exact":
        tl_launch.TANH_APPROX_DTYPES = ()
    try:
        yield
    finally:
        gluon_route.WS_MIN_WORK, tl_launch.TANH_APPROX_DTYPES = saved


def fa4_call(name: str, q, k, v, causal: bool, backward: bool):
    """flash-attn 4's flash_attn_func on the same inputs in its (B, S, H, D) layout."""
    from flash_attn.cute import flash_attn_func

    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    kwargs = {"causal": causal}
    if name == "fa4-softcap":
        kwargs["softcap"] = SOFTCAP
    sinks = torch.randn(q.shape[1], device=q.device, requires_grad=True) if name == "fa4-sinks" else None
    if sinks is not None:
        kwargs["learnable_sink"] = sinks
    leaves = [qt, kt, vt] + ([sinks] if sinks is not None else [])
    do = torch.randn_like(qt)

    def run():
        out = flash_attn_func(qt, kt, vt, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def fwd():
        with torch.no_grad():
            return run()

    def train():
        torch.autograd.grad((run() * do).sum(), leaves)

    return train if backward else fwd


def fa4_installed() -> bool:
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed or broken: its rows are left out
        return False
    return True


def make_call(name: str, q, k, v, causal: bool, backward: bool):
    if name.startswith("fa4"):
        return fa4_call(name, q, k, v, causal, backward)
    b, h = q.shape[:2]
    params = KernelParams(
        scale=q.shape[-1] ** -0.5,
        align_bottom_right=True,
        window_right=0 if causal else -1,
        softcap=SOFTCAP if name.startswith("softcap") else 0.0,
    )
    slopes = torch.rand(b, h, device=q.device) * 0.1 if name == "alibi" else None
    sinks = torch.randn(h, device=q.device, requires_grad=True) if name == "sinks" else None
    need_lse = name == "lse-grad"
    if name == "softcap-large":
        q = (q.detach() * LARGE_Q).requires_grad_()
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            return triton_attention(q, k, v, None, params, alibi_slopes=slopes, sinks=sinks, return_lse=need_lse)

    def train():
        out, lse = triton_attention(q, k, v, None, params, alibi_slopes=slopes, sinks=sinks, return_lse=True)
        loss = (out * do).sum() + (lse.sum() if need_lse else 0.0)
        torch.autograd.grad(loss, leaves)

    return train if backward else fwd


def softcap_errors(dtype=torch.bfloat16, s=512):
    """max |out - float64| of the exact and the approximate tanh, and of bf16 math (the budget's base)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from naive import naive_attention

    q, k, v = (torch.randn(2, 4, s, 128, device="cuda", dtype=dtype) for _ in range(3))
    params = KernelParams(scale=128**-0.5, softcap=SOFTCAP / 6, align_bottom_right=True)
    # the reference builds its masks on the CPU: it runs there
    ref = naive_attention(*(t.cpu().double() for t in (q, k, v)), softcap=SOFTCAP / 6)
    low = naive_attention(*(t.cpu() for t in (q, k, v)), softcap=SOFTCAP / 6)
    errs = {"bf16 math": (low.double() - ref).abs().max().item()}
    for name in ("softcap", "softcap-exact"):
        with variant_setting(name):
            errs[name] = (triton_attention(q, k, v, None, params).cpu().double() - ref).abs().max().item()
    return errs


def paired_ratios(times: list, base_times: list) -> tuple:
    """(min, median, max) of each round's time over its base's time in the same round: the drift between
    rounds (the GPU's clocks at its power limit) cancels within a round."""
    ratios = sorted(t / b for t, b in zip(times, base_times))
    return ratios[0], statistics.median(ratios), ratios[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds: stop starting rounds past it")
    ap.add_argument("--timer", choices=("do_bench", "kernel"), default="do_bench")
    every = VARIANTS + FA4_VARIANTS
    ap.add_argument("--variants", default=",".join(every), help="comma-separated, from: " + ", ".join(every))
    args = ap.parse_args(argv)
    start = time.time()
    variants = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(variants) - set(every))
    if "plain" not in variants or unknown:
        ap.error(f"--variants must include 'plain' and name only {', '.join(every)}; got {args.variants!r}")
    if any(n.startswith("fa4") for n in variants):
        if fa4_installed():
            variants += [] if "fa4" in variants else ["fa4"]
        else:
            print("flash-attn 4 not installed: its variants left out", flush=True)
            variants = [n for n in variants if not n.startswith("fa4")]
    if "softcap-exact" in variants:
        print(torch.cuda.get_device_name(), "softcap errors:", softcap_errors(), flush=True)
    shape = (args.batch, args.heads, args.seq, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flops = 4 * args.batch * args.heads * args.seq * args.seq * 128 / (2 if args.causal else 1)
    times = {(n, mode): [] for n in variants for mode in ("fwd", "fwd+bwd")}
    for r in range(args.rounds):
        if r and time.time() - start > args.budget:
            print(f"budget reached after {r} rounds", flush=True)
            break
        for mode in ("fwd", "fwd+bwd"):
            # the order turns each round: a variant timed always after the others would always meet a warmer GPU
            for name in variants[r % len(variants) :] + variants[: r % len(variants)]:
                with variant_setting(name):
                    fn = make_call(name, q, k, v, args.causal, mode == "fwd+bwd")
                    if args.timer == "kernel":
                        fn()  # compiled and warm before the burst
                        times[(name, mode)].append(kernel_ms(fn, 10))
                    else:
                        times[(name, mode)].append(do_bench(fn, warmup=10, rep=60))
    print(torch.cuda.get_device_name(), f"timer {args.timer}", flush=True)
    label = f"bf16 d128 B={args.batch} H={args.heads} S={args.seq}" + (" causal" if args.causal else "")
    for mode in ("fwd", "fwd+bwd"):
        base_tl = statistics.median(times[("plain-tl", mode)]) if "plain-tl" in variants else None
        for name in variants:
            base_name = "fa4" if name.startswith("fa4") else "plain"
            base = statistics.median(times[(base_name, mode)])
            ms = statistics.median(times[(name, mode)])
            tflops = flops * (3.5 if mode == "fwd+bwd" else 1.0) / ms / 1e9
            of_tl = f"  x{ms / base_tl:5.3f} of plain-tl" if base_tl else ""
            lo, mid, hi = paired_ratios(times[(name, mode)], times[(base_name, mode)])
            print(
                f"{label} {mode:8s} {name:15s} {ms:8.3f} ms {tflops:6.0f} TFLOP/s  "
                f"x{ms / base:5.3f} of {base_name}{of_tl}  paired x{mid:5.3f} ({lo:5.3f}-{hi:5.3f})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
