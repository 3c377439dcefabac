"""Choosing a backend: candidate order, checks, Decision, NoBackendError, the cache.

Decisions reused over key lengths (issue 34: a decode step whose key length grows by one per
call).  Each step is a new Problem, so the decision cache alone would decide every step again.
:func:`seqlen_k_span` proves, for a Decision, the key lengths ``lo ... hi`` (within the power
of two that holds its seqlen_k) for which :func:`decide` on the same Problem with that
seqlen_k returns the same Decision, field for field (the Problem aside); sdpa() then reuses it
for its calls that differ only in Sk (api.py, fast_key.length_key).  The proof decides once
more, on a probe Problem whose seqlen_k is a :class:`problem.TracedLength`, through exactly
the code decide() runs on a miss (:func:`_decision`: every candidate's capabilities and
check(), availability, the performance table's choice):

- decide() is a function of the Problem (and of the config, registry, scope and torch's
  determinism flags, which are part of sdpa()'s keys, and of what the decision cache assumes
  fixed until clear_cache(): backends' availability, the performance tables), and it can
  learn seqlen_k only by using it.  Every use of the probe's seqlen_k is either exact over the whole span (integer
  arithmetic kept symbolic as a * Sk + b) or returns a plain value that the span is narrowed
  to keep (a comparison with a threshold, ``Sk == Sq``, a multiple through // or %, a power of
  two through bit_length: :meth:`problem.LengthSpan.hold`), or collapses the span to Sk alone
  (formatting it into a reason, an int(), a tensor size, hashing: raises).  So for every
  length in the span each candidate's code sees the same plain values and takes the same
  path: the same reasons, word for word, the same eligible list, the same choice.
- The probe's Decision must equal the one decided on the real Problem (it does unless a check
  branched on the type of seqlen_k, which it must not: a Problem's seqlen_k is an int), and a
  proof that fails or holds one length only leaves the call to the full path.
- What decide() cannot see stays out of the reuse: sdpa()'s key holds everything else exactly,
  policy="fastest" (it measures) is never reused, and the backend's own run() is called on
  each call's tensors, so routes and kernel parameters that depend on the exact sizes (the
  triton backend's decode route from 512 keys, alignment to 128) are chosen per call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
import warnings

from . import config as _config
from . import perf_table, policy, registry
from .caches import register_cache
from .problem import Problem, trace_lengths
from .route import Route
from .torch_private import checkpoint_stop

logger = logging.getLogger("attention_dispatch")


class NoBackendError(RuntimeError):
    """No candidate can compute the call; the message lists every candidate's reasons."""

    def __init__(self, message: str, decision: "Decision"):
        super().__init__(message)
        self.decision = decision


class BackendRunError(RuntimeError):
    """The chosen backend failed while running (an error of the library, not of the input)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which backend serves a Problem, and why every other candidate does not.

    rejected: name -> reasons for every candidate that cannot serve the call.
    eligible: the candidates with no reasons, in order (backend is the first).
    failures: name -> error for candidates that failed at run time (on_error="fallback") or
    while policy="fastest" timed them.
    """

    backend: str | None
    problem: Problem
    source: str
    candidates: tuple[str, ...]
    rejected: dict[str, list[str]]
    eligible: tuple[str, ...]
    failures: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # ms, policy="fastest"
    # each timed backend's samples (ms) behind `timings`, when measured in this process
    timing_samples: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    # host time per call (ms) in those samples, on a GPU: near the device's, a call is host-bound
    host_timings: dict[str, float] = dataclasses.field(default_factory=dict)
    # the implementation the chosen backend runs inside (explain() fills it; see Backend.route)
    route: Route | None = None
    # ms per call a performance table expects of each eligible backend (perf_table.table_choice)
    expected: dict[str, float] = dataclasses.field(default_factory=dict)
    # (lo, hi): sdpa() reuses this Decision for calls differing from `problem` only in seqlen_k,
    # anywhere in lo..hi, where it is proven to be decide()'s (seqlen_k_span); `problem` is the
    # call it was decided for
    seqlen_k_span: tuple[int, int] | None = None

    def __str__(self) -> str:
        chosen = self.backend or "NO BACKEND"
        if self.route is not None:
            chosen += f" [{self.route}]"
        head = f"attention_dispatch: {chosen} (order from {self.source})"
        lines = [head, f"  problem: {self.problem.summary()}"]
        if self.route is not None:
            lines.extend(("  route: " if i == 0 else "         ") + line for i, line in enumerate(self.route.lines()))
        width = max([len(n) for n in self.candidates] + [7])
        for name in self.candidates:
            if name == self.backend:
                status = "chosen"
                if name in self.timings:
                    status += f" (measured fastest: {self.timings[name]:.3f} ms{self._host(name)})"
                elif name in self.expected:
                    status += f" (expected {self.expected[name]:.3f} ms)"
            elif name in self.timings:
                status = f"eligible ({self.timings[name]:.3f} ms{self._host(name)})"
            elif name in self.expected and name not in self.failures:
                status = f"eligible (expected {self.expected[name]:.3f} ms)"
            elif name in self.failures:
                status = f"failed: {self.failures[name]}"
            elif name in self.rejected:
                status = "no: " + "; ".join(self.rejected[name])
            else:
                status = "eligible"
            lines.append(f"  {name:<{width}}  {status}")
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.seqlen_k_span is not None:
            lo, hi = self.seqlen_k_span
            lines.append(
                f"  note: the same decision for every Sk in {lo}..{hi} (proven); sdpa() reuses it for "
                f"calls differing only in Sk, so the problem shown is the call it was decided for"
            )
        return "\n".join(lines)

    def _host(self, name: str) -> str:
        return f"; host {self.host_timings[name]:.3f} ms" if name in self.host_timings else ""

    def fallback_after_failure(self, failed: str, error: BaseException) -> "Decision":
        """The Decision for the next eligible candidate after `failed` broke at run time."""
        failures = {
            **self.failures,
            failed: f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
        }
        rest = tuple(n for n in self.eligible if n not in failures)
        return dataclasses.replace(
            self,
            backend=rest[0] if rest else None,
            route=None,
            failures=failures,
            notes=self.notes + (f"{failed} failed at run time; fell back",),
        )


# ---- candidate order ---------------------------------------------------------------------

_scope: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "attention_dispatch_backends", default=None
)


@contextlib.contextmanager
def use_backends(*names: str):
    """Scoped candidate order for this context (thread / task), e.g. use_backends("flash_attn", "math")."""
    if len(names) == 1 and isinstance(names[0], (list, tuple)):
        names = tuple(names[0])
    known = registry.list_backends()
    for name in names:
        if name not in known:
            raise ValueError(f"use_backends: unknown backend {name!r}; registered: {', '.join(known)}")
    if not names:
        raise ValueError("use_backends() needs at least one backend name")
    token = _scope.set(tuple(names))
    try:
        yield
    finally:
        _scope.reset(token)


def candidate_order(forced: str | None, cfg) -> tuple[tuple[str, ...], str]:
    """(names, source): backend= > use_backends() > env > config file > registry default."""
    if forced is not None:
        return (forced,), "backend= argument"
    scoped = _scope.get()
    if scoped is not None:
        return scoped, "use_backends()"
    env = _config.env_priority()
    if env is not None:
        return env, f"env {_config.ENV_BACKENDS}"
    if cfg.dispatch.priority is not None:  # a file's, or a Config / dict given to use_config()
        listed = cfg.dispatch.priority
        # Backends registered but not listed by the file come after, in default order.
        source = cfg.source if cfg.source != "default" else "use_config()"
        return tuple(listed) + tuple(n for n in registry.list_backends() if n not in listed), source
    return tuple(registry.list_backends()), "default" if cfg.source == "default" else f"{cfg.source} (registry order)"


# ---- deciding ----------------------------------------------------------------------------


def evaluate(problem: Problem, names: tuple[str, ...], source: str, cfg, forced: str | None) -> Decision:
    rejected: dict[str, list[str]] = {}
    eligible: list[str] = []
    known = set(registry.list_backends())
    disabled = set(cfg.dispatch.disabled)
    for name in names:
        backend = registry.find_backend(name) if name in known else None
        if backend is None:  # (or unregistered by another thread since `known` was read)
            rejected[name] = [f"not registered (registered: {', '.join(registry.list_backends())})"]
            continue
        reasons: list[str] = []
        if name in disabled and forced is None:
            reasons.append("disabled by config (dispatch.disabled)")
        if not backend.is_available():
            reasons.append(backend.unavailable_reason() or "not available")
        else:
            reasons.extend(backend.reasons(problem))
            reasons.extend(policy.reasons(name, backend, problem, cfg))  # quarantined, known bad
        if backend.reference and problem.device_type == "cuda" and cfg.dispatch.math_fallback == "forbid":
            reasons.append("math on a CUDA input is forbidden by config (dispatch.math_fallback='forbid')")
        if reasons:
            rejected[name] = reasons
        else:
            eligible.append(name)
    return Decision(
        backend=eligible[0] if eligible else None,
        problem=problem,
        source=source,
        candidates=names,
        rejected=rejected,
        eligible=tuple(eligible),
    )


_cache: dict = {}
_cache_lock = threading.Lock()
_CACHE_LIMIT = 4096
_warned: set = set()


# sdpa()'s fast path (fast_key.call_key): call signature -> (Decision, the backend's prepared
# runner).  Cleared with the decision cache.
fast_calls: dict = {}
FAST_CALLS_LIMIT = 4096

# sdpa()'s calls reused over key lengths (fast_key.length_key): signature without Sk ->
# (entries, probes): entries up to SPAN_ENTRIES tuples (lo, hi, Decision, backend.run, options),
# newest first; probes: how many more full paths of this signature may try to prove a span (a
# proof that fails, or proves a single length, uses one; one that cannot work ends them)
span_calls: dict = {}
SPAN_ENTRIES = 4
SPAN_PROBES = 8
# hits: calls run from span_calls; proofs: spans of several lengths proven; unprovable: probes
# that proved none or a single length
span_stats = {"hits": 0, "proofs": 0, "unprovable": 0}


def _clear_spans() -> None:
    span_calls.clear()
    for name in span_stats:
        span_stats[name] = 0


def _clear_decisions() -> None:
    with _cache_lock:
        _cache.clear()
        fast_calls.clear()
        _clear_spans()


register_cache("dispatch.decisions and fast_calls", _clear_decisions, lambda: len(_cache) + len(fast_calls))
register_cache("dispatch.span_calls", _clear_spans, span_calls.__len__, stats=lambda: dict(span_stats))
# warnings given once per process (math on CUDA, a nondeterministic backward): clear_cache() re-arms them
register_cache("dispatch.warned_once", _warned.clear, _warned.__len__)


def decide(problem: Problem, forced: str | None = None, raise_if_none: bool = True) -> Decision:
    """The Decision for `problem` (cached by Problem, order, config and registry versions).

    Raises NoBackendError when no candidate can serve it.
    """
    cfg = _config.current_config()
    key = (problem, forced, _scope.get(), id(cfg), _config.config_version(), registry.registry_version())
    decision = _cache.get(key)
    if decision is None:
        decision = _decision(problem, forced, cfg)
        with _cache_lock:
            if len(_cache) >= _CACHE_LIMIT:
                _cache.clear()
            _cache[key] = decision
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("new decision\n%s", decision)
    if decision.backend is None:
        if not raise_if_none:
            return decision
        raise NoBackendError(no_backend_message(decision, forced), decision)
    _warn_once(decision, cfg)
    return decision


def _decision(problem: Problem, forced: str | None, cfg) -> Decision:
    """What decide() computes on a cache miss (and seqlen_k_span on its probe)."""
    names, source = candidate_order(forced, cfg)
    decision = evaluate(problem, names, source, cfg, forced)
    if problem.device_type == "cuda":
        decision = perf_table.table_choice(decision, cfg.dispatch.policy if forced is None else "forced")
    return decision


def seqlen_k_span(decision: Decision, forced: str | None = None) -> tuple[int, int] | None:
    """The key lengths ``(lo, hi)`` for which decide(problem with that seqlen_k, forced) is
    ``decision`` again, field for field but the Problem (``decision``: what decide() returned
    for ``forced`` under the current config, registry and scope), within the power of two that
    holds decision.problem.seqlen_k (2**(n-1) ... 2**n - 1).  ``lo == hi`` where the decision
    changes on both sides; None where nothing can be proven: the power of two holds one length,
    or the proof failed (module doc)."""
    n = decision.problem.seqlen_k.bit_length()
    lo, hi = 1 << max(n - 1, 0), (1 << n) - 1
    if hi <= lo:
        return None
    return length_span(decision, forced, lo, hi)


def length_span(
    decision: Decision, forced, lo: int, hi: int, fields=("seqlen_k",), mask_dims=()
) -> tuple[int, int] | None:
    """seqlen_k_span's proof within ``lo ... hi`` for one length standing in ``fields`` and
    ``mask_dims`` (problem.trace_lengths); None where it fails."""
    problem = decision.problem
    probe, span = trace_lengths(problem, lo, hi, fields, mask_dims)
    try:
        traced = _decision(probe, forced, _config.current_config())
    except Exception as exc:  # noqa: BLE001 - a use of the length the probe cannot stand for
        logger.debug("%s span of %s: none (%s: %s)", "/".join(fields), problem.summary(), type(exc).__name__, exc)
        return None
    if span.opaque or dataclasses.replace(traced, problem=problem) != decision:
        return None
    return span.lo, span.hi


def no_backend_message(decision: Decision, forced: str | None) -> str:
    what = f"backend {forced!r} (forced) cannot run this call" if forced else "no available backend for this call"
    lines = [
        f"attention_dispatch: {what}",
        f"  problem: {decision.problem.summary()}",
        f"  candidates (order from {decision.source}):",
    ]
    for name in decision.candidates:
        lines.append(f"    {name}: " + "; ".join(decision.rejected.get(name, ["eligible"])))
    return "\n".join(lines)


def _warn_once(decision: Decision, cfg) -> None:
    p = decision.problem
    chosen = registry.get_backend(decision.backend)
    if chosen.reference and p.device_type == "cuda" and cfg.dispatch.math_fallback == "warn":
        if "math-cuda" not in _warned:
            _warned.add("math-cuda")
            warnings.warn(
                f"attention_dispatch: falling back to the reference backend {decision.backend!r} on a CUDA input "
                f"({p.summary()}); it is quadratic in time and chunked but slow. Set "
                "dispatch.math_fallback='allow' to silence or 'forbid' to refuse.",
                RuntimeWarning,
                stacklevel=4,
            )
    if p.deterministic and p.deterministic_warn_only and p.requires_grad:
        key = ("nondeterministic", decision.backend)
        if not chosen.capabilities.deterministic_backward and key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"attention_dispatch: backend {decision.backend!r} has a nondeterministic backward; "
                "used anyway because torch.use_deterministic_algorithms(warn_only=True)",
                UserWarning,
                stacklevel=4,
            )


def run_with_fallback(decision: Decision, run):
    """``(decision, run(backend))`` for the chosen backend; on a run-time failure re-raise as
    BackendRunError, or with dispatch.on_error="fallback" try the next eligible backend (the
    returned Decision then says which failed)."""
    on_error = _config.current_config().dispatch.on_error
    while True:
        try:
            return decision, run(registry.get_backend(decision.backend))
        except checkpoint_stop:  # activation checkpointing ends its recomputation: not a failure
            raise
        except Exception as exc:
            if on_error != "fallback":
                raise BackendRunError(
                    f"backend {decision.backend!r} failed while running: {type(exc).__name__}: {exc}"
                ) from exc
            failed = decision.backend
            decision = decision.fallback_after_failure(failed, exc)
            logger.warning(
                "backend %r failed (%s: %s); falling back to %r", failed, type(exc).__name__, exc, decision.backend
            )
            if decision.backend is None:
                raise BackendRunError(
                    f"every eligible backend failed while running; last was {failed!r}: "
                    f"{type(exc).__name__}: {exc}\n{decision}"
                ) from exc
