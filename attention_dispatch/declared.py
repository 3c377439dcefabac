"""The decision for a device that is not here (``explain --device cuda --arch sm90`` on a
laptop), from each backend's declared capabilities alone, saying what could not be checked.

Only the capabilities are evaluated: availability, installed versions and a backend's own
``check()`` describe this machine (its libraries, its GPU), not the one asked about."""

from __future__ import annotations

import dataclasses
import re

from . import config as _config
from . import dispatch, registry
from .backends.base import Backend, not_supported_reasons
from .problem import Problem

_ARCH = re.compile(r"^(?:sm_?)?(\d+)(\d)$")


def parse_arch(arch: str) -> tuple[int, int]:
    """'sm90', 'sm_90', '90' or '9.0' -> (9, 0)."""
    text = arch.strip().lower()
    match = re.fullmatch(r"(\d+)\.(\d+)", text) or _ARCH.fullmatch(text)
    if match is None:
        raise ValueError(f"--arch {arch!r}: expected a CUDA compute capability such as sm90, sm_80 or 9.0")
    return int(match.group(1)), int(match.group(2))


def device_present(device_type: str) -> bool:
    """Whether this machine has a device of that type that torch can use."""
    if device_type == "cpu":
        return True
    import torch

    module = getattr(torch, device_type, None)
    return bool(module is not None and getattr(module, "is_available", lambda: False)())


def explain_declared(problem: Problem, forced: str | None = None) -> dispatch.Decision:
    """The Decision among the usual candidates (same order and config) where each backend's
    only reasons are its declared capabilities (and ``dispatch.disabled``); the notes name
    what that leaves unchecked."""
    cfg = _config.current_config()
    names, source = dispatch.candidate_order(forced, cfg)
    known = set(registry.list_backends())
    disabled = set(cfg.dispatch.disabled)
    rejected: dict[str, list[str]] = {}
    eligible: list[str] = []
    own_checks: list[str] = []
    for name in names:
        if name not in known:
            rejected[name] = [f"not registered (registered: {', '.join(registry.list_backends())})"]
            continue
        backend = registry.get_backend(name)
        reasons = not_supported_reasons(backend.capabilities, problem)
        if name in disabled and forced is None:
            reasons.append("disabled by config (dispatch.disabled)")
        if backend.reference and problem.device_type == "cuda" and cfg.dispatch.math_fallback == "forbid":
            reasons.append("math on a CUDA input is forbidden by config (dispatch.math_fallback='forbid')")
        if type(backend).check is not Backend.check:
            own_checks.append(name)
        if reasons:
            rejected[name] = reasons
        else:
            eligible.append(name)
    where = problem.device_type + (" sm%d%d" % problem.compute_capability if problem.compute_capability else "")
    notes = [
        f"declared capabilities only: no {where} device here, nothing was run",
        "not checked: whether each backend is installed and available there (library, driver, GPU)",
    ]
    if own_checks:
        notes.append(
            "not checked: the own checks (library versions, kernel limits, determinism flags) of "
            + ", ".join(own_checks)
        )
    if problem.device_type == "cuda":
        if problem.compute_capability is None:
            notes.append("not checked: compute-capability limits (pass --arch, e.g. sm90)")
        notes.append("not checked: the performance table (policy='auto' picks by measured speed on that GPU)")
    return dispatch.Decision(
        backend=eligible[0] if eligible else None,
        problem=problem,
        source=source,
        candidates=names,
        rejected=rejected,
        eligible=tuple(eligible),
        notes=tuple(notes),
    )


def hypothetical_problem(problem: Problem, device_type: str, arch: tuple[int, int] | None) -> Problem:
    """``problem`` (built on the meta device) as if its tensors lived on ``device_type``."""
    return dataclasses.replace(problem, device_type=device_type, compute_capability=arch)
