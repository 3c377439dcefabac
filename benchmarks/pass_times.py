"""GPU time of the forward and of each warp-specialised backward pass (GPU; a diagnostic).

    python benchmarks/pass_times.py

bf16 d128, S = 4k / 16k / 16k causal / 4k with a (1, H, S, S) bias (B * S = 16k tokens, 16
heads): the forward, the dK/dV pass, the dQ pass and the dK/dV pass with dQ fused into it
(fp32 TMA reduce-adds, configs.WsConfig.fuse_dq) each timed alone by CUDA events (median of 7 loops of
5 calls), and their TFLOP/s counting only their own products (2 / 4 / 3 / 5 matrix products of
the forward's size).  docs/experiments/perf-notes.md experiments 47, 50 and 54.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from attention_dispatch.kernels import KernelParams, attention_forward, bias as bias_mod  # noqa: E402
from attention_dispatch.kernels.device import use_descriptors  # noqa: E402
from attention_dispatch.kernels.gluon import launch as gluon_launch  # noqa: E402
from attention_dispatch.kernels.gluon.route import ws_backward_reason  # noqa: E402
from attention_dispatch.kernels.shapes import KernelShapes  # noqa: E402

for S, causal, with_bias in ((4096, False, False), (16384, False, False), (16384, True, False), (4096, False, True)):
    B = 16384 // S
    q, k, v, do = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    bias = torch.randn(1, 16, S, S, device="cuda", dtype=torch.bfloat16) if with_bias else None
    params = KernelParams(scale=128**-0.5, window_right=0 if causal else -1)
    out, lse, _ = attention_forward(q, k, v, bias, params)
    delta = (do.float() * out.float()).sum(-1)
    prob = KernelShapes(q, k, v, None, None, None, None)
    desc = use_descriptors(params, (q, k, v, do), q.device)
    kind, bt, bstr, _ = bias_mod.bias_layout(bias, (B, 16, S, S))
    why_not, route = ws_backward_reason(
        do, q, k, v, bias_mod.ws_bias_reason(kind, bt, bstr, q.dtype, desc), params, prob, desc
    )
    assert route is not None, why_not
    ws_bias = gluon_launch.WsBias.of(bt, bstr, prob) if with_bias else None
    fns = {
        "fwd": lambda: attention_forward(q, k, v, bias, params),
        "dkdv": lambda: gluon_launch.dkdv(q, k, v, do, lse, delta, params, prob, *route, bias=ws_bias),
        "dkdv+dq": lambda: gluon_launch.dkdv(q, k, v, do, lse, delta, params, prob, *route, bias=ws_bias, fuse_dq=True),
        "dq": lambda: gluon_launch.dq(q, k, v, do, lse, delta, params, prob, *route, bias=ws_bias),
    }
    mm = {"fwd": 2, "dkdv": 4, "dq": 3, "dkdv+dq": 5}
    flop1 = 2 * B * 16 * S * S * 128 / (2 if causal else 1)
    res = []
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        ts = []
        for _ in range(7):
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            [fn() for _ in range(5)]
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 5)
        ms = sorted(ts)[3]
        res.append(f"{name} {ms:.3f} ms ({mm[name] * flop1 / ms / 1e9:.0f} TFLOP/s of its {mm[name]} products)")
    print(f"S={S} causal={causal} bias={with_bias}: " + "; ".join(res), flush=True)
