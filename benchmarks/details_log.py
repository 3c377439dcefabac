"""details.log, and the one line of an error that it and the report show."""

from __future__ import annotations

from pathlib import Path


class Log:
    """details.log: every line also printed (flushed), so a killed run leaves its trace."""

    def __init__(self, path: Path | None, echo: bool = True):
        self.f = open(path, "w") if path else None
        self.echo = echo

    def __call__(self, msg: str) -> None:
        if self.f:
            self.f.write(msg + "\n")
            self.f.flush()
        if self.echo:
            print(msg, flush=True)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
