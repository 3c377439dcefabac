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
dtype.  Softcap, ALiBi, sinks and a returned logsumexp are judged like any call (the lse too);
dropout where the backend can draw its keep-mask again (``Backend.dropout_keep_mask``, from the
random state kept before the call).  A due call the guard cannot judge is never passed silently:
:func:`unjudged` names why, in the decision's notes and in explain().
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import random
import threading

import torch

from ..caches import register_cache
from .guard_rows import Rows, _chunks, _gather_dense, _gather_varlen, _max_err, _reference, _rows_in

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
        "softcap",
        "alibi_slopes",
        "sinks",
        "return_lse",
    }
)
CHECKED_LIMIT = 4096
# elements of a dropout keep-mask the guard draws again (bool, (B, Hq, Sq, Sk)): above, not judged
KEEP_LIMIT = 1 << 26


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


def unjudged(problem, options: dict, backend=None, rng=None) -> str | None:
    """Why the guard cannot judge this call of `backend` (None: it can).  Dropout needs the
    backend's ``dropout_keep_mask(query, key, options)`` (its keep-mask drawn again) and the
    random state from before the call (`rng`, see :func:`rng_before`)."""
    if problem.layout not in ("dense", "varlen"):
        return f"{problem.layout} layout"
    unknown = [k for k, v in options.items() if k not in KNOWN_OPTIONS and v is not None and v is not False and v != 0]
    if unknown:
        return f"option {unknown[0]!r} is unknown to the guard"
    if options["dropout_p"] > 0:
        name = getattr(backend, "name", backend)
        if getattr(backend, "dropout_keep_mask", None) is None:
            return f"dropout: backend {name!r} cannot draw its keep-mask again (no dropout_keep_mask())"
        elements = problem.batch * problem.heads_q * problem.seqlen_q * problem.seqlen_k
        if elements > KEEP_LIMIT:
            return f"dropout: its keep-mask of {elements} elements is over the guard's {KEEP_LIMIT}"
        if rng is None or rng[0] != name:
            return "dropout: the random state before the call was not kept (a fallback or a re-run ran it)"
    return None


def judgeable(problem, options: dict) -> bool:
    """Whether the guard judges this call without dropout (see :func:`unjudged`)."""
    return options["dropout_p"] == 0 and unjudged(problem, options) is None


def _device_rng(device):
    return None if device.type == "cpu" else torch.get_device_module(device.type)


def rng_before(name: str, problem, device, cfg):
    """sdpa() before running backend `name`: the device's random state when the guard may
    judge a dropout call (so it can draw the keep-mask again), else None."""
    if cfg.mode == "off" or not problem.dropout:
        return None
    module = _device_rng(device)
    return name, device, torch.get_rng_state() if module is None else module.get_rng_state(device)


def _redrawn_keep(backend, rng, query, key, options):
    """The keep-mask `backend` applied, drawn again from the random state before its call; the
    user's random stream is left where the call left it."""
    _, device, state = rng
    module = _device_rng(device)
    after = torch.get_rng_state() if module is None else module.get_rng_state(device)
    try:
        torch.set_rng_state(state) if module is None else module.set_rng_state(state, device)
        return backend.dropout_keep_mask(query, key, options)
    finally:
        torch.set_rng_state(after) if module is None else module.set_rng_state(after, device)


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


def _verdict(picks, error: float, base: float, dtype, factor: float, floor: float = 0.0) -> Mismatch | None:
    allowed_error = factor * base + max(FLOOR.get(dtype, 1e-5), floor)
    if error <= allowed_error:
        return None
    return Mismatch(error, allowed_error, tuple((b, h, i) for b, h, i, *_ in picks))


def _wide_bias(rows: Rows, dtype) -> bool:
    """A bias wider than the inputs is exact input: the input dtype's error is then rounding alone."""
    return rows.bias is not None and rows.bias.dtype != dtype and rows.bias.dtype.itemsize > dtype.itemsize


def _split(out, options):
    """A backend's result as (out, lse or None)."""
    return out if options.get("return_lse") else (out, None)


def check(
    problem, query, key, value, options: dict, out, rows: int = 8, factor: float = 2.0, keep=None
) -> Mismatch | None:
    """Recompute up to `rows` random query rows of a call (canonical tensors and options, as
    a backend's run() gets them, and its result) and return the Mismatch if the output's rows
    (or the returned lse's) are wrong, else None.  keep: a dropout call's keep-mask (see
    :func:`unjudged` for the calls it cannot judge; it passes those)."""
    if options["dropout_p"] > 0 and keep is None or unjudged(problem, dict(options, dropout_p=0.0)) is not None:
        return None
    out, lse = _split(out, options)
    picks = _picks(query, options, rows)
    if not picks:
        return None
    gather = _gather_varlen if options["cu_seqlens_q"] is not None else _gather_dense
    scale, softcap, dtype = options["scale"], options.get("softcap"), query.dtype
    errors = dict(out=0.0, lse=0.0)
    bases = dict(out=0.0, lse=0.0)
    largest_lse = 0.0
    with torch.no_grad():
        for chunk in _chunks(picks, key, options):
            got = gather(problem, chunk, query, key, value, options, out, lse, keep)
            ref, ref_lse = _reference(got, scale, softcap)
            if _wide_bias(got, dtype):
                low, low_lse = ref.to(dtype), ref_lse.to(dtype)
            else:
                low, low_lse = _rows_in(dtype, got, scale, softcap)
            bases["out"] = max(bases["out"], _max_err(low.double(), ref))
            errors["out"] = max(errors["out"], _max_err(got.got.double(), ref))
            if lse is not None:
                bases["lse"] = max(bases["lse"], _max_err(low_lse.double(), ref_lse))
                errors["lse"] = max(errors["lse"], _max_err(got.got_lse.double(), ref_lse))
                finite = ref_lse[torch.isfinite(ref_lse)]
                largest_lse = max([largest_lse] + finite.abs().tolist())
    found = _verdict(picks, errors["out"], bases["out"], dtype, factor)
    if found is None and lse is not None:  # lse is float32: half an ulp of it is rounding however computed
        floor = 0.5 * torch.finfo(torch.float32).eps * largest_lse
        found = _verdict(picks, errors["lse"], bases["lse"], dtype, factor, floor)
    return found


def check_backward(
    problem, query, key, value, options: dict, out, rows: int = 8, factor: float = 2.0, keep=None
) -> Mismatch | None:
    """strict mode's check of the backward: dq of up to `rows` random query rows for a random
    output gradient (drawn from a generator of its own), against the same rows' reference
    gradient (dq_i depends on row i alone).  The backend's backward runs once more, through
    autograd.grad with the graph retained for the caller's own backward.  Mismatch or None."""
    out, _ = _split(out, options)
    if options["dropout_p"] > 0 and keep is None or unjudged(problem, dict(options, dropout_p=0.0)) is not None:
        return None
    if not out.requires_grad or not query.requires_grad:
        return None
    picks = _picks(query, options, rows)
    if not picks:
        return None
    generator = torch.Generator(device=out.device)
    generator.manual_seed(_rng.getrandbits(62))
    grad_out = torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype)
    (dq,) = torch.autograd.grad(out, query, grad_out, retain_graph=True)
    gather = _gather_varlen if options["cu_seqlens_q"] is not None else _gather_dense
    scale, softcap, dtype = options["scale"], options.get("softcap"), query.dtype
    error = base = 0.0
    for chunk in _chunks(picks, key, options):
        with torch.no_grad():
            got = gather(problem, chunk, query, key, value, options, dq, keep=keep)
            grad_rows = gather(problem, chunk, query, key, value, options, grad_out, keep=keep).got
        with torch.enable_grad():
            q64 = got.q.detach().double().requires_grad_()
            (ref_dq,) = torch.autograd.grad(_reference(got, scale, softcap, q64)[0], q64, grad_rows.double())
            if _wide_bias(got, dtype):
                low_dq = ref_dq.to(dtype)
            else:
                ql = got.q.detach().clone().requires_grad_()
                (low_dq,) = torch.autograd.grad(_rows_in(dtype, got, scale, softcap, ql)[0], ql, grad_rows)
        base = max(base, _max_err(low_dq.double(), ref_dq))
        error = max(error, _max_err(got.got.double(), ref_dq))
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


def _judge(name: str, problem, query, key, value, options, out, cfg, rng=None) -> str | None:
    """None when the rows match (or the call cannot be judged: see _unjudged_note); else logs
    the mismatch, raises in strict mode, quarantines the backend and returns the reason."""
    from .. import registry

    backend = registry.get_backend(name)
    if unjudged(problem, options, backend, rng) is not None:
        return None  # not passed: a later call of this kind is judged when it can be
    keep = _redrawn_keep(backend, rng, query, key, options) if options["dropout_p"] > 0 else None
    found, what = check(problem, query, key, value, options, out, cfg.rows, cfg.factor, keep), "max error"
    if found is None and cfg.mode == "strict" and problem.requires_grad:
        args = (problem, query, key, value, options, out, cfg.rows, cfg.factor, keep)
        found, what = check_backward(*args), "dq max error"
    return _mismatch(name, problem, found, what, cfg)


def not_judged_note(name: str, problem, options: dict, cfg, rng) -> str | None:
    """The note a decision carries when the guard is on but cannot judge its call (rng:
    rng_before's state, or (name,) for explain(), which runs nothing)."""
    from .. import registry

    if cfg.mode == "off" or name is None:
        return None
    reason = unjudged(problem, options, registry.get_backend(name), rng)
    return None if reason is None else f"numerics guard ({cfg.mode}): cannot judge this call: {reason}"


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


def guard_call(decision, call, out, cfg, rerun, rng=None):
    """sdpa()'s full path after the chosen backend ran: check it when due; on a mismatch
    quarantine it and ``rerun()`` (decide again and run), checking the next one likewise; a
    due call the guard cannot judge gets a note saying why.  rng: :func:`rng_before`'s state
    (a dropout call).  Returns (decision, out)."""
    problem, wrong = call.problem, []
    while _due(decision.backend, problem, cfg):
        name = decision.backend
        note = not_judged_note(name, problem, call.options, cfg, rng)
        if note is not None:
            decision = dataclasses.replace(decision, notes=decision.notes + (note,))
            break
        reason = _judge(name, problem, call.query, call.key, call.value, call.options, out, cfg, rng)
        if reason is None:
            break
        wrong.append(name)
        decision, out = rerun()
        rng = None  # the re-run drew its own mask
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
        if chance() >= fraction:
            return runner(query, key, value, *args, **kwargs)
        rng = rng_before(name, problem, query.device, cfg)
        out = runner(query, key, value, *args, **kwargs)
        opts = dict(options, attn_mask=args[0] if args else None)
        opts.update(kwargs)
        if _judge(name, problem, query, key, value, opts, out, cfg, rng) is not None:
            raise _Quarantined(name)
        return out

    return guarded
