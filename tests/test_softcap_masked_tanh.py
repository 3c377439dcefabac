"""Issue 36's softcap in the Gluon backward passes, E106a: a softcap alone masks its scores to
gluon/common.MASKED_TANH instead of -inf, so the masked tile is the tanh tile (dkdv.py, dq.py; the dQ
pass's causal split takes such calls too).

CPU: the sentinel's arithmetic, and that each GPU case below takes the Gluon backward on an sm90 (a
call under WS_MIN_WORK runs the tl kernels: E106's d64 case, 1 x 2 x 4096 x 4096 x 64, asserted the
route and never reached the kernels).  GPU (`gpu`): softcap alone through the Gluon dK/dV and dQ passes
(fused or not) in the bands and head dims the change touches, against naive in float64, every tensor
compared before the test fails (test_kernel_features.check stops at the first).
"""

import os
import sys

import pytest
import torch
import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_kernel_features as features  # noqa: E402
from oracle import assert_matches  # noqa: E402
from test_kernel_features import BF16, _params, check, gpu, needs_cuda, rand  # noqa: E402

from attention_dispatch.kernels import describe_route, entry  # noqa: E402
from attention_dispatch.kernels.gluon import launch as gluon_launch  # noqa: E402
from attention_dispatch.kernels.gluon import route as gluon_route  # noqa: E402

common = pytest.importorskip("attention_dispatch.kernels.gluon.common")

SEQ = 4096
SOFTCAP = 30.0

# (head dim, causal, window, extra KernelParams, the backward's dQ kernel)
CASES = [
    (128, None, None, {}, "fused"),  # dK/dV with dQ fused
    (128, None, None, dict(deterministic=True), "gluon"),  # the dQ pass over dense tiles
    (128, "bottom_right", None, {}, "fused"),  # causal softcap: dQ fused, masked diagonal tiles (E109)
    (128, "bottom_right", None, dict(deterministic=True), "gluon"),  # the dQ pass's causal split, masked tiles
    (128, None, (1500, 0), {}, "gluon"),  # a window's masked tiles in both passes
    (128, None, (700, 400), {}, "gluon"),
    (64, "bottom_right", None, {}, "fused"),  # d64: 128-row query tiles, dQ fused in causal calls too
    (64, "top_left", None, {}, "fused"),
    (64, "bottom_right", None, dict(deterministic=True), "gluon"),  # d64's dQ pass, its causal split
    (64, None, (1500, 0), {}, "fused"),
]


def _heads(d: int) -> int:
    """Query (= key) heads of a (1, H, SEQ, d) call with at least WS_MIN_WORK products, else the
    Gluon kernels leave it to the tl ones."""
    return max(2, -(-gluon_route.WS_MIN_WORK // (SEQ * SEQ * d)))


def test_masked_tanh_gives_zero_p_times_its_derivative():
    """A masked pair's stand-in tanh (MASKED_TANH) in the backward: P = exp2(t scale - lse2) is 0 and
    1 - t^2 finite, so P (1 - t^2) and dS are 0, not NaN, for any cap (scale = cap log2 e) and row."""
    t = torch.tensor(common.MASKED_TANH.value, dtype=torch.float32)
    g = 1.0 - t * t
    assert torch.isfinite(g)
    for cap in (1e-6, 0.5, 30.0, 50.0, 1e6):
        scale = torch.tensor(cap * 1.4426950408889634, dtype=torch.float32)
        for lse2 in (-scale.item(), 0.0, 30.0, 1e4):
            p = torch.exp2(t * scale - lse2)
            assert p.item() == 0.0
            ds = p * g * (torch.tensor(3.0) - 1.5)
            assert ds.item() == 0.0 and not torch.isnan(ds)


@pytest.mark.parametrize("d,causal,window,extra,dq", CASES, ids=str)
def test_cases_take_the_gluon_backward_on_an_h100(monkeypatch, d, causal, window, extra, dq):
    """The route each GPU case below asserts, computed here for an H100 (sm90, TMA descriptors, the
    Triton the Gluon kernels are written for), so that a shape off the Gluon route fails on the CPU."""
    if gluon_launch.GLUON_IMPORT_ERROR is not None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(gluon_route, "GLUON_TRITON_VERSIONS", (triton.__version__,))
    monkeypatch.setattr(gluon_route, "device_info", lambda dev: ((9, 0), 132))
    monkeypatch.setattr(entry, "use_descriptors", lambda *a, **k: True)
    monkeypatch.setattr(entry, "store_dtype", lambda dtype: dtype)  # the interpreter's bf16 stand-in off
    q = torch.empty(1, _heads(d), SEQ, d, dtype=BF16)
    params = _params(causal, window, d**-0.5, softcap=SOFTCAP, **extra)
    steps = describe_route(q, q, q, None, params, backward=True)
    assert [s[1] for s in steps[1:]] == ["gluon", dq], steps


@gpu
@needs_cuda
@pytest.mark.parametrize("d,causal,window,extra,dq", CASES, ids=str)
def test_gpu_softcap_alone_gluon_backward(monkeypatch, d, causal, window, extra, dq):
    """Softcap 30 alone (the backward's masked tanh tile) against naive in float64: out, lse, dq, dk
    and dv each, the failure naming every one off (a forward error moves all the gradients)."""
    q, k, v = (rand(1, _heads(d), SEQ, d, dtype=BF16) for _ in range(3))
    params = _params(causal, window, d**-0.5, softcap=SOFTCAP, **extra)
    steps = describe_route(q, k, v, None, params, backward=True)
    assert [s[1] for s in steps[1:]] == ["gluon", dq], steps
    off = []

    def compare(got, *args, **kw):
        try:
            return assert_matches(got, *args, **kw)
        except AssertionError as e:
            off.append(str(e))
            return float("nan")

    monkeypatch.setattr(features, "assert_matches", compare)
    check(q, k, v, causal=causal, window=window, softcap=SOFTCAP, **extra)
    assert not off, f"{steps[0][1]} forward, {dq} dQ: " + "; ".join(off)
