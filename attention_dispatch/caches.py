"""Every per-process cache of the package, in one list, emptied together by clear_cache().

A module that keeps a cache registers how to empty it when it is imported; this module
imports nothing of the package, so kernels may register here too.
"""

from __future__ import annotations

import threading
from typing import Callable

_lock = threading.Lock()
_caches: dict[str, Callable[[], None]] = {}


def register_cache(name: str, clear: Callable[[], None]) -> None:
    """Add a cache under a dotted name saying where it lives (e.g. "dispatch.decisions")."""
    with _lock:
        _caches[name] = clear


def cache_names() -> list[str]:
    """The registered caches (those of modules imported so far)."""
    return sorted(_caches)


def clear_cache() -> None:
    """Empty every cache: decisions, sdpa()'s fast path, Problems, policy="fastest"'s
    in-memory winners, backends' availability and the kernels' chosen configs and compiled
    launches. Call it after installing a library or changing the environment in-process."""
    with _lock:
        clears = list(_caches.values())
    for clear in clears:
        clear()
