"""Issue 36's features through flash-attn 2, 3 and 4: softcap, ALiBi slopes, attention sinks
and the returned logsumexp.  What each generation declares (from the signatures of the
functions it installed), why it refuses a call, the keywords a call passes, and its
logsumexp turned into ours.

Read in the libraries' source (Dao-AILab/flash-attention; flash-attn 2 at v2.8.3 / 0251105a,
flash-attn 3 ``hopper/`` at 0251105a, flash-attn 4 in the 4.0.0b36 wheel):

- softcap, all three: the *scaled* score is capped, ``softcap * tanh(softmax_scale * qk /
  softcap)``, before masks and ALiBi (flash-attn 2: flash_api.cpp set_params_fprop passes
  ``softmax_scale / softcap`` to the kernel's tanh and ``softcap`` as the softmax scale;
  flash-attn 3: mainloop_fwd_sm90_tma_gmma_ws.hpp:543-562, the same; flash-attn 4:
  utils.create_softcap_scoremod after ``score * softmax_scale``, softmax.apply_score_mod_inner),
  with its gradient.  Our ``s = softcap * tanh(scale <q, k> / softcap)``: the same function.
  flash-attn 2 refuses softcap with dropout ("Softcapping does not support dropout for now").
- alibi_slopes, flash-attn 2 only: fp32 ``(nheads,)`` or ``(batch, nheads)`` with a unit last
  stride (a stride-0 batch is read as such, flash_api.cpp set_params_alibi), bias
  ``-slope * |i + Sk - Sq - j|`` per sequence (mask.h), ours with off = Sk - Sq; the slopes are
  divided by the softmax scale in the kernel so that the bias is added to the scaled (and
  capped) score.  Causal calls add ``slope * j`` instead (mask.h, Is_causal): the same softmax,
  but a logsumexp larger by ``slope * (i + Sk - Sq)`` per row, so return_lse with ALiBi and
  causal is refused.
- sinks, flash-attn 4 only: ``learnable_sink`` (float16/bfloat16/float32 ``(nheads,)`` from
  4.0.0b26, which also brought its gradient in ``_flash_attn_bwd``; before that bfloat16 only
  and no gradient: not claimed).  One more column per head in the softmax denominator, O = 0
  for an empty row (softmax.apply_learnable_sink), as ours.  Its logsumexp includes the sink
  (an empty row's is the sink), ours leaves it out: return_lse with sinks is refused.
- the logsumexp: flash-attn 2 and 3 return it with ``return_attn_probs=True`` as
  ``(out, softmax_lse, ...)``, float32 (B, H, Sq) dense, (H, total_q) varlen (flash-attn 2 from
  2.6.0; before it is padded to (B, H, max_seqlen_q)); their backward ignores its gradient
  (``backward(ctx, dout, *args)``): forward only (lse_grad False; the dispatcher refuses a
  return_lse call that needs gradients).  flash-attn 2 marks an empty row +inf (softmax.h
  normalize_softmax_lse, flash_fwd_kernel.h, mha_fwd for Sk = 0): turned into our -inf.
  flash-attn 2 returns it alongside the (B, H, Sq, Sk) probabilities when dropout_p > 0:
  refused.  flash-attn 3 writes -inf (softmax.h, epilogue_fwd.hpp).  flash-attn 4 returns
  ``(out, lse)`` with ``return_lse=True``, -inf for an empty row, differentiable where its
  ``_flash_attn_bwd`` takes ``dlse`` (4.0.0b5 on).

sdpa_with_kvcache() takes none of these; a KV-cache Problem that carried one would be
refused here rather than run without it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math

import torch

from ..problem import KV_LAYOUTS, Problem
from .base import Capabilities
from .flash_attn_kvcache import _release, passed_window

FLAGS = ("softcap", "alibi", "sinks", "sinks_grad", "return_lse", "lse_grad")
# What each generation's public functions can take (narrowed by what is installed: declared()).
DECLARED = {
    "fa2": dict(softcap=True, alibi=True, return_lse=True),
    "fa3": dict(softcap=True, return_lse=True),
    "fa4": dict(softcap=True, sinks=True, sinks_grad=True, return_lse=True, lse_grad=True),
}
FA2_UNPADDED_LSE = (2, 6, 0)  # flash-attn 2.6.0: varlen logsumexp (H, total_q) instead of padded
FA4_INTERFACE = "flash_attn.cute.interface"


def declared_flags(key: str) -> dict[str, bool]:
    """Every feature flag of generation `key`'s declaration (its Capabilities' fields)."""
    return dict.fromkeys(FLAGS, False) | DECLARED[key]


def problem_fields(requires_grad: bool, options: dict) -> dict:
    """The Problem's feature fields (and requires_grad: sinks that require grad need a backward)
    of run()'s options."""
    sinks = options.get("sinks")
    sinks_grad = sinks is not None and torch.is_grad_enabled() and sinks.requires_grad
    return dict(
        requires_grad=requires_grad or sinks_grad,
        softcap=options.get("softcap") is not None,
        alibi=options.get("alibi_slopes") is not None,
        sinks=sinks is not None,
        sinks_grad=sinks_grad,
        return_lse=bool(options.get("return_lse")),
    )


def _parameters(func) -> set[str]:
    """The keyword names `func` takes; empty when it has no readable signature (claim nothing)."""
    if func is None:
        return set()
    try:
        return set(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return set()


def _fa4_interface():
    """flash-attn 4's interface module (private: its backward's and sinks' declarations)."""
    try:
        return importlib.import_module(FA4_INTERFACE)
    except Exception:
        return None


def declared(key: str, func, varlen_func, build_flags: dict | None = None) -> dict[str, bool]:
    """The feature flags of one installed generation: DECLARED[key], each kept only where both its
    functions (varlen_func when there is one) take the keyword that carries it."""
    params = _parameters(func)
    if varlen_func is not None:
        params &= _parameters(varlen_func)
    flags = dict.fromkeys(FLAGS, False)
    want = DECLARED[key]
    if key in ("fa2", "fa3"):
        flags["softcap"] = "softcap" in params and not (build_flags or {}).get("FLASHATTENTION_DISABLE_SOFTCAP")
        flags["alibi"] = want.get("alibi", False) and "alibi_slopes" in params
        flags["return_lse"] = "return_attn_probs" in params
    else:
        interface = _fa4_interface()
        backward = _parameters(getattr(interface, "_flash_attn_bwd", None))
        sink_dtypes = getattr(interface, "_LEARNABLE_SINK_DTYPES", ())
        flags["softcap"] = "softcap" in params
        # float32 sinks (ours are exact in it) and their gradient both came with 4.0.0b26
        flags["sinks"] = "learnable_sink" in params and torch.float32 in sink_dtypes and "learnable_sink" in backward
        flags["sinks_grad"] = flags["sinks"]
        flags["return_lse"] = "return_lse" in params
        flags["lse_grad"] = flags["return_lse"] and "dlse" in backward
    return {name: bool(on and want.get(name, False)) for name, on in flags.items()}


def feature_capabilities(key: str, func, varlen_func, caps: Capabilities, build_flags: dict | None = None):
    """`caps` with the feature flags the installed generation supports (declared())."""
    return dataclasses.replace(caps, **declared(key, func, varlen_func, build_flags))


def uses_features(p: Problem) -> bool:
    return p.softcap or p.alibi or p.sinks or p.return_lse


def fa2_causal_kernel(p: Problem) -> bool:
    """Whether flash-attn 2 runs `p` with its causal kernel: a window side >= Sk (max_seqlen_k)
    is unbounded, causal makes right 0, and causal is left unbounded with right 0
    (flash_api.cpp mha_fwd / mha_varlen_fwd, set_params_fprop)."""
    left, right = passed_window(p.causal, p.window)
    left, right = (-1 if w >= p.seqlen_k else w for w in (left, right))
    if p.causal is not None:
        right = 0
    return left < 0 and right == 0


def feature_reasons(key: str, version: str, p: Problem) -> list[str]:
    """Reasons one generation refuses a call's features beyond its capabilities."""
    if not uses_features(p):
        return []
    if p.layout in KV_LAYOUTS:
        return ["softcap, alibi_slopes, sinks and return_lse are not mapped for KV-cache calls"]
    reasons = []
    if key == "fa2":
        if p.softcap and p.dropout:
            reasons.append("softcap with dropout_p > 0 (flash-attn 2: softcapping does not support dropout)")
        if p.return_lse and p.dropout:
            reasons.append(
                "return_lse with dropout_p > 0 (flash-attn 2 returns its logsumexp with the (B, H, Sq, Sk) "
                "attention probabilities then)"
            )
        if p.return_lse and p.alibi and fa2_causal_kernel(p):
            reasons.append(
                "return_lse with alibi_slopes and causal (flash-attn 2 adds slope * j to causal rows: the same "
                "softmax, a logsumexp larger by slope * (i + Sk - Sq))"
            )
        release = _release(version)
        if p.return_lse and p.layout == "varlen" and (release is None or release[:3] < FA2_UNPADDED_LSE):
            reasons.append(
                f"return_lse with varlen needs flash-attn >= 2.6.0 (before, its logsumexp is padded; "
                f"this is {version or 'an unknown version'})"
            )
    if key == "fa4" and p.return_lse and p.sinks:
        reasons.append("return_lse with sinks (flash-attn 4's logsumexp includes the sink; ours leaves it out)")
    return reasons


def feature_kwargs(key: str, options: dict) -> dict:
    """The generation's keywords for a call's features (run()'s options)."""
    kwargs = {}
    if options.get("softcap") is not None:
        kwargs["softcap"] = float(options["softcap"])
    slopes = options.get("alibi_slopes")
    if slopes is not None:  # (B, Hq) float32, maybe a stride-0 batch; flash-attn 2 needs a unit last stride
        kwargs["alibi_slopes"] = slopes if slopes.stride(-1) == 1 else slopes.contiguous()
    sinks = options.get("sinks")
    if sinks is not None:  # float32 holds any float16/bfloat16 sink exactly; the cast passes the gradient back
        kwargs["learnable_sink"] = sinks.to(torch.float32)
    if options.get("return_lse"):
        kwargs["return_lse" if key == "fa4" else "return_attn_probs"] = True
    return kwargs


def expected_lse_shape(query, varlen: bool) -> tuple[int, ...]:
    """Ours: (B, Hq, Sq) for (B, Hq, Sq, D) queries, (Hq, total_q) for packed (total_q, Hq, D)."""
    return (query.shape[1], query.shape[0]) if varlen else tuple(query.shape[:3])


def library_lse(key: str, result, query, varlen: bool) -> torch.Tensor:
    """The logsumexp in a generation's result (``(out, lse, ...)``), as ours: float32, our
    layout, -inf for a row with no allowed key (flash-attn 2 marks those +inf)."""
    if not isinstance(result, (tuple, list)) or len(result) < 2 or not isinstance(result[1], torch.Tensor):
        raise RuntimeError(f"flash-attn ({key}) returned no logsumexp although one was asked for")
    lse = result[1]
    want = expected_lse_shape(query, varlen)
    if tuple(lse.shape) != want or lse.dtype != torch.float32:
        raise RuntimeError(
            f"flash-attn ({key}) returned a logsumexp of shape {tuple(lse.shape)} and dtype {lse.dtype}; "
            f"expected float32 {want}"
        )
    if key == "fa2":
        lse = lse.masked_fill(lse == math.inf, -math.inf)
    return lse


def empty_result(out, query, varlen: bool, options: dict):
    """run()'s result for a call with an empty dimension, given its output of zeros: sinks that
    require grad on the graph (a zero gradient, as query's), and with return_lse a logsumexp of
    -inf for every row, on the query's graph."""
    sinks = options.get("sinks")
    if sinks is not None and sinks.requires_grad:
        out = out + sinks.sum().to(out.dtype) * 0
    if not options.get("return_lse"):
        return out
    rows = (query[..., 0].t() if varlen else query[..., 0]).float()
    return out, torch.full_like(rows, -math.inf) + rows * 0


__all__ = [
    "DECLARED",
    "FLAGS",
    "declared",
    "declared_flags",
    "empty_result",
    "feature_capabilities",
    "feature_kwargs",
    "feature_reasons",
    "library_lse",
    "problem_fields",
    "uses_features",
]
