"""DESIGN.md section 7's rule: error vs the float64 oracle at most 2x the error of the
reference run in the input dtype, plus a small absolute slack; never NaN."""

from __future__ import annotations

import torch

import attention_dispatch as ad
from attention_dispatch.kernels.tl.launch import TANH_APPROX_DTYPES

SLACK = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# the largest |tanh.approx.f32(x) - tanh(x)| over every float32 x (tests/test_tanh_approx.py measures it)
TANH_APPROX_ABS_ERR = 8.0e-6  # H100, 2026-11-27: 7.98e-6 at x = 1.21875


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over finite entries; infinities (a logsumexp of -inf) must match exactly."""
    if a.numel() == 0:
        return 0.0
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite), "non-finite pattern differs"
    assert torch.equal(a[~finite], b[~finite]), "infinite values differ"
    return (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0


def rounding_floor(ref64: torch.Tensor, dtype: torch.dtype) -> float:
    """The slack, or half an ulp of the largest reference value in ``dtype`` if that is more:
    rounding the exact result to a 16-bit dtype costs that much however it was computed, and
    the reference run in that dtype may happen to round its worst element closer (bfloat16
    gradients of magnitude ~10 missed 2x the reference's error by 4-20% on 3 of 1600 draws)."""
    finite = ref64[torch.isfinite(ref64)] if ref64.numel() else ref64
    largest = finite.abs().max().item() if finite.numel() else 0.0
    return max(SLACK[dtype], 0.5 * torch.finfo(dtype).eps * largest)


def softcap_tanh_slack(softcap: float | None, dtype: torch.dtype, device) -> float:
    """What a float32 result (the logsumexp) of a softcap call owes to tanh.approx.f32, which the GPU
    kernels take for 16-bit inputs (tl/launch.TANH_APPROX_DTYPES, the Gluon kernels, flash-attn): each
    score moves by at most softcap x its error, so a row's logsumexp (sum_j P_ij d s_ij) as much."""
    if not softcap or dtype not in TANH_APPROX_DTYPES or torch.device(device).type != "cuda":
        return 0.0
    return softcap * TANH_APPROX_ABS_ERR


def assert_matches(
    got, ref64, ref_lowp=None, what: str = "output", dtype=None, factor: float = 2.0, extra: float = 0.0
) -> float:
    """got/ref_lowp in the input dtype, ref64 in float64 (same shapes). Without ref_lowp the
    budget is the slack alone; dtype (default got's) picks the slack; ``extra`` is added to the
    budget (an error the algorithm owes to an earlier rounding: :func:`stored_output_slack`).
    Returns the error."""
    assert got is not None, f"{what}: missing (None)"
    assert got.shape == ref64.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN in result"
    err = max_err(got, ref64)
    base = max_err(ref_lowp, ref64) if ref_lowp is not None else 0.0
    budget = factor * base + rounding_floor(ref64, dtype or got.dtype) + extra
    assert err <= budget, f"{what}: max error {err:.3e} > allowed {budget:.3e}"
    return err


def stored_output_slack(out, out64, grad_out, lse64, inputs: dict) -> dict:
    """{name: max |gradient error|} that a flash-style backward owes to its stored output alone.
    It takes each row's delta_i = <dO_i, O_i> from the output it wrote (PyTorch's, flash-attn's and
    our kernels do), so that output's own error e_i = <dO_i, O_i - O64_i> moves every d score_ij by
    -P_ij e_i: the gradients move by -e_i d lse_i / d theta, however exactly the rest is computed
    (fp16 Sq=1 Sk=2 at scale 1: dq 4.9e-3 off where the fp16 autograd reference is 1e-4 off, H100).
    ``lse64``: tests/naive.py's float64 logsumexp (shaped as the output less its last axis),
    connected to the float64 leaves in ``inputs``."""
    e = (
        (out.detach().to(out64.device, torch.float64) - out64.detach()) * grad_out.to(out64.device, torch.float64)
    ).sum(-1)
    finite = torch.isfinite(lse64)
    moved = (torch.where(finite, lse64, torch.zeros_like(lse64)) * e).sum()
    if not moved.requires_grad:
        return {}
    names = list(inputs)
    grads = torch.autograd.grad(moved, [inputs[n] for n in names], allow_unused=True)
    return {n: (g.abs().max().item() if g is not None and g.numel() else 0.0) for n, g in zip(names, grads)}


def accumulation_slack(
    grad_out,
    out64,
    lse64,
    q64,
    k64,
    v64,
    key_rows,
    scale: float,
    dtype,
    heads_kv: int,
    batch: int,
    dot_abs: float = 0.0,
    grad_lse=None,
    sink_rows: float = 0.0,
) -> dict:
    """{name: bound} of the error an attention in the accumulation's precision owes to roundings whose
    size the budget's reference, run in the input dtype, may miss by luck or by its formula:
    - the scores: s_ij rounded to ~u |s_ij|, ~u |lse_i| where P matters: the output moves by ~2 u max|lse|
      times |v_j - O_i| (math float32, scale 3 at magnitude 8, scores ~300: out 1.9e-5 against an allowed
      1.05e-5, where the float32 reference's worst element happened to round closer); and the dot
      product's own rounding, ~u scale sum_d |q_id k_jd|, which is far more than u |s_ij| where the sum
      cancels: ``dot_abs`` (:func:`dot_rounding`: P-weighted, times a softcap's derivative; math float32,
      softcap 2 at scale 20 and magnitude 8, scores ~2 from products ~4e4: lse 1.46e-4 against 1.11e-4);
    - dP_ij = <dO_i, v_j> and D_i = <dO_i, O_i> rounded apart: dS_ij = P_ij (dP_ij - D_i) cancels where
      one key holds a row's softmax (Sq = Sk = 1: exactly 0 in float64 and in the reference; torch_cpu
      float32 at magnitude 8: dq 1.04e-5 against the 1e-5 floor): an error ~ u G_i a row, with
      G_i = sum_d |dO_id| (max |v| + max |O_i|) (maxima: more than a dot product's rounding reaches), plus
      |dlse_i| where the logsumexp gets a gradient (``grad_lse``: it adds P_ij dlse_i to dS_ij; math float32
      with sinks ~40 and softcap 2 at scale 20: dk 1.87e-5 against 1.83e-5, a sum of 18 terms ~160);
    - P_ij = exp(s_ij - lse_i) recomputed from the stored logsumexp: a relative error ~ 2 u |lse_i| where
      P matters (there s_ij ~ lse_i), large with large scores or a large bias (torch_cpu float32, Sk = 1,
      a bias ~100: dv 4.3e-5 against 1.0e-5).
    - a sink's gradient -sum_i p_sink_i <dO_i, O_i>: each p_sink_i = exp(sink - lse_i) off by the same relative
      error as P, each term by u more: ``sink_rows`` = max_h sum_i p_sink_i sum_d |dO_id O_id| (math float32,
      scale 20, scores ~115: dsinks 0.5465 off by 1.3e-5 against an allowed 1.0e-5).
    u: the accumulation's unit roundoff (float32 for 16-bit inputs).  With e = u + 2 u max|lse|, dS_ij is
    off by at most P_ij e G_i: dq by e G scale max|k| (sum_j P_ij <= 1; softcap's derivative <= 1), dk by
    e G scale max|q| key_rows (``key_rows``: max_j sum_i P_ij, over the kv head's query heads too), a float
    mask's gradient by e G key_rows over the heads and batch it may be broadcast across; dv_j = sum_i
    P_ij dO_i by 2 u max|lse| key_rows max|dO|."""
    if out64.numel() == 0:
        return {}
    u = torch.finfo(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype).eps / 2

    def largest(t):
        t = t.detach()
        t = t[torch.isfinite(t)]
        return t.abs().max().item() if t.numel() else 0.0

    g, o = grad_out.detach().to(out64.device, torch.float64).abs(), out64.detach().abs()
    rows = g.sum(-1) * (largest(v64) + o.amax(-1))
    if grad_lse is not None:
        rows = rows + grad_lse.detach().to(rows.device, torch.float64).abs()
    big = largest(rows)
    p_rel = 2 * u * (largest(lse64) + dot_abs)
    e = u + p_rel
    return {
        "out": p_rel * 2 * largest(v64),
        # the scores' rounding, ~u |s| with |s| ~ |lse| (math float32, scores ~3000: 2.1e-4), and the dot products'
        "lse": 4 * u * largest(lse64) + u * dot_abs,
        "dq": e * big * scale * largest(k64),
        "dk": e * big * scale * largest(q64) * key_rows,
        "dv": p_rel * key_rows * largest(g),
        "dmask": e * big * key_rows * heads_kv * max(batch, 1),
        "dsinks": (e + u) * sink_rows,
    }


def rounded_operands_slack(dot_products, grads, dv_abs, dtype) -> dict:
    """{"dq", "dk", "dv": bound} of what a 16-bit flash backward owes to operands it rounds to the input
    dtype: each dS_ij before its dq = dS K and dk = dS^T Q products, each P_ij before dV = P^T dO, and each
    query head's dK / dV before a GQA group's sum (PyTorch's CPU flash kernel, flash-attn's GQA backward and
    the GPU passes, which feed the tensor cores so). dS_ij off by u |dS_ij| moves dq_i by u scale sum_j
    |dS_ij| |k_j|, far above dq's own size where that sum cancels (torch_cpu bfloat16, Sq=1 Sk=4 d1 at
    magnitude 8: dq 0.106 off against an allowed 0.0866, scale sum_j |dS_j k_j| = 52); dk_j likewise over
    the query rows of every head sharing its kv head (which bounds its heads' roundings too); dv_j by u
    sum_i P_ij |dO_i| over those rows (torch_cpu bfloat16, GQA 3/1, Sk=1: 36 dO rows summed, dv 3.3e-2 off
    against 2.2e-2).  ``dot_products``: tests/naive.py's records of a float64 call (entry, q k^T, q_h, k, kv
    head, P); ``grads``: the call's gradients with respect to each q k^T (scale dS); ``dv_abs``: sum_i P_ij
    |dO_i| (the gradient of <out, |dO|> with respect to v).  u: the input dtype's unit roundoff (16-bit
    inputs only; float32 backwards keep these in float32)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return {}
    u = torch.finfo(dtype).eps / 2
    dq, dk_sums = 0.0, {}
    for (entry, _, q_h, k_kv, kv_head, _), g in zip(dot_products, grads):
        if g is None:
            continue
        g = g.detach().abs()
        dq = max(dq, (g @ k_kv.detach().abs()).max().item())
        key = (entry, kv_head)
        dk_sums[key] = dk_sums.get(key, 0) + g.T @ q_h.detach().abs()
    dk = max((t.max().item() for t in dk_sums.values()), default=0.0)
    dv = dv_abs.abs().max().item() if dv_abs is not None and dv_abs.numel() else 0.0
    return {"dq": u * dq, "dk": u * dk, "dv": u * dv}


def dot_rounding(dot_products, scale: float, softcap: float | None) -> float:
    """max_i sum_j P_ij c_ij scale sum_d |q_id| |k_jd|: what rounding the dot products moves a row's scores
    by, P-weighted (P over the allowed keys without sinks: a logsumexp's gradient weighs by it), where
    c_ij = 1 - tanh^2(scale q_i k_j / softcap) is a softcap's derivative (1 without one): a capped score
    near its bound hardly moves, one whose products cancel moves as much as they round.
    ``dot_products``: tests/naive.py's records of a float64 call."""
    worst = 0.0
    for _, qk, q_h, k_kv, _, p in dot_products:
        size = scale * (q_h.detach().abs() @ k_kv.detach().abs().T)
        if softcap:
            size = size * (1 - torch.tanh(scale * qk.detach() / softcap) ** 2)
        worst = max(worst, (p * size).sum(-1).max().item())
    return worst


def compare_backend(case, backend: str, keep_fn=None, device="cpu", seed=1234, requires_grad=True):
    """Run `case` through sdpa(backend=...) forward and backward and check the output and
    every gradient against tests/naive.py in float64 (and in the input dtype for the budget).

    keep_fn(case, q, k, cu_q, cu_k) -> the backend's dropout keep-mask, drawn right after
    torch.manual_seed(seed) as the backend does; needed when case.dropout_p > 0.
    Returns the Decision of the call.
    """
    from cases import leaf_copy, make_inputs
    from naive import naive_attention

    q, k, v, mask, sdpa_kw, naive_kw = make_inputs(case, device, requires_grad)
    torch.manual_seed(seed)
    out = ad.sdpa(q, k, v, attn_mask=mask, backend=backend, **sdpa_kw)
    out, lse = out if case.return_lse else (out, None)
    decision = ad.last_decision()
    assert decision.backend == backend
    keep = None
    if case.dropout_p:
        assert keep_fn is not None, "dropout case without a way to recover the keep-mask"
        torch.manual_seed(seed)
        keep = keep_fn(case, q, k, sdpa_kw.get("cu_seqlens_q"), sdpa_kw.get("cu_seqlens_k")).cpu()
    varlen = case.varlen is not None
    if lse is not None and varlen:
        lse = lse.t()  # (Hq, total_q) -> the reference's (total_q, Hq)
    grad_out = torch.randn_like(out)
    grad_lse = None if lse is None else torch.randn(lse.shape, device=lse.device, dtype=lse.dtype)
    sinks = sdpa_kw.get("sinks")
    names = ("dq", "dk", "dv", "dmask", "dsinks")
    if requires_grad:
        torch.autograd.backward(
            [out] + ([lse] if lse is not None else []), [grad_out] + ([grad_lse] if lse is not None else [])
        )
    leaves = (
        [q, k, v]
        + ([mask] if mask is not None and mask.requires_grad else [None])
        + ([sinks] if sinks is not None and sinks.requires_grad else [None])
        if requires_grad
        else []
    )
    results = {"out": out} | ({"lse": lse} if lse is not None else {})
    results.update({name: t.grad for name, t in zip(names, leaves) if t is not None})
    refs = {}
    # A bias wider than the inputs (case.mask_dtype) is an exact input: the input-dtype budget
    # is then float64's result rounded to the input dtype, so a backend rounding the bias fails.
    wide_bias = case.mask_dtype is not None and case.mask_dtype != case.dtype
    for dtype in (torch.float64, case.dtype):
        compute = torch.float64 if wide_bias else dtype
        copies = [leaf_copy(t.cpu(), compute if t.is_floating_point() else None) for t in (q, k, v)]
        m = None if mask is None else leaf_copy(mask.cpu(), compute if mask.is_floating_point() else None)
        kw = dict(naive_kw)
        s = None if sinks is None else leaf_copy(sinks.cpu(), compute)
        if s is not None:
            kw["sinks"] = s
        ref = naive_attention(*copies, mask=m, keep=keep, **kw)
        ref, ref_lse = ref if case.return_lse else (ref, None)
        if requires_grad:
            torch.autograd.backward(
                [ref] + ([ref_lse] if ref_lse is not None else []),
                [grad_out.cpu().to(compute)] + ([grad_lse.cpu().to(compute)] if ref_lse is not None else []),
            )
        ref_leaves = (
            copies
            + ([m] if m is not None and m.requires_grad else [None])
            + ([s] if s is not None and s.requires_grad else [None])
            if requires_grad
            else []
        )
        refs[dtype] = {"out": ref.to(dtype)}
        if ref_lse is not None:  # a returned logsumexp is float32 (float64 for float64 inputs)
            refs[dtype]["lse"] = ref_lse.to(torch.float64 if dtype == torch.float64 else ref_lse.dtype)
        refs[dtype].update({name: t.grad.to(dtype) for name, t in zip(names, ref_leaves) if t is not None})
    for name, got in results.items():
        assert_matches(
            got.cpu(), refs[torch.float64][name], refs[case.dtype][name], f"{backend} {case} {name}", dtype=case.dtype
        )
    return decision


def math_keep_mask(case, q, k, cu_q, cu_k):
    """The keep-mask the math backend draws after manual_seed: one seed per call, then the
    position-keyed Philox stream (dropout_stream.py), whatever the query chunking; varlen
    (sequences, Hq, max_sq, max_sk) of local positions, as the triton kernel's."""
    from attention_dispatch.dropout_stream import DropoutStream, draw_seed, keep_mask

    seed = draw_seed(q.device)
    if cu_q is None:
        b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    else:
        b = cu_q.numel() - 1
        sq = int((cu_q[1:] - cu_q[:-1]).max()) if b else 0
        sk = int((cu_k[1:] - cu_k[:-1]).max()) if b else 0
    bh = torch.arange(b * case.heads_q, device=q.device)
    stream = DropoutStream(seed, 0, 0, 0, sq, sk)
    return keep_mask(stream, case.dropout_p, bh, case.heads_q, sq, 0, sk).reshape(b, case.heads_q, sq, sk).cpu()


def triton_keep_mask(case, q, k, cu_q, cu_k):
    """The triton kernel's keep-mask, drawn as its forward draws it."""
    from attention_dispatch.kernels import dropout_keep_mask

    if cu_q is None:
        b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    else:
        b = cu_q.numel() - 1
        sq = int((cu_q[1:] - cu_q[:-1]).max()) if b else 0
        sk = int((cu_k[1:] - cu_k[:-1]).max()) if b else 0
    return dropout_keep_mask(b, case.heads_q, sq, sk, case.dropout_p, q.device)


# Backends whose dropout mask a test can recover exactly; others are checked statistically.
KEEP_MASKS = {"math": math_keep_mask, "triton": triton_keep_mask}


def check_stored_forward_backward(q, k, v, out, lse, grad_out, causal, scale, enable_gqa: bool):
    """A kernel's output, float32 logsumexp and q/k/v gradients (``out.backward(grad_out)`` already
    run) against the math backend in float64, with tests/naive.py in the input dtype as the budget
    and the stored-output slack of a flash-style backward; the lse within 1e-4 of float64's."""
    from naive import naive_attention

    pairs = (("dq", q), ("dk", k), ("dv", v))
    leaves = {n: t.detach().double().requires_grad_() for n, t in pairs}
    out64 = ad.sdpa(*leaves.values(), backend="math", causal=causal, scale=scale, enable_gqa=enable_gqa)
    out64.backward(grad_out.double())
    ref64 = {"out": out64.detach()} | {n: t.grad for n, t in leaves.items()}
    low = {n: t.detach().clone().requires_grad_() for n, t in pairs}
    out_low = naive_attention(*low.values(), causal=causal, scale=scale)
    out_low.backward(grad_out)
    ref_low = {"out": out_low.detach()} | {n: t.grad for n, t in low.items()}
    naive64 = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    o64, lse64 = naive_attention(*naive64.values(), causal=causal, scale=scale, return_lse=True)
    assert_matches(lse, lse64, what="lse", extra=1e-4)  # fp32 from exact 16-bit products: ~1e-6 off
    slack = stored_output_slack(out, o64, grad_out, lse64, naive64)
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, value in got.items():
        assert_matches(value, ref64[name], ref_low[name], what=name, extra=slack.get(name, 0.0))
