"""Where the host time of sdpa(backend="triton") training calls goes (GPU; a diagnostic).

    python benchmarks/host_split.py [S]      # bf16 d128, B * S = 16k tokens, 16 heads

Wraps the launch glue's functions with timers (inclusive microseconds per forward+backward
call; each wrapper adds ~0.3 us), runs 50 repeated sdpa() training calls after a warm-up (the
prepared runner: TrainingPlan); the autograd engine's own cost (an identity Function, and one
shaped as _EagerAttention with and without materialised gradients); an inference loop and the
cost of one Gluon descriptor; training calls behind a busy device (a synchronisation inside
would show as one long call); the CUDA runtime calls and aten ops of five training calls
(torch.profiler).  docs/experiments/perf-notes.md experiments 44, 46 and 67.
"""

import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import attention_dispatch as ad  # noqa: E402
from attention_dispatch.kernels import autograd as ag, compiled_cache as cc, entry, launch_replay, replay, run  # noqa: E402
from attention_dispatch.kernels.gluon import launch as gluon_launch, route as gluon_route  # noqa: E402

acc = collections.Counter()


def wrap(obj, name, label=None):
    real = getattr(obj, name)
    label = label or name

    def w(*a, **kw):
        t = time.perf_counter_ns()
        try:
            return real(*a, **kw)
        finally:
            acc[label] += time.perf_counter_ns() - t

    setattr(obj, name, w)


# each function wrapped where its callers look it up
for n in ("forward", "dkdv", "dq", "rows_descriptor"):
    wrap(gluon_launch, n)
wrap(gluon_route, "ws_reason")
wrap(entry, "use_descriptors")
wrap(run, "launch_one")
wrap(cc.COMPILED, "launch", "COMPILED.launch")
wrap(replay.TrainingPlan, "forward", "TrainingPlan.forward")
wrap(replay.TrainingPlan, "backward", "TrainingPlan.backward")
wrap(launch_replay.Replay, "__call__", "Replay.__call__")
wrap(launch_replay, "rebase")
wrap(launch_replay, "run_with_scratch")
wrap(run, "run_with_scratch", "run_with_scratch(run)")
wrap(cc, "relaunch", "relaunch")
wrap(launch_replay, "relaunch", "relaunch(replay)")
for mod in (ag, replay):  # attention_forward / attention_backward as both callers see them
    for n in ("attention_forward", "attention_backward"):
        wrap(mod, n, f"{n}({mod.__name__.rsplit('.', 1)[-1]})")
S = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
B = 16384 // S
q, k, v = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
for _ in range(5):
    torch.autograd.grad(ad.sdpa(q, k, v, backend="triton"), (q, k, v), do)
torch.cuda.synchronize()
acc.clear()
N = 50
tf = tb = 0
for _ in range(N):
    t0 = time.perf_counter_ns()
    o = ad.sdpa(q, k, v, backend="triton")
    t1 = time.perf_counter_ns()
    torch.autograd.grad(o, (q, k, v), do)
    t2 = time.perf_counter_ns()
    tf += t1 - t0
    tb += t2 - t1
    torch.cuda.synchronize()
print(f"S={S}: sdpa forward (grad) {tf / N / 1e3:.0f} us, autograd.grad {tb / N / 1e3:.0f} us per call")
for label, ns in acc.most_common():
    print(f"  {label:24s} {ns / N / 1e3:8.1f} us/call")


def apply_and_grad_us(apply) -> tuple[float, float]:
    """Host microseconds of ``apply()`` (a Function's forward over q, k, v) and of autograd.grad
    over its output, per call, after five warm-up calls; no synchronisation between calls."""
    tf = tb = 0
    for i in range(N + 5):
        t0 = time.perf_counter_ns()
        o = apply()
        t1 = time.perf_counter_ns()
        torch.autograd.grad(o, (q, k, v), do)
        t2 = time.perf_counter_ns()
        if i >= 5:
            tf += t1 - t0
            tb += t2 - t1
    return tf / N / 1e3, tb / N / 1e3


class _Identity3(torch.autograd.Function):
    """The engine's own cost: three inputs, one output, nine saved tensors, a backward that
    returns the incoming gradient three times (no kernel launched)."""

    @staticmethod
    def forward(ctx, a, b, c):
        ctx.save_for_backward(a, b, c, a, b, c, a, b, c)
        return a.view_as(a)

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        return g, g, g


us = apply_and_grad_us(lambda: _Identity3.apply(q, k, v))
print(f"engine alone (identity Function, no kernel): apply {us[0]:.0f} us, autograd.grad {us[1]:.0f} us")


class _Mimic(torch.autograd.Function):
    """_EagerAttention's shape without kernels: ten inputs, (out, lse) with lse non-differentiable,
    a backward that allocates three gradients (``materialize``: undefined grads become zeros)."""

    materialize = True

    @staticmethod
    def forward(ctx, a, b, c, bias, cq, ck, msq, msk, params, plan):
        ctx.set_materialize_grads(_Mimic.materialize)
        out, lse = torch.empty_like(a), torch.empty(a.shape[:-1], device=a.device)
        ctx.save_for_backward(a, b, c, bias, out, lse, None, cq, ck)
        ctx.extra = (msq, msk, params, plan)
        ctx.mark_non_differentiable(lse)
        return out, lse

    launches = 0  # kernels launched by the backward (tiny fills), as the real one launches three

    @staticmethod
    def backward(ctx, g, g_lse):
        a, b, c = ctx.saved_tensors[:3]
        grads = torch.empty_like(a), torch.empty_like(b), torch.empty_like(c)
        for t in grads[: _Mimic.launches]:
            t.view(-1)[:1].zero_()
        return (*grads, None, None, None, None, None, None, None)


# Is autograd.grad's time beyond the engine's kernel-less cost (experiment 67: 76-174 us not located)
# the launches made from the engine's device thread?  The same Function with 0 and 3 launches.
for materialize, launches in ((True, 0), (False, 0), (False, 3), (True, 0), (False, 0), (False, 3)):
    _Mimic.materialize, _Mimic.launches = materialize, launches
    us = apply_and_grad_us(lambda: _Mimic.apply(q, k, v, None, None, None, -1, -1, None, None)[0])
    print(
        f"engine, _EagerAttention's shape (materialize={materialize}, {launches} launches in backward): "
        f"apply {us[0]:.0f} us, autograd.grad {us[1]:.0f} us"
    )
with torch.no_grad():
    for _ in range(3):  # the inference kernels compile on their first call
        ad.sdpa(q, k, v, backend="triton")
    torch.cuda.synchronize()
    t = time.perf_counter_ns()
    for _ in range(N):
        ad.sdpa(q, k, v, backend="triton")
    print(f"inference sdpa: {(time.perf_counter_ns() - t) / N / 1e3:.0f} us/call")
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as G

lay = gluon_launch.smem_layout(64, 128, q.dtype)
t = time.perf_counter_ns()
for _ in range(1000):
    G(q, [B * 16 * S, 128], [128, 1], [64, 128], lay)
print(f"GluonDescriptor(): {(time.perf_counter_ns() - t) / 1000 / 1e3:.2f} us")
t = time.perf_counter_ns()
for _ in range(1000):
    d = object.__new__(G)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = (
        q,
        [B * 16 * S, 128],
        [128, 1],
        [64, 128],
        lay,
        "zero",
    )
print(f"without __post_init__: {(time.perf_counter_ns() - t) / 1000 / 1e3:.2f} us")
t = time.perf_counter_ns()
for _ in range(1000):
    gluon_launch.smem_layout(64, 128, q.dtype)
print(f"smem_layout: {(time.perf_counter_ns() - t) / 1000 / 1e3:.2f} us")

# Does a training call wait for the device?  Keep the device busy (~200 ms of spinning) and
# time host-only training calls behind it: without a synchronisation inside they take their
# host time; with one, the first waits for the spin to end.
spin = torch.cuda._sleep
torch.cuda.synchronize()
spin(int(2e8))  # ~100-200 ms at the H100's clock
t = [time.perf_counter_ns()]
for _ in range(10):
    torch.autograd.grad(ad.sdpa(q, k, v, backend="triton"), (q, k, v), do)
    t.append(time.perf_counter_ns())
torch.cuda.synchronize()
t_end = time.perf_counter_ns()
steps = [round((b - a) / 1e3) for a, b in zip(t, t[1:])]
print(f"training calls behind a busy device: host us per call {steps}; sync after {(t_end - t[-1]) / 1e6:.1f} ms")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for _ in range(2):  # the first profile pays CUPTI's start-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(ad.sdpa(q, k, v, backend="triton"), (q, k, v), do)
        torch.cuda.synchronize()
rows = sorted(
    (e for e in prof.key_averages() if e.key.startswith(("cuda", "cu", "aten::"))), key=lambda e: -e.cpu_time_total
)[:22]
for e in rows:
    print(f"  {e.key[:60]:60s} x{e.count // 5:<3d} {e.cpu_time_total / 5:8.1f} us/call (host)")
