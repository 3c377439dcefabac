"""The numerics guard on sdpa_with_kvcache() (policy/guard_kv.py)."""

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.backends.math import math_attention, math_attention_with_kvcache
from attention_dispatch.policy import guard, guard_kv


class SloppyKV(ad.Backend):
    """A KV-cache backend that ignores the window once a sequence holds more than 64 keys."""

    name = "sloppy_kv"
    capabilities = ad.Capabilities(kv_cache=frozenset({"dense", "paged"}))

    def run(self, query, key, value, **options):
        return math_attention(query, key, value, **options)

    def run_kvcache(self, query, k_cache, v_cache, cache_seqlens, **options):
        if int(cache_seqlens.max()) > 64:
            options = dict(options, window=None)
        return math_attention_with_kvcache(query, k_cache, v_cache, cache_seqlens, **options)


def cache(lengths, sq=2, paged=False):
    b, hkv, hq, d, cap = len(lengths), 2, 4, 16, 128
    q = torch.randn(b, hq, sq, d)
    k_cache, v_cache = torch.randn(b, hkv, cap, d), torch.randn(b, hkv, cap, d)
    k_new, v_new = torch.randn(b, hkv, sq, d), torch.randn(b, hkv, sq, d)
    kw = dict(k_new=k_new, v_new=v_new, window=(8, 0), enable_gqa=True)
    if paged:  # blocks of 16, each sequence its own pages in reverse order
        pages = cap // 16
        k_cache = k_cache.reshape(b, hkv, pages, 16, d).permute(0, 2, 3, 1, 4).reshape(b * pages, 16, hkv, d)
        v_cache = v_cache.reshape(b, hkv, pages, 16, d).permute(0, 2, 3, 1, 4).reshape(b * pages, 16, hkv, d)
        kw["block_table"] = torch.arange(b * pages, dtype=torch.int32).reshape(b, pages).flip(1).contiguous()
    return q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32), kw


def reference(q, k_cache, v_cache, lengths, kw):
    kc, vc = k_cache.clone(), v_cache.clone()
    rest = {n: v for n, v in kw.items() if n != "enable_gqa"}
    return math_attention_with_kvcache(q, kc, vc, lengths, scale=q.shape[-1] ** -0.5, **rest)


def test_first_mode_quarantines_a_wrong_kv_backend():
    ad.register_backend(SloppyKV(), priority="first")
    q, kc, vc, lengths, kw = cache([100, 30])
    ref = reference(q, kc, vc, lengths, kw)
    with ad.use_config({"guard": {"mode": "first", "rows": 16}}), ad.use_backends("sloppy_kv", "math"):
        out = ad.sdpa_with_kvcache(q, kc, vc, lengths, **kw)
        torch.testing.assert_close(out, ref)
        d = ad.last_decision()
        assert d.backend == "math" and any("sloppy_kv quarantined: max error" in n for n in d.notes)
        e = ad.explain_with_kvcache(q, kc, vc, lengths, **kw)
        assert e.rejected["sloppy_kv"][0].startswith("quarantined: max error")


def test_strict_mode_raises_on_a_wrong_kv_backend_and_passes_right_ones():
    ad.register_backend(SloppyKV(), priority="first")
    for paged in (False, True):
        q, kc, vc, lengths, kw = cache([100, 0, 7], paged=paged)
        with ad.use_config({"guard": {"mode": "strict", "rows": 64}}):
            with ad.use_backends("sloppy_kv", "math"), pytest.raises(guard.GuardError, match="'sloppy_kv'"):
                ad.sdpa_with_kvcache(q, kc, vc, lengths, **kw)
            for name in ("math", "torch_cpu"):
                with ad.use_backends(name):
                    try:
                        ad.sdpa_with_kvcache(q, kc, vc, lengths, **kw)
                    except ad.NoBackendError:
                        continue
    assert guard.quarantined() == {}


def test_kv_calls_it_cannot_judge():
    assert guard_kv.judgeable(
        {"k_new": None, "v_new": None, "block_table": None, "causal": None, "window": None, "scale": 1.0}
    )
    assert guard_kv.judgeable({"scale": 1.0, "softcap": 30.0, "alibi_slopes": None, "sinks": None, "return_lse": True})
    assert not guard_kv.judgeable({"scale": 1.0, "a_feature_added_later": 1})


class SoftcapIgnoringKV(SloppyKV):
    """Claims softcap, ALiBi, sinks and lse on its KV path but ignores the softcap."""

    name = "softcap_ignoring_kv"
    capabilities = ad.Capabilities(
        kv_cache=frozenset({"dense", "paged"}), softcap=True, alibi=True, sinks=True, return_lse=True
    )

    def run_kvcache(self, query, k_cache, v_cache, cache_seqlens, **options):
        return math_attention_with_kvcache(query, k_cache, v_cache, cache_seqlens, **dict(options, softcap=None))


def test_kv_features_are_judged():
    """softcap, ALiBi, sinks and the returned lse of a KV call: math passes strict, a backend
    ignoring the softcap is caught (dense and paged)."""
    ad.register_backend(SoftcapIgnoringKV(), priority="first")
    for paged in (False, True):
        q, kc, vc, lengths, kw = cache([100, 0, 7], paged=paged)
        kw = dict(kw, softcap=2.0, alibi_slopes=torch.full((4,), 0.2), sinks=torch.randn(4), return_lse=True)
        q = q * 4
        with ad.use_config({"guard": {"mode": "strict", "rows": 64}}):
            with ad.use_backends("math"):
                ad.sdpa_with_kvcache(q, kc.clone(), vc.clone(), lengths, **kw)
            with ad.use_backends("softcap_ignoring_kv", "math"), pytest.raises(guard.GuardError, match="softcap_ignor"):
                ad.sdpa_with_kvcache(q, kc.clone(), vc.clone(), lengths, **kw)
