"""Forward-kernel experiment on the GPU: structural variants of ``_attn_fwd`` (constexpr
switches) and launch configurations, timed next to cuDNN in one process.

    python benchmarks/fwd_variants.py [--json PATH] [--quick]

Every variant's output is checked against cuDNN's (bf16: max abs error <= 2e-2) before it
is timed; a variant that fails to compile or to match is reported, never timed.  The result
goes to docs/experiments/perf-notes.md by hand (an experiment record), not to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from attention_dispatch.kernels import configs as C  # noqa: E402
from attention_dispatch.kernels.shapes import KernelShapes, common_constexprs  # noqa: E402
from attention_dispatch.kernels.tl import KERNELS  # noqa: E402
from attention_dispatch.kernels.tl.common import LOG2E  # noqa: E402
from attention_dispatch.kernels.params import KernelParams  # noqa: E402

TOKENS, HIDDEN = 16384, 2048


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def run_kernel(q, k, v, causal, cfg, flags):
    prob = KernelShapes(q, k, v, None, None, None, None)
    out = torch.empty(prob.out_shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(prob.lse_shape, device=q.device, dtype=torch.float32)
    params = KernelParams(scale=q.shape[-1] ** -0.5, window_right=0 if causal else -1)
    args = (
        q,
        k,
        v,
        q,
        out,
        lse,
        q,
        q,
        q,
        params.scale * LOG2E,
        0.0,
        *prob.q_strides,
        *prob.k_strides,
        *prob.v_strides,
        0,
        0,
        0,
        0,
        *prob.out_strides(out),
        *prob.lse_strides(),
        prob.Hq,
        prob.B,
        prob.group,
        prob.Sq,
        prob.Sk,
        0,
        params.window_left,
        params.window_right,
        0,
        0,
    )
    kw = dict(
        common_constexprs(q, params, prob),
        BIAS_KIND=0,
        BIAS_DESC=False,
        HAS_DROPOUT=False,
        BATCH_MINOR=False,
        SCALE_POS=True,
        STORE_LSE=True,
        KV_HOST=0,
        **flags,
    )
    grid = (triton.cdiv(prob.Sq, cfg.block_m), prob.B * prob.Hq)

    def fn():
        KERNELS[C.FWD][grid](
            *args,
            **kw,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            SUBTILES=cfg.subtiles,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return out

    return fn


def bench(fn, reps=30):
    fn()
    torch.cuda.synchronize()
    for _ in range(3):
        fn()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        st.record()
        for _ in range(reps):
            fn()
        en.record()
        torch.cuda.synchronize()
        times.append(st.elapsed_time(en) / reps)
    return sorted(times)[len(times) // 2]


VARIANTS = {
    # name: (flags, (BM, BN, warps, stages)); experiment 4 also compared a single loop with a
    # per-block branch (removed: 307 TFLOP/s at S=4k d=128) and warp_specialize (no effect).
    "ptr_128x64w8s3": (dict(USE_DESC=False, MAY_EMPTY=False), (128, 64, 8, 3)),
    "ptr_128x64w8s3_safe": (dict(USE_DESC=False, MAY_EMPTY=True), (128, 64, 8, 3)),
}
for _bm, _bn, _w, _st in (
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (256, 64, 8, 2),
    (128, 32, 4, 3),
):
    VARIANTS[f"desc_{_bm}x{_bn}w{_w}s{_st}"] = (dict(USE_DESC=True, MAY_EMPTY=False), (_bm, _bn, _w, _st))
# two query sub-tiles per program (experiment 22)
for _bm, _bn, _w, _st in ((256, 64, 8, 3), (256, 64, 8, 2), (128, 64, 4, 3), (128, 128, 4, 3)):
    VARIANTS[f"sub2_{_bm}x{_bn}w{_w}s{_st}"] = (dict(USE_DESC=True, MAY_EMPTY=False), (_bm, _bn, _w, _st, 2))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=None, help="comma list (default: all)")
    ap.add_argument("--shapes", default="4096:0:128,4096:1:128,16384:0:128,16384:1:128,4096:0:64,4096:0:256")
    a = ap.parse_args(argv)
    triton.set_allocator(_alloc)
    names = a.variants.split(",") if a.variants else list(VARIANTS)
    results = []
    torch.manual_seed(0)
    for spec in a.shapes.split(","):
        S, causal, D = (int(x) for x in spec.split(":"))
        causal = bool(causal)
        B, H = TOKENS // S, HIDDEN // D
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            t_cudnn = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        row = {"S": S, "causal": causal, "D": D, "cudnn": flops / t_cudnn / 1e9}
        for name in names:
            flags, tiles = VARIANTS[name]
            cfg = C.KernelConfig(*tiles)
            t0 = time.perf_counter()
            try:
                fn = run_kernel(q, k, v, causal, cfg, flags)
                o = fn()
                torch.cuda.synchronize()
                err = (o.float() - ref.float()).abs().max().item()
                if not err <= 2e-2:
                    row[name] = f"wrong {err:.3g}"
                    continue
                row[name] = flops / bench(fn) / 1e9
            except Exception as e:  # noqa: BLE001
                row[name] = "err " + str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            row[name + "_s"] = round(time.perf_counter() - t0, 1)
        results.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    # short table, last
    print(f"{'variant':18s}" + "".join(f"{r['S'] // 1024}k{'c' if r['causal'] else ''}d{r['D']:<6}" for r in results))
    for name in ["cudnn"] + names:
        cells = []
        for r in results:
            x = r.get(name)
            cells.append(f"{x:9.0f}" if isinstance(x, float) else f"{str(x)[:9]:>9s}")
        print(f"{name:18s}" + "".join(f"{c:10s}" for c in cells))


if __name__ == "__main__":
    main()
