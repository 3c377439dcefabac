"""How a row's implementations take turns in rounds: the order of each round (shuffled by
attention_dispatch.timing.turn_order, salted by the row), our policies' turns paired with
their choices', slow turns cut short, and the untimed calls opening a turn."""

from __future__ import annotations

import math

from attention_dispatch import timing


def slow_turns(first: dict[int, tuple[str, float]], factor: float, keep=frozenset()) -> set[int]:
    """The turns whose first-round time (``first``: turn -> (mode, ms)) exceeds ``factor`` times
    the fastest first-round time of the same mode: they cannot be the row's best, so their later
    rounds are skipped (experiment 66).  ``factor`` <= 0 keeps every turn, and so are the turns
    in ``keep``: our own columns, which the targets read (a disturbed first turn had cut
    policy="fastest" to 6 samples in grid efa536c)."""
    if factor <= 0:
        return set()
    best: dict[str, float] = {}
    for mode, ms in first.values():
        best[mode] = min(ms, best.get(mode, ms))
    return {i for i, (mode, ms) in first.items() if ms > factor * best[mode] and i not in keep}


def warm_calls(est_ms: float, warm_ms: float, most: int = 200) -> int:
    """Untimed calls opening a turn: at least one, enough for ``warm_ms`` of device time at
    ``est_ms`` per call, at most ``most`` (host-bound tiny calls)."""
    return max(1, min(most, math.ceil(warm_ms / max(est_ms, 1e-3))))


# The columns of our policies, each timed next to the column of the backend it chose: policy="fastest"
# right after it in even rounds and right before it in odd ones, the default policy ("sdpa") the other
# way round, so both sit next to their choice every round even when they chose the same column.
PAIRED = {"fastest": 1, "sdpa": -1}


def pair_choices(
    order: list[int], turns: list[tuple[str, str]], chosen: dict[tuple[str, str], str], rnd: int
) -> list[int]:
    """``order`` (a round's turn indices) with each PAIRED implementation's turn moved next to the
    turn of the column running the backend it chose (``chosen``: (implementation, mode) -> column),
    on its PAIRED side in even rounds and the other side in odd ones.  ``turns``: (implementation,
    mode) per index.  A choice without a column in the row keeps its place."""
    out = list(order)
    for (impl, mode), column in chosen.items():
        if (impl, mode) not in turns or (column, mode) not in turns:
            continue
        mine = turns.index((impl, mode))
        out.remove(mine)
        at = out.index(turns.index((column, mode)))
        after = (PAIRED[impl] > 0) == (rnd % 2 == 0)
        out.insert(at + 1 if after else at, mine)
    return out


def turn_order(n: int, row_id: str, rnd: int, seed: int) -> list[int]:
    """The order of a row's ``n`` turns in round ``rnd``: the first round as listed, later ones
    shuffled (seeded by the row and round).  A turn's speed depends on the one before it (the
    clock follows the previous implementation, experiment 32); a rotation by one turn per round
    kept almost every predecessor, and the grid's triton column then ran below its sdpa (auto)
    column, the same kernels (experiment 55).  policy="fastest" orders its turns the same way
    (attention_dispatch.timing.turn_order, unsalted)."""
    return timing.turn_order(n, rnd, f"{seed}-{row_id}")
