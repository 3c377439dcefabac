"""The known-bad list: (backend, library version range, condition on the Problem, reason,
link), shipped as data (known_bad.toml) and extended by the config's [[known_bad]] tables;
a matching entry is one more reason for dispatch.evaluate() ("known bad: cuDNN < 9.15.1 with
Sk % 128 != 0 gives wrong results (pytorch#169849)").

Conditions are data, never code: a Problem field (or field % modulo) compared with a value.
They compare with plain operators, so a decision's seqlen_k span stays provable
(dispatch.seqlen_k_span).  Versions compare by their numeric release parts ("9.15.1",
"2.13.0+cpu" -> 2.13.0); a library that is not installed matches no entry.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import operator
import re
import threading
from importlib import resources
from typing import TYPE_CHECKING, Any

import torch

from ..caches import register_cache
from ..problem import Problem

if TYPE_CHECKING:
    from .known_bad_entries import Condition, Entry

_OPS = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "in": lambda a, b: a in b,
    "not in": lambda a, b: a not in b,
}
FIELDS = frozenset(f.name for f in dataclasses.fields(Problem)) | {"gqa_ratio", "kv_cache", "sequences_match"}


class KnownBadError(ValueError):
    """A known-bad entry is malformed; the message names where it came from."""


_SPEC = re.compile(r"^\s*(<=|>=|==|!=|<|>)\s*([0-9][0-9A-Za-z.+-]*)\s*$")


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.13.0+cpu" -> (2, 13, 0)."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() < len(part):  # "0rc1": the pre-release ends the release
            break
    return tuple(parts)


def _pad(a: tuple[int, ...], n: int) -> tuple[int, ...]:
    return a + (0,) * (n - len(a))


def version_matches(version: str, spec: str) -> bool:
    """Whether `version` satisfies every comparison in `spec` ("" = any)."""
    have = release(version)
    for clause in filter(str.strip, spec.split(",")):
        op, want = _SPEC.match(clause).groups()
        want_t = release(want)
        n = max(len(have), len(want_t))
        if not _OPS[op](_pad(have, n), _pad(want_t, n)):
            return False
    return True


def parse(entries, origin: str) -> tuple[Entry, ...]:
    """Validate raw entries (mappings); raises KnownBadError naming `origin` and the entry."""
    from pydantic import ValidationError

    from .known_bad_entries import Entry

    parsed = []
    for index, raw in enumerate(entries):
        where = f"{origin}: known_bad[{index}]"
        try:
            entry = Entry.model_validate(raw)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(entry)'}: {e['msg']}" for e in err.errors())
            raise KnownBadError(f"{where}: {problems}") from None
        for cond in entry.when:
            if cond.field not in FIELDS:
                raise KnownBadError(
                    f"{where}: unknown Problem field {cond.field!r}; allowed: {', '.join(sorted(FIELDS))}"
                )
            if cond.op in ("in", "not in") and not isinstance(cond.value, tuple):
                raise KnownBadError(f"{where}: op {cond.op!r} needs a list value, got {cond.value!r}")
        for clause in filter(str.strip, entry.versions.split(",")):
            if not _SPEC.match(clause):
                raise KnownBadError(f"{where}: versions {entry.versions!r}: {clause.strip()!r} is not like '<9.15.1'")
        parsed.append(entry)
    return tuple(parsed)


@functools.lru_cache(maxsize=1)
def shipped() -> tuple[Entry, ...]:
    """The package's own list (known_bad.toml)."""
    import tomllib

    text = resources.files(__package__).joinpath("known_bad.toml").read_text()
    return parse(tomllib.loads(text).get("entry", []), "attention_dispatch/policy/known_bad.toml")


_versions: dict[str, str | None] = {}


def library_version(library: str) -> str | None:
    """The installed version of `library` ("torch", "cudnn", "cuda" or a distribution), None if absent."""
    if library not in _versions:
        _versions[library] = _read_version(library)
    return _versions[library]


def _read_version(library: str) -> str | None:
    if library == "torch":
        return torch.__version__
    if library == "cuda":
        return torch.version.cuda
    if library == "cudnn":
        if not torch.backends.cudnn.is_available():
            return None
        v = int(torch.backends.cudnn.version() or 0)
        if not v:
            return None
        # cuDNN 9 encodes major*10000 + minor*100 + patch, cuDNN 8 major*1000 + minor*100 + patch
        major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


_lock = threading.Lock()
_from_config: dict[int, tuple[Any, tuple[Entry, ...]]] = {}  # id(config's raw tuple) -> (it, parsed)


def _clear() -> None:
    _versions.clear()
    with _lock:
        _from_config.clear()


register_cache("known_bad.versions", _clear, lambda: len(_versions) + len(_from_config))


def _configured(raw) -> tuple[Entry, ...]:
    if not raw:
        return ()
    hit = _from_config.get(id(raw))
    if hit is None or hit[0] is not raw:
        hit = (raw, parse(raw, "config"))
        with _lock:
            _from_config[id(raw)] = hit
    return hit[1]


def _value(problem, field: str):
    value = getattr(problem, field)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def holds(cond: Condition, problem) -> bool:
    value = _value(problem, cond.field)
    if value is None and cond.op not in ("==", "!=", "in", "not in"):
        return False  # e.g. compute_capability on the CPU: no order with a number
    if cond.modulo is not None:
        value = value % cond.modulo
    try:
        return bool(_OPS[cond.op](value, cond.value))
    except TypeError:  # a value of another kind (a tuple against an int): the entry does not apply
        return False


def matching(name: str, problem, configured=()) -> list[Entry]:
    """The entries (shipped, then the config's) that apply to backend `name` on `problem`."""
    found = []
    for entry in shipped() + _configured(configured):
        if entry.backend != name:
            continue
        if entry.versions:
            version = library_version(entry.library)
            if version is None or not version_matches(version, entry.versions):
                continue
        if all(holds(cond, problem) for cond in entry.when):
            found.append(entry)
    return found


def reasons(name: str, backend, problem, configured=()) -> list[str]:
    """dispatch.evaluate()'s reasons from the known-bad list for backend `name`."""
    return [f"known bad: {e.reason}" + (f" ({e.link})" if e.link else "") for e in matching(name, problem, configured)]
