"""How candidates are judged beyond their declared capabilities: the numerics guard
(guard.py: backends caught giving wrong answers at run time) and the known-bad list
(known_bad.py: library versions known to be wrong under a condition).  Both are one more
source of reasons for dispatch.evaluate()."""

from __future__ import annotations

from . import guard, known_bad


def reasons(name: str, backend, problem, cfg) -> list[str]:
    """Why `backend` must not serve `problem` beyond its capabilities: quarantined by the
    guard, or listed as known bad (shipped list plus the config's [[known_bad]])."""
    return guard.quarantine_reasons(name, problem) + known_bad.reasons(name, backend, problem, cfg.known_bad)
