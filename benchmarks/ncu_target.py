"""One attention call, alone, for Nsight Compute (ncu) to profile (GPU; perf-notes E113).

Issue 36's softcap forward and issue 34's chunked prefill, ours and flash-attn 4's (cases below).

    python benchmarks/ncu_target.py --case CASE [--warm-only]

The call is built and run twice (compiling its kernels), then once more between
torch.cuda.profiler.start() and stop(), so `ncu --profile-from-start off` profiles that call's
kernels and nothing else.  --warm-only stops after the warm-up: compiling every case side by side
first leaves the profiled processes Triton's disk cache.  Cases (bf16, d128, forward only):

- plain, softcap, plain-causal, softcap-causal: B=4 H=16 S=4096 through ``triton_attention`` as
  benchmarks/features.py builds them (softcap 30, the Gluon forward where it serves);
- fa4, fa4-softcap: flash-attn 4's flash_attn_func on the same dense shape (features.py's call);
- kv-chunk: chunked prefill, kernels.decode.kv_forward (the Gluon KV-cache forward) with B=4,
  Hq 32 / Hkv 8, 512 new queries over 8k keys (capacity 8704, every cache full), causal, as
  E107/E111's kv_device_ab.py (in their patches) times it;
- fa4-chunk: flash-attn 4 on (B, S, H, D) copies of the same tensors, causal (bottom-right);
- plain-train, softcap-train, softcap-causal-train: features.py's training call (forward + backward of
  the dense or causal shape above): the backward's dK/dV pass is the case's longest kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# case -> (features.py variant, causal, forward + backward)
DENSE = {
    "plain": ("plain", False, False),
    "softcap": ("softcap", False, False),
    "plain-causal": ("plain", True, False),
    "softcap-causal": ("softcap", True, False),
    "fa4": ("fa4", False, False),
    "fa4-softcap": ("fa4-softcap", False, False),
    "plain-train": ("plain", False, True),
    "softcap-train": ("softcap", False, True),
    "softcap-causal-train": ("softcap", True, True),
}
CHUNK = ("kv-chunk", "fa4-chunk")
CASES = tuple(DENSE) + CHUNK
# issue 36's shape (features.py's defaults) and issue 34's chunked-prefill row (kv_device_ab.py's first, E107)
DENSE_SHAPE = (4, 16, 4096, 128)
CHUNK_B, CHUNK_HQ, CHUNK_HKV, CHUNK_SQ, CHUNK_CAPACITY = 4, 32, 8, 512, 8192 + 512


def dense_call(case: str):
    """(the forward call, a line naming it) through features.make_call, as its timed rounds build it."""
    import torch

    from benchmarks.features import make_call

    variant, causal, train = DENSE[case]
    q, k, v = (torch.randn(DENSE_SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=train) for _ in range(3))
    fn = make_call(variant, q, k, v, causal, backward=train)
    return fn, f"{case}: features.py {variant!r} bf16 B,H,S,D={DENSE_SHAPE} causal={causal} backward={train}"


def chunk_call(case: str):
    """(the call, a line naming it): the chunked-prefill row, ours (kv_forward) or flash-attn 4's."""
    import torch

    from attention_dispatch.kernels import KernelParams
    from attention_dispatch.kernels.decode import kv_forward, kv_route
    from benchmarks.decode import fa4

    B, Hq, Hkv, Sq, S, D = CHUNK_B, CHUNK_HQ, CHUNK_HKV, CHUNK_SQ, CHUNK_CAPACITY, 128
    q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    label = f"{case}: B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} over {S} keys causal d{D}"
    if case == "kv-chunk":
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")  # the chunk's keys already appended
        params = KernelParams(scale=D**-0.5, window_right=0, align_bottom_right=True)
        route = kv_route(q, k, v, None, params)
        return lambda: kv_forward(q, k, v, lens, params, None), f"{label}, kv_forward route {route}"
    flash = fa4()
    if flash is None:
        raise SystemExit(f"{case}: flash-attn 4 is not importable here (source .fa4b/fa4-env.sh)")
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return lambda: flash(qt, kt, vt, causal=True), f"{label}, flash_attn.cute.flash_attn_func"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", required=True, choices=CASES)
    ap.add_argument("--warm-only", action="store_true", help="compile and warm up, profile nothing")
    args = ap.parse_args(argv)

    import torch

    fn, label = chunk_call(args.case) if args.case in CHUNK else dense_call(args.case)
    print(label, flush=True)
    train = args.case in DENSE and DENSE[args.case][2]
    with torch.set_grad_enabled(train):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        if args.warm_only:
            return 0
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print(f"{args.case}: profiled one call", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
