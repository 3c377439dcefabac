"""flash-attn 4's inference forward, relaunched for sdpa()'s fast path.

``flash_attn.cute.flash_attn_func`` spends 90-160 us of Python per call on the H100 host
(docs/perf-notes.md experiment 59) rebuilding arguments that are the same for every call of
one signature, then calls its compiled kernel (~10 us).  At S <= 2k the kernel itself runs
0.1-0.3 ms, so that host time decides whether the GPU waits between calls.  sdpa() prepares
one runner per call signature (shapes, strides, dtypes, device, alignment, grad mode,
options); for a forward without autograd, the runner here lets the first call go through the
public function while recording the compiled call it makes, then repeats that call with each
call's tensors and a fresh output.

What is recorded is checked before it is reused: exactly one compiled call made on our query,
whose tensor arguments are our query, key and value and the output it returned, and no other
tensor anywhere (an LSE kept for a backward, split-KV partials, scheduler metadata, aux
tensors).  Anything else keeps the public function for this signature.  The stream is not an
argument: flash-attn 4 compiles against the current ("environment") stream, as here.
"""
from __future__ import annotations

import importlib
import logging
import threading
from typing import Callable

import torch

logger = logging.getLogger("attention_dispatch")
INTERFACE = "flash_attn.cute.interface"
# Recording swaps one attribute of flash-attn 4's module (its forward's compile cache) for
# the length of one call and puts it back; recordings take turns.  Other threads calling
# flash-attn 4 meanwhile go through the recorder to the same cache, unrecorded.
_record_lock = threading.Lock()


class _Recorder:
    """Stands in for ``_flash_attn_fwd.compile_cache`` during one public call: lookups and
    stores reach the real cache; compiled calls whose first argument is our query (same
    storage) are recorded, then made."""

    def __init__(self, cache, query_ptr: int):
        self.cache, self.query_ptr, self.calls = cache, query_ptr, []

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, compiled) -> None:
        self.cache[key] = compiled

    def __getitem__(self, key):
        compiled = self.cache[key]

        def call(*args):
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.data_ptr() == self.query_ptr:
                self.calls.append((compiled, args))
            return compiled(*args)
        return call

    def __getattr__(self, name):   # anything else the cache offers (clear(), ...)
        return getattr(self.cache, name)


def _holds_tensor(value, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 4:
        return True    # deeper than flash-attn's argument tuples go: not understood, refuse
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(x, depth + 1) for x in value)
    if isinstance(value, dict):
        return any(_holds_tensor(x, depth + 1) for x in value.values())
    if value is None or isinstance(value, (bool, int, float, str)):
        return False
    fields = getattr(value, "__dict__", None)
    return fields is not None and any(_holds_tensor(x, depth + 1) for x in fields.values())


def _same_view(a, b: torch.Tensor) -> bool:
    return (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def refusal(calls: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> str | None:
    """Why the recorded ``calls`` cannot be repeated with new tensors (None: they can)."""
    if not calls:
        return "no compiled call took the caller's query (flash-attn copied it, or its interface changed)"
    if len(calls) > 1:
        return f"the public call made {len(calls)} compiled calls on the query (one expected)"
    args = calls[0][1]
    if len(args) < 4:
        return f"the compiled call took {len(args)} arguments"
    for name, got, ours in (("query", args[0], q), ("key", args[1], k), ("value", args[2], v)):
        if not _same_view(got, ours):
            return f"the compiled call's {name} is not the caller's (flash-attn copied it)"
    if not (_same_view(args[3], out) and out.is_contiguous()):
        return "the compiled call's fourth argument is not the output returned"
    if _holds_tensor(args[4:]):
        return "the compiled call takes tensors beyond query, key, value and output"
    return None


class ForwardRelauncher:
    """sdpa()'s prepared runner for a flash-attn 4 forward without autograd:
    (query, key, value) in (B, H, S, D) -> (B, Hq, Sq, Dv), flash-attn reading (B, S, H, D)
    views.  ``public`` is ``flash_attn_func``, ``kwargs`` its keyword arguments."""

    __slots__ = ("public", "kwargs", "launch", "refused")

    def __init__(self, public: Callable, kwargs: dict):
        self.public, self.kwargs = public, kwargs
        self.launch = None    # (compiled, its arguments after the output, output shape) once recorded
        self.refused = None   # why not, once the recording was refused

    def __call__(self, query, key, value):
        # detached as flash-attn does: its kernels take no tensor that requires grad
        q, k, v = (t.detach().transpose(1, 2) for t in (query, key, value))
        launch = self.launch
        if launch is not None:
            compiled, rest, shape = launch
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
            compiled(q, k, v, out, *rest)
            return out.transpose(1, 2)
        if self.refused is not None:
            return _first(self.public(q, k, v, **self.kwargs)).transpose(1, 2)
        return self._record(q, k, v).transpose(1, 2)

    def _record(self, q, k, v) -> torch.Tensor:
        """One public call, recording its compiled launch; its output (B, S, H, D)."""
        try:
            holder = importlib.import_module(INTERFACE)._flash_attn_fwd
            cache = holder.compile_cache
        except (ImportError, AttributeError) as exc:
            self.refused = f"{INTERFACE}._flash_attn_fwd.compile_cache not found ({type(exc).__name__})"
            return _first(self.public(q, k, v, **self.kwargs))
        recorder = _Recorder(cache, q.data_ptr())
        with _record_lock:
            holder.compile_cache = recorder
            try:
                out = _first(self.public(q, k, v, **self.kwargs))
            finally:
                holder.compile_cache = cache
        reason = refusal(recorder.calls, q, k, v, out)
        if reason is None:
            compiled, args = recorder.calls[0]
            self.launch = (compiled, tuple(args[4:]), tuple(out.shape))
        else:
            self.refused = reason
            logger.debug("flash-attn 4 forward not relaunched: %s", reason)
        return out


def _first(out):
    return out[0] if isinstance(out, tuple) else out


__all__ = ["ForwardRelauncher", "refusal", "INTERFACE"]
