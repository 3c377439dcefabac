"""The backward at padded head dims > 256 in 16-bit dtypes (configs.wide_backward, E108): dV and
dK in two launches of the tl dK/dV kernel (configs.SPLIT_KINDS) where the table has entries for
them, dP computed apart from the other products' warp layout (DP_IN_BRANCH).  Gradients against
tests/naive.py in float64 (tests/oracle.py's rule) under TRITON_INTERPRET=1, the launches each
call makes and dK/dV written over the keys they read; on the GPU (bf16) test_head_dim_512's cases
assert the split launches."""

import dataclasses

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import registry
from attention_dispatch.call import normalize_call
from attention_dispatch.kernels import configs as C
from cases import Case
from launch_watch import watch_kinds
from oracle import compare_backend, triton_keep_mask
from test_head_dim_512 import CPU_CASES as HEAD_DIM_512_CASES

SM90, SM80 = ((9, 0), 227 * 1024), ((8, 0), 163 * 1024)

# (label, case): test_head_dim_512's float32 shapes in half precision (fp16 and bf16 in turn), and two
# feature mixes of their own; tiny shapes that cross several of the interpreter's 16/32-row tiles
HALF = (torch.float16, torch.bfloat16)
CPU_CASES = [
    *(
        (f"{label} {str(dtype).removeprefix('torch.')}", dataclasses.replace(case, dtype=dtype))
        for (label, case), dtype in zip(HEAD_DIM_512_CASES, HALF * len(HEAD_DIM_512_CASES))
    ),
    (
        "d512 fp16 dropout softcap",
        Case(
            batch=1,
            heads_q=2,
            heads_kv=1,
            seqlen_q=24,
            seqlen_k=40,
            head_dim=512,
            dtype=torch.float16,
            dropout_p=0.25,
            softcap=20.0,
        ),
    ),
    (
        "d512 bf16 varlen alibi sinks",
        Case(
            batch=2,
            heads_q=2,
            heads_kv=2,
            head_dim=512,
            dtype=torch.bfloat16,
            varlen=(21, 34),
            extra_k=(5, 0),
            causal="bottom_right",
            alibi="heads",
            sinks="grad",
        ),
    ),
]


@pytest.mark.parametrize("label,case", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_split_dkdv_passes_match_the_oracle(label, case, monkeypatch):
    seen = watch_kinds(monkeypatch)
    compare_backend(case, "triton", keep_fn=triton_keep_mask if case.dropout_p else None)
    assert [k for k in seen if k != C.FWD] == [C.BWD_DV, C.BWD_DK, C.BWD_DQ], seen


def test_float32_and_narrow_head_dims_keep_one_dkdv_pass(monkeypatch):
    seen = watch_kinds(monkeypatch)
    for case in (
        Case(batch=1, heads_q=2, heads_kv=2, seqlen_q=20, seqlen_k=20, head_dim=512),  # float32
        Case(batch=1, heads_q=2, heads_kv=2, seqlen_q=20, seqlen_k=20, head_dim=256, dtype=torch.bfloat16),
    ):
        seen.clear()
        compare_backend(case, "triton")
        assert [k for k in seen if k != C.FWD] == [C.BWD_DKDV, C.BWD_DQ], (case, seen)


def test_split_gradients_written_over_the_keys_equal_new_ones():
    """dkv_out=(key, value) in float16 (stored as is by the interpreter): the dV pass writes a
    buffer, not the values the dK pass reads after it; bit for bit the call returning new tensors."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 24, 512).half()
    k, v = torch.randn(1, 2, 36, 512).half(), torch.randn(1, 2, 36, 512).half()
    chosen = registry.get_backend("triton")
    out, lse = ad.sdpa(q, k, v, is_causal=True, return_lse=True, backend="triton")
    dout = torch.randn_like(out)
    call = normalize_call(q, k, v, is_causal=True)
    want = chosen.run_backward(call.query, call.key, call.value, out, lse, dout, None, **call.options)
    k2, v2 = k.clone(), v.clone()
    call = normalize_call(q, k2, v2, is_causal=True)
    got = chosen.run_backward(call.query, k2, v2, out, lse, dout, None, dkv_out=(k2, v2), **call.options)
    assert got[1] is k2 and got[2] is v2
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.isfinite().all() and torch.equal(g, w), name


@pytest.mark.parametrize("dims", [(512, 512), (320, 512), (512, 256), (257, 257)])
def test_split_kinds_have_fitting_sm90_entries_and_none_elsewhere(dims):
    """sm90 16-bit: both passes have candidates that fit its shared memory, 64 keys over 8 warps
    first; sm80 has none (one dK/dV pass there); wide_backward is 16-bit past 256 only."""
    bdq, bdv = C.block_d(dims[0]), C.block_d(dims[1])
    for dtype in (torch.bfloat16, torch.float16):
        assert C.wide_backward(bdq, bdv, dtype)
        for kind in C.SPLIT_KINDS:
            cands = C.candidate_configs(kind, *dims, dtype, *SM90)
            assert cands and all(C.shared_memory_estimate(kind, c, bdq, bdv, 2) <= SM90[1] for c in cands)
            assert cands[0][1:3] == (64, 8), (kind, cands[0])
            assert not C.candidate_configs(kind, *dims, dtype, *SM80)
    assert not C.wide_backward(bdq, bdv, torch.float32)
    assert not C.wide_backward(256, 128, torch.bfloat16)
