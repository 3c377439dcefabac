"""Debug API: last_decision(), record(), logging setup, info tables."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os

from . import registry
from .dispatch import Decision

logger = logging.getLogger("attention_dispatch")
ENV_LOG = "ATTENTION_DISPATCH_LOG"

_last: contextvars.ContextVar[Decision | None] = contextvars.ContextVar("attention_dispatch_last", default=None)
_recorders: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar("attention_dispatch_record", default=())


def last_decision() -> Decision | None:
    """The Decision of the latest sdpa() call in this thread / context (None before any)."""
    return _last.get()


def note_decision(decision: Decision) -> None:
    """Called by sdpa() for every call: remember it and hand it to active recorders."""
    _last.set(decision)
    for sink in _recorders.get():
        sink.append(decision)


@contextlib.contextmanager
def record():
    """Collect the Decision of every sdpa() call in the block: `with record() as ds: ...`."""
    sink: list[Decision] = []
    token = _recorders.set(_recorders.get() + (sink,))
    try:
        yield sink
    finally:
        _recorders.reset(token)


def configure_logging_from_env() -> None:
    """ATTENTION_DISPATCH_LOG=debug|info|warning: log decisions to stderr at that level."""
    level = os.environ.get(ENV_LOG, "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"{ENV_LOG}={level.lower()!r}; allowed: debug, info, warning, error")
    logger.setLevel(level)
    if not any(getattr(h, "_attention_dispatch", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
        handler._attention_dispatch = True
        logger.addHandler(handler)


def backend_table(markdown: bool = False, line_width: int = 120) -> str:
    """Every registered backend: availability (or why not), version, and its capabilities.
    The text table never cuts a value: its backend columns come in blocks of at most
    ``line_width`` characters (one backend per block where a single one is wider)."""
    names = registry.list_backends()
    backends = [registry.get_backend(n) for n in names]
    status = []
    for b in backends:
        if b.is_available():
            status.append("available")
        else:
            status.append("unavailable: " + (b.unavailable_reason() or "?"))
    versions = [b.version() or "-" for b in backends]
    features = [row[0] for row in backends[0].capabilities.rows()] if backends else []
    values = [dict(b.capabilities.rows()) for b in backends]
    if markdown:
        out = ["| backend | status | version |", "|---|---|---|"]
        out += [f"| `{n}` | {s} | {v} |" for n, s, v in zip(names, status, versions)]
        out += ["", "| feature | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
        out += [f"| {f} | " + " | ".join(val[f] for val in values) + " |" for f in features]
        notes = [f"- `{b.name}`: {b.capabilities.notes}" for b in backends if b.capabilities.notes]
        if notes:
            out += ["", *notes]
        return "\n".join(out) + "\n"
    out = []
    width = max(len(n) for n in names)
    vwidth = max(len(v) for v in versions)
    for n, s, v in zip(names, status, versions):
        out.append(f"{n:<{width}}  {v:<{vwidth}}  {s}")
    out.append("")
    col = max(len(f) for f in features) if features else 0
    cell = [max(len(n), *(len(val[f]) for f in features)) for n, val in zip(names, values)]
    for block in _column_blocks(cell, line_width - col - 2):
        out.append(" " * col + "  " + "  ".join(f"{names[i]:<{cell[i]}}" for i in block).rstrip())
        for f in features:
            out.append(f"{f:<{col}}  " + "  ".join(f"{values[i][f]:<{cell[i]}}" for i in block).rstrip())
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def _column_blocks(widths: list[int], room: int) -> list[list[int]]:
    """Consecutive column indices grouped so that each group's columns (2 spaces before
    each) fit in ``room``; a column wider than ``room`` stands alone."""
    blocks: list[list[int]] = []
    used = room
    for i, w in enumerate(widths):
        if used + 2 + w > room:
            blocks.append([])
            used = 0
        blocks[-1].append(i)
        used += 2 + w
    return blocks
