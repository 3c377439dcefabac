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
from attention_dispatch.kernels import configs as C
from cases import Case
from launch_watch import sm90, watch_kinds
from oracle import compare_backend, triton_keep_mask
from test_kvcache import KvCase, check_kv_call

MAX = KERNEL_LIMITS.max_head_dim


def test_the_limit_is_512_and_the_triton_backend_claims_it():
    assert MAX == 512
    caps = ad.get_backend("triton").capabilities
    assert caps.head_dim_max == 512 and caps.different_head_dims
    from test_capabilities import claimed_cases

    # the capability claims exercise the new maximum (tests/test_capabilities.py)
    assert any(c.head_dim == MAX for _, c, _ in claimed_cases(caps))


# (label, case): float32 (one dK/dV pass); test_wide_backward runs them in half precision (split passes).
# Tiny shapes that still cross several of the interpreter's 16/32-row tiles
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
        "d512 GQA window bias grad",
        Case(
            batch=1,
            heads_q=2,
            heads_kv=1,
            seqlen_q=26,
            seqlen_k=26,
            head_dim=512,
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


def test_the_kernel_limits_are_reported_once():
    """device, dtype and head dims are KERNEL_LIMITS, reported by the capabilities; the backend's own
    check (arch and shared memory) does not repeat them in other words."""
    triton_backend = ad.get_backend("triton")
    for q, v, limit in (
        (torch.randn(1, 1, 4, 16, dtype=torch.float64), None, "dtype"),
        (torch.randn(1, 1, 4, 520), None, "520"),
        (torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 544), "544"),
        (torch.randn(1, 1, 4, 16, device="meta"), None, "meta"),
    ):
        reasons = triton_backend.reasons(normalize_call(q, q, q if v is None else v).problem)
        assert sum(limit in r for r in reasons) == 1, reasons


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
_WINDOW_BIAS = Case(
    batch=1,
    heads_q=4,
    heads_kv=4,
    seqlen_q=512,
    seqlen_k=512,
    head_dim=512,
    window=(200, 50),
    mask="float_grad",
    mask_shape="heads",
)
GPU_CASES = [
    ("d512 S=1024", Case(batch=1, heads_q=4, heads_kv=4, seqlen_q=1024, seqlen_k=1024, head_dim=512)),
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
    ("d512 S=512 bias grad window", _WINDOW_BIAS),
    ("d512 S=512 bias grad window dropout", dataclasses.replace(_WINDOW_BIAS, seqlen_k=520, dropout_p=0.1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("label,case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_head_dim_512_on_the_gpu(label, case, monkeypatch):
    """Against float64; on sm90 the backward launches dV and dK apart (configs.wide_backward, E108)."""
    seen = watch_kinds(monkeypatch)
    case = dataclasses.replace(case, dtype=torch.bfloat16)
    compare_backend(case, "triton", keep_fn=triton_keep_mask if case.dropout_p else None, device="cuda")
    if sm90():
        assert C.BWD_DV in seen and C.BWD_DK in seen and C.BWD_DKDV not in seen, seen


@pytest.mark.gpu
def test_head_dim_512_route_on_the_gpu_names_the_d512_forward_and_the_tl_backward():
    """On the H100 the forward is the Gluon d512 one (tests/test_gluon_d512.py; the tl forward where
    this Triton runs no Gluon kernel, saying why); the backward passes are the tl ones, the
    d<=256 Gluon kernels passed over with the head-dim reason."""
    from attention_dispatch.kernels.gluon import route_d512
    from attention_dispatch.kernels.gluon.route import gluon_reason

    q = torch.randn(2, 8, 4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    call = normalize_call(q, q, q, is_causal=True)
    route = ad.get_backend("triton").route(call.query, call.key, call.value, call.options)
    why_not = gluon_reason() or (None if route_d512.GPU_VERIFIED else "not yet verified on a GPU")
    forward = "gluon d512" if why_not is None else "tl"
    assert [s.chosen for s in route.steps] == [forward, "tl", "tl"], route
    if forward == "tl":
        ((name, why),) = route.steps[0].passed_over
        assert name == "gluon d512" and why.startswith(why_not), route.steps[0]
    for step in route.steps[1:]:
        assert any(name == "gluon" and "head dims 512/512" in why for name, why in step.passed_over), step


@pytest.mark.gpu
def test_decode_kernel_head_dim_512_on_the_gpu():
    check_kv_call(
        "triton",
        KvCase(dtype=torch.bfloat16, batch=2, heads_q=8, heads_kv=2, capacity=2048, head_dim=512, append=True),
        device="cuda",
    )
