"""Where flash-attn 4's host time per call goes through our adapter (GPU; a diagnostic, ~30 s).

    python benchmarks/fa4_host_probe.py [--calls 400]

The shipped H100 table records ~0.13-0.19 ms of host time per flash-attn 4 inference call
through the prepared relaunch (tune's details), against 0.02-0.04 ms for ours and cuDNN, and
29-49 us when experiment 59 measured the relaunch (2026-11-23).  With that much host time a
0.2-0.4 ms call turns host-bound as soon as the host is busy (perf-notes E104).  This prints
what the DLPack exchange looks like in this process (tvm-ffi passes torch tensors to the
compiled kernel through it) and the host microseconds per call of, on a tiny call whose
device time is below the host's (so wall time per call is host time):

- ``sdpa``: ``ad.sdpa(..., backend="flash_attn")`` (a fast-path hit: the prepared relaunch);
- ``runner``: the prepared runner alone;
- ``compiled``: the recorded compiled call alone, on the same views and a fresh output;
- ``public``: ``flash_attn.cute.flash_attn_func``;
- ``triton``: ``ad.sdpa(..., backend="triton")``, for scale.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import attention_dispatch as ad  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    """Median over 5 rounds of the wall time per call of ``calls`` calls, synchronised after."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(rounds)[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400)
    a = p.parse_args()
    import flash_attn.cute as fa4

    try:
        import tvm_ffi

        tvm = getattr(tvm_ffi, "__version__", "?")
    except ImportError:
        tvm = "not importable"
    try:
        import torch_c_dlpack_ext  # noqa: F401

        ext = "loaded"
    except ImportError as exc:
        ext = f"not loaded ({exc})"
    print(
        f"torch {torch.__version__}: Tensor.__dlpack_c_exchange_api__ "
        f"{hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}, __c_dlpack_exchange_api__ "
        f"{hasattr(torch.Tensor, '__c_dlpack_exchange_api__')}; tvm_ffi {tvm}; torch_c_dlpack_ext {ext}; "
        f"flash-attn 4 {getattr(fa4, '__version__', '?')}"
    )
    q, k, v = (torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows = {"sdpa": lambda: ad.sdpa(q, k, v, backend="flash_attn")}
    ad.sdpa(q, k, v, backend="flash_attn")
    from attention_dispatch.call import normalize_call

    call = normalize_call(q, k, v)
    runner = ad.get_backend("flash_attn").prepare(q, k, v, call.options)
    runner(q, k, v)
    rows["runner"] = lambda: runner(q, k, v)
    launch = getattr(runner, "launch", None)
    if launch is not None:
        compiled, rest, shape, _ = launch
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        rows["compiled"] = lambda: compiled(qt, kt, vt, torch.empty(shape, dtype=q.dtype, device=q.device), *rest)
    else:
        print("runner not relaunched:", getattr(runner, "refused", type(runner).__name__))
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    rows["public"] = lambda: fa4.flash_attn_func(qb, kb, vb)
    rows["triton"] = lambda: ad.sdpa(q, k, v, backend="triton")
    rows["empty"] = lambda: torch.empty(1, 128, 2, 128, device="cuda", dtype=q.dtype)
    for name, fn in rows.items():
        print(f"{name:<9} {per_call_us(fn, a.calls):8.1f} us per call")


if __name__ == "__main__":
    main()
