"""The score features of issue 36 (softcap, ALiBi slopes, attention sinks, a returned logsumexp):
their validation, and what every call that uses them shares.

Meaning (docs/semantics.md): ``s_ij = softcap * tanh(scale <q_i, k_j> / softcap) + bias_ij
- slope_h |i + off - j|`` (off: the diagonal of the alignment in effect, as the window's);
a sink is one more logit per head in each row's softmax denominator, carrying no value; the
returned logsumexp is that of the allowed scores, without the sink, -inf for an empty row.
"""

from __future__ import annotations

import math
import numbers

import torch


def check_softcap(softcap) -> float | None:
    """None, or a finite float > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be None or a float > 0, got {type(softcap).__name__} {softcap!r}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a finite float > 0 (None: no capping), got {softcap!r}")
    return float(softcap)


def check_alibi_slopes(alibi_slopes, batch: int, heads_q: int, lead: tuple[int, ...], query) -> torch.Tensor | None:
    """ALiBi slopes as float32 (batch, heads_q) (a stride-0 view of (heads_q,) slopes).
    Accepted: float32 of shape (Hq,) or (B, Hq) (B: the call's batch, or its leading dims for
    inputs of rank > 4), on the query's device, without a gradient (none is computed)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be None or a float32 tensor, got {type(alibi_slopes).__name__}")
    shape = tuple(alibi_slopes.shape)
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes.dtype={str(alibi_slopes.dtype).removeprefix('torch.')}; allowed: float32")
    allowed = [(heads_q,), (batch, heads_q)]
    if len(lead) > 1:
        allowed.append(tuple(lead) + (heads_q,))
    if shape not in allowed:
        raise ValueError(
            f"alibi_slopes of shape {shape}; allowed: {' or '.join(str(s) for s in allowed)} (query heads {heads_q})"
        )
    if alibi_slopes.device != query.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but query is on {query.device}")
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError("alibi_slopes requires grad, but no gradient is computed for them: pass slopes.detach()")
    return alibi_slopes.reshape(-1, heads_q).expand(batch, heads_q)


def check_sinks(sinks, heads_q: int, query) -> torch.Tensor | None:
    """Attention sinks: a floating tensor of shape (Hq,) on the query's device (may require grad)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a tensor of shape ({heads_q},), got {type(sinks).__name__}")
    if not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks.dtype={str(sinks.dtype).removeprefix('torch.')}; allowed: a floating dtype")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}; allowed: ({heads_q},) (one logit per query head)")
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {query.device}")
    return sinks


def check_return_lse(return_lse) -> bool:
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    return return_lse


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """A returned logsumexp's dtype: float64 for float64 inputs, else float32 (DESIGN.md section 3)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
