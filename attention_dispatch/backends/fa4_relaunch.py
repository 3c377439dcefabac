"""flash-attn 4's dense forward, relaunched for sdpa()'s fast path.

``flash_attn.cute.flash_attn_func`` spends 90-160 us of Python per call on the H100 host
(docs/experiments/perf-notes.md experiment 59) rebuilding arguments that are the same for every call of
one signature, then calls its compiled kernel (~10 us).  At S <= 2k the kernel itself runs
0.1-0.3 ms, so that host time decides whether the GPU waits between calls.  sdpa() prepares
one runner per call signature (shapes, strides, dtypes, device, alignment, grad mode,
options); the runner here lets the first call go through the public function while recording
the compiled call it makes, then repeats that call with each call's tensors and a fresh
output (and, when the signature needs grad, a fresh log-sum-exp, then flash-attn 4's own
backward: :class:`_TrainingCall`, experiment 61).

What is recorded is checked before it is reused: exactly one compiled call made on our query,
whose tensor arguments are our query, key and value, the output it returned and, for
training, the log-sum-exp it returned, and no other tensor anywhere (split-KV partials,
scheduler metadata, aux tensors).  Anything else keeps the public function for this
signature.  The stream is not an argument: flash-attn 4 compiles against the current
("environment") stream, as here.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Callable

import torch

from ..higher_order import refuse_create_graph, refuse_create_graph_through

logger = logging.getLogger("attention_dispatch")
INTERFACE = "flash_attn.cute.interface"
# flash-attn 4 releases whose private forward compile cache (``_flash_attn_fwd.compile_cache``)
# and ``_flash_attn_bwd`` were read and checked here (4.0.0b36 measured on the H100); any other
# release keeps the public function.
TESTED_RELEASES = ("4.0.0b",)


def untested_release(version: str) -> str | None:
    """Why a flash-attn 4 release is not relaunched, or None for a tested one."""
    if any(version.startswith(prefix) for prefix in TESTED_RELEASES):
        return None
    return f"flash-attn 4 {version or '(unknown version)'} is not a tested release ({', '.join(TESTED_RELEASES)}*)"


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

    def __getattr__(self, name):  # anything else the cache offers (clear(), ...)
        return getattr(self.cache, name)


def _holds_tensor(value, depth: int = 0) -> bool:
    """True unless ``value`` is plain data: None, numbers, strings, and tuples (NamedTuples
    such as flash-attn's AuxData), lists and dicts of them.  Anything else may hold device
    state that a relaunch would share between calls, so it counts as a tensor."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return False
    if depth > 4:
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(x, depth + 1) for x in value)
    if isinstance(value, dict):
        return any(_holds_tensor(x, depth + 1) for x in value.values())
    return True


def _same_view(a, b: torch.Tensor) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def refusal(
    calls: list,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    offsets: tuple = (),
) -> str | None:
    """Why the recorded ``calls`` cannot be repeated with new tensors (None: they can).
    ``lse``: the log-sum-exp the public call returned for a backward (training calls);
    ``offsets``: the call's cu_seqlens tensors (varlen), the only other tensors it may take."""
    if not calls:
        return "no compiled call took the caller's query (flash-attn copied it, or its interface changed)"
    if len(calls) > 1:
        return f"the public call made {len(calls)} compiled calls on the query (one expected)"
    args = calls[0][1]
    if len(args) < 5:
        return f"the compiled call took {len(args)} arguments"
    for name, got, ours in (("query", args[0], q), ("key", args[1], k), ("value", args[2], v)):
        if not _same_view(got, ours):
            return f"the compiled call's {name} is not the caller's (flash-attn copied it)"
    if not (_same_view(args[3], out) and out.is_contiguous()):
        return "the compiled call's fourth argument is not the output returned"
    if lse is not None and not (_same_view(args[4], lse) and lse.is_contiguous() and lse.dtype == torch.float32):
        return "the compiled call's fifth argument is not the log-sum-exp returned"
    rest = args[4:] if lse is None else args[5:]
    if _holds_tensor([a for a in rest if not any(_same_view(a, t) for t in offsets)]):
        return (
            "the compiled call takes tensors (or objects that are not plain data) beyond query, key, value, "
            "output" + ("" if lse is None else " and LSE") + (" and offsets" if offsets else "")
        )
    if offsets and not any(_same_view(a, t) for a in rest for t in offsets):
        return "the compiled call does not take the caller's offsets (flash-attn copied them)"
    return None


def dist_version(*names: str) -> str:
    """The first installed distribution's version among ``names``, "" when none is."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except Exception:
            continue
    return ""


def fa4_version(module_version: str) -> str:
    """flash-attn 4's version: its module's, or the installed wheel's where the module says "0.0.0"
    (4.0.0b36's ``__version__`` asks for a distribution "fa4"; the wheel's is "flash-attn-4")."""
    if module_version in ("", "0.0.0"):
        return dist_version("flash-attn-4", "flash_attn_4") or module_version
    return module_version


def _release() -> str:
    """flash-attn 4's version, as the flash_attn backend reads it."""
    return fa4_version(str(getattr(importlib.import_module("flash_attn.cute"), "__version__", "") or ""))


def _recorded_call(public: Callable, args: tuple, kwargs: dict, training: bool = False):
    """``public(*args, **kwargs)`` with flash-attn 4's forward compile cache swapped for a
    :class:`_Recorder` of calls on the query (``args[0]``): (what it returned, the recorded calls, flash-attn 4's
    ``_flash_attn_bwd`` when ``training``, None), or (returned, [], None, why not) when the
    interface lacks what recording needs."""
    why = untested_release(_release())
    if why is not None:
        return public(*args, **kwargs), [], None, why
    try:
        module = importlib.import_module(INTERFACE)
        holder = module._flash_attn_fwd
        cache = holder.compile_cache
        backward = module._flash_attn_bwd if training else None
    except (ImportError, AttributeError) as exc:
        why = f"{INTERFACE}'s _flash_attn_fwd.compile_cache or _flash_attn_bwd not found ({type(exc).__name__})"
        return public(*args, **kwargs), [], None, why
    recorder = _Recorder(cache, args[0].data_ptr())
    with _record_lock:
        holder.compile_cache = recorder
        try:
            returned = public(*args, **kwargs)
        finally:
            holder.compile_cache = cache
    return returned, recorder.calls, backward, None


class ForwardRelauncher:
    """sdpa()'s prepared runner for a flash-attn 4 dense call: (query, key, value) in
    (B, H, S, D) -> (B, Hq, Sq, Dv), flash-attn reading (B, S, H, D) views.  ``public`` is
    ``flash_attn_func``, ``kwargs`` its keyword arguments; ``training``: the signature needs
    grad, and the relaunched forward keeps its log-sum-exp for flash-attn 4's own backward
    (:class:`_TrainingCall`)."""

    __slots__ = ("public", "kwargs", "training", "launch", "backward", "refused")

    def __init__(self, public: Callable, kwargs: dict, training: bool = False):
        self.public, self.kwargs, self.training = public, kwargs, training
        # once recorded: (compiled, its arguments after output [and LSE], output shape, LSE shape or None)
        self.launch = None
        self.backward = None  # flash-attn 4's _flash_attn_bwd (training)
        self.refused = None  # why not, once the recording was refused

    def __call__(self, query, key, value):
        launch = self.launch
        if launch is not None:
            if self.training:
                return _TrainingCall.apply(query, key, value, self)
            # detached as flash-attn does: its kernels take no tensor that requires grad
            q, k, v = (t.detach().transpose(1, 2) for t in (query, key, value))
            compiled, rest, shape, _ = launch
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
            compiled(q, k, v, out, *rest)
            return out.transpose(1, 2)
        # training: the views stay on the autograd graph (flash-attn's own Function runs)
        q, k, v = (t.transpose(1, 2) if self.training else t.detach().transpose(1, 2) for t in (query, key, value))
        if self.refused is not None:
            out = _first(self.public(q, k, v, **self.kwargs)).transpose(1, 2)
        else:
            out = self._record(q, k, v).transpose(1, 2)
        if self.training:  # flash-attn 4's own Function: its gradients have no graph and it does not refuse
            refuse_create_graph_through("flash-attn 4's attention", out)
        return out

    def _record(self, q, k, v) -> torch.Tensor:
        """One public call, recording its compiled launch; its output (B, S, H, D)."""
        returned, calls, backward, reason = _recorded_call(self.public, (q, k, v), self.kwargs, self.training)
        if reason is not None:
            self.refused = reason
            return _first(returned)
        out = _first(returned)
        lse = returned[1] if self.training and isinstance(returned, tuple) and len(returned) > 1 else None
        if self.training and not isinstance(lse, torch.Tensor):
            lse, reason = None, "the public call returned no log-sum-exp"
        else:
            reason = refusal(calls, q, k, v, out, lse)
        if reason is None:
            compiled, args = calls[0]
            kept = 5 if self.training else 4
            self.launch = (compiled, tuple(args[kept:]), tuple(out.shape), None if lse is None else tuple(lse.shape))
            self.backward = backward
        else:
            self.refused = reason
            logger.debug("flash-attn 4 forward not relaunched: %s", reason)
        return out


class VarlenRelauncher:
    """sdpa()'s prepared runner for flash-attn 4 varlen inference: packed (total, H, D)
    query, key, value and each call's int32 offsets -> (total_q, Hq, Dv).  ``public`` is
    ``flash_attn_varlen_func``, ``kwargs`` its keyword arguments (max_seqlen included: part of
    the signature, as are the offsets' shapes and whether one tensor serves queries and keys).
    The first call records the compiled call as :class:`ForwardRelauncher` does, where the
    call's offsets may appear too; later calls repeat it with their own tensors and offsets.
    flash-attn 4 reads nothing of the offsets' values on the host (no data-dependent choice
    to repeat); it copies offsets whose address is not 16-byte aligned, so such a call takes
    the public function.  ``offsets``: the prepared call's (queries', keys'), used by a call
    that passes none (the contract of ``Backend.prepare``)."""

    __slots__ = ("public", "kwargs", "offsets", "launch", "refused")

    def __init__(self, public: Callable, kwargs: dict, offsets: tuple[torch.Tensor, torch.Tensor]):
        self.public, self.kwargs, self.offsets = public, kwargs, offsets
        # once recorded: (compiled, arguments after the output, the positions of the offsets
        # among them (0: queries', 1: keys'), output shape, whether one tensor held both)
        self.launch = None
        self.refused = None

    def __call__(self, query, key, value, *, cu_seqlens_q=None, cu_seqlens_k=None):
        cu_seqlens_q = self.offsets[0] if cu_seqlens_q is None else cu_seqlens_q
        cu_seqlens_k = self.offsets[1] if cu_seqlens_k is None else cu_seqlens_k
        launch = self.launch
        if launch is not None and self._relaunchable(cu_seqlens_q, cu_seqlens_k, launch[4]):
            compiled, rest, positions, shape, _ = launch
            rest = list(rest)
            for at, which in positions:
                rest[at] = cu_seqlens_k if which else cu_seqlens_q
            out = torch.empty(shape, dtype=query.dtype, device=query.device)
            compiled(query.detach(), key.detach(), value.detach(), out, *rest)
            return out
        q, k, v = (t.detach() for t in (query, key, value))
        call = dict(self.kwargs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        if launch is not None or self.refused is not None:
            return _first(self.public(q, k, v, **call))
        returned, calls, _, reason = _recorded_call(self.public, (q, k, v), call)
        out = _first(returned)
        offsets = (cu_seqlens_q, cu_seqlens_k)
        if reason is None and cu_seqlens_q is not cu_seqlens_k and _same_view(cu_seqlens_q, cu_seqlens_k):
            reason = "two offsets tensors over the same memory: which one the compiled call takes is not known"
        reason = reason or refusal(calls, q, k, v, out, None, offsets)
        if reason is None:
            compiled, args = calls[0]
            rest = tuple(args[4:])
            # which offsets sit where: by identity, the queries' first where one tensor serves both
            positions = tuple(
                (i, 0 if _same_view(a, cu_seqlens_q) else 1)
                for i, a in enumerate(rest)
                if any(_same_view(a, t) for t in offsets)
            )
            self.launch = (compiled, rest, positions, tuple(out.shape), cu_seqlens_q is cu_seqlens_k)
        else:
            self.refused = reason
            logger.debug("flash-attn 4 varlen forward not relaunched: %s", reason)
        return out

    @staticmethod
    def _relaunchable(cu_q: torch.Tensor, cu_k: torch.Tensor, shared: bool) -> bool:
        # as recorded: one tensor for both iff it was then; aligned and contiguous, as
        # flash-attn 4 would pass them itself (it copies them otherwise)
        return (
            (cu_q is cu_k) == shared
            and cu_q.is_contiguous()
            and cu_k.is_contiguous()
            and cu_q.data_ptr() % 16 == 0
            and cu_k.data_ptr() % 16 == 0
        )


class _TrainingCall(torch.autograd.Function):
    """flash-attn 4's FlashAttnFunc for a relaunched forward, (B, H, S, D) in and out: the
    forward relaunches the recorded compiled call with a fresh output and LSE; the backward is
    flash-attn 4's ``_flash_attn_bwd``, called with the arguments FlashAttnFunc.backward gives it
    for these keyword arguments (no softcap, score_mod, aux tensors, sinks or returned LSE)."""

    @staticmethod
    def forward(ctx, query, key, value, relauncher):
        q, k, v = (t.detach().transpose(1, 2) for t in (query, key, value))
        compiled, rest, out_shape, lse_shape = relauncher.launch
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        compiled(q, k, v, out, lse, *rest)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.relauncher = relauncher
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_create_graph("flash-attn 4's attention")
        q, k, v, out, lse = ctx.saved_tensors
        relauncher = ctx.relauncher
        kw = relauncher.kwargs
        left, right = kw["window_size"]
        dq, dk, dv = relauncher.backward(
            q,
            k,
            v,
            out,
            grad_out.transpose(1, 2),
            lse,
            kw["softmax_scale"],
            kw["causal"],
            0.0,
            window_size_left=left,
            window_size_right=right,
            deterministic=kw["deterministic"],
        )[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None


def _first(out):
    return out[0] if isinstance(out, tuple) else out


__all__ = ["ForwardRelauncher", "VarlenRelauncher", "refusal", "INTERFACE"]
