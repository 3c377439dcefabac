"""Issue 36's features in the Triton kernels: logit softcapping, ALiBi slopes, attention sinks
and a differentiable logsumexp, alone and with every existing feature (both causal alignments,
window, GQA, varlen, bias with grad, dropout, determinism), forward and backward, and in the
KV-cache decode kernel, against tests/naive.py in float64 (DESIGN.md section 7's rule).

CPU: TRITON_INTERPRET=1 at tiny shapes.  GPU: the `gpu`-marked tests at realistic ones.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from naive import naive_attention  # noqa: E402
from oracle import assert_matches  # noqa: E402

from attention_dispatch.kernels import (  # noqa: E402
    KernelParams,
    describe_route,
    dropout_keep_mask,
    is_interpreter,
    triton_attention,
)
from attention_dispatch.kernels.decode import decode_forward, kv_route  # noqa: E402
from attention_dispatch.semantics import band, normalize_causal, normalize_window  # noqa: E402

INTERP = is_interpreter()
DEV = "cpu" if INTERP else "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERP, reason="needs a CUDA GPU")

ALL = dict(softcap=2.5, alibi=True, sinks=True, lse_grad=True)


def _params(causal, window, scale, dropout_p=0.0, softcap=None, **kw):
    br, wl, wr = band(normalize_causal(False, causal), normalize_window(window))
    return KernelParams(
        scale=scale,
        align_bottom_right=br,
        window_left=wl,
        window_right=wr,
        dropout_p=dropout_p,
        softcap=softcap or 0.0,
        **kw,
    )


def _seq_dims(q, k, cu_q, max_sq, max_sk):
    if cu_q is None:
        return q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    return cu_q.numel() - 1, q.shape[1], max_sq, max_sk


def _finite_lse_loss(lse, dlse):
    """sum(lse * dlse) over the rows that have a logsumexp (-inf rows carry no gradient)."""
    return (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse).sum()


def check(
    q,
    k,
    v,
    bias=None,
    *,
    causal=None,
    window=None,
    dropout_p=0.0,
    cu=None,
    max_s=(None, None),
    softcap=None,
    alibi=False,
    sinks=False,
    lse_grad=False,
    sink_dtype=F32,
    seed=1234,
    **pkw,
):
    """The kernels' out, lse and the gradients of q, k, v, a float bias that requires grad and
    the sinks (loss: <out, dO> + <lse, dlse> with ``lse_grad``) against naive in float64, the
    budget from naive in the inputs' dtype.  Returns the kernel's results."""
    cu_q, cu_k = cu if cu is not None else (None, None)
    batch = q.shape[0] if cu_q is None else cu_q.numel() - 1
    hq = q.shape[1] if cu_q is None else q.shape[1]
    scale = q.shape[-1] ** -0.5
    params = _params(causal, window, scale, dropout_p, softcap, **pkw)
    # alibi: True, or a float scaling the slopes (small slopes: far keys keep visible weights)
    slopes = (torch.rand(hq, device=q.device) * 0.4 + 0.05).mul(float(alibi)).expand(batch, hq) if alibi else None
    # sinks: True, or a float they are centred on (far above every score: the sink takes ~all the weight)
    sink_mean = 0.0 if sinks is True else float(sinks)
    sink_t = (torch.randn(hq, device=q.device) * 2 + sink_mean).to(sink_dtype).requires_grad_() if sinks else None
    torch.manual_seed(seed)
    out, lse = triton_attention(
        q, k, v, bias, params, cu_q, cu_k, *max_s, return_lse=True, alibi_slopes=slopes, sinks=sink_t
    )
    keep = None
    if dropout_p:
        torch.manual_seed(seed)
        keep = dropout_keep_mask(*_seq_dims(q, k, cu_q, *max_s), dropout_p, device=q.device).cpu()
    do = torch.randn_like(out)
    dlse = torch.randn_like(lse) if lse_grad else None
    named = [(n, t) for n, t in (("dq", q), ("dk", k), ("dv", v), ("dbias", bias), ("dsinks", sink_t))]
    named = [(n, t) for n, t in named if t is not None and t.requires_grad]
    loss = (out.float() * do.float()).sum() + (_finite_lse_loss(lse, dlse) if lse_grad else 0.0)
    got = dict(out=out, lse=lse)
    got.update(zip([n for n, _ in named], torch.autograd.grad(loss, [t for _, t in named])))
    assert not torch.isnan(lse).any()
    refs = {}
    for dt in (torch.float64, q.dtype):
        leaves = {}
        for n, t in named:
            leaves[n] = t.detach().cpu().to(dt if t.is_floating_point() else t.dtype).requires_grad_()
        cp = [leaves.get(n, t.detach().cpu().to(dt)) for n, t in (("dq", q), ("dk", k), ("dv", v))]
        m = leaves.get("dbias")
        if m is None and bias is not None:
            m = bias.detach().cpu()
            m = m.to(dt) if m.is_floating_point() else m
        r_sinks = leaves.get("dsinks", None if sink_t is None else sink_t.detach().cpu().to(dt))
        r_out, r_lse = naive_attention(
            *cp,
            mask=m,
            causal=causal,
            window=window,
            scale=scale,
            keep=keep,
            dropout_p=dropout_p,
            cu_seqlens_q=None if cu_q is None else cu_q.cpu(),
            cu_seqlens_k=None if cu_k is None else cu_k.cpu(),
            return_lse=True,
            softcap=softcap,
            alibi_slopes=None if slopes is None else slopes.cpu().to(dt),
            sinks=r_sinks,
        )
        r_loss = (r_out * do.cpu().to(dt)).sum()
        if lse_grad:
            r_loss = r_loss + _finite_lse_loss(r_lse, dlse.cpu().to(dt))
        r = dict(out=r_out, lse=r_lse)
        r.update(zip(leaves, torch.autograd.grad(r_loss, list(leaves.values()))))
        refs[dt] = r
    for name, g in got.items():
        r64, rlo = refs[torch.float64][name], refs[q.dtype][name]
        if name == "lse":  # fp32 in the kernels whatever the inputs: naive's own fp32 rounding is the budget
            rlo = r64.float()
        if name in ("dsinks", "dbias") and g.dtype != q.dtype:
            rlo = rlo.to(g.dtype)
        slack = F32 if name in ("lse",) and q.dtype == F32 else q.dtype
        assert g.dtype == (sink_dtype if name == "dsinks" else g.dtype)
        assert_matches(g, r64, rlo, name, dtype=slack)
    return got


def rand(*shape, dtype=F32, grad=True, device=None):
    return torch.randn(*shape, dtype=dtype, device=device or DEV).requires_grad_(grad)


def dense(b=1, hq=2, hkv=2, sq=9, sk=13, d=16, dtype=F32):
    return rand(b, hq, sq, d, dtype=dtype), rand(b, hkv, sk, d, dtype=dtype), rand(b, hkv, sk, d, dtype=dtype)


# ----------------------------------------------------------------------------- each feature alone


@pytest.mark.parametrize(
    "feature", [dict(softcap=1.5), dict(alibi=True), dict(sinks=True), dict(lse_grad=True)], ids=str
)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_feature_alone(feature, causal):
    check(*dense(), causal=causal, **feature)


# ----------------------------------------------------------------------------- all of them, with each existing feature


def test_all_with_window_gqa():
    check(*dense(hq=4, hkv=2, sq=11, sk=9), window=(3, 1), **ALL)


def test_all_with_top_left_window():
    check(*dense(sq=12, sk=10), causal="top_left", window=(4, -1), **ALL)


def test_all_with_bias_grad_gqa():
    q, k, v = dense(b=2, hq=4, hkv=1)
    bias = rand(1, 4, 1, 13)  # broadcast over batch and rows: summed gradient
    check(q, k, v, bias, causal="bottom_right", **ALL)


def test_all_with_varlen():
    lq, lk, hq, hkv, d = [5, 0, 7], [6, 4, 3], 2, 1, 16
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 6, 10, 13], dtype=torch.int32, device=DEV)
    q, k, v = rand(sum(lq), hq, d), rand(sum(lk), hkv, d), rand(sum(lk), hkv, d)
    check(q, k, v, causal="bottom_right", cu=(cu_q, cu_k), max_s=(max(lq), max(lk)), **ALL)


def test_all_with_dropout():
    check(*dense(b=2, sq=10, sk=12), dropout_p=0.3, **ALL)


def test_all_deterministic_is_bitwise_repeatable():
    """deterministic=True with GQA (the dK/dV group split and the dQ key splits are then off):
    the same inputs give bitwise the same output, lse and gradients, d(sinks) included."""
    q, k, v = dense(hq=4, hkv=2, sq=20, sk=24)
    slopes, sinks = torch.rand(1, 4, device=DEV), torch.randn(4, device=DEV, requires_grad=True)
    params = KernelParams(scale=0.25, softcap=3.0, window_right=0, deterministic=True, block_m=16, block_n=16)

    def once():
        out, lse = triton_attention(q, k, v, None, params, return_lse=True, alibi_slopes=slopes, sinks=sinks)
        return (out, lse, *torch.autograd.grad(out.sum() + lse.sum(), (q, k, v, sinks)))

    for a, b in zip(once(), once()):
        assert torch.equal(a, b)


def test_all_half_precision_bf16_sinks():
    check(*dense(dtype=F16), causal="bottom_right", sink_dtype=BF16, **ALL)


# ----------------------------------------------------------------------------- edge rows


def test_fully_masked_rows_with_sinks_and_lse():
    """A row with no allowed key: output 0, lse -inf, no NaN anywhere, gradients 0 on that row."""
    q, k, v = dense(hq=2, sq=6, sk=8)
    mask = torch.ones(1, 1, 6, 8, dtype=torch.bool, device=DEV)
    mask[..., 2, :] = False
    got = check(q, k, v, mask, sinks=True, lse_grad=True, softcap=3.0, alibi=True)
    assert (got["out"][:, :, 2] == 0).all() and (got["lse"][:, :, 2] == -math.inf).all()
    assert (got["dq"][:, :, 2] == 0).all()


@pytest.mark.parametrize("sink", [16.0, 30.0, 120.0])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_sinks_far_above_every_score_with_a_logsumexp_gradient(sink, dtype):
    """A sink ~16 (some heads either side of the delta pass's EXCESS_SPLIT), ~30 or ~120 above the
    scores: P with the sink in its normaliser is ~e^-sink (0 in float32 past ~88), while the gradient
    into lse (without the sink) moves the scores by P without it, O(1).  exp(sink) overflowed in the delta pass: NaN in every gradient (H100 fuzz, bf16, 2026-11-27)."""
    check(*dense(dtype=dtype), sinks=sink, lse_grad=True)
    check(*dense(dtype=dtype, sq=12, sk=10), causal="top_left", sinks=sink, lse_grad=True, softcap=3.0)


@pytest.mark.parametrize(
    "dtype, seq", [(F32, None), (BF16, None), pytest.param(BF16, 4096, marks=[gpu, needs_cuda], id="gluon")]
)
def test_a_sink_of_plus_infinity_takes_all_the_weight_without_nan(dtype, seq):
    """sinks = +inf: every P is 0 and the output 0, the sink's gradient 0 (its row weight is 1, delta 0);
    the logsumexp (without the sink) and its gradient are those of the call without sinks.  inf - inf in
    the delta pass gave NaN gradients.  ``seq``: a causal d128 call the Gluon kernels take on an sm90."""
    q, k, v = dense(dtype=dtype, sq=12, sk=10) if seq is None else (rand(1, 2, seq, 128, dtype=dtype) for _ in range(3))
    params = KernelParams(scale=q.shape[-1] ** -0.5, window_right=0)
    sinks = torch.full((2,), math.inf, device=DEV, requires_grad=True)
    out, lse = triton_attention(q, k, v, None, params, return_lse=True, sinks=sinks)
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out.float() * do.float()).sum() + (lse * dlse).sum(), (q, k, v, sinks))
    assert (out == 0).all() and all(not g.isnan().any() for g in grads)
    assert (grads[3] == 0).all() and (grads[2] == 0).all()
    plain_lse = triton_attention(q, k, v, None, params, return_lse=True)[1]
    torch.testing.assert_close(lse, plain_lse)
    expected = torch.autograd.grad((plain_lse * dlse).sum(), (q, k))
    for got, want in zip(grads[:2], expected):
        torch.testing.assert_close(got, want)


def test_window_leaving_rows_empty_with_sinks():
    # bottom-right with Sq > Sk: the first rows see no key at all
    check(*dense(sq=12, sk=5), causal="bottom_right", **ALL)


def test_sinks_without_grad_and_no_lse_gradient_costs_nothing(monkeypatch):
    """No lse gradient, sinks not requiring grad: the delta pass gets no dlse, no d(sink) rows and no
    rescaled dO (the passes read the caller's)."""
    from attention_dispatch.kernels.tl import launch_backward

    seen = []
    real = launch_backward.delta_pass

    def spy(*args, **kw):
        seen.append(args[5:])
        return real(*args, **kw)

    monkeypatch.setattr(launch_backward, "delta_pass", spy)
    q, k, v = dense()
    out = triton_attention(q, k, v, None, KernelParams(scale=0.25), sinks=torch.randn(2, device=DEV))
    out.sum().backward()
    lse_arg, sinks_arg, grad_lse, lse_total, dsink_rows, do_scaled = seen[-1]
    assert sinks_arg is not None and lse_total is not None and grad_lse is None and dsink_rows is None
    assert do_scaled is None
    out = triton_attention(q, k, v, None, KernelParams(scale=0.25))
    out.sum().backward()
    assert all(a is None for a in seen[-1][1:])


# ----------------------------------------------------------------------------- routes and inputs


def test_gluon_routes_name_the_feature():
    """The Gluon forward and backward compute softcap and ALiBi (not past ALIBI_MAX_SEQ keys, with a
    reason naming the argument); the KV-cache Gluon forward takes none of the features."""
    from attention_dispatch.kernels.gluon.route import ALIBI_MAX_SEQ, score_features_reason

    q, k, v = dense()
    alibi = torch.ones(1, 2, device=DEV)
    for params, extra in ((KernelParams(scale=0.25, softcap=5.0), {}), (KernelParams(scale=0.25), dict(alibi=alibi))):
        steps = describe_route(q, k, v, None, params, backward=True, **extra)
        assert not any(why.startswith(("softcap", "alibi")) for _, why in steps[0][2] + steps[1][2]), steps
    for part in ("forward", "backward"):
        assert score_features_reason(KernelParams(scale=0.25, softcap=5.0), True, True, part, 4096) is None
        why = score_features_reason(KernelParams(scale=0.25), True, False, part, ALIBI_MAX_SEQ)
        assert why.startswith(f"alibi_slopes with {ALIBI_MAX_SEQ} keys or queries"), why
    cache = torch.randn(1, 2, 32, 16, device=DEV)
    for params, extra, name in (
        (KernelParams(scale=0.25, softcap=5.0), {}, "softcap"),
        (KernelParams(scale=0.25), dict(sinks=torch.ones(2, device=DEV)), "sinks"),
        (KernelParams(scale=0.25), dict(alibi=alibi), "alibi_slopes"),
    ):
        kernel, why = kv_route(q, cache, cache, None, params, **extra)
        assert kernel == "decode split-KV" and why.startswith(f"{name}: not in the Gluon cache forward"), why


def test_bad_inputs_raise():
    q, k, v = dense()
    with pytest.raises(ValueError, match="softcap"):
        KernelParams(scale=1.0, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        KernelParams(scale=1.0, softcap=math.inf)
    with pytest.raises(ValueError, match="alibi_slopes"):
        triton_attention(q, k, v, None, KernelParams(scale=1.0), alibi_slopes=torch.ones(3, 2, device=DEV))
    with pytest.raises(ValueError, match="alibi_slopes"):
        triton_attention(q, k, v, None, KernelParams(scale=1.0), alibi_slopes=torch.ones(1, 2, dtype=F16, device=DEV))
    with pytest.raises(ValueError, match="sinks"):
        triton_attention(q, k, v, None, KernelParams(scale=1.0), sinks=torch.ones(3, device=DEV))


def test_compiled_op_takes_the_features():
    """torch.compile traces the custom ops: the schema carries slopes, sinks and softcap, the fake
    kernels match, and the lse and sinks gradients flow through the compiled graph."""
    q, k, v = dense()
    slopes = torch.full((1, 2), 0.2, device=DEV)
    sinks = torch.randn(2, device=DEV, requires_grad=True)
    params = KernelParams(scale=0.25, softcap=4.0)

    def f(q, k, v, sinks):
        out, lse = triton_attention(q, k, v, None, params, return_lse=True, alibi_slopes=slopes, sinks=sinks)
        return out.sum() + lse.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
    want = torch.autograd.grad(f(q, k, v, sinks), (q, k, v, sinks))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


# ----------------------------------------------------------------------------- the decode kernel


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_features_and_lse(splits, paged):
    """softcap, ALiBi (diagonal at each sequence's length) and sinks in the decode kernel, the sink
    once after the split merge, and the logsumexp it returns."""
    b, hq, hkv, sq, cap, d = 2, 4, 2, 3, 64, 16
    q = torch.randn(b, hq, sq, d, device=DEV)
    kc, vc = torch.randn(b, hkv, cap, d, device=DEV), torch.randn(b, hkv, cap, d, device=DEV)
    lens = torch.tensor([29, 61], dtype=torch.int32, device=DEV)
    slopes = (torch.rand(hq, device=DEV) * 0.3).expand(b, hq)
    sinks = torch.randn(hq, device=DEV)
    params = KernelParams(scale=0.3, softcap=3.0, window_right=0, window_left=40)
    table = None
    k_in, v_in = kc, vc
    if paged:  # pages of 16 keys, shuffled
        page = 16
        perm = torch.randperm(b * cap // page, device=DEV)
        table = perm.reshape(b, cap // page).to(torch.int32)
        k_in = torch.empty(b * cap // page, page, hkv, d, device=DEV)
        v_in = torch.empty_like(k_in)
        k_in[perm] = kc.transpose(1, 2).reshape(b * cap // page, page, hkv, d)
        v_in[perm] = vc.transpose(1, 2).reshape(b * cap // page, page, hkv, d)
    out, lse = decode_forward(
        q, k_in, v_in, lens, params, block_table=table, num_splits=splits, alibi=slopes, sinks=sinks, need_lse=True
    )
    for i in range(b):
        n = int(lens[i])
        kk, vv = (t[i : i + 1, :, :n].repeat_interleave(hq // hkv, 1).double() for t in (kc, vc))
        r_out, r_lse = naive_attention(
            q[i : i + 1].double(),
            kk,
            vv,
            scale=0.3,
            causal="bottom_right",
            window=(40, 0),
            softcap=3.0,
            alibi_slopes=slopes[i].double(),
            sinks=sinks.double(),
            return_lse=True,
        )
        assert_matches(out[i : i + 1].cpu(), r_out, None, "out", dtype=F32)
        assert_matches(lse[i : i + 1].cpu(), r_lse, None, "lse", dtype=F32)


def test_dense_call_on_the_decode_route_takes_the_features():
    """A dense inference call shaped like decode runs the decode kernel, features included."""
    q, k, v = (torch.randn(1, 2, s, 16, device=DEV) for s in (1, 520, 520))
    slopes = torch.rand(1, 2, device=DEV)
    sinks = torch.randn(2, device=DEV)
    params = KernelParams(scale=0.25, softcap=2.0, align_bottom_right=True)  # ALiBi's diagonal at Sk - Sq
    assert describe_route(q, k, v, None, params, alibi=slopes, sinks=sinks)[0][1] == "decode"
    out = triton_attention(q, k, v, None, params, alibi_slopes=slopes, sinks=sinks)
    ref = naive_attention(
        *(t.double() for t in (q, k, v)), scale=0.25, softcap=2.0, alibi_slopes=slopes.double(), sinks=sinks.double()
    )
    assert_matches(out.cpu(), ref, None, "out", dtype=F32)


def test_gluon_softcap_bounded_up_to_55():
    """Caps up to 55.4 take the Gluon forward's fixed softmax reference (gluon/common.SOFTCAP_BOUNDED: its
    P stays within [2^-96, 2^64]) in bfloat16, larger ones and float16 the running max."""
    from attention_dispatch.kernels.gluon.launch import SOFTCAP_BOUNDED, forward_softcap

    assert forward_softcap(0.0, BF16) is False
    assert forward_softcap(2.5, BF16) == forward_softcap(30.0, BF16) == forward_softcap(55.4, BF16) == SOFTCAP_BOUNDED
    assert forward_softcap(55.5, BF16) is True
    # float16 keeps the running max: the fixed reference's P (up to 2^64) overflowed it to inf, the output NaN
    assert forward_softcap(2.0, F16) is forward_softcap(30.0, F16) is True


def test_gluon_bounded_softcap_forward_takes_three_consumers():
    """A bounded softcap alone at d128, dense or causal, launches the Gluon forward on three consumer warpgroups
    over 64-key slots (configs.WS_FWD_SOFTCAP_CONFIGS, E130); KV-cache and one-length launches without a bias take
    WS_FWD_CACHE_CONFIGS at d128 (three K/V slots, E149), softcap or not; plain calls, a running-max softcap, a bias,
    ALiBi, a window and the other head dims keep WS_FWD_CONFIGS."""
    from attention_dispatch.kernels import configs as C

    base = dict(has_bias=False, has_alibi=False, window_left=-1, window_right=-1, kv_lens_mode=0)
    for causal in (dict(), dict(window_right=0)):
        three = C.ws_forward_config(128, True, **dict(base, **causal))
        assert (three.consumers, three.block_n) == (3, 64) and three == C.WS_FWD_SOFTCAP_CONFIGS[128]
    for bounded in (False, True):
        for mode in (1, 2):
            cache = C.ws_forward_config(128, bounded, **dict(base, window_right=0, kv_lens_mode=mode))
            assert cache == C.WS_FWD_CACHE_CONFIGS[128] and (cache.stages, cache.consumers) == (3, 2)
    for head_d, bounded, change in [
        (128, False, {}),
        (128, True, dict(has_bias=True)),
        (128, True, dict(has_alibi=True)),
        (128, True, dict(window_left=256, window_right=0)),
        (128, True, dict(window_right=64)),
        (128, False, dict(has_bias=True, kv_lens_mode=1)),
        (64, True, {}),
        (64, False, dict(kv_lens_mode=1)),
        (256, True, {}),
        (256, False, dict(kv_lens_mode=1)),
    ]:
        assert C.ws_forward_config(head_d, bounded, **dict(base, **change)) == C.WS_FWD_CONFIGS[head_d], change
    # causal without a bias, each consumer reads only its own key tiles (E151); dense, windowed, biased calls and
    # the other configs read all of their program's
    three = C.WS_FWD_SOFTCAP_CONFIGS[128]
    assert three.forward_own_tiles(-1, 0, False)
    assert not three.forward_own_tiles(-1, -1, False)
    assert not three.forward_own_tiles(256, 0, False)
    assert not three.forward_own_tiles(-1, 0, True)
    for cfg in (*C.WS_FWD_CONFIGS.values(), *C.WS_FWD_CACHE_CONFIGS.values()):
        assert not cfg.forward_own_tiles(-1, 0, False), cfg


def _sm90_step_loops(tmp_path, monkeypatch, cases: str, label: str) -> list:
    """Each step loop's SASS opcodes (sass_loop.loops, 8 HGMMA or more) of compile_sm90's case ``label`` (from
    its ``cases`` generator: ws_cases or ws_backward_cases), compiled for sm90 in a subprocess with the Triton
    the Gluon kernels are written for (skips elsewhere; run with /tmp/t36)."""
    import subprocess

    import triton

    from attention_dispatch.kernels.gluon import route as gluon_route

    if not triton.__version__.startswith(gluon_route.GLUON_TRITON_VERSIONS):
        pytest.skip("the Gluon kernels compile with the Triton they are written for (run with /tmp/t36)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench = os.path.join(root, "benchmarks")
    script = (
        f"import sys; sys.path[:0] = [{root!r}, {bench!r}]\n"
        "import compile_sm90 as c\n"
        f"case = next(x for x in c.{cases}() if x[2] == {label!r})\n"
        "err, kernel = c.compile_ws_case(case[0], case[1], case[3])\n"
        "assert err is None, err\n"
        f"open({str(tmp_path / 'k.cubin')!r}, 'wb').write(kernel.asm['cubin'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    monkeypatch.syspath_prepend(bench)
    import sass_loop

    ins = sass_loop.instructions(sass_loop.sass_text(str(tmp_path / "k.cubin"), None))
    return [[op for a, _, op, _ in ins if start <= a <= end] for start, end in sass_loop.loops(ins, 8)]


def test_gluon_bounded_softcap_step_folds_the_tanh_scale_into_q(tmp_path, monkeypatch):
    """The bounded softcap forward's step loops multiply no score by the tanh's scale (folded into Q once a
    program, E150): per step a thread's 32 scores take 64 MUFU ops (tanh, ex2) and no FMUL."""
    label = "ws d=128 dense rows=(1, 1) lse=True softcap-bounded consumers=3 block_n=64 stages=3"
    steps = _sm90_step_loops(tmp_path, monkeypatch, "ws_cases", label)
    assert len(steps) == 3, steps  # one step loop a consumer warpgroup
    for body in steps:
        assert sum(op.startswith("MUFU") for op in body) == 64, body
        assert not [op for op in body if op.startswith("FMUL")], body


def test_gluon_kv_cache_step_releases_slots_per_warp(tmp_path, monkeypatch):
    """The KV-cache forward's consumers release each K/V slot per warp on a named barrier (E156): per step one
    BAR.SYNC (Triton's, before the K wait) and two BAR.ARV, no mbarrier arrive; the dense forward keeps the
    mbarrier release (a warpgroup BAR.SYNC before each of thread 0's two SYNCS.ARRIVE)."""
    label = "ws d=128 causal rows=(1, 1) lse=False"
    for name, steps in (
        ("cache", _sm90_step_loops(tmp_path, monkeypatch, "ws_cases", f"{label} kv-cache consumers=2 block_n=128 stages=3")),
        ("dense", _sm90_step_loops(tmp_path, monkeypatch, "ws_cases", label)),
    ):  # fmt: skip
        assert len(steps) >= 2, (name, steps)  # a loop a consumer warpgroup (and the causal split's two)
        for body in steps:
            bars = [op for op in body if op.startswith(("BAR.", "SYNCS.ARRIVE"))]
            per_warp = ["BAR.SYNC.DEFER_BLOCKING", "BAR.ARV", "BAR.ARV"]
            if name == "cache":
                assert bars == per_warp, (name, bars)
            else:
                assert bars.count("BAR.SYNC.DEFER_BLOCKING") == 3 and len(bars) == 5, (name, bars)
                assert "BAR.ARV" not in bars, (name, bars)


def test_warp_release_only_where_measured():
    """Per-warp slot release (E156) in the KV-cache / one-length launch's config only: the dQ pass shares the
    forward's loader with mbarrier releases, and the dense configs were not measured with it."""
    from attention_dispatch.kernels import configs as C

    assert C.WS_FWD_CACHE_CONFIGS[128].warp_release
    for cfg in (*C.WS_FWD_CONFIGS.values(), *C.WS_FWD_SOFTCAP_CONFIGS.values(), *C.WS_DQ_CONFIGS.values()):
        assert not cfg.warp_release, cfg
    for cfg in C.WS_FWD_CACHE_CONFIGS.values():
        assert cfg.consumers == 2 and 10 + 2 * cfg.stages <= 16 and not cfg.own_tiles, cfg


# ----------------------------------------------------------------------------- GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("causal,window", [(None, None), ("top_left", None), ("bottom_right", (200, 0))])
def test_gpu_all_features(dtype, causal, window):
    q = rand(2, 8, 700, 128, dtype=dtype)
    k, v = rand(2, 4, 900, 128, dtype=dtype), rand(2, 4, 900, 128, dtype=dtype)
    check(q, k, v, causal=causal, window=window, **ALL)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "feature",
    [
        dict(sinks=True),
        dict(lse_grad=True),
        dict(softcap=30.0, sinks=True, lse_grad=True),
        dict(sinks=40.0, lse_grad=True),  # sinks outweigh every row: the passes' rescaled dO
        dict(alibi=True, causal="bottom_right"),
        dict(softcap=20.0, alibi=True, sinks=True),
    ],
    ids=str,
)
def test_gpu_gluon_with_softcap_alibi_sinks_lse_grad(feature):
    """The Gluon forward computes softcap, ALiBi and sinks, the Gluon backward softcap and ALiBi; sinks
    and a logsumexp gradient reach it through lse and delta only."""
    q, k, v = (rand(1, 2, 4096, 128, dtype=BF16) for _ in range(3))
    causal = feature.get("causal")
    params = KernelParams(
        scale=128**-0.5, softcap=feature.get("softcap", 0.0), align_bottom_right=True, window_right=0 if causal else -1
    )
    sinks = torch.ones(2, device=DEV) if feature.get("sinks") else None
    alibi = torch.ones(1, 2, device=DEV) if feature.get("alibi") else None
    steps = describe_route(q, k, v, None, params, backward=True, sinks=sinks, alibi=alibi)
    assert steps[0][1] == "gluon", steps
    assert steps[1][1] == "gluon", steps
    check(q, k, v, **feature)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "extra",
    [dict(deterministic=True), dict(causal="bottom_right"), dict(causal="bottom_right", window=(1500, 0))],
    ids=str,
)
def test_gpu_gluon_backward_softcap_alibi_gqa(extra):
    """Softcap and ALiBi in the Gluon backward with GQA (each query head's slope in a dK/dV program),
    causal, a window and the separate dQ pass (deterministic: no fused dQ), against naive."""
    q = rand(1, 4, 4096, 128, dtype=BF16)
    k, v = rand(1, 2, 4096, 128, dtype=BF16), rand(1, 2, 4096, 128, dtype=BF16)
    extra = dict(extra)
    causal, window = extra.pop("causal", None), extra.pop("window", None)
    params = _params(causal, window, 128**-0.5, softcap=20.0, **extra)
    steps = describe_route(q, k, v, None, params, backward=True, alibi=torch.ones(1, 4, device=DEV))
    assert steps[0][1] == "gluon" and steps[1][1] == "gluon", steps
    check(q, k, v, causal=causal, window=window, softcap=20.0, alibi=True, **extra)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "d,causal,group,dtype,extra",
    [
        (128, None, 1, BF16, {}),  # dQ fused, 64-row tiles: each warpgroup's half of dQ's columns from both K tiles
        (128, "bottom_right", 4, BF16, {}),
        (64, None, 2, BF16, {}),  # 128-row tiles: each warpgroup's half of dQ's rows
        (128, None, 2, BF16, dict(deterministic=True)),  # the separate dQ pass: its Q tiles folded
        (128, "bottom_right", 1, BF16, dict(window=(1500, 0))),
        (128, None, 1, F16, {}),  # float16 keeps the scale in the step
    ],
    ids=str,
)
def test_gpu_gluon_backward_softcap_folds_the_scale(d, causal, group, dtype, extra):
    """The Gluon backward with a softcap alone folds the tanh's scale into each pass's stationary tile (E152,
    bfloat16): the dK/dV pass's K (the fused dQ reads both warpgroups' folded tiles), the dQ pass's Q; dQ, dK
    and dV against naive."""
    extra = dict(extra)
    window = extra.pop("window", None)
    heads_kv = 4 // group  # four query heads of 4096 rows: at least WS_MIN_WORK, the Gluon route
    q = rand(1, 4, 4096, d, dtype=dtype)
    k, v = rand(1, heads_kv, 4096, d, dtype=dtype), rand(1, heads_kv, 4096, d, dtype=dtype)
    params = _params(causal, window, d**-0.5, softcap=20.0, **extra)
    steps = describe_route(q, k, v, None, params, backward=True)
    assert steps[1][1] == "gluon", steps
    check(q, k, v, causal=causal, window=window, softcap=20.0, **extra)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "d,extra",
    [
        (128, {}),
        (128, dict(causal="bottom_right")),
        (128, dict(deterministic=True)),
        (128, dict(softcap=20.0)),
        (64, {}),
        (64, dict(softcap=20.0)),
    ],
    ids=str,
)
def test_gpu_gluon_alibi_small_slopes(d, extra):
    """ALiBi with slopes 0.05-0.45 times 2^-8: every key tile keeps a visible weight, so the three tile
    kinds (left of the diagonal, right of it, crossing it) of the Gluon forward, dQ and dK/dV passes
    each count (common._alibi_split; deterministic: the separate dQ pass)."""
    q, k, v = (rand(1, 4, 4096, d, dtype=BF16) for _ in range(3))  # at least WS_MIN_WORK: the Gluon route
    extra = dict(extra)
    causal = extra.pop("causal", None)
    params = _params(causal, None, d**-0.5, **extra)
    steps = describe_route(q, k, v, None, params, backward=True, alibi=torch.ones(1, 4, device=DEV))
    assert steps[0][1] == "gluon" and steps[1][1] == "gluon", steps
    check(q, k, v, causal=causal, alibi=2.0**-8, **extra)


@pytest.mark.parametrize(
    "label,mufu,fmul",
    [
        # dK/dV (dQ fused): 32 scores a thread, 64 MUFU (tanh, ex2; the plain step has one more too), FMUL for
        # P (1 - t^2), dS and the dQ partial's scale: 96, 128 without the fold
        ("ws dkdv+dq d=128 dense rows=(1, 1, 1) softcap", 65, 96),
        # the dQ pass: 64 scores a thread, FMUL for P (1 - t^2) and dS: 128, 192 without the fold
        ("ws dq d=128 dense rows=(1, 1, 1) softcap", 128, 128),
    ],
    ids=["dkdv", "dq"],
)
def test_gluon_backward_softcap_steps_fold_the_tanh_scale(tmp_path, monkeypatch, label, mufu, fmul):
    """The backward passes' softcap steps multiply no score by the tanh's scale (folded once a program into
    the stationary tile: the dK/dV pass's K, the dQ pass's Q, E152)."""
    steps = _sm90_step_loops(tmp_path, monkeypatch, "ws_backward_cases", label)
    assert len(steps) == 2, steps  # one step loop a consumer warpgroup
    for body in steps:
        assert sum(op.startswith("MUFU") for op in body) == mufu, body
        assert sum(op.startswith("FMUL") for op in body) == fmul, body


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "softcap,causal,dtype",
    [
        (30.0, None, BF16),
        (50.0, None, BF16),
        (50.0, "bottom_right", BF16),
        (60.0, None, BF16),
        # float16 keeps the running max (its P overflowed to inf on the fixed reference: NaN, found by fuzzing)
        (2.0, None, F16),
        (30.0, "bottom_right", F16),
    ],
    ids=str,
)
def test_gpu_gluon_softcap_bounded(softcap, causal, dtype):
    """A cap up to 55.4 runs the Gluon forward's softmax on a fixed reference in bfloat16
    (gluon/common.SOFTCAP_BOUNDED; 60 and float16: the running max): against naive, the first 64 rows
    with every score at the lower cap (the smallest P the reference gives, 2^(64 - 2 c log2 e)), the
    rest random."""
    k = (1.0 + 0.1 * torch.randn(1, 2, 4096, 128, device=DEV)).to(dtype).requires_grad_()
    q = torch.randn(1, 2, 4096, 128, device=DEV)
    q[:, :, :64] = -20.0  # q.k near -2560 for every key: tanh saturates at -1
    q = q.to(dtype).requires_grad_()
    v = rand(1, 2, 4096, 128, dtype=dtype)
    params = _params(causal, None, 128**-0.5, softcap=softcap)
    assert describe_route(q, k, v, None, params)[0][1] == "gluon"
    check(q, k, v, causal=causal, softcap=softcap)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "sq,sk,causal,extra",
    [
        (128, 4096, None, {}),  # one program: its second and third warpgroups start past Sq
        (640, 4096, None, dict(sinks=True, lse_grad=True)),  # the last program's first warpgroup only
        (384, 8192, None, {}),  # whole programs
        (1280, 1280, "top_left", dict(lse_grad=True)),  # causal, the last program's two warpgroups
        (640, 2048, None, dict(group=4)),  # GQA: four query heads a kv head
        (1280, 1280, "bottom_right", dict(group=2, sinks=True)),
        # causal, each warpgroup stops at its own diagonal (E151): the last program's first warpgroup only, whole programs
        (1024, 1024, "top_left", dict(lse_grad=True)),
        (768, 768, "bottom_right", dict(group=2, sinks=True)),
    ],
    ids=str,
)
def test_gpu_gluon_bounded_softcap_three_consumers(monkeypatch, sq, sk, causal, extra):
    """The bounded softcap's three-consumer forward (E130) where Sq is not a multiple of its 192 rows,
    with sinks, a logsumexp gradient and GQA, dense and causal: the launch takes that config, the
    results match naive."""
    from attention_dispatch.kernels import configs as C

    launched = []  # the configs gluon/launch.forward takes
    choose = C.ws_forward_config

    def record(*args, **kwargs):
        launched.append(choose(*args, **kwargs))
        return launched[-1]

    monkeypatch.setattr(C, "ws_forward_config", record)
    extra = dict(extra)
    group = extra.pop("group", 1)
    hq = group * max(1, (1 << 33) // (sq * sk * 128 * group))  # past WS_MIN_WORK: the Gluon route
    q = rand(1, hq, sq, 128, dtype=BF16)
    k, v = rand(1, hq // group, sk, 128, dtype=BF16), rand(1, hq // group, sk, 128, dtype=BF16)
    params = _params(causal, None, 128**-0.5, softcap=30.0)
    assert describe_route(q, k, v, None, params)[0][1] == "gluon"
    check(q, k, v, causal=causal, softcap=30.0, **extra)
    assert launched and all(cfg == C.WS_FWD_SOFTCAP_CONFIGS[128] for cfg in launched), launched


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gpu_decode_features(dtype):
    q = torch.randn(4, 8, 1, 128, device=DEV, dtype=dtype)
    k, v = (torch.randn(4, 2, 4096, 128, device=DEV, dtype=dtype) for _ in range(2))
    slopes, sinks = torch.rand(4, 8, device=DEV), torch.randn(8, device=DEV)
    params = KernelParams(scale=128**-0.5, softcap=20.0, align_bottom_right=True)  # naive: Sk - Sq
    out, lse = triton_attention(q, k, v, None, params, return_lse=True, alibi_slopes=slopes, sinks=sinks)
    lens = torch.full((4,), 4096, dtype=torch.int32, device=DEV)
    dec, dlse = decode_forward(q, k, v, lens, params, alibi=slopes, sinks=sinks, need_lse=True)
    kk, vv = (t.repeat_interleave(4, 1).double().cpu() for t in (k, v))
    ref, rlse = naive_attention(  # naive.py runs on the CPU
        q.double().cpu(), kk, vv, scale=128**-0.5, softcap=20.0, alibi_slopes=slopes.double().cpu(),
        sinks=sinks.double().cpu(), return_lse=True,
    )  # fmt: skip
    for got in (out, dec):
        assert_matches(got.cpu(), ref, None, "out", factor=1.0)
    for got in (lse, dlse):  # fp32 sums of 4096 exponentials of half-precision products
        assert_matches(got.cpu(), rlse, None, "lse", dtype=F16, factor=1.0)


@gpu
@needs_cuda
def test_gpu_kv_cache_gluon_forward_returns_the_merged_lse():
    """Many new queries over a dense cache: the Gluon forward's output and logsumexp, each
    sequence's partial last key tile included (kernels/decode.cache_forward)."""
    from attention_dispatch.kernels.decode import CACHE_GLUON, kv_forward

    b, hq, hkv, sq, cap, d = 2, 8, 2, 256, 8192, 128
    q = torch.randn(b, hq, sq, d, device=DEV, dtype=BF16)
    kc, vc = (torch.randn(b, hkv, cap, d, device=DEV, dtype=BF16) for _ in range(2))
    lens = torch.tensor([8000, 5001], dtype=torch.int32, device=DEV)
    params = KernelParams(scale=d**-0.5, align_bottom_right=True, window_right=0)
    assert kv_route(q, kc, vc, None, params)[0] == CACHE_GLUON
    out, lse = kv_forward(q, kc, vc, lens, params, need_lse=True)
    for i in range(b):
        n = int(lens[i])
        kk, vv = (t[i : i + 1, :, :n].repeat_interleave(hq // hkv, 1).double().cpu() for t in (kc, vc))
        r_out, r_lse = naive_attention(q[i : i + 1].double().cpu(), kk, vv, causal="bottom_right", return_lse=True)
        assert_matches(out[i : i + 1].cpu(), r_out, None, "out")
        assert_matches(lse[i : i + 1].cpu(), r_lse, None, "lse", dtype=BF16)


# ----------------------------------------------------------------------------- through the public API


def test_sdpa_triton_backend_takes_the_features():
    """ad.sdpa(backend="triton"): (Hq,) slopes, sinks requiring grad, softcap and a differentiable
    lse, against naive in float64 (the budget from naive in float32)."""
    import attention_dispatch as ad

    q, k, v = dense(b=2, hq=4, hkv=2, sq=7, sk=11)
    slopes = torch.rand(4, device=DEV) * 0.3
    sinks = torch.randn(4, device=DEV, requires_grad=True)
    out, lse = ad.sdpa(
        q, k, v, causal="bottom_right", enable_gqa=True, softcap=3.0, alibi_slopes=slopes, sinks=sinks,
        return_lse=True, backend="triton",
    )  # fmt: skip
    assert ad.last_decision().backend == "triton"
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    got = (out, lse) + torch.autograd.grad((out * do).sum() + (lse * dl).sum(), (q, k, v, sinks))
    refs = {}
    for dt in (torch.float64, F32):
        leaves = [t.detach().cpu().to(dt).requires_grad_() for t in (q, k, v, sinks)]
        kk, vv = (t.repeat_interleave(2, 1) for t in leaves[1:3])
        r_out, r_lse = naive_attention(
            leaves[0], kk, vv, causal="bottom_right", softcap=3.0, alibi_slopes=slopes.cpu().to(dt),
            sinks=leaves[3], return_lse=True,
        )  # fmt: skip
        loss = (r_out * do.cpu().to(dt)).sum() + (r_lse * dl.cpu().to(dt)).sum()
        refs[dt] = (r_out, r_lse) + torch.autograd.grad(loss, leaves)
    for name, g, r64, r32 in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, refs[torch.float64], refs[F32]):
        assert_matches(g.cpu(), r64, r32, name, dtype=F32)


def test_sdpa_triton_varlen_lse_is_heads_first():
    """Varlen: the returned lse is (Hq, total_q), as flash-attn's (the kernels write (total_q, Hq))."""
    import attention_dispatch as ad

    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEV)
    q, k, v = (torch.randn(8, 2, 16, device=DEV) for _ in range(3))
    sinks = torch.randn(2, device=DEV)
    out, lse = ad.sdpa(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5, sinks=sinks, return_lse=True,
        backend="triton",
    )  # fmt: skip
    r_out, r_lse = naive_attention(
        q.double(), k.double(), v.double(), cu_seqlens_q=cu, cu_seqlens_k=cu, sinks=sinks.double(), return_lse=True
    )
    assert lse.shape == (2, 8)
    assert_matches(out.cpu(), r_out, None, "out", dtype=F32)
    assert_matches(lse.cpu(), r_lse.T, None, "lse", dtype=F32)


def test_sdpa_with_kvcache_triton_takes_the_features():
    """sdpa_with_kvcache(backend="triton"): softcap, ALiBi (at each sequence's length), sinks and
    the logsumexp, the new keys appended."""
    import attention_dispatch as ad

    b, hq, hkv, sq, cap, d = 2, 4, 2, 2, 48, 16
    q = torch.randn(b, hq, sq, d, device=DEV)
    kc, vc = torch.randn(b, hkv, cap, d, device=DEV), torch.randn(b, hkv, cap, d, device=DEV)
    k_new, v_new = torch.randn(b, hkv, sq, d, device=DEV), torch.randn(b, hkv, sq, d, device=DEV)
    lens = torch.tensor([20, 37], dtype=torch.int32, device=DEV)
    slopes, sinks = torch.rand(hq, device=DEV) * 0.3, torch.randn(hq, device=DEV)
    out, lse = ad.sdpa_with_kvcache(
        q, kc, vc, lens, k_new=k_new, v_new=v_new, causal=True, softcap=4.0, alibi_slopes=slopes, sinks=sinks,
        return_lse=True, backend="triton",
    )  # fmt: skip
    for i in range(b):
        n = int(lens[i]) + sq
        kk, vv = (t[i : i + 1, :, :n].repeat_interleave(hq // hkv, 1).double() for t in (kc, vc))
        assert torch.equal(kc[i, :, n - sq : n], k_new[i])  # appended in place
        r_out, r_lse = naive_attention(
            q[i : i + 1].double(), kk, vv, causal="bottom_right", softcap=4.0, alibi_slopes=slopes.double(),
            sinks=sinks.double(), return_lse=True,
        )  # fmt: skip
        assert_matches(out[i : i + 1].cpu(), r_out, None, "out", dtype=F32)
        assert_matches(lse[i : i + 1].cpu(), r_lse, None, "lse", dtype=F32)
