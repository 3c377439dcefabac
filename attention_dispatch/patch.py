"""patch_sdpa(): route ``torch.nn.functional.scaled_dot_product_attention`` through ``ad.sdpa``.

    with ad.patch_sdpa():            # or: ad.patch_sdpa(); ...; ad.unpatch_sdpa()
        model(x)                     # every F.sdpa call of the model runs ad.sdpa (ad.record() shows them)

What is patched: the attribute ``scaled_dot_product_attention`` of the module
``torch.nn.functional``, so every caller that looks it up at call time (``F.scaled_dot_product_attention(...)``,
``torch.nn.functional.scaled_dot_product_attention(...)``, ``nn.MultiheadAttention``'s slow path,
transformers' "sdpa" implementation) is routed. A reference taken before the patch
(``from torch.nn.functional import scaled_dot_product_attention`` at import time) keeps calling
PyTorch, as do ops that never go through it (``nn.TransformerEncoderLayer``'s fused fast path).

Scope, nesting and threads: a module attribute is process-global, so the patch is too: while
any scope is open, calls from every thread are routed (unlike ``ad.use_backends``, which is scoped
per context). The trade-off is deliberate: a caller's code is reached only through that attribute.
Scopes are counted: the first ``patch_sdpa()`` installs the router, nested or concurrent ones
(any thread) add to a count under a lock, and the function that was there before is restored
when the last one ends; a ``with`` block always ends its scope in ``finally``, exceptions included.
``unpatch_sdpa()`` without an open scope is a ``RuntimeError``. If someone else replaced the
attribute after us, the last scope leaves theirs in place (with a warning) instead of undoing it.

Calls that ``ad.sdpa``'s own backends make to PyTorch's function (the ``torch_cpu``, cuDNN and
flash/efficient adapters call ``F.scaled_dot_product_attention``) reach the original: the router
marks the thread while it runs ``ad.sdpa``, a flag that ``torch.compile`` traces (no graph break).

Under ``torch.compile`` the router is traced like the caller's code: compile inside the scope;
a graph compiled inside is guarded on the patched attribute, so a call after the scope recompiles.
The semantics are F.sdpa's for all its arguments (``ad.sdpa`` is a drop-in replacement); where we
differ on purpose (a row with no allowed key gives 0, never NaN; see docs/semantics.md), the routed
call follows ``ad.sdpa``.
"""

from __future__ import annotations

import threading
import warnings

import torch.nn.functional as F

from .api import sdpa

__all__ = ["patch_sdpa", "unpatch_sdpa", "sdpa_patched"]

_lock = threading.Lock()
_open = 0  # scopes open, over all threads
_original = None  # what F.scaled_dot_product_attention was before the first scope
_inside = threading.local()  # .active: this thread is running ad.sdpa for a routed call


def _routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention's signature, run by ``ad.sdpa`` (PyTorch's own function for
    the calls ad.sdpa's backends make while it runs)."""
    if getattr(_inside, "active", False):
        return _original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    _inside.active = True
    try:
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    finally:
        _inside.active = False


_routed_sdpa.__doc__ = (
    (_routed_sdpa.__doc__ or "")
    + "\n\nF.scaled_dot_product_attention:\n"
    + (F.scaled_dot_product_attention.__doc__ or "")
)


class _Scope:
    """One open patch scope; ``with`` ends it on exit (the scope opened when patch_sdpa() was called)."""

    def __init__(self):
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._closed:
            self._closed = True
            unpatch_sdpa()
        return False


def patch_sdpa() -> _Scope:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through ``ad.sdpa`` from now until the
    matching ``unpatch_sdpa()``, or for a ``with`` block: ``with ad.patch_sdpa(): model(x)``.
    Process-global and counted (module doc)."""
    global _open, _original
    with _lock:
        if _open == 0:
            _original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _routed_sdpa
        _open += 1
    return _Scope()


def unpatch_sdpa() -> None:
    """End one ``patch_sdpa()`` scope; the last one restores the function that was there before."""
    global _open
    with _lock:
        if _open == 0:
            raise RuntimeError("unpatch_sdpa(): F.scaled_dot_product_attention is not patched (no open patch_sdpa())")
        _open -= 1
        if _open:
            return
        if F.scaled_dot_product_attention is _routed_sdpa:
            F.scaled_dot_product_attention = _original
        else:
            warnings.warn(
                "unpatch_sdpa(): F.scaled_dot_product_attention was replaced by another patch after "
                "patch_sdpa(); leaving that one in place",
                RuntimeWarning,
                stacklevel=2,
            )
        # _original stays: a thread still inside a routed call reaches it for ad.sdpa's backends


def sdpa_patched() -> bool:
    """Whether a patch_sdpa() scope is open (in any thread)."""
    return _open > 0
