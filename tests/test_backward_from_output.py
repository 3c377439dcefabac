"""Backend.run_backward (Capabilities.backward_from_output): a block's dq, dk, dv from a larger
call's output and logsumexp. Split one call's keys into blocks: each block's run_backward with
the whole call's (out, lse) gives its share, so the blocks' dq sum to the call's and their dk, dv
are the call's key rows, against autograd through one float64 math call. Generated from what the
backends declare: every available backend declaring the capability, and only those."""

from __future__ import annotations

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import registry
from attention_dispatch.backends.base import Backend
from attention_dispatch.call import normalize_call
from attention_dispatch.dropout_stream import DropoutStream, draw_seed, positioned

from cases import cpu_backends_declaring

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 12, 24, 16
CUTS = (0, 8, 24)  # two key blocks; column offsets multiples of 4 (the triton kernels' dropout draw)
CASES = {
    "plain": {},
    "gqa_softcap_grad_lse": {"enable_gqa": True, "softcap": 2.0, "grad_lse": True},
    "bool_mask_bias": {"mask": True, "bias": True},
    "dropout": {"dropout_p": 0.3, "grad_lse": True},
}


def test_declared_exactly_where_run_backward_is_implemented():
    for name in ad.list_backends():
        backend = registry.get_backend(name)
        implemented = type(backend).run_backward is not Backend.run_backward
        assert backend.capabilities.backward_from_output == implemented, name
    assert {"math", "triton"} <= {
        n for n in ad.list_backends() if registry.get_backend(n).capabilities.backward_from_output
    }


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_from_output"))
def test_blocks_from_the_whole_calls_output_add_up_to_its_backward(backend, case):
    feature = CASES[case]
    dtype = torch.float64 if backend == "math" else torch.float32
    hq = HQ if feature.get("enable_gqa") else HKV
    q = torch.randn(B, hq, SQ, D, dtype=torch.float64)
    k, v = torch.randn(B, HKV, SK, D, dtype=torch.float64), torch.randn(B, HKV, SK, D, dtype=torch.float64)
    dout, dlse = torch.randn(B, hq, SQ, D, dtype=torch.float64), torch.randn(B, hq, SQ, dtype=torch.float64)
    mask = None
    if feature.get("bias"):
        mask = torch.randn(B, 1, SQ, SK, dtype=torch.float64)
    if feature.get("mask"):
        allowed = torch.rand(1, hq, SQ, SK) > 0.3
        allowed[..., 0] = True  # no empty row
        mask = allowed if mask is None else mask.masked_fill(~allowed, float("-inf"))
    options = {n: feature[n] for n in ("enable_gqa", "softcap", "dropout_p") if n in feature}
    seed = draw_seed("cpu")

    def stream(c0):  # the whole call's keep-mask at the block's columns
        return positioned(DropoutStream(seed, 0, 0, c0, SQ, SK))

    # the whole call, float64 math: its output, logsumexp and gradients
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with stream(0):
        out, lse = ad.sdpa(*leaves, mask, return_lse=True, backend="math", **options)
    grad_lse = dlse if feature.get("grad_lse") else None
    torch.autograd.backward((out, lse), (dout, torch.zeros_like(dlse) if grad_lse is None else grad_lse))
    want = [t.grad for t in leaves]

    blocks = []
    for c0, c1 in zip(CUTS, CUTS[1:]):
        cols = mask if mask is None else mask[..., c0:c1]
        cols = cols.to(dtype) if cols is not None and cols.is_floating_point() else cols
        with stream(c0):
            call = normalize_call(q.to(dtype), k[:, :, c0:c1].to(dtype), v[:, :, c0:c1].to(dtype), cols, **options)
            blocks.append(
                registry.get_backend(backend).run_backward(
                    call.query,
                    call.key,
                    call.value,
                    out.detach().to(dtype),
                    lse.detach().to(torch.float64 if dtype == torch.float64 else torch.float32),
                    dout.to(dtype),
                    None if grad_lse is None else grad_lse.to(dtype),
                    **call.options,
                )
            )
    got = [sum(b[0] for b in blocks), torch.cat([b[1] for b in blocks], 2), torch.cat([b[2] for b in blocks], 2)]
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    for name, g, w in zip("qkv", got, want):
        assert g.isfinite().all(), name
        assert (g.double() - w).abs().max() <= tolerance * max(1.0, w.abs().max().item()), name


@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_from_output"))
def test_run_backward_refuses_what_it_does_not_compute(backend):
    q = torch.randn(1, 2, 4, 8)
    call = normalize_call(q, q, q, sinks=torch.zeros(2))
    out, lse = torch.zeros_like(q), torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="run_backward: sinks given"):
        registry.get_backend(backend).run_backward(q, q, q, out, lse, out, None, **call.options)
