"""The numerics guard's recomputed rows: each picked query row of a call gathered as a
one-query call over its own keys (band, mask, ALiBi, sinks, dropout's kept weights), its
float64 reference (the math backend's section 3 for those rows), and the same rows in the
input dtype.  A sampled check runs on ~1% of calls: its kernels are few (measure())."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..caches import register_cache
from ..semantics import band


@dataclasses.dataclass
class Rows:
    """Recomputed rows, each a one-query call over its own keys: q (n, D), k (n, Sk, D), v (n,
    Sk, Dv) (dropout's kept weights folded in: v * keep / (1 - p)), allowed (n, Sk) or None (every
    key), the float bias (n, Sk) or None, ALiBi as slope (n,) and distance (n, Sk) or None, sinks (n,) or None,
    and the backend's output rows (n, Dv) and lse (n,) or None.  packed: the one flat buffer
    q, k, v are views of (the float64 reference converts it in one op), pair: (2, n, Dv), got
    its slot 0 (slot 1 takes the input dtype's rows: the errors need no stack); None each
    where not gathered so (see gather)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    allowed: torch.Tensor | None
    bias: torch.Tensor | None
    slope: torch.Tensor | None
    distance: torch.Tensor | None
    sinks: torch.Tensor | None
    got: torch.Tensor
    got_lse: torch.Tensor | None
    packed: torch.Tensor | None = None
    pair: torch.Tensor | None = None


def _rows_in(dtype, rows: Rows, scale, softcap, q=None, with_lse: bool = True, out=None):
    """Section 3 for single rows computed in `dtype`, as tests/naive.py and the math backend do:
    in float64 the reference, in the input dtype its own error (the same roundings, step by
    step).  (out (n, Dv), lse (n,) without the sinks, or None unless with_lse or sinks).  q: the
    rows' queries (default rows.q; one requiring grad for the backward); out: an (n, Dv) buffer
    for the output rows (none requiring grad).  In float64 without lse or sinks the softmax is
    one op: a float64 rounding apart from the steps, far under any input dtype's error.  Few kernels (a check is ~1% of calls): a row without keys (or a
    non-finite max) shifts by 0 and its sum (>= 1 wherever a key counts: the max's exp is 1)
    divides as 1."""
    q, k, v = _converted(dtype, rows, q)
    s = torch.bmm(k, q[:, :, None])[:, :, 0] * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if rows.slope is not None:
        s = s - rows.slope.to(dtype)[:, None] * rows.distance.to(dtype)
    if rows.bias is not None:
        s = s + rows.bias.to(dtype)
    if rows.allowed is not None:
        s = torch.where(rows.allowed, s, -math.inf)
    if dtype == torch.float64 and not with_lse and rows.sinks is None:  # a row without keys: NaN -> 0
        return torch.bmm(torch.softmax(s, -1).nan_to_num(0.0)[:, None], v, out=_row_out(out))[:, 0], None
    m = s.detach().amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    lse = (m + torch.log(z))[:, 0] if with_lse or rows.sinks is not None else None  # log(0) = -inf: no keys
    if rows.sinks is None:
        p = e / z.clamp_min(1.0)
    else:  # P = exp(s - logaddexp(lse, sink)): exact for any sink, an empty row included (lse -inf)
        p = torch.exp(s - torch.logaddexp(lse, rows.sinks.to(dtype))[:, None])
    return torch.bmm(p[:, None], v, out=_row_out(out))[:, 0], lse


def _row_out(out):
    return None if out is None else out[:, None]


def _converted(dtype, rows: Rows, q=None):
    """rows' q, k, v in `dtype`: one conversion of rows.packed where it holds them (q not given)."""
    if rows.packed is None or q is not None or rows.packed.dtype == dtype:
        return (rows.q if q is None else q).to(dtype), rows.k.to(dtype), rows.v.to(dtype)
    parts = rows.packed.to(dtype).split([rows.q.numel(), rows.k.numel(), rows.v.numel()])
    return (part.view(t.shape) for part, t in zip(parts, (rows.q, rows.k, rows.v)))


def _errors(got, ref) -> torch.Tensor:
    """max |got[k] - ref| over entries for each got[k] (got (K, *ref.shape)), as a float64 (K,)
    tensor on the device, read by nobody here (no host sync); a non-finite value where the
    reference has another (or NaN against NaN) is inf or NaN, which the host reads as inf
    (guard._read).  Few kernels: equal entries (infinities too) count 0, NaN is max's, and the
    comparisons promote got to float64 as they go (no copy)."""
    diff = torch.where(got == ref, 0.0, (got - ref).abs()).flatten(1)
    return diff.amax(1) if diff.shape[1] else diff.new_zeros(diff.shape[0])


@functools.lru_cache(maxsize=16)
def positions(length: int, device: torch.device) -> torch.Tensor:
    """arange(length) on `device`, made once (a kernel less in every check of that length)."""
    return torch.arange(length, device=device)


register_cache("guard.positions", positions.cache_clear, lambda: positions.cache_info().currsize)


def index_tensor(columns, device) -> torch.Tensor:
    """Host ints (K lists of n) as a (K, n) int64 tensor on `device`, copied without a host
    sync (a pageable copy to the GPU waits for its queue; a pinned one does not)."""
    host = torch.tensor(columns, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def feature_rows(options: dict, b, h) -> dict:
    """The rows' ALiBi slopes and sinks (b, h (n,) batch/head): name -> (source, its indices)."""
    slopes, sinks = options.get("alibi_slopes"), options.get("sinks")
    found = {} if slopes is None else {"slope": (slopes, (b, h))}
    return found if sinks is None else found | {"sinks": (sinks.detach(), (h,))}


def _features(rows: dict, options: dict, gathered: dict, diag, j, keep, lse) -> None:
    """Adds ALiBi (slope, distance), sinks (gathered: feature_rows' indexings done), dropout
    (folded into v) and the backend's lse rows to `rows` (diag (n, 1) the diagonal, j the keys'
    positions in their sequence, (width,) or (n, width))."""
    if "slope" in gathered:
        rows["slope"] = gathered["slope"]
        rows["distance"] = (diag - j).abs().double()
    if "sinks" in gathered:
        rows["sinks"] = gathered["sinks"]
    if keep is not None:  # v is no longer the packed buffer's
        rows["v"] = rows["v"].double() * keep.to(rows["v"].device) / (1.0 - options["dropout_p"])
        rows["packed"] = None
    rows["got_lse"] = lse


def _band(options, diag, j, sk):
    """(n, width) keys a row may attend by causal/window alone (j: local key positions, sk the
    sequence's length (n, 1), or None: every j is a key)."""
    bottom_right, left, right = band(options["causal"], options["window"])
    allowed = torch.ones_like(j, dtype=torch.bool) if sk is None else (j >= 0) & (j < sk)
    if left >= 0:
        allowed = allowed & (j >= diag - left)
    if right >= 0:
        allowed = allowed & (j <= diag + right)
    return allowed


def dense_columns(flat, query, key, options) -> list[list[int]]:
    """Flat picks (ints < B * Hq * Sq) as host columns for _gather_dense: batch, head, row, the
    kv head, the diagonal and the band's bounds lo, hi (keys lo <= j <= hi; unused where unbounded),
    all worked out on the host, where they cost no kernel."""
    _, hq, sq, _ = query.shape
    sk, group = key.shape[2], hq // max(key.shape[1], 1)
    bottom_right, left, right = band(options["causal"], options["window"])
    b, h, i = [f // (hq * sq) for f in flat], [f // sq % hq for f in flat], [f % sq for f in flat]
    diag = [r + (sk - sq if bottom_right else 0) for r in i]
    return [b, h, i, [x // group for x in h], diag, [d - left for d in diag], [d + right for d in diag]]


def dense_gathers(problem, picks, query, key, value, options, out, lse=None) -> dict:
    """The indexings of a dense check's rows (picks (7, n) on the device, see dense_columns; lse:
    the backend's (B, Hq, Sq)): name -> (source, its index tensors), one indexing each."""
    b, h, i, kv_head = picks[:4]
    found = dict(q=(query, (b, h, i)), k=(key, (b, kv_head)), v=(value, (b, kv_head)), got=(out, (b, h, i)))
    if lse is not None:
        found["got_lse"] = (lse, (b, h, i))
    mask = options["attn_mask"]
    if mask is not None:
        found["mask"] = (mask.expand(problem.batch, problem.heads_q, query.shape[2], key.shape[2]), (b, h, i))
    return found | feature_rows(options, b, h)


def gather(found: dict) -> dict:
    """dense_gathers' indexings done, one op each: q, k, v into views of one flat buffer when
    they share a dtype ("packed"), got into slot 0 of a (2, n, Dv) buffer ("pair"), the rest
    each its own tensor (guard_graph refills these same tensors: index.Tensor_out)."""
    shapes = {name: (index[0].shape[0], *source.shape[len(index) :]) for name, (source, index) in found.items()}
    gathered, (q, _), device = {}, found["q"], found["q"][0].device
    if found["k"][0].dtype == q.dtype == found["v"][0].dtype:
        sizes = [math.prod(shapes[name]) for name in "qkv"]
        gathered["packed"] = torch.empty(sum(sizes), dtype=q.dtype, device=device)
        for name, part in zip("qkv", gathered["packed"].split(sizes)):
            gathered[name] = part.view(shapes[name])
    gathered["pair"] = torch.empty((2, *shapes["got"]), dtype=found["got"][0].dtype, device=device)
    gathered["got"] = gathered["pair"][0]
    for name, (source, index) in found.items():
        if name in gathered:
            torch.ops.aten.index.Tensor_out(source, list(index), out=gathered[name])
        else:
            gathered[name] = source[index]
    return gathered


def dense_rows(gathered: dict, picks, options, seqlen_k: int, keep=None) -> Rows:
    """Rows from dense_gathers' gathered tensors: the band and ALiBi's distances from the picks
    (no indexing of the call's tensors: guard_graph captures this part). keep: (n, Sk) or None."""
    diag, lo, hi = picks[4:]
    _, left, right = band(options["causal"], options["window"])
    j = positions(seqlen_k, picks.device)
    allowed = None  # every key
    if left >= 0:
        allowed = j >= lo[:, None]
    if right >= 0:
        allowed = j <= hi[:, None] if allowed is None else allowed & (j <= hi[:, None])
    bias, mask = None, gathered.get("mask")
    if mask is not None and mask.dtype == torch.bool:
        allowed = mask if allowed is None else allowed & mask
    elif mask is not None:
        bias = mask
    fields = dict(q=gathered["q"], k=gathered["k"], v=gathered["v"], allowed=allowed, bias=bias)
    fields |= dict(slope=None, distance=None, sinks=None, got=gathered["got"])
    fields |= dict(packed=gathered.get("packed"), pair=gathered.get("pair"))
    keep = None if keep is None else keep[..., None]
    _features(fields, options, gathered, diag[:, None], j, keep, gathered.get("got_lse"))
    return Rows(**fields)


def _gather_dense(problem, picks, query, key, value, options, out, lse=None, keep=None) -> Rows:
    """The picked rows of a dense call, gathered in one go (picks (7, n) on the device, see
    dense_columns; lse: the backend's (B, Hq, Sq); keep: the keep-mask (B, Hq, Sq, Sk))."""
    gathered = gather(dense_gathers(problem, picks, query, key, value, options, out, lse))
    b, h, i = picks[:3]
    return dense_rows(gathered, picks, options, key.shape[2], None if keep is None else keep[b, h, i])


def varlen_rows(options, t):
    """Packed query rows t (n,) on the device -> their (sequence b, row i in it, sq, k0, sk),
    from the offsets on the device (never read on the host)."""
    cu_q, cu_k = options["cu_seqlens_q"].long(), options["cu_seqlens_k"].long()
    b = torch.searchsorted(cu_q, t, right=True) - 1  # the last start <= t: the sequence holding t
    q0, k0 = cu_q[b], cu_k[b]
    return b, t - q0, cu_q[b + 1] - q0, k0, cu_k[b + 1] - k0


def _gather_varlen(problem, picks, query, key, value, options, out, lse=None, keep=None) -> Rows:
    """As _gather_dense for packed sequences (picks (3, n): packed row t, head, kv head): each row over
    every packed key, those outside its sequence not allowed (the offsets stay on the device);
    a mask and a keep-mask are indexed by positions local to each sequence; lse is (Hq, total_q)."""
    t, h, kv_head = picks
    bottom_right, _, _ = band(options["causal"], options["window"])
    b, i, sq, k0, sk = varlen_rows(options, t)
    j = torch.arange(key.shape[0], device=query.device) - k0[:, None]  # (n, total_k) local positions
    diag = (i + (sk - sq if bottom_right else 0))[:, None]
    allowed = _band(options, diag, j, sk[:, None])
    local = j.clamp(0, max(problem.seqlen_k - 1, 0))
    bias, mask = None, options["attn_mask"]
    if mask is not None:
        mask = mask.expand(problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k)
        rows = mask[b[:, None], h[:, None], i[:, None], local]
        if rows.dtype == torch.bool:
            allowed = allowed & rows
        else:
            bias = torch.where(allowed, rows, 0)
    fields = dict(q=query[t, h], k=key[:, kv_head].transpose(0, 1), v=value[:, kv_head].transpose(0, 1))
    fields |= dict(allowed=allowed, bias=bias, slope=None, distance=None, sinks=None, got=out[t, h])
    kept = None if keep is None else (keep[b[:, None], h[:, None], i[:, None], local] & allowed)[..., None]
    gathered = {name: source[index] for name, (source, index) in feature_rows(options, b, h).items()}
    _features(fields, options, gathered, diag, j, kept, None if lse is None else lse[h, t])
    return Rows(**fields)


# float64 elements of one batch of recomputed rows' keys and values (128 MiB): long sequences
# are checked a few rows at a time, never as one copy of n x Sk keys (varlen: n x total_k);
# 8 rows of head dim 128 are one batch up to Sk = 8k (each batch is ~40 kernels)
CHUNK_ELEMENTS = 1 << 24


def _chunks(picks, key, options):
    """The picks ((K, n) on the device) in batches whose float64 copies of keys and values stay under CHUNK_ELEMENTS."""
    width = key.shape[0] if options["cu_seqlens_q"] is not None else key.shape[-2]
    per_row = max(1, width * (key.shape[-1] + 1) * 2)
    step = max(1, CHUNK_ELEMENTS // per_row)
    return [picks[:, i : i + step] for i in range(0, picks.shape[1], step)]


def _reference(rows: Rows, scale, softcap, q=None, with_lse: bool = True):
    """The rows in float64, as (out (n, Dv), lse (n,)): the math backend's computation for
    one-query calls (see _rows_in).  q: the rows' queries (default rows.q; pass one requiring grad)."""
    return _rows_in(torch.float64, rows, scale, softcap, q, with_lse)


def _wide_bias(rows: Rows, dtype) -> bool:
    """A bias wider than the inputs is exact input: the input dtype's error is then rounding alone."""
    return rows.bias is not None and rows.bias.dtype != dtype and rows.bias.dtype.itemsize > dtype.itemsize


# the layout of measure()'s result: the first two alone without lse
ERROR, BASE, LSE_ERROR, LSE_BASE, LARGEST_LSE = range(5)


def stat_count(with_lse: bool) -> int:
    """measure()'s values: 5 with the lse's, else 2."""
    return 5 if with_lse else 2


def measure(chunks, scale, softcap, dtype, with_lse: bool) -> torch.Tensor:
    """The errors of gathered Rows (an iterable of chunks) as one float64 tensor on their
    device (stat_count() values), never read here: the output's error against float64 and its
    base (the same rows' error in the input dtype), then with lse the lse's two and the largest
    finite |lse|.  A NaN among them is read as inf (guard._read)."""
    stats = None
    with torch.no_grad():
        for rows in chunks:
            ref, ref_lse = _reference(rows, scale, softcap, with_lse=with_lse)
            slot = None  # the input dtype's rows written next to got: no stack
            if dtype == torch.float64:  # the input dtype's computation is the reference itself
                low, low_lse = ref, ref_lse
            elif _wide_bias(rows, dtype):
                low, low_lse = ref.to(dtype), None if ref_lse is None else ref_lse.to(dtype)
            else:
                slot = rows.pair[1] if rows.pair is not None and rows.pair.dtype == dtype else None
                low, low_lse = _rows_in(dtype, rows, scale, softcap, with_lse=with_lse, out=slot)
            both = rows.pair if slot is not None else torch.stack([rows.got, low.to(rows.got.dtype)])
            chunk = _errors(both, ref)
            if with_lse:
                lse_errors = _errors(torch.stack([rows.got_lse, low_lse.to(rows.got_lse.dtype)]), ref_lse)
                largest = ref_lse.abs().nan_to_num(0.0, 0.0).amax(0, keepdim=True)  # -inf (no keys) counts 0
                chunk = torch.cat([chunk, lse_errors, largest])
            stats = chunk if stats is None else torch.maximum(stats, chunk)
    return stats
