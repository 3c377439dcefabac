"""Many new queries over a dense KV cache (chunked prefill, speculative verification): on Hopper the
triton backend runs the Gluon forward over each sequence's key tiles, the partial last one
masked (kernels/decode.cache_forward).  The Gluon kernels do not run on the CPU: the route's
reasons are checked here, the route itself on the GPU (marked gpu), with NaN in the cache past
every sequence's keys (masked, and their V rows zeroed before the product)."""

from __future__ import annotations

import math

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.kernels import KernelParams
from attention_dispatch.kernels.decode import CACHE_DECODE, CACHE_GLUON, kv_route
from oracle import assert_matches
from test_kvcache import KvCase, kv_reference, make_kv_inputs, reference_append


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


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gluon_route_per_warp_release_is_the_mbarrier_release(monkeypatch, causal):
    """The KV-cache forward with its K/V slots released per warp on named barriers (E156, as shipped) and on
    the mbarriers: bit-equal outputs, over sequences of 0 keys (no tile: no release), one tile (fewer tiles
    than slots), 130 and 8000 (the ring wraps), so every release count the loader waits on is met."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from attention_dispatch.kernels import configs

    case = KvCase(
        dtype=torch.bfloat16, batch=4, heads_q=16, heads_kv=4, seqlen_q=128, capacity=8192, head_dim=128,
        causal=causal, lengths=(8000, 0, 63, 130),
    )  # fmt: skip
    args = make_kv_inputs(case, "cuda")
    params = KernelParams(scale=1.0, window_right=0 if causal else -1)
    kernel, why_not = kv_route(args["query"], args["k_cache"], args["v_cache"], None, params)
    if kernel != CACHE_GLUON:
        pytest.skip(f"not the Gluon route here: {why_not}")
    shipped = configs.WS_FWD_CACHE_CONFIGS[128]
    assert shipped.warp_release
    out = ad.sdpa_with_kvcache(**args, backend="triton")
    monkeypatch.setitem(configs.WS_FWD_CACHE_CONFIGS, 128, shipped._replace(warp_release=False))
    ad.clear_cache()  # the call's captured launches (its replay plan) would run the first kernel again
    out_mbarrier = ad.sdpa_with_kvcache(**args, backend="triton")
    ad.clear_cache()
    torch.cuda.synchronize()
    assert not out.isnan().any() and torch.equal(out, out_mbarrier)
