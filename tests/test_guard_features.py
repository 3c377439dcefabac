"""The numerics guard on softcap, ALiBi, sinks, a returned lse and dropout (issue 38): judged
against the float64 reference like any call; a call it cannot judge says why in explain()
and in the decision's notes, never passing silently."""

import dataclasses

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.api import normalize_call
from attention_dispatch.backends.math import math_attention
from attention_dispatch.policy import guard

from cases import Case, make_inputs
from naive import naive_attention

FEATURE_CASES = [
    Case(softcap=2.0, seqlen_k=30),
    Case(alibi="heads", causal="bottom_right", seqlen_q=9, seqlen_k=13),
    Case(alibi="batch", causal="top_left", window=(3, 2), seqlen_q=13, seqlen_k=9),
    Case(sinks="fixed", mask="bool", mask_shape="keys", seqlen_q=6, seqlen_k=6),  # fully masked rows likely
    Case(return_lse=True, heads_q=8, heads_kv=2, mask="float"),
    Case(softcap=30.0, alibi="heads", sinks="fixed", return_lse=True, dtype=torch.float16, causal="bottom_right"),
    Case(
        varlen=(3, 0, 5, 1), extra_k=(2, 4, 0, 0), alibi="batch", sinks="fixed", return_lse=True, causal="bottom_right"
    ),
    Case(varlen=(4, 2), extra_k=(0, 3), softcap=5.0, return_lse=True, dtype=torch.bfloat16, window=(1, 1)),
]


def reference_call(case):
    q, k, v, mask, sdpa_kw, _ = make_inputs(case, requires_grad=False)
    call = normalize_call(q, k, v, mask, **sdpa_kw)
    return call, math_attention(call.query, call.key, call.value, **call.options)


@pytest.mark.parametrize("case", FEATURE_CASES, ids=str)
def test_features_are_judged_and_a_wrong_entry_caught(case):
    call, result = reference_call(case)
    args = (call.problem, call.query, call.key, call.value, call.options)
    assert guard.unjudged(call.problem, call.options) is None
    assert guard.check(*args, result, rows=4096) is None  # every row, no false alarm
    out, lse = result if case.return_lse else (result, None)
    bad = out.clone()
    bad.view(-1)[torch.randint(bad.numel(), ())] += 0.05 if case.dtype != torch.bfloat16 else 0.2
    assert guard.check(*args, (bad, lse) if case.return_lse else bad, rows=4096) is not None
    if lse is not None:  # the lse is compared too
        wrong = lse.clone()
        finite = torch.isfinite(wrong).view(-1).nonzero()
        wrong.view(-1)[finite[torch.randint(len(finite), ())]] += 1e-3 if case.dtype == torch.float32 else 0.2
        assert guard.check(*args, (out, wrong), rows=4096) is not None


class IgnoresSoftcap(ad.Backend):
    """Claims softcap and ALiBi but ignores the softcap (a planted wrong backend)."""

    name = "ignores_softcap"
    capabilities = dataclasses.replace(ad.Backend.capabilities, softcap=True, alibi=True)

    def run(self, query, key, value, **options):
        return math_attention(query, key, value, **dict(options, softcap=None))


def test_first_mode_quarantines_a_backend_wrong_on_softcap():
    ad.register_backend(IgnoresSoftcap(), priority="first")
    q, k, v = (torch.randn(1, 2, 16, 8) * 4 for _ in range(3))
    slopes = torch.full((2,), 0.3)
    ref = naive_attention(q.double(), k.double(), v.double(), softcap=2.0, alibi_slopes=slopes.double()).float()
    with ad.use_config({"guard": {"mode": "first"}}), ad.use_backends("ignores_softcap", "math"):
        out = ad.sdpa(q, k, v, softcap=2.0, alibi_slopes=slopes)
        torch.testing.assert_close(out, ref)
        assert ad.last_decision().backend == "math"
        assert "ignores_softcap" in guard.quarantined()


class Dropping(ad.Backend):
    """Dropout through naive_attention with a keep-mask drawn from torch's generator, and
    dropout_keep_mask() drawing it again; `wrong`: applies another mask than it declares."""

    name = "dropping"

    def __init__(self, wrong=False):
        self.wrong = wrong

    def dropout_keep_mask(self, query, key, options):
        b, hq, sq, _ = query.shape
        return torch.rand(b, hq, sq, key.shape[2]) >= options["dropout_p"]

    def run(self, query, key, value, *, dropout_p, causal, scale, enable_gqa, **options):
        assert options["attn_mask"] is None and options["cu_seqlens_q"] is None and options["window"] is None
        keep = self.dropout_keep_mask(query, key, dict(dropout_p=dropout_p))
        if self.wrong:
            keep = keep.roll(1, dims=-1)
        key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], 1) for t in (key, value))
        return naive_attention(query, key, value, keep=keep, dropout_p=dropout_p, causal=causal, scale=scale)


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong"])
def test_dropout_is_judged_through_the_redrawn_keep_mask(wrong):
    ad.register_backend(Dropping(wrong), priority="first")
    q, k, v = (torch.randn(2, 4, 12, 16) for _ in range(3))
    with ad.use_config({"guard": {"mode": "first", "rows": 32}}), ad.use_backends("dropping", "math"):
        torch.manual_seed(5)
        ad.sdpa(q, k, v, dropout_p=0.3, is_causal=True)
        assert (ad.last_decision().backend == "math") is wrong
        assert ("dropping" in guard.quarantined()) is wrong
        if not wrong:
            assert not any("cannot judge" in n for n in ad.last_decision().notes)


def test_the_guard_leaves_the_random_stream_where_a_dropout_call_left_it():
    ad.register_backend(Dropping(), priority="first")
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with ad.use_backends("dropping", "math"):
        torch.manual_seed(9)
        ad.sdpa(q, k, v, dropout_p=0.3)
        expected = torch.rand(4)
        with ad.use_config({"guard": {"mode": "strict"}}):
            torch.manual_seed(9)
            ad.sdpa(q, k, v, dropout_p=0.3)
            assert torch.equal(torch.rand(4), expected)


class Opaque(ad.Backend):
    """Dropout drawn inside, with no dropout_keep_mask(): the guard cannot judge its dropout calls."""

    name = "opaque"

    def run(self, query, key, value, **options):
        return math_attention(query, key, value, **options)


def test_a_dropout_call_it_cannot_judge_says_why_in_explain_and_the_decision():
    ad.register_backend(Opaque(), priority="first")
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with ad.use_config({"guard": {"mode": "first"}}), ad.use_backends("opaque"):
        d = ad.explain(q, k, v, dropout_p=0.3)
        (note,) = [n for n in d.notes if "numerics guard" in n]
        assert "cannot judge" in note and "'opaque' cannot draw its keep-mask again" in note
        ad.sdpa(q, k, v, dropout_p=0.3)
        assert note in ad.last_decision().notes
        assert "opaque" not in guard.quarantined()
        assert not any("numerics guard" in n for n in ad.explain(q, k, v).notes)  # no dropout: judged
    with ad.use_backends("opaque"):
        assert not any("numerics guard" in n for n in ad.explain(q, k, v, dropout_p=0.3).notes)  # guard off


@pytest.mark.parametrize(
    "case",
    [
        Case(dropout_p=0.3, heads_q=4, heads_kv=2, seqlen_q=20, seqlen_k=36, causal="bottom_right"),
        Case(dropout_p=0.5, varlen=(5, 0, 9), extra_k=(3, 2, 0), mask="float"),
    ],
    ids=str,
)
def test_the_triton_kernels_dropout_passes_the_guard(case):
    """The triton backend's dropout_keep_mask() is the mask its kernel applied: no false alarm,
    and strict mode checks its backward too."""
    triton = ad.get_backend("triton")
    if not triton.is_available():
        pytest.skip(triton.unavailable_reason())
    q, k, v, mask, sdpa_kw, _ = make_inputs(case)
    with ad.use_config({"guard": {"mode": "strict", "rows": 64}}):
        out = ad.sdpa(q, k, v, attn_mask=mask, backend="triton", **sdpa_kw)  # raises GuardError if wrong
    assert not any("cannot judge" in n for n in ad.last_decision().notes)
    out.sum().backward()
