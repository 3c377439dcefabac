"""Direct launches of already compiled Triton kernels.

``kernel[grid](*args, **constexprs)`` goes through Triton's ``JITFunction.run`` on every
call: it re-binds and re-specialises every argument, hashes the specialisation, reads its
knobs and builds launch metadata.  With ~50 arguments that cost ~140 us per launch (E6),
longer than many attention kernels run.  Here the first launch of a specialisation goes
through Triton as usual and returns its ``CompiledKernel``; later launches with the same
specialisation call the compiled kernel's launcher directly.

The key is finer than Triton's own specialisation: each tensor's dtype and 16-byte
alignment, the exact value of every scalar argument, the constexprs, the launch options and
the device.  Two calls with the same key therefore get the same compiled kernel from Triton
too.  The tl kernels take their leading pointers followed by scalars (the common, cheapest
key); the Gluon kernels (gluon/) start with host-built TMA descriptors and are keyed
argument by argument.  A call of another shape keeps Triton's launch path.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

import torch
import triton

from .. import torch_private
from ..caches import register_cache

try:  # descriptors built on the host: Triton's launcher encodes their tensormaps
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton < 3.3
    TensorDescriptor = None

try:  # Gluon's host-built descriptors (they carry their shared-memory layout)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:  # pragma: no cover - Triton without Gluon
    GluonDescriptor = None

try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - Triton < 3.4 keeps hooks on CompiledKernel
    _knobs = None

# Entries beyond this (e.g. varlen batches whose max_seqlen changes every step) flush the cache.
MAX_ENTRIES = 4096


def leading_tensors(args) -> int:
    """How many leading arguments are tensors (our kernels take their pointers first)."""
    n = 0
    for a in args:
        if not isinstance(a, torch.Tensor):
            break
        n += 1
    return n


def specialization_key(args, n_tensors: int) -> tuple:
    """What Triton's specialisation can depend on, finer than Triton itself: dtype and
    16-byte alignment of each leading tensor, the exact value of every other argument."""
    return tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in args[:n_tensors]]), args[n_tensors:]


def is_descriptor(a) -> bool:
    """A host-built TMA descriptor (tl's or Gluon's)."""
    return (TensorDescriptor is not None and isinstance(a, TensorDescriptor)) or (
        GluonDescriptor is not None and isinstance(a, GluonDescriptor)
    )


def _descriptor_key(a):
    """A host-built TMA descriptor (an unhashable dataclass) as what its compiled form can
    depend on, finer than Triton: its base's dtype, its shape, strides, block, padding and
    (Gluon) shared-memory layout (its base is 16-byte aligned by construction); any other
    argument unchanged."""
    if not is_descriptor(a):
        return a
    return (
        "tensordesc",
        a.base.dtype,
        tuple(a.shape),
        tuple(a.strides),
        tuple(a.block_shape),
        a.padding,
        getattr(a, "layout", None),
    )


def _argument_key(a):
    """One argument of a descriptor-first (Gluon) kernel: a tensor by dtype and 16-byte
    alignment, a descriptor by :func:`_descriptor_key`, anything else by value."""
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dtype, a.data_ptr() & 15 == 0)
    return _descriptor_key(a)


def rebase(descriptor, base: torch.Tensor):
    """The same host-built descriptor over another tensor of the same dtype, shape and strides.
    Only the base changes, so of the constructor's checks (shape, strides, block, layout:
    ~5 us per descriptor, 15 descriptors per training call, E57) only the base's 16-byte
    alignment is repeated; every other field is copied as it is."""
    if base.dtype == descriptor.base.dtype and base.data_ptr() & 15 == 0:
        copy = object.__new__(type(descriptor))
        copy.__dict__.update(descriptor.__dict__)
        copy.base = base
        return copy
    if GluonDescriptor is not None and isinstance(descriptor, GluonDescriptor):
        return GluonDescriptor(
            base, descriptor.shape, descriptor.strides, descriptor.block_shape, descriptor.layout, descriptor.padding
        )
    return TensorDescriptor(base, descriptor.shape, descriptor.strides, descriptor.block_shape, descriptor.padding)


def detached(descriptor):
    """The descriptor over an empty tensor of its dtype and device: what a captured launch keeps
    (every field but the base), so that it does not hold the captured call's tensor alive."""
    return rebase(descriptor, torch.empty(0, dtype=descriptor.base.dtype, device=descriptor.base.device))


_get_device = torch_private.cuda_device
_get_raw_stream = torch_private.cuda_raw_stream  # None (Triton's own query) unless both are on


def current_stream():
    """The stream Triton's own launch would use (the current device's current stream).  Triton
    asks ``torch.cuda.current_device()``, whose lazy-initialisation check is ~0.5 us of host
    time per call on the H100 machine; a relaunched entry had its first launch through Triton,
    so CUDA is initialised and the raw C calls give the same stream."""
    if _get_raw_stream is not None:
        return _get_raw_stream(_get_device())
    drv = triton.runtime.driver.active
    return drv.get_current_stream(drv.get_current_device())


def _hook_set(hook) -> bool:
    # Triton >= 3.4 keeps an always-present HookChain (empty when nothing is installed)
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def hooks_installed() -> bool:
    """Profilers (e.g. proton) install launch hooks that need Triton's own launch path."""
    if _knobs is None:
        return True
    rt = _knobs.runtime
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


# Set by :meth:`CompiledLaunchCache.capture`: every launch appends what relaunches it.
_capture: contextvars.ContextVar = contextvars.ContextVar("attention_dispatch_launch_capture", default=None)


class CompiledLaunchCache:
    """One cache per process: (kernel, device, constexprs, options, specialisation) ->
    (launcher, CUDA function, packed metadata, constexpr values in signature order)."""

    def __init__(self):
        self._entries: dict = {}
        self._n_tensors: dict = {}
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self._entries.clear()
        self._n_tensors.clear()
        self.hits = self.misses = 0

    def launch(self, kernel, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int, **options):
        """Launch ``kernel[grid](*args, **constexprs, num_warps=, num_stages=, **options)``.
        ``args`` are the leading positional parameters (the first a tensor on the launch's
        device, or a host-built descriptor over one), ``constexprs`` every remaining parameter,
        ``options`` further launch options (e.g. ``maxnreg``)."""
        n_tensors = self._n_tensors.get(kernel)
        if n_tensors is None:
            n_tensors = self._n_tensors[kernel] = leading_tensors(args)
        if n_tensors:
            key = (
                kernel,
                args[0].device,
                tuple(constexprs.items()),
                num_warps,
                num_stages,
                tuple(options.items()),
                specialization_key(args, n_tensors),
            )
            try:
                entry = self._entries.get(key)
            except TypeError:  # unhashable: host-built descriptors among the scalars (kept off the common path)
                key = key[:-1] + ((key[-1][0], tuple(map(_descriptor_key, key[-1][1]))),)
                entry = self._entries.get(key)
        else:  # a descriptor-first (Gluon) kernel
            key = (
                kernel,
                args[0].base.device,
                tuple(constexprs.items()),
                num_warps,
                num_stages,
                tuple(options.items()),
                tuple(map(_argument_key, args)),
            )
            entry = self._entries.get(key)
        if entry is not None and not hooks_installed():
            self.hits += 1
            relaunch(entry, grid, args)
            self.record(entry, grid, args, constexprs)
            return
        self.misses += 1
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **options)
        order = constexpr_order(kernel, len(args), constexprs)
        launcher = getattr(compiled, "run", None)  # the launcher, loaded by the launch above
        # tensors after the leading ones are keyed by identity in the common key: not cacheable there
        cacheable = (
            order is not None
            and launcher is not None
            and getattr(compiled, "function", None) is not None
            and leading_tensors(args) == n_tensors
            and (n_tensors == 0 or not any(isinstance(a, torch.Tensor) for a in args[n_tensors:]))
        )
        if cacheable:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            # the key holds the constexprs: their values, in signature order, are fixed per entry
            tail = tuple(constexprs[n] for n in order)
            self._entries[key] = entry = (launcher, compiled.function, compiled.packed_metadata, tail)
        self.record(entry if cacheable else None, grid, args, constexprs)

    @staticmethod
    def record(entry, grid, args, constexprs) -> None:
        """Add a launch to the active :meth:`capture` (the interpreter's launches, which skip
        this cache, are added this way by tests that replay them)."""
        sink = _capture.get()
        if sink is not None:
            sink.append((entry, tuple(grid), args, constexprs))

    @staticmethod
    @contextlib.contextmanager
    def capture():
        """Collect ``(entry or None, grid, args, constexprs)`` for every launch in the block
        (entry: what :func:`relaunch` takes; None when the launch cannot be repeated directly)."""
        sink: list = []
        token = _capture.set(sink)
        try:
            yield sink
        finally:
            _capture.reset(token)

    def __len__(self) -> int:
        return len(self._entries)


def relaunch(entry, grid: tuple, args) -> None:
    """Launch a captured entry again with new leading arguments of the same specialisation."""
    launcher, function, metadata, tail = entry
    launcher(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        current_stream(),
        function,
        metadata,
        None,
        None,
        None,
        *args,
        *tail,
    )


# Tensormaps kept per descriptor argument of a DirectLaunch (one per base address seen).
MAX_TENSORMAPS = 64


def _direct_parts(launcher):
    """(raw launch, {signature index: descriptor metadata}, encoder) of a launcher built the way
    Triton 3.6's CudaLauncher is: ``launcher.launch`` wraps the C launch in a closure that
    turns every descriptor argument into ``make_tensordesc_arg(descriptor, metadata)``'s
    values, after ``_BASE_ARGS_FORMAT_LEN`` (13) leading arguments, and no scratch memory is
    allocated per launch.  None for any other launcher (other Triton versions, kernels without
    host-built descriptors or needing scratch): those keep :func:`relaunch`."""
    wrapper = getattr(launcher, "launch", None)
    code, closure = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    driver = sys.modules.get(type(launcher).__module__)
    encode = getattr(driver, "make_tensordesc_arg", None)
    if (
        code is None
        or not closure
        or encode is None
        or getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != 13
        or getattr(getattr(encode, "__code__", None), "co_argcount", None) != 2
        or getattr(launcher, "global_scratch_size", 1)
        or getattr(launcher, "profile_scratch_size", 1)
    ):
        return None
    cells = dict(zip(code.co_freevars, closure))
    try:
        raw, indices, metas = (cells[n].cell_contents for n in ("launcher", "tensordesc_indices", "tensordesc_meta"))
    except (KeyError, ValueError):
        return None
    if not callable(raw) or not indices or not metas or len(metas) != len(indices) or None in metas:
        return None
    return raw, dict(zip(sorted(indices), metas)), encode


class DirectLaunch:
    """A captured launch of a kernel taking host-built TMA descriptors, repeated over new
    tensors below Triton's per-launch descriptor handling.  Triton 3.6 encodes every
    descriptor's tensormap again on every launch (a Python expansion and a driver call, ~2-3 us
    each; a Gluon training call has 15, E63), although a tensormap depends only on
    the base address once dtype, shape, strides, block and layout are fixed, as they are for a
    captured launch.  Each descriptor argument keeps the tensormaps of the last
    ``MAX_TENSORMAPS`` addresses it saw (the caching allocator hands a training loop the same
    few addresses step after step); the values passed to the C launch are exactly the ones
    Triton's wrapper would pass (``make_tensordesc_arg`` of the descriptor over the new base)."""

    __slots__ = ("raw", "encode", "template", "pointers", "descriptors", "hits", "misses")

    def __init__(self, raw, encode, template, pointers, descriptors):
        self.raw, self.encode, self.template, self.pointers, self.descriptors = (
            raw,
            encode,
            template,
            pointers,
            descriptors,
        )
        self.hits = self.misses = 0

    @classmethod
    def build(cls, entry, grid: tuple, params: tuple, pointers: dict, descriptors: dict) -> "DirectLaunch | None":
        """``entry``: a compiled-cache entry; ``params``: the launch's positional arguments as
        captured; ``pointers``: {argument position: pool index} of the tensors passed by address;
        ``descriptors``: {argument position: pool index} of the descriptors (each rebuilt over
        that pool tensor).  None when the entry's launcher is not one :func:`_direct_parts`
        knows, or its descriptor arguments are not exactly ``descriptors``."""
        if entry is None:
            return None
        launcher, function, metadata, tail = entry
        parts = _direct_parts(launcher)
        if parts is None:
            return None
        raw, metas, encode = parts
        if set(metas) != set(descriptors) or set(pointers) & set(descriptors):
            return None
        values = [*params, *tail]
        head = [
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            None,
            function,
            launcher.launch_cooperative_grid,
            launcher.launch_pdl,
            None,
            None,
            metadata,
            None,
            None,
            None,
        ]
        template, slots, descs = list(head), [], []
        for pos, value in enumerate(values):
            if pos in descriptors:
                expanded = encode(value, metas[pos])  # the captured call's tensormap seeds the cache
                descs.append(
                    (
                        len(template),
                        len(template) + len(expanded),
                        descriptors[pos],
                        detached(value),
                        metas[pos],
                        {value.base.data_ptr(): expanded},
                    )
                )
                template.extend(expanded)
            elif pos in pointers:  # filled per call (no reference to the captured tensor kept)
                slots.append((len(template), pointers[pos]))
                template.append(None)
            else:
                template.append(value)
        return cls(raw, encode, template, tuple(slots), tuple(descs))

    def __call__(self, addresses: list, pool: tuple) -> None:
        args = self.template.copy()
        args[3] = current_stream()
        for at, i in self.pointers:
            args[at] = addresses[i]
        for lo, hi, i, descriptor, meta, maps in self.descriptors:
            address = addresses[i]
            values = maps.get(address)
            if values is None:
                self.misses += 1
                if len(maps) >= MAX_TENSORMAPS:
                    maps.clear()
                values = maps[address] = self.encode(rebase(descriptor, pool[i]), meta)
            else:
                self.hits += 1
            args[lo:hi] = values
        self.raw(*args)


def constexpr_order(kernel, n_positional: int, constexprs: dict):
    """Names of the parameters after the positional ones, in signature order, when they are
    exactly the given constexprs (else None: that kernel keeps Triton's launch path)."""
    names = getattr(kernel, "arg_names", None)
    if names is None or len(names) != n_positional + len(constexprs):
        return None
    rest = names[n_positional:]
    if set(rest) != set(constexprs):
        return None
    return tuple(rest)


COMPILED = CompiledLaunchCache()
register_cache("kernels.compiled_cache.COMPILED", COMPILED.clear, lambda: len(COMPILED._entries))
