"""Where a context-parallel call's first step of a new layout spends its time (2 GPUs, NCCL).

    python benchmarks/cp_first_call.py [--s 32768] [--feature full] [--exchange ring]
        [--layouts zigzag,contiguous] [--out DIR] [--cpu]

benchmarks/context_parallel.py's correctness phase found, at 2 H100s, the first contiguous case
of a feature 13 s at 32k and 100 s (causal) / 200 s (full) at 128k (O(S^2), once per process),
the others under a second; window blocks (our backward) did not show it, causal and full blocks
(flash-attn 4's backward) did.  Here each layout runs in turn, as there (same inputs, same
order); each layout's first step runs under torch.profiler, then a second step plain.  Rank 0
prints per layout the first and second step's forward and backward seconds, the backends the
blocks took, and the first step's top operators by self CPU and by CUDA time (tables into
OUT/first_call_<layout>.txt).  Bring back only the summary: a device call returns ~8 files.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import context_parallel as cp  # noqa: E402  (sets the no-multicast environment first)
import attention_dispatch as ad  # noqa: E402


def _step(leaves, dos, layout: str, exchange: str, kw: dict) -> tuple[float, float, dict]:
    """One forward + backward: (forward s, backward s, backend -> sdpa calls), synchronised."""
    from attention_dispatch.distributed import context_parallel_sdpa

    for t in leaves:
        t.grad = None
    dist.barrier()
    cp._sync()
    with ad.record() as decisions:
        a = time.perf_counter()
        out = context_parallel_sdpa(*leaves, enable_gqa=True, exchange=exchange, layout=layout, **kw)
        cp._sync()
        b = time.perf_counter()
        out.backward(dos)
        cp._sync()
        c = time.perf_counter()
    return b - a, c - b, dict(collections.Counter(str(d.backend) for d in decisions))


def _worker(rank: int, world: int, args, init: str, queue) -> None:
    from torch.profiler import ProfilerActivity, profile

    from attention_dispatch.distributed import shard

    cp._configure(argparse.Namespace(modes="", profile=False, out=args.out, cpu=args.cpu))
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=device)
    q, k, v, do = cp._inputs(args.s, args.s, device)
    kw = cp.FEATURES[args.feature]
    rows = []
    for layout in args.layouts.split(","):
        leaves = [shard(t, layout=layout).detach().requires_grad_() for t in (q, k, v)]
        dos = shard(do, layout=layout)
        activities = [ProfilerActivity.CPU] + ([] if args.cpu else [ProfilerActivity.CUDA])
        with profile(activities=activities) as prof:
            first = _step(leaves, dos, layout, args.exchange, kw)
        second = _step(leaves, dos, layout, args.exchange, kw)
        if rank == 0:
            averages = prof.key_averages()
            by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=80)
            by_cuda = (
                "" if args.cpu else averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=80)
            )
            with open(os.path.join(args.out, f"first_call_{layout}.txt"), "w") as f:
                f.write(
                    f"{layout}: first {first}, second {second}\n\nby self CPU time\n{by_cpu}\n\nby CUDA time\n{by_cuda}\n"
                )
            top_cpu = [(e.key, round(e.self_cpu_time_total / 1e6, 2)) for e in averages]
            top_cpu.sort(key=lambda x: -x[1])
            rows.append(dict(layout=layout, first=first, second=second, top_self_cpu_s=top_cpu[:8]))
            print("first call", rows[-1], flush=True)
        del leaves, dos
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--s", type=int, default=32768, help="total sequence length (default 32768)")
    parser.add_argument("--feature", default="full", choices=sorted(cp.FEATURES))
    parser.add_argument("--exchange", default="ring", choices=("ring", "allgather"))
    parser.add_argument("--layouts", default="zigzag,contiguous", help="comma list, run in this order")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="details directory (default: $OUT or .)")
    parser.add_argument("--cpu", action="store_true", help="gloo processes on the CPU, float32, tiny sizes (a dry run)")
    args = parser.parse_args()
    if args.cpu:
        args.s = min(args.s, 64)
    elif torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    os.makedirs(args.out, exist_ok=True)
    init = f"file://{os.path.abspath(os.path.join(args.out, 'first_call_rendezvous'))}"
    if os.path.exists(init[7:]):
        os.remove(init[7:])
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(2, args, init, queue), nprocs=2, join=True)
    for row in queue.get():
        (f_fwd, f_bwd, f_used), (s_fwd, s_bwd, _) = row["first"], row["second"]
        print(
            f"{row['layout']:<10} first fwd {f_fwd:7.2f} s bwd {f_bwd:7.2f} s | second fwd {s_fwd:6.3f} s "
            f"bwd {s_bwd:6.3f} s | {f_used}"
        )
        print("   top self CPU (s):", ", ".join(f"{name} {t}" for name, t in row["top_self_cpu_s"]))


if __name__ == "__main__":
    main()
