"""How a call is timed among others: the primitives policy="fastest" and benchmarks/ share,
and the near-tie rule (:func:`pick_winner`) that policy="fastest" and policy="auto" apply.

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


# A near-tie goes to the backend with host time to spare (experiment 73).  A call whose host
# time per call is HOST_HEAVY of its device time or more turns host-bound as soon as the host
# slows, and the host's speed varies ~2x within a run (experiment 67): where the leader is such
# a call and another backend is within TIE of its device time, the one with the least host time
# per call wins.  Replayed over 798 decisions of five grids it changed four (flash-attn 4 ->
# ours at d64 S=512 causal training): 0.69 -> 1.00, 0.97 -> 1.00, 1.00 -> 1.00, 1.00 -> 0.99.
# HOST_HEAVY is 0.5 since experiment 83: a host twice as slow makes such a call host-bound (0.7
# let flash-attn 4 at 0.63 through, and its column then ran 0.80x ours); replayed over the 2876
# decisions of the 19 grids that record host times: 17 below 0.97 of the row's best, 18 at 0.7,
# 25 without the rule.
TIE = 0.03
HOST_HEAVY = 0.5


def pick_winner(timings: dict[str, float], host: dict[str, float]) -> str:
    """The backend with the lowest time (ms per call), unless the leader is host-heavy (its host
    time per call, ``host``, at least HOST_HEAVY of its time) and others are within TIE of it:
    then the one of those with the least host time (see TIE).  Without host times (the CPU,
    where a sample is the host's time), the lowest time.  policy="fastest" applies it to what it
    measured, policy="auto" to a performance table's times."""
    leader = min(timings, key=timings.get)
    if host.get(leader, 0.0) < HOST_HEAVY * timings[leader]:
        return leader
    near = [name for name, ms in timings.items() if ms <= timings[leader] * (1 + TIE)]
    return min(near, key=lambda name: (host.get(name, math.inf), timings[name]))


def tie_note(winner: str, timings: dict[str, float], host: dict[str, float], policy: str) -> str | None:
    """Why :func:`pick_winner` passed over the leader for ``winner``, for the decision's notes
    (``policy``: "policy=fastest", or "auto" for a performance table's times); None where the leader won."""
    leader = min(timings, key=timings.get, default=winner)
    if winner == leader or leader not in host or winner not in host:
        return None
    return (
        f"{policy}: {leader} led by {timings[winner] / timings[leader] - 1:.1%} but spends "
        f"{host[leader]:.3f} of its {timings[leader]:.3f} ms on the host; {winner} needs "
        f"{host[winner]:.3f} ms there (a near-tie goes to host time to spare)"
    )
