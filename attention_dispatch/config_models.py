"""The configuration's pydantic models (imported by config.py when a configuration is first
loaded or validated, never by ``import attention_dispatch``: pydantic costs ~0.5 s)."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .backends import BUILTIN_ORDER


class DispatchSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    priority: Union[tuple[str, ...], None] = Field(
        default=None,
        description="candidate order, first wins; omitted: the registry's order (built-ins "
        f"{', '.join(BUILTIN_ORDER)}, custom backends where they were registered)",
    )
    disabled: tuple[str, ...] = Field(default=(), description="backends never chosen")
    policy: Literal["auto", "priority", "fastest"] = Field(
        default="auto",
        description="auto: the lowest expected time in a performance table for this GPU and these "
        "versions (python -m attention_dispatch tune), else the order; priority: first eligible in "
        "order; fastest: measured at run time per shape bucket",
    )
    fastest_cache: Union[str, None] = Field(
        default=None, description="JSON file keeping policy='fastest' measurements across processes"
    )
    deterministic: Union[Literal["auto"], bool] = Field(
        default="auto", description="auto follows torch.are_deterministic_algorithms_enabled()"
    )

    @field_validator("deterministic", mode="before")
    @classmethod
    def _auto_or_bool(cls, value):
        # pydantic's bool would take "yes", "on", 1 and the like as true
        if value == "auto" or isinstance(value, bool):
            return value
        raise ValueError('allowed: "auto", true or false')

    math_fallback: Literal["warn", "allow", "forbid"] = Field(
        default="warn", description="when math is chosen for a CUDA input"
    )
    on_error: Literal["raise", "fallback"] = Field(
        default="raise", description="a backend failing at run time: re-raise, or run the next candidate"
    )


class GuardSection(BaseModel):
    """[guard]: the numerics guard (policy/guard.py); off by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["off", "first", "sample", "strict"] = Field(
        default="off",
        description="first: check the first call of each new decision; sample: that and a fraction of "
        "later calls; strict: every call, raising on a mismatch instead of quarantining the backend",
    )
    sample: float = Field(default=0.01, ge=0.0, le=1.0, description="fraction of later calls checked (sample)")
    sample_verdict: Literal["deferred", "immediate"] = Field(
        default="deferred",
        description="sample: deferred reads a sampled call's verdict once the device has it (no host sync; a "
        "wrong backend is quarantined from a later call, that call's output stays); immediate reads it at "
        "once (a sync each) and re-runs a wrong call on the next candidate",
    )
    rows: int = Field(default=8, ge=1, le=4096, description="query rows recomputed per checked call")
    factor: float = Field(default=2.0, gt=0.0, description="allowed error: factor x the input dtype's own error")


class Config(BaseModel):
    """The whole configuration; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dispatch: DispatchSection = DispatchSection()
    guard: GuardSection = GuardSection()
    # [[known_bad]] entries added to the shipped list (policy/known_bad.py validates them)
    known_bad: tuple[dict[str, Any], ...] = ()
    backends: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Where the order came from when it is not the file's: set by the loader, not by users.
    source: str = Field(default="default", exclude=True)
