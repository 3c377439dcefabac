"""The numerics guard's one-kernel check (issue 38: policy/guard_triton.py): the same payload as
guard_rows' torch measurement for the same picks, wrong entries caught through it, and the
calls it leaves to the torch path.  CPU: under TRITON_INTERPRET=1 (tests/conftest.py)."""

import pytest
import torch

from attention_dispatch.api import normalize_call
from attention_dispatch.backends.math import math_attention
from attention_dispatch.policy import guard, guard_graph, guard_rows, guard_triton

from cases import Case, make_inputs
from test_guard_sample import DeviceOps

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16 = torch.bfloat16, torch.float16

KERNEL_CASES = [
    Case(causal="bottom_right", dtype=BF16, seqlen_q=64, seqlen_k=64, head_dim=128),  # benchmarks/guard_overhead.py's
    Case(causal="bottom_right", dtype=FP16, seqlen_q=9, seqlen_k=40, heads_q=4, heads_kv=2),
    Case(causal="top_left", dtype=BF16, seqlen_q=40, seqlen_k=9, head_dim=16, head_dim_v=24),
    Case(window=(3, 2), dtype=BF16, seqlen_q=20, seqlen_k=33, head_dim=40),
    Case(window=(1, 0), causal="bottom_right", dtype=FP16, seqlen_q=12, seqlen_k=3),  # rows without keys
]


def _call(case, strided=False):
    q, k, v, mask, sdpa_kw, _ = make_inputs(case, device=DEVICE, requires_grad=False)
    if strided:  # the same values, other strides: the kernel reads through them
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    call = normalize_call(q, k, v, mask, **sdpa_kw)
    out = math_attention(call.query, call.key, call.value, **call.options)
    return call, out


def _both(call, out, rows=8):
    """(the kernel's payload, the torch measurement's) for the same random picks."""
    args = (call.query, call.key, call.value, call.options)
    columns = guard._columns(call.query, call.key, call.options, rows)
    kernel = guard_triton.payload(*args, out, columns)
    picks = guard_rows.index_tensor(columns, call.query.device)
    found = guard_rows._gather_dense(call.problem, picks, call.query, call.key, call.value, call.options, out)
    stats = guard_rows.measure([found], call.options["scale"], None, call.query.dtype, False)
    return kernel, torch.cat([stats, picks[:3].flatten()])


# keys split across programs (guard_triton.BLOCK_N forced small below): blocks the band leaves
# without keys, a last block cut short
SPLIT_CASES = [
    Case(causal="bottom_right", dtype=BF16, seqlen_q=8, seqlen_k=300, head_dim=64),
    Case(window=(40, 7), dtype=FP16, seqlen_q=30, seqlen_k=301, heads_q=4, heads_kv=2, head_dim=24),
    Case(dtype=BF16, seqlen_q=4, seqlen_k=700, head_dim=16, head_dim_v=40),
]


@pytest.fixture
def small_splits(monkeypatch):
    monkeypatch.setattr(guard_triton, "BLOCK_N", 16)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_the_kernel_measures_what_the_torch_path_measures(case, strided):
    _same_as_the_torch_path(case, strided)


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_keys_split_across_programs_measure_what_the_torch_path_measures(case, small_splits):
    assert case.seqlen_k / guard_triton.block_n(case.head_dim, case.head_dim_v or case.head_dim) > 18
    _same_as_the_torch_path(case, False)


def _same_as_the_torch_path(case, strided):
    call, out = _call(case, strided)
    assert guard_triton.supported(call.query, call.key, call.value, call.options, out, None, None)
    kernel, torch_path = _both(call, out)
    assert torch.equal(kernel[2:], torch_path[2:])  # the same rows
    # the error against float64 alike; the base (the input dtype's steps) is a max over roundings that
    # another float32 summation order moves entry by entry: within the rule's factor 2 either way
    torch.testing.assert_close(kernel[0], torch_path[0], rtol=1e-6, atol=1e-12)
    base, torch_base = kernel[1].item(), torch_path[1].item()
    assert torch_base / 2 - 1e-7 <= base <= 2 * torch_base + 1e-7, (base, torch_base)
    assert guard._read(kernel.tolist(), case.dtype, 2.0, False) is None


@pytest.mark.parametrize("case", [KERNEL_CASES[0], KERNEL_CASES[3], SPLIT_CASES[1]], ids=str)  # interpreted: ~10 s each
@pytest.mark.parametrize("wrong", ["entries", "nan", "row"])
def test_the_kernel_catches_a_wrong_output(case, wrong, small_splits):
    call, out = _call(case)
    bad = out.clone()
    if wrong == "entries":
        bad[..., ::7] += 0.5  # every 7th entry of every row
    elif wrong == "nan":
        bad[..., 1] = float("nan")
    else:  # another row's output everywhere: right magnitudes, wrong values
        bad = bad.roll(1, dims=2)
    kernel, _ = _both(call, bad, rows=32)
    found = guard._read(kernel.tolist(), case.dtype, 2.0, False)
    assert found is not None and found.error > found.allowed


NOT_KERNEL = {
    "float32": Case(causal="top_left"),
    "bool mask": Case(dtype=BF16, mask="bool"),
    "float mask": Case(dtype=BF16, mask="float"),
    "ALiBi": Case(dtype=BF16, alibi="heads"),
    "softcap": Case(dtype=BF16, softcap=5.0),
    "sinks": Case(dtype=BF16, sinks="fixed"),
    "lse": Case(dtype=BF16, return_lse=True),
    "varlen": Case(dtype=BF16, varlen=(3, 5), extra_k=(1, 0)),
    "head dim 512": Case(dtype=BF16, head_dim=512, seqlen_q=4, seqlen_k=4),
}


@pytest.mark.parametrize("name", NOT_KERNEL)
def test_calls_the_kernel_does_not_compute_keep_the_torch_path(name):
    case = NOT_KERNEL[name]
    q, k, v, mask, sdpa_kw, _ = make_inputs(case, requires_grad=False)
    call = normalize_call(q, k, v, mask, **sdpa_kw)
    out = math_attention(call.query, call.key, call.value, **call.options)
    out, lse = out if case.return_lse else (out, None)
    assert not guard_triton.supported(call.query, call.key, call.value, call.options, out, lse, None)


def test_a_kernel_that_fails_to_build_leaves_the_torch_path(monkeypatch, caplog):
    call, out = _call(KERNEL_CASES[0])
    from attention_dispatch.kernels.tl import guard_check

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no compiler")

            return launch

    monkeypatch.setattr(guard_check, "_guard_check", Broken())
    monkeypatch.setattr(guard_triton, "_broken", [])
    columns = guard._columns(call.query, call.key, call.options, 8)
    assert guard_triton.payload(call.query, call.key, call.value, call.options, out, columns) is None
    assert "no compiler" in caplog.text and guard_triton._broken
    assert not guard_triton.supported(call.query, call.key, call.value, call.options, out, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_on_cuda_a_sampled_check_is_the_kernel_in_one_device_op(case, monkeypatch):
    """guard.payload() on CUDA: the picks' copy (one op; the kernel is no aten op; 2 allowed), no graph,
    and the same verdicts as the torch path (graph and eager)."""
    call, out = _call(case)
    args = (call.problem, call.query, call.key, call.value, call.options)
    guard.payload(*args, out)  # built once
    graphs = len(guard_graph._graphs)
    with DeviceOps() as counted:
        measured = guard.payload(*args, out)
    assert sum(counted.ops.values()) <= 2, dict(counted.ops)
    assert len(guard_graph._graphs) == graphs and guard._read(measured.tolist(), case.dtype, 2.0, False) is None
    bad = out.clone()
    bad[..., ::7] += 0.5
    assert guard.check(*args, bad) is not None
    monkeypatch.setattr(guard_triton, "supported", lambda *a: False)
    assert guard.check(*args, out) is None and guard.check(*args, bad) is not None
