"""Second derivatives: where a backward computes its gradients with kernels that build no graph."""

from __future__ import annotations

import functools

import torch


def refuse_create_graph(what: str) -> None:
    """Raise when autograd runs this backward to build a graph (``create_graph=True``): its
    gradients come from kernels that record none, so a second derivative through them would
    silently miss every term that depends on the inputs (PyTorch's own attention kernels raise
    here too). Call at the top of an ``autograd.Function.backward``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what}: gradients of gradients (create_graph=True) are not supported: its backward "
            "runs kernels that build no graph. Run the call with backend='math' for higher-order "
            "gradients (its backward is made of differentiable torch ops)."
        )


@functools.cache
def _refusing_hook(what: str):
    """A graph node's pre-hook running :func:`refuse_create_graph` for ``what`` (made once a name)."""

    def hook(grad_outputs):
        refuse_create_graph(what)

    return hook


def refuse_create_graph_through(what: str, *outputs) -> None:
    """:func:`refuse_create_graph` for a library's autograd Function whose backward neither builds a
    graph nor refuses (flash-attn's, xformers'): a hook on each returned tensor's graph node runs it
    when a backward reaches that node. Not while torch.compile traces (its compiled backward refuses
    create_graph itself)."""
    if torch.compiler.is_compiling():  # dynamo cannot trace a grad_fn
        return
    for tensor in outputs:
        node = getattr(tensor, "grad_fn", None)
        if node is not None:
            node.register_prehook(_refusing_hook(what))
