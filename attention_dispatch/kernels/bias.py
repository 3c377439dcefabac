"""Attention biases and masks as the kernels read them: layout, broadcast strides, the
constexprs they decide, and whether the warp-specialised (Gluon) kernels can read them."""

from __future__ import annotations

import torch


def bias_layout(bias: torch.Tensor | None, full: tuple[int, int, int, int]):
    """Normalise an attention bias/mask for the kernels.

    Accepted: any tensor broadcastable to ``full`` = (B, Hq, Sq, Sk) (varlen: max lengths)
    whose dims are each either 1 or full size (fewer dims are left-padded).  Size-1 dims are
    read with stride 0 and their gradient is summed in-kernel/over the workspace.  Returns
    (kind, tensor_for_kernel, strides(4), broadcast(4 bools))."""
    if bias is None:
        return 0, None, (0, 0, 0, 0), (True, True, True, True)
    if bias.dim() > 4:
        raise ValueError(f"attn bias must have at most 4 dims, got shape {tuple(bias.shape)}")
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    for d in range(4):
        if bias.shape[d] not in (1, full[d]):
            raise ValueError(
                f"attn bias shape {tuple(bias.shape)} does not broadcast to {tuple(full)}"
                " (each dim must be 1 or full size)"
            )
    if bias.dtype == torch.bool:
        kind, t = 2, bias.view(torch.uint8)
    elif bias.dtype.is_floating_point:
        kind, t = 1, bias
    else:
        raise TypeError(f"attn bias dtype {bias.dtype}: expected bool or a floating dtype")
    bcast = tuple(bias.shape[d] == 1 for d in range(4))
    strides = tuple(0 if bcast[d] else bias.stride(d) for d in range(4))
    return kind, t, strides, bcast


def bias_constexprs(kind: int, bias_t, bias_strides, prob, use_desc: bool) -> dict:
    """The constexprs that the bias layout decides, for every attention kernel of a call."""
    return dict(
        BIAS_KIND=kind,
        BIAS_DESC=bias_descriptor(use_desc, bias_t, bias_strides),
        BATCH_MINOR=batch_minor(kind, bias_strides, prob),
    )


def batch_minor(bias_kind: int, bias_strides, prob) -> bool:
    """Launch the (batch, head) programs batch-fastest: when a bias/mask is shared by the
    batches, the programs reading the same bias tiles then run together (L2 reuse)."""
    return bias_kind != 0 and bias_strides[0] == 0 and prob.B > 1 and not prob.varlen


def bias_descriptor(use_desc: bool, bias_t, bias_strides) -> bool:
    """Read bias/mask tiles through TMA descriptors (with the other descriptor loads) when
    TMA can address them: contiguous keys, a non-broadcast row dim, 16-byte aligned base and
    strides.  Otherwise masked pointer loads (e.g. a (B, 1, 1, Sk) key-padding mask)."""
    if not use_desc or bias_t is None:
        return False
    es = bias_t.element_size()
    sbb, sbh, sbi, sbj = bias_strides
    return sbj == 1 and sbi > 0 and bias_t.data_ptr() % 16 == 0 and all((st * es) % 16 == 0 for st in (sbb, sbh, sbi))


def ws_bias_reason(
    kind: int, bias_t, bias_strides, dtype: torch.dtype, uses_descriptors: bool, grad: bool = False
) -> str | None:
    """None when the warp-specialised kernels can read this bias (or there is none), else why
    not: they take a float bias of the query's dtype through a TMA descriptor over the (rows,
    Sk) matrix whose row of query i of (b, h) is b * batch_rows + h * head_rows + i
    (:func:`ws_bias_rows`).  ``grad``: a backward that needs the bias's gradient (only the tl
    backward computes it)."""
    if kind == 0:
        return None
    if grad:
        return "a bias whose gradient is needed: only the tl backward computes it"
    if kind == 2:
        return "boolean mask: not in the warp-specialised kernels"
    if bias_t.dtype != dtype:
        return f"bias dtype {bias_t.dtype}: the warp-specialised kernels read a bias of the query's dtype ({dtype})"
    if not bias_descriptor(uses_descriptors, bias_t, bias_strides):
        return "bias layout: the warp-specialised kernels need contiguous keys, per-query rows and 16-byte aligned rows"
    sbb, sbh, sbi, _ = bias_strides
    if sbb % sbi or sbh % sbi:
        return "bias layout: batch and head strides are not whole rows"
    return None


def ws_bias_rows(bias_strides) -> tuple[int, int]:
    """(rows per batch, rows per head) of a bias :func:`ws_bias_reason` accepts (0: broadcast)."""
    sbb, sbh, sbi, _ = bias_strides
    return sbb // sbi, sbh // sbi
