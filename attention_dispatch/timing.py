"""How a call is timed among others: the primitives policy="fastest" and benchmarks/ share.

Both time several implementations in interleaved rounds of short turns (:func:`turn_order`),
group calls shorter than a sample's length into one sample (:func:`calls_per_sample`), keep
Python's collector off while sampling (:func:`collector_off`) and read the samples' lower
quartile (:func:`lower_quartile`).  Pure Python: nothing here touches the device.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import statistics
from collections.abc import Iterator, Sequence


def lower_quartile(times: Sequence[float]) -> float:
    """The first quartile of ``times`` (linear interpolation between order statistics): the
    statistic of a timing of policy="fastest" and of a cell in benchmarks/bench.py.
    Disturbances (host hiccups, a clock still ramping) only slow samples down, so a low
    quantile resists them; the minimum does not (one lucky sample sets it: experiment 62)."""
    if len(times) < 2:
        return times[0]
    return statistics.quantiles(times, n=4, method="inclusive")[0]


def turn_order(n: int, rnd: int, salt: str = "") -> list[int]:
    """The order of ``n`` interleaved turns in round ``rnd``: the first round as listed, later
    ones shuffled (seeded by ``salt`` and the round), so that no turn keeps its predecessor,
    whose clock state it inherits (docs/experiments/perf-notes.md experiments 32 and 55).
    policy="fastest" passes no salt; benchmarks/ salts with the seed and the row's id."""
    order = list(range(n))
    if rnd:
        random.Random(f"{salt}-{rnd}").shuffle(order)
    return order


def calls_per_sample(call_ms: float, sample_ms: float) -> int:
    """How many back-to-back calls of ``call_ms`` one sample groups so that it lasts about
    ``sample_ms``: one for calls at least that long."""
    return max(1, math.ceil(sample_ms / call_ms)) if call_ms < sample_ms else 1


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's garbage collector off inside, as it was afterwards (also on an error): a
    collection of a large heap stalls the host for milliseconds, and whichever call it lands
    on loses (as in timeit)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
