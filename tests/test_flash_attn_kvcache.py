"""flash-attn's sdpa_with_kvcache() adapter (attention_dispatch/backends/flash_attn_kvcache.py).

On the CPU the adapter runs against fakes of each generation's function, written here from the
library's documented semantics (computed in float64 from the definition, with the library's own
conventions: (B, S, H, D) layouts, in-place append of k/v at cache_seqlens, causal and window
bottom-right against each sequence's length, window sides past the cache turned unbounded as
flash_api.cpp does, flash-attn 2's block size check).  The fakes record their arguments, so a
wrong mapping gives a wrong number or a wrong recorded argument.  Their signatures are compared
with the real functions' where a library is installed.  On a GPU (marked ``gpu``) every installed
generation is compared with the float64 reference of tests/test_kvcache.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import types

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.backends import flash_attn as fa_module
from attention_dispatch.backends import flash_attn_kvcache as fakv
from attention_dispatch.backends.flash_attn import FA2_CAPS, FA3_CAPS, FA4_CAPS, FlashAttnBackend, caps_union
from attention_dispatch.kvcache import normalize_kvcache
from naive import naive_attention
from oracle import assert_matches
from test_kvcache import KvCase, check_kv_call, kv_reference, make_kv_inputs, reference_append

# ---- fakes of the three generations' KV-cache functions ------------------------------------


def _semantics(version, calls, q, k_cache, v_cache, k, v, lengths, table, softmax_scale, causal, window_size):
    """What flash_attn_with_kvcache (2, 3) / flash_attn_varlen_func with seqused_k (4) compute."""
    calls.append(
        dict(
            version=version,
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            k=k,
            v=v,
            lengths=lengths,
            table=table,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
        )
    )
    assert q.dim() == 4 and q.stride(-1) == 1, "q: (B, Sq, H, D) with a unit last stride"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    assert lengths.dtype == torch.int32 and lengths.is_contiguous(), "seqlens_k must be int32 and contiguous"
    b, sq, hq, d = q.shape
    if table is not None:
        assert table.dtype == torch.int32 and table.stride(-1) == 1, "block table: int32, contiguous last dim"
        _, page, hkv, _ = k_cache.shape
        if version == 2:
            assert page % 256 == 0, "Paged KV cache block size must be divisible by 256"
        seqlen_k = table.shape[1] * page
    else:
        assert k_cache.shape[0] == b
        _, seqlen_k, hkv, _ = k_cache.shape
    if version == 4:
        assert all(w is None or w >= 0 for w in window_size), "flash-attn 4 takes None for unbounded"
        left, right = (-1 if w is None else w for w in window_size)
    else:
        left, right = window_size
    if causal:
        right = 0
    # flash_api.cpp: the query heads of one kv head regrouped as rows (Sq = 1, GQA, no window)
    regrouped = version == 2 and sq == 1 and hq > hkv and left < 0 and right < 0 and d % 8 == 0
    if version == 2:  # flash-attn 2: a window side past the cache's capacity is unbounded
        left, right = (-1 if w >= seqlen_k else w for w in (left, right))
    elif version == 3:
        left = -1 if left >= seqlen_k - 1 else left
        right = -1 if right >= sq - 1 else right
    if k is not None:
        assert version in (2, 3), "flash-attn 4 has no k/v append"
        if (hq // hkv if regrouped else sq) > seqlen_k:
            raise RuntimeError("If key is supplied, it must have seqlen <= the seqlen of the KV cache")
        assert k.shape == (b, sq, hkv, d) and k.stride(-1) == 1 and v.stride(-1) == 1
    total = lengths.tolist()
    out = torch.zeros(b, hq, sq, d, dtype=torch.float64)
    for i in range(b):
        rows = torch.arange(total[i] + (sq if k is not None else 0))
        if table is None:
            where = (torch.full_like(rows, i), rows)
        else:
            page = k_cache.shape[1]
            where = (table[i].long()[rows // page], rows % page)
        if k is not None:  # written in place at cache_seqlens[b] ..., then attended to
            k_cache[where[0][total[i] :], where[1][total[i] :]] = k[i]
            v_cache[where[0][total[i] :], where[1][total[i] :]] = v[i]
        keys = k_cache[where].transpose(0, 1).double()[None]  # (1, Hkv, L_b, D)
        values = v_cache[where].transpose(0, 1).double()[None]
        out[i] = naive_attention(
            q[i].transpose(0, 1).double()[None],
            keys,
            values,
            causal="bottom_right" if causal else None,
            window=None if (left, right) == (-1, -1) else (left, right),
            scale=softmax_scale if softmax_scale is not None else 1 / math.sqrt(d),
        )[0]
    return out.transpose(1, 2).to(q.dtype).contiguous()  # theirs: (B, Sq, H, D), contiguous


def make_fakes(calls: list) -> dict:
    """The three generations' KV-cache functions (keyword-only past the tensors: the adapter must
    name every argument), each with the real function's names and defaults."""

    def fa2_with_kvcache(
        q,
        k_cache,
        v_cache,
        *,
        k=None,
        v=None,
        cache_seqlens=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
    ):
        return _semantics(
            2, calls, q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size
        )

    def fa3_with_kvcache(
        q,
        k_cache,
        v_cache,
        *,
        k=None,
        v=None,
        cache_seqlens=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
    ):
        return _semantics(
            3, calls, q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale, causal, window_size
        )

    def fa4_varlen_func(
        q,
        k,
        v,
        *,
        seqused_k=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
    ):
        out = _semantics(4, calls, q, k, v, None, None, seqused_k, page_table, softmax_scale, causal, window_size)
        return out, None  # (out, lse)

    return {"fa2": fa2_with_kvcache, "fa3": fa3_with_kvcache, "fa4": fa4_varlen_func}


REAL = {  # generation -> (module, function) the fake stands for
    "fa2": ("flash_attn", "flash_attn_with_kvcache"),
    "fa3": ("flash_attn_interface", "flash_attn_with_kvcache"),
    "fa4": ("flash_attn.cute", "flash_attn_varlen_func"),
}


def _unused(*args, **kwargs):
    raise AssertionError("sdpa_with_kvcache must not call flash_attn_func")


def declare_fa4_kv(monkeypatch) -> None:
    """flash-attn 4 with the KV path it declines (FA4_KV_DECLINED) declared as flash-attn 3's:
    the mapping a release that reads nothing past seqused_k would run, tested here."""
    declared = dataclasses.replace(FA4_CAPS, **fakv.FA3_KV, kv_cache_declined="")
    monkeypatch.setattr(fa_module, "FA4_CAPS", declared)


@pytest.fixture
def fa(monkeypatch):
    """fa("fa2", "fa4", ...) installs fake modules of those generations, returns (backend, calls);
    fa4_kv=True: flash-attn 4 with its KV path declared (declare_fa4_kv)."""

    def make(*keys, version4="4.0.0b36", fa4_kv=False):
        if fa4_kv:
            declare_fa4_kv(monkeypatch)
        calls: list = []
        funcs = make_fakes(calls)
        for name in list(sys.modules):
            if name.split(".")[0] in ("flash_attn", "flash_attn_interface", "flash_attn_config"):
                monkeypatch.delitem(sys.modules, name)
        package = types.ModuleType("flash_attn")
        package.__path__ = []
        if "fa2" in keys:
            package.__version__ = "2.8.3"
            package.flash_attn_func = package.flash_attn_varlen_func = _unused
            package.flash_attn_with_kvcache = funcs["fa2"]
        if "fa3" in keys:
            fa3 = types.ModuleType("flash_attn_interface")
            fa3.flash_attn_func = fa3.flash_attn_varlen_func = _unused
            fa3.flash_attn_with_kvcache = funcs["fa3"]
            monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
        if "fa4" in keys:
            cute = types.ModuleType("flash_attn.cute")
            cute.__version__ = version4
            cute.flash_attn_func = _unused
            cute.flash_attn_varlen_func = funcs["fa4"]
            package.cute = cute
            monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        if "fa2" in keys or "fa4" in keys:
            monkeypatch.setitem(sys.modules, "flash_attn", package)
        order = tuple(k for k in ("fa3", "fa4", "fa2") if k in keys)
        return FlashAttnBackend(order), calls

    return make


def run(backend, case: KvCase, args=None, **changes):
    """backend.run_kvcache on fresh inputs of `case` (or `args`), validated and passed as
    sdpa_with_kvcache does; returns (out, args, (k_cache, v_cache, cache_seqlens) before the call)."""
    args = make_kv_inputs(case) if args is None else args
    args.update(changes)
    before = (args["k_cache"].clone(), args["v_cache"].clone(), args["cache_seqlens"].clone())
    call = normalize_kvcache(**args)
    with torch.no_grad():
        out = backend.run_kvcache(call.query, call.k_cache, call.v_cache, call.cache_seqlens, **call.options)
    return out, args, before


def check_against_reference(out, args, before, case: KvCase, what: str):
    """The output against tests/test_kvcache.py's float64 reference, the cache after the append."""
    k0, v0, lengths0 = before
    table = args["block_table"]
    if case.append:
        k_want, v_want = reference_append(k0, v0, lengths0, args["k_new"], args["v_new"], table)
    else:
        k_want, v_want = k0, v0
    assert torch.equal(args["k_cache"], k_want) and torch.equal(args["v_cache"], v_want), f"{what}: the cache"
    assert torch.equal(args["cache_seqlens"], lengths0), f"{what}: cache_seqlens was modified"
    lengths = [n + (case.seqlen_q if case.append else 0) for n in lengths0.tolist()]
    common = dict(block_table=table, causal=case.causal, window=case.window)
    ref64 = kv_reference(args["query"], k_want, v_want, lengths, **common)
    ref_low = kv_reference(args["query"], k_want, v_want, lengths, dtype=case.dtype, **common)
    assert out.shape == args["query"].shape and out.dtype == case.dtype
    assert_matches(out, ref64, ref_low, what, dtype=case.dtype)


def kv_problem(case: KvCase, cc=(9, 0), **changes):
    """The Problem sdpa_with_kvcache() builds for `case`, as on a GPU of compute capability `cc`."""
    p = normalize_kvcache(**make_kv_inputs(case)).problem
    fields = dict(device_type="cuda", compute_capability=cc, dtype=torch.bfloat16)
    fields.update(changes)
    return dataclasses.replace(p, **fields)


# ---- capabilities and reasons --------------------------------------------------------------


def test_each_generation_declares_its_kv_cache_path():
    assert FA2_CAPS.kv_cache == FA3_CAPS.kv_cache == frozenset({"dense", "paged"})
    assert FA2_CAPS.paged_block_sizes() == "multiples of 256"
    assert FA3_CAPS.paged_block_sizes() == "any"
    assert all(c.kv_append and c.kv_multi_query for c in (FA2_CAPS, FA3_CAPS))
    union = caps_union([FA2_CAPS, FA3_CAPS])
    assert union.kv_cache == frozenset({"dense", "paged"}) and union.paged_block_sizes() == "any"
    # flash-attn 4 declines, saying why; beside a generation with a KV path, that path alone
    assert FA4_CAPS.kv_cache == frozenset() and FA4_CAPS.kv_cache_declined == fakv.FA4_KV_DECLINED
    with_fa2 = caps_union([FA2_CAPS, FA4_CAPS])
    assert with_fa2.paged_block_sizes() == "multiples of 256" and not with_fa2.kv_cache_declined
    assert caps_union([FA2_CAPS]).paged_block_sizes() == "multiples of 256"
    no_kv = dataclasses.replace(FA2_CAPS, kv_cache=frozenset())
    assert caps_union([no_kv, no_kv]).kv_cache == frozenset()
    assert caps_union([no_kv, FA3_CAPS]).paged_block_sizes() == "any"


def test_capabilities_follow_what_the_installed_functions_take():
    def dense_only(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None):
        pass

    def no_lengths(q, k, v, page_table=None):
        pass

    assert fakv.kv_capabilities("fa2", None, FA2_CAPS).kv_cache == frozenset()
    assert fakv.kv_capabilities("fa2", dense_only, FA2_CAPS).kv_cache == frozenset({"dense"})
    assert fakv.kv_capabilities("fa4", no_lengths, FA4_CAPS).kv_cache == frozenset()
    funcs = make_fakes([])
    for key, caps in (("fa2", FA2_CAPS), ("fa3", FA3_CAPS), ("fa4", FA4_CAPS)):
        assert fakv.kv_capabilities(key, funcs[key], caps) == caps
    flags = {"FLASHATTENTION_DISABLE_PAGEDKV": True, "FLASHATTENTION_DISABLE_APPENDKV": True}
    built = fakv.kv_capabilities("fa3", funcs["fa3"], FA3_CAPS, flags)
    assert built.kv_cache == frozenset({"dense"}) and not built.kv_append
    no_varlen = fakv.kv_capabilities("fa3", funcs["fa3"], FA3_CAPS, {"FLASHATTENTION_DISABLE_VARLEN": True})
    assert no_varlen.kv_cache == frozenset()


def test_generations_are_detected_with_their_kv_function(fa):
    backend, _ = fa("fa2", "fa3", "fa4")
    impls = {i.key: i for i in backend.implementations()}
    assert set(impls) == {"fa2", "fa3", "fa4"}
    assert impls["fa2"].kv_func.__name__ == "fa2_with_kvcache"
    assert impls["fa3"].kv_func.__name__ == "fa3_with_kvcache"
    assert impls["fa4"].kv_func.__name__ == "fa4_varlen_func"
    assert backend.capabilities.kv_cache == frozenset({"dense", "paged"})


def test_flash_attn_4_declines_kv_calls_naming_why(fa):
    """Rows past the lengths are not part of a call; flash-attn 4 reads some (module doc): every
    KV call is refused with that reason, dense or paged; flash-attn 2 beside it takes them."""
    alone, calls = fa("fa4")
    assert alone.capabilities.kv_cache == frozenset()
    for case in (KvCase(head_dim=64), KvCase(block_size=16, head_dim=64, append=True)):
        reasons = alone.reasons(kv_problem(case, cc=(10, 0)))
        assert any("reads key/value rows past seqused_k" in r for r in reasons), reasons
        with pytest.raises(RuntimeError, match="rows past seqused_k"):
            run(alone, case)
    assert not calls
    both, _ = fa("fa2", "fa4")
    assert both.select(kv_problem(KvCase(head_dim=64))).impl.key == "fa2"


def test_flash_attn_2_paged_block_sizes_are_named_in_the_reasons(fa):
    backend, _ = fa("fa2")
    paged16 = kv_problem(KvCase(block_size=16))
    assert "paged block_size=16 not supported (allowed: multiples of 256)" in backend.reasons(paged16)
    assert backend.reasons(kv_problem(KvCase(block_size=256, capacity=512))) == []
    assert backend.reasons(kv_problem(KvCase(append=True, seqlen_q=3, causal=True))) == []
    # flash-attn 2 and 4 on sm80: flash-attn 4 needs sm90, flash-attn 2 a block of 256
    both, _ = fa("fa2", "fa4", fa4_kv=True)
    reasons = both.reasons(kv_problem(KvCase(block_size=16, head_dim=64), cc=(8, 0)))
    assert "flash-attn 4: compute capability sm80 < sm90" in reasons
    assert "flash-attn 2: paged block_size=16 not supported (allowed: multiples of 256)" in reasons
    assert both.choose(kv_problem(KvCase(block_size=16, head_dim=64)))[0].key == "fa4"  # sm90: flash-attn 4
    assert both.choose(kv_problem(KvCase(block_size=256, capacity=512, head_dim=64), cc=(8, 0)))[0].key == "fa2"


def test_kv_reasons_of_each_generation(fa):
    backend, _ = fa("fa2", "fa3", "fa4", fa4_kv=True)
    r = backend.reasons
    assert "dtype=float32 not in {bfloat16, float16}" in r(kv_problem(KvCase(), dtype=torch.float32))
    assert "compute capability sm75 < sm80" in r(kv_problem(KvCase(), cc=(7, 5)))
    choice = backend.select(kv_problem(KvCase(head_dim=80), cc=(10, 0)))  # 3: sm90 only, 4: head dims
    assert choice.impl.key == "fa2" and "flash-attn 4: head_dim=80 not in {64, 96, 128}" in choice.refusals
    strided = r(kv_problem(KvCase(), cc=(8, 0), last_dim_contiguous=False))
    assert any("flash-attn 2: a query/cache/k_new/v_new whose last dimension is not contiguous" in x for x in strided)
    assert any(
        "flash-attn 2: a tensor not 16-byte aligned" in x for x in r(kv_problem(KvCase(), cc=(8, 0), aligned_16=False))
    )
    # flash-attn 4 copies what is not aligned (reads only): aligned_16 is no reason for it
    assert backend.choose(kv_problem(KvCase(head_dim=64), cc=(10, 0), aligned_16=False))[0].key == "fa4"


def test_flash_attn_2_window_past_the_cache_is_refused_where_it_would_be_unbounded(fa):
    """flash-attn 2 takes a window side >= the cache's capacity as unbounded, or as the capacity beside a
    bounded side (window_clamp): exact only where no row needed more."""
    backend, _ = fa("fa2")
    case = KvCase(seqlen_q=8, capacity=4, window=(1, 5), lengths=(4, 2, 0))
    assert any(
        "window=(1, 5) with Sq=8, Sk=4: flash-attn 2/3 takes its right side as Sk=4" in x
        for x in backend.reasons(kv_problem(case))
    )
    assert backend.reasons(kv_problem(dataclasses.replace(case, window=(9, 7)))) == []  # right >= Sq - 1: exact
    assert backend.reasons(kv_problem(dataclasses.replace(case, window=(9, 3)))) == []  # right < capacity
    # an accepted one: flash_api.cpp's unbounded sides (the fake's) give the definition's result
    exact = dataclasses.replace(case, window=(9, 7))
    out, args, before = run(backend, exact)
    check_against_reference(out, args, before, exact, "fa2 window past the cache")


def test_flash_attn_2_append_with_regrouped_heads_past_a_tiny_cache_is_refused(fa):
    """Sq = 1, GQA, no window: flash-attn 2 checks Hq / Hkv regrouped rows against the cache length."""
    backend, _ = fa("fa2")
    case = KvCase(heads_q=8, heads_kv=1, capacity=4, append=True, lengths=(3, 0, 1))
    assert any(
        "k_new with Sq=1 and 8 query heads per kv head > the cache's capacity 4" in x
        for x in backend.reasons(kv_problem(case))
    )
    assert backend.reasons(kv_problem(dataclasses.replace(case, capacity=8, lengths=(7, 0, 1)))) == []
    with pytest.raises(RuntimeError, match="flash-attn 2: k_new with Sq=1"):
        run(backend, case)


def test_flash_attn_4_paged_on_sm90_needs_4_0_0b5(fa):
    case = KvCase(block_size=16, head_dim=64)
    old, _ = fa("fa4", version4="4.0.0b4", fa4_kv=True)
    assert any(
        "paged KV cache on sm90 needs flash-attn 4 >= 4.0.0b5 (this is 4.0.0b4)" in x
        for x in old.reasons(kv_problem(case))
    )
    assert old.reasons(kv_problem(case, cc=(10, 0))) == []  # sm100 had it from the start
    assert old.reasons(kv_problem(dataclasses.replace(case, block_size=None))) == []  # dense: fine
    new, _ = fa("fa4", version4="4.0.0b36", fa4_kv=True)
    assert new.reasons(kv_problem(case)) == []
    assert fakv._release("4.0.0b36") == (4, 0, 0, 36) and fakv._release("4.0.0") == (4, 0, 0, math.inf)
    assert fakv._release("0.0.0") is None and fakv._release("") is None


def test_flash_attn_4_release_from_the_distribution_when_the_module_says_0_0_0(monkeypatch):
    """4.0.0b36's flash_attn.cute.__version__ asks importlib.metadata for "fa4", which the wheel
    "flash-attn-4" does not install: the module says "0.0.0"; the distribution knows."""
    from importlib import metadata

    def version(name):
        if name == "flash-attn-4":
            return "4.0.0b36"
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)
    fakv.fa4_release.cache_clear()
    try:
        assert fakv.fa4_release("0.0.0") == (4, 0, 0, 36)
        assert fakv.fa4_release("4.0.0b4") == (4, 0, 0, 4)
        assert fakv.kv_reasons("fa4", "0.0.0", kv_problem(KvCase(block_size=16, head_dim=64))) == []
        monkeypatch.setattr(metadata, "version", lambda name: (_ for _ in ()).throw(metadata.PackageNotFoundError()))
        fakv.fa4_release.cache_clear()
        assert fakv.fa4_release("0.0.0") is None
        assert any("(this is 0.0.0)" in r for r in fakv.kv_reasons("fa4", "0.0.0", kv_problem(KvCase(block_size=16))))
    finally:
        fakv.fa4_release.cache_clear()


# ---- the mapping, against the fakes --------------------------------------------------------

CASES = {
    "dense decode GQA": KvCase(),
    "dense decode MHA append": KvCase(heads_kv=4, append=True),
    "dense append Sq=3 causal GQA": KvCase(heads_q=8, heads_kv=2, seqlen_q=3, append=True, causal=True),
    "dense Sq=4 causal, no append, short caches": KvCase(seqlen_q=4, causal=True, lengths=(64, 2, 0)),
    "dense window": KvCase(seqlen_q=2, window=(3, 1), append=True),
    "dense window left + causal": KvCase(seqlen_q=3, window=(5, -1), causal=True),
    "dense window right only": KvCase(seqlen_q=3, window=(-1, 0), lengths=(10, 1, 0)),
    "empty caches": KvCase(lengths=(0, 0, 0)),
    "full caches": KvCase(seqlen_q=2, append=True, causal=True, lengths=(62, 62, 62)),
    "paged GQA append": KvCase(block_size=16, append=True),
    "paged causal Sq=2 append": KvCase(block_size=32, seqlen_q=2, causal=True, append=True),
    "paged window": KvCase(block_size=16, seqlen_q=2, window=(7, 0), lengths=(64, 0, 40)),
    "bfloat16 dense append causal": KvCase(dtype=torch.bfloat16, seqlen_q=2, append=True, causal=True),
}


def _fits(key: str, case: KvCase) -> KvCase:
    """flash-attn 2's pages are multiples of 256: its paged cases get 256-key blocks; flash-attn 4
    compiles head dims 64, 96 and 128 (FA4_HEAD_DIMS): its cases get 64."""
    if key == "fa2" and case.block_size is not None:
        return dataclasses.replace(case, block_size=256, capacity=512)
    if key == "fa4":
        return dataclasses.replace(case, head_dim=64)
    return case


@pytest.mark.parametrize("key", ["fa2", "fa3", "fa4"])
@pytest.mark.parametrize("label", list(CASES))
def test_each_generation_matches_the_reference(fa, key, label):
    backend, calls = fa(key, fa4_kv=True)
    case = _fits(key, CASES[label])
    out, args, before = run(backend, case)
    check_against_reference(out, args, before, case, f"{key} {label}")
    assert len(calls) == 1, "one call of the generation's function"


@pytest.mark.parametrize("key", ["fa2", "fa3", "fa4"])
@pytest.mark.parametrize("paged", [False, True])
def test_arguments_and_layouts_passed(fa, key, paged):
    """Views, never copies (the append lands in the caller's cache), the keywords of each
    generation, our output layout back."""
    backend, calls = fa(key, fa4_kv=True)
    case = _fits(key, KvCase(seqlen_q=3, append=True, causal=True, window=(6, -1), block_size=16 if paged else None))
    d = case.head_dim
    out, args, before = run(backend, case, scale=0.3)
    call = calls[-1]
    q, kc, vc = args["query"], args["k_cache"], args["v_cache"]
    assert call["q"].data_ptr() == q.data_ptr() and call["q"].shape == (3, 3, 4, d)
    assert call["q"].stride() == q.transpose(1, 2).stride()
    if paged:
        assert call["k_cache"] is kc and call["v_cache"] is vc
        assert call["table"] is args["block_table"]
    else:
        assert call["k_cache"].data_ptr() == kc.data_ptr() and call["k_cache"].shape == (3, 64, 2, d)
        assert call["k_cache"].stride() == kc.transpose(1, 2).stride() and call["table"] is None
    assert call["softmax_scale"] == 0.3 and call["causal"] is True
    if key == "fa4":  # our append, then per-sequence lengths including the new keys
        assert call["k"] is None and call["window_size"] == (6, 0)
        assert call["lengths"].dtype == torch.int32
        assert call["lengths"].tolist() == [n + 3 for n in before[2].tolist()]
    else:
        assert call["k"].data_ptr() == args["k_new"].data_ptr() and call["k"].shape == (3, 3, 2, d)
        assert call["v"].data_ptr() == args["v_new"].data_ptr()
        assert call["lengths"] is args["cache_seqlens"] and call["window_size"] == (6, 0)
    assert out.shape == (3, 4, 3, d) and out.transpose(1, 2).is_contiguous()  # theirs, transposed back


@pytest.mark.parametrize("key", ["fa2", "fa4"])
def test_window_conventions(fa, key):
    """-1 unbounded for flash-attn 2/3, None for 4; no window: (-1, -1) / (None, None)."""
    backend, calls = fa(key, fa4_kv=True)
    run(backend, _fits(key, KvCase(seqlen_q=2, window=(-1, 3))))
    run(backend, _fits(key, KvCase(seqlen_q=2, causal=True)))
    unbounded = -1 if key == "fa2" else None
    assert calls[0]["window_size"] == (unbounded, 3) and calls[0]["causal"] is False
    assert calls[1]["window_size"] == (unbounded, unbounded) and calls[1]["causal"] is True


def test_a_strided_cache_seqlens_is_made_contiguous(fa):
    backend, calls = fa("fa2")
    case = KvCase(append=True)
    args = make_kv_inputs(case)
    wide = torch.zeros(3, 2, dtype=torch.int32)
    wide[:, 0] = args["cache_seqlens"]
    out, args, before = run(backend, case, args, cache_seqlens=wide[:, 0])
    assert calls[-1]["lengths"].is_contiguous() and not args["cache_seqlens"].is_contiguous()
    check_against_reference(out, args, before, case, "strided cache_seqlens")


@pytest.mark.parametrize("key", ["fa2", "fa4"])
def test_empty_calls_give_zeros_without_a_call(fa, key):
    backend, calls = fa(key, fa4_kv=True)
    d = _fits(key, KvCase()).head_dim
    out, _, _ = run(backend, _fits(key, KvCase(batch=0, lengths=())))
    assert out.shape == (0, 4, 1, d)
    out, args, before = run(backend, _fits(key, KvCase(seqlen_q=0, lengths=(3, 0, 5), append=True)))
    assert out.shape == (3, 4, 0, d) and torch.equal(args["k_cache"], before[0])
    out, _, _ = run(backend, _fits(key, KvCase(capacity=0, lengths=(0, 0, 0))))
    assert out.shape == (3, 4, 1, d) and not out.any()
    assert not calls


def test_a_refused_call_raises_with_every_reason(fa):
    backend, _ = fa("fa2")
    with pytest.raises(RuntimeError, match="multiples of 256"):
        run(backend, KvCase(block_size=16))


# ---- the fakes against the real functions --------------------------------------------------


def _real(key: str):
    module, name = REAL[key]
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except Exception as exc:  # not installed, or broken on this machine
        pytest.skip(f"{module}.{name} not importable: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("key", ["fa2", "fa3", "fa4"])
def test_fake_signature_matches_the_real_one(key):
    """Every argument the fake (and so the adapter) takes exists in the real function, by the
    same name, as a keyword, with the same default; the tensors come first in the same order."""
    real = inspect.signature(_real(key)).parameters
    fake = inspect.signature(make_fakes([])[key]).parameters
    positional = [n for n, p in fake.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert list(real)[: len(positional)] == positional
    for name, param in fake.items():
        assert name in real, f"{REAL[key][1]} has no argument {name!r}"
        assert real[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        if param.default is not inspect.Parameter.empty:
            assert real[name].default == param.default, f"{name}: default {real[name].default!r}"
    assert fakv.KV_FUNCTION[key] == REAL[key][1]


# ---- on the GPU: every installed generation against the reference ---------------------------

GPU_CASES = {
    "dense decode GQA": KvCase(dtype=torch.bfloat16, heads_q=8, heads_kv=2, capacity=1024, head_dim=128),
    "dense decode MHA append": KvCase(dtype=torch.float16, heads_kv=4, capacity=1024, head_dim=64, append=True),
    "dense chunk Sq=37 causal append GQA": KvCase(
        dtype=torch.bfloat16, heads_q=8, heads_kv=2, seqlen_q=37, capacity=1024, head_dim=128, append=True, causal=True
    ),
    "dense Sq=5 causal, no append, short caches": KvCase(
        dtype=torch.bfloat16, seqlen_q=5, capacity=512, head_dim=64, causal=True, lengths=(512, 3, 0)
    ),
    "dense window": KvCase(dtype=torch.bfloat16, seqlen_q=4, capacity=1024, head_dim=128, window=(100, 0), append=True),
    "paged GQA append": KvCase(
        dtype=torch.bfloat16, heads_q=8, heads_kv=2, capacity=1024, head_dim=128, block_size=16, append=True
    ),
    "paged causal Sq=9 append": KvCase(
        dtype=torch.bfloat16,
        heads_q=8,
        heads_kv=2,
        seqlen_q=9,
        capacity=1024,
        head_dim=128,
        block_size=256,
        append=True,
        causal=True,
    ),
    "paged MHA block 128": KvCase(dtype=torch.float16, heads_kv=4, capacity=1024, head_dim=64, block_size=128),
    "paged window": KvCase(
        dtype=torch.bfloat16, seqlen_q=3, capacity=1024, head_dim=128, block_size=64, window=(50, 0)
    ),
}


def _generation(key: str, monkeypatch=None):
    """The installed generation `key`; a KV path it declines skips the test, unless
    `monkeypatch` is given: then flash-attn 4's is declared (declare_fa4_kv) to record it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if monkeypatch is not None and key == "fa4":
        declare_fa4_kv(monkeypatch)
    backend = FlashAttnBackend((key,))
    if not backend.implementations():
        pytest.skip(f"{fakv.KV_FUNCTION[key]} of {key}: {backend.unavailable_reason()}")
    caps = backend.implementations()[0].caps
    if not caps.kv_cache:
        pytest.skip(f"{key} declines KV-cache calls: {caps.kv_cache_declined}")
    return backend


def _run_gpu(backend, case: KvCase):
    args = make_kv_inputs(case, "cuda")
    before = (args["k_cache"].cpu(), args["v_cache"].cpu(), args["cache_seqlens"].cpu())
    call = normalize_kvcache(**args)
    problem = call.problem
    reasons = backend.reasons(problem)
    if reasons:
        return None, reasons
    with torch.no_grad():
        out = backend.run_kvcache(call.query, call.k_cache, call.v_cache, call.cache_seqlens, **call.options)
    torch.cuda.synchronize()
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return (out.cpu(), cpu, before), []


@pytest.mark.gpu
@pytest.mark.parametrize("key", ["fa2", "fa3", "fa4"])
@pytest.mark.parametrize("label", list(GPU_CASES))
def test_gpu_generation_matches_the_reference(key, label):
    backend = _generation(key)
    case = GPU_CASES[label]
    impl = backend.implementations()[0]
    if case.block_size is not None and not impl.caps.paged_block_size_ok(case.block_size):
        case = dataclasses.replace(case, block_size=256)
    result, reasons = _run_gpu(backend, case)
    if result is None:  # only the architecture may refuse a case: everything else is claimed
        assert all("compute capability" in r for r in reasons), reasons
        pytest.skip("; ".join(reasons))
    out, args, before = result
    check_against_reference(out, args, before, case, f"{impl.label} {impl.version} {label}")


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["dense decode GQA", "dense chunk Sq=37 causal append GQA", "paged GQA append"])
def test_gpu_dispatched_flash_attn_matches_the_reference(label):
    """Through ad.sdpa_with_kvcache(backend="flash_attn"): what the dispatcher runs."""
    if not ad.get_backend("flash_attn").is_available():
        pytest.skip(ad.get_backend("flash_attn").unavailable_reason())
    case = GPU_CASES[label]
    caps = ad.get_backend("flash_attn").capabilities
    if not caps.kv_cache:  # flash-attn 4 alone: it declines KV calls (Capabilities.kv_cache_declined)
        pytest.skip(f"flash_attn declares no KV cache: {caps.kv_cache_declined}")
    if case.block_size is not None and not caps.paged_block_size_ok(case.block_size):
        case = dataclasses.replace(case, block_size=256)
    check_kv_call("flash_attn", case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("key", ["fa2", "fa3", "fa4"])
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_cuda_graph_capture_and_replay(key, paged):
    """Captured once; between replays the inputs, cache_seqlens and block_table change in place."""
    backend = _generation(key)
    block = 256 if key == "fa2" else 16
    case = KvCase(
        dtype=torch.bfloat16,
        heads_q=8,
        heads_kv=2,
        seqlen_q=2,
        capacity=512,
        head_dim=128,
        block_size=block if paged else None,
        append=True,
        causal=True,
        lengths=(0, 100, 510),
    )
    args = make_kv_inputs(case, "cuda")
    call = normalize_kvcache(**args, validate=False)
    reasons = backend.reasons(call.problem)
    if reasons:
        assert all("compute capability" in r for r in reasons), reasons
        pytest.skip("; ".join(reasons))

    def step():
        return backend.run_kvcache(call.query, call.k_cache, call.v_cache, call.cache_seqlens, **call.options)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):  # compile outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = step()
    for n, lengths in enumerate(((5, 0, 510), (200, 17, 3), (510, 510, 0))):
        for name in ("query", "k_new", "v_new", "k_cache", "v_cache"):
            args[name].copy_(torch.randn_like(args[name]))
        args["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        if paged:
            per_seq = case.capacity // case.block_size
            perm = torch.randperm(args["k_cache"].shape[0])[: case.batch * per_seq]
            args["block_table"].copy_(perm.reshape(case.batch, per_seq).to(torch.int32))
        before = (args["k_cache"].cpu(), args["v_cache"].cpu(), torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        check_against_reference(out.cpu(), cpu, before, case, f"{key} replay {n}")


@pytest.mark.gpu
@pytest.mark.parametrize("key", ["fa2", "fa3", "fa4"])
@pytest.mark.parametrize("block_size", [None, 128, 176])
def test_gpu_rows_past_the_lengths_holding_nan(monkeypatch, key, block_size):
    """Rows past L_b are not part of the call; a cache allocated with torch.empty may hold NaN
    there.  flash-attn 4 documents (interface.py:4277) that pages loaded by TMA read them, and
    declines KV calls for it (FA4_KV_DECLINED): this records what each generation does, flash-attn
    4 with its KV path declared (xfail where NaN comes out)."""
    backend = _generation(key, monkeypatch)
    if block_size is not None and not backend.implementations()[0].caps.paged_block_size_ok(block_size):
        block_size = 256
    case = KvCase(
        dtype=torch.bfloat16,
        heads_q=8,
        heads_kv=2,
        capacity=1024 if block_size != 176 else 1056,
        head_dim=128,
        block_size=block_size,
        lengths=(1000, 5, 130),
    )
    args = make_kv_inputs(case, "cuda")
    lengths = args["cache_seqlens"].tolist()
    for b, n in enumerate(lengths):  # NaN in every row past the length
        for cache in (args["k_cache"], args["v_cache"]):
            if block_size is None:
                cache[b, :, n:] = float("nan")
            else:
                for j in range(n, -(-n // block_size) * block_size):
                    cache[args["block_table"][b, j // block_size], j % block_size] = float("nan")
    call = normalize_kvcache(**args)
    if backend.reasons(call.problem):
        pytest.skip("; ".join(backend.reasons(call.problem)))
    with torch.no_grad():
        out = backend.run_kvcache(call.query, call.k_cache, call.v_cache, call.cache_seqlens, **call.options)
    if torch.isnan(out).any():
        pytest.xfail(f"{key}: NaN rows past cache_seqlens reach the output (block_size={block_size})")
    table = None if args["block_table"] is None else args["block_table"].cpu()
    q, k, v = args["query"].cpu(), args["k_cache"].cpu(), args["v_cache"].cpu()
    ref64 = kv_reference(q, k, v, lengths, block_table=table)
    ref_low = kv_reference(q, k, v, lengths, block_table=table, dtype=torch.bfloat16)
    assert_matches(out.cpu(), ref64, ref_low, f"{key} NaN past the lengths", dtype=torch.bfloat16)
