"""sdpa_with_kvcache()'s recent signatures (kv_fast_key.kv_recent_entry / kv_recent_hit, issue
34/35): a call that passes a recent entry's C++ check is a call with that entry's key (every
field of kv_call_key), it runs the backend and records its decision, and anything else (another
size, stride, dtype, grad need, argument present or absent, option type, alignment, scope,
determinism, a tensor passed twice) takes the key's path as before."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import kvcache, torch_private
from attention_dispatch.kv_fast_key import RECENT, RECENT_LIMIT, kv_call_key, kv_calls, kv_recent_hit

pytestmark = pytest.mark.skipif(
    torch_private.tensor_check is None, reason="this torch has no tested TensorGuards (torch_private)"
)

OPTIONS = ("causal", "window", "scale", "enable_gqa", "backend", "validate")


def _step(b=2, hq=4, hkv=2, d=16, capacity=32, dtype=torch.float32):
    q = torch.randn(b, hq, 1, d, dtype=dtype)
    k_cache, v_cache = (torch.randn(b, hkv, capacity, d, dtype=dtype) for _ in range(2))
    return q, k_cache, v_cache, torch.tensor([5, 9][:b], dtype=torch.int32)


def _options(**kw):
    base = dict(causal=False, window=None, scale=None, enable_gqa=True, backend=None, validate=None)
    base.update(kw)
    return base


def _entries():
    recent = kv_calls.get(RECENT)
    return () if recent is None else recent[1]


def _args(k_new=None, v_new=None, block_table=None, **kw):
    o = _options(**kw)
    return (k_new, v_new, block_table), tuple(o[name] for name in OPTIONS)


def _hit(q, k_cache, v_cache, lens, **kw):
    (k_new, v_new, table), options = _args(**kw)
    return kv_recent_hit(_entries(), q, k_cache, v_cache, lens, k_new, v_new, table, options)


def _key(q, k_cache, v_cache, lens, **kw):
    (k_new, v_new, table), options = _args(**kw)
    return kv_call_key(q, k_cache, v_cache, lens, k_new, v_new, table, *options)


def _reference(q, k_cache, v_cache, lens):
    """float64, per sequence over its first lens[b] keys (GQA: query head h reads kv head h // G)."""
    g = q.shape[1] // k_cache.shape[1]
    rows = []
    for b, n in enumerate(lens.tolist()):
        k = k_cache[b, :, :n].double().repeat_interleave(g, 0)
        v = v_cache[b, :, :n].double().repeat_interleave(g, 0)
        p = torch.softmax(q[b].double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        rows.append(p @ v)
    return torch.stack(rows)


def _warm(q, k_cache, v_cache, lens, **kw):
    """Two calls: the first takes the full path, the second hits the key and makes the entry."""
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, **kw)
    ad.sdpa_with_kvcache(q, k_cache, v_cache, lens, **kw)


def test_a_repeated_step_hits_without_the_key(monkeypatch):
    q, k_cache, v_cache, lens = _step()
    _warm(q, k_cache, v_cache, lens)
    assert len(_entries()) == 1
    monkeypatch.setattr(kvcache, "kv_call_key", lambda *a: pytest.fail("the key was computed"))
    q2, k2, v2 = (t.clone() for t in (q, k_cache, v_cache))  # other tensors and lengths, one signature
    lens2 = torch.tensor([3, 31], dtype=torch.int32)
    out = ad.sdpa_with_kvcache(q2, k2, v2, lens2)
    torch.testing.assert_close(out.double(), _reference(q2, k2, v2, lens2), atol=1e-5, rtol=1e-5)
    assert ad.last_decision() is _entries()[0][4][0]
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\]=33 exceeds the cache's capacity 32"):
        ad.sdpa_with_kvcache(q2, k2, v2, torch.tensor([3, 33], dtype=torch.int32))  # values still checked


def test_a_step_with_append_hits_and_appends():
    q, k_cache, v_cache, lens = _step()
    k_new, v_new = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    _warm(q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new)
    assert _hit(q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new) is not None
    assert _hit(q, k_cache, v_cache, lens) is None  # without k_new: another key
    k2, v2 = k_cache.clone(), v_cache.clone()
    out = ad.sdpa_with_kvcache(q, k2, v2, lens, k_new=k_new, v_new=v_new)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(k2[b, :, n], k_new[b, :, 0]) and torch.equal(v2[b, :, n], v_new[b, :, 0])
    torch.testing.assert_close(out.double(), _reference(q, k2, v2, lens + 1), atol=1e-5, rtol=1e-5)


def _variants():
    """(name, make(q, k_cache, v_cache, lens) -> (q, k_cache, v_cache, lens, kw)): steps that
    differ from the warm one in one fact."""
    off = lambda t: torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)  # noqa: E731
    new = lambda: {"k_new": torch.randn(2, 2, 1, 16), "v_new": torch.randn(2, 2, 1, 16)}  # noqa: E731
    return [
        ("capacity", lambda q, k, v, n: (q, k[:, :, :16], v[:, :, :16], n, {})),
        ("batch", lambda q, k, v, n: (q[:1], k[:1], v[:1], n[:1], {})),
        ("stride", lambda q, k, v, n: (q, k.transpose(1, 2).contiguous().transpose(1, 2), v, n, {})),
        ("dtype", lambda q, k, v, n: (q.double(), k.double(), v.double(), n, {})),
        ("lens dtype", lambda q, k, v, n: (q, k, v, n.long(), {})),
        ("int lens", lambda q, k, v, n: (q, k, v, 5, {})),
        ("requires_grad", lambda q, k, v, n: (q.clone().requires_grad_(), k, v, n, {})),
        ("misaligned", lambda q, k, v, n: (q, off(k), v, n, {})),
        ("k is v", lambda q, k, v, n: (q, k, k, n, {})),
        ("subclass", lambda q, k, v, n: (torch.nn.Parameter(q, requires_grad=False), k, v, n, {})),
        ("append", lambda q, k, v, n: (q, k, v, n, new())),
        ("causal", lambda q, k, v, n: (q, k, v, n, {"causal": True})),
        ("int causal", lambda q, k, v, n: (q, k, v, n, {"causal": 0})),
        ("scale", lambda q, k, v, n: (q, k, v, n, {"scale": 0.5})),
        ("int scale", lambda q, k, v, n: (q, k, v, n, {"scale": 1})),
        ("window", lambda q, k, v, n: (q, k, v, n, {"window": (4, 0)})),
        ("backend", lambda q, k, v, n: (q, k, v, n, {"backend": "math"})),
        ("validate", lambda q, k, v, n: (q, k, v, n, {"validate": False})),
        ("int validate", lambda q, k, v, n: (q, k, v, n, {"validate": 0})),
    ]


@pytest.mark.parametrize("name,make", _variants(), ids=[n for n, _ in _variants()])
def test_a_step_that_differs_in_one_fact_never_hits_an_entry_of_another_key(name, make):
    q, k_cache, v_cache, lens = _step()
    _warm(q, k_cache, v_cache, lens, scale=1.0)
    assert _hit(q, k_cache, v_cache, lens, scale=1.0) is not None
    q2, k2, v2, lens2, kw = make(*(t.clone() for t in (q, k_cache, v_cache, lens)))
    kw = {"scale": 1.0, **kw}
    entry = _hit(q2, k2, v2, lens2, **kw)
    assert entry is None or entry[5] == _key(q2, k2, v2, lens2, **kw)
    assert entry is None  # each of these changes the key


@pytest.mark.parametrize("scope", ["config", "backends", "deterministic"])
def test_the_dispatch_state_is_checked(scope):
    q, k_cache, v_cache, lens = _step()
    _warm(q, k_cache, v_cache, lens)
    assert _hit(q, k_cache, v_cache, lens) is not None
    if scope == "deterministic":
        torch.use_deterministic_algorithms(True)
        try:
            assert _hit(q, k_cache, v_cache, lens) is None
        finally:
            torch.use_deterministic_algorithms(False)
        return
    contexts = {
        "config": lambda: ad.use_config({"dispatch": {"policy": "priority"}}),
        "backends": lambda: ad.use_backends("math"),
    }
    with contexts[scope]():
        assert _hit(q, k_cache, v_cache, lens) is None
        out = ad.sdpa_with_kvcache(q, k_cache, v_cache, lens)  # the key's path, decided for this state
        if scope == "backends":
            assert ad.last_decision().backend == "math"
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, lens), atol=1e-5, rtol=1e-5)


def test_clearing_the_cache_forgets_the_entries():
    q, k_cache, v_cache, lens = _step()
    _warm(q, k_cache, v_cache, lens)
    kv_calls.clear()
    assert _hit(q, k_cache, v_cache, lens) is None
    _warm(q, k_cache, v_cache, lens)
    ad.clear_cache()
    assert _entries() == ()


def test_a_failing_backend_drops_the_entries_and_the_full_path_runs():
    q, k_cache, v_cache, lens = _step()
    _warm(q, k_cache, v_cache, lens)
    entry = _entries()[0]

    def broken(*a, **kw):
        raise RuntimeError("stale run")

    kv_calls[RECENT] = (None, (entry[:4] + ((entry[4][0], broken) + entry[4][2:],) + entry[5:],))
    out = ad.sdpa_with_kvcache(q, k_cache, v_cache, lens)
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, lens), atol=1e-5, rtol=1e-5)
    assert all(e[4][1] is not broken for e in _entries())


def test_more_signatures_than_the_limit_stay_correct():
    steps = [_step(capacity=c) for c in range(16, 16 + RECENT_LIMIT + 2)]
    for _ in range(3):
        for q, k_cache, v_cache, lens in steps:
            out = ad.sdpa_with_kvcache(q, k_cache, v_cache, lens)
            torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, lens), atol=1e-5, rtol=1e-5)
    assert len(_entries()) == RECENT_LIMIT
    assert len({e[5] for e in _entries()}) == RECENT_LIMIT


def test_an_entry_keeps_no_tensor_alive():
    q, k_cache, v_cache, lens = _step()
    _warm(q, k_cache, v_cache, lens)
    refs = [weakref.ref(t) for t in (q, k_cache, v_cache, lens)]
    del q, k_cache, v_cache, lens
    gc.collect()
    assert _entries() and all(r() is None for r in refs)
