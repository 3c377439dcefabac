"""Issue 36's features through the flash-attn adapter (attention_dispatch/backends/flash_attn_features.py):
softcap, alibi_slopes, sinks and return_lse, per generation.

On the CPU every generation runs against tests/fakes, which compute the features from their
definitions with each library's own conventions (flash-attn 2's +inf logsumexp of an empty row
and its causal ALiBi shifted by a per-row constant, flash-attn 4's logsumexp with the sink in it,
2's and 3's logsumexp without a gradient).  Each generation is registered as a CPU backend and
every claim its declared Capabilities generate (tests/test_capabilities.py's claimed_cases) is
checked against the float64 oracle, one test item per claim.  The fakes' public signatures are
compared with the installed libraries' where they are installed; on a GPU the real libraries'
claims run in tests/test_capabilities.py (marked gpu).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.backends import flash_attn_features as features
from attention_dispatch.backends.flash_attn import FlashAttnBackend
from attention_dispatch.problem import Problem
from attention_dispatch.semantics import CausalKind
from tests import fakes
from tests.naive import naive_attention
import oracle
from test_capabilities import check_claim, claimed_cases

BR = CausalKind.BOTTOM_RIGHT
KEYS = {2: "fa2", 3: "fa3", 4: "fa4"}
MODULES = ("flash_attn", "flash_attn_interface", "flash_attn.cute", "flash_attn.cute.interface")


def _modules(*versions, calls=None) -> dict:
    calls = [] if calls is None else calls
    modules: dict = {}
    for v in versions:
        for name, mod in fakes.make_flash_attn(v, calls).items():
            if name == "flash_attn" and "flash_attn" in modules:  # fa2 + fa4: one package with both
                mod = modules["flash_attn"]
            modules[name] = mod
        if v == 4 and 2 in versions:
            modules["flash_attn"].cute = modules["flash_attn.cute"]
    return modules


def _install(monkeypatch, modules):
    for name in MODULES:
        if name not in modules:
            monkeypatch.delitem(sys.modules, name, raising=False)
    fakes.install(monkeypatch, modules)


class OnCpu(FlashAttnBackend):
    """flash_attn over the fakes, registered for CPU tensors: it decides as on a CUDA device of
    compute capability `cc` (the fakes compute on the CPU)."""

    def __init__(self, name: str, versions: tuple[str, ...], cc=(9, 0)):
        super().__init__(versions)
        self.name, self.cc = name, cc

    def is_available(self) -> bool:
        return True

    def unavailable_reason(self) -> str:
        return ""

    @property
    def capabilities(self):  # type: ignore[override]
        return dataclasses.replace(super().capabilities, devices=frozenset({"cuda", "cpu"}))

    def reasons(self, problem):
        return super().reasons(dataclasses.replace(problem, device_type="cuda", compute_capability=self.cc))


def _fake_caps(version: int):
    """The Capabilities generation `version` declares over its fakes (for collection)."""
    saved = {name: sys.modules.get(name) for name in MODULES}
    try:
        for name in MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(_modules(version))
        return FlashAttnBackend((KEYS[version],)).implementations()[0].caps
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def _fake_keep_mask(case, q, k, cu_q, cu_k):
    """The dropout keep-mask the flash-attn 2 fake draws (dense): the oracle then checks the
    exact output and gradients instead of a mean over many draws."""
    assert cu_q is None, "the fake draws no varlen dropout"
    shape = (q.shape[0], case.heads_q, q.shape[2], k.shape[2])
    return torch.rand(shape, dtype=torch.float64) >= case.dropout_p


@pytest.fixture
def fake_backend(monkeypatch):
    """fake_backend(version) installs that generation's fakes and registers it on the CPU."""

    def make(version: int, cc=(9, 0), calls=None) -> str:
        _install(monkeypatch, _modules(version, calls=calls))
        name = f"fake_fa{version}"
        monkeypatch.setitem(oracle.KEEP_MASKS, name, _fake_keep_mask)
        ad.register_backend(OnCpu(name, (KEYS[version],), cc), priority="first", replace=name in ad.list_backends())
        return name

    return make


def _claims():
    for version in (2, 3, 4):
        # flash-attn 4 compiles head dims 64, 96 and 128: its claims at the GPU's sizes
        for label, case, single in claimed_cases(_fake_caps(version), big=version == 4):
            yield pytest.param(version, label, case, single, id=f"fa{version}: {label}")


@pytest.mark.parametrize("version,label,case,single", list(_claims()))
def test_claim_holds_against_the_fakes(fake_backend, version, label, case, single):
    """Every claim of each generation (features alone and combined included) against the oracle,
    decided as on an H100 (flash-attn 4: on sm100, where its backward takes a window and varlen,
    so that sinks with their gradient meet both; its sm90 rules are tests/test_adapters.py's)."""
    name = fake_backend(version, cc=(10, 0) if version == 4 else (9, 0))
    if not check_claim(name, label, case, single):
        pytest.skip(f"fa{version} refines {label} away in its own checks")


def test_each_generation_declares_its_features():
    flags = {v: {f for f in features.FLAGS if getattr(_fake_caps(v), f)} for v in (2, 3, 4)}
    assert flags[2] == {"softcap", "alibi", "return_lse"}
    assert flags[3] == {"softcap", "return_lse"}
    assert flags[4] == {"softcap", "sinks", "sinks_grad", "return_lse", "lse_grad"}


def _narrowed(monkeypatch, version, module, func, drop=(), interface_attr=None):
    """Generation `version`'s flags with `func` of `module` taking none of `drop` (an older release)."""
    modules = _modules(version)
    target = modules[module]
    original = getattr(target, func)
    kept = [p for n, p in inspect.signature(original).parameters.items() if n not in drop]

    def older(*args, **kwargs):
        return original(*args, **kwargs)

    older.__signature__ = inspect.Signature(kept)
    setattr(target, func, older)
    if interface_attr is not None:
        delattr(modules["flash_attn.cute.interface"], interface_attr)
    _install(monkeypatch, modules)
    caps = FlashAttnBackend((KEYS[version],)).implementations()[0].caps
    return {f for f in features.FLAGS if getattr(caps, f)}


def test_older_releases_claim_only_what_their_functions_take(monkeypatch):
    # flash-attn 2 before 2.6.0: no softcap (its varlen function decides as much as the dense one)
    assert _narrowed(monkeypatch, 2, "flash_attn", "flash_attn_varlen_func", ("softcap",)) == {"alibi", "return_lse"}
    # flash-attn 4 before 4.0.0b26: bfloat16 sinks only and no sink gradient in _flash_attn_bwd
    fa4 = _narrowed(
        monkeypatch, 4, "flash_attn.cute.interface", "_flash_attn_bwd", ("learnable_sink",), "_LEARNABLE_SINK_DTYPES"
    )
    assert fa4 == {"softcap", "return_lse", "lse_grad"}
    # before 4.0.0b5: no dlse, so the logsumexp it returns is forward only
    fa4 = _narrowed(monkeypatch, 4, "flash_attn.cute.interface", "_flash_attn_bwd", ("dlse",))
    assert fa4 == {"softcap", "sinks", "sinks_grad", "return_lse"}


def problem(**kw) -> Problem:
    fields = dict(
        batch=2,
        heads_q=4,
        heads_kv=4,
        seqlen_q=64,
        seqlen_k=64,
        head_dim_qk=64,
        head_dim_v=64,
        dtype=torch.bfloat16,
        device_type="cuda",
        compute_capability=(9, 0),
        layout="dense",
        mask_kind="none",
        mask_shape=None,
        mask_requires_grad=False,
        causal=None,
        window=None,
        dropout=False,
        requires_grad=False,
        deterministic=False,
        deterministic_warn_only=False,
        last_dim_contiguous=True,
        aligned_16=True,
    )
    fields.update(kw)
    return Problem(**fields)


def test_reasons_name_the_generation_and_the_argument(monkeypatch):
    _install(monkeypatch, _modules(2, 3, 4))
    backend = FlashAttnBackend()
    r = backend.reasons
    assert "flash-attn 2: softcap with dropout_p > 0 (flash-attn 2: softcapping does not support dropout)" in r(
        problem(softcap=True, dropout=True)
    )
    assert any(
        x.startswith("flash-attn 2: return_lse with dropout_p > 0") for x in r(problem(return_lse=True, dropout=True))
    )
    shifted = [problem(alibi=True, return_lse=True, causal=BR), problem(alibi=True, return_lse=True, window=(-1, 0))]
    shifted.append(problem(alibi=True, return_lse=True, causal=BR, window=(64, 3)))  # left >= Sk: causal kernel
    for p in shifted:
        assert any("return_lse with alibi_slopes and causal" in x for x in r(p)), p
    local = problem(alibi=True, return_lse=True, causal=BR, window=(8, -1))  # the exact |i + off - j| kernel
    assert backend.select(local).impl.key == "fa2"
    assert "flash-attn 4: return_lse with sinks (flash-attn 4's logsumexp includes the sink; ours leaves it out)" in r(
        problem(sinks=True, return_lse=True)
    )
    assert "flash-attn 3: alibi_slopes not supported" in r(problem(alibi=True, sinks=True))
    assert "flash-attn 2: sinks not supported" in r(problem(alibi=True, sinks=True))
    # forward-only logsumexp: the shared check names it, per generation
    grad = r(problem(return_lse=True, requires_grad=True, head_dim_qk=80, head_dim_v=80))
    assert "flash-attn 2: return_lse with gradients: the returned logsumexp is not differentiable" in grad
    # the KV-cache path maps none of them
    kv = problem(layout="kvcache", softcap=True, seqlen_q=1, kv_block_size=None)
    assert "flash-attn 3: softcap, alibi_slopes, sinks and return_lse are not mapped for KV-cache calls" in (
        backend.select(kv).refusals
    )


def test_each_feature_goes_to_the_generation_that_has_it(monkeypatch):
    _install(monkeypatch, _modules(2, 3, 4))
    backend = FlashAttnBackend()

    def chosen(**kw):
        return backend.select(problem(**kw)).impl.key

    assert chosen(softcap=True) == "fa3" and chosen(return_lse=True) == "fa3"
    assert chosen(alibi=True) == "fa2"
    assert chosen(sinks=True, sinks_grad=True, requires_grad=True) == "fa4"
    assert chosen(return_lse=True, requires_grad=True) == "fa4"  # the only differentiable logsumexp
    passed = dict(backend.select(problem(sinks=True)).passed_over)
    assert passed["flash-attn 3"] == "sinks not supported"


def _dense_inputs(b=2, hq=4, hkv=2, sq=40, sk=24, d=64, dtype=torch.bfloat16, grad=False):
    mk = lambda *s: torch.randn(*s, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, d)


def test_flash_attn_2_lse_of_empty_rows_is_minus_inf_and_alibi_maps_exactly(fake_backend):
    """Sq > Sk bottom-right causal leaves rows without a key: flash-attn 2 marks them +inf, we
    return -inf; ALiBi (B, Hq) with a window goes as flash-attn 2's stride-0-batch fp32 slopes."""
    calls = []
    name = fake_backend(2, calls=calls)
    q, k, v = _dense_inputs()
    slopes = torch.rand(4) * 0.5
    with torch.no_grad():
        out, lse = ad.sdpa(q, k, v, causal="bottom_right", enable_gqa=True, softcap=2.5, return_lse=True, backend=name)
        ref, ref_lse = naive_attention(
            *(t.double() for t in (q, k, v)), causal="bottom_right", softcap=2.5, return_lse=True
        )
        assert (lse[:, :, :16] == -math.inf).all() and torch.isfinite(lse[:, :, 16:]).all()
        torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=0)
        assert calls[-1]["return_lse"] is True and calls[-1]["softcap"] == 2.5
        out = ad.sdpa(q, k, v, window=(6, 2), enable_gqa=True, alibi_slopes=slopes, backend=name)
        slopes_passed = calls[-1]["alibi_slopes"]
        assert (
            slopes_passed.shape == (2, 4) and slopes_passed.stride() == (0, 1) and slopes_passed.dtype == torch.float32
        )
        ref = naive_attention(*(t.double() for t in (q, k, v)), window=(6, 2), alibi_slopes=slopes.double())
        torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=0)


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("varlen", [False, True])
def test_an_empty_call_returns_minus_inf_lse(monkeypatch, version, varlen):
    _install(monkeypatch, _modules(version))
    if varlen:
        q, k, v = torch.randn(5, 4, 64, dtype=torch.bfloat16), *torch.randn(2, 0, 4, 64, dtype=torch.bfloat16)
        cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=0)
    else:
        q, k, v = _dense_inputs(hkv=4, sk=0)
        kw = {}
    out, lse = FlashAttnBackend().run(q, k, v, return_lse=True, causal=None, window=None, **kw)
    assert not out.any() and (lse == -math.inf).all() and lse.dtype == torch.float32
    assert lse.shape == ((4, 5) if varlen else (2, 4, 40))


def test_keywords_each_generation_receives(fake_backend):
    """softcap as a float, sinks as float32 learnable_sink (the gradient back in the sinks' dtype),
    the logsumexp asked for by each generation's own keyword."""
    calls = []
    name = fake_backend(4, calls=calls)
    q, k, v = _dense_inputs(sq=24, grad=True)
    sinks = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    out = ad.sdpa(q, k, v, enable_gqa=True, softcap=3, sinks=sinks, backend=name)
    call = calls[-1]
    assert call["softcap"] == 3.0 and isinstance(call["softcap"], float)
    assert call["learnable_sink"].dtype == torch.float32 and "return_lse" not in call
    out.sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16 and sinks.grad.abs().sum() > 0
    with torch.no_grad():
        ad.sdpa(q, k, v, enable_gqa=True, return_lse=True, backend=name)
    assert calls[-1]["return_lse"] is True
    name = fake_backend(3, calls=calls)
    with torch.no_grad():
        ad.sdpa(q, k, v, enable_gqa=True, return_lse=True, backend=name)
    assert calls[-1]["return_lse"] is True  # recorded from flash-attn 3's return_attn_probs
    assert "learnable_sink" not in calls[-1] and "alibi_slopes" not in calls[-1]


def test_a_call_with_features_is_prepared_as_run(monkeypatch):
    """sdpa()'s fast path never takes these calls, but prepare() (policy="fastest" times it) must
    not relaunch a recorded flash-attn 4 forward without them: it runs run()."""
    _install(monkeypatch, _modules(4))
    backend = FlashAttnBackend()
    q, k, v = _dense_inputs(sq=24)
    options = dict(
        attn_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
        causal=None, window=None, scale=None, enable_gqa=True, deterministic=False, softcap=2.0,
    )  # fmt: skip
    runner = backend.prepare(q, k, v, options)
    with torch.no_grad():
        torch.testing.assert_close(runner(q, k, v), backend.run(q, k, v, **options), rtol=0, atol=0)
    assert not sys.modules["flash_attn.cute.interface"].launches  # nothing recorded or relaunched


def test_route_of_a_feature_call_has_no_relaunch_step(monkeypatch):
    """sdpa() prepares no call with these features, so its route names the kernel alone."""
    q, k, v = _dense_inputs(sq=24)
    options = dict(causal=None, window=None, scale=None, enable_gqa=True, dropout_p=0.0, cu_seqlens_q=None)
    _install(monkeypatch, _modules(4))
    plain = FlashAttnBackend().route(q, k, v, options)
    assert [step.part for step in plain.steps] == ["kernel", "repeat calls"]
    _install(monkeypatch, _modules(3, 4))
    route = FlashAttnBackend().route(q, k, v, dict(options, sinks=torch.zeros(4)))
    assert [(step.part, step.chosen) for step in route.steps] == [("kernel", "flash-attn 4")]
    assert dict(route.steps[0].passed_over)["flash-attn 3"] == "sinks not supported"


FEATURE_CALLS = {
    "softcap": dict(softcap=5.0),
    "alibi_slopes": dict(alibi_slopes=torch.full((4,), 0.25)),
    "sinks": dict(sinks=torch.zeros(4)),
    "return_lse": dict(return_lse=True),
}
WHY = {
    "softcap": "softcap not supported",
    "alibi_slopes": "alibi_slopes not supported",
    "sinks": "sinks not supported",
    "return_lse": "return_lse not supported",
}


def _swallows_options(backend) -> bool:
    """run() takes unknown keywords into a catch-all it never reads (``**_``)."""
    params = inspect.signature(type(backend).run).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD and p.name == "_" for p in params)


@pytest.mark.parametrize("feature", list(FEATURE_CALLS))
def test_no_backend_that_ignores_unknown_options_is_chosen_for_a_feature(feature):
    """A backend whose run() would drop softcap, alibi_slopes, sinks or return_lse without a word
    (a ``**_`` catch-all: PyTorch's kernels, cuDNN, xformers) declares none of them, so each is
    refused with its reason on every device, whatever else the call is."""
    swallowing = [n for n in ad.list_backends() if _swallows_options(ad.get_backend(n))]
    assert {"cudnn", "torch_flash", "torch_efficient", "torch_cpu", "xformers"} <= set(swallowing)
    flag = {"alibi_slopes": "alibi", "sinks": "sinks", "softcap": "softcap", "return_lse": "return_lse"}[feature]
    for name in swallowing:
        backend = ad.get_backend(name)
        assert not getattr(backend.capabilities, flag), name
        for device, cc in (("cuda", (9, 0)), ("cpu", None)):
            p = problem(device_type=device, compute_capability=cc, **{flag: True})
            assert WHY[feature] in backend.reasons(p), (name, device)
    q, k, v = _dense_inputs(hkv=4, sq=8, sk=8, d=16, dtype=torch.float32)
    decision = ad.explain(q, k, v, **FEATURE_CALLS[feature])
    assert decision.backend not in swallowing
    assert WHY[feature] in decision.rejected["torch_cpu"]


def test_info_shows_the_feature_rows():
    from attention_dispatch.backends.base import Capabilities

    rows = dict(Capabilities(softcap=True, sinks=True, sinks_grad=True, return_lse=True).rows())
    assert rows["softcap"] == "yes" and rows["sinks"] == "yes (grad)" and rows["return lse"] == "yes"
    caps = _fake_caps(2)
    rows = dict(caps.rows())
    assert rows["ALiBi"] == "yes" and rows["sinks"] == "no" and rows["return lse"] == "yes"


# ---- the fakes against the real functions ------------------------------------------------------

PUBLIC = {
    (2, "flash_attn", "flash_attn_func"),
    (2, "flash_attn", "flash_attn_varlen_func"),
    (3, "flash_attn_interface", "flash_attn_func"),
    (3, "flash_attn_interface", "flash_attn_varlen_func"),
    (4, "flash_attn.cute", "flash_attn_func"),
    (4, "flash_attn.cute", "flash_attn_varlen_func"),
}


@pytest.mark.parametrize("version,module,name", sorted(PUBLIC))
def test_fake_public_signatures_match_the_real_ones(version, module, name):
    """Every argument the fake takes by name exists in the installed function, with the same
    default where both have one; q, k, v come first."""
    try:
        real_module = __import__(module, fromlist=[name])
        real = inspect.signature(getattr(real_module, name)).parameters
    except Exception as exc:  # not installed, or broken on this machine
        pytest.skip(f"{module}.{name} not importable: {type(exc).__name__}: {exc}")
    if version == 2 and not hasattr(real_module, "__version__"):
        pytest.skip("flash_attn is flash-attn 4's namespace here")
    fake = inspect.signature(getattr(_modules(version)[module], name)).parameters
    assert list(real)[:3] == ["q", "k", "v"] == list(fake)[:3]
    for arg, param in fake.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        assert arg in real, f"{module}.{name} has no argument {arg!r}"
        if param.default is not inspect.Parameter.empty and real[arg].default is not inspect.Parameter.empty:
            assert real[arg].default == param.default, f"{arg}: default {real[arg].default!r} != {param.default!r}"
