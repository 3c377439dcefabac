"""Backend.run_backward(dkv_out=) (Capabilities.backward_dkv_out): dk and dv written into given
tensors, which may be the key and value themselves (context parallelism's received keys, read no
more once their last block ran: backward="merged" then allocates no dk/dv for that block).
Against the same call returning new tensors, bit for bit: a kernel pass that reads every key
tile (the separate dQ passes) must have read them before dK/dV replace them. Generated from
what the backends declare."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import registry
from attention_dispatch.backends.base import Backend
from attention_dispatch.call import normalize_call

from cases import cpu_backends_declaring

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_declared_exactly_where_run_backward_takes_dkv_out():
    for name in ad.list_backends():
        backend = registry.get_backend(name)
        own = type(backend).run_backward
        takes = own is not Backend.run_backward and "dkv_out" in inspect.signature(own).parameters
        assert backend.capabilities.backward_dkv_out == takes, name
        assert not takes or backend.capabilities.backward_from_output, name
    assert {"math", "triton"} <= {
        n for n in ad.list_backends() if registry.get_backend(n).capabilities.backward_dkv_out
    }


def _call(dtype, causal, sk=48):
    q = torch.randn(1, 4, 32, 16).to(dtype)
    k, v = torch.randn(1, 2, sk, 16).to(dtype), torch.randn(1, 2, sk, 16).to(dtype)
    causal = "bottom_right" if causal else None
    out, lse = ad.sdpa(q, k, v, enable_gqa=True, causal=causal, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    return q, k, v, causal, out, lse, dout, dlse


def _dtypes(backend):
    return (torch.float64,) if backend == "math" else (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_dkv_out"))
def test_gradients_written_over_the_keys_equal_new_ones(backend, causal):
    """dkv_out=(key, value): dq, dk, dv bit for bit those of the call returning new tensors,
    dk/dv returned as the key/value tensors themselves."""
    for dtype in _dtypes(backend):
        q, k, v, causal_arg, out, lse, dout, dlse = _call(dtype, causal)
        chosen = registry.get_backend(backend)
        call = normalize_call(q, k, v, enable_gqa=True, causal=causal_arg)
        want = chosen.run_backward(call.query, call.key, call.value, out, lse, dout, dlse, **call.options)
        k2, v2 = k.clone(), v.clone()
        call = normalize_call(q, k2, v2, enable_gqa=True, causal=causal_arg)
        got = chosen.run_backward(call.query, k2, v2, out, lse, dout, dlse, dkv_out=(k2, v2), **call.options)
        assert got[1] is k2 and got[2] is v2, dtype
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert g.isfinite().all() and torch.equal(g, w), (dtype, name)


@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_dkv_out"))
def test_gradients_written_into_separate_strided_buffers(backend):
    """dkv_out of separate memory: a row slice of longer (B, H, S, D) buffers (a key block's rows
    of a rank's received keys); the rows outside it keep their values."""
    for dtype in _dtypes(backend):
        q, k, v, causal_arg, out, lse, dout, dlse = _call(dtype, True)
        chosen = registry.get_backend(backend)
        call = normalize_call(q, k, v, enable_gqa=True, causal=causal_arg)
        args = (call.query, call.key, call.value, out, lse, dout, dlse)
        want = chosen.run_backward(*args, **call.options)
        big_k, big_v = torch.randn(1, 2, 80, 16).to(dtype), torch.randn(1, 2, 80, 16).to(dtype)
        before = big_k.clone(), big_v.clone()
        rows = slice(16, 64)
        got = chosen.run_backward(*args, dkv_out=(big_k[:, :, rows], big_v[:, :, rows]), **call.options)
        assert got[1].data_ptr() == big_k[:, :, rows].data_ptr(), dtype
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        for big, old in zip((big_k, big_v), before):
            assert torch.equal(big[:, :, :16], old[:, :, :16]) and torch.equal(big[:, :, 64:], old[:, :, 64:])


@pytest.mark.parametrize("backend", cpu_backends_declaring("backward_dkv_out"))
def test_a_wrong_dkv_out_is_refused_naming_it(backend):
    q, k, v, causal_arg, out, lse, dout, dlse = _call(torch.float64 if backend == "math" else torch.float32, False)
    chosen = registry.get_backend(backend)
    call = normalize_call(q, k, v, enable_gqa=True)
    args = (call.query, call.key, call.value, out, lse, dout, dlse)
    twice = torch.cat([call.key, call.key], dim=2)  # the key as its first rows, then more
    k_in = twice[:, :, :48]
    bad = {
        "shape": ((twice[:, :, :47], torch.zeros_like(v)), "dkv_out's dk must be"),
        "dtype": ((torch.zeros_like(k), torch.zeros_like(v, dtype=torch.float16)), "dkv_out's dv must be"),
        "overlap": ((twice[:, :, 1:49], torch.zeros_like(v)), "dkv_out's dk shares memory"),
        "not a pair": (torch.zeros_like(k), "dkv_out must be a pair"),
    }
    for what, (given, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            chosen.run_backward(call.query, k_in, *args[2:], dkv_out=given, **call.options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [None, "top_left"])
@pytest.mark.parametrize("tokens_first", [False, True])
def test_gpu_gradients_written_over_the_keys(causal, tokens_first):
    """The Gluon dK/dV (sm90) written over the K/V tiles it read (a program stores its tile after
    its only read of it), with the fused dQ (non-causal) or after the separate dQ pass (causal),
    and keys in (B, S, H, D) memory (written new, then copied over them): dk and dv bit for bit
    those of the call returning new tensors, dq to its rounding where fused (reduce-adds in any
    order), bit for bit where separate."""
    g = torch.Generator(device="cuda").manual_seed(0)
    S = 4096
    q = torch.randn(1, 8, S, 128, device="cuda", generator=g).bfloat16()
    shape = (1, S, 4, 128) if tokens_first else (1, 4, S, 128)
    k, v = (torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(2))
    if tokens_first:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    chosen = registry.get_backend("triton")
    call = normalize_call(q, k, v, enable_gqa=True, causal=causal)
    out, lse = ad.sdpa(q, k, v, enable_gqa=True, causal=causal, return_lse=True, backend="triton")
    dout = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
    want = chosen.run_backward(q, k, v, out, lse, dout, None, **call.options)
    k2, v2 = k.clone(memory_format=torch.preserve_format), v.clone(memory_format=torch.preserve_format)
    got = chosen.run_backward(q, k2, v2, out, lse, dout, None, dkv_out=(k2, v2), **call.options)
    assert got[1] is k2 and got[2] is v2
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    if causal:
        assert torch.equal(got[0], want[0])
    else:
        assert (got[0].float() - want[0].float()).abs().max().item() <= 1e-2 * want[0].float().abs().max().item()
    assert all(t.isfinite().all() for t in got)


@pytest.mark.parametrize("B,H,S", [(1, 1, 8), (1, 3, 8), (2, 2, 12)])
def test_received_key_rows_packed_in_their_own_memory_and_gradients_unpacked(B, H, S):
    """distributed.merged's last block over a part of the received keys: where _packable allows,
    _pack_rows gives exactly those rows in a contiguous view of the front of the same memory, and
    _unpack_rows puts a gradient written there back at those rows, zeros elsewhere (every part)."""
    from attention_dispatch.distributed.merged import _packable, _pack_rows, _unpack_rows

    seen = 0
    for start in range(S):
        for stop in range(start + 1, S + 1):
            keys = slice(start, stop)
            t = torch.randn(B, H, S, 4, dtype=torch.float64)
            if not _packable(t, keys):
                continue
            seen += 1
            want = t[:, :, keys].clone()
            packed = _pack_rows(t, keys)
            assert packed.is_contiguous() and packed.data_ptr() == t.data_ptr()
            assert torch.equal(packed, want)
            grad = torch.randn_like(want)
            packed.copy_(grad)
            expect = torch.zeros_like(t)
            expect[:, :, keys] = grad
            assert torch.equal(_unpack_rows(t, packed, keys), expect)
    assert seen >= S // 2  # at least the prefixes of up to half the rows
