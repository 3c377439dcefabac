"""Backend.run_backward(only=, dq_out=) (Capabilities.backward_split): dq or dk/dv alone, dq
written into a given tensor, bit for bit the whole call's (context parallelism's merged backward
runs the own block's dq at the first ring step and its dk/dv after the last). And the in-place
casts of distributed.dq_buffer that let one buffer hold the float32 dq accumulator, then the
16-bit dq and the own keys' gradients. Generated from what the backends declare."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import registry
from attention_dispatch.backends.base import Backend
from attention_dispatch.call import normalize_call
from attention_dispatch.distributed import dq_buffer

from cases import cpu_backends_declaring

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_declared_exactly_where_run_backward_takes_only():
    for name in ad.list_backends():
        backend = registry.get_backend(name)
        own = type(backend).run_backward
        takes = own is not Backend.run_backward and "only" in inspect.signature(own).parameters
        assert backend.capabilities.backward_split == takes, name
    assert {"math", "triton"} <= {n for n in ad.list_backends() if registry.get_backend(n).capabilities.backward_split}


def _call(dtype, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 64, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 64, 16, generator=g).to(dtype) for _ in range(2))
    causal = "top_left" if causal else None
    out, lse = ad.sdpa(q, k, v, enable_gqa=True, causal=causal, return_lse=True)
    dout, dlse = torch.randn(out.shape, generator=g).to(dtype), torch.randn(lse.shape, generator=g)
    return q, k, v, causal, out, lse.to(torch.float64 if dtype == torch.float64 else torch.float32), dout, dlse


def _dtypes(backend):
    return (torch.float64,) if backend == "math" else (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_split"))
def test_dq_alone_and_dkv_alone_equal_the_whole_backward(backend, causal):
    """only="dq" (into dq_out, then into an accumulator) and only="dkv" (into dkv_out, separate
    views of one buffer): the whole call's dq, dk, dv bit for bit, the other gradients None."""
    for dtype in _dtypes(backend):
        q, k, v, causal_arg, out, lse, dout, dlse = _call(dtype, causal)
        chosen = registry.get_backend(backend)
        call = normalize_call(q, k, v, enable_gqa=True, causal=causal_arg)
        args = (call.query, call.key, call.value, out, lse, dout, dlse)
        want = chosen.run_backward(*args, **call.options)
        dq_out = torch.full_like(q, 7.0)
        got = chosen.run_backward(*args, only="dq", dq_out=dq_out, **call.options)
        assert got[0] is dq_out and got[1] is None and got[2] is None, dtype
        assert torch.equal(dq_out, want[0]), dtype
        acc = torch.ones(q.shape, dtype=lse.dtype)
        assert chosen.run_backward(*args, only="dq", dq_accumulator=acc, **call.options)[0] is None
        assert torch.allclose(acc - 1, want[0].to(acc.dtype), atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
        buf = torch.full((2 * k.numel(),), 7.0, dtype=dtype)
        dk, dv = buf[: k.numel()].view(k.shape), buf[k.numel() :].view(v.shape)
        got = chosen.run_backward(*args, only="dkv", dkv_out=(dk, dv), **call.options)
        assert got[0] is None and got[1] is dk and got[2] is dv, dtype
        assert torch.equal(dk, want[1]) and torch.equal(dv, want[2]), dtype


@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_split"))
def test_wrong_split_arguments_are_refused_naming_them(backend):
    q, k, v, causal_arg, out, lse, dout, dlse = _call(_dtypes(backend)[0], True)
    chosen = registry.get_backend(backend)
    call = normalize_call(q, k, v, enable_gqa=True, causal=causal_arg)
    args = (call.query, call.key, call.value, out, lse, dout, dlse)
    with pytest.raises(ValueError, match="only must be"):
        chosen.run_backward(*args, only="dk", **call.options)
    with pytest.raises(ValueError, match="dq_out must be a contiguous"):
        chosen.run_backward(*args, only="dq", dq_out=torch.zeros_like(q).transpose(1, 2), **call.options)
    with pytest.raises(ValueError, match="dq_out is not taken"):
        chosen.run_backward(*args, only="dkv", dq_out=torch.zeros_like(q), **call.options)


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 1000, 4096 + 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_place_narrow_and_widen_equal_the_casts(n, dtype):
    """narrow(): the float32 values rounded into the front half of their own memory, equal to
    .to(dtype); widen(): the front half's 16-bit values in float32, equal to .to(float32) (in
    chunks whose writes reach no byte not yet read: a GPU's one copy kernel gives no such order)."""
    g = torch.Generator().manual_seed(n)
    acc = torch.randn(1, n, generator=g) * 100
    want = acc.to(dtype)
    got = dq_buffer.narrow(acc, dtype)
    assert got.data_ptr() == acc.data_ptr() and torch.equal(got, want)
    assert torch.equal(dq_buffer.front(acc, dtype), want)
    assert torch.equal(dq_buffer.widen(acc, dtype), want.to(torch.float32))


def test_back_views_fill_the_freed_half_without_overlap():
    acc = torch.zeros(1, 4, 8, 2)  # 64 float32: 64 free 16-bit elements after the front half
    k, v = torch.zeros(1, 2, 8, 2, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 2, dtype=torch.bfloat16)
    dk, dv = dq_buffer.back_views(acc, torch.bfloat16, k, v)
    front = dq_buffer.front(acc, torch.bfloat16)
    ends = [(t.data_ptr(), t.data_ptr() + 2 * t.numel()) for t in (front, dk, dv)]
    assert ends[0][1] <= ends[1][0] and ends[1][1] <= ends[2][0] <= ends[2][1] <= acc.data_ptr() + 4 * acc.numel()
    big = torch.zeros(1, 4, 8, 2, dtype=torch.bfloat16)  # Hq == Hkv: one fits, the other not
    assert [t is None for t in dq_buffer.back_views(acc, torch.bfloat16, big, big)] == [False, True]


def _split_worker(rank, world, init, hkv, out):
    """One rank of a bf16 causal zigzag ring call, backward="merged" on the math blocks: the
    gradients (gathered) and whether they came back as views of one buffer (the split ran)."""
    import torch.distributed as dist

    from attention_dispatch.distributed import context_parallel_sdpa, shard, unshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, h, 64, 16, generator=g, dtype=torch.bfloat16) for h in (4, hkv, hkv, 4))
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    kw = dict(enable_gqa=True, causal="bottom_right", exchange="ring", backward="merged", backend="math")
    context_parallel_sdpa(*leaves, **kw).backward(shard(do))
    grads = [t.grad for t in leaves]
    one = [g.untyped_storage().data_ptr() == grads[0].untyped_storage().data_ptr() for g in grads]
    torch.save(([unshard(g).float() for g in grads], one), f"{out}{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("hkv", [2, 4])
def test_two_rank_merged_backward_split_equals_one_call(hkv):
    """2 gloo ranks, bf16 causal zigzag ring: the own block's dq at the first step and its dk/dv
    after the last, in the float32 dq's memory narrowed in place (merged._own_split): dq, dk, dv
    as one float64 call's within the bf16 rule (<= 2x one bf16 call's error + 1e-2); returned as
    views of one buffer (dv too where Hq >= 2 Hkv; Hq == Hkv: dk fits, dv is new)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_split_worker, args=(2, init, hkv, os.path.join(tmp, "rank")), nprocs=2, join=True)
        rows = {r: torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)}
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, h, 64, 16, generator=g, dtype=torch.bfloat16) for h in (4, hkv, hkv, 4))

    def grads(dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        ad.sdpa(*leaves, enable_gqa=True, causal="bottom_right", backend="math").backward(do.to(dtype))
        return [t.grad.double() for t in leaves]

    exact, bf16 = grads(torch.float64), grads(torch.bfloat16)
    for rank, (got, one) in rows.items():
        assert one == [True, True, hkv * 2 <= 4], (rank, one)
        for name, x, e, b in zip(("dq", "dk", "dv"), got, exact, bf16):
            err, ref = (x.double() - e).abs().max().item(), (b - e).abs().max().item()
            assert err <= 2 * ref + 1e-2, (rank, name, err, ref)
