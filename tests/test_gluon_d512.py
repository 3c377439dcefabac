"""The Gluon d512 forward (kernels/gluon/forward_d512.py, issue 36): Dqk = Dv = 512 in fp16/bf16 on
sm90, dense or causal (either alignment), GQA, both row layouts; every other d512 call keeps the tl
forward with a reason, and every d512 backward is the tl one, reading the logsumexp the Gluon forward
wrote.  CPU: the route and its reasons, the launch's arguments, the sm90 compile (Triton 3.6 only);
GPU (marked gpu): output, logsumexp and the gradients through the tl backward against float64."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.api import normalize_call  # noqa: E402
from attention_dispatch.kernels import KernelParams, describe_route, entry, run, triton_attention  # noqa: E402
from attention_dispatch.kernels.gluon import launch as gluon_launch  # noqa: E402
from attention_dispatch.kernels.gluon import launch_d512  # noqa: E402
from attention_dispatch.kernels.gluon import route as gluon_route  # noqa: E402
from attention_dispatch.kernels.gluon import route_d512  # noqa: E402
from attention_dispatch.kernels.shapes import KernelShapes  # noqa: E402
from attention_dispatch.kernels.tl.common import LOG2E  # noqa: E402
from launch_watch import sm90, watch_launches  # noqa: E402
from oracle import check_stored_forward_backward  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BF16, F16 = torch.bfloat16, torch.float16
D = 512
ALIGN = {"bottom_right": True, "top_left": False}  # align_bottom_right


def _params(causal: str | None = None, window=None, **kw) -> KernelParams:
    left, right = window or ((-1, 0) if causal else (-1, -1))
    kw = {"scale": D**-0.5, **kw}
    return KernelParams(align_bottom_right=ALIGN.get(causal, False), window_left=left, window_right=right, **kw)


def _gluon_here(monkeypatch, min_work: int = 0):
    """The route's answers as on an H100 with the Triton the Gluon kernels are written for."""
    if gluon_launch.GLUON_IMPORT_ERROR is not None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(gluon_route, "GLUON_TRITON_VERSIONS", (triton.__version__,))
    monkeypatch.setattr(gluon_route, "device_info", lambda dev: ((9, 0), 132))
    monkeypatch.setattr(route_d512, "device_info", lambda dev: ((9, 0), 132))
    monkeypatch.setattr(route_d512, "GPU_VERIFIED", True)
    monkeypatch.setattr(gluon_route, "WS_MIN_WORK", min_work)


def _qkv(sq=256, sk=256, hq=4, hkv=4, b=2, dtype=F16, dv=D, layout=1, device="cpu", grad=False):
    """q (b, hq, sq, 512), k/v (b, hkv, sk, 512 / dv); layout 2: (B, S, H, D) memory seen as (B, H, S, D)."""

    def make(h, s, d):
        if layout == 2:
            t = torch.randn(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)
        else:
            t = torch.randn(b, h, s, d, dtype=dtype, device=device)
        return t.requires_grad_() if grad else t

    return make(hq, sq, D), make(hkv, sk, D), make(hkv, sk, dv)


def _reason(q, k, v, params, bias_kind=0, desc=True, alibi=False, sinks=False):
    prob = KernelShapes(q, k, v, None, None, None, None)
    return route_d512.d512_forward_reason(q, k, v, bias_kind, params, prob, desc, alibi, sinks)


# ---- which calls the route takes, and why not the others ------------------------------------


SERVED = [
    ("dense", None, 256, 256),
    ("dense Sq < Sk", None, 128, 384),
    ("dense Sq > Sk", None, 384, 128),
    ("causal top-left", "top_left", 256, 256),
    ("causal bottom-right", "bottom_right", 256, 256),
    ("causal bottom-right Sq < Sk", "bottom_right", 128, 384),
    ("causal top-left Sq < Sk", "top_left", 128, 384),
    ("causal top-left Sq > Sk", "top_left", 384, 256),
]


@pytest.mark.parametrize("label, causal, sq, sk", SERVED, ids=[s[0] for s in SERVED])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hkv, layout", [(4, 1), (2, 1), (4, 2)], ids=["MHA", "GQA 4/2", "BSHD"])
def test_route_serves_dense_and_causal_calls(monkeypatch, label, causal, sq, sk, dtype, hkv, layout):
    _gluon_here(monkeypatch)
    q, k, v = _qkv(sq, sk, hkv=hkv, dtype=dtype, layout=layout)
    assert _reason(q, k, v, _params(causal)) == (None, (layout, layout))


NOT_SERVED = [
    # (label, call changes, words of the reason)
    ("mask", dict(bias_kind=1), "attn_mask: not in the Gluon d512 forward"),
    ("dropout", dict(params=dict(dropout_p=0.1)), "dropout: not in the Gluon d512 forward"),
    ("softcap", dict(params=dict(softcap=30.0)), "softcap: not in the Gluon d512 forward"),
    ("alibi", dict(alibi=True), "alibi_slopes: not in the Gluon d512 forward"),
    ("sinks", dict(sinks=True), "sinks: not in the Gluon d512 forward"),
    ("window", dict(window=(256, 0)), "window (256, 0): not in the Gluon d512 forward"),
    ("window right", dict(window=(-1, 64)), "window (-1, 64)"),
    ("causal bottom-right Sq > Sk", dict(causal="bottom_right", sq=384, sk=256), "rows without keys"),
    ("Sq not whole blocks", dict(sq=200), "Sq=200, Sk=256: multiples of 64 and 32 only"),
    ("Sk not whole tiles", dict(sk=250), "Sq=256, Sk=250: multiples of 64 and 32 only"),
    ("float32", dict(dtype=torch.float32), "float16 or bfloat16 only"),
    ("no descriptors", dict(desc=False), "no TMA descriptors"),
    ("forced tiles", dict(params=dict(block_m=64)), "tiles forced"),
    ("negative scale", dict(params=dict(scale=-0.1)), "positive only"),
    ("Dv 256", dict(dv=256), "head dims 512/256: 512/512 only"),
    ("grid", dict(params=dict(max_grid=4)), "32-bit limits"),
]


@pytest.mark.parametrize("label, change, why", NOT_SERVED, ids=[c[0] for c in NOT_SERVED])
def test_route_reasons_for_the_calls_it_leaves_to_the_tl_forward(monkeypatch, label, change, why):
    _gluon_here(monkeypatch)
    shape = {n: change[n] for n in ("sq", "sk", "dtype", "dv") if n in change}
    q, k, v = _qkv(**shape)
    params = _params(change.get("causal"), change.get("window"), **change.get("params", {}))
    kw = {n: change[n] for n in ("bias_kind", "desc", "alibi", "sinks") if n in change}
    got, rows = _reason(q, k, v, params, **kw)
    assert got is not None and why in got and rows is None, got


def test_route_is_off_until_verified_on_a_gpu(monkeypatch):
    """The shipped route stays off (the tl forward serves d512, saying why) until its GPU tests pass."""
    _gluon_here(monkeypatch)
    monkeypatch.setattr(route_d512, "GPU_VERIFIED", False)
    q, k, v = _qkv()
    why, rows = _reason(q, k, v, _params())
    assert rows is None and "not yet verified on a GPU" in why


def test_route_reasons_for_the_machine_and_the_memory_layout(monkeypatch):
    _gluon_here(monkeypatch)
    q, k, v = _qkv()
    strided = torch.empty(2, 4, 512, D, dtype=F16)[:, :, ::2]  # every other row: no rows layout
    assert "memory layout" in _reason(strided, k, v, _params())[0]
    monkeypatch.setattr(route_d512, "device_info", lambda dev: ((8, 0), 108))
    assert "compute capability 8.0: the Gluon d512 forward is sm90 only" in _reason(q, k, v, _params())[0]
    monkeypatch.setattr(gluon_route, "GLUON_TRITON_VERSIONS", ("0.0.",))
    assert "the Gluon kernels are written for Triton" in _reason(q, k, v, _params())[0]


def test_route_min_work_counts_the_keys_a_row_reads(monkeypatch):
    """WS_MIN_WORK as the other Gluon forwards: causal top-left with Sq < Sk reads Sq keys a row."""
    q, k, v = _qkv(128, 512, b=1, hq=2, hkv=2)
    _gluon_here(monkeypatch, min_work=2 * 128 * 512 * D)
    assert _reason(q, k, v, _params())[0] is None
    assert _reason(q, k, v, _params("bottom_right"))[0] is None
    assert "below WS_MIN_WORK" in _reason(q, k, v, _params("top_left"))[0]
    _gluon_here(monkeypatch, min_work=2 * 128 * 512 * D + 1)
    assert "below WS_MIN_WORK" in _reason(q, k, v, _params())[0]


@pytest.mark.parametrize(
    "kw, forward, why",
    [
        (dict(), entry.GLUON_D512, None),
        (dict(causal="top_left"), entry.GLUON_D512, None),
        (dict(causal="bottom_right", sq=128, sk=384), entry.GLUON_D512, None),
        (dict(mask=True), entry.TL, "attn_mask: not in the Gluon d512 forward"),
        (dict(sinks=True), entry.TL, "sinks: not in the Gluon d512 forward"),
        (dict(alibi=True), entry.TL, "alibi_slopes: not in the Gluon d512 forward"),
        (dict(softcap=20.0), entry.TL, "softcap: not in the Gluon d512 forward"),
        (dict(window=(300, 0)), entry.TL, "window (300, 0)"),
    ],
)
def test_describe_route_names_the_d512_forward_and_the_tl_backward(monkeypatch, kw, forward, why):
    """describe_route (explain()'s route): the Gluon d512 forward, or the tl forward saying why not
    it; the backward on the tl passes, the d<=256 Gluon ones passed over for the head dims."""
    _gluon_here(monkeypatch)
    monkeypatch.setattr(entry, "use_descriptors", lambda *a, **k: True)
    q, k, v = _qkv(kw.get("sq", 256), kw.get("sk", 256))
    params = _params(kw.get("causal"), kw.get("window"), softcap=kw.get("softcap", 0.0))
    extra = {}
    if kw.get("sinks"):
        extra["sinks"] = torch.zeros(4)
    if kw.get("alibi"):
        extra["alibi"] = torch.ones(2, 4)
    mask = torch.zeros(2, 4, q.shape[2], k.shape[2], dtype=F16) if kw.get("mask") else None
    (part, kernel, passed), dkdv, dq = describe_route(q, k, v, mask, params, backward=True, **extra)
    assert (part, kernel) == ("forward", forward)
    if why is None:
        assert passed == (), passed
    else:
        assert any(alt == entry.GLUON_D512 and why in reason for alt, reason in passed), passed
    for part, kernel, passed in (dkdv, dq):
        assert kernel == entry.TL and any(alt == entry.GLUON and "head dims 512/512" in r for alt, r in passed)


def test_other_head_dims_keep_their_routes(monkeypatch):
    """512/256 and d320 are not the d512 forward's: the d<=256 Gluon route's head-dim reason."""
    _gluon_here(monkeypatch)
    monkeypatch.setattr(entry, "use_descriptors", lambda *a, **k: True)
    for q, k, v in (_qkv(dv=256), tuple(t[..., :320].contiguous() for t in _qkv())):
        (_, kernel, passed), *_ = describe_route(q, k, v, None, _params())
        assert kernel == entry.TL and passed[0][0] == entry.GLUON and "head dims" in passed[0][1], passed


def test_triton_backend_route_text_shows_the_d512_forward(monkeypatch):
    """The triton backend's route (explain()'s Decision) as text, like the other Gluon routes."""
    _gluon_here(monkeypatch)
    monkeypatch.setattr(entry, "use_descriptors", lambda *a, **k: True)
    backend = ad.get_backend("triton")
    q, k, v = _qkv(grad=True)
    call = normalize_call(q, k, v, is_causal=True)
    route = backend.route(call.query, call.key, call.value, call.options)
    assert str(route) == "gluon d512 forward, tl dK/dV, tl dQ", route
    assert route.lines()[0] == "gluon d512 forward", route.lines()
    mask = torch.zeros(256, 256, dtype=F16)
    call = normalize_call(q.detach(), k.detach(), v.detach(), attn_mask=mask)
    route = backend.route(call.query, call.key, call.value, call.options)
    assert route.lines() == [
        "tl forward (not gluon d512: attn_mask: not in the Gluon d512 forward (dense or causal calls only))"
    ]


# ---- the launch --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "causal, sq, sk, hkv, layout, diag",
    [
        (None, 256, 384, 4, 1, 0),
        ("top_left", 256, 384, 2, 1, 0),
        ("bottom_right", 128, 384, 4, 2, 256),
        ("bottom_right", 256, 256, 2, 2, 0),
    ],
)
def test_attention_forward_launches_the_d512_kernel_with_its_geometry(monkeypatch, causal, sq, sk, hkv, layout, diag):
    """kernels.attention_forward on the route's answer: one launch of the d512 kernel, grid (Sq / 64,
    B * Hq), descriptors over the rows layout with the kernel's tiles, causal's diagonal offset,
    the logsumexp buffer where the call needs one (stand-in: O)."""
    _gluon_here(monkeypatch)
    monkeypatch.setattr(entry, "use_descriptors", lambda *a, **k: True)
    launches = []
    monkeypatch.setattr(run, "launch_one", lambda *a, **kw: launches.append((a, kw)))
    q, k, v = _qkv(sq, sk, hkv=hkv, layout=layout)
    params = _params(causal)
    for need_lse in (True, False):
        launches.clear()
        out, lse, _ = entry.attention_forward(q, k, v, None, params, need_lse=need_lse)
        (((kernel, grid, args, const, warps, stages), options),) = launches
        assert kernel is launch_d512.KERNELS["fwd_d512"] and options == {}
        assert grid == (sq // 64, 2 * 4) and (warps, stages) == (launch_d512.WARPS, gluon_launch.WS_STAGES)
        rows = {1: (2 * hkv * sk, D), 2: (2 * sk, hkv * D)}[layout]
        assert [list(a.shape) for a in args[:4]] == [
            [2 * 4 * sq, D] if layout == 1 else [2 * sq, 4 * D],
            list(rows),
            list(rows),
            [2 * 4 * sq, D],
        ]
        assert [list(a.block_shape) for a in args[:4]] == [[64, 64], [32, 512], [32, 256], [64, 256]]
        assert args[3].base is out and out.shape == (2, 4, sq, D) and out.is_contiguous()
        assert args[4] is (lse if need_lse else out) and (lse is not None) == need_lse
        assert args[5] == pytest.approx(params.scale * LOG2E) and args[6:] == (sq, sk, 4, 4 // hkv, diag)
        assert const == launch_d512.constexprs(layout, layout, causal is not None, need_lse)


# ---- the benchmark scripts (benchmarks/compile_sm90.py, benchmarks/head_dim_512.py) ---------------


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}_d512", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _compile_sm90():
    return _load("compile_sm90")


def test_head_dim_512_benchmark_switches_the_d512_route_off_and_on(monkeypatch):
    """head_dim_512.py --forward's baseline: inside d512_route_off() a d512 call takes the tl forward
    (the d<=256 Gluon route's head-dim reason), after it the Gluon d512 forward again."""
    _gluon_here(monkeypatch)
    monkeypatch.setattr(entry, "use_descriptors", lambda *a, **k: True)
    from attention_dispatch.kernels import configs

    # the script replaces candidate_configs when loaded (its sweep's forced tiles): restored after the test
    monkeypatch.setattr(configs, "candidate_configs", configs.candidate_configs)
    hd = _load("head_dim_512")
    q, k, v = _qkv()
    with hd.d512_route_off():
        (_, kernel, passed), *_ = describe_route(q, k, v, None, _params())
        assert kernel == entry.TL and "head dims 512/512" in passed[0][1], passed
    assert describe_route(q, k, v, None, _params())[0][1] == entry.GLUON_D512


def test_compile_sm90_lists_the_d512_forward_cases(monkeypatch, capsys):
    """--kinds fwd_d512: dense and causal over each row layout pairing, one without the logsumexp;
    --ws-one-each the first (dense) alone."""
    cs = _compile_sm90()
    compiled = []
    monkeypatch.setattr(cs, "compile_d512_case", lambda const: (compiled.append(const), (None, None))[1])
    monkeypatch.setattr(cs, "_report", lambda *args: 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cs.main(["--kinds", "fwd_d512"]) == 0
    seen = {(c["CAUSAL"], c["Q_ROWS"], c["KV_ROWS"], c["STORE_LSE"]) for c in compiled}
    rows = {(1, 1, True), (2, 2, True), (1, 2, True), (1, 1, False)}
    assert seen == {(causal, *r) for causal in (False, True) for r in rows} and len(compiled) == 8
    compiled.clear()
    assert cs.main(["--kinds", "fwd_d512", "--ws-one-each"]) == 0
    assert [(c["CAUSAL"], c["Q_ROWS"], c["STORE_LSE"]) for c in compiled] == [(False, 1, True)]


@pytest.mark.skipif(
    not triton.__version__.startswith(gluon_route.GLUON_TRITON_VERSIONS),
    reason="the Gluon kernels compile with the Triton they are written for (run with /tmp/t36)",
)
def test_d512_forward_compiles_for_sm90_without_spills():
    """Every case compiles for sm90 with no spill, its shared memory within the 227 KiB a block may
    take (in a process without the interpreter, which compiles nothing)."""
    import re
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compile_sm90.py"), "--kinds", "fwd_d512", "--spills"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "8 kernels compiled for sm90, 0 failed" in done.stdout, (
        done.stdout + done.stderr[-2000:]
    )
    usage = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads, (\d+) B shared: (d512 .*)", done.stdout)
    assert len(usage) == 8, done.stdout
    for stores, loads, shared, label in usage:
        assert (stores, loads) == ("0", "0") and int(shared) <= 232448, (label, stores, loads, shared)


# ---- GPU: against float64 ----------------------------------------------------------------------


def _skip_without_the_route(monkeypatch):
    monkeypatch.setattr(route_d512, "GPU_VERIFIED", True)  # these tests are what verifies it
    if not sm90():
        pytest.skip("needs an sm90 GPU")
    if gluon_route.gluon_reason() is not None:
        pytest.skip(gluon_route.gluon_reason())


GPU_CASES = [
    # (label, causal, Sq, Sk, Hkv, rows layout); Hq = 4, B = 2
    ("dense", None, 256, 256, 4, 1),
    ("dense GQA Sq<Sk", None, 128, 384, 2, 1),
    ("causal", "top_left", 256, 256, 4, 1),
    ("causal bottom-right Sq<Sk", "bottom_right", 128, 384, 4, 1),
    ("causal top-left Sq<Sk GQA", "top_left", 192, 416, 2, 1),
    ("causal top-left Sq>Sk", "top_left", 384, 256, 4, 1),
    ("causal BSHD", "bottom_right", 320, 320, 4, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("label, causal, sq, sk, hkv, layout", GPU_CASES, ids=[c[0] for c in GPU_CASES])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_gpu_d512_forward_and_tl_backward_match_float64(monkeypatch, label, causal, sq, sk, hkv, layout, dtype):
    """Output and logsumexp of the Gluon d512 forward against the math backend in float64 (budget:
    tests/naive.py in the input dtype), and the gradients of the tl backward that reads them
    against float64 autograd; the route and the launch are the d512 kernel's."""
    _skip_without_the_route(monkeypatch)
    monkeypatch.setattr(gluon_route, "WS_MIN_WORK", 0)  # small shapes: the route, not its threshold
    params = _params(causal)
    q, k, v = _qkv(sq, sk, hkv=hkv, dtype=dtype, layout=layout, device="cuda", grad=True)
    steps = describe_route(q, k, v, None, params, backward=True)
    assert [s[1] for s in steps] == [entry.GLUON_D512, entry.TL, entry.TL], steps
    seen = watch_launches(monkeypatch, launch_d512.KERNELS["fwd_d512"], lambda c: c)
    out, lse = triton_attention(q, k, v, None, params, return_lse=True)
    assert [(c["CAUSAL"], c["Q_ROWS"], c["STORE_LSE"]) for c in seen] == [(causal is not None, layout, True)], seen
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    check_stored_forward_backward(q, k, v, out, lse, grad_out, causal, params.scale, enable_gqa=hkv != 4)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_gpu_sdpa_inference_at_the_benchmark_shape_takes_the_d512_forward(monkeypatch, causal):
    """ad.sdpa(backend="triton") without gradients at B=2 H=16 S=4096 (the timed shape, above
    WS_MIN_WORK): explain() names the d512 forward, it runs without a logsumexp, and matches
    float32 math within bf16's budget."""
    _skip_without_the_route(monkeypatch)
    q, k, v = _qkv(4096, 4096, hq=16, hkv=16, dtype=BF16, device="cuda")
    kw = dict(is_causal=causal, backend="triton")
    decision = ad.explain(q, k, v, **kw)
    assert decision.route.steps[0].chosen == entry.GLUON_D512, str(decision)
    seen = watch_launches(monkeypatch, launch_d512.KERNELS["fwd_d512"], lambda c: c)
    with torch.no_grad():
        out = ad.sdpa(q, k, v, **kw)
    assert [(c["CAUSAL"], c["STORE_LSE"]) for c in seen] == [(causal, False)], seen
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :2].float(), k[:, :2].float(), v[:, :2].float(), is_causal=causal
    )
    err = (out[:, :2].float() - ref).abs().max().item()
    assert err < 2e-2, err
