"""Head dims up to 512 (Dqk and Dv) in the triton backend (issue 36): the tl kernels forward and
backward against tests/naive.py in float64 (tests/oracle.py's rule), d > 512 a reason naming the
limit, the routes that stop at 256 (the Gluon kernels) saying why, and the decode kernel over a
KV cache.  CPU cases run under TRITON_INTERPRET=1 (tiny shapes); gpu-marked ones in bf16 on the
H100 (S = 256..1024)."""

import dataclasses

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.api import normalize_call
from attention_dispatch.kernels import KERNEL_LIMITS
from cases import Case
from oracle import compare_backend
from test_kvcache import KvCase, check_kv_call

MAX = KERNEL_LIMITS.max_head_dim


def test_the_limit_is_512_and_the_triton_backend_claims_it():
    assert MAX == 512
    caps = ad.get_backend("triton").capabilities
    assert caps.head_dim_max == 512 and caps.different_head_dims
    from test_capabilities import claimed_cases

    # the capability claims exercise the new maximum (tests/test_capabilities.py)
    assert any(c.head_dim == MAX for _, c, _ in claimed_cases(caps))


# (label, case): tiny shapes that still cross several of the interpreter's 16/32-row tiles
CPU_CASES = [
    ("d512", Case(batch=1, heads_q=2, heads_kv=2, seqlen_q=40, seqlen_k=33, head_dim=512)),
    (
        "512/256 causal top-left Sq>Sk",
        Case(batch=1, heads_q=2, heads_kv=2, seqlen_q=37, seqlen_k=21, head_dim=512, head_dim_v=256, causal="top_left"),
    ),
    (
        "320/512 GQA causal bottom-right",
        Case(
            batch=1,
            heads_q=4,
            heads_kv=2,
            seqlen_q=19,
            seqlen_k=35,
            head_dim=320,
            head_dim_v=512,
            causal="bottom_right",
        ),
    ),
    (
        "d512 bf16 GQA window bias grad",
        Case(
            batch=1,
            heads_q=2,
            heads_kv=1,
            seqlen_q=26,
            seqlen_k=26,
            head_dim=512,
            dtype=torch.bfloat16,
            window=(9, 4),
            mask="float_grad",
            mask_shape="heads",
        ),
    ),
]


@pytest.mark.parametrize("label,case", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_head_dim_512_forward_and_backward_match_the_oracle(label, case):
    compare_backend(case, "triton")


@pytest.mark.parametrize("dims", [(512, 512), (320, 512), (512, 256), (257, 257)])
def test_every_kernel_kind_has_configs_for_head_dims_up_to_512(dims):
    """Hopper (227 KiB) and A100 (163 KiB), half precision: each pass has candidates whose
    shared-memory estimate fits; on sm90 the forward takes the measured best first
    (docs/experiments/head-dim-512.md).  float32 has its small fallback tiles."""
    from attention_dispatch.kernels import configs as C

    for cc, smem in (((9, 0), 227 * 1024), ((8, 0), 163 * 1024)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert C.arch_reason(*dims, dtype, cc, smem) is None
            for kind in C.KINDS:
                cands = C.candidate_configs(kind, *dims, dtype, cc, smem)
                bdq, bdv = C.block_d(dims[0]), C.block_d(dims[1])
                esize = torch.empty((), dtype=dtype).element_size()
                assert cands and all(C.shared_memory_estimate(kind, c, bdq, bdv, esize) <= smem for c in cands)
    first = {k: C.candidate_configs(k, *dims, torch.bfloat16, (9, 0), 227 * 1024)[0][:4] for k in C.KINDS}
    assert first == {C.FWD: (64, 64, 8, 1), C.BWD_DKDV: (32, 32, 8, 2), C.BWD_DQ: (64, 32, 8, 1)}


def test_head_dim_past_512_is_rejected_with_a_reason_naming_it():
    q = torch.randn(1, 1, 4, 520)
    reasons = ad.get_backend("triton").reasons(normalize_call(q, q, q).problem)
    assert "head_dim=520 > 512" in reasons
    v = torch.randn(1, 1, 4, 544)  # Dv alone past the limit
    reasons = ad.get_backend("triton").reasons(normalize_call(q[..., :64], q[..., :64], v).problem)
    assert any("544 > 512" in r for r in reasons), reasons
    with pytest.raises(ad.NoBackendError, match="head_dim=520 > 512"):
        ad.sdpa(q, q, q, backend="triton")


def test_the_gluon_kernels_refuse_head_dims_past_256_with_a_reason(monkeypatch):
    """The warp-specialised sm90 kernels have configs up to d256: a d512 call keeps the tl
    kernels, and the route says why (the Triton version check passed over here)."""
    from attention_dispatch.kernels import KernelParams
    from attention_dispatch.kernels.gluon import route
    from attention_dispatch.kernels.shapes import KernelShapes

    monkeypatch.setattr(route, "gluon_reason", lambda: None)
    params = KernelParams(scale=512**-0.5)
    for dqk, dv in ((512, 512), (320, 320), (512, 256)):
        q = torch.empty(2, 8, 4096, dqk, dtype=torch.bfloat16)
        v = torch.empty(2, 8, 4096, dv, dtype=torch.bfloat16)
        prob = KernelShapes(q, q, v, None, None, None, None)
        why = route.ws_forward_reason(prob, None, params, torch.bfloat16, (9, 0), True, 1, 1)
        assert why is not None and f"head dims {dqk}/{dv}" in why, why


def test_decode_kernel_takes_head_dim_512_over_a_kv_cache():
    check_kv_call("triton", KvCase(batch=2, heads_q=4, heads_kv=2, capacity=48, head_dim=512, append=True))
    check_kv_call("triton", KvCase(batch=2, heads_q=2, heads_kv=1, capacity=64, head_dim=512, block_size=16))


# ---------------------------------------------------------------- GPU (bf16, the H100)
GPU_CASES = [
    (
        "d512 S=1024 causal",
        Case(batch=1, heads_q=4, heads_kv=4, seqlen_q=1024, seqlen_k=1024, head_dim=512, causal="top_left"),
    ),
    (
        "512/256 GQA S=512 causal bottom-right",
        Case(
            batch=1,
            heads_q=8,
            heads_kv=2,
            seqlen_q=384,
            seqlen_k=512,
            head_dim=512,
            head_dim_v=256,
            causal="bottom_right",
        ),
    ),
    ("320/512 S=768", Case(batch=1, heads_q=4, heads_kv=4, seqlen_q=768, seqlen_k=768, head_dim=320, head_dim_v=512)),
    (
        "d512 S=512 bias grad window",
        Case(
            batch=1,
            heads_q=4,
            heads_kv=4,
            seqlen_q=512,
            seqlen_k=512,
            head_dim=512,
            window=(200, 50),
            mask="float_grad",
            mask_shape="heads",
        ),
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("label,case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_head_dim_512_on_the_gpu(label, case):
    case = dataclasses.replace(case, dtype=torch.bfloat16)
    compare_backend(case, "triton", device="cuda")


# the head-dim-chunked forward's tiles forced: one stage of 64-key tiles in 128-column chunks, two
# of 32-key tiles in 64-column chunks (benchmarks/head_dim_512.py's sweep candidates)
DCHUNK_GPU = [(64, 64, 8, 1, 1, True, 128), (64, 32, 8, 2, 1, True, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", DCHUNK_GPU, ids=str)
@pytest.mark.parametrize("label,case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_head_dim_512_chunked_forward_on_the_gpu(monkeypatch, label, case, cfg):
    from attention_dispatch.kernels import configs as C

    candidates = C.candidate_configs
    monkeypatch.setattr(
        C,
        "candidate_configs",
        lambda kind, *a, **k: [C.KernelConfig(*cfg)] if kind == C.FWD else candidates(kind, *a, **k),
    )
    seen = _dchunk_launches(monkeypatch)
    compare_backend(dataclasses.replace(case, dtype=torch.bfloat16), "triton", device="cuda")
    assert seen and all(dk == cfg[-1] for dk in seen), seen


@pytest.mark.gpu
def test_head_dim_512_route_on_the_gpu_names_the_tl_kernels():
    """On the H100 the Gluon kernels are passed over for d512 with the head-dim reason."""
    q = torch.randn(2, 8, 4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    call = normalize_call(q, q, q, is_causal=True)
    route = ad.get_backend("triton").route(call.query, call.key, call.value, call.options)
    assert [s.chosen for s in route.steps] == ["tl", "tl", "tl"], route
    for step in route.steps:
        assert any(name == "gluon" and "head dims 512/512" in why for name, why in step.passed_over), step


@pytest.mark.gpu
def test_decode_kernel_head_dim_512_on_the_gpu():
    check_kv_call(
        "triton",
        KvCase(dtype=torch.bfloat16, batch=2, heads_q=8, heads_kv=2, capacity=2048, head_dim=512, append=True),
        device="cuda",
    )


# ---------------------------------------------------------------- the head-dim-chunked forward loop
# 16-bit calls past d256 run the forward's chunked loop (configs.dchunk_applies; the interpreter's
# INTERPRETER_FWD_DCHUNK, 128 columns a chunk): every feature of the tl forward through it, in
# float16 at tiny shapes, with the backward's gradients (an unchanged kernel) against naive in float64.
def _chunked(d=512, dv=None, b=1, hq=2, hkv=2, sq=9, sk=13):
    from test_kernel_features import F16, rand

    return rand(b, hq, sq, d, dtype=F16), rand(b, hkv, sk, d, dtype=F16), rand(b, hkv, sk, dv or d, dtype=F16)


def _dchunk_launches(monkeypatch):
    """The BLOCK_DK of every forward launch, recorded."""
    from attention_dispatch.kernels import run

    seen, launch = [], run.launch_one

    def record(kernel, grid, args, constexprs, *a, **k):
        if "SUBTILES" in constexprs:  # the forward
            seen.append(constexprs.get("BLOCK_DK", 0))
        return launch(kernel, grid, args, constexprs, *a, **k)

    monkeypatch.setattr(run, "launch_one", record)
    return seen


@pytest.mark.parametrize(
    "dims,causal", [((512, 512), "bottom_right"), ((320, 512), "top_left"), ((512, 256), None)], ids=str
)
def test_chunked_forward_all_score_features(monkeypatch, dims, causal):
    from test_kernel_features import ALL, check

    seen = _dchunk_launches(monkeypatch)
    check(*_chunked(*dims), causal=causal, **ALL)
    assert seen and all(dk == 128 for dk in seen), seen


def test_chunked_forward_window_gqa_bias_grad():
    from test_kernel_features import ALL, F16, check, rand

    q, k, v = _chunked(hq=4, hkv=2, sq=11, sk=9)
    check(q, k, v, rand(1, 4, 1, 9, dtype=F16), window=(3, 1), **ALL)


def test_chunked_forward_varlen_dropout():
    from test_kernel_features import ALL, DEV, F16, check, rand

    # query lengths 5, 0, 7 over key lengths 6, 4, 3
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 6, 10, 13], dtype=torch.int32, device=DEV)
    q, k, v = rand(12, 2, 512, dtype=F16), rand(13, 1, 512, dtype=F16), rand(13, 1, 512, dtype=F16)
    check(q, k, v, causal="bottom_right", cu=(cu_q, cu_k), max_s=(7, 6), dropout_p=0.3, **ALL)


def test_float32_and_forced_tiles_keep_the_whole_row_loop(monkeypatch):
    """float32 (exact scores, issue 38) and forced tiles run the unchunked loop."""
    from attention_dispatch.kernels import KernelParams, triton_attention

    seen = _dchunk_launches(monkeypatch)
    q = torch.randn(1, 1, 8, 320)
    triton_attention(q, q, q, None, KernelParams(scale=0.1))
    triton_attention(q.half(), q.half(), q.half(), None, KernelParams(scale=0.1, block_m=16, block_n=16))
    assert seen == [0, 0]
