"""Every per-process cache of the package, in one list, emptied together by clear_cache().

A module that keeps a cache registers how to empty it when it is imported; this module
imports nothing of the package, so kernels may register here too.
"""

from __future__ import annotations

import threading
from typing import Callable

_lock = threading.Lock()
_caches: dict[str, tuple[Callable[[], None], Callable[[], int]]] = {}
_stats: dict[str, Callable[[], dict[str, int]]] = {}


def register_cache(
    name: str, clear: Callable[[], None], size: Callable[[], int], stats: Callable[[], dict[str, int]] | None = None
) -> None:
    """Add a cache under a dotted name saying where it lives (e.g. "dispatch.decisions"):
    how to empty it, how many entries it holds and, optionally, its counters (e.g. hits) since
    it was last emptied."""
    with _lock:
        _caches[name] = (clear, size)
        if stats is not None:
            _stats[name] = stats


def cache_sizes() -> dict[str, int]:
    """Entries held by each registered cache (those of modules imported so far); for tests
    and for a user wondering what the dispatcher keeps."""
    with _lock:
        caches = dict(_caches)
    return {name: size() for name, (_, size) in sorted(caches.items())}


def cache_stats() -> dict[str, dict[str, int]]:
    """The counters of each registered cache that keeps some (e.g. "dispatch.span_calls":
    hits, proofs, unprovable), since clear_cache()."""
    with _lock:
        stats = dict(_stats)
    return {name: get() for name, get in sorted(stats.items())}


def clear_cache() -> None:
    """Empty every cache: decisions, sdpa()'s fast paths (exact, and over key lengths) and
    sdpa_with_kvcache()'s, Problems, policy="fastest"'s in-memory winners, backends'
    availability and the kernels' chosen configs and compiled launches. Call it after
    installing a library or changing the environment in-process."""
    with _lock:
        clears = [clear for clear, _ in _caches.values()]
    for clear in clears:
        clear()
