"""The numerics guard: recompute a few query rows of a call with the float64 reference and
quarantine a backend whose answer is wrong (config [guard], off by default).

Mode "first" checks the first call of each new decision (a backend, a Problem), "sample"
that and a fraction of later calls (sdpa()'s fast path runs through :func:`sampled`),
"strict" every call, raising :class:`GuardError` instead of quarantining, and there the
backward too (:func:`check_backward`: dq of the sampled rows).  A mismatch is
logged as an error naming backend, problem and error; the backend is quarantined for that
kind of call (:func:`kind_of`: device, dtype, layout, head dims and the features used, not
the sizes), so every later decision skips it with a reason, and the call is run again on the
next candidate.  clear_cache() forgets the quarantine.

The rule is the test suite's (tests/oracle.py): the error against float64 may be at most
``factor`` (2) times the error of the same rows computed in the input dtype, plus a floor per
dtype.  Calls the guard cannot judge pass unchecked: dropout (the kept weights are random),
KV-cache calls, and options it does not know (a feature added after it).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import random
import threading

import torch

from ..backends.math import dense_math_attention
from ..caches import register_cache
from ..semantics import band

logger = logging.getLogger("attention_dispatch")

# tests/oracle.py's absolute slack: the error a correct kernel may have beyond 2x the input dtype's
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# the options the guard's reference computes; a call with any other set is not judged
KNOWN_OPTIONS = frozenset(
    {
        "attn_mask",
        "dropout_p",
        "causal",
        "window",
        "scale",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "enable_gqa",
        "deterministic",
    }
)
CHECKED_LIMIT = 4096


class GuardError(RuntimeError):
    """strict mode: a backend's answer differs from the reference beyond the tolerance."""


class _Quarantined(Exception):
    """Raised by a sampled fast-path runner after quarantining its backend: sdpa()'s fast
    path catches it and takes the full path, which decides again."""


@dataclasses.dataclass(frozen=True)
class Mismatch:
    error: float
    allowed: float
    rows: tuple[tuple[int, ...], ...]  # (batch, head, row) of each recomputed row


_lock = threading.Lock()
_quarantine: dict[tuple[str, tuple], str] = {}  # (backend, kind) -> reason
_checked: set = set()  # (backend, Problem) whose first call passed
_rng = random.Random()  # never torch's generator: the guard must not move the user's dropout stream


def _clear() -> None:
    with _lock:
        _quarantine.clear()
        _checked.clear()


register_cache("guard.quarantine", _clear, lambda: len(_quarantine) + len(_checked))


def kind_of(problem) -> tuple:
    """The kind of call a quarantine covers: everything that selects a different code path in
    a kernel (device, arch, dtype, layout, head dims, features), not the sizes.  It reads no
    sequence length, so a decision's seqlen_k span is unaffected (dispatch.seqlen_k_span)."""
    return (
        problem.device_type,
        problem.compute_capability,
        problem.dtype,
        problem.layout,
        problem.head_dim_qk,
        problem.head_dim_v,
        problem.mask_kind,
        problem.causal,
        problem.window is not None,
        problem.dropout,
        problem.heads_q != problem.heads_kv,
    )


def describe_kind(kind: tuple) -> str:
    device, cc, dtype, layout, dqk, dv, mask, causal, window, dropout, gqa = kind
    parts = [layout, str(dtype).removeprefix("torch."), device + (f" sm{cc[0]}{cc[1]}" if cc else "")]
    parts.append(f"head_dim={dqk}" if dqk == dv else f"head_dim_qk={dqk}, head_dim_v={dv}")
    parts += [f"{mask} mask"] * (mask != "none") + [f"causal={causal}"] * (causal is not None)
    parts += ["window"] * window + ["dropout"] * dropout + ["GQA"] * gqa
    return ", ".join(parts)


def quarantine_reasons(name: str, problem) -> list[str]:
    """The quarantine reason of backend `name` for calls of this kind, if any."""
    if not _quarantine:
        return []
    reason = _quarantine.get((name, kind_of(problem)))
    return [] if reason is None else [reason]


def quarantined() -> dict[str, list[str]]:
    """backend -> the reasons it is quarantined for (one per kind of call)."""
    out: dict[str, list[str]] = {}
    with _lock:
        for (name, _), reason in _quarantine.items():
            out.setdefault(name, []).append(reason)
    return out


def quarantine(name: str, problem, reason: str) -> None:
    """Quarantine backend `name` for calls of `problem`'s kind, and forget every decision
    (cached ones would still choose it)."""
    from .. import dispatch  # dispatch imports this package for its reasons

    with _lock:
        _quarantine[(name, kind_of(problem))] = reason
    dispatch._clear_decisions()


# ---- checking one call ---------------------------------------------------------------------


def judgeable(problem, options: dict) -> bool:
    """Whether the guard's reference computes this call (see the module doc)."""
    if problem.layout not in ("dense", "varlen") or options["dropout_p"] > 0:
        return False
    return all(k in KNOWN_OPTIONS or v is None or v is False or v == 0 for k, v in options.items())


def _picks(query, options: dict, count: int) -> list[tuple[int, int, int, int, int, int, int]]:
    """Random (batch, head, row, q_index, sq, k0, sk) of up to `count` distinct query rows:
    q_index is the row in the packed query (varlen) and k0 the sequence's first key."""
    cu_q = options["cu_seqlens_q"]
    hq = query.shape[-2] if cu_q is not None else query.shape[1]
    if cu_q is None:
        b, _, sq, _ = query.shape
        total = b * hq * sq
        flat = _rng.sample(range(total), min(count, total))
        return [(f // (hq * sq), f // sq % hq, f % sq, f % sq, sq, 0, -1) for f in flat]
    starts_q, starts_k = cu_q.tolist(), options["cu_seqlens_k"].tolist()
    total = starts_q[-1] * hq
    picks = []
    for f in _rng.sample(range(total), min(count, total)):
        t, h = divmod(f, hq)
        b = bisect.bisect_right(starts_q, t) - 1  # the last start <= t: a sequence holding row t
        sq, sk = starts_q[b + 1] - starts_q[b], starts_k[b + 1] - starts_k[b]
        picks.append((b, h, t - starts_q[b], t, sq, starts_k[b], sk))
    return picks


def _rows_in(dtype, q, k, v, bias, allowed, scale):
    """Section 3 for single rows, computed in `dtype` (the input dtype's own error)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s = torch.einsum("nd,nld->nl", q, k) * scale
    if bias is not None:
        s = s + bias.to(dtype)
    s = s.masked_fill(~allowed, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    return torch.einsum("nl,nlv->nv", e / torch.where(z > 0, z, torch.ones_like(z)), v)


def _max_err(got, ref) -> float:
    """max |got - ref| over entries; a non-finite value where the reference has another is inf."""
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite], ref[~finite]):
        return math.inf
    return (got[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0


def _gather_dense(problem, picks, query, key, value, options, out):
    """The picked rows of a dense call as (q (n, D), k (n, Sk, D), v (n, Sk, Dv), allowed
    (n, Sk), float bias (n, Sk) or None, the output's rows (n, Dv)), gathered in one go."""
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
    return query[b, h, i], key[b, kv_head], value[b, kv_head], allowed, bias, out[b, h, i]


def _gather_varlen(problem, picks, query, key, value, options, out):
    """As _gather_dense for packed sequences: each row's own keys, padded to the longest
    (padding not allowed); a mask is indexed by positions local to each sequence."""
    group = problem.heads_q // max(problem.heads_kv, 1)
    bottom_right, left, right = band(options["causal"], options["window"])
    mask = options["attn_mask"]
    if mask is not None:
        mask = mask.expand(problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k)
    width = max(p[6] for p in picks)
    n, dev = len(picks), query.device
    qs, ks, vs, got = [], [], [], []
    allowed = torch.zeros(n, width, dtype=torch.bool, device=dev)
    bias = None if mask is None or mask.dtype == torch.bool else torch.zeros(n, width, dtype=mask.dtype, device=dev)
    for r, (b, h, i, t, sq, k0, sk) in enumerate(picks):
        qs.append(query[t, h])
        got.append(out[t, h])
        ks.append(torch.nn.functional.pad(key[k0 : k0 + sk, h // group], (0, 0, 0, width - sk)))
        vs.append(torch.nn.functional.pad(value[k0 : k0 + sk, h // group], (0, 0, 0, width - sk)))
        diag = i + (sk - sq if bottom_right else 0)
        lo, hi = (diag - left if left >= 0 else 0), (diag + right if right >= 0 else sk - 1)
        allowed[r, max(lo, 0) : max(min(hi, sk - 1) + 1, 0)] = True
        if mask is not None:
            row = mask[b, h, i, :sk]
            if bias is None:
                allowed[r, :sk] &= row
            else:
                bias[r, :sk] = row
    return torch.stack(qs), torch.stack(ks), torch.stack(vs), allowed, bias, torch.stack(got)


# float64 elements of one batch of recomputed rows' keys and values (64 MiB): long sequences
# are checked a few rows at a time, never as one copy of n x Sk keys
CHUNK_ELEMENTS = 1 << 23


def _chunks(picks, key, options):
    """The picks in batches whose float64 copies of keys and values stay under CHUNK_ELEMENTS."""
    width = max(p[6] for p in picks) if options["cu_seqlens_q"] is not None else key.shape[-2]
    per_row = max(1, width * (key.shape[-1] + 1) * 2)
    step = max(1, CHUNK_ELEMENTS // per_row)
    return [picks[i : i + step] for i in range(0, len(picks), step)]


def _reference(q, k, v, allowed, bias, scale):
    """The rows in float64 through the math reference (the band and mask folded into `allowed`
    / `bias`, so each row is a one-query call without causal or window)."""
    mask = allowed if bias is None else bias.double().masked_fill(~allowed, -math.inf)
    out = dense_math_attention(
        q.double()[:, None, None],
        k.double()[:, None],
        v.double()[:, None],
        mask[:, None, None],
        scale=scale,
        bottom_right=True,
        left=-1,
        right=-1,
    )
    return out[:, 0, 0]


def _verdict(picks, error: float, base: float, dtype, factor: float) -> Mismatch | None:
    allowed_error = factor * base + FLOOR.get(dtype, 1e-5)
    if error <= allowed_error:
        return None
    return Mismatch(error, allowed_error, tuple((b, h, i) for b, h, i, *_ in picks))


def check(problem, query, key, value, options: dict, out, rows: int = 8, factor: float = 2.0) -> Mismatch | None:
    """Recompute up to `rows` random query rows of a call (canonical tensors and options, as
    a backend's run() gets them, and its output) and return the Mismatch if the output's rows
    are wrong, else None (also for a call the guard cannot judge)."""
    if not judgeable(problem, options):
        return None
    picks = _picks(query, options, rows)
    if not picks:
        return None
    gather = _gather_varlen if options["cu_seqlens_q"] is not None else _gather_dense
    error = base = 0.0
    with torch.no_grad():
        for chunk in _chunks(picks, key, options):
            q, k, v, allowed, bias, got = gather(problem, chunk, query, key, value, options, out)
            ref = _reference(q, k, v, allowed, bias, options["scale"])
            # a bias wider than the inputs is exact input: the input dtype's error is then rounding alone
            wide = bias is not None and bias.dtype != query.dtype and bias.dtype.itemsize > query.dtype.itemsize
            low = ref.to(query.dtype) if wide else _rows_in(query.dtype, q, k, v, bias, allowed, options["scale"])
            base = max(base, _max_err(low.double(), ref))
            error = max(error, _max_err(got.double(), ref))
    return _verdict(picks, error, base, query.dtype, factor)


def check_backward(problem, query, key, value, options: dict, out, rows: int = 8, factor: float = 2.0):
    """strict mode's check of the backward: dq of up to `rows` random query rows for a random
    output gradient (drawn from a generator of its own), against the same rows' reference
    gradient (dq_i depends on row i alone).  The backend's backward runs once more, through
    autograd.grad with the graph retained for the caller's own backward.  Mismatch or None."""
    if not judgeable(problem, options) or not out.requires_grad or not query.requires_grad:
        return None
    picks = _picks(query, options, rows)
    if not picks:
        return None
    generator = torch.Generator(device=out.device)
    generator.manual_seed(_rng.getrandbits(62))
    grad_out = torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype)
    (dq,) = torch.autograd.grad(out, query, grad_out, retain_graph=True)
    gather = _gather_varlen if options["cu_seqlens_q"] is not None else _gather_dense
    scale, dtype = options["scale"], query.dtype
    error = base = 0.0
    for chunk in _chunks(picks, key, options):
        with torch.no_grad():
            q, k, v, allowed, bias, got = gather(problem, chunk, query, key, value, options, dq)
            grad_rows = gather(problem, chunk, query, key, value, options, grad_out)[5]
        with torch.enable_grad():
            q64 = q.detach().double().requires_grad_()
            (ref_dq,) = torch.autograd.grad(_reference(q64, k, v, allowed, bias, scale), q64, grad_rows.double())
            if bias is not None and bias.dtype != dtype and bias.dtype.itemsize > dtype.itemsize:
                low_dq = ref_dq.to(dtype)
            else:
                ql = q.detach().clone().requires_grad_()
                (low_dq,) = torch.autograd.grad(_rows_in(dtype, ql, k, v, bias, allowed, scale), ql, grad_rows)
        base = max(base, _max_err(low_dq.double(), ref_dq))
        error = max(error, _max_err(got.double(), ref_dq))
    return _verdict(picks, error, base, dtype, factor)


# ---- the hooks sdpa() calls ------------------------------------------------------------------


def _due(name: str, problem, cfg) -> bool:
    if cfg.mode == "strict" or (name, problem) not in _checked:
        return True
    return cfg.mode == "sample" and _rng.random() < cfg.sample


def _passed(name: str, problem) -> None:
    with _lock:
        if len(_checked) >= CHECKED_LIMIT:
            _checked.clear()
        _checked.add((name, problem))


def _judge(name: str, problem, query, key, value, options, out, cfg) -> str | None:
    """None when the rows match; else logs the mismatch, raises in strict mode, quarantines
    the backend and returns the reason."""
    found, what = check(problem, query, key, value, options, out, cfg.rows, cfg.factor), "max error"
    if found is None and cfg.mode == "strict" and problem.requires_grad:
        found, what = check_backward(problem, query, key, value, options, out, cfg.rows, cfg.factor), "dq max error"
    return _mismatch(name, problem, found, what, cfg)


def _mismatch(name: str, problem, found: Mismatch | None, what: str, cfg) -> str | None:
    """_judge's verdict on `found` (None: the rows matched)."""
    if found is None:
        _passed(name, problem)
        return None
    what = f"{what} {found.error:.3g} > {found.allowed:.3g} on {problem.summary()}"
    logger.error(
        "numerics guard: backend %r gives wrong results: %s (rows (batch, head, query) %s)", name, what, found.rows
    )
    if cfg.mode == "strict":
        raise GuardError(f"numerics guard: backend {name!r} gives wrong results: {what}")
    reason = f"quarantined: {what} (numerics guard; for every call of this kind: {describe_kind(kind_of(problem))})"
    quarantine(name, problem, reason)
    return reason


def guard_call(decision, call, out, cfg, rerun):
    """sdpa()'s full path after the chosen backend ran: check it when due; on a mismatch
    quarantine it and ``rerun()`` (decide again and run), checking the next one likewise.
    Returns (decision, out)."""
    problem, wrong = call.problem, []
    while _due(decision.backend, problem, cfg):
        name = decision.backend
        reason = _judge(name, problem, call.query, call.key, call.value, call.options, out, cfg)
        if reason is None:
            break
        wrong.append(name)
        decision, out = rerun()
        if decision.backend in wrong:  # never loop: the quarantine must have rejected it
            raise GuardError(f"numerics guard: backend {decision.backend!r} chosen again after its quarantine")
        decision = _noted(decision, name, reason)
    return decision, out


def _noted(decision, name: str, reason: str):
    return dataclasses.replace(decision, notes=decision.notes + (f"{name} {reason}; ran {decision.backend}",))


def sampled(runner, decision, options: dict, cfg):
    """sdpa()'s fast-path runner for mode "sample": a fraction of calls are checked; a
    mismatch quarantines the backend and raises, so that sdpa() takes the full path (which
    decides again and runs the next candidate)."""
    name, problem, fraction = decision.backend, decision.problem, cfg.sample
    options = dict(options, attn_mask=None)  # each call passes its own; don't keep the first one's alive
    chance = _rng.random

    def guarded(query, key, value, *args, **kwargs):
        out = runner(query, key, value, *args, **kwargs)
        if chance() < fraction:
            opts = dict(options, attn_mask=args[0] if args else None)
            opts.update(kwargs)
            if _judge(name, problem, query, key, value, opts, out, cfg) is not None:
                raise _Quarantined(name)
        return out

    return guarded
