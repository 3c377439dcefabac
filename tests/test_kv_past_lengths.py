"""Cache rows past each sequence's length are not part of an sdpa_with_kvcache() call (issue 34):
a cache allocated with torch.empty may hold NaN or Inf there.  For every KV-cache claim each
backend declares (test_capabilities.kv_claimed_cases, one item per claim), NaN and then +Inf
are written in every row past the lengths, then the output is checked against the float64
reference of the valid rows only (tests/test_kvcache.py).  Dense: rows L_b .. capacity of each
sequence, lengths uneven with 0 and full; paged: the tail of each sequence's last block and every
block no sequence reads.  The rows the append overwrites are poisoned too (it must write them).
KV calls are forward only: there is no backward to check.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from test_capabilities import _kv_claims
from test_kvcache import KvCase, check_kv_call, make_kv_inputs

POISONS = {"NaN": math.nan, "+Inf": math.inf}


def uneven_lengths(case: KvCase) -> KvCase:
    """`case` with four sequences: full (after the append), empty, one ending inside a block, one key."""
    room = case.capacity - (case.seqlen_q if case.append else 0)
    return dataclasses.replace(case, batch=4, lengths=(room, 0, min(room, room // 2 + 5), min(room, 1)))


def poison_past_lengths(args: dict, value: float) -> None:
    """Write `value` into every cache row no sequence reads before the append (in place)."""
    lengths = args["cache_seqlens"].tolist()
    table = args["block_table"]
    for cache in (args["k_cache"], args["v_cache"]):
        if table is None:
            for b, n in enumerate(lengths):
                cache[b, :, n:] = value
            continue
        num_blocks, page = cache.shape[:2]
        keep = torch.zeros(num_blocks * page, dtype=torch.bool, device=cache.device)
        for b, n in enumerate(lengths):
            j = torch.arange(n, device=cache.device)
            keep[table[b].long()[j // page] * page + j % page] = True
        cache.view(num_blocks * page, *cache.shape[2:])[~keep] = value


def check_past_lengths(backend: str, case: KvCase, device: str) -> None:
    case = uneven_lengths(case)
    for name, value in POISONS.items():
        args = make_kv_inputs(case, device)
        poison_past_lengths(args, value)
        try:
            check_kv_call(backend, case, device, args=args)
        except AssertionError as error:
            raise AssertionError(f"{name} in the cache rows past the lengths: {error}") from None


@pytest.mark.parametrize("backend,label,case", list(_kv_claims("cpu", big=False)))
def test_rows_past_the_lengths_are_never_part_of_the_call(backend, label, case):
    check_past_lengths(backend, case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,label,case", list(_kv_claims("cuda", big=True)))
def test_gpu_rows_past_the_lengths_are_never_part_of_the_call(backend, label, case):
    check_past_lengths(backend, case, "cuda")
