"""What the route tests share: whether this is an sm90 GPU, and spies on kernel launches."""

from __future__ import annotations

from typing import Callable

import torch

from attention_dispatch.kernels import run


def sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def watch_launches(monkeypatch, kernel, pick: Callable[[dict], object]) -> list:
    """``pick(constexprs)`` of every launch of ``kernel`` from now on; the launches still run."""
    seen, real = [], run.launch_one

    def spy(launched, grid, args, constexprs, *rest, **options):
        if launched is kernel:
            seen.append(pick(constexprs))
        return real(launched, grid, args, constexprs, *rest, **options)

    monkeypatch.setattr(run, "launch_one", spy)
    return seen


def watch_kinds(monkeypatch) -> list:
    """The configuration kind (configs.FWD, BWD_DV, ...) of every tl launch from now on; they still run."""
    seen, real = [], run.launch_first_fitting

    def spy(kind, *a, **kw):
        seen.append(kind)
        return real(kind, *a, **kw)

    monkeypatch.setattr(run, "launch_first_fitting", spy)
    return seen
