"""Causal calls with Sq < Sk (chunked prefill over a dense cache, bottom-right; top-left reads
only the first Sq keys) on the Gluon forward as a KV-cache call: every cached length 0 (the
package's constant zeros) and L new keys (gluon.route.one_length), the last key tile masked past L.
The backward
stays on the tl passes (the Gluon ones take banded calls with Sq == Sk only) and reads the
forward's logsumexp.  CPU: the route and its reasons; GPU (marked gpu): the numbers against the
math backend in float64."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.kernels import KernelParams, configs, describe_route, triton_attention  # noqa: E402
from attention_dispatch.kernels import entry  # noqa: E402
from attention_dispatch.kernels.gluon import launch as gluon_launch  # noqa: E402
from attention_dispatch.kernels.gluon import route as gluon_route  # noqa: E402
from attention_dispatch.kernels.shapes import KernelShapes  # noqa: E402
from launch_watch import sm90, watch_launches  # noqa: E402
from naive import naive_attention  # noqa: E402
from oracle import assert_matches, check_stored_forward_backward  # noqa: E402

BF16, F16 = torch.bfloat16, torch.float16
CAUSAL = {"bottom_right": True, "top_left": False}  # align_bottom_right


def _params(causal: str | None = "bottom_right", window=None, **kw) -> KernelParams:
    left, right = window or ((-1, 0) if causal else (-1, -1))
    return KernelParams(
        scale=0.1, align_bottom_right=CAUSAL.get(causal, False), window_left=left, window_right=right, **kw
    )


def _prob(sq: int, sk: int, d: int = 128, hq: int = 4, hkv: int = 2) -> KernelShapes:
    q, k = torch.empty(2, hq, sq, d), torch.empty(2, hkv, sk, d)
    return KernelShapes(q, k, k, None, None, None, None)


def _gluon_here(monkeypatch, min_work: int = 0):
    """The route's answers as on an H100 with the Triton the Gluon kernels are written for."""
    if gluon_launch.GLUON_IMPORT_ERROR is not None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(gluon_route, "GLUON_TRITON_VERSIONS", (triton.__version__,))
    monkeypatch.setattr(gluon_route, "device_info", lambda dev: ((9, 0), 132))
    monkeypatch.setattr(gluon_route, "WS_MIN_WORK", min_work)


@pytest.mark.parametrize(
    "causal, window, sq, sk, want",
    [
        ("bottom_right", None, 128, 1000, 1000),
        ("top_left", None, 128, 1000, 128),
        ("bottom_right", None, 256, 256, None),  # Sq == Sk: the dense tiles
        ("bottom_right", None, 256, 128, None),  # Sq > Sk: rows without keys
        (None, None, 128, 1000, None),  # not banded: the dense route
        (None, (1024, 0), 128, 2048, None),  # a window
        (None, (-1, 64), 128, 2048, None),
    ],
)
def test_one_length_is_the_keys_a_causal_row_can_see(causal, window, sq, sk, want):
    assert gluon_route.one_length(_params(causal, window), _prob(sq, sk)) == want


@pytest.mark.parametrize(
    "causal, window, sq, sk, lengths, reason",
    [
        ("bottom_right", None, 128, 1000, True, None),  # a partial last key tile
        ("top_left", None, 384, 8704, True, None),
        ("bottom_right", None, 128, 1000, False, "Sq != Sk"),  # the backward passes
        ("bottom_right", None, 256, 128, True, "causal with Sq > Sk"),
        (None, (1024, 0), 128, 2048, True, "window, or causal"),
        ("bottom_right", None, 192, 1000, True, "Sq=192: a multiple of 128 only"),
        (None, None, 128, 1000, True, "multiples of 128 and 128"),  # not banded: whole tiles as before
    ],
)
def test_forward_reasons_with_lengths(monkeypatch, causal, window, sq, sk, lengths, reason):
    """The forward (``lengths``) takes causal calls with Sq < Sk, the last key tile partial; the
    backward passes' answer is unchanged; a window with Sq != Sk stays off the Gluon kernels."""
    _gluon_here(monkeypatch)
    got = gluon_route.ws_forward_reason(
        _prob(sq, sk), None, _params(causal, window), BF16, (9, 0), True, 1, 1, lengths=lengths
    )
    assert got == reason if reason is None else (got is not None and reason in got), got


def test_forward_min_work_counts_the_keys_read(monkeypatch):
    """Top-left reads Sq keys a row at most: its work is B * Hq * Sq * Sq * D."""
    _gluon_here(monkeypatch, min_work=2 * 4 * 128 * 512 * 128)
    prob = _prob(128, 512)
    for causal, reason in (("bottom_right", None), ("top_left", "below WS_MIN_WORK")):
        got = gluon_route.ws_forward_reason(prob, None, _params(causal), BF16, (9, 0), True, 1, 1, lengths=True)
        assert got == reason if reason is None else reason in got, (causal, got)


def _cpu_qkv(sq, sk, d, hq=4, hkv=2, dtype=F16):
    return torch.randn(2, hq, sq, d, dtype=dtype), *(torch.randn(2, hkv, sk, d, dtype=dtype) for _ in range(2))


@pytest.mark.parametrize(
    "kw, forward, why",
    [
        (dict(), entry.GLUON_LENGTHS, None),
        (dict(causal="top_left"), entry.GLUON_LENGTHS, None),
        (dict(d=64), entry.TL, "dense calls only"),  # d64's config: the Gluon forward on dense calls
        (dict(softcap=5.0), entry.TL, "softcap: not in the Gluon one-length forward"),
        (dict(sinks=True), entry.TL, "sinks: not in the Gluon one-length forward"),
        (dict(alibi=True), entry.TL, "alibi_slopes: not in the Gluon one-length forward"),
        (dict(mask=True), entry.TL, "attn_mask: not in the Gluon one-length forward"),
        (dict(window=(2048, 0)), entry.TL, "window, or causal with Sq > Sk"),
    ],
)
def test_route_names_the_one_length_forward_and_the_tl_backward(monkeypatch, kw, forward, why):
    """describe_route (explain()'s route) of a causal call with Sq < Sk: the Gluon one-length
    forward, or the tl forward with the reason; the backward on the tl passes, saying why."""
    _gluon_here(monkeypatch)
    monkeypatch.setattr(entry, "use_descriptors", lambda *a, **k: True)
    d = kw.get("d", 128)
    q, k, v = _cpu_qkv(128, 1000, d)
    params = _params(kw.get("causal", "bottom_right"), kw.get("window"), softcap=kw.get("softcap", 0.0))
    extra = {}
    if kw.get("sinks"):
        extra["sinks"] = torch.zeros(4)
    if kw.get("alibi"):
        extra["alibi"] = torch.ones(2, 4)
    mask = torch.zeros(2, 4, 128, 1000, dtype=F16) if kw.get("mask") else None
    steps = describe_route(q, k, v, mask, params, backward=True, **extra)
    (part, kernel, passed), dkdv, dq = steps
    assert (part, kernel) == ("forward", forward), steps
    if why is None:
        assert passed == (), steps
    else:
        assert any(alt == entry.GLUON and why in reason for alt, reason in passed), steps
    for part, kernel, passed in (dkdv, dq):
        assert kernel == entry.TL and any(alt == entry.GLUON and "Sq != Sk" in r for alt, r in passed), steps


# ---- the GPU route ---------------------------------------------------------------------------


GPU_SHAPES = [(sq, sk) for sq in (128, 384) for sk in (sq + 128, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hkv", [2, 8], ids=["GQA 8/2", "MHA"])
@pytest.mark.parametrize("sq, sk", GPU_SHAPES, ids=[f"Sq={sq} Sk={sk}" for sq, sk in GPU_SHAPES])
def test_gpu_one_length_forward_matches_math_float64(monkeypatch, sq, sk, hkv, d, causal):
    """Output and logsumexp against the math backend in float64 (budget: tests/naive.py in bf16),
    and the gradients of the tl backward that reads them against float64 autograd; the route is
    the one-length Gluon forward wherever the head dim's config runs its forward on causal calls
    (d64: the tl forward, the route says why)."""
    if not sm90():
        pytest.skip("needs an sm90 GPU")
    if gluon_route.gluon_reason() is not None:
        pytest.skip(gluon_route.gluon_reason())
    monkeypatch.setattr(gluon_route, "WS_MIN_WORK", 0)  # small shapes: the route, not its threshold
    params = _params(causal)
    q = torch.randn(2, 8, sq, d, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(2, hkv, sk, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
    served = configs.WS_FWD_CONFIGS[d].forward_scope == "all"
    steps = describe_route(q, k, v, None, params, backward=True)
    assert steps[0][1] == (entry.GLUON_LENGTHS if served else entry.TL), steps
    seen = watch_launches(monkeypatch, gluon_launch.KERNELS["fwd_ws"], lambda c: c["KV_LENS"])
    out, lse = triton_attention(q, k, v, None, params, return_lse=True)
    assert seen == ([gluon_launch.LENS_TENSOR] if served else []), seen
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    check_stored_forward_backward(q, k, v, out, lse, grad_out, causal, params.scale, enable_gqa=hkv != 8)


@pytest.mark.gpu
def test_gpu_chunked_prefill_call_explains_and_takes_the_one_length_forward(monkeypatch):
    """The benchmark's call (benchmarks/decode.py, "Sq=512 over 8k+"): a plain sdpa() with
    causal="bottom_right" and GQA, no gradients: explain() names the route and it runs."""
    if not sm90() or gluon_route.gluon_reason() is not None:
        pytest.skip("needs an sm90 GPU and the Triton the Gluon kernels are written for")
    q = torch.randn(4, 32, 512, 128, device="cuda", dtype=BF16)
    k, v = (torch.randn(4, 8, 8704, 128, device="cuda", dtype=BF16) for _ in range(2))
    kw = dict(causal="bottom_right", enable_gqa=True, backend="triton")
    decision = ad.explain(q, k, v, **kw)
    assert decision.route.steps[0].chosen == entry.GLUON_LENGTHS, str(decision)
    seen = watch_launches(monkeypatch, gluon_launch.KERNELS["fwd_ws"], lambda c: c["KV_LENS"])
    out = ad.sdpa(q, k, v, **kw)
    assert seen == [gluon_launch.LENS_TENSOR], seen
    ref64 = ad.sdpa(q.double(), k.double(), v.double(), causal="bottom_right", enable_gqa=True, backend="math")
    ref_low = naive_attention(q, k, v, causal="bottom_right")
    assert_matches(out, ref64, ref_low, what="chunked prefill output")


@pytest.mark.gpu
def test_gpu_chunked_prefill_plan_relaunches_with_the_constant_lengths(monkeypatch):
    """Repeated plain sdpa() chunked-prefill calls: the plan captures the one-length launch (its lengths
    are the package's constant zeros, static_buffers) and relaunches it for new tensors, each result
    equal to the full path's."""
    if not sm90() or gluon_route.gluon_reason() is not None:
        pytest.skip("needs an sm90 GPU and the Triton the Gluon kernels are written for")
    from attention_dispatch import dispatch
    from attention_dispatch.kernels import ForwardPlan
    from attention_dispatch.kernels import compiled_cache as cc
    from attention_dispatch.kernels import launch_replay
    from attention_dispatch.kernels.static_buffers import is_static

    relaunched = []
    monkeypatch.setattr(launch_replay, "relaunch", lambda *a: relaunched.append("relaunch") or cc.relaunch(*a))
    direct_call = cc.DirectLaunch.__call__
    monkeypatch.setattr(cc.DirectLaunch, "__call__", lambda *a: relaunched.append("direct") or direct_call(*a))
    monkeypatch.setattr(gluon_route, "WS_MIN_WORK", 0)
    ad.clear_cache()
    q = torch.randn(2, 8, 256, 128, device="cuda", dtype=BF16)
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda", dtype=BF16) for _ in range(2))
    kw = dict(causal="bottom_right", enable_gqa=True, backend="triton")
    params = KernelParams(scale=128**-0.5, window_right=0, align_bottom_right=True)
    with torch.no_grad():
        ad.sdpa(q, k, v, **kw)  # the full path; stores the plan
        ad.sdpa(q, k, v, **kw)  # the plan's first call captures
        plans = [r for _, r in dispatch.fast_calls.values() if isinstance(r, ForwardPlan)]
        assert plans and plans[-1].launch is not None
        (step,) = plans[-1].launch.steps
        assert any(isinstance(a, torch.Tensor) and is_static(a) for a in step[3]), step[3]
        relaunched.clear()
        for _ in range(3):
            q, k, v = (torch.randn_like(t) for t in (q, k, v))
            got = ad.sdpa(q, k, v, **kw)
            assert torch.equal(got, triton_attention(q, k, v, None, params))
    assert relaunched == ["direct"] * 3
