"""dropout_stream.py: the plain-PyTorch Philox keep-mask is the tl kernels' mask bit for bit,
any block of it is drawn alone at its offsets, and the math backend uses it (so math and
triton drop the same weights for a seed, and a block call reproduces a whole call's)."""

from __future__ import annotations

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.dropout_stream import DropoutStream, keep_mask, positioned

SHAPES = [(2, 3, 19, 37, 0.3), (1, 2, 16, 64, 0.5), (1, 1, 5, 3, 0.9)]


def _whole(seed, b, h, sq, sk, p):
    stream = DropoutStream(seed, 0, 0, 0, sq, sk)
    return keep_mask(stream, p, torch.arange(b * h), h, sq, 0, sk).reshape(b, h, sq, sk)


@pytest.mark.parametrize(("b", "h", "sq", "sk", "p"), SHAPES)
def test_keep_mask_is_the_kernels_mask(b, h, sq, sk, p):
    pytest.importorskip("triton")
    from attention_dispatch.kernels import dropout_keep_mask

    seed = torch.tensor([123456789012345], dtype=torch.int64)
    want = dropout_keep_mask(b, h, sq, sk, p, device="cpu", seed=seed)
    assert torch.equal(_whole(seed, b, h, sq, sk, p), want)


@pytest.mark.parametrize(("row0", "col0", "batch0"), [(5, 7, 0), (0, 1, 1), (3, 0, 1), (2, 6, 0)])
def test_a_block_draws_its_part_of_the_whole_mask(row0, col0, batch0):
    b, h, sq, sk, p = 3, 2, 11, 23, 0.4
    seed = torch.randint(0, 2**62, (1,))
    whole = _whole(seed, b, h, sq, sk, p)
    rows, cols = sq - row0 - 1, sk - col0 - 2
    stream = DropoutStream(seed, batch0, row0, col0, sq, sk)
    part = keep_mask(stream, p, torch.arange((b - batch0) * h), h, rows, 0, cols)
    assert torch.equal(
        part.reshape(b - batch0, h, rows, cols), whole[batch0:, :, row0 : row0 + rows, col0 : col0 + cols]
    )


def test_keep_rate():
    keep = _whole(torch.tensor([7]), 2, 4, 64, 64, 0.3).float()
    assert abs(keep.mean().item() - 0.7) < 5 * (0.7 * 0.3 / keep.numel()) ** 0.5


def test_math_block_call_equals_its_rows_and_columns_of_the_whole_call():
    """A math call under positioned() computes a block of the whole call's dropped attention:
    its rows' probabilities against its columns, the same kept weights."""
    q, k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(3)
    whole, lse = ad.sdpa(q, k, v, dropout_p=0.3, backend="math", return_lse=True)
    torch.manual_seed(3)
    seed = torch.randint(0, 2**62, (1,))
    outs, lses = [], []
    for c0, c1 in ((0, 5), (5, 12)):  # two column blocks of rows 4..9, merged by their lse
        with positioned(DropoutStream(seed, 0, 4, c0, 12, 12)):
            o, lo = ad.sdpa(
                q[:, :, 4:10], k[:, :, c0:c1], v[:, :, c0:c1], dropout_p=0.3, backend="math", return_lse=True
            )
        outs.append(o)
        lses.append(lo)
    total = torch.logaddexp(*lses)
    merged = sum(o * torch.exp(lo - total)[..., None] for o, lo in zip(outs, lses))
    assert (merged - whole[:, :, 4:10]).abs().max().item() < 1e-12
    assert (total - lse[:, :, 4:10]).abs().max().item() < 1e-12


def test_math_and_triton_drop_the_same_weights():
    pytest.importorskip("triton")
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    torch.manual_seed(11)
    want = ad.sdpa(q.double(), k.double(), v.double(), dropout_p=0.25, backend="math")
    torch.manual_seed(11)
    got = ad.sdpa(q, k, v, dropout_p=0.25, backend="triton")
    assert (got.double() - want).abs().max().item() < 1e-4
