"""Backend.run_backward(dq_accumulator=) (Capabilities.backward_dq_accumulator): the query's
gradient added, unrounded, into a given tensor of the lse dtype, a rank's sum over its blocks in
context parallelism (backward="merged"). Against the same call returning its dq: the rows of the
accumulator it covers gain exactly that dq (before rounding), no other row changes. Generated from
what the backends declare. And the peak of what the merged backward allocates per rank, counted
on 2 gloo ranks (benchmarks/cp_memory.py), is below the float32-per-block scheme's."""

from __future__ import annotations

import inspect
import os
import sys
import tempfile

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import registry
from attention_dispatch.backends.base import Backend
from attention_dispatch.call import normalize_call

from cases import cpu_backends_declaring

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_declared_exactly_where_run_backward_takes_an_accumulator():
    for name in ad.list_backends():
        backend = registry.get_backend(name)
        own = type(backend).run_backward
        takes = own is not Backend.run_backward and "dq_accumulator" in inspect.signature(own).parameters
        assert backend.capabilities.backward_dq_accumulator == takes, name
        assert not takes or backend.capabilities.backward_from_output, name
    assert {"math", "triton"} <= {
        n for n in ad.list_backends() if registry.get_backend(n).capabilities.backward_dq_accumulator
    }


def _call(dtype, causal):
    q = torch.randn(1, 4, 32, 16).to(dtype)
    k, v = torch.randn(1, 2, 48, 16).to(dtype), torch.randn(1, 2, 48, 16).to(dtype)
    call = normalize_call(q, k, v, enable_gqa=True, causal="bottom_right" if causal else None)
    out, lse = ad.sdpa(q, k, v, enable_gqa=True, causal="bottom_right" if causal else None, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    return call, out, lse, dout, dlse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_dq_accumulator"))
def test_accumulated_dq_is_the_returned_dq_added_to_its_rows(backend, causal):
    for dtype in (torch.float64,) if backend == "math" else (torch.float32, torch.bfloat16):
        call, out, lse, dout, dlse = _call(dtype, causal)
        chosen = registry.get_backend(backend)
        args = (call.query, call.key, call.value, out, lse, dout, dlse)
        dq, dk, dv = chosen.run_backward(*args, **call.options)
        compute = lse.dtype
        # a slice of a larger buffer's rows (a block's rows in a rank's accumulator), random before
        whole = torch.randn(1, 4, 80, 16, dtype=compute)
        before = whole.clone()
        rows = slice(24, 56)
        none, dk2, dv2 = chosen.run_backward(*args, dq_accumulator=whole[:, :, rows], **call.options)
        assert none is None and torch.equal(dk2, dk) and torch.equal(dv2, dv), dtype
        outside = torch.ones(80, dtype=torch.bool)
        outside[rows] = False
        assert torch.equal(whole[:, :, outside], before[:, :, outside]), dtype
        zero = torch.zeros(1, 4, 32, 16, dtype=compute)
        chosen.run_backward(*args, dq_accumulator=zero, **call.options)
        assert zero.isfinite().all()
        # the returned dq is the accumulated one rounded once to the input dtype
        assert torch.equal(zero.to(dtype), dq), dtype
        assert torch.equal(whole[:, :, rows], before[:, :, rows] + zero), dtype


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_dq_accumulator"))
def test_row_slices_of_query_and_dout_give_their_copies_gradients(backend, causal):
    """The merged backward passes a block's rows of the rank's q and dout where they lie (no
    whole-row copies): the same arithmetic, so the copies' gradients bit for bit, both layouts."""
    for dtype in (torch.float64,) if backend == "math" else (torch.float32, torch.bfloat16):
        call, out, lse, dout, dlse = _call(dtype, causal)
        chosen = registry.get_backend(backend)
        rows = slice(24, 56)
        for tokens_first in (False, True):  # (B, H, S, D) and (B, S, H, D) memory
            bigger = torch.randn(1, 80, 4, 16) if tokens_first else torch.randn(1, 4, 80, 16)
            q_big, do_big = bigger.to(dtype), torch.randn_like(bigger).to(dtype)
            seq = (slice(None), rows) if tokens_first else (slice(None), slice(None), rows)
            q_part, do_part = q_big[seq], do_big[seq]
            if tokens_first:
                q_part, do_part = q_part.transpose(1, 2), do_part.transpose(1, 2)
            assert not q_part.is_contiguous() and q_part.shape == call.query.shape
            kv = (call.key, call.value)
            got = chosen.run_backward(q_part, *kv, out, lse, do_part, dlse, **call.options)
            want = chosen.run_backward(q_part.contiguous(), *kv, out, lse, do_part.contiguous(), dlse, **call.options)
            for name, g, w in zip(("dq", "dk", "dv"), got, want):
                assert g.isfinite().all() and torch.equal(g, w), (dtype, tokens_first, name)


def test_seq_rows_reads_a_slice_of_rows_in_either_layout():
    """kernels.shapes.seq_rows: a block's rows of a longer (B, H, S, D) or (B, S, H, D) tensor are
    rows of that layout, sequences S_whole apart; a slice of heads or a permuted tensor is not."""
    pytest.importorskip("triton")
    from attention_dispatch.kernels.shapes import row_matrix, rows_layout, seq_rows

    heads_first = torch.zeros(2, 4, 80, 16)[:, :, 24:56]
    tokens_first = torch.zeros(2, 80, 4, 16)[:, 24:56].transpose(1, 2)
    assert rows_layout(heads_first) == 0 and rows_layout(heads_first, strided=True) == 1
    assert seq_rows(heads_first, 1) == 80 and row_matrix(heads_first, 1) == (7 * 80 + 32, 16)
    assert rows_layout(tokens_first, strided=True) == 2 and seq_rows(tokens_first, 2) == 80
    assert row_matrix(tokens_first, 2) == (80 + 32, 64)
    whole = torch.zeros(2, 4, 32, 16)
    assert seq_rows(whole, 1) == 32 and row_matrix(whole, 1) == (2 * 4 * 32, 16)
    assert seq_rows(torch.zeros(2, 8, 32, 16)[:, :4], 1) is None
    assert seq_rows(torch.zeros(2, 32, 4, 16).permute(0, 3, 1, 2)[..., :16], 1) is None


@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_dq_accumulator"))
def test_a_wrong_accumulator_is_refused_naming_it(backend):
    call, out, lse, dout, dlse = _call(torch.float64 if backend == "math" else torch.float32, False)
    chosen = registry.get_backend(backend)
    args = (call.query, call.key, call.value, out, lse, dout, dlse)
    for bad in (torch.zeros(1, 4, 31, 16, dtype=lse.dtype), torch.zeros(1, 4, 32, 16, dtype=torch.float16)):
        with pytest.raises(ValueError, match="dq_accumulator must be .* of the query's shape"):
            chosen.run_backward(*args, dq_accumulator=bad, **call.options)


@pytest.mark.skipif(not INTERPRET, reason="the triton kernels under the interpreter (TRITON_INTERPRET=1)")
def test_merged_backward_allocates_less_than_a_float32_dq_per_block():
    """2 gloo ranks, S = 256: each rank's backward peaks at ~3.12 / 3.12 local query shards (a
    float32 dQ per block cast and added into a bf16 one, and the own keys' gradients in flight
    during the second step: 7.56 / 8.06; rank 0's whole-row q and dout copies: 6.06; the last
    block's dk/dv new and the other rank's key gradients received whole: 5.06 / 5.06; the GPU's
    route followed on the CPU, cp_memory._gpu_like_launches; rank 1's last block's keys copied
    out of the received ones: 4.56; the other rank's key gradients received in 2 pieces a tensor,
    not 4: 4.25; the own block's dK/dV at the first step beside the float32 dq, not after the last
    block in the freed half of the dq narrowed in place, merged.own_grads: 4.12)."""
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import cp_memory

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(cp_memory._worker, args=(2, 256, "triton", init, queue), nprocs=2, join=True)
    rows = {rank: (peak, branches) for rank, peak, _, branches in (queue.get() for _ in range(2))}
    assert rows[0][0] <= 3.15 and rows[1][0] <= 3.15, rows
    # as the GPU's Gluon route: the own causal block's separate dQ pass at the first step, into
    # the accumulator's memory, its dK/dV after the last block (fused, over its keys) into dk_out
    for _, branches in rows.values():
        assert [b[2:] for b in branches] == [
            ["separate dQ (bf16, into dq_out)", "-"],
            ["dQ fused into dK/dV", "in place over the keys it read"],
            ["-", "into dk_out"],
        ], branches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_gpu_gluon_fused_dq_adds_into_a_row_slice(causal):
    """The Gluon fused dK/dV (sm90) reduce-adds dQ into an accumulator whose heads are rows apart
    by more than Sq (a block's rows of a rank's accumulator), and causal's separate Gluon dQ pass
    is added into it: those rows gain the dq the call returns (to their rounding), no other row
    changes."""
    from attention_dispatch.kernels.entry import describe_route
    from attention_dispatch.kernels.params import KernelParams

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 4096, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, 4, 4096, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    chosen = registry.get_backend("triton")
    call = normalize_call(q, k, v, enable_gqa=True, causal=causal)
    out, lse = ad.sdpa(q, k, v, enable_gqa=True, causal=causal, return_lse=True, backend="triton")
    dout = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
    args = (call.query, call.key, call.value, out, lse, dout, None)
    if torch.cuda.get_device_capability() == (9, 0):
        params = KernelParams(scale=128**-0.5, window_left=-1, window_right=0 if causal else -1)
        steps = describe_route(q, k, v, None, params, backward=True)
        # causal keeps the separate Gluon dQ pass (measured faster, E54): its dq is added after it
        assert steps[-1][1] == ("fused" if causal is None else "gluon"), steps
    dq, dk, dv = chosen.run_backward(*args, **call.options)
    whole = torch.randn(1, 8, 6144, 128, device="cuda", generator=g)
    before = whole.clone()
    rows = slice(1024, 5120)
    none, dk2, dv2 = chosen.run_backward(*args, dq_accumulator=whole[:, :, rows], **call.options)
    assert none is None
    assert torch.equal(whole[:, :, :1024], before[:, :, :1024]) and torch.equal(whole[:, :, 5120:], before[:, :, 5120:])
    added = whole[:, :, rows] - before[:, :, rows]
    assert added.isfinite().all()
    scale = dq.float().abs().max().item()
    assert (added - dq.float()).abs().max().item() <= 1e-2 * scale  # dq rounded to bf16, sums reordered
    assert (dk2.float() - dk.float()).abs().max().item() <= 1e-2 * dk.float().abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [None, "top_left"])
@pytest.mark.parametrize("tokens_first", [False, True])
def test_gpu_gluon_backward_reads_query_and_dout_row_slices(causal, tokens_first):
    """The Gluon dK/dV (+fused dQ) and dQ passes (sm90) read q and dO as a block's rows of longer
    tensors (their sequences seq_rows apart): dK, dV and the separate pass's dQ equal their
    contiguous copies' bit for bit, the fused dQ (reduce-adds in any order) to its rounding."""
    from attention_dispatch.kernels.gluon.route import ws_backward_reason
    from attention_dispatch.kernels.params import KernelParams
    from attention_dispatch.kernels.shapes import KernelShapes

    g = torch.Generator(device="cuda").manual_seed(0)
    S, rows = 4096, slice(1024, 5120)
    shape = (1, 6144, 8, 128) if tokens_first else (1, 8, 6144, 128)
    q_big, do_big = (torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(2))
    q, dout = (t[:, rows].transpose(1, 2) if tokens_first else t[:, :, rows] for t in (q_big, do_big))
    k, v = (torch.randn(1, 4, S, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    chosen = registry.get_backend("triton")
    call = normalize_call(q, k, v, enable_gqa=True, causal=causal)
    out, lse = ad.sdpa(q.contiguous(), k, v, enable_gqa=True, causal=causal, return_lse=True, backend="triton")
    if torch.cuda.get_device_capability() == (9, 0):
        params = KernelParams(scale=128**-0.5, window_left=-1, window_right=0 if causal else -1)
        reason, _ = ws_backward_reason(dout, q, k, v, None, params, KernelShapes(q, k, v, None, None, None, None), True)
        assert reason is None, reason
    got = chosen.run_backward(q, k, v, out, lse, dout, None, **call.options)
    want = chosen.run_backward(q.contiguous(), k, v, out, lse, dout.contiguous(), None, **call.options)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    if causal:  # the separate Gluon dQ pass: the same arithmetic
        assert torch.equal(got[0], want[0])
    else:
        assert (got[0].float() - want[0].float()).abs().max().item() <= 1e-2 * want[0].float().abs().max().item()
    assert all(t.isfinite().all() for t in got)


@pytest.mark.skipif(not INTERPRET, reason="the delta pass runs on CPU tensors under TRITON_INTERPRET=1")
@pytest.mark.parametrize("overwrite", [False, True])
def test_gluon_separate_dq_into_an_accumulator_is_freed_before_dkdv(monkeypatch, overwrite):
    """The Gluon route with a separate dQ pass (causal: gluon.route.fuse_dq_reason) and an
    accumulator: the dQ pass runs first, its q-dtype dq is added into the accumulator and no longer
    alive when the dK/dV pass starts (the GPU's merged step held both: issue 40's 0.754 GiB at
    64k); the accumulator gains exactly that dq. Stand-in passes, the real entry glue."""
    import weakref

    from attention_dispatch.kernels import entry
    from attention_dispatch.kernels.gluon import launch as gluon_launch
    from attention_dispatch.kernels.params import KernelParams

    monkeypatch.setattr(
        entry,
        "backward_route",
        lambda *a, **kw: entry.BackwardRoute(entry.GLUON, entry.GLUON, None, "causal", (1, 1, 1)),
    )
    events, made = [], {}

    def fake_dq(q, k, v, do, lse, delta, params, prob, *rows, bias=None, alibi=None, out=None):
        made["dq"] = torch.randn(q.shape, dtype=q.dtype)
        events.append("dq")
        return made["dq"].clone()

    def fake_dkdv(q, k, v, do, lse, delta, params, prob, *rows, dk_out=None, dv_out=None, **kw):
        events.append(("dkdv", [r() is not None for r in made["alive"]]))
        dk = k if dk_out is not None else torch.empty_like(k)
        dv = v if dv_out is not None else torch.empty_like(v)
        return dk.fill_(1), dv.fill_(2), None

    monkeypatch.setattr(gluon_launch, "dq", fake_dq)
    monkeypatch.setattr(gluon_launch, "dkdv", fake_dkdv)
    real_add = torch.Tensor.add_
    made["alive"] = []

    q, do, out = (torch.randn(1, 4, 64, 16).half() for _ in range(3))
    k, v = torch.randn(1, 2, 64, 16).half(), torch.randn(1, 2, 64, 16).half()
    lse = torch.randn(1, 4, 64)
    acc = torch.randn(1, 4, 64, 16)
    before = acc.clone()

    def add_(self, other, *a, **kw):  # the accumulator's add: remember the dq it was given
        if self is acc:
            made["alive"].append(weakref.ref(other))
        return real_add(self, other, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "add_", add_)
    params = KernelParams(scale=0.25, align_bottom_right=False, window_left=-1, window_right=0)
    got = entry.attention_backward(
        do, q, k, v, None, out, lse, None, params, dq_accumulator=acc,
        **({"dk_out": k, "dv_out": v} if overwrite else {}),
    )  # fmt: skip
    assert got[0] is None and events[0] == "dq" and events[1] == ("dkdv", [False])
    assert torch.equal(acc, before + made["dq"].float())
