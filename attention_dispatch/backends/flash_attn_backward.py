"""flash_attn's run_backward (Capabilities.backward_from_output): a call's dq, dk, dv from a given
output and logsumexp, those of a larger call it is one block of (context parallelism's merged
backward). Only flash-attn 4 declares it: its backward op (``_flash_attn_bwd``, the private
function behind its autograd, called through :mod:`.fa4_compiled` and only for the releases
:mod:`.fa4_relaunch` has checked) takes out, dout, lse and dlse as given. flash-attn 2 and 3 do
not declare it (their backward functions are not wrapped here)."""

from __future__ import annotations

import dataclasses

from .base import Capabilities, check_backward_options
from .fa4_compiled import _NO_WINDOW, fa4_dense_backward
from .fa4_relaunch import untested_release


def fa4_capabilities(caps: Capabilities, version: str) -> Capabilities:
    """flash-attn 4's declaration for an installed ``version``: backward_from_output only for a
    tested release (the backward op is private API)."""
    why = untested_release(version)
    if why is None:
        return caps
    return dataclasses.replace(caps, backward_from_output=False, notes=f"{caps.notes}; no run_backward: {why}")


# run_backward's keywords for what flash-attn 4 does not do (Capabilities.backward_dq_accumulator,
# backward_dkv_out, backward_split: not declared)
_UNDECLARED = ("dq_accumulator", "dkv_out", "only", "dq_out")


def run_backward(backend, query, key, value, out, lse, grad_out, grad_lse, options: dict):
    """(dq, dk, dv) (B, H, S, D) of a dense call from ``out`` (B, Hq, Sq, Dv, the query's dtype),
    ``lse`` (B, Hq, Sq) and their gradients ``grad_out``, ``grad_lse`` (None: zero), on the
    generation select() takes for the call's backward from a given output (flash-attn 4)."""
    options = dict(options)
    given = [name for name in _UNDECLARED if options.pop(name, None) is not None]
    check_backward_options(options)
    if given:
        raise ValueError(
            f"flash_attn.run_backward: {', '.join(given)} given; flash-attn returns dq, dk and dv "
            "(Capabilities.backward_dq_accumulator / backward_dkv_out / backward_split are not declared)"
        )
    if options.pop("attn_mask", None) is not None:
        raise ValueError("flash_attn.run_backward: attn_mask given; flash-attn takes no mask")
    problem = dataclasses.replace(
        backend.run_problem(query, key, value, **options), requires_grad=True, backward_from_output=True
    )
    choice = backend.select(problem)
    if choice.impl is None:
        raise ValueError(
            "flash_attn.run_backward: no flash-attn generation computes this call's backward from a given "
            "output: " + "; ".join(choice.refusals)
        )
    is_causal, (left, right) = backend.window_args(choice.impl, options.get("causal"), options.get("window"))
    dq, dk, dv = fa4_dense_backward(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        out.transpose(1, 2),
        grad_out.transpose(1, 2),
        lse.float().contiguous(),  # flash-attn 4 reads a contiguous float32 logsumexp
        None if grad_lse is None else grad_lse.float().contiguous(),
        options.get("scale"),
        is_causal,
        _NO_WINDOW if left is None else int(left),
        _NO_WINDOW if right is None else int(right),
        float(options.get("softcap") or 0.0),
        bool(options.get("deterministic", False)),
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
