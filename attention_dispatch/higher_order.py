"""Second derivatives: where a backward computes its gradients with kernels that build no graph."""

from __future__ import annotations

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
