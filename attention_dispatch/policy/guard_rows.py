"""The numerics guard's recomputed rows: each picked query row of a call gathered as a
one-query call over its own keys (band, mask, ALiBi, sinks, dropout's kept weights), its
float64 reference through the math backend, and the same rows in the input dtype."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..backends.math import dense_math_attention
from ..semantics import band


@dataclasses.dataclass
class Rows:
    """Recomputed rows, each a one-query call over its own keys: q (n, D), k (n, Sk, D), v (n,
    Sk, Dv) (dropout's kept weights folded in: v * keep / (1 - p)), allowed (n, Sk), the float
    bias (n, Sk) or None, ALiBi as slope (n,) and distance (n, Sk) or None, sinks (n,) or None,
    and the backend's output rows (n, Dv) and lse (n,) or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    allowed: torch.Tensor
    bias: torch.Tensor | None
    slope: torch.Tensor | None
    distance: torch.Tensor | None
    sinks: torch.Tensor | None
    got: torch.Tensor
    got_lse: torch.Tensor | None


def _rows_in(dtype, rows: Rows, scale, softcap, q=None):
    """Section 3 for single rows computed in `dtype` (the input dtype's own error), as
    tests/naive.py does: (out (n, Dv), lse (n,)).  q: the rows' queries (default rows.q)."""
    q, k, v = (rows.q if q is None else q).to(dtype), rows.k.to(dtype), rows.v.to(dtype)
    s = torch.einsum("nd,nld->nl", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if rows.slope is not None:
        s = s - rows.slope.to(dtype)[:, None] * rows.distance.to(dtype)
    if rows.bias is not None:
        s = s + rows.bias.to(dtype)
    s = s.masked_fill(~rows.allowed, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    lse = torch.where(z > 0, m + torch.log(torch.where(z > 0, z, torch.ones_like(z))), -math.inf)
    if rows.sinks is None:
        p = e / torch.where(z > 0, z, torch.ones_like(z))
    else:
        p = torch.exp(s - torch.logaddexp(lse, rows.sinks.to(dtype)[:, None]))
    return torch.einsum("nl,nlv->nv", p, v), lse[:, 0]


def _max_err(got, ref) -> float:
    """max |got - ref| over entries; a non-finite value where the reference has another is inf."""
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite], ref[~finite]):
        return math.inf
    return (got[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0


def _features(rows: dict, options: dict, b, h, diag, sk, keep, lse) -> None:
    """Adds ALiBi (slope, distance), sinks, dropout (folded into v) and the backend's lse rows
    to `rows` (tensors (n,) of batch/head, diag (n, 1) the diagonal, sk the keys' width)."""
    slopes, sinks = options.get("alibi_slopes"), options.get("sinks")
    if slopes is not None:
        rows["slope"] = slopes[b, h]
        rows["distance"] = (diag - torch.arange(sk, device=diag.device)).abs().double()
    if sinks is not None:
        rows["sinks"] = sinks.detach()[h]
    if keep is not None:
        rows["v"] = rows["v"].double() * keep.to(rows["v"].device) / (1.0 - options["dropout_p"])
    rows["got_lse"] = lse


def _gather_dense(problem, picks, query, key, value, options, out, lse=None, keep=None) -> Rows:
    """The picked rows of a dense call, gathered in one go (lse: the backend's (B, Hq, Sq);
    keep: the keep-mask (B, Hq, Sq, Sk) of a dropout call)."""
    dev = query.device
    b, h, i = (torch.tensor(column, device=dev) for column in list(zip(*picks))[:3])
    kv_head = h // (problem.heads_q // max(problem.heads_kv, 1))
    sq, sk = query.shape[2], key.shape[2]
    bottom_right, left, right = band(options["causal"], options["window"])
    diag = (i + (sk - sq if bottom_right else 0))[:, None]
    j = torch.arange(sk, device=dev)
    allowed = torch.ones(len(picks), sk, dtype=torch.bool, device=dev)
    if left >= 0:
        allowed &= j >= diag - left
    if right >= 0:
        allowed &= j <= diag + right
    bias, mask = None, options["attn_mask"]
    if mask is not None:
        rows = mask.expand(problem.batch, problem.heads_q, sq, sk)[b, h, i]
        if rows.dtype == torch.bool:
            allowed &= rows
        else:
            bias = rows
    fields = dict(q=query[b, h, i], k=key[b, kv_head], v=value[b, kv_head], allowed=allowed, bias=bias)
    fields |= dict(slope=None, distance=None, sinks=None, got=out[b, h, i])
    keep = None if keep is None else keep[b, h, i][..., None]
    _features(fields, options, b, h, diag, sk, keep, None if lse is None else lse[b, h, i])
    return Rows(**fields)


def _gather_varlen(problem, picks, query, key, value, options, out, lse=None, keep=None) -> Rows:
    """As _gather_dense for packed sequences: each row's own keys, padded to the longest
    (padding not allowed); a mask and a keep-mask are indexed by positions local to each
    sequence; lse is the backend's (Hq, total_q)."""
    group = problem.heads_q // max(problem.heads_kv, 1)
    bottom_right, left, right = band(options["causal"], options["window"])
    mask = options["attn_mask"]
    if mask is not None:
        mask = mask.expand(problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k)
    width = max(p[6] for p in picks)
    n, dev = len(picks), query.device
    qs, ks, vs, got, diags = [], [], [], [], []
    allowed = torch.zeros(n, width, dtype=torch.bool, device=dev)
    bias = None if mask is None or mask.dtype == torch.bool else torch.zeros(n, width, dtype=mask.dtype, device=dev)
    kept = None if keep is None else torch.zeros(n, width, 1, dtype=torch.bool)
    for r, (b, h, i, t, sq, k0, sk) in enumerate(picks):
        qs.append(query[t, h])
        got.append(out[t, h])
        ks.append(torch.nn.functional.pad(key[k0 : k0 + sk, h // group], (0, 0, 0, width - sk)))
        vs.append(torch.nn.functional.pad(value[k0 : k0 + sk, h // group], (0, 0, 0, width - sk)))
        diag = i + (sk - sq if bottom_right else 0)
        diags.append(diag)
        lo, hi = (diag - left if left >= 0 else 0), (diag + right if right >= 0 else sk - 1)
        allowed[r, max(lo, 0) : max(min(hi, sk - 1) + 1, 0)] = True
        if mask is not None:
            row = mask[b, h, i, :sk]
            if bias is None:
                allowed[r, :sk] &= row
            else:
                bias[r, :sk] = row
        if keep is not None:
            kept[r, :sk, 0] = keep[b, h, i, :sk].cpu()
    b, h, t = (torch.tensor([p[k] for p in picks], device=dev) for k in (0, 1, 3))
    fields = dict(q=torch.stack(qs), k=torch.stack(ks), v=torch.stack(vs), allowed=allowed, bias=bias)
    fields |= dict(slope=None, distance=None, sinks=None, got=torch.stack(got))
    diag = torch.tensor(diags, device=dev)[:, None]
    _features(fields, options, b, h, diag, width, kept, None if lse is None else lse[h, t])
    return Rows(**fields)


# float64 elements of one batch of recomputed rows' keys and values (64 MiB): long sequences
# are checked a few rows at a time, never as one copy of n x Sk keys
CHUNK_ELEMENTS = 1 << 23


def _chunks(picks, key, options):
    """The picks in batches whose float64 copies of keys and values stay under CHUNK_ELEMENTS."""
    width = max(p[6] for p in picks) if options["cu_seqlens_q"] is not None else key.shape[-2]
    per_row = max(1, width * (key.shape[-1] + 1) * 2)
    step = max(1, CHUNK_ELEMENTS // per_row)
    return [picks[i : i + step] for i in range(0, len(picks), step)]


def _reference(rows: Rows, scale, softcap, q=None):
    """The rows in float64 through the math reference, as (out (n, Dv), lse (n,)): the rows are
    the heads of a one-query call without causal or window (the band, mask and ALiBi folded into
    a float mask, dropout into v).  q: the rows' queries (default rows.q; pass one requiring grad)."""
    mask = torch.zeros(rows.allowed.shape, dtype=torch.float64, device=rows.allowed.device)
    if rows.bias is not None:
        mask = mask + rows.bias.double()
    if rows.slope is not None:
        mask = mask - rows.slope.double()[:, None] * rows.distance
    out, lse = dense_math_attention(
        (rows.q if q is None else q).double()[None, :, None],
        rows.k.double()[None],
        rows.v.double()[None],
        mask.masked_fill(~rows.allowed, -math.inf)[None, :, None],
        scale=scale,
        bottom_right=True,
        left=-1,
        right=-1,
        softcap=softcap,
        sinks=None if rows.sinks is None else rows.sinks.double(),
        return_lse=True,
    )
    return out[0, :, 0], lse[0, :, 0]
