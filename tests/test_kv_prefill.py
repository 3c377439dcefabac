"""Many new queries over a dense KV cache (chunked prefill, speculative verification): on Hopper the
triton backend runs the Gluon forward over each sequence's whole key tiles and the decode kernel
over the keys past them, merged by the logsumexp (kernels/decode.cache_forward).

On the CPU the tail kernel's merge is checked against the definition, with the Gluon part
computed by the test from the definition; on the GPU (marked gpu) the whole route, with NaN in
the cache past every sequence's keys (never read)."""

from __future__ import annotations

import math

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.kernels import KernelParams
from attention_dispatch.kernels.decode import CACHE_DECODE, CACHE_GLUON, _launch_split, kv_route
from oracle import assert_matches
from test_kvcache import KvCase, kv_reference, make_kv_inputs, reference_append


def _partial(query, k_cache, v_cache, lengths, upto, causal):
    """(output, natural-log logsumexp) of each row over keys 0 .. upto[b]-1 only, the causal
    diagonal still that of the whole sequence (L_b = lengths[b]); float64, a row with no key
    0 and -inf, as the Gluon forward writes them."""
    B, Hq, Sq, D = query.shape
    group = Hq // k_cache.shape[1]
    out = torch.zeros(B, Hq, Sq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=torch.float64)
    for b in range(B):
        n = upto[b]
        i = torch.arange(Sq)[:, None]
        j = torch.arange(n)[None, :]
        ok = torch.ones(Sq, n, dtype=torch.bool)
        if causal:
            ok &= j <= i + lengths[b] - Sq
        for h in range(Hq):
            k = k_cache[b, h // group, :n].double()
            v = v_cache[b, h // group, :n].double()
            s = (query[b, h].double() @ k.T / math.sqrt(D)).masked_fill(~ok, -math.inf)
            row_lse = torch.logsumexp(s, -1)
            seen = ok.any(-1)
            p = torch.where(seen[:, None], torch.exp(s - row_lse[:, None]), torch.zeros(()))
            out[b, h] = p @ v
            lse[b, h] = torch.where(seen, row_lse, torch.full((), -math.inf, dtype=torch.float64))
    return out, lse


TAIL_CASES = {
    "causal, lengths across tiles": (True, (40, 5, 16), False),
    "causal, append": (True, (23, 0, 9), True),
    "not causal": (False, (40, 5, 16), False),
    "not causal, append, empty cache": (False, (0, 31, 17), True),
    "causal, cache shorter than Sq": (True, (3, 0, 12), False),
}


@pytest.mark.parametrize("label", list(TAIL_CASES))
def test_the_tail_kernel_merges_into_the_whole_tiles(label):
    """Keys from L_b // 16 * 16 on by the tail kernel, merged into the earlier keys' result."""
    causal, cached, append = TAIL_CASES[label]
    tail = 16
    case = KvCase(batch=3, heads_q=4, heads_kv=2, seqlen_q=8, capacity=48, append=append, causal=causal, lengths=cached)
    args = make_kv_inputs(case)
    q, k_cache, v_cache = args["query"], args["k_cache"], args["v_cache"]
    seqlens = args["cache_seqlens"]
    if append:
        k_cache, v_cache = reference_append(k_cache, v_cache, seqlens, args["k_new"], args["v_new"], None)
    n_new = case.seqlen_q if append else 0
    lengths = [n + n_new for n in cached]
    head, lse = _partial(q, k_cache, v_cache, lengths, [n // tail * tail for n in lengths], causal)
    out = head.to(q.dtype)
    params = KernelParams(
        scale=1.0 / math.sqrt(case.head_dim), align_bottom_right=True, window_right=0 if causal else -1
    )
    _launch_split(q, k_cache, v_cache, seqlens, None, out, params, n_new, 1, tail=tail, tail_lse=lse.float())
    ref64 = kv_reference(q, k_cache, v_cache, lengths, causal=causal)
    ref_low = kv_reference(q, k_cache, v_cache, lengths, causal=causal, dtype=q.dtype)
    assert_matches(out, ref64, ref_low, f"tail merge {label}", dtype=q.dtype)


def test_kv_route_names_the_decode_kernel_and_why_not_the_gluon_forward():
    q = torch.randn(1, 4, 256, 64)
    cache = torch.randn(1, 2, 512, 64)
    kernel, why_not = kv_route(q, cache, cache, None, KernelParams(scale=0.125, window_right=0))
    assert kernel == CACHE_DECODE and why_not


# ---- the GPU route --------------------------------------------------------------------------

# sizes past gluon.route.WS_MIN_WORK (B * Hq * Sq * capacity * D >= 2**32)
GPU_CASES = {
    "GQA 8/2 d128 causal append": KvCase(
        dtype=torch.bfloat16,
        batch=3,
        heads_q=16,
        heads_kv=4,
        seqlen_q=256,
        capacity=4096,
        head_dim=128,
        append=True,
        causal=True,
        lengths=(3840, 0, 777),
    ),
    "MHA d128 causal, cache shorter than Sq": KvCase(
        dtype=torch.float16,
        batch=3,
        heads_q=8,
        heads_kv=8,
        seqlen_q=512,
        capacity=4096,
        head_dim=128,
        causal=True,
        lengths=(100, 4096, 1000),
    ),
    "GQA 8/2 d128 not causal": KvCase(
        dtype=torch.bfloat16,
        batch=2,
        heads_q=16,
        heads_kv=4,
        seqlen_q=128,
        capacity=8192,
        head_dim=128,
        append=True,
        lengths=(8000, 63),
    ),
    "d256 causal append": KvCase(
        dtype=torch.bfloat16,
        batch=2,
        heads_q=16,
        heads_kv=4,
        seqlen_q=128,
        capacity=8192,
        head_dim=256,
        append=True,
        causal=True,
        lengths=(8000, 500),
    ),
    "d64 not causal": KvCase(
        dtype=torch.bfloat16,
        batch=2,
        heads_q=16,
        heads_kv=4,
        seqlen_q=256,
        capacity=8192,
        head_dim=64,
        lengths=(8000, 129),
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("label", list(GPU_CASES))
def test_gluon_route_matches_the_reference(label):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case = GPU_CASES[label]
    args = make_kv_inputs(case, "cuda")
    n_new = case.seqlen_q if case.append else 0
    # NaN past every sequence's keys (after the append): a kernel that reads them fails
    for b, n in enumerate(case.lengths):
        args["k_cache"][b, :, n + n_new :] = math.nan
        args["v_cache"][b, :, n + n_new :] = math.nan
    params = KernelParams(scale=1.0, window_right=0 if case.causal else -1)
    kernel, why_not = kv_route(args["query"], args["k_cache"], args["v_cache"], None, params)
    if kernel != CACHE_GLUON:
        pytest.skip(f"not the Gluon route here: {why_not}")
    k0, v0 = args["k_cache"].cpu().clone(), args["v_cache"].cpu().clone()
    out = ad.sdpa_with_kvcache(**args, backend="triton")
    seqlens = torch.tensor(case.lengths, dtype=torch.int32)
    if case.append:
        k, v = reference_append(k0, v0, seqlens, args["k_new"].cpu(), args["v_new"].cpu(), None)
    else:
        k, v = k0, v0
    lengths = [n + n_new for n in case.lengths]
    q = args["query"].cpu()
    ref64 = kv_reference(q, k, v, lengths, causal=case.causal)
    ref_low = kv_reference(q, k, v, lengths, causal=case.causal, dtype=case.dtype)
    assert_matches(out.cpu(), ref64, ref_low, f"gluon route {label}", dtype=case.dtype)


@pytest.mark.gpu
def test_gluon_route_under_cuda_graph_replay():
    """Captured once; between replays the query, k_new/v_new, the cache and cache_seqlens change
    in place; every replay matches the reference (the Gluon forward's descriptors and the tail's
    lengths are device data or fixed by the shapes)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case = KvCase(
        dtype=torch.bfloat16, batch=2, heads_q=16, heads_kv=4, seqlen_q=128, capacity=8192, head_dim=128,
        append=True, causal=True, lengths=(8000, 100),
    )  # fmt: skip
    args = make_kv_inputs(case, "cuda")
    kernel, why_not = kv_route(
        args["query"], args["k_cache"], args["v_cache"], None, KernelParams(scale=1.0, window_right=0)
    )
    if kernel != CACHE_GLUON:
        pytest.skip(f"not the Gluon route here: {why_not}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and decide outside the capture
        for _ in range(2):
            ad.sdpa_with_kvcache(**args, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ad.sdpa_with_kvcache(**args, backend="triton")
    for step, lengths in enumerate(((5, 8064), (4000, 0), (127, 129))):
        for name in ("query", "k_new", "v_new", "k_cache", "v_cache"):
            args[name].copy_(torch.randn_like(args[name]))
        args["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        k0, v0 = args["k_cache"].cpu(), args["v_cache"].cpu()
        graph.replay()
        torch.cuda.synchronize()
        k, v = reference_append(k0, v0, torch.tensor(lengths), args["k_new"].cpu(), args["v_new"].cpu(), None)
        total = [n + case.seqlen_q for n in lengths]
        q = args["query"].cpu()
        ref64 = kv_reference(q, k, v, total, causal=True)
        ref_low = kv_reference(q, k, v, total, causal=True, dtype=case.dtype)
        assert_matches(out.cpu(), ref64, ref_low, f"gluon route replay {step}", dtype=case.dtype)
