"""Second derivatives (create_graph=True) are right or refused, never silently missing terms.

A backward that computes its gradients with kernels records no graph: autograd would then treat
the gradient as a constant and a gradient penalty built on it would lose every term through q, k
and v without a word. PyTorch's own attention kernels raise there; so must ours and every adapter.
Generated from the declarations: for each backend and each single-feature claim of it, a backend
declaring ``second_derivatives`` matches tests/naive.py's float64 second derivatives, any other
backend raises. Forward-mode AD (dual tensors) likewise: the tangent right, or the backend refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import attention_dispatch as ad
from attention_dispatch.api import normalize_call
from attention_dispatch.distributed.merge import merge_blocks
from cases import leaf_copy, make_inputs
from naive import naive_attention
from oracle import KEEP_MASKS, assert_matches
from test_capabilities import _available, claimed_cases

# what a refusal says: ours (higher_order.refuse_create_graph), PyTorch's kernels' and a once-differentiable
# Function's
REFUSED = r"create_graph=True|is not implemented|differentiate twice"


def _second_order_claims(device: str):
    if device == "cuda" and not torch.cuda.is_available():
        return
    for backend in _available(device):
        caps = ad.get_backend(backend).capabilities
        for label, case, single in claimed_cases(caps, big=device == "cuda"):
            if single:
                if caps.second_derivatives and torch.float64 in caps.dtypes:
                    case = dataclasses.replace(case, dtype=torch.float64)
                yield pytest.param(backend, case, id=f"{backend}: {label}")


def _leaves(q, k, v, mask, sinks) -> dict:
    """The call's leaves that require grad, by name."""
    named = dict(q=q, k=k, v=v, mask=mask, sinks=sinks)
    return {name: t for name, t in named.items() if t is not None and t.requires_grad}


def _outputs(result, case):
    """The call's differentiable outputs, the varlen logsumexp as (total_q, Hq) like the reference's."""
    if not case.return_lse:
        return [result]
    out, lse = result
    return [out, lse.t() if case.varlen is not None else lse]


def check_second_derivatives(backend: str, case, device="cpu", seed=1234):
    """grad(out, leaves, create_graph=True), then the gradient of those gradients along random
    directions: against tests/naive.py's in float64 when ``backend`` declares second_derivatives,
    else the first or the second step must raise."""
    q, k, v, mask, kw, naive_kw = make_inputs(case, device, requires_grad=True)
    reasons = ad.get_backend(backend).reasons(normalize_call(q, k, v, mask, **kw).problem)
    if reasons:  # a claim for the forward only (test_capabilities checks it): no backward to differentiate
        pytest.skip(f"{backend} has no backward for {case}: {reasons}")
    torch.manual_seed(seed)
    outs = _outputs(ad.sdpa(q, k, v, attn_mask=mask, backend=backend, **kw), case)
    assert ad.last_decision().backend == backend
    named = _leaves(q, k, v, mask, kw.get("sinks"))
    leaves = list(named.values())
    cotangents = [torch.randn_like(o) for o in outs]
    if not ad.get_backend(backend).capabilities.second_derivatives:
        with pytest.raises(RuntimeError, match=REFUSED):
            firsts = torch.autograd.grad(outs, leaves, cotangents, create_graph=True, allow_unused=True)
            pairs = [(f, torch.randn_like(f)) for f in firsts if f is not None]
            torch.autograd.grad([f for f, _ in pairs], leaves, [d for _, d in pairs], allow_unused=True)
        return
    firsts = torch.autograd.grad(outs, leaves, cotangents, create_graph=True, materialize_grads=True)
    directions = [torch.randn_like(f) for f in firsts]
    got = torch.autograd.grad(firsts, leaves, directions, materialize_grads=True)

    keep = None
    if case.dropout_p:
        torch.manual_seed(seed)
        keep = KEEP_MASKS[backend](case, q, k, kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")).cpu()
    # float64 copies: the leaves as new leaves, the rest as constants (a bool mask as it is)
    ref = {
        name: leaf_copy(t.cpu(), torch.float64)
        if name in named
        else (t.detach().cpu().double() if t.is_floating_point() else t.cpu())
        for name, t in (dict(mask=mask, sinks=naive_kw.get("sinks")) | named).items()
        if t is not None
    }
    if "sinks" in ref:
        naive_kw["sinks"] = ref["sinks"]
    ref_outs = _outputs(
        naive_attention(ref["q"], ref["k"], ref["v"], mask=ref.get("mask"), keep=keep, **naive_kw), case
    )
    ref_leaves = [ref[name] for name in named]
    ref_firsts = torch.autograd.grad(
        ref_outs, ref_leaves, [c.cpu().double() for c in cotangents], create_graph=True, materialize_grads=True
    )
    want = torch.autograd.grad(ref_firsts, ref_leaves, [d.cpu().double() for d in directions], materialize_grads=True)
    for name, a, b in zip(named, got, want):
        assert_matches(a.cpu(), b, what=f"{backend} {case} second derivative of {name}")


@pytest.mark.parametrize("backend,case", list(_second_order_claims("cpu")))
def test_second_derivatives_are_right_or_refused_on_cpu(backend, case):
    check_second_derivatives(backend, case)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,case", list(_second_order_claims("cuda")))
def test_second_derivatives_are_right_or_refused_on_gpu(backend, case):
    check_second_derivatives(backend, case, device="cuda")


def test_the_triton_backend_refuses_with_a_reason_naming_math():
    if "triton" not in _available("cpu"):
        pytest.skip("the triton backend runs on the CPU only under TRITON_INTERPRET=1")
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    out = ad.sdpa(q, k, v, backend="triton")
    with pytest.raises(RuntimeError, match="create_graph=True.*backend='math'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    (g,) = torch.autograd.grad(ad.sdpa(q, k, v, backend="triton").sum(), q)  # a plain backward still runs
    assert not g.requires_grad


def test_the_context_parallel_merge_refuses_a_gradient_of_its_gradient():
    outs = [torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(2)]
    lses = [torch.randn(1, 2, 3, requires_grad=True) for _ in range(2)]
    out, _ = merge_blocks([(0, outs[0], lses[0]), (3, outs[1], lses[1])], 6)
    with pytest.raises(RuntimeError, match="the context-parallel merge: gradients of gradients"):
        torch.autograd.grad(out.sum(), outs[0], create_graph=True)


class _GraphFreeFunction(torch.autograd.Function):
    """A library's Function whose backward builds no graph and does not refuse (flash-attn's)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.detach() ** 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return (2 * x.detach() * grad).detach()


def test_the_hook_refuses_create_graph_through_a_graph_free_function():
    from attention_dispatch.higher_order import refuse_create_graph_through

    x = torch.randn(3, requires_grad=True)
    y = _GraphFreeFunction.apply(x).transpose(0, 0)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)  # unguarded: a gradient without its graph
    assert not g.requires_grad
    y = _GraphFreeFunction.apply(x).transpose(0, 0)
    refuse_create_graph_through("a library's attention", y, None)
    with pytest.raises(RuntimeError, match="a library's attention: gradients of gradients"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    y = _GraphFreeFunction.apply(x).transpose(0, 0)
    refuse_create_graph_through("a library's attention", y)
    (g,) = torch.autograd.grad(y.sum(), x)  # a plain backward passes the hook
    torch.testing.assert_close(g, 2 * x.detach())


# ---- forward-mode AD (dual tensors) ---------------------------------------------------------------------
def _forward_claims():
    for backend in _available("cpu"):
        caps = ad.get_backend(backend).capabilities
        for label, case, single in claimed_cases(caps):
            if single and not case.dropout_p:
                if caps.forward_ad and torch.float64 in caps.dtypes:
                    case = dataclasses.replace(case, dtype=torch.float64)
                yield pytest.param(backend, case, id=f"{backend}: {label}")


@pytest.mark.parametrize("backend,case", list(_forward_claims()))
def test_forward_mode_ad_is_right_or_refused(backend, case):
    """A dual query, key and value (and float mask): a backend declaring forward_ad gives the output's
    tangent (tests/naive.py's in float64), any other is refused before it runs, never an output whose
    tangent is silently zero (a kernel's output carries none)."""
    q, k, v, mask, kw, naive_kw = make_inputs(case, requires_grad=False)
    floats = dict(q=q, k=k, v=v) | ({"mask": mask} if mask is not None and mask.is_floating_point() else {})
    tangents = {name: torch.randn_like(t) for name, t in floats.items()}
    with fwAD.dual_level():
        dual = {name: fwAD.make_dual(t, tangents[name]) for name, t in floats.items()}
        args = (dual["q"], dual["k"], dual["v"])
        if not ad.get_backend(backend).capabilities.forward_ad:
            with pytest.raises(ad.NoBackendError, match="forward-mode AD"):
                ad.sdpa(*args, attn_mask=dual.get("mask", mask), backend=backend, **kw)
            return
        result = ad.sdpa(*args, attn_mask=dual.get("mask", mask), backend=backend, **kw)
        got = [fwAD.unpack_dual(t).tangent for t in _outputs(result, case)]
    assert ad.last_decision().backend == backend
    ref_mask = None if mask is None else (mask if not mask.is_floating_point() else mask.double())
    with fwAD.dual_level():
        d = {name: fwAD.make_dual(t.double(), tangents[name].double()) for name, t in floats.items()}
        kw64 = dict(naive_kw)
        if "sinks" in kw64:
            kw64["sinks"] = kw64["sinks"].detach().double()
        ref = naive_attention(d["q"], d["k"], d["v"], mask=d.get("mask", ref_mask), **kw64)
        want = [fwAD.unpack_dual(t).tangent for t in _outputs(ref, case)]
    for name, a, b in zip(("out", "lse"), got, want):
        assert a is not None, f"{backend} {case}: the {name} carries no tangent"
        assert_matches(a, b, what=f"{backend} {case} tangent of {name}")


def test_a_dual_call_is_not_served_from_the_fast_paths():
    """sdpa()'s fast paths remember a plain call's backend: the same signature with dual tensors must be
    decided again (a kernel backend refused), and a plain call after it served as before."""
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    for _ in range(3):  # the decision, then its prepared runner, then the recent signature
        plain = ad.sdpa(q, k, v)
    fast = ad.last_decision().backend
    t = torch.randn_like(q)
    for _ in range(2):
        with fwAD.dual_level():
            out = ad.sdpa(fwAD.make_dual(q, t), k, v)
            tangent = fwAD.unpack_dual(out).tangent
        assert ad.get_backend(ad.last_decision().backend).capabilities.forward_ad
        assert tangent is not None
        torch.testing.assert_close(out, plain)
    ad.sdpa(q, k, v)
    assert ad.last_decision().backend == fast


@pytest.mark.parametrize("backend", [b for b in _available("cpu") if ad.get_backend(b).capabilities.kv_cache])
def test_sdpa_with_kvcache_is_forward_only_in_forward_mode_ad_too(backend):
    """Forward only: dual inputs give the primals' output with no tangent on every backend alike (the math
    reference's torch ops would otherwise carry one and the kernels none)."""
    q = torch.randn(2, 4, 3, 16)
    k_cache, v_cache = torch.randn(2, 2, 32, 16), torch.randn(2, 2, 32, 16)
    k_new, v_new = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    caches = (k_cache.clone(), v_cache.clone())
    want = ad.sdpa_with_kvcache(q, *caches, lengths, k_new=k_new, v_new=v_new, causal=True, backend=backend)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(t, torch.randn_like(t)) for t in (q, k_new, v_new)]
        out = ad.sdpa_with_kvcache(
            duals[0], k_cache, v_cache, lengths, k_new=duals[1], v_new=duals[2], causal=True, backend=backend
        )
        assert fwAD.unpack_dual(out).tangent is None
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close((k_cache, v_cache), caches, rtol=0, atol=0)  # the same appended keys


# ---- torch.func transforms -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,case", list(_forward_claims()))
def test_torch_func_transforms_are_right_or_refused(backend, case):
    """torch.func.vmap over a stack of queries and torch.func.grad of a scalar of the output: a backend
    declaring func_transforms gives tests/naive.py's float64 results, any other is refused before it runs
    (its kernels would fail reading a wrapper's data pointer)."""
    q, k, v, mask, kw, naive_kw = make_inputs(case, requires_grad=False)
    queries = torch.stack([q, torch.randn_like(q)])
    weights = torch.randn(_outputs(ad.sdpa(q, k, v, attn_mask=mask, backend="math", **kw), case)[0].shape)

    def attend(x, fn, **options):
        return _outputs(fn(x, k, v, attn_mask=mask, **options), case)[0]

    def scalar(x, fn, **options):
        return (attend(x, fn, **options) * weights.to(x.dtype)).sum()

    if not ad.get_backend(backend).capabilities.func_transforms:
        with pytest.raises(ad.NoBackendError, match="torch.func"):
            torch.func.vmap(lambda x: attend(x, ad.sdpa, backend=backend, **kw))(queries)
        return
    got_vmap = torch.func.vmap(lambda x: attend(x, ad.sdpa, backend=backend, **kw))(queries)
    got_grad = torch.func.grad(lambda x: scalar(x, ad.sdpa, backend=backend, **kw))(q)
    assert ad.last_decision().backend == backend
    kw64 = dict(naive_kw)
    if "sinks" in kw64:
        kw64["sinks"] = kw64["sinks"].detach().double()
    ref_mask = None if mask is None else (mask.double() if mask.is_floating_point() else mask)
    k, v, mask = k.double(), v.double(), ref_mask

    def naive(x, k, v, attn_mask):
        return naive_attention(x, k, v, mask=attn_mask, **kw64)

    want_vmap = torch.stack([attend(x.double(), naive) for x in queries])
    x64 = q.double().requires_grad_()
    (want_grad,) = torch.autograd.grad(scalar(x64, naive), x64)
    assert_matches(got_vmap, want_vmap, what=f"{backend} {case} under vmap")
    assert_matches(got_grad, want_grad, what=f"{backend} {case} under grad")


def test_sdpa_with_kvcache_under_torch_func_says_why():
    """vmap or grad over sdpa_with_kvcache (forward only, in-place cache writes) is refused by name, also after
    its fast paths remember the signature (they read data pointers, which torch.func's tensors lack)."""
    k_cache, v_cache = torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    queries = torch.randn(3, 2, 4, 1, 8)
    for _ in range(3):
        ad.sdpa_with_kvcache(queries[0], k_cache, v_cache, lengths)
    with pytest.raises(TypeError, match="query is a tensor of a torch.func transform"):
        torch.func.vmap(lambda q: ad.sdpa_with_kvcache(q, k_cache, v_cache, lengths))(queries)
    with pytest.raises(TypeError, match="query is a tensor of a torch.func transform"):
        torch.func.grad(lambda q: ad.sdpa_with_kvcache(q, k_cache, v_cache, lengths).sum())(queries[0])
