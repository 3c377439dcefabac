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

import atexit
import dataclasses
import logging
import math
import random
import threading

import torch

from ..caches import register_cache
from . import guard_graph as _graph
from . import guard_rows as _rows
from . import guard_triton as _triton
from .guard_rows import _chunks, _errors, _gather_dense, _gather_varlen, _reference, _rows_in, _wide_bias

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


@dataclasses.dataclass
class _Pending:
    """A sampled call's deferred verdict: check()'s payload, copied to the host behind `event`
    (None: already there, a CPU call)."""

    name: str
    problem: object
    payload: torch.Tensor
    event: object
    factor: float
    with_lse: bool


_pending: list[_Pending] = []
# deferred verdicts kept at most: one more waits for the oldest (a queue running far behind)
PENDING_LIMIT = 64


def _clear() -> None:
    with _lock:
        _quarantine.clear()
        _checked.clear()
        _pending.clear()  # verdicts of calls made before: they would quarantine into a clean state


register_cache("guard.quarantine", _clear, lambda: len(_quarantine) + len(_checked) + len(_pending))


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


def _picks(query, key, options: dict, count: int) -> torch.Tensor | None:
    """_columns on the query's device (copied without a sync)."""
    columns = _columns(query, key, options, count)
    return None if columns is None else _rows.index_tensor(columns, query.device)


def _columns(query, key, options: dict, count: int) -> list | None:
    """Up to `count` distinct random query rows (across batch, heads and rows), drawn on the
    host from sizes alone, with what follows from them there, as host columns: dense 7
    (guard_rows.dense_columns); varlen 3: packed row, head, kv head."""
    if options["cu_seqlens_q"] is not None:
        hq = query.shape[-2]
        total, group = query.shape[0] * hq, hq // max(key.shape[-2], 1)
        flat = _rng.sample(range(total), min(count, total))
        columns = [[f // hq for f in flat], [f % hq for f in flat], [f % hq // group for f in flat]]
    else:
        b, hq, sq, _ = query.shape
        flat = _rng.sample(range(b * hq * sq), min(count, b * hq * sq))
        columns = _rows.dense_columns(flat, query, key, options)
    return columns if flat else None


def _where(options: dict, picks) -> torch.Tensor:
    """The (batch, head, row) of each pick, (3, n) on the device (varlen: its sequence and row in it)."""
    if options["cu_seqlens_q"] is None:
        return picks[:3]
    b, i = _rows.varlen_rows(options, picks[0])[:2]
    return torch.stack([b, picks[1], i])


def _verdict(rows, error: float, base: float, dtype, factor: float, floor: float = 0.0) -> Mismatch | None:
    allowed_error = factor * base + max(FLOOR.get(dtype, 1e-5), floor)
    if error <= allowed_error:  # NaN never passes
        return None
    return Mismatch(error, allowed_error, tuple(rows))


def _read(values: list, dtype, factor: float, with_lse: bool) -> Mismatch | None:
    """The verdict on a payload read on the host (see :func:`payload`)."""
    count = _rows.stat_count(with_lse)
    n = (len(values) - count) // 3
    where = [int(x) for x in values[count:]]
    values = [math.inf if math.isnan(x) else x for x in values[:count]]  # a NaN error (or base) is inf
    rows = zip(where[:n], where[n : 2 * n], where[2 * n :])
    found = _verdict(rows, values[_rows.ERROR], values[_rows.BASE], dtype, factor)
    if found is None and with_lse:  # lse is float32: half an ulp of it is rounding however computed
        floor = 0.5 * torch.finfo(torch.float32).eps * values[_rows.LARGEST_LSE]
        found = _verdict(rows, values[_rows.LSE_ERROR], values[_rows.LSE_BASE], dtype, factor, floor)
    return found


def _split(out, options):
    """A backend's result as (out, lse or None)."""
    return out if options.get("return_lse") else (out, None)


def payload(problem, query, key, value, options: dict, out, rows: int = 8, keep=None) -> torch.Tensor | None:
    """check()'s measurement, left on the device (no host sync: it only queues kernels): a
    float64 tensor of guard_rows.measure()'s values (stat_count), then the (batch, head, row) of each
    recomputed row; None where there is nothing to judge (see check)."""
    if options["dropout_p"] > 0 and keep is None or unjudged(problem, dict(options, dropout_p=0.0)) is not None:
        return None
    out, lse = _split(out, options)
    columns = _columns(query, key, options, rows)
    if columns is None:
        return None
    if query.device.type == "cuda" and _triton.supported(query, key, value, options, out, lse, keep):
        measured = _triton.payload(query, key, value, options, out, columns)
        if measured is not None:
            return measured
    if _graph.capturable(query, key, value, options, len(columns[0]), keep):
        measured = _graph.payload(problem, query, key, value, options, out, lse, columns)
        if measured is not None:
            return measured
    picks = _rows.index_tensor(columns, query.device)
    gather = _gather_varlen if options["cu_seqlens_q"] is not None else _gather_dense
    scale, softcap = options["scale"], options.get("softcap")
    with torch.no_grad():
        chunks = (gather(problem, c, query, key, value, options, out, lse, keep) for c in _chunks(picks, key, options))
        stats = _rows.measure(chunks, scale, softcap, query.dtype, lse is not None)
        return torch.cat([stats, _where(options, picks).flatten()])  # one kernel: cat converts


def check(
    problem, query, key, value, options: dict, out, rows: int = 8, factor: float = 2.0, keep=None
) -> Mismatch | None:
    """Recompute up to `rows` random query rows of a call (canonical tensors and options, as
    a backend's run() gets them, and its result) and return the Mismatch if the output's rows
    (or the returned lse's) are wrong, else None.  keep: a dropout call's keep-mask (see
    :func:`unjudged` for the calls it cannot judge; it passes those).  Reads its verdict on
    the host: one sync (see :func:`payload` for the measurement alone)."""
    measured = payload(problem, query, key, value, options, out, rows, keep)
    if measured is None:
        return None
    return _read(measured.tolist(), query.dtype, factor, bool(options.get("return_lse")))


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
    picks = _picks(query, key, options, rows)
    if picks is None:
        return None
    generator = torch.Generator(device=out.device)
    generator.manual_seed(_rng.getrandbits(62))
    grad_out = torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype)
    (dq,) = torch.autograd.grad(out, query, grad_out, retain_graph=True)
    gather = _gather_varlen if options["cu_seqlens_q"] is not None else _gather_dense
    scale, softcap, dtype = options["scale"], options.get("softcap"), query.dtype
    worst = None  # [error, base] on the device
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
        errors = _errors(torch.stack([got.got.double(), low_dq.double()]), ref_dq)
        worst = errors if worst is None else torch.maximum(worst, errors)
    values = torch.cat([worst, _where(options, picks).double().flatten()]).tolist()
    return _read(values, dtype, factor, False)


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
    if _pending:  # sampled calls' verdicts that came in: a quarantine applies from the next decision
        _resolve(wait=False)
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
    """sdpa()'s fast-path runner for mode "sample": a fraction of calls are checked.  With
    ``sample_verdict = "immediate"`` a mismatch quarantines the backend and raises, so that
    sdpa() takes the full path (which decides again and runs the next candidate); that reads
    the verdict on the host, a sync of the device's queue.  "deferred" (default) queues the
    check and reads its verdict when it is done (:func:`_resolve`): each guarded call first
    applies the verdicts that came in, and takes the full path if they quarantined this backend;
    the sampled call's own output was already returned."""
    name, problem, fraction = decision.backend, decision.problem, cfg.sample
    options = dict(options, attn_mask=None)  # each call passes its own; don't keep the first one's alive
    chance, deferred = _rng.random, cfg.sample_verdict == "deferred"

    def guarded(query, key, value, *args, **kwargs):
        if _pending:
            _resolve(wait=False)
            if _quarantine and quarantine_reasons(name, problem):
                raise _Quarantined(name)
        if chance() >= fraction:
            return runner(query, key, value, *args, **kwargs)
        rng = rng_before(name, problem, query.device, cfg)
        out = runner(query, key, value, *args, **kwargs)
        opts = dict(options, attn_mask=args[0] if args else None)
        opts.update(kwargs)
        if deferred:
            _defer(name, problem, query, key, value, opts, out, cfg, rng)
        elif _judge(name, problem, query, key, value, opts, out, cfg, rng) is not None:
            raise _Quarantined(name)
        return out

    return guarded


def mode_note(cfg) -> str | None:
    """explain()'s note on how sampled calls are judged (None unless mode "sample")."""
    if cfg.mode != "sample":
        return None
    if cfg.sample_verdict == "immediate":
        how = "judged before the call returns (a host sync each); a wrong one is re-run on the next candidate"
    else:
        how = (
            "judged after the call returns, without a host sync; a wrong backend is quarantined from a "
            "later call, the sampled call's output is not re-run (guard_flush() waits for the verdicts)"
        )
    return f"numerics guard (sample {cfg.sample:g}, sample_verdict={cfg.sample_verdict!r}): sampled calls are {how}"


# ---- deferred verdicts ------------------------------------------------------------------------


def _defer(name: str, problem, query, key, value, options, out, cfg, rng) -> None:
    """Queue the check of a sampled call and keep its payload's copy to the host with an event."""
    from .. import registry

    backend = registry.get_backend(name)
    if unjudged(problem, options, backend, rng) is not None:
        return
    keep = _redrawn_keep(backend, rng, query, key, options) if options["dropout_p"] > 0 else None
    measured = payload(problem, query, key, value, options, out, cfg.rows, keep)
    if measured is None:
        return
    event = None
    if measured.device.type != "cpu":  # the copy lands behind the check's kernels; the event says when
        module = torch.get_device_module(measured.device.type)
        host = torch.empty(measured.shape, dtype=measured.dtype, pin_memory=True)
        host.copy_(measured, non_blocking=True)
        event = module.Event()
        event.record(module.current_stream(measured.device))
        measured = host
    with _lock:
        _pending.append(_Pending(name, problem, measured, event, cfg.factor, bool(options.get("return_lse"))))
        full = len(_pending) > PENDING_LIMIT
    if full:
        _resolve(wait=True, oldest=True)


def _resolve(wait: bool, oldest: bool = False) -> list[str]:
    """Apply the deferred verdicts that are in (wait: all of them, waiting for the device; oldest:
    the oldest alone): a mismatch is logged and quarantines its backend.  The quarantine reasons."""
    with _lock:
        if oldest:
            ready = _pending[:1]
        else:
            ready = [p for p in _pending if wait or p.event is None or p.event.query()]
        for item in ready:
            _pending.remove(item)
    reasons = []
    for item in ready:
        if item.event is not None:
            item.event.synchronize()  # done already unless waiting
        problem = item.problem
        found = _read(item.payload.tolist(), problem.dtype, item.factor, item.with_lse)
        if found is None:
            continue
        what = f"max error {found.error:.3g} > {found.allowed:.3g} on {problem.summary()}"
        logger.error(
            "numerics guard: backend %r gives wrong results: %s (rows (batch, head, query) %s); found after "
            "the sampled call returned ([guard] sample_verdict = \"deferred\"): that call's output was "
            "already returned and is not re-run; later calls of this kind do not run it",
            item.name,
            what,
            found.rows,
        )
        reason = f"quarantined: {what} (numerics guard, a sampled call; for every call of this kind: "
        reason += f"{describe_kind(kind_of(problem))})"
        quarantine(item.name, problem, reason)
        reasons.append(f"{item.name} {reason}")
    return reasons


def guard_flush() -> list[str]:
    """Wait for the deferred verdicts of sampled calls (mode "sample", sample_verdict "deferred")
    and apply them: each mismatch is logged and quarantines its backend.  Returns the reasons
    ("<backend> quarantined: ...") of those it quarantined.  Also run at process exit."""
    return _resolve(wait=True) if _pending else []


def _flush_at_exit() -> None:
    try:
        guard_flush()
    except Exception as exc:  # noqa: BLE001 - a device torn down at exit: say so, never fail the exit
        logger.warning("numerics guard: deferred verdicts not read at exit: %s", exc)


atexit.register(_flush_at_exit)
