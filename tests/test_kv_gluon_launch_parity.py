"""Chunked prefill over a dense cache on Hopper (issue 34, benchmarks/decode.py "Sq=512 8k causal"):
what each entry point launches, on a faked sm90 with kernels.run.launch_one watched.
kernels.decode.kv_forward, every sdpa_with_kvcache() call of the signature (the full path, the
CacheRunner's capture, its hits) and plain sdpa() over the cache's keys launch one Gluon forward
each, with the same grid, tiles, LPT order and scalars, and allocate only the output: the
dispatcher adds no device work.  Plain sdpa() launches the same kernel with lengths 0 (the package's
constant zeros, static_buffers) and n_new = Sk where the KV-cache call reads cache_seqlens and 0."""

from __future__ import annotations

import pytest
import torch
import triton

import attention_dispatch as ad
from attention_dispatch.kernels import KernelParams, decode, entry, run
from attention_dispatch.kernels.compiled_cache import is_descriptor
from attention_dispatch.kernels.gluon import launch as gluon_launch
from attention_dispatch.kernels.gluon import route as gluon_route
from attention_dispatch.kernels.static_buffers import int32_zeros, is_static
from test_kv_hit_work import _AtenOps

B, HQ, HKV, SQ, S, D = 2, 8, 2, 128, 384, 128


def _as_sm90(monkeypatch) -> list:
    """Routes as on an H100 with the Triton the Gluon kernels are written for (the KV-cache route's
    CUDA-only check passed); returns the list every launch is appended to, none run."""
    if gluon_launch.GLUON_IMPORT_ERROR is not None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(gluon_route, "GLUON_TRITON_VERSIONS", (triton.__version__,))
    monkeypatch.setattr(gluon_route, "device_info", lambda dev: ((9, 0), 232448, 132))
    monkeypatch.setattr(gluon_route, "WS_MIN_WORK", 0)
    monkeypatch.setattr(gluon_route, "cache_forward_reason", lambda *a: None)
    monkeypatch.setattr(gluon_launch, "l2_bytes", lambda dev: 50 << 20)  # lpt_rows as on the H100
    monkeypatch.setattr(entry, "use_descriptors", lambda *a, **kw: True)
    monkeypatch.setattr(entry, "store_dtype", lambda dtype: dtype)  # the interpreter's fp32 store: no launch here
    launches = []
    monkeypatch.setattr(
        run, "launch_one", lambda kernel, grid, args, cx, *rest, **kw: launches.append((kernel, grid, args, cx))
    )
    return launches


def _launch(launch, lens=None):
    """A launch as comparable values: descriptors by everything but their base (the output is new
    per call), the lengths tensor by identity, the package's constant buffers and the output's
    other uses (stand-ins) by name."""
    kernel, grid, args, constexprs = launch
    out = args[3].base  # the output's descriptor (gluon/launch.forward)
    shown = []
    for a in args:
        if is_descriptor(a):
            shown.append(("desc", a.base is out or a.base.data_ptr(), tuple(a.shape), tuple(a.block_shape)))
        elif isinstance(a, torch.Tensor):
            shown.append("lens" if a is lens else "out" if a is out else "static" if is_static(a) else a.data_ptr())
        else:
            shown.append(a)
    return kernel, grid, tuple(shown), constexprs


def test_kv_forward_a_kvcache_hit_and_plain_sdpa_launch_one_gluon_forward_alike(monkeypatch):
    launches = _as_sm90(monkeypatch)
    q = torch.randn(B, HQ, SQ, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, S, D, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), S, dtype=torch.int32)
    params = KernelParams(scale=D**-0.5, window_right=0, align_bottom_right=True)
    int32_zeros(q.device, B)  # plain sdpa()'s lengths, made once per device: here before the calls

    def calls(fn, n):
        seen = []
        for _ in range(n):
            launches.clear()
            with _AtenOps() as ops:
                fn()
            seen.append(([_launch(x, lens) for x in launches], ops.ops))
        return seen

    with torch.no_grad():
        (direct, direct_ops), *_ = calls(lambda: decode.kv_forward(q, k, v, lens, params, None), 1)
        kv = calls(lambda: ad.sdpa_with_kvcache(q, k, v, lens, causal=True, backend="triton"), 3)
        dense = calls(lambda: ad.sdpa(q, k, v, causal="bottom_right", enable_gqa=True, backend="triton"), 2)
    assert len(direct) == 1 and direct[0][0] is gluon_launch.KERNELS["fwd_ws"], direct
    assert direct[0][3]["KV_LENS"] == gluon_launch.LENS_TENSOR
    assert direct_ops == ["aten.empty.memory_format"], direct_ops
    for i, (got, ops) in enumerate(kv):  # the full path, the CacheRunner's capture, a hit
        assert got == direct, f"sdpa_with_kvcache call {i} launched {got}, kv_forward {direct}"
        assert ops == direct_ops, f"sdpa_with_kvcache call {i} ran {ops}"
    # plain sdpa() over the same keys: the same launch with lengths 0 (the constant zeros) and n_new = S
    (kernel, grid, args, constexprs) = direct[0]
    at = args.index("lens")
    assert args[at + 1] == 0  # the KV-cache call's n_new
    zeros_and_s = (kernel, grid, args[:at] + ("static", S) + args[at + 2 :], constexprs)
    for got, ops in dense:
        assert got == [zeros_and_s], got
        # the output and an empty dropout seed, nothing else: no per-call lengths to fill
        assert ops == ["aten.empty.memory_format"] * 2, ops
