"""Routes are decisions (issue 33): the route a backend reports (``backend.route`` and
``ad.explain(...).route``) is the one its run() and prepare() take, with why each faster
route was passed over.

flash_attn: the generation (flash-attn 2/3/4) chosen by ``FlashAttnBackend.select`` from what
is installed, the GPU and the call's features; for flash-attn 4 also whether sdpa()'s repeated
calls relaunch its compiled forward.  On the CPU the generations are tests/fakes' (one call list
each, so the generation that ran is the list that grew) and the GPU's architecture is patched.
PyTorch's kernels: the form a call takes through F.scaled_dot_product_attention
(``call_form``), seen by a recorder in place of F.sdpa, and whether repeated calls call the
pinned kernel's ATen op (``direct_reasons``), seen by a recorder in its place.  GPU variants
(marked ``gpu``) check explain() against sdpa() on the real libraries.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias

import attention_dispatch as ad
from attention_dispatch.backends import flash_attn as fa_module
from attention_dispatch.backends import torch_backends as tb, torch_sdpa as ts
from attention_dispatch.backends.base import Capabilities
from attention_dispatch.backends.flash_attn import PUBLIC, RELAUNCHED, FlashAttnBackend
from attention_dispatch.route import Route, RouteStep
from attention_dispatch.semantics import CausalKind
from tests import fakes

TL, BR = CausalKind.TOP_LEFT, CausalKind.BOTTOM_RIGHT
FA2, FA3, FA4 = "flash-attn 2", "flash-attn 3", "flash-attn 4"
NOT_INSTALLED = "not installed"


def options(**kw) -> dict:
    """Normalised options as sdpa() hands them to a backend."""
    base = dict(
        attn_mask=None,
        dropout_p=0.0,
        causal=None,
        window=None,
        scale=0.3,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        enable_gqa=False,
        deterministic=False,
    )
    base.update(kw)
    return base


def dense(b, hq, hkv, sq, sk, d, dtype=torch.float64, grad=False, device="cpu"):
    mk = lambda *s: torch.randn(*s, dtype=dtype, device=device).requires_grad_(grad)  # noqa: E731
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, d)


def packed(lens, hq, hkv, d, dtype=torch.float64, grad=False):
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    mk = lambda h: torch.randn(sum(lens), h, d, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), cu


# ------------------------------------------------------------------ flash-attn ------
@pytest.fixture
def generations(monkeypatch, tmp_path):
    """generations(*versions, cc=, fa4_version=, broken_fa3=) installs fake flash-attn
    generations, each recording into its own list, on a GPU of compute capability `cc`;
    returns (FlashAttnBackend(), {label: calls}, flash-attn 4's fake interface or None)."""

    def make(*versions, cc=(9, 0), fa4_version=None, broken_fa3=False):
        calls = {FA2: [], FA3: [], FA4: []}
        modules: dict = {}
        for v in sorted(versions):
            for name, mod in fakes.make_flash_attn(v, calls[f"flash-attn {v}"]).items():
                if name == "flash_attn" and "flash_attn" in modules:  # fa2 + fa4: one package with both
                    mod = modules["flash_attn"]
                modules[name] = mod
            if v == 4 and 2 in versions:
                modules["flash_attn"].cute = modules["flash_attn.cute"]
        for missing in ("flash_attn", "flash_attn_interface", "flash_attn.cute", "flash_attn.cute.interface"):
            if missing not in modules:
                monkeypatch.delitem(sys.modules, missing, raising=False)
        fakes.install(monkeypatch, modules)
        if broken_fa3:  # a flash-attn 3 build that imports but fails to load its CUDA library
            (tmp_path / "flash_attn_interface.py").write_text(
                "raise ImportError('libcudart.so.13: cannot open shared object file')\n"
            )
            monkeypatch.syspath_prepend(str(tmp_path))
        if fa4_version is not None:
            modules["flash_attn.cute"].__version__ = fa4_version
        monkeypatch.setattr(fa_module, "compute_capability", lambda device: cc)
        return FlashAttnBackend(), calls, modules.get("flash_attn.cute.interface")

    return make


WHY_SM80 = "compute capability sm80 < sm90"
WHY_DROPOUT = "dropout_p > 0 not supported"
RELAUNCH = ("repeat calls", RELAUNCHED, ())

# id: (installed, cc, call, chosen, passed over, repeat step (part, chosen, passed over) or None)
FA_ROUTES = {
    "fa3-on-sm90": ((2, 3, 4), (9, 0), {}, FA3, (), None),
    "fa4-when-fa3-is-not-installed": ((2, 4), (9, 0), {}, FA4, ((FA3, NOT_INSTALLED),), RELAUNCH),
    "fa4-on-sm100": ((2, 3, 4), (10, 0), {}, FA4, ((FA3, "compute capability sm100 > sm90"),), RELAUNCH),
    "fa2-on-sm80": ((2, 3, 4), (8, 0), {}, FA2, ((FA3, WHY_SM80), (FA4, WHY_SM80)), None),
    "fa2-for-dropout": ((2, 3, 4), (9, 0), dict(dropout_p=0.25), FA2, ((FA3, WHY_DROPOUT), (FA4, WHY_DROPOUT)), None),
    "fa2-alone": ((2,), (9, 0), {}, FA2, ((FA3, NOT_INSTALLED), (FA4, NOT_INSTALLED)), None),
    "fa2-when-fa3-fails-to-import": (
        (2,),
        (9, 0),
        dict(broken_fa3=True),
        FA2,
        ((FA3, "import failed: ImportError: libcudart.so.13: cannot open shared object file"), (FA4, NOT_INSTALLED)),
        None,
    ),
    "fa2-for-head-dim-80": (
        (2, 4),
        (9, 0),
        dict(d=80),
        FA2,
        ((FA3, NOT_INSTALLED), (FA4, "head_dim=80 not in {64, 96, 128}")),
        None,
    ),
    "fa2-for-windowed-training-on-sm90": (
        (2, 4),
        (9, 0),
        dict(window=(3, 0), grad=True),
        FA2,
        ((FA3, NOT_INSTALLED), (FA4, "backward with a window not supported on sm90")),
        None,
    ),
    "fa2-for-deterministic-training-on-sm90": (
        (2, 4),
        (9, 0),
        dict(deterministic=True, grad=True),
        FA2,
        ((FA3, NOT_INSTALLED), (FA4, "deterministic backward only on sm100/sm110")),
        None,
    ),
    "fa2-for-varlen-training-on-sm90": (
        (2, 4),
        (9, 0),
        dict(varlen=True, grad=True),
        FA2,
        ((FA3, NOT_INSTALLED), (FA4, "varlen backward not supported on sm90")),
        None,
    ),
    "fa4-training-relaunched": ((4,), (9, 0), dict(grad=True), FA4, ((FA3, NOT_INSTALLED),), RELAUNCH),
    "fa4-varlen-inference-relaunched": ((4,), (9, 0), dict(varlen=True), FA4, ((FA3, NOT_INSTALLED),), RELAUNCH),
    "fa4-varlen-training-public": (
        (4,),
        (10, 0),
        dict(varlen=True, grad=True),
        FA4,
        ((FA3, NOT_INSTALLED),),
        (
            "repeat calls",
            PUBLIC,
            ((RELAUNCHED, "varlen with autograd: only flash-attn 4's varlen inference forward is relaunched"),),
        ),
    ),
    "fa4-untested-release-public": (
        (4,),
        (9, 0),
        dict(fa4_version="4.1.0"),
        FA4,
        ((FA3, NOT_INSTALLED),),
        ("repeat calls", PUBLIC, ((RELAUNCHED, "flash-attn 4 4.1.0 is not a tested release (4.0.0b*)"),)),
    ),
}


def _fa_call(spec: dict):
    """(query, key, value, options, runner's call keywords) of one flash-attn test call."""
    d, grad = spec.get("d", 64), spec.get("grad", False)
    if spec.get("varlen"):
        q, k, v, cu = packed([5, 3, 8], 4, 2, d, grad=grad)
        opts = options(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8, enable_gqa=True)
        extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        q, k, v = dense(2, 4, 2, 6, 9, d, grad=grad)
        opts, extra = options(causal=BR, enable_gqa=True), {}
    for name in ("dropout_p", "window", "deterministic"):
        if name in spec:
            opts[name] = spec[name]
    return q, k, v, opts, extra


def _grown(calls: dict, before: dict) -> list[str]:
    return [label for label, c in calls.items() if len(c) > before[label]]


@pytest.mark.parametrize("case", list(FA_ROUTES), ids=list(FA_ROUTES))
def test_flash_attn_route_is_the_generation_run_and_prepare_call(generations, case):
    """The generation route() names is the one run() calls (its fake's list grows, no other),
    and the one the prepared runner calls; each generation preferred to it is passed over with
    its reason; for flash-attn 4 the repeat-call step says whether the runner relaunches its
    compiled forward (later calls skip flash_attn_func) or keeps the public function."""
    installed, cc, spec, chosen, passed, repeat = FA_ROUTES[case]
    make_kw = {n: spec[n] for n in ("broken_fa3", "fa4_version") if n in spec}
    backend, calls, iface = generations(*installed, cc=cc, **make_kw)
    q, k, v, opts, extra = _fa_call(spec)

    route = backend.route(q, k, v, opts)
    want = [RouteStep("kernel", chosen, passed)] + ([RouteStep(*repeat)] if repeat else [])
    assert list(route.steps) == want, route.lines()

    before = {label: len(c) for label, c in calls.items()}
    torch.manual_seed(0)
    backend.run(q, k, v, **opts)
    assert _grown(calls, before) == [chosen]

    runner = backend.prepare(q, k, v, opts)
    for i in range(2):
        q2, k2, v2 = (torch.randn_like(t).requires_grad_(t.requires_grad) for t in (q, k, v))
        before = {label: len(c) for label, c in calls.items()}
        launches = len(iface.launches) if iface is not None else 0
        runner(q2, k2, v2, **extra)
        if repeat is not None and repeat[1] == RELAUNCHED and i == 1:
            assert _grown(calls, before) == [] and len(iface.launches) == launches + 1  # relaunched
        else:
            assert _grown(calls, before) == [chosen]  # the public function of the chosen generation


def test_flash_attn_route_of_an_empty_call_names_no_kernel(generations):
    backend, calls, _ = generations(2, 3, 4)
    q, k, v = dense(2, 4, 4, 6, 0, 64)
    route = backend.route(q, k, v, options())
    assert route.steps == (RouteStep("output", "zeros", ((FA3, "an empty dimension: exact zeros, no kernel"),)),)
    out = backend.run(q, k, v, **options())
    assert not out.any() and not any(calls.values())


def test_flash_attn_check_and_route_agree(generations):
    """check()'s reasons for a call no generation runs are the installed generations' reasons
    from the same choice (select), the route's passed-over reasons."""
    backend, _, _ = generations(3, 4, cc=(8, 0))
    q, k, v = dense(2, 4, 4, 8, 8, 64)
    choice = backend.select(backend.run_problem(q, k, v, **options()))
    assert choice.impl is None
    assert choice.passed_over == (
        (FA3, WHY_SM80),
        (FA4, WHY_SM80),
        (FA2, "not installed (flash_attn has no flash_attn_func)"),
    )
    assert backend.choose(backend.run_problem(q, k, v, **options()))[1] == [f"{FA3}: {WHY_SM80}", f"{FA4}: {WHY_SM80}"]
    route = backend.route(q, k, v, options())
    assert route.steps[0].chosen == "none" and route.steps[0].passed_over == choice.passed_over


# ----------------------------------------------------------- PyTorch's kernels ------
@pytest.fixture
def sdpa_calls(monkeypatch):
    """Records every F.scaled_dot_product_attention call the adapters make (how the mask,
    causal flag, query rows and heads arrive), then computes it with PyTorch's math kernel."""
    calls: list = []
    real = F.scaled_dot_product_attention
    inside = []  # CausalBias calls F.sdpa (this recorder) again with its materialised mask

    def recorder(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not inside:
            calls.append(
                dict(
                    nested=q.is_nested,
                    mask=attn_mask,
                    is_causal=is_causal,
                    rows=None if q.is_nested else q.shape[-2],
                    k_heads=k.size(1),
                    enable_gqa=enable_gqa,
                )
            )
        args = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        inside.append(1)
        try:
            with sdpa_kernel(SDPBackend.MATH):
                if isinstance(attn_mask, CausalBias):
                    return CausalBias._dispatch(q, k, v, attn_mask, **args)
                return real(q, k, v, attn_mask=attn_mask, **args)
        finally:
            inside.pop()

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorder)
    return calls


def observed_form(call: dict | None, sq: int, user_mask) -> str:
    """The call_form name of what F.sdpa received (None: it was not called)."""
    if call is None:
        return ts.EMPTY
    if call["nested"]:
        return ts.NESTED
    mask = call["mask"]
    if isinstance(mask, CausalBias):
        return ts.LOWER_RIGHT
    if mask is None:
        if not call["is_causal"]:
            return ts.FOLDED if call["rows"] != sq else ts.PLAIN  # FOLDED: G * Sq rows
        return ts.TAIL if call["rows"] < sq else ts.IS_CAUSAL
    if user_mask is None:
        return ts.BAND_MASK
    # the test's masks allow everything: any False / -inf comes from a folded causal band
    return ts.MASK_BAND if bool((mask == 0).any() if mask.dtype == torch.bool else (mask < 0).any()) else ts.MASK


class CpuLowerRight(ts.TorchSdpaBackend):
    """The shared adapter as torch_flash / torch_efficient configure it (causal_lower_right and
    nested inputs native), on CPU tensors."""

    name = "cpu_lower_right"
    device_type = "cpu"
    sdp_backend = "MATH"
    native_lower_right = True
    capabilities = Capabilities()


TOP_LEFT_WHY = "causal=bottom_right with Sq=5 < Sk=9 (is_causal aligns top-left)"
BAND_WHY = "native only in CUDA flash/efficient attention; elsewhere PyTorch builds this mask"
FOLDED_WHY = "PyTorch refuses is_causal together with an attn_mask"
GQA_LOWER_RIGHT = "the lower-right path calls the kernels without enable_gqa: K/V expanded to Hq=4 heads"
GQA_NESTED = "nested inputs broadcast heads only without grad: K/V expanded to Hq=4 heads"
CUDNN_OP = "torch._scaled_dot_product_cudnn_attention"
CPU_OP = "torch._scaled_dot_product_flash_attention_for_cpu"


def _is_causal_arg(args, kwargs) -> bool:
    """is_causal of a recorded call of the CPU op (the prepared runner passes only what differs
    from the op's defaults)."""
    return args[4] if len(args) > 4 else kwargs.get("is_causal", False)


# id: (backend, (hq, hkv, sq, sk), causal, mask, extra options, form, passed over, repeat: (chosen, why) or None)
SDPA_ROUTES = {
    "cudnn-plain": ("cudnn", (4, 4, 8, 8), None, None, {}, ts.PLAIN, (), (CUDNN_OP, None)),
    "cudnn-is-causal": ("cudnn", (4, 4, 8, 8), TL, None, {}, ts.IS_CAUSAL, (), (CUDNN_OP, None)),
    "cudnn-square-bottom-right-is-top-left": ("cudnn", (4, 4, 8, 8), BR, None, {}, ts.IS_CAUSAL, (), (CUDNN_OP, None)),
    "cudnn-bottom-right-tail": (
        "cudnn",
        (4, 4, 9, 5),
        BR,
        None,
        {},
        ts.TAIL,
        (),
        ("F.sdpa", "causal=bottom_right with Sq != Sk"),
    ),
    "cudnn-bottom-right-band-mask": (
        "cudnn",
        (4, 4, 5, 9),
        BR,
        None,
        {},
        ts.BAND_MASK,
        ((ts.IS_CAUSAL, TOP_LEFT_WHY), (ts.LOWER_RIGHT, BAND_WHY)),
        ("F.sdpa", "causal=bottom_right with Sq != Sk"),
    ),
    "cudnn-mask": ("cudnn", (4, 4, 8, 8), None, "float", {}, ts.MASK, (), ("F.sdpa", "an attn_mask")),
    "cudnn-mask-with-causal": (
        "cudnn",
        (4, 4, 8, 8),
        TL,
        "bool",
        {},
        ts.MASK_BAND,
        ((ts.IS_CAUSAL, FOLDED_WHY),),
        ("F.sdpa", "an attn_mask"),
    ),
    "cudnn-gqa": ("cudnn", (4, 2, 8, 8), TL, None, {}, ts.IS_CAUSAL, (), ("F.sdpa", "GQA (Hq=4 != Hkv=2)")),
    "cudnn-strided": (
        "cudnn",
        (4, 4, 8, 8),
        None,
        None,
        dict(strided=True),
        ts.PLAIN,
        (),
        ("F.sdpa", "a last dimension that is not contiguous"),
    ),
    "cudnn-empty": (
        "cudnn",
        (4, 4, 8, 0),
        None,
        None,
        {},
        ts.EMPTY,
        (("F.sdpa", "an empty dimension: nothing to compute"),),
        ("F.sdpa", "an empty dimension"),
    ),
    "torch_cpu-is-causal": ("torch_cpu", (4, 4, 8, 8), TL, None, {}, ts.IS_CAUSAL, (), (CPU_OP, None)),
    "torch_cpu-bottom-right-band-mask": (
        "torch_cpu",
        (4, 2, 5, 9),
        BR,
        None,
        {},
        ts.BAND_MASK,
        ((ts.IS_CAUSAL, TOP_LEFT_WHY), (ts.LOWER_RIGHT, BAND_WHY)),
        ("F.sdpa", "causal=bottom_right with Sq != Sk"),  # the CPU op takes GQA itself
    ),
    "torch_cpu-gqa-folded": ("torch_cpu", (4, 2, 8, 8), None, None, {}, ts.FOLDED, (), (CPU_OP, None)),
    "torch_cpu-gqa-causal": ("torch_cpu", (4, 2, 8, 8), TL, None, {}, ts.IS_CAUSAL, (), (CPU_OP, None)),
    "torch_cpu-one-row-bottom-right-is-plain": ("torch_cpu", (4, 4, 1, 9), BR, None, {}, ts.PLAIN, (), (CPU_OP, None)),
    "lower-right-native": (
        "cpu_lower_right",
        (4, 4, 5, 9),
        BR,
        None,
        {},
        ts.LOWER_RIGHT,
        ((ts.IS_CAUSAL, TOP_LEFT_WHY),),
        None,
    ),
    "lower-right-native-gqa": (
        "cpu_lower_right",
        (4, 2, 5, 9),
        BR,
        None,
        {},
        ts.LOWER_RIGHT,
        ((ts.IS_CAUSAL, TOP_LEFT_WHY), ("F.sdpa(enable_gqa)", GQA_LOWER_RIGHT)),
        None,
    ),
    "nested": ("cpu_lower_right", (4, 4, 0, 0), None, None, dict(varlen=True), ts.NESTED, (), None),
    "nested-gqa": (
        "cpu_lower_right",
        (4, 2, 0, 0),
        None,
        None,
        dict(varlen=True),
        ts.NESTED,
        (("F.sdpa(enable_gqa)", GQA_NESTED),),
        None,
    ),
}

BACKENDS = {"cudnn": tb.CudnnBackend, "torch_cpu": tb.TorchCpuBackend, "cpu_lower_right": CpuLowerRight}


def _sdpa_call(shape, causal, mask, extra, dtype=torch.float32, device="cpu", grad=False):
    hq, hkv, sq, sk = shape
    if extra.get("varlen"):
        q, k, v, cu = packed([5, 3, 7], hq, hkv, 16, dtype=dtype)
        opts = options(causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
        return q, k, v, opts, dict(cu_seqlens_q=cu, cu_seqlens_k=cu), 7
    q, k, v = dense(2, hq, hkv, sq, sk, 16, dtype=dtype, device=device, grad=grad)
    if extra.get("strided"):
        q = q.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(grad)
    m = None
    if mask == "bool":
        m = torch.ones(2, 1, sq, sk, dtype=torch.bool, device=device)
    elif mask == "float":
        m = torch.rand(2, 1, sq, sk, dtype=dtype, device=device)  # >= 0: the test can tell a folded band
    return q, k, v, options(causal=causal, attn_mask=m, enable_gqa=hq != hkv), {}, sq


def _fake_cudnn_op(seen):
    def op(q, k, v, bias, lse, dropout_p, is_causal, debug, *, scale=None):
        seen.append(is_causal)
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), None  # which op ran is the point here

    return op


@pytest.mark.parametrize("case", list(SDPA_ROUTES), ids=list(SDPA_ROUTES))
def test_torch_sdpa_route_is_the_form_run_and_prepare_take(monkeypatch, sdpa_calls, case):
    """The form route() names ("call") is how run() calls F.sdpa (recorded: mask, is_causal,
    rows, nested, heads), with the faster forms passed over and why; the repeat-call step is
    what the prepared runner calls: the pinned kernel's ATen op (recorded in its place) or
    run()'s F.sdpa, with direct_reasons."""
    name, shape, causal, mask, extra, form, passed, repeat = SDPA_ROUTES[case]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # ts.fold_pays: folding fills the threads
    backend = BACKENDS[name]()
    q, k, v, opts, runner_kw, sq = _sdpa_call(shape, causal, mask, extra)

    route = backend.route(q, k, v, opts)
    steps = [RouteStep("output" if form == ts.EMPTY else "call", form, passed)]
    if repeat is not None:
        op = CUDNN_OP if name == "cudnn" else CPU_OP
        chosen, why = repeat
        steps.append(RouteStep("repeat calls", chosen, () if why is None else ((op, why),)))
    assert list(route.steps) == steps, route.lines()

    backend.run(q, k, v, **opts)
    assert observed_form(sdpa_calls[-1] if sdpa_calls else None, sq, opts["attn_mask"]) == form
    if sdpa_calls:
        call = sdpa_calls[-1]
        expanded = any(alt == "F.sdpa(enable_gqa)" for alt, _ in passed)
        assert call["k_heads"] == (shape[0] if expanded or shape[0] == shape[1] else shape[1])
        assert call["enable_gqa"] == (shape[0] != shape[1] and not expanded and form not in (ts.NESTED, ts.FOLDED))

    seen: list = []
    if name == "cudnn":
        monkeypatch.setattr(torch, "_scaled_dot_product_cudnn_attention", _fake_cudnn_op(seen))
    elif name == "torch_cpu":
        real = torch._scaled_dot_product_flash_attention_for_cpu
        monkeypatch.setattr(
            torch,
            "_scaled_dot_product_flash_attention_for_cpu",
            lambda *a, **kw: seen.append(_is_causal_arg(a, kw)) or real(*a, **kw),
        )
    runner = backend.prepare(q, k, v, opts)
    del sdpa_calls[:]
    args = (q, k, v) if opts["attn_mask"] is None else (q, k, v, opts["attn_mask"])
    runner(*args, **runner_kw)
    if repeat is not None and repeat[0] != "F.sdpa":
        assert seen == [form == ts.IS_CAUSAL] and not sdpa_calls  # the ATen op, is_causal mapped
    else:
        assert not seen
        assert observed_form(sdpa_calls[-1] if sdpa_calls else None, sq, opts["attn_mask"]) == form


TORCH_CPU_EXPLAIN = {
    "plain": ((4, 4, 8, 8), None, None, ts.PLAIN, CPU_OP),
    "is-causal": ((4, 4, 8, 8), TL, None, ts.IS_CAUSAL, CPU_OP),
    "tail": ((4, 4, 9, 5), BR, None, ts.TAIL, "F.sdpa"),
    "band-mask": ((4, 4, 5, 9), BR, None, ts.BAND_MASK, "F.sdpa"),
    "mask": ((4, 4, 8, 8), None, "bool", ts.MASK, "F.sdpa"),
    "gqa": ((4, 2, 8, 8), None, None, ts.FOLDED, CPU_OP),
    "gqa-causal": ((4, 2, 8, 8), TL, None, ts.IS_CAUSAL, CPU_OP),
}


@pytest.mark.parametrize("case", list(TORCH_CPU_EXPLAIN), ids=list(TORCH_CPU_EXPLAIN))
def test_torch_cpu_explain_names_the_route_sdpa_takes(monkeypatch, sdpa_calls, case):
    """Through the public API on the CPU: ad.explain(...).route is torch_cpu's route; sdpa()'s
    first call takes its form, the second (prepared) call the ATen op or F.sdpa as the route
    says; str(decision) shows it."""
    shape, causal, mask, form, repeat = TORCH_CPU_EXPLAIN[case]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # ts.fold_pays: folding fills the threads
    q, k, v, opts, _, sq = _sdpa_call(shape, causal, mask, {})
    seen: list = []
    real = torch._scaled_dot_product_flash_attention_for_cpu
    monkeypatch.setattr(
        torch,
        "_scaled_dot_product_flash_attention_for_cpu",
        lambda *a, **kw: seen.append(_is_causal_arg(a, kw)) or real(*a, **kw),
    )
    kw = dict(
        attn_mask=opts["attn_mask"], causal=None if causal is None else str(causal), enable_gqa=opts["enable_gqa"]
    )
    decision = ad.explain(q, k, v, backend="torch_cpu", **kw)
    route = decision.route
    assert isinstance(route, Route) and [s.part for s in route.steps] == ["call", "repeat calls"]
    assert route.steps[0].chosen == form and route.steps[1].chosen == repeat
    assert f"torch_cpu [{route}]" in str(decision)
    for alt, why in route.steps[0].passed_over + route.steps[1].passed_over:
        assert f"not {alt}: {why}" in str(decision)

    ad.sdpa(q, k, v, backend="torch_cpu", **kw)
    assert observed_form(sdpa_calls[-1], sq, opts["attn_mask"]) == form and not seen
    del sdpa_calls[:]
    ad.sdpa(q, k, v, backend="torch_cpu", **kw)  # the fast path: the prepared runner
    if repeat == CPU_OP:
        assert len(seen) == 1 and not sdpa_calls
    else:
        assert not seen and observed_form(sdpa_calls[-1], sq, opts["attn_mask"]) == form


# ------------------------------------------------------------------------- GPU ------
def _cuda_backend(name: str):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    backend = ad.get_backend(name)
    if not backend.is_available():
        pytest.skip(f"{name}: {backend.unavailable_reason()}")
    return backend


CUDNN_GPU = {
    "is-causal": ((4, 4, 256, 256), "top_left", None, ts.IS_CAUSAL, CUDNN_OP),
    "bottom-right-band-mask": ((4, 4, 128, 256), "bottom_right", None, ts.BAND_MASK, "F.sdpa"),
    "gqa": ((8, 2, 256, 256), None, None, ts.PLAIN, "F.sdpa"),
    "mask": ((4, 4, 256, 256), None, "bool", ts.MASK, "F.sdpa"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("case", list(CUDNN_GPU), ids=list(CUDNN_GPU))
def test_gpu_cudnn_explain_names_the_route_sdpa_takes(monkeypatch, case, grad):
    """On the GPU: explain(backend="cudnn") names the F.sdpa form and the repeat-call path, and
    sdpa() takes them (the first call through F.sdpa, recorded; the second through the cuDNN
    ATen op, recorded around the real one, where the route says so)."""
    _cuda_backend("cudnn")
    shape, causal, mask, form, repeat = CUDNN_GPU[case]
    hq, hkv, sq, sk = shape
    q, k, v = dense(2, hq, hkv, sq, sk, 128, dtype=torch.bfloat16, device="cuda", grad=grad)
    m = torch.ones(2, 1, sq, sk, dtype=torch.bool, device="cuda") if mask else None
    kw = dict(attn_mask=m, causal=causal, enable_gqa=hq != hkv)
    decision = ad.explain(q, k, v, backend="cudnn", **kw)
    if decision.backend is None:
        pytest.skip(f"cudnn refuses it here: {decision.rejected}")
    route = decision.route
    assert route.steps[0].chosen == form and route.steps[1].chosen == repeat, route.lines()
    assert f"cudnn [{route}]" in str(decision)

    sdpa_seen, op_seen = [], []
    real_sdpa, real_op = F.scaled_dot_product_attention, torch._scaled_dot_product_cudnn_attention

    def sdpa(q_, k_, v_, attn_mask=None, **o):
        sdpa_seen.append(
            dict(nested=False, mask=attn_mask, is_causal=o.get("is_causal"), rows=q_.shape[-2], k_heads=k_.size(1))
        )
        return real_sdpa(q_, k_, v_, attn_mask=attn_mask, **o)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(
        torch, "_scaled_dot_product_cudnn_attention", lambda *a, **o: op_seen.append(1) or real_op(*a, **o)
    )
    ad.sdpa(q, k, v, backend="cudnn", **kw)
    assert observed_form(sdpa_seen[-1], sq, m) == form
    del sdpa_seen[:]
    ad.sdpa(q, k, v, backend="cudnn", **kw)
    if repeat == CUDNN_OP:
        assert op_seen == [1] and not sdpa_seen
    else:
        assert not op_seen and observed_form(sdpa_seen[-1], sq, m) == form


FA_GPU = {  # id: (Hq, Hkv, Sq, Sk, head dim, causal, dropout_p, window, grad)
    "causal": (8, 8, 512, 512, 128, "top_left", 0.0, None, False),
    "gqa-decode": (8, 2, 64, 512, 128, "bottom_right", 0.0, None, False),
    "training": (8, 8, 512, 512, 128, "top_left", 0.0, None, True),
    "dropout": (8, 8, 512, 512, 128, None, 0.1, None, True),
    "head-dim-80": (8, 8, 256, 256, 80, None, 0.0, None, False),
    "window-training": (8, 8, 512, 512, 64, "top_left", 0.0, (128, 0), True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(FA_GPU), ids=list(FA_GPU))
def test_gpu_flash_attn_explain_names_the_generation_sdpa_calls(monkeypatch, case):
    """On the GPU with the installed flash-attn generations: explain(backend="flash_attn")
    names the generation, and sdpa() calls that generation's function (recorded around the
    real one); every generation preferred to it is not installed or has a reason; on an H100
    flash-attn 3 takes what it supports when installed, then flash-attn 4, and dropout goes to
    flash-attn 2."""
    backend = _cuda_backend("flash_attn")
    hq, hkv, sq, sk, d, causal, dropout_p, window, grad = FA_GPU[case]
    q, k, v = dense(2, hq, hkv, sq, sk, d, dtype=torch.bfloat16, device="cuda", grad=grad)
    kw = dict(causal=causal, dropout_p=dropout_p, window=window, enable_gqa=hq != hkv)
    decision = ad.explain(q, k, v, backend="flash_attn", **kw)
    if decision.backend is None:
        pytest.skip(f"flash_attn refuses it here: {decision.rejected}")
    kernel = decision.route.steps[0]
    assert kernel.part == "kernel" and f"flash_attn [{decision.route}]" in str(decision)
    installed = {i.label for i in backend.implementations()}
    assert kernel.chosen in installed
    for label, why in kernel.passed_over:
        assert why and (label in installed) == (not why.startswith(("not installed", "import failed")))
    if dropout_p:
        assert kernel.chosen == FA2
        assert all("dropout" in why or label not in installed for label, why in kernel.passed_over)
    elif torch.cuda.get_device_capability() == (9, 0) and FA3 in installed and d % 8 == 0:
        assert kernel.chosen == FA3

    called: list = []
    impls, errors, anything, absent = backend.load()

    def recorded(impl):
        def wrap(func):
            return None if func is None else (lambda *a, **o: called.append(impl.label) or func(*a, **o))

        return dataclasses.replace(impl, func=wrap(impl.func), varlen_func=wrap(impl.varlen_func))

    monkeypatch.setattr(backend, "loaded", ([recorded(i) for i in impls], errors, anything, absent))
    ad.clear_cache()
    ad.sdpa(q, k, v, backend="flash_attn", **kw)
    assert called == [kernel.chosen]
    for _ in range(2):  # the prepared runner: a relauncher records its first call, then relaunches it
        ad.sdpa(q, k, v, backend="flash_attn", **kw)
    relaunched = len(decision.route.steps) > 1 and decision.route.steps[1].chosen == RELAUNCHED
    assert called == [kernel.chosen] * (2 if relaunched else 3)
