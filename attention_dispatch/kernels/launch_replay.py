"""One call's kernel launches captured and relaunched over a later call's tensors (Replay): the
record the training and inference plans (replay.py) and the KV-cache forward's plan (decode.py)
replay.  Imports no launch logic, so the kernels' entry points can use it without a cycle."""

from __future__ import annotations

import torch

from .compiled_cache import DirectLaunch, detached, is_descriptor, rebase, relaunch
from .device import is_interpreter, run_with_scratch
from .static_buffers import is_static


class Replay:
    """Kernel launches captured during one call (``COMPILED.capture``), relaunched over the
    tensors of a later call of the same signature.  Every tensor argument and every host-built
    descriptor's base is found by identity in the call's ``pool`` (its inputs and outputs in a
    fixed order), or is one of the package's constant buffers (static_buffers.is_static: kept as
    it is); :meth:`capture` returns None when a launch cannot be repeated that way (another
    tensor outside the pool: a dropout seed, a workspace, a converted output; or a launch
    without a relaunch entry).  Outputs are the caller's to allocate: each replay gets fresh
    ones, which the captured kernels must write whole."""

    __slots__ = ("steps", "device", "addresses")

    def __init__(self, steps: tuple, device: torch.device, addresses: bool):
        self.steps, self.device, self.addresses = steps, device, addresses

    @classmethod
    def capture(cls, launches: list, pool: tuple, device: torch.device) -> "Replay | None":
        def index(t):
            return next((i for i, x in enumerate(pool) if x is t), None)

        steps = []
        for entry, grid, args, constexprs in launches:
            if entry is None:
                return None
            sources = []  # the leading tensors, as pool indices
            for a in args:
                if not isinstance(a, torch.Tensor):
                    break
                idx = index(a)
                if idx is None:
                    return None
                sources.append(idx)
            # (argument position, pool index, descriptor or None for the tensor itself): host-built
            # descriptors (the tl forward's K/V, every Gluon operand) and pointers after the leading ones
            patches = []
            for pos, a in enumerate(args[len(sources) :], len(sources)):
                desc = is_descriptor(a)
                if not desc and isinstance(a, torch.Tensor) and is_static(a):
                    continue  # a constant buffer of the package (static_buffers): relaunched as it is
                if desc or isinstance(a, torch.Tensor):
                    idx = index(a.base if desc else a)
                    if idx is None:
                        return None
                    patches.append((pos, idx, detached(a) if desc else None))
            patched = {pos for pos, _, _ in patches}
            direct = (
                None
                if is_interpreter()
                else DirectLaunch.build(
                    entry,
                    grid,
                    tuple(args),
                    dict(enumerate(sources)) | {pos: i for pos, i, d in patches if d is None},
                    {pos: i for pos, i, d in patches if d is not None},
                )
            )
            steps.append(
                (
                    entry,
                    tuple(grid),
                    tuple(sources),
                    # patched positions hold nothing of the captured call (its tensors stay the caller's)
                    tuple(None if pos in patched else a for pos, a in enumerate(args) if pos >= len(sources)),
                    tuple(patches),
                    constexprs.get("USE_DESC", False),
                    direct,
                )
            )
        # addresses as ints for the compiled launcher; the interpreter (CPU tests) needs tensors
        return cls(tuple(steps), device, not is_interpreter()) if steps else None

    @property
    def patches(self) -> tuple:
        """Every step's patches (tests read which descriptors are rebuilt)."""
        return tuple(p for step in self.steps for p in step[4])

    def __call__(self, pool: tuple) -> None:
        # Triton's launcher takes an int as the address itself; for a tensor it calls data_ptr()
        # and cuPointerGetAttribute, once per pointer argument (the dummies repeat q)
        addrs = [t.data_ptr() for t in pool] if self.addresses else pool
        for entry, grid, sources, rest, patches, desc, direct in self.steps:
            if direct is not None:  # descriptors' tensormaps kept per address (compiled_cache.DirectLaunch)
                direct(addrs, pool)
                continue
            args = (*[addrs[i] for i in sources], *rest)
            if patches:  # descriptors and later pointers: the same ones over the new tensors
                args = list(args)
                for pos, i, d in patches:
                    args[pos] = addrs[i] if d is None else rebase(d, pool[i])
            run_with_scratch(self.device, desc, relaunch, entry, grid, args)
