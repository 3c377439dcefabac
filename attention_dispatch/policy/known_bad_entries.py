"""The known-bad list's entries as pydantic models (known_bad.py imports them when it first
parses a list, so ``import attention_dispatch`` never imports pydantic)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict


class Condition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    field: str
    op: Literal["==", "!=", "<", "<=", ">", ">=", "in", "not in"]
    value: Union[bool, int, float, str, tuple[Union[int, str], ...], None]
    modulo: Union[int, None] = None


class Entry(BaseModel):
    """One known-bad entry (validated when a config or the shipped file is read)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str
    library: str = "torch"
    versions: str = ""
    when: tuple[Condition, ...] = ()
    reason: str
    link: str = ""
