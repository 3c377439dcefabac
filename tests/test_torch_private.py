"""torch_private: the adapter of torch's private TensorGuards is on only for tested torch
releases, and where it is on, the installed TensorGuards takes the construction call we make
and its check has each property fast_key's recent signatures rely on (a C++ class has no
inspect.signature, so the call and these behaviours are its signature)."""

from __future__ import annotations

import pytest
import torch

from attention_dispatch import torch_private
from attention_dispatch.torch_private import tensor_check, untested_torch


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.13.0a0+git1234"])
def test_tested_releases(version):
    assert untested_torch(version) is None


@pytest.mark.parametrize("version", ["2.10.0", "2.14.0", "3.0.0", "1.13.1", "", "nightly"])
def test_untested_releases_keep_the_adapter_off(version):
    reason = untested_torch(version)
    assert "is not a tested release (2.11-2.13)" in reason
    assert torch_private._adapter(version) is None


needs_guards = pytest.mark.skipif(tensor_check is None, reason="this torch has no tested TensorGuards")


@needs_guards
def test_the_construction_call_binds_to_the_installed_tensor_guards():
    """The keywords we pass are TensorGuards' own: a wrong one is refused, so ours are read."""
    from torch._C._dynamo.guards import TensorGuards

    t = torch.randn(2, 3)
    assert TensorGuards(t, dynamic_dims_sizes=None, dynamic_dims_strides=None).check(t)
    with pytest.raises(TypeError):
        TensorGuards(t, dynamic_dims_sizes=None, no_such_keyword=None)


def _complex():
    return torch.randn(2, 3, 4, dtype=torch.complex64)


def _base():
    return torch.randn(2, 3, 4, 8)


# (property, base tensor, the same property in another tensor, that property changed)
CHANGES = [
    ("dtype", _base, lambda t: t.clone(), lambda t: t.double()),
    ("device", _base, lambda t: t.clone(), lambda t: t.to("meta")),
    ("shape", _base, lambda t: t.clone(), lambda t: t[:, :, :2]),
    ("stride", _base, lambda t: t.clone(), lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
    ("requires_grad", _base, lambda t: t.clone(), lambda t: t.clone().requires_grad_()),
    ("conj view", _complex, lambda t: t.clone(), lambda t: t.conj()),
    ("neg view", lambda: _complex().imag, lambda t: _complex().imag, lambda t: _complex().conj().imag),
    ("subclass", _base, lambda t: t.clone(), lambda t: torch.nn.Parameter(t, requires_grad=False)),
]


@needs_guards
@pytest.mark.parametrize("name, make, same, changed", CHANGES, ids=[c[0] for c in CHANGES])
def test_the_check_accepts_the_same_and_rejects_each_change(name, make, same, changed):
    base = make()
    other = torch.randn(5, 6)  # a second tensor that stays as it was
    check = tensor_check(base, other)
    assert check is not None
    alike = same(base)
    assert alike is not base and alike.data_ptr() != base.data_ptr()
    assert check(alike, other.clone())  # other storage, the same properties
    moved = changed(base)
    assert not check(moved, other), name
    assert not check(other, base), "the tensors are checked one for one, in order"


@needs_guards
def test_the_check_rejects_a_change_of_the_second_tensor():
    a, b = _base(), _base()
    check = tensor_check(a, b)
    assert check(a, b)
    assert not check(a, b.double())
    assert not check(a, b[:1])


@needs_guards
def test_tensor_guards_refusing_the_tensors_gives_no_check(monkeypatch):
    def refuse(*tensors, **kw):
        raise RuntimeError("refused")

    monkeypatch.setattr(torch_private, "_TensorGuards", refuse)
    assert tensor_check(_base()) is None


# (adapter, torch._C name, public twin or None) for the getters read instead of a public call
GETTERS = [
    ("deterministic", "_get_deterministic_algorithms", torch.are_deterministic_algorithms_enabled),
    (
        "deterministic_warn_only",
        "_get_deterministic_algorithms_warn_only",
        torch.is_deterministic_algorithms_warn_only_enabled,
    ),
    ("any_autocast", "_is_any_autocast_enabled", torch_private._maybe_autocast),
    ("cuda_device", "_cuda_getDevice", None),
    ("cuda_raw_stream", "_cuda_getCurrentRawStream", None),
]


@pytest.mark.parametrize("adapter, name, public", GETTERS, ids=[g[0] for g in GETTERS])
def test_each_getter_is_the_private_attribute_on_a_tested_torch_and_the_public_one_elsewhere(adapter, name, public):
    found = getattr(torch._C, name, None)
    if name.startswith("_cuda"):  # a CPU build has neither; a CUDA build of a tested torch has both
        assert (found is not None) == torch.cuda._is_compiled()
    else:
        assert found is not None, f"torch {torch.__version__} has no torch._C.{name}"
    expected = found if found is not None and untested_torch(torch.__version__) is None else public
    assert getattr(torch_private, adapter) is expected
    assert torch_private._private(name, public, "2.14.0") is public


@pytest.mark.parametrize("mode", [False, True, "warn_only"])
def test_the_deterministic_getters_match_the_public_functions(mode):
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(bool(mode), warn_only=mode == "warn_only")
        assert torch_private.deterministic() is torch.are_deterministic_algorithms_enabled() is bool(mode)
        warn = torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch_private.deterministic_warn_only() is warn is (mode == "warn_only")
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_autocast_getter_sees_each_device_types_autocast(device_type):
    if device_type == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA autocast turns itself off without a CUDA device")
    assert torch_private.any_autocast() is False
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=True):
        assert torch_private.any_autocast() is True
        assert torch_private._maybe_autocast() is True
    assert torch_private.any_autocast() is False


def test_the_forward_level_is_forward_ads_current_level():
    assert (torch_private.forward_ad is torch.autograd.forward_ad) == (untested_torch(torch.__version__) is None)
    assert torch_private._forward_ad("2.14.0")._current_level == 0  # the stand-in: a level may be open
    assert torch_private.forward_ad._current_level == -1
    with torch.autograd.forward_ad.dual_level():
        assert torch_private.forward_ad._current_level == 0
    assert torch_private.forward_ad._current_level == -1


@pytest.mark.parametrize(
    "wrapped", [torch_private.functorch_wrapped, torch_private._storage_less], ids=["adapter", "stand-in"]
)
def test_functorch_wrapped_tensors_are_told_apart(wrapped):
    assert (torch_private.functorch_wrapped is torch._C._functorch.is_functorch_wrapped_tensor) == (
        untested_torch(torch.__version__) is None
    )
    assert torch_private._functorch_wrapped("2.14.0") is torch_private._storage_less
    x = torch.randn(2, 3)
    assert not wrapped(x)
    seen = []
    torch.func.vmap(lambda t: seen.append(wrapped(t)) or t)(x)
    torch.func.grad(lambda t: seen.append(wrapped(t)) or t.sum())(x)
    assert seen == [True, True]


@pytest.mark.parametrize("flag", [False, True])
def test_the_compiling_flag_is_what_is_compiling_returns(monkeypatch, flag):
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", flag)
    assert (torch_private.compiler is torch.compiler) == (untested_torch(torch.__version__) is None)
    stand_in = torch_private._compiler("2.14.0")
    assert stand_in is not torch.compiler
    for holder in (torch_private.compiler, stand_in):
        assert holder._is_compiling_flag is torch.compiler.is_compiling() is flag


@pytest.mark.gpu
def test_the_cuda_getters_give_the_current_device_and_stream():
    assert torch_private.cuda_raw_stream is not None, "a tested CUDA torch turns the raw-stream pair on"
    for index in range(torch.cuda.device_count()):
        with torch.cuda.device(index), torch.cuda.stream(torch.cuda.Stream()):
            assert torch_private.cuda_device() == torch.cuda.current_device() == index
            raw = torch_private.cuda_raw_stream(torch_private.cuda_device())
            assert raw == torch.cuda.current_stream().cuda_stream != torch.cuda.default_stream().cuda_stream


def test_checkpoint_stop_is_the_exception_non_reentrant_checkpointing_raises():
    import torch.utils.checkpoint as tuc

    found = getattr(tuc, "_StopRecomputationError", None)
    assert found is not None, f"torch {torch.__version__} has no torch.utils.checkpoint._StopRecomputationError"
    assert torch_private.checkpoint_stop is found
    assert issubclass(torch_private._NeverRaised, Exception)
