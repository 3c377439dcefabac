"""Performance tables: the expected time of each backend per shape bucket on one GPU and one set
of library versions, for ``policy = "auto"`` (the default) and for explain()'s warnings.

A table is a JSON file written by ``python -m attention_dispatch tune`` (attention_dispatch/tune.py):
the environment it measured (GPU name and compute capability, torch, and every registered
backend's ``version()``: Triton, cuDNN, flash-attn, ...), its date, and per bucket
(:func:`bucket_key`: sizes rounded up to powers of two, every feature flag, inference or
training) the lower-quartile milliseconds of each backend it timed.  Tables ship in
``attention_dispatch/tables/`` and are written per user to :func:`user_table_dir`; a user's
table is preferred to a shipped one of the same environment.  policy="fastest" with
``fastest_cache`` set refines the user's table with each bucket it measures (:func:`refine`).

A table applies on the same GPU (name and compute capability) with the same torch; a
backend's times count only where its version now is the one timed (a backend not installed
here is not eligible, so a table measured with flash-attn serves a process without it).  The
table decides a call only where it has a usable time for every eligible backend (the
reference aside) in the call's bucket.  A call whose bucket the table did not measure takes the
ranking of the nearest measured bucket(s) with every field but the sizes equal (:func:`nearest_times`;
within MAX_NEAREST_DISTANCE); otherwise the priority order decides, as with ``policy = "priority"``,
and the Decision says why.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import warnings
from pathlib import Path

import torch

from . import registry
from .caches import register_cache
from .problem import Problem
from .semantics import CausalKind
from .timing import pick_winner, tie_note

logger = logging.getLogger("attention_dispatch")

TABLE_FORMAT = 1
PACKAGE_TABLES = Path(__file__).parent / "tables"


def user_table_dir() -> Path:
    """Where ``tune`` writes and later processes read a user's tables:
    ``$ATTENTION_DISPATCH_CACHE_DIR/tables``, else ``$XDG_CACHE_HOME/attention_dispatch/tables``,
    else ``~/.cache/attention_dispatch/tables``."""
    base = os.environ.get("ATTENTION_DISPATCH_CACHE_DIR")
    if base:
        return Path(base) / "tables"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "attention_dispatch" / "tables"


def user_table_path(environment: "Environment") -> Path:
    """The user's table file for this GPU and torch (one per environment), which ``tune`` and
    policy="fastest"'s :func:`refine` write."""
    gpu = "".join(c if c.isalnum() else "-" for c in environment.gpu).strip("-").lower()
    return user_table_dir() / f"{gpu}-torch{environment.torch.split('+')[0]}.json"


@dataclasses.dataclass(frozen=True)
class Environment:
    """What a table's times depend on besides the call: the GPU and the software."""

    gpu: str
    compute_capability: tuple[int, int]
    torch: str
    backends: tuple[tuple[str, str], ...]  # (name, version()) of each backend timed

    def label(self) -> str:
        """Short, for decision texts: e.g. ``H100 torch 2.11.0 triton 3.6.0``."""
        gpu = self.gpu.replace("NVIDIA ", "").split()[0] if self.gpu else "?"
        triton = dict(self.backends).get("triton", "")
        return f"{gpu} torch {self.torch.split('+')[0]}" + (f" triton {triton}" if triton else "")

    def to_json(self) -> dict:
        return {
            "gpu": self.gpu,
            "compute_capability": list(self.compute_capability),
            "torch": self.torch,
            "backends": dict(self.backends),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Environment":
        return cls(
            str(data["gpu"]),
            tuple(int(x) for x in data["compute_capability"]),  # type: ignore[arg-type]
            str(data["torch"]),
            tuple(sorted((str(k), str(v)) for k, v in dict(data["backends"]).items())),
        )


def backend_versions() -> dict[str, str]:
    """version() of every registered backend now ("" where it is not installed)."""
    out = {}
    for name in registry.list_backends():
        try:
            out[name] = registry.get_backend(name).version()
        except Exception as exc:  # noqa: BLE001 - a broken install has no version
            out[name] = f"unknown ({type(exc).__name__})"
    return out


def device_environment(device: torch.device, names=None) -> Environment | None:
    """This process's Environment on CUDA ``device`` (None off CUDA), with the versions of
    ``names`` (default: every registered backend)."""
    if device.type != "cuda":
        return None
    versions = backend_versions()
    names = sorted(versions) if names is None else sorted(names)
    return Environment(
        torch.cuda.get_device_name(device),
        tuple(torch.cuda.get_device_capability(device)),
        torch.__version__,
        tuple((n, versions.get(n, "")) for n in names),
    )


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


def _window_bucket(window) -> str:
    if window is None:
        return "none"
    return ",".join(str(w if w < 0 else _pow2(w + 1) - 1) for w in window)


def bucket_key(problem: Problem) -> str:
    """The bucket of a call in a table: batch, query heads and lengths rounded up to powers of
    two (window bounds to 2^k - 1), the GQA ratio, head dims, dtype, layout and every feature
    flag exact (bottom-right causal over matching lengths is top-left's bucket)."""
    p = problem
    causal = p.causal.value if p.causal is not None else "none"
    if p.causal == CausalKind.BOTTOM_RIGHT and p.sequences_match:  # the same attention as top-left
        causal = CausalKind.TOP_LEFT.value
    mask = p.mask_kind
    if p.mask_kind != "none":
        pattern = "".join("1" if n == 1 else "n" for n in (p.mask_shape or ()))
        mask += f"[{pattern}]" + ("+grad" if p.mask_requires_grad else "") + ("+fp32" if p.float32_bias else "")
    parts = [
        p.layout,
        str(p.dtype).removeprefix("torch."),
        f"d{p.head_dim_qk}/{p.head_dim_v}",
        f"B{_pow2(p.batch)}",
        f"H{_pow2(p.heads_q)}/g{p.gqa_ratio}",
        f"Sq{_pow2(p.seqlen_q)}",
        f"Sk{_pow2(p.seqlen_k)}",
        f"causal={causal}",
        f"window={_window_bucket(p.window)}",
        f"mask={mask}",
        "dropout" if p.dropout else "no-dropout",
        "training" if p.requires_grad else "inference",
    ]
    if p.deterministic:
        parts.append("deterministic")
    if p.kv_block_size is not None:
        parts.append(f"block{p.kv_block_size}")
    if p.kv_append:
        parts.append("append")
    for name, on in (
        ("softcap", p.softcap),
        ("alibi", p.alibi),
        ("sinks+grad" if p.sinks_grad else "sinks", p.sinks),
        ("lse", p.return_lse),
    ):
        if on:  # unmeasured until a table has these buckets: the priority order decides
            parts.append(name)
    return "|".join(parts)


# A bucket's size fields in bucket_key (batch, query heads / GQA ratio, Sq, Sk): apart from them, two
# buckets of a call and of its nearest neighbour are equal
_SIZE_FIELDS = range(3, 7)


def split_key(key: str) -> tuple[str, tuple[float, float, float, int]] | None:
    """(the key without its size fields, (log2 batch x heads, log2 Sq, log2 Sk, GQA ratio)), or None
    for a key not written by :func:`bucket_key`."""
    parts = key.split("|")
    try:
        batch, (heads, group), sq, sk = int(parts[3][1:]), parts[4][1:].split("/g"), parts[5][2:], parts[6][2:]
        sizes = (math.log2(max(1, batch * int(heads))), math.log2(max(1, int(sq))), math.log2(max(1, int(sk))))
        return "|".join(p for i, p in enumerate(parts) if i not in _SIZE_FIELDS), (*sizes, int(group))
    except (IndexError, ValueError):
        return None


def size_distance(a: tuple, b: tuple) -> float:
    """How far two buckets' sizes are (split_key's): octaves of Sq and Sk, half an octave per
    octave of batch x heads, half for a different GQA ratio."""
    return abs(a[1] - b[1]) + abs(a[2] - b[2]) + 0.5 * abs(a[0] - b[0]) + (0.5 if a[3] != b[3] else 0.0)


# The nearest bucket's ranking stands in for an unmeasured one's this far at most: on the shipped H100
# table, leaving each bucket out, the nearest one(s) chose a backend within 0.95x of the best in 165 of
# 166 buckets (worst 0.950; the priority order: 60 of 178), and S = 64k / 128k training (4.5 / 6.5 away
# from S = 16k) ranked as 16k did (decisions.md)
MAX_NEAREST_DISTANCE = 7.0


@dataclasses.dataclass(frozen=True)
class PerfTable:
    """One table file: where it was read from, what it measured, its entries (bucket key ->
    backend -> expected ms per call) and the host's part of them (bucket key -> backend -> host
    ms per call, from tune's details; empty where the file has none)."""

    path: str
    origin: str  # "package" | "user"
    environment: Environment
    created: str
    entries: dict[str, dict[str, float]]
    host: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def label(self) -> str:
        return f"table {self.environment.label()}"

    @functools.cached_property
    def by_shape(self) -> dict[str, tuple[tuple[tuple, str], ...]]:
        """Entries grouped by split_key's key without sizes: (sizes, key) of each."""
        groups: dict[str, list] = {}
        for key in self.entries:
            split = split_key(key)
            if split is not None:
                groups.setdefault(split[0], []).append((split[1], key))
        return {shape: tuple(found) for shape, found in groups.items()}


def read_table(path: Path, origin: str) -> PerfTable | None:
    """The table in ``path``; None, with a warning, for a file that is not one (corrupt JSON,
    another format version, missing fields): a bad table is ignored, never fatal."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this attention_dispatch reads {TABLE_FORMAT}")
        env = Environment.from_json(data["environment"])
        entries = {
            str(key): {str(n): float(ms) for n, ms in dict(times).items()} for key, times in data["entries"].items()
        }
        host = {
            str(key): {str(n): float(ms) for n, ms in dict(dict(found).get("host_ms") or {}).items()}
            for key, found in dict(data.get("details") or {}).items()
        }
        return PerfTable(str(path), origin, env, str(data.get("created", "")), entries, host)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        warnings.warn(f"attention_dispatch: ignoring performance table {path}: {exc}", RuntimeWarning, stacklevel=2)
        return None


def write_table(path: Path, environment: Environment, created: str, entries: dict, extra: dict | None = None) -> None:
    """Write a table atomically (a temporary file renamed over ``path``): a concurrent reader
    or writer never sees half a file; the last writer wins."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": TABLE_FORMAT, "created": created, "environment": environment.to_json(), "entries": entries}
    if extra:
        data.update(extra)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    tables_found.cache_clear()


def read_extra(path: Path) -> dict:
    """What tune keeps beside the times: "details" (per bucket: row label, host times, failures)
    and "grid" ("full" or "quick"), and the buckets policy="fastest" re-measured ("refined", see
    :func:`refine`); {} for a file that has none."""
    try:
        data = json.loads(Path(path).read_text())
        return {name: data[name] for name in ("details", "grid", "refined") if name in data}
    except (OSError, ValueError, TypeError):
        return {}


@functools.lru_cache(maxsize=1)
def tables_found() -> tuple[PerfTable, ...]:
    """Every readable table: the user's (newest first), then the package's."""
    found = []
    for origin, folder in (("user", user_table_dir()), ("package", PACKAGE_TABLES)):
        try:
            files = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime, reverse=True)
        except OSError:
            continue
        for f in files:
            table = read_table(f, origin)
            if table is not None:
                found.append(table)
    return tuple(found)


def mismatch(table: PerfTable, device: torch.device) -> str | None:
    """Why ``table`` does not apply on ``device`` in this process, or None."""
    env = table.environment
    if device.type != "cuda":
        return f"device {device.type}: tables are measured on CUDA GPUs"
    gpu, cc = torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device))
    if gpu != env.gpu or cc != env.compute_capability:
        return f"GPU {gpu} sm{cc[0]}{cc[1]}, the table measured {env.gpu}"
    if torch.__version__ != env.torch:
        return f"torch {torch.__version__}, the table measured {env.torch}"
    return None


@functools.lru_cache(maxsize=4)
def _versions_now(registry_version: int) -> dict[str, str]:
    return backend_versions()


def stale_backends(table: PerfTable) -> dict[str, str]:
    """Backends whose version now differs from the one the table timed: name -> why.  Their
    times are not used (a backend not installed now is simply not eligible)."""
    now = _versions_now(registry.registry_version())
    return {
        name: f"{name} {now[name]}, the table timed {was}"
        for name, was in table.environment.backends
        if name in now and now[name] and now[name] != was
    }


@functools.lru_cache(maxsize=16)
def _applicable(device: torch.device) -> PerfTable | None:
    for table in tables_found():
        if mismatch(table, device) is None:
            return table
    return None


def applicable_table(device: torch.device) -> PerfTable | None:
    """The first table (user's before package's) whose environment is this process's."""
    if device.type != "cuda":
        return None
    return _applicable(device)


def nearest_times(table: PerfTable, key: str) -> tuple[dict[str, float], tuple[str, ...]] | None:
    """(backend -> ms, the buckets they come from) for an unmeasured bucket ``key``: the measured
    bucket(s) nearest in size (size_distance, at most MAX_NEAREST_DISTANCE) with every other field
    equal; equally near ones give the geometric mean of each backend timed in all of them."""
    split = split_key(key)
    if split is None:
        return None
    shape, sizes = split
    found = [(size_distance(sizes, other), k) for other, k in table.by_shape.get(shape, ())]
    if not found:
        return None
    best = min(d for d, _ in found)
    if best > MAX_NEAREST_DISTANCE:
        return None
    keys = tuple(sorted(k for d, k in found if d == best))
    timed = set.intersection(*(set(table.entries[k]) for k in keys))
    times = {n: math.exp(sum(math.log(table.entries[k][n]) for k in keys) / len(keys)) for n in timed}
    return (times, keys) if times else None


def _sizes_label(key: str) -> str:
    return " ".join(key.split("|")[i] for i in _SIZE_FIELDS)


def host_times(table: PerfTable, keys: tuple[str, ...]) -> dict[str, float]:
    """backend -> host ms per call in the buckets ``keys`` (their mean, for backends with a host
    time in each); {} where the table kept none."""
    found = [table.host.get(k, {}) for k in keys]
    common = set.intersection(*(set(h) for h in found)) if found else set()
    return {n: sum(h[n] for h in found) / len(found) for n in common}


def expected_times(
    problem: Problem, device: torch.device
) -> tuple[PerfTable, dict[str, float], str, dict[str, float]] | None:
    """(the table, backend -> expected ms, where they come from: "" for the call's own bucket, else
    "nearest ..." naming the sizes of the bucket(s) they were measured at, backend -> host ms per
    call in the same bucket(s)), or None (no table applies, or neither this bucket nor one near it
    was measured)."""
    table = applicable_table(device)
    if table is None:
        return None
    key = bucket_key(problem)
    times = table.entries.get(key)
    if times:
        return table, times, "", host_times(table, (key,))
    near = nearest_times(table, key)
    if near is None:
        return None
    return table, near[0], "nearest " + " + ".join(_sizes_label(k) for k in near[1]), host_times(table, near[1])


# explain() says so where the chosen backend is expected this much slower than the fastest
# eligible one, whatever the policy or a forced order chose
SLOW_RATIO = 1.5


# policy="auto" takes a backend that builds a plan per sequence length (Capabilities.plans_per_length)
# only where the fastest other one is more than this much slower, and never for a decode step; one whose
# first call of a shape is slow (Capabilities.first_call_per_shape) only outside decode steps.
# 5% left the default 2-5% behind cuDNN in 5 buckets where the grid read it 0.945-0.965x (docs/decisions.md)
LENGTH_PLAN_MARGIN = 1.02
DECODE_MAX_QUERIES = 16  # an inference call with at most this many queries: a decode or verify step


def _per_length_cost(name: str, decode: bool) -> str:
    """Why backend ``name`` pays per new sequence length in this kind of call, "" when it does not."""
    caps = registry.get_backend(name).capabilities
    return caps.plans_per_length or (caps.first_call_per_shape if decode else "")


def _length_plan_alternative(problem, ranked: list, times: dict) -> tuple[str, str] | None:
    """(the backend to take instead of ``ranked[0]``, why) where ranked[0] builds a plan per
    sequence length and another eligible backend is within LENGTH_PLAN_MARGIN, or the call is a
    decode step (its key length grows by one a call: every step would build one or make a slow
    first call); else None."""
    decode = problem.layout == "dense" and not problem.requires_grad and problem.seqlen_q <= DECODE_MAX_QUERIES
    why = _per_length_cost(ranked[0], decode)
    if not why:
        return None
    others = [n for n in ranked[1:] if not _per_length_cost(n, decode)]
    if not others:
        return None
    ratio = times[others[0]] / times[ranked[0]]
    if not decode and ratio > LENGTH_PLAN_MARGIN:
        return None
    where = "a decode step" if decode else f"within {LENGTH_PLAN_MARGIN:.2f}x ({ratio:.3f}x)"
    return others[0], f"auto: {others[0]} rather than {ranked[0]} ({where}): {why}"


def _cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def table_choice(decision, policy: str):
    """``decision`` (dispatch.Decision) under the table that applies to its call: with ``policy``
    "auto", the eligible backend with the lowest expected time, where the table timed every
    eligible one (the reference aside); under any policy a note where the chosen backend is
    expected over SLOW_RATIO times slower than the fastest eligible one.  Unchanged where no
    table applies (the priority order stands)."""
    p = decision.problem
    if p.device_type != "cuda" or decision.backend is None or not torch.cuda.is_available():
        return decision
    found = expected_times(p, _cuda_device())
    if found is None:
        if policy != "auto":
            return decision
        table = applicable_table(_cuda_device())
        why = (
            "it did not measure this bucket or one near it"
            if table is not None
            else "none for this GPU and these versions"
        )
        note = f"auto: no performance table entry ({why}); priority order"
        return dataclasses.replace(decision, notes=decision.notes + (note,))
    table, times, where, host = found
    stale = stale_backends(table)
    times = {n: ms for n, ms in times.items() if n not in stale}
    ranked = sorted((n for n in decision.eligible if n in times), key=times.__getitem__)
    unmeasured = [n for n in decision.eligible if n not in times and not registry.get_backend(n).reference]
    expected = {n: times[n] for n in ranked}
    source = f"{table.label()}, {where}" if where else table.label()
    text = f"auto ({source}): " + ", ".join(f"{n} {times[n]:.3f} ms" for n in ranked)
    backend, notes = decision.backend, decision.notes
    if policy == "auto" and ranked and not unmeasured:
        # a near-tie goes to host time to spare, as policy="fastest" decides (timing.pick_winner)
        ranked_times = {n: times[n] for n in ranked}
        backend = pick_winner(ranked_times, host)
        notes += (text,)
        tie = tie_note(backend, ranked_times, host, "auto")
        notes += (tie,) if tie else ()
        instead = _length_plan_alternative(p, [backend] + [n for n in ranked if n != backend], times)
        if instead is not None:
            backend = instead[0]
            notes += (instead[1],)
    elif policy == "auto":
        why = "; ".join(stale.get(n, f"{n} not timed in this bucket") for n in unmeasured)
        notes += (f"auto: {table.label()} has no usable time for {', '.join(unmeasured)} ({why}); priority order",)
    if backend in times and ranked and times[backend] > SLOW_RATIO * times[ranked[0]]:
        notes += (
            f"{backend} is expected {times[backend] / times[ranked[0]]:.1f}x slower than {ranked[0]} here "
            f"({text.removeprefix('auto ')})",
        )
    return dataclasses.replace(decision, backend=backend, notes=notes, expected=expected)


def refine(
    problem: Problem, device: torch.device, timings: dict[str, float], host: dict[str, float], failures: dict[str, str]
) -> Path | None:
    """policy="fastest"'s measurement of ``problem`` (with ``fastest_cache`` set) written into the
    user's table for this GPU and these versions (:func:`user_table_path`), so that policy="auto"
    ranks that bucket by it in later processes: the table that applies now (the user's or the
    package's) is copied without its stale backends' times, the call's bucket updated with the
    measured times (a backend not measured keeps its time, one that failed loses it), and the
    file written atomically (concurrent refiners never tear it; the last one wins).  The same
    timing as ``tune``'s (fastest.time_backends).  None off CUDA or with no time."""
    env = device_environment(device)
    if env is None or not timings:
        return None
    base = applicable_table(device)
    entries: dict[str, dict[str, float]] = {}
    extra: dict = {"details": {}, "grid": "refined", "refined": []}
    if base is not None:
        stale = stale_backends(base)
        entries = {k: {n: ms for n, ms in t.items() if n not in stale} for k, t in base.entries.items()}
        extra.update(read_extra(Path(base.path)))
        extra["details"] = {
            k: {**d, "host_ms": {n: ms for n, ms in dict(d.get("host_ms") or {}).items() if n not in stale}}
            for k, d in dict(extra.get("details") or {}).items()
            if isinstance(d, dict)
        }
    key = bucket_key(problem)
    # backends the call could not use (disabled, another order) keep their times; one that failed loses its own
    kept = {n: ms for n, ms in entries.get(key, {}).items() if n not in failures}
    entries[key] = {**kept, **{n: round(ms, 5) for n, ms in timings.items()}}
    kept_host = {
        n: ms
        for n, ms in dict(extra["details"].get(key, {}).get("host_ms") or {}).items()
        if n in kept and n not in timings
    }
    extra["details"][key] = {"row": "policy=fastest", "host_ms": {**kept_host, **host}, "failures": dict(failures)}
    extra["refined"] = sorted({*extra.get("refined", []), key})
    created = (
        base.created
        if base is not None
        else datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    )
    path = user_table_path(env)
    try:
        write_table(path, env, created, entries, extra)
    except OSError as exc:  # a read-only cache directory costs the refinement, never the call
        warnings.warn(f"attention_dispatch: could not refine the performance table {path}: {exc}", RuntimeWarning)
        return None
    forget()
    return path


def forget() -> None:
    """Re-read the tables at the next decision (after tune wrote one, or the cache dir changed)."""
    tables_found.cache_clear()
    _applicable.cache_clear()


register_cache("perf_table.tables", forget, lambda: tables_found.cache_info().currsize)
