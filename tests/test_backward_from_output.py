"""Backend.run_backward (Capabilities.backward_from_output): a block's dq, dk, dv from a larger
call's output and logsumexp. Split one call's keys into blocks: each block's run_backward with
the whole call's (out, lse) gives its share, so the blocks' dq sum to the call's and their dk, dv
are the call's key rows, against autograd through one float64 math call. Generated from what the
backends declare: every available backend declaring the capability, and only those."""

from __future__ import annotations

import sys

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import registry
from attention_dispatch.backends.base import Backend
from attention_dispatch.backends.flash_attn import FA2_CAPS, FA3_CAPS, FA4_CAPS, FlashAttnBackend
from attention_dispatch.call import normalize_call
from attention_dispatch.dropout_stream import DropoutStream, draw_seed, positioned

from cases import cpu_backends_declaring
from tests import fakes

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
        if name == "flash_attn":  # declared per generation: flash-attn 4's alone (a tested release)
            assert implemented and FA4_CAPS.backward_from_output
            assert not (FA2_CAPS.backward_from_output or FA3_CAPS.backward_from_output)
            continue
        assert backend.capabilities.backward_from_output == implemented, name
    assert {"math", "triton"} <= {
        n for n in ad.list_backends() if registry.get_backend(n).capabilities.backward_from_output
    }


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_from_output"))
def test_blocks_from_the_whole_calls_output_add_up_to_its_backward(backend, case):
    dtype = torch.float64 if backend == "math" else torch.float32
    _check_blocks(registry.get_backend(backend), CASES[case], dtype)


@pytest.fixture
def fake_fa4(monkeypatch):
    """flash_attn on the fake flash-attn 4 (tests/fakes), whose backward computes from the given
    out and lse as flash-attn 4's does."""
    modules = fakes.make_flash_attn(4, [])
    for missing in ("flash_attn", "flash_attn_interface", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, missing, raising=False)
    fakes.install(monkeypatch, modules)
    modules["flash_attn.cute.interface"].marked_lse = False
    modules["flash_attn.cute.interface"].backward_from_lse = True
    return FlashAttnBackend()


@pytest.mark.parametrize("case", [c for c, f in CASES.items() if not ({"mask", "bias", "dropout_p"} & set(f))])
def test_flash_attn_4_blocks_add_up_to_the_backward(fake_fa4, case):
    """flash_attn's run_backward (flash-attn 4's backward op with out, lse and dlse as given), on
    the fake: the blocks' shares from the whole call's output add up to its backward."""
    assert fake_fa4.capabilities.backward_from_output
    _check_blocks(fake_fa4, CASES[case], torch.float32, d=64)  # its lse is float32; its head dims


def test_flash_attn_run_backward_refuses_what_it_does_not_declare(fake_fa4):
    q = torch.randn(1, 2, 8, 64, dtype=torch.float64)
    call = normalize_call(q, q, q)
    out, lse = torch.zeros_like(q), torch.zeros(1, 2, 8)
    acc = torch.zeros_like(q)
    with pytest.raises(ValueError, match="flash_attn.run_backward: dq_accumulator given"):
        fake_fa4.run_backward(q, q, q, out, lse, out, None, dq_accumulator=acc, **call.options)


def test_untested_flash_attn_4_release_does_not_declare_it():
    from attention_dispatch.backends.flash_attn_backward import fa4_capabilities

    assert fa4_capabilities(FA4_CAPS, "4.0.0b36").backward_from_output
    caps = fa4_capabilities(FA4_CAPS, "4.9.0")
    assert not caps.backward_from_output and "no run_backward: flash-attn 4 4.9.0" in caps.notes


def _check_blocks(chosen, feature: dict, dtype, d: int = D):
    hq = HQ if feature.get("enable_gqa") else HKV
    q = torch.randn(B, hq, SQ, d, dtype=torch.float64)
    k, v = torch.randn(B, HKV, SK, d, dtype=torch.float64), torch.randn(B, HKV, SK, d, dtype=torch.float64)
    dout, dlse = torch.randn(B, hq, SQ, d, dtype=torch.float64), torch.randn(B, hq, SQ, dtype=torch.float64)
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
                chosen.run_backward(
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


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_flash_attn_4_blocks_add_up_to_the_backward(causal):
    """flash-attn 4's run_backward on the H100, bf16 d128 GQA: two key blocks of one call (its
    bottom-right causal mask: the first block unmasked, the second causal), each from the whole
    call's float64 out and lse with a dlse; their sum against float64 autograd, within twice
    flash-attn 4's own bf16 backward error of the whole call + 1e-2."""
    pytest.importorskip("flash_attn.cute")
    backend = FlashAttnBackend(versions=("fa4",))
    assert backend.capabilities.backward_from_output, backend.capabilities.notes
    b, hq, hkv, sq, sk, d = 2, 8, 2, 256, 512, 128
    gen = torch.Generator(device="cuda").manual_seed(7 + causal)
    q, dout = (torch.randn(b, hq, sq, d, device="cuda", dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.float64, generator=gen) for _ in range(2))
    dlse = torch.randn(b, hq, sq, device="cuda", dtype=torch.float64, generator=gen)
    whole = dict(enable_gqa=True, causal="bottom_right" if causal else None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ad.sdpa(*leaves, return_lse=True, backend="math", **whole)
    torch.autograd.backward((out, lse), (dout, dlse))
    want = [t.grad for t in leaves]
    own = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    own_out, own_lse = ad.sdpa(*own, return_lse=True, backend="flash_attn", **whole)
    torch.autograd.backward((own_out, own_lse), (dout.to(torch.bfloat16), dlse.float()))
    blocks = []
    for c0, c1, block_causal in ((0, 256, None), (256, 512, "bottom_right" if causal else None)):
        bf = [t.to(torch.bfloat16) for t in (q, k[:, :, c0:c1], v[:, :, c0:c1])]
        call = normalize_call(*bf, enable_gqa=True, causal=block_causal)
        blocks.append(
            backend.run_backward(
                call.query,
                call.key,
                call.value,
                out.detach().to(torch.bfloat16),
                lse.detach().float(),
                dout.to(torch.bfloat16),
                dlse.float(),
                **call.options,
            )  # fmt: skip
        )
    got = [
        sum(x[0].double() for x in blocks),
        torch.cat([x[1] for x in blocks], 2),
        torch.cat([x[2] for x in blocks], 2),
    ]
    for name, g, w, o in zip("qkv", got, want, [t.grad for t in own]):
        err, base = (g.double() - w).abs().max().item(), (o.double() - w).abs().max().item()
        assert g.isfinite().all() and err <= 2 * base + 1e-2, (name, err, base)
