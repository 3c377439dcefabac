"""Issue 40: the peak of the tensors context_parallel_sdpa's backward allocates, per rank, on the CPU.

    TRITON_INTERPRET=1 python benchmarks/cp_memory.py [--world 2] [--s 1024] [--backend triton]

2 gloo processes, bf16, GQA 4/2 heads, d32, causal zigzag ring, backward="merged" (the 2-GPU
benchmark's call at a small size). Every tensor an op creates during the backward is followed
by a weak reference; after each op the bytes of the distinct storages still alive are summed:
the peak of that sum is what the GPU's peak above the step's start follows (the blocks' kernels'
own workspaces included, as their torch allocations: the triton kernels under the interpreter
take the tl route, here made to allocate what the GPU's Gluon route does at d128:
_gpu_like_launches). Printed per rank in units of one local query shard (B, Hq, S / W, D) in
bf16, with each block's dQ and dK/dV branch. The GPU's step peak (context_parallel.py) adds
what the forward keeps (the merged output: 1 shard).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


B, HQ, HKV, D, DTYPE = 1, 4, 2, 32, torch.bfloat16


BRANCHES = []  # per attention_backward call: (q rows, keys, dQ branch, dK/dV branch), as on the GPU


def _gpu_like_launches():
    """The interpreter's kernel launches copy their tensor arguments (a GPU launch allocates
    nothing): ops inside them are not followed. And the tl kernels write bf16 results in bf16,
    as on a GPU (the interpreter's float32 results, rounded by torch after, would count twice).
    The tl passes allocate what the GPU's Gluon route (bf16 d128, Sk >= FUSE_DQ_MIN_KEYS there)
    does: dQ fused into the dK/dV pass (reduce-added into the accumulator, or a zeroed float32
    buffer cast) unless the block is banded (gluon.route.fuse_dq_reason: causal or window), then
    a separate Gluon dQ pass writing a bf16 dq that entry adds into the accumulator; dK/dV written
    into dk_out/dv_out only where contiguous (gluon.launch.dkdv), else new and copied by entry."""
    from triton.runtime.interpreter import GridExecutor

    from attention_dispatch import kernels
    from attention_dispatch.kernels.tl import launch_backward as launch

    launch.store_dtype = lambda dtype: dtype
    real_dq, real_dkdv = launch.dq_pass, launch.dkdv_pass

    def dq_pass(do, q, k, v, lse, delta, params, prob, a, accumulator=None, out=None):
        # only="dq" (no dK/dV pass: "-") runs the separate Gluon dQ pass where the route fuses it
        banded = params.window_left >= 0 or params.window_right >= 0 or BRANCHES[-1][3] == "-"
        if banded and out is not None:  # the separate Gluon dQ pass writing into the given dq
            BRANCHES[-1][:3] = [q.shape[2], k.shape[2], "separate dQ (bf16, into dq_out)"]
            return real_dq(do, q, k, v, lse, delta, params, prob, a, out=out)
        if banded:  # the separate Gluon dQ pass: a bf16 dq of q's rows, added by entry
            dq = real_dq(do, q, k, v, lse, delta, params, prob, a)
            BRANCHES[-1][:3] = [q.shape[2], k.shape[2], "separate dQ (bf16 dq, then added)"]
            if accumulator is None:
                return dq
            accumulator.add_(dq)
            return None
        BRANCHES[-1][:3] = [q.shape[2], k.shape[2], "dQ fused into dK/dV"]
        if accumulator is not None:
            return real_dq(do, q, k, v, lse, delta, params, prob, a, accumulator)
        acc = torch.zeros(q.shape, dtype=torch.float32)  # its float32 workspace, then cast
        acc.add_(real_dq(do, q, k, v, lse, delta, params, prob, a))
        return acc.to(q.dtype)

    def dkdv_pass(*args, dk_out=None, dv_out=None):
        k = args[2]
        given = dk_out is not None
        dk_out, dv_out = (t if t is not None and t.is_contiguous() else None for t in (dk_out, dv_out))
        over = dk_out is not None and dk_out.data_ptr() == k.data_ptr()
        if not given:
            branch = "new"
        elif dk_out is None:
            branch = "new, then copied into the non-contiguous dk_out"
        else:
            branch = "in place over the keys it read" if over else "into dk_out"
        BRANCHES[-1][:2] = [args[1].shape[2], k.shape[2]]
        BRANCHES[-1][3] = branch
        return real_dkdv(*args, dk_out=dk_out, dv_out=dv_out)

    def attention_backward(*args, **kwargs):  # one record per call, filled by its passes
        only = kwargs.get("only")
        BRANCHES.append([None, None, "-" if only == "dkv" else None, "-" if only == "dq" else None])
        return real_backward(*args, **kwargs)

    real_backward = kernels.attention_backward
    launch.dq_pass, launch.dkdv_pass, kernels.attention_backward = dq_pass, dkdv_pass, attention_backward

    real = GridExecutor.__call__

    def call(self, *args, **kwargs):
        LiveBytes.inside += 1
        try:
            return real(self, *args, **kwargs)
        finally:
            LiveBytes.inside -= 1

    GridExecutor.__call__ = call


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of the storages that ops created under this mode and that are still
    referenced (views of one storage counted once)."""

    inside = 0  # kernel launches under way (_gpu_like_launches)

    def __init__(self):
        super().__init__()
        self.refs = []  # (weak reference to a created tensor, its storage's address, its bytes)
        self.peak = 0
        self.peak_op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if LiveBytes.inside:
            return out
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not func.is_view:
                storage = t.untyped_storage()
                self.refs.append((weakref.ref(t), storage.data_ptr(), storage.nbytes()))
        self.refs = [r for r in self.refs if r[0]() is not None]
        live = sum(dict((ptr, n) for _, ptr, n in self.refs).values())
        if live > self.peak:
            self.peak, self.peak_op = live, str(func.overloadpacket.__name__)
            if os.environ.get("CP_MEMORY_DEBUG"):
                self.at_peak = [(tuple(r().shape), r().dtype, n) for r, _, n in self.refs]
        return out


def backward_peak(rank: int, world: int, s: int, backend: str) -> tuple[float, str]:
    """(peak bytes the backward allocated, in local query shards; the op at the peak) of one
    causal zigzag ring call with backward="merged" on this rank (the process group set up)."""
    from attention_dispatch.distributed import context_parallel_sdpa, shard

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, h, s, D, generator=g, dtype=DTYPE) for h in (HQ, HKV, HKV, HQ))
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    dos = shard(do)
    unit = leaves[0].numel() * leaves[0].element_size()
    kw = dict(enable_gqa=True, causal="bottom_right", exchange="ring", backward="merged", backend=backend)
    context_parallel_sdpa(*leaves, **kw).backward(dos)  # warm-up (first-call caches)
    for t in leaves:
        t.grad = None
    out = context_parallel_sdpa(*leaves, **kw)
    mode = LiveBytes()
    with mode:
        out.backward(dos)
    if os.environ.get("CP_MEMORY_DEBUG"):
        print(rank, [(sh, str(dt)[6:], round(n / unit, 2)) for sh, dt, n in mode.at_peak], flush=True)
    return mode.peak / unit, mode.peak_op, BRANCHES[len(BRANCHES) // 2 :]  # the measured call's blocks


def _worker(rank, world, s, backend, init, queue):
    torch.set_num_threads(1)
    if backend == "triton":
        _gpu_like_launches()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    queue.put((rank, *backward_peak(rank, world, s, backend)))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--s", type=int, default=512, help="total sequence length")
    parser.add_argument(
        "--backend", default="triton", help="the blocks' backend (triton: run under TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_worker, args=(args.world, args.s, args.backend, init, queue), nprocs=args.world, join=True)
    rows = sorted(queue.get() for _ in range(args.world))
    print(f"backward='merged' peak allocated in the backward, causal zigzag ring, S={args.s}, {args.backend} blocks:")
    for rank, peak, op, branches in rows:
        print(f"  rank {rank}: {peak:.2f} local q shards (at {op})")
        for q_rows, keys, dq, dkdv in branches:
            print(f"    block q rows {q_rows} x keys {keys}: {dq}; dK/dV {dkdv}")


if __name__ == "__main__":
    main()
