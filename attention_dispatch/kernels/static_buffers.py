"""Device buffers the package owns whose contents never change: a launch may read one from any
call, and a captured launch (launch_replay.Replay) keeps it by reference where it would refuse
any other tensor outside its call's own.  They are never freed (not even by clear_cache()): a
CUDA graph that captured a launch reading one holds no reference to it."""

from __future__ import annotations

import torch

_ZEROS: dict[torch.device, list[torch.Tensor]] = {}  # per device, every one handed out (the last is current)
_MIN_ZEROS = 64


def int32_zeros(device: torch.device, n: int) -> torch.Tensor:
    """Zeros, int32, at least ``n`` of them on ``device``: the same tensor call after call (a
    larger one once ``n`` outgrows it).  Under CUDA-graph capture a missing or short buffer is
    made for that call alone: memory allocated while capturing belongs to the graph's pool."""
    kept = _ZEROS.get(device)
    if kept and kept[-1].numel() >= n:
        return kept[-1]
    fresh = torch.zeros(max(_MIN_ZEROS, 1 << (n - 1).bit_length()), dtype=torch.int32, device=device)
    if device.type == "cuda":
        with torch.cuda.device(device):  # that device's current stream (a capture runs on it)
            if torch.cuda.is_current_stream_capturing():
                return fresh
    _ZEROS.setdefault(device, []).append(fresh)
    return fresh


def is_static(t: torch.Tensor) -> bool:
    """``t`` is one of these buffers."""
    return any(t is buf for kept in _ZEROS.values() for buf in kept)
