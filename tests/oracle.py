"""DESIGN.md section 7's rule: error vs the float64 oracle at most 2x the error of the
reference run in the input dtype, plus a small absolute slack; never NaN."""
from __future__ import annotations

import torch

SLACK = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_matches(got, ref64, ref_lowp, what: str, factor: float = 2.0):
    """got/ref_lowp in the input dtype, ref64 in float64 (same shapes)."""
    assert got is not None, f"{what}: missing (None)"
    assert got.shape == ref64.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN in result"
    err = max_err(got, ref64)
    budget = factor * max_err(ref_lowp, ref64) + SLACK[got.dtype]
    assert err <= budget, f"{what}: max error {err:.3e} > allowed {budget:.3e}"


def compare_backend(case, backend: str, keep_fn=None, device="cpu", seed=1234):
    """Run `case` through sdpa(backend=...) forward and backward and check the output and
    every gradient against tests/naive.py in float64 (and in the input dtype for the budget).

    keep_fn(case, q, k, cu_q, cu_k) -> the backend's dropout keep-mask, drawn right after
    torch.manual_seed(seed) as the backend does; needed when case.dropout_p > 0.
    Returns the Decision of the call.
    """
    import attention_dispatch as ad
    from cases import leaf_copy, make_inputs
    from naive import naive_attention

    q, k, v, mask, sdpa_kw, naive_kw = make_inputs(case, device)
    torch.manual_seed(seed)
    out = ad.sdpa(q, k, v, attn_mask=mask, backend=backend, **sdpa_kw)
    decision = ad.last_decision()
    assert decision.backend == backend
    keep = None
    if case.dropout_p:
        assert keep_fn is not None, "dropout case without a way to recover the keep-mask"
        torch.manual_seed(seed)
        keep = keep_fn(case, q, k, sdpa_kw.get("cu_seqlens_q"), sdpa_kw.get("cu_seqlens_k")).cpu()
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    leaves = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    results = {"out": out}
    results.update({name: t.grad for name, t in zip(("dq", "dk", "dv", "dmask"), leaves)})
    refs = {}
    for dtype in (torch.float64, case.dtype):
        copies = [leaf_copy(t.cpu(), dtype if t.is_floating_point() else None) for t in (q, k, v)]
        m = None if mask is None else leaf_copy(mask.cpu(), dtype if mask.is_floating_point() else None)
        ref = naive_attention(*copies, mask=m, keep=keep, **naive_kw)
        ref.backward(grad_out.cpu().to(dtype))
        ref_leaves = copies + ([m] if m is not None and m.requires_grad else [])
        refs[dtype] = {"out": ref}
        refs[dtype].update({name: t.grad for name, t in zip(("dq", "dk", "dv", "dmask"), ref_leaves)})
    for name, got in results.items():
        assert_matches(got.cpu(), refs[torch.float64][name], refs[case.dtype][name], f"{backend} {case} {name}")
    return decision
