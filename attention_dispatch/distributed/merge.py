"""Merging partial attention results by their logsumexp, and the sinks applied once after.

Block b of a row attends to a subset of its keys and gives (out_b, lse_b); the row's attention
over the union of the subsets is

    lse = log sum_b exp(lse_b),    out = sum_b exp(lse_b - lse) * out_b

exact, in float32 (float64 for float64 inputs). Rows whose every block is empty (lse_b = -inf)
give out 0 and lse -inf, with finite gradients (no NaN in forward or backward).
"""

from __future__ import annotations

import math

import torch


def merge_partials(outs, lses):
    """outs: list of (B, H, S, Dv), lses: list of (B, H, S) float32/float64 (same length >= 1).
    Returns (out (B, H, S, Dv), lse (B, H, S)), both in the lses' dtype."""
    compute = lses[0].dtype
    if len(outs) == 1:
        return outs[0].to(compute), lses[0]
    stacked = torch.stack(lses)  # (n, B, H, S)
    # the shift cancels exactly; detached so that its gradient is not computed at all
    top = stacked.detach().amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # empty rows: shift by 0, not -inf
    weights = torch.exp(stacked - top)  # exp(-inf) = 0 with gradient 0
    total = weights.sum(0)
    nonempty = total > 0
    safe_total = torch.where(nonempty, total, torch.ones_like(total))  # no log(0) even in the unused branch
    lse = torch.where(nonempty, top + torch.log(safe_total), torch.full_like(total, -math.inf))
    scale = weights / safe_total
    out = sum(scale[i].unsqueeze(-1) * outs[i].to(compute) for i in range(len(outs)))
    return out, lse


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with one sink logit per head from attention without: out (B, H, S, Dv), lse
    (B, H, S) without the sink, sinks (H,). A sink only enlarges each row's denominator, so
    out_sink = out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink) (0 for lse -inf)."""
    factor = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])
    return out * factor.unsqueeze(-1).to(out.dtype)
