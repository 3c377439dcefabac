"""sdpa()'s recent signatures (fast_key.recent_entry, checked inline in sdpa(), issue 35): a call
that passes a recent entry's check is a call with that entry's fast-path key (every field of
call_key) and the full path's decision (every field), it runs the prepared runner (or its
``first_of`` op) and records its decision, and anything else (another size, stride, dtype, grad
need, option type, alignment, config, scope, determinism, a mask, a tensor passed twice,
inference mode, tracing) takes the key's path as before."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import attention_dispatch as ad
from attention_dispatch import api, dispatch, torch_private
from attention_dispatch.fast_key import RECENT, RECENT_LIMIT, call_key

pytestmark = pytest.mark.skipif(
    torch_private.tensor_check is None, reason="this torch has no tested TensorGuards (torch_private)"
)

ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "causal", "window", "deterministic", "backend")


def _qkv(shape=(1, 2, 8, 16), dtype=torch.float32):
    return tuple(torch.randn(shape, dtype=dtype) for _ in range(3))


def _options(**kw):
    base = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    base.update(causal=None, window=None, deterministic=None, backend=None)
    base.update(kw)
    return base


def _entries():
    recent = dispatch.fast_calls.get(RECENT)
    return () if recent is None else recent[1]


class _Miss(Exception):
    pass


def _no_key(*args):
    raise _Miss  # the call left the recent entries for the key's path: stop it there


def _hit(q, k, v, **kw):
    """The recent entry that sdpa() runs for this call (its runner traced, first_of off), else
    None: the call went on to call_key(), stopped there (nothing decided, nothing remembered)."""
    entries, ran = _entries(), []

    def traced(entry):
        def run(*args):
            ran.append(entry)
            return entry[7](*args)

        return entry[:7] + (run,) + entry[8:-1] + (None,)

    dispatch.fast_calls[RECENT] = (None, tuple(traced(e) for e in entries))
    saved, api.call_key = api.call_key, _no_key
    try:
        ad.sdpa(q, k, v, **_options(**kw))
    except _Miss:
        return None
    finally:
        api.call_key = saved
        dispatch.fast_calls[RECENT] = (None, entries)
    assert len(ran) == 1
    return ran[0]


def _key(q, k, v, **kw):
    o = _options(**kw)
    return call_key(q, k, v, *(o[name] for name in ARGS))


def _warm(q, k, v, **kw):
    """Two calls: the first takes the full path, the second hits the key and makes the entry."""
    ad.sdpa(q, k, v, **kw)
    ad.sdpa(q, k, v, **kw)


def test_a_repeated_call_hits_without_the_key(monkeypatch):
    q, k, v = _qkv()
    _warm(q, k, v)
    assert len(_entries()) == 1
    monkeypatch.setattr(ad.api, "call_key", lambda *a: pytest.fail("the key was computed"))
    q2, k2, v2 = (t.clone() for t in (q, k, v))  # other tensors, the same signature
    out = ad.sdpa(q2, k2, v2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q2, k2, v2))
    assert ad.last_decision() is _entries()[0][6]


def _variants():
    """(name, make(q, k, v) -> (q, k, v, kw)): calls that differ from the warm one in one fact."""
    off = lambda t: torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)  # noqa: E731
    return [
        ("shape", lambda q, k, v: (q[:, :, :4], k, v, {})),
        ("stride", lambda q, k, v: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, {})),
        ("dtype", lambda q, k, v: (q.double(), k.double(), v.double(), {})),
        ("requires_grad", lambda q, k, v: (q.clone().requires_grad_(), k, v, {})),
        ("misaligned", lambda q, k, v: (off(q), k, v, {})),
        ("q is k", lambda q, k, v: (q, q, v, {})),
        ("subclass", lambda q, k, v: (torch.nn.Parameter(q, requires_grad=False), k, v, {})),
        ("int dropout", lambda q, k, v: (q, k, v, {"dropout_p": 0})),
        ("int is_causal", lambda q, k, v: (q, k, v, {"is_causal": 0})),
        ("is_causal", lambda q, k, v: (q, k, v, {"is_causal": True})),
        ("scale", lambda q, k, v: (q, k, v, {"scale": 0.5})),
        ("int scale", lambda q, k, v: (q, k, v, {"scale": 1})),
        ("causal", lambda q, k, v: (q, k, v, {"causal": "bottom_right"})),
        ("backend", lambda q, k, v: (q, k, v, {"backend": "math"})),
        ("deterministic", lambda q, k, v: (q, k, v, {"deterministic": True})),
        ("int deterministic", lambda q, k, v: (q, k, v, {"deterministic": 1})),
        ("mask", lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool)})),
    ]


@pytest.mark.parametrize("name,make", _variants(), ids=[n for n, _ in _variants()])
def test_a_call_that_differs_in_one_fact_never_hits_an_entry_of_another_key(name, make):
    q, k, v = _qkv()
    _warm(q, k, v)
    q2, k2, v2, kw = make(*(t.clone() for t in (q, k, v)))
    entry = _hit(q2, k2, v2, **kw)
    assert entry is None or entry[8] == _key(q2, k2, v2, **kw)
    assert entry is None  # each of these changes the key


@pytest.mark.parametrize(
    "scope",
    ["config", "backends", "deterministic", "no_grad", "inference_mode"],
)
def test_the_dispatch_state_is_checked(scope):
    q, k, v = _qkv()
    q.requires_grad_()
    _warm(q, k, v)
    assert _hit(q, k, v) is not None
    contexts = {
        "config": lambda: ad.use_config({"dispatch": {"policy": "priority"}}),
        "backends": lambda: ad.use_backends("math"),
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
    }
    if scope == "deterministic":
        torch.use_deterministic_algorithms(True)
        try:
            assert _hit(q, k, v) is None
        finally:
            torch.use_deterministic_algorithms(False)
        return
    with contexts[scope]():
        assert _hit(q, k, v) is None
        out = ad.sdpa(q, k, v)  # the key's path, decided for this state
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


class _Spare(ad.Backend):
    name = "spare_for_recent"

    def is_available(self):
        return False


def _swap_loaded_config():
    """Another loaded config without a version bump (no API does that: the check is defensive)."""
    ad.config._loaded = ad.config._loaded.model_copy()


@pytest.mark.parametrize(
    "change",
    [
        lambda: ad.config._bump(),  # what dropping the config pins does: the version alone
        lambda: ad.load_config(),  # another loaded config, and the version
        lambda: ad.register_backend(_Spare()),  # the registry's version
        _swap_loaded_config,
    ],
    ids=["config version", "loaded config", "registry", "loaded config alone"],
)
def test_a_process_wide_change_is_another_state(change):
    q, k, v = _qkv()
    ad.load_config()
    _warm(q, k, v)
    assert _hit(q, k, v) is not None
    change()
    assert _hit(q, k, v) is None
    torch.testing.assert_close(ad.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_a_mask_call_has_its_own_entry():
    q, k, v = _qkv()
    mask = torch.rand(1, 1, 8, 8) > 0.3
    mask[..., 0] = True
    _warm(q, k, v, attn_mask=mask)
    assert _hit(q, k, v, attn_mask=mask) is not None
    assert _hit(q, k, v) is None
    assert _hit(q, k, v, attn_mask=mask.float()) is None
    out = ad.sdpa(q, k, v, attn_mask=mask.clone())
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_no_entry_for_a_tensor_passed_twice():
    q, _, v = _qkv()
    _warm(q, q, v)
    assert _entries() == ()
    torch.testing.assert_close(ad.sdpa(q, q, v), F.scaled_dot_product_attention(q, q, v))


def test_clearing_fast_calls_forgets_the_entries():
    q, k, v = _qkv()
    _warm(q, k, v)
    dispatch.fast_calls.clear()
    assert _hit(q, k, v) is None
    _warm(q, k, v)
    ad.clear_cache()
    assert _entries() == ()


def test_a_failing_runner_drops_its_entry_and_the_full_path_runs(monkeypatch):
    q, k, v = _qkv()
    _warm(q, k, v)
    entry = _entries()[0]

    def broken(*a):
        raise RuntimeError("stale runner")

    dispatch.fast_calls[RECENT] = (None, (entry[:7] + (broken,) + entry[8:-1] + (None,),))
    out = ad.sdpa(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    assert all(e[7] is not broken for e in _entries())


def test_a_failing_first_of_op_drops_its_entry_and_the_full_path_runs():
    q, k, v = _qkv()
    _warm(q, k, v, backend="torch_cpu")
    entry = _entries()[0]
    assert entry[14] is not None  # torch_cpu's plain call: sdpa() calls the op itself

    def broken(*a):
        raise RuntimeError("stale op")

    dispatch.fast_calls[RECENT] = (None, (entry[:14] + (broken,),))
    out = ad.sdpa(q, k, v, backend="torch_cpu")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    assert all(e[14] is not broken for e in _entries())


def test_the_first_of_op_computes_what_the_runner_does():
    q, k, v = _qkv()
    _warm(q, k, v, backend="torch_cpu")
    entry = _entries()[0]
    assert entry[14] is not None and entry[7].first_of is entry[14]
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    torch.testing.assert_close(ad.sdpa(q2, k2, v2, backend="torch_cpu"), entry[7](q2, k2, v2), rtol=0, atol=0)
    assert ad.last_decision() is entry[6]
    _warm(q, k, v, backend="torch_cpu", is_causal=True)  # a runner without first_of: no op
    assert _entries()[0][8] != entry[8] and _entries()[0][14] is None
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    _warm(q, k, v, attn_mask=mask, backend="torch_cpu")
    assert _entries()[0][1] and _entries()[0][14] is None  # a mask call runs its runner


def _fields(decision):
    return {f.name: getattr(decision, f.name) for f in dataclasses.fields(decision)}


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"dropout_p": 0.0, "is_causal": False},
        {"is_causal": True},
        {"scale": 0.3},
        {"causal": "bottom_right"},
        {"backend": "torch_cpu"},
        {"backend": "torch_cpu", "dropout_p": 0.0, "is_causal": False},
    ],
    ids=["plain", "transformers", "causal", "scale", "bottom_right", "torch_cpu", "torch_cpu transformers"],
)
def test_a_hit_records_the_full_paths_decision_field_by_field(kw):
    q, k, v = _qkv()
    _warm(q, k, v, **kw)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    entry = _hit(q2, k2, v2, **kw)
    assert entry is not None and entry[8] == _key(q2, k2, v2, **kw)
    hit = ad.sdpa(q2, k2, v2, **kw)
    hit_decision = ad.last_decision()
    ad.clear_cache()  # the same call decided from scratch, on the full path
    full = ad.sdpa(q2, k2, v2, **kw)
    assert _fields(hit_decision) == _fields(ad.last_decision())
    torch.testing.assert_close(hit, full, rtol=0, atol=0)


def test_more_signatures_than_the_limit_stay_correct():
    shapes = [(1, 2, s, 16) for s in range(4, 4 + RECENT_LIMIT + 2)]
    tensors = [_qkv(s) for s in shapes]
    for _ in range(3):
        for q, k, v in tensors:
            torch.testing.assert_close(ad.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert len(_entries()) == RECENT_LIMIT
    assert len({e[8] for e in _entries()}) == RECENT_LIMIT


def test_an_entry_keeps_no_tensor_alive():
    q, k, v = _qkv()
    _warm(q, k, v)
    refs = [weakref.ref(t) for t in (q, k, v)]
    del q, k, v
    gc.collect()
    assert _entries() and all(r() is None for r in refs)


def test_equal_options_hit_whether_or_not_they_are_the_entrys_objects():
    q, k, v = _qkv()
    scale = 0.25
    _warm(q, k, v, scale=scale)
    entry = _hit(q, k, v, scale=scale)  # the entry's own float: the identity check
    assert entry is not None and entry[2][2] is scale
    assert _hit(q, k, v, scale=float("0.25")) is entry  # an equal float of another object
    assert _hit(q, k, v, scale=0.5) is None


def test_determinism_warn_only_is_another_state():
    q, k, v = _qkv()
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        _warm(q, k, v)
        assert _hit(q, k, v) is not None
        torch.use_deterministic_algorithms(True)
        assert _hit(q, k, v) is None
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_no_recent_entry_is_read_while_export_traces(monkeypatch):
    q, k, v = _qkv()
    _warm(q, k, v)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # what torch.export sets
    monkeypatch.setattr(ad.api, "_recent_get", lambda *a: pytest.fail("a recent entry was read while tracing"))
    torch.testing.assert_close(ad.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize(
    "warm, same, other_type",
    [
        ({"dropout_p": 0.0}, {"dropout_p": float("0.0")}, {"dropout_p": 0}),
        ({"window": (3, 0)}, {"window": tuple([3, 0])}, {"window": (3.0, 0)}),
        ({"causal": "bottom_right"}, {"causal": "".join(["bottom", "_right"])}, None),
        ({"backend": "math"}, {"backend": "".join(["ma", "th"])}, None),
        ({"scale": 1.0}, {"scale": float("1.0")}, {"scale": 1}),
    ],
    ids=["dropout_p", "window", "causal", "backend", "scale"],
)
def test_an_option_equal_to_the_entrys_hits_and_one_of_another_type_does_not(warm, same, other_type):
    q, k, v = _qkv()
    _warm(q, k, v, **warm)
    name = next(iter(warm))
    assert same[name] is not warm[name] and same[name] == warm[name]
    entry = _hit(q, k, v, **same)
    assert entry is not None and entry[8] == _key(q, k, v, **same)
    if other_type is not None:
        assert _hit(q, k, v, **other_type) is None
