"""Launching the decode kernels (tl/decode.py) for a call against a KV cache (the new keys
already appended: backends/kv_append.py): the number of key splits, the split pass and the
combine pass.

Everything is device work or python ints: ``cache_seqlens`` and ``block_table`` are never read
on the host, so a call is CUDA-graph capturable with their contents changing between replays.
"""

from __future__ import annotations

import torch

from . import configs as C
from . import run
from .device import device_info, is_interpreter
from .limits import MAX_GRID_YZ
from .params import KernelParams
from .shapes import cdiv, next_pow2
from .tl.decode import _decode_combine, _decode_split
from .tl.common import LOG2E

# A split covers at least this many keys: below it the combine pass and the partials' traffic
# outweigh the parallelism gained.
MIN_KEYS_PER_SPLIT = 256
MAX_DECODE_SPLITS = 128


def decode_splits(programs: int, capacity: int, num_sms: int) -> int:
    """Key splits per (sequence, kv head, row block): enough programs for about four waves of
    the SMs (``programs``: the grid without splits), each split at least MIN_KEYS_PER_SPLIT keys
    of the cache's ``capacity`` (the longest a sequence can be: no read of cache_seqlens)."""
    target = 4 * max(1, num_sms)
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), cdiv(capacity, MIN_KEYS_PER_SPLIT), MAX_DECODE_SPLITS))


def decode_forward(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    params: KernelParams,
    block_table=None,
    n_new: int = 0,
    num_splits: int = 0,
) -> torch.Tensor:
    """Attention of q (B, Hq, Sq, D) over each sequence's first cache_seqlens[b] + n_new cached
    keys (the new ones already appended).  ``params``: scale, window and bottom-right causal
    (``window_right=0``); ``num_splits`` > 0 forces the key splits.  Returns (B, Hq, Sq, D)."""
    B, Hq, Sq, D = q.shape
    paged = block_table is not None
    if paged:
        page, Hkv = k_cache.shape[1], k_cache.shape[2]
        capacity = block_table.shape[1] * page
        k_str = (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1))
        v_str = (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1))
        bt, bt_stride = block_table, block_table.stride(0)
    else:
        page, Hkv, capacity = 1, k_cache.shape[1], k_cache.shape[2]
        k_str, v_str = k_cache.stride()[:3], v_cache.stride()[:3]
        bt, bt_stride = cache_seqlens, 0
    group = Hq // Hkv
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if out.numel() == 0 or capacity == 0:
        return out.zero_()
    interp = is_interpreter()
    block_m = max(16, min(64, next_pow2(group * Sq)))
    block_n = 32 if interp else (64 if D <= 128 else 32)
    block_d = C.block_d(D)  # the padding is masked
    row_blocks = cdiv(group * Sq, block_m)
    if num_splits <= 0:
        num_splits = decode_splits(B * Hkv * row_blocks, capacity, device_info(q.device)[2])
    keys_per_split = cdiv(cdiv(capacity, num_splits), block_n) * block_n
    num_splits = cdiv(capacity, keys_per_split)
    split = num_splits > 1
    bh_axis0 = B * Hkv > MAX_GRID_YZ
    if split:
        o_part = torch.empty((num_splits, B, Hq, Sq, block_d), device=q.device, dtype=torch.float32)
        l_part = torch.empty((num_splits, B, Hq, Sq), device=q.device, dtype=torch.float32)
    else:
        o_part = l_part = out
    run.launch_one(
        _decode_split,
        (B * Hkv, num_splits, row_blocks) if bh_axis0 else (num_splits, B * Hkv, row_blocks),
        (
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            bt,
            out,
            o_part,
            l_part,
            params.scale * LOG2E,
            *q.stride()[:3],
            *k_str,
            *v_str,
            bt_stride,
            *out.stride()[:3],
            Hq,
            Hkv,
            Sq,
            keys_per_split,
            n_new,
            capacity,
            max(params.window_left, 0),
            max(params.window_right, 0),
        ),
        dict(
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            HEAD_D=D,
            BLOCK_D=block_d,
            PAGED=paged,
            PAGE=page,
            HAS_WL=params.window_left >= 0,
            HAS_WR=params.window_right >= 0,
            SPLIT=split,
            BH_AXIS0=bh_axis0,
            DOT_UPCAST=interp and q.dtype != torch.float32,
            DOT_IEEE=q.dtype == torch.float32,
        ),
        4,
        2,
    )
    if split:
        run.launch_one(
            _decode_combine,
            (B * Hq * Sq,),
            (o_part, l_part, out, B * Hq * Sq, Hq, Sq, *out.stride()[:3]),
            dict(NUM_SPLITS=num_splits, SPLITS_P2=next_pow2(num_splits), HEAD_D=D, BLOCK_D=block_d),
            4,
            1,
        )
    return out
