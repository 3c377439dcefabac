"""Issue 40: what context_parallel_sdpa runs besides the blocks' attention, counted on the CPU.

    python benchmarks/cp_overhead.py [--world 2] [--s 1024]

2 gloo processes, bf16, GQA 4/2 heads, d16, causal zigzag ring (the 2-GPU benchmark's call at a
tiny size). Each block's ad.sdpa() is wrapped in an autograd Function that stands for one fused
attention forward and one fused backward (what a flash-style kernel does), so that every other
tensor op (merge, casts, slices' gradients, accumulation, exchanges) is counted per fwd+bwd
(backward="merged": each block's Backend.run_backward is the one fused backward):
launches (view ops excluded) and bytes read + written, per phase and backward mode, and the
largest ops. Bytes are given in units of one local query shard (B, Hq, S / W, D) in bf16.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attention_dispatch as ad  # noqa: E402

B, HQ, HKV, D, DTYPE = 1, 4, 2, 16, torch.bfloat16
_INSIDE = {"attention": 0}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = "fwd"
        self.ops = collections.Counter()
        self.bytes = collections.Counter()
        self.by_op = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _INSIDE["attention"] or func.is_view or func.namespace == "c10d":
            return out
        name = str(func.overloadpacket.__name__)
        read = () if name.startswith(("empty", "zeros", "full", "new_")) else (args, kwargs)  # not read
        flat = torch.utils._pytree.tree_leaves((read, out))
        nbytes = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        self.ops[self.phase] += 1
        self.bytes[self.phase] += nbytes
        self.by_op[(self.phase, name)] += nbytes
        return out


class _FusedAttention(torch.autograd.Function):
    """One block's attention as one forward and one backward 'kernel' (uncounted)."""

    @staticmethod
    def forward(ctx, kwargs, q, k, v):
        _INSIDE["attention"] += 1
        try:
            out, lse = _REAL_SDPA(q, k, v, **kwargs)
        finally:
            _INSIDE["attention"] -= 1
        ctx.kwargs = kwargs
        ctx.save_for_backward(q, k, v)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        _INSIDE["attention"] += 1
        try:
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
                out, lse = _REAL_SDPA(*leaves, **ctx.kwargs)
                grads = torch.autograd.grad((out, lse), leaves, (dout, dlse), allow_unused=True)
        finally:
            _INSIDE["attention"] -= 1
        return (None, *grads)


_REAL_SDPA = ad.sdpa


def _fused_run_backward(real):
    """A backend's run_backward (backward="merged") as one fused backward 'kernel' (uncounted,
    its delta pass included, as the other modes' blocks' backward)."""

    def run_backward(*args, **kwargs):
        _INSIDE["attention"] += 1
        try:
            return real(*args, **kwargs)
        finally:
            _INSIDE["attention"] -= 1

    return run_backward


def _stub(q, k, v, attn_mask=None, dropout_p=0.0, **kwargs):
    assert attn_mask is None and dropout_p == 0
    return _FusedAttention.apply(kwargs, q, k, v)


def _worker(rank, world, s, init, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from attention_dispatch.distributed import context_parallel_sdpa, shard, steps

    steps.sdpa = _stub
    math = ad.get_backend("math")
    math.run_backward = _fused_run_backward(math.run_backward)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, h, s, D, generator=g, dtype=DTYPE) for h in (HQ, HKV, HKV, HQ))
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    dos = shard(do)
    unit = leaves[0].numel() * leaves[0].element_size()
    rows = {}
    for backward in ("merged", "recompute", "autograd"):
        kw = dict(enable_gqa=True, causal="bottom_right", exchange="ring", backward=backward, backend="math")
        context_parallel_sdpa(*leaves, **kw).backward(dos)  # warm-up (first-call caches)
        for t in leaves:
            t.grad = None
        mode = _Count()
        with mode:
            out = context_parallel_sdpa(*leaves, **kw)
            mode.phase = "bwd"
            out.backward(dos)
        top = sorted(mode.by_op.items(), key=lambda kv: -kv[1])[:8]
        rows[backward] = dict(
            ops=dict(mode.ops),
            bytes_in_q_shards={p: round(b / unit, 2) for p, b in mode.bytes.items()},
            top=[(p, n, round(b / unit, 2)) for (p, n), b in top],
        )
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--s", type=int, default=1024, help="total sequence length")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_worker, args=(args.world, args.s, init, queue), nprocs=args.world, join=True)
    rows = queue.get()
    print(f"outside the blocks' attention, rank 0 of {args.world}, one causal zigzag ring fwd+bwd, S={args.s}:")
    for backward, r in rows.items():
        print(f"  {backward:<9} ops {r['ops']}  bytes read+written (local q shards) {r['bytes_in_q_shards']}")
        print("            largest: " + ", ".join(f"{p} {n} {b}" for p, n, b in r["top"]))


if __name__ == "__main__":
    main()
