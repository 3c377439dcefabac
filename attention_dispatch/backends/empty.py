"""Exact zeros for a call with an empty dimension (no query, key or head; a zero head dim), on the
autograd graph, so that adapters whose library refuses or mishandles such shapes run no kernel."""

from __future__ import annotations

import torch


def is_empty(query, key, value) -> bool:
    """A call with an empty dimension: its output is exact zeros without a kernel."""
    return query.numel() == 0 or key.numel() == 0 or value.numel() == 0


def empty_attention(query, key, value, varlen: bool):
    """Zeros of the output's shape ((B, Hq, Sq, Dv), varlen (total_q, Hq, Dv)) whose gradient reaches
    query, key and value as zeros."""
    if key.shape[1] != query.shape[1]:  # heads are dim 1 in both (B, H, S, D) and (total, H, D)
        group = query.shape[1] // max(key.shape[1], 1)
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    if varlen:
        return torch.einsum("qhk,khe->qhe", torch.einsum("qhd,khd->qhk", query, key[:0]), value[:0])
    return (query @ key.transpose(-1, -2)) @ value


__all__ = ["empty_attention", "is_empty"]
