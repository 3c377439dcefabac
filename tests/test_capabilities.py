"""Capability honesty: every claim a backend declares is exercised against the float64
oracle, so a claim without a test cannot exist. Cases are generated from each backend's
Capabilities; a single-feature claim must also be accepted by the backend's checks.  The
KV-cache claims (kv_cache, paged block sizes, kv_append, kv_multi_query, and causal, window,
GQA and dtypes through sdpa_with_kvcache) are checked against tests/test_kvcache.py's reference."""

import dataclasses

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import CausalKind
from attention_dispatch.api import normalize_call
from attention_dispatch.backends.math import math_attention, math_attention_with_kvcache
from cases import Case, make_inputs
from oracle import KEEP_MASKS, compare_backend
from test_kvcache import KvCase, check_kv_call, make_kv_inputs


def claimed_cases(caps: ad.Capabilities, big: bool = False):
    """(label, case, single_feature) for what `caps` claims. Small shapes on the CPU."""
    order = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    dtypes = [d for d in order if d in caps.dtypes]
    base_dtype = dtypes[0]
    s = 256 if big else 24
    hd_default = 64 if big else 32
    # Kernels on a GPU want 16-byte rows; the CPU interpreter takes any head dim.
    multiple = max(caps.head_dim_multiple, 8 if big else 1)

    def dim(d):
        return max(caps.head_dim_min, -(-d // multiple) * multiple)

    hd = dim(hd_default)
    base = Case(dtype=base_dtype, head_dim=hd, seqlen_q=s, seqlen_k=s, batch=2, heads_q=4, heads_kv=4)
    out = [(f"dtype={str(d)[6:]}", dataclasses.replace(base, dtype=d), True) for d in dtypes]
    # A head-dim range is refined by the backend's check() (e.g. flash-attn 4's {64, 96, 128},
    # cuDNN's version-dependent limit): those are not single-feature claims.
    dims = {dim(max(caps.head_dim_min, 1)), dim(max(caps.head_dim_min, 16)), dim(40), caps.head_dim_max or dim(160)}
    out += [
        (f"head_dim={d}", dataclasses.replace(base, head_dim=d), False)
        for d in sorted(dims)
        if (caps.head_dim_max is None or d <= caps.head_dim_max)
    ]
    if caps.different_head_dims:
        out.append(("Dqk!=Dv", dataclasses.replace(base, head_dim_v=dim(hd // 2)), True))
    for kind in sorted(caps.causal_kinds):
        for sq, sk in ((s - 7, s + 5), (s + 5, s - 7)):
            out.append(
                (
                    f"causal={kind} Sq={sq} Sk={sk}",
                    dataclasses.replace(base, causal=str(kind), seqlen_q=sq, seqlen_k=sk),
                    True,
                )
            )
    if caps.window:
        out.append(("window", dataclasses.replace(base, window=(5, 3), seqlen_k=s + 9), True))
        out.append(("window left only", dataclasses.replace(base, window=(6, -1)), True))
        for kind in sorted(caps.causal_kinds):
            out.append(
                (
                    f"window+causal={kind}",
                    dataclasses.replace(base, window=(4, -1), causal=str(kind), seqlen_k=s + 3),
                    False,
                )
            )
    if caps.bool_mask:
        out.append(("bool mask", dataclasses.replace(base, mask="bool"), True))
        out.append(("bool mask keys", dataclasses.replace(base, mask="bool", mask_shape="keys"), True))
    if caps.float_bias:
        out.append(("float bias", dataclasses.replace(base, mask="float", mask_shape="heads"), True))
        if caps.bias_grad:
            out.append(("bias grad", dataclasses.replace(base, mask="float_grad", mask_shape="heads"), True))
            out.append(("bias grad 2-D", dataclasses.replace(base, mask="float_grad", mask_shape="square"), True))
    half = [d for d in dtypes if d in (torch.bfloat16, torch.float16)]
    if caps.float_bias and caps.float32_bias and half:
        wide = dataclasses.replace(base, dtype=half[0], mask="float", mask_shape="heads", mask_dtype=torch.float32)
        out.append((f"float32 bias, {str(half[0])[6:]} inputs", wide, True))
        if caps.bias_grad:
            out.append(
                (f"float32 bias grad, {str(half[0])[6:]} inputs", dataclasses.replace(wide, mask="float_grad"), True)
            )
    if caps.mask_with_causal and (caps.bool_mask or caps.float_bias) and caps.causal_kinds:
        kind = sorted(caps.causal_kinds)[0]
        out.append(
            (
                "mask+causal",
                dataclasses.replace(base, mask="bool" if caps.bool_mask else "float", causal=str(kind)),
                True,
            )
        )
    if caps.gqa:
        out.append(("gqa", dataclasses.replace(base, heads_q=8, heads_kv=2), True))
    if caps.varlen:
        lengths = (s // 3, s, 1, s // 2)
        out.append(("varlen", dataclasses.replace(base, varlen=lengths), True))
        for kind in sorted(caps.causal_kinds):
            out.append(
                (
                    f"varlen causal={kind}",
                    dataclasses.replace(base, varlen=lengths, extra_k=(3, 0, 5, 1), causal=str(kind)),
                    False,
                )
            )
    if caps.dropout:
        out.append(("dropout", dataclasses.replace(base, dropout_p=0.25), True))
    out += _feature_claims(caps, base, s)
    return out


def _feature_claims(caps: ad.Capabilities, base: Case, s: int):
    """Issue 36's features: each alone (single), then with the band, GQA and varlen where claimed."""
    out = []
    kind = str(sorted(caps.causal_kinds)[0]) if caps.causal_kinds else None
    features = {}
    if caps.softcap:
        features["softcap"] = dict(softcap=3.0)
    if caps.alibi:
        features["alibi"] = dict(alibi="heads")
        out.append(("alibi (B, Hq)", dataclasses.replace(base, alibi="batch"), True))
    if caps.sinks:
        features["sinks"] = dict(sinks="grad" if caps.sinks_grad else "fixed")
    if caps.return_lse:
        features["return_lse"] = dict(return_lse=True)
    for name, fields in features.items():
        # a forward-only claim (sinks without their gradient, an lse that is not differentiable)
        # is still exercised: check_claim falls back to the inference call
        out.append((name, dataclasses.replace(base, **fields), True))
        if kind is not None:
            out.append(
                (f"{name}+causal={kind}", dataclasses.replace(base, causal=kind, seqlen_k=s + 5, **fields), False)
            )
        if caps.window:
            out.append((f"{name}+window", dataclasses.replace(base, window=(5, 3), seqlen_k=s + 9, **fields), False))
        if caps.gqa:
            out.append((f"{name}+gqa", dataclasses.replace(base, heads_q=8, heads_kv=2, **fields), False))
        if caps.varlen:
            lengths, extra = (s // 3, s, 1, s // 2), (3, 0, 5, 1)
            out.append((f"{name}+varlen", dataclasses.replace(base, varlen=lengths, extra_k=extra, **fields), False))
        if caps.dropout:
            out.append((f"{name}+dropout", dataclasses.replace(base, dropout_p=0.25, **fields), False))
        if caps.float_bias and caps.bias_grad:
            grad_bias = dict(mask="float_grad", mask_shape="heads")
            out.append((f"{name}+bias grad", dataclasses.replace(base, **grad_bias, **fields), False))
    if len(features) > 1:
        every = {k: v for fields in features.values() for k, v in fields.items()}
        out.append(("+".join(features), dataclasses.replace(base, **every), False))
        if kind is not None:
            out.append((f"{'+'.join(features)}+causal={kind}", dataclasses.replace(base, causal=kind, **every), False))
    return out


def kv_claimed_cases(caps: ad.Capabilities, big: bool = False):
    """(label, KvCase) for each KV-cache feature `caps` declares (each a single feature: the
    backend must accept it). Small shapes on the CPU."""
    if not caps.kv_cache:
        return []
    order = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    dtypes = [d for d in order if d in caps.dtypes]
    capacity = 1024 if big else 64
    head_dim = max(caps.head_dim_min, 64 if big else 16)
    head_dim = -(-head_dim // caps.head_dim_multiple) * caps.head_dim_multiple
    sizes = [n for n in range(1, capacity + 1) if capacity % n == 0 and caps.paged_block_size_ok(n)]
    sizes = sizes[:1] + [n for n in sizes if sizes and n >= 4 * sizes[0]][:1]  # the smallest and a larger one
    paged_only = "dense" not in caps.kv_cache
    base = KvCase(
        dtype=dtypes[0],
        heads_kv=4,
        capacity=capacity,
        head_dim=head_dim,
        block_size=sizes[0] if paged_only and sizes else None,
    )
    out = [(f"kv dtype={str(d)[6:]}", dataclasses.replace(base, dtype=d)) for d in dtypes]
    if "dense" in caps.kv_cache:
        out.append(("kv dense cache", dataclasses.replace(base, block_size=None)))
    if "paged" in caps.kv_cache:
        out += [(f"kv paged block_size={n}", dataclasses.replace(base, block_size=n)) for n in sizes]
    if caps.kv_append:
        out.append(("kv append", dataclasses.replace(base, append=True)))
    if caps.kv_multi_query:
        out.append(("kv Sq>1", dataclasses.replace(base, seqlen_q=3)))
    sq = 3 if caps.kv_multi_query else 1
    if CausalKind.BOTTOM_RIGHT in caps.causal_kinds:
        out.append((f"kv causal Sq={sq}", dataclasses.replace(base, seqlen_q=sq, causal=True)))
    if caps.window:
        out.append(("kv window", dataclasses.replace(base, seqlen_q=sq, window=(5, 1))))
    if caps.gqa:
        out.append(("kv gqa", dataclasses.replace(base, heads_q=8, heads_kv=2)))
    features = {}
    if caps.softcap:
        features["softcap"] = dict(softcap=3.0)
    if caps.alibi:
        features["alibi"] = dict(alibi=True)
    if caps.sinks:
        features["sinks"] = dict(sinks=True)
    if caps.return_lse:
        features["return_lse"] = dict(return_lse=True)
    for name, fields in features.items():
        out.append((f"kv {name}", dataclasses.replace(base, seqlen_q=sq, causal=sq > 1, **fields)))
    if features:  # every one together, with GQA, the append and a window where declared
        every = {k: v for fields in features.values() for k, v in fields.items()}
        out.append(
            (
                "kv " + "+".join(features),
                dataclasses.replace(
                    base,
                    seqlen_q=sq,
                    heads_q=8 if caps.gqa else base.heads_q,
                    heads_kv=2 if caps.gqa else base.heads_kv,
                    append=caps.kv_append,
                    window=(6, 0) if caps.window else None,
                    **every,
                ),
            )
        )
    return out


def check_kv_claim(backend: str, label: str, case: KvCase, device="cpu") -> None:
    """One KV-cache claim: accepted by the backend, and its output and cache match the reference."""
    decision = ad.explain_with_kvcache(**make_kv_inputs(case, device), backend=backend)
    assert decision.backend == backend, f"{backend} claims {label} but rejects it: {decision.rejected.get(backend)}"
    check_kv_call(backend, case, device)


def check_kv_claims(backend: str, device="cpu", big=False) -> int:
    """Every KV-cache claim of `backend` in one loop (for registered test doubles)."""
    cases = kv_claimed_cases(ad.get_backend(backend).capabilities, big)
    for label, case in cases:
        check_kv_claim(backend, label, case, device)
    return len(cases)


def _available(device_type):
    for name in ad.list_backends():
        backend = ad.get_backend(name)
        if backend.is_available() and device_type in backend.capabilities.devices:
            yield name


def _check_dropout_statistically(backend, case, device):
    """For kernels whose mask cannot be recovered: the mean over many draws is the
    dropout-free result, and draws differ."""
    q, k, v, mask, kw, _ = make_inputs(dataclasses.replace(case, dropout_p=0.0), device, requires_grad=False)
    kw.pop("return_lse", None)  # the output is what dropout changes
    exact = ad.sdpa(q, k, v, attn_mask=mask, backend="math", **kw).double()
    draws = torch.stack(
        [ad.sdpa(q, k, v, attn_mask=mask, dropout_p=case.dropout_p, backend=backend, **kw).double() for _ in range(300)]
    )
    assert not draws.isnan().any()
    err = (draws.mean(0) - exact).abs().max().item()
    assert err < 0.2, f"{backend}: dropout mean differs from the exact output by {err}"
    assert (draws.std(0) > 0).any()


def check_prepared_runner(backend: str, case, device, grad: bool):
    """Backend.prepare's runner (what sdpa()'s fast path and policy="fastest"'s timing call)
    computes what run() does, forward and gradients: given the call's own mask and offsets
    and, for varlen, with the offsets omitted (the prepared call's are then used)."""
    q, k, v, mask, kw, _ = make_inputs(case, device, requires_grad=grad)
    call = normalize_call(q, k, v, mask, **kw)
    impl, options = ad.get_backend(backend), call.options
    args = (call.query, call.key, call.value) + (() if options["attn_mask"] is None else (options["attn_mask"],))
    leaves = [t for t in args if t.requires_grad]
    varlen = options["cu_seqlens_q"] is not None
    with torch.set_grad_enabled(grad):
        want = impl.run(call.query, call.key, call.value, **options)
        runner = impl.prepare(call.query, call.key, call.value, options)
        # as sdpa()'s fast path calls it: a dense runner takes no offsets
        outs = {
            "as sdpa() calls it": runner(
                *args, **({n: options[n] for n in ("cu_seqlens_q", "cu_seqlens_k")} if varlen else {})
            )
        }
        if varlen:
            outs["offsets omitted"] = runner(*args)
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, g) if leaves else ()

    def close(got, ref, what):
        # the same kernels, but a backward may sum with atomics: a few units of the last place
        eps = torch.finfo(ref.dtype).eps
        torch.testing.assert_close(
            got,
            ref,
            rtol=4 * eps,
            atol=4 * eps * ref.abs().max().item(),
            msg=lambda m: f"{backend} {case} prepared runner, {what}: {m}",
        )

    for how, out in outs.items():
        close(out, want, how)
        for name, got, ref in zip(
            ("dq", "dk", "dv", "dmask"), torch.autograd.grad(out, leaves, g) if leaves else (), want_grads
        ):
            close(got, ref, f"{how}, {name}")


def check_claim(backend: str, label: str, case, single: bool, device="cpu") -> bool:
    """One claim of `backend` against the float64 oracle; False when a claim that is not a
    single feature is refined away by the backend's own checks (nothing to test)."""
    # A feature may be claimed for the forward only (e.g. flash-attn 4's window on sm90):
    # then the inference call must be accepted and exact.
    for grad in (True, False):
        q, k, v, mask, kw, _ = make_inputs(case, device, requires_grad=grad)
        problem = normalize_call(q, k, v, mask, **kw).problem
        reasons = ad.get_backend(backend).reasons(problem)
        if not reasons:
            break
    if reasons:
        assert not single, f"{backend} claims {label} but rejects it: {reasons}"
        return False
    if case.dropout_p and backend not in KEEP_MASKS:
        _check_dropout_statistically(backend, case, device)
    else:
        compare_backend(case, backend, keep_fn=KEEP_MASKS.get(backend), device=device, requires_grad=grad)
    features = case.softcap is not None or case.alibi or case.sinks or case.return_lse
    if not case.dropout_p and not features:  # sdpa() prepares no call with issue 36's features
        check_prepared_runner(backend, case, device, grad)
    return True


def check_claims(backend: str, device="cpu", big=False) -> int:
    """Every claim of `backend` in one loop (for registered test doubles); the suite runs
    each claim as its own test item."""
    caps = ad.get_backend(backend).capabilities
    return sum(check_claim(backend, label, case, single, device) for label, case, single in claimed_cases(caps, big))


def _claims(device: str, big: bool):
    if device == "cuda" and not torch.cuda.is_available():
        return
    for backend in _available(device):
        for label, case, single in claimed_cases(ad.get_backend(backend).capabilities, big):
            yield pytest.param(backend, label, case, single, id=f"{backend}: {label}")


def _kv_claims(device: str, big: bool):
    if device == "cuda" and not torch.cuda.is_available():
        return
    for backend in _available(device):
        for label, case in kv_claimed_cases(ad.get_backend(backend).capabilities, big):
            yield pytest.param(backend, label, case, id=f"{backend}: {label}")


@pytest.mark.parametrize("backend,label,case", list(_kv_claims("cpu", big=False)))
def test_kv_capability_claim_holds_on_cpu(backend, label, case):
    check_kv_claim(backend, label, case)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,label,case", list(_kv_claims("cuda", big=True)))
def test_kv_capability_claim_holds_on_gpu(backend, label, case):
    check_kv_claim(backend, label, case, device="cuda")


@pytest.mark.parametrize("backend,label,case,single", list(_claims("cpu", big=False)))
def test_capability_claim_holds_on_cpu(backend, label, case, single):
    if not check_claim(backend, label, case, single):
        pytest.skip(f"{backend} refines {label} away in its own checks")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,label,case,single", list(_claims("cuda", big=True)))
def test_capability_claim_holds_on_gpu(backend, label, case, single):
    if not check_claim(backend, label, case, single, device="cuda"):
        pytest.skip(f"{backend} refines {label} away in its own checks")


class _Liar(ad.Backend):
    """Claims the sliding window but ignores it: the honesty check must catch this."""

    name = "liar"
    capabilities = ad.Capabilities(dtypes=frozenset({torch.float32}), dropout=False, varlen=False)

    def run(self, query, key, value, **options):
        return math_attention(query, key, value, **{**options, "window": None})


def test_a_false_claim_fails_the_honesty_check():
    ad.register_backend(_Liar())
    with pytest.raises(AssertionError, match="liar .*window.* out: max error"):
        check_claims("liar")


class _Rounder(ad.Backend):
    """Claims float32 biases with 16-bit inputs but rounds them to the inputs' dtype."""

    name = "rounder"
    capabilities = ad.Capabilities(dtypes=frozenset({torch.bfloat16}), dropout=False, varlen=False)

    def run(self, query, key, value, **options):
        mask = options["attn_mask"]
        if mask is not None and mask.dtype == torch.float32:
            options = {**options, "attn_mask": mask.to(query.dtype)}
        return math_attention(query, key, value, **options)


def test_a_rounded_float32_bias_fails_the_honesty_check():
    ad.register_backend(_Rounder())
    with pytest.raises(AssertionError, match="rounder .*mask_dtype=torch.float32.* out: max error"):
        check_claims("rounder")


class _KvLiar(ad.Backend):
    """Claims a window against a KV cache but ignores it."""

    name = "kv_liar"
    capabilities = ad.Capabilities(dtypes=frozenset({torch.float32}), kv_cache=frozenset({"dense", "paged"}))

    def run_kvcache(self, query, k_cache, v_cache, cache_seqlens, **options):
        return math_attention_with_kvcache(query, k_cache, v_cache, cache_seqlens, **{**options, "window": None})


def test_an_ignored_kv_window_fails_the_honesty_check():
    ad.register_backend(_KvLiar())
    with pytest.raises(AssertionError, match="kv_liar .*window=\\(5, 1\\).* out: max error"):
        check_kv_claims("kv_liar")


class _NoAppend(ad.Backend):
    """Claims the append but attends to k_new without writing it into the cache."""

    name = "no_append"
    capabilities = ad.Capabilities(dtypes=frozenset({torch.float32}), kv_cache=frozenset({"paged"}))

    def run_kvcache(self, query, k_cache, v_cache, cache_seqlens, **options):
        return math_attention_with_kvcache(query, k_cache.clone(), v_cache.clone(), cache_seqlens, **options)


def test_a_missing_append_fails_the_honesty_check():
    ad.register_backend(_NoAppend())
    with pytest.raises(AssertionError, match="no_append .*append=True.*: k_cache after the call"):
        check_kv_claims("no_append")
