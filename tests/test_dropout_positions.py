"""The triton backend's dropout at a block's position (issue 39): under dropout_stream.positioned()
its forward and backward kernels drop exactly the whole call's keep-mask at the block's rows and
columns (dropout_stream.keep_mask, plain PyTorch, is the oracle); a plain call draws the mask it
always drew (offset 0 of itself); bad positions raise before any launch."""

from __future__ import annotations

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.dispatch import BackendRunError
from attention_dispatch.dropout_stream import DropoutStream, draw_seed, keep_mask, positioned

pytest.importorskip("triton")
if __import__("os").environ.get("TRITON_INTERPRET") != "1":  # CPU tensors: the kernels under the interpreter
    pytest.skip("runs the triton kernels under TRITON_INTERPRET=1", allow_module_level=True)

P = 0.4
WHOLE = (2, 2, 29, 44)  # the larger call: B, H, Sq, Sk
# (batch offset, row offset, column offset (a multiple of 4), block rows, block columns); None: a plain call
BLOCKS = [None, (0, 0, 0, 29, 44), (0, 5, 8, 13, 16), (1, 11, 28, 18, 16), (0, 20, 4, 9, 20)]


def _whole_mask(seed, b0: int, r0: int, c0: int, rows: int, cols: int, batch: int) -> torch.Tensor:
    """The whole call's keep-mask at the block: (batch, H, rows, cols)."""
    _, h, sq, sk = WHOLE
    stream = DropoutStream(seed, b0, r0, c0, sq, sk)
    return keep_mask(stream, P, torch.arange(batch * h), h, rows, 0, cols).reshape(batch, h, rows, cols)


def _block_call(block, seed, q, k, v, **kw):
    if block is None:
        torch.manual_seed(seed)
        return ad.sdpa(q, k, v, dropout_p=P, backend="triton", **kw)
    b0, r0, c0 = block[:3]
    with positioned(DropoutStream(seed, b0, r0, c0, WHOLE[2], WHOLE[3])):
        return ad.sdpa(q, k, v, dropout_p=P, backend="triton", **kw)


def _shape(block):
    b, h, sq, sk = WHOLE
    return (b, h, sq, sk, 0, 0, 0) if block is None else (b - block[0], h, block[3], block[4], *block[:3])


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: "plain" if b is None else "-".join(map(str, b)))
def test_block_drops_the_whole_calls_weights(block):
    """Forward: with V = I the output is the dropped probabilities (P > 0 everywhere), so its zeros
    are the forward kernel's mask; backward: with dO = I, dV = (dropped P)^T shows the dK/dV
    pass's mask; dQ against the math backend under the same stream (float64)."""
    batch, h, rows, cols, b0, r0, c0 = _shape(block)
    seed = 1234 if block is None else torch.randint(0, 2**62, (1,))
    if block is None:  # the seed a plain call draws after manual_seed
        torch.manual_seed(seed)
        want_seed = draw_seed("cpu")
    else:
        want_seed = seed
    want = _whole_mask(want_seed, b0, r0, c0, rows, cols, batch)
    q = (0.3 * torch.randn(batch, h, rows, 16)).requires_grad_()
    k = (0.3 * torch.randn(batch, h, cols, 16)).requires_grad_()
    v = torch.eye(cols).expand(batch, h, cols, cols).clone().requires_grad_()
    out = _block_call(block, seed, q, k, v)
    assert torch.equal(out != 0, want)
    grad = torch.eye(rows, cols).expand(batch, h, rows, cols)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    # dV[j, c] = sum_i dropped P[i, j] dO[i, c] = dropped P[c, j] for c < rows
    n = min(rows, cols)
    assert torch.equal(dv[..., :n].transpose(-1, -2) != 0, want[..., :n, :])
    # the math backend draws the same stream in plain PyTorch: dQ (and all else) agree
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    if block is None:
        torch.manual_seed(seed)
        ref = ad.sdpa(qd, kd, vd, dropout_p=P, backend="math")
    else:
        with positioned(DropoutStream(seed, b0, r0, c0, WHOLE[2], WHOLE[3])):
            ref = ad.sdpa(qd, kd, vd, dropout_p=P, backend="math")
    rq, rk, rv = torch.autograd.grad(ref, (qd, kd, vd), grad.double())
    assert (out.double() - ref).abs().max().item() < 1e-5
    for got, exp in ((dq, rq), (dk, rk), (dv, rv)):
        assert (got.double() - exp).abs().max().item() < 1e-4


def test_gqa_causal_block_equals_math_under_the_same_stream():
    """A GQA, causal, bottom-right block: forward and every gradient as the math backend's."""
    seed = torch.randint(0, 2**62, (1,))
    stream = DropoutStream(seed, 0, 7, 12, 40, 48)
    q = torch.randn(1, 4, 17, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, 4, 17, 16)
    results = []
    for backend, dtype in (("triton", torch.float32), ("math", torch.float64)):
        ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        with positioned(stream):
            out = ad.sdpa(*ins, dropout_p=0.3, causal="bottom_right", enable_gqa=True, backend=backend)
        results.append((out, *torch.autograd.grad(out, ins, grad.to(dtype))))
    for got, want in zip(*results):
        assert (got.double() - want).abs().max().item() < 1e-4


def test_keep_mask_of_a_positioned_call_is_the_blocks():
    """The backend's dropout_keep_mask (the numerics guard's) honours the stream in scope."""
    from attention_dispatch.registry import find_backend

    seed = torch.randint(0, 2**62, (1,))
    q, k = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 12, 16)
    options = dict(cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=P)
    with positioned(DropoutStream(seed, 1, 3, 16, WHOLE[2], WHOLE[3])):
        got = find_backend("triton").dropout_keep_mask(q, k, options)
    assert torch.equal(got, _whole_mask(seed, 1, 3, 16, 9, 12, 1))


@pytest.mark.parametrize(
    ("stream", "match"),
    [
        ((0, 3, 6, 29, 44), "col_offset=6: .* a multiple of 4"),
        ((0, 25, 0, 29, 44), "a block of 9 x 12 at \\(25, 0\\) does not fit"),
        ((0, 0, 36, 29, 44), "does not fit in the whole call's 29 x 44"),
    ],
)
def test_bad_positions_raise_before_any_launch(stream, match, monkeypatch):
    from attention_dispatch.kernels.tl import launch

    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(launch, "forward", no_launch)
    q, k = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 12, 16)
    # run()'s ValueError, as the dispatcher reports a backend's run-time refusal
    with positioned(DropoutStream(torch.tensor([5]), *stream)), pytest.raises(BackendRunError, match=match):
        ad.sdpa(q, k, k, dropout_p=P, backend="triton")


def test_varlen_call_cannot_be_a_block():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    stream = DropoutStream(torch.tensor([5]), 0, 0, 0, 8, 8)
    with positioned(stream), pytest.raises(BackendRunError, match="ValueError: a positioned dropout stream .* varlen"):
        ad.sdpa(
            q, q, q, dropout_p=P, backend="triton", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6
        )


def test_triton_declares_dropout_positions():
    from attention_dispatch.kernels.limits import KERNEL_LIMITS
    from attention_dispatch.registry import find_backend

    caps = find_backend("triton").capabilities
    assert caps.dropout_positions and caps.dropout_column_multiple == KERNEL_LIMITS.dropout_column_multiple == 4
