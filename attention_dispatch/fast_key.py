"""sdpa()'s fast-path keys: the signature of a call whose normalisation (call.py) and decision
(dispatch.py) an earlier call already made.  It reads only what those read, with the same
rules (:func:`call.mask_kept_as_given`, :func:`call.offsets_kept_as_given`), and returns None for
any call they would convert or reshape.

:func:`length_key` is the same signature without the key length, for dense calls without a
mask (a decode step whose key length grows by one per call): it holds every fact
normalize_call() derives from the tensors but Sk, i.e. every field of the call's Problem but
seqlen_k, and every input of its options (none depends on Sk or on a stride: scale from the
head dim, enable_gqa from the heads, determinism from the flags in the key), plus the power of
two that holds Sk.  Two calls with one length key therefore have Problems that differ only in
seqlen_k and the same options; where dispatch.seqlen_k_span proved the Decision for a span of
lengths, a call with its Sk in that span gets exactly that Decision, and its own tensors go to
the backend's run() (strides, exact sizes and pointers are the run's business, not the
decision's).
"""

from __future__ import annotations

import torch

from . import config as _config
from . import registry
from .call import mask_kept_as_given, offsets_kept_as_given
from .dispatch import _scope

# positions in call_key()'s tuple that length_key() reads (shapes and strides: 0 to 5)
_POINTERS, _MASK, _PACKED = 6, 9, 10


def call_key(
    query,
    key,
    value,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    causal,
    window,
    deterministic,
    backend,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
):
    """sdpa()'s fast-path key, built from the same rules as :func:`normalize_call`, for plain 4-D tensors (a 4-D mask of bool or the query's dtype
    included), or packed 3-D ones with int32 offsets and int max_seqlen (no mask), and scalar
    options; None when the call must take the full path.  The key
    holds everything normalize_call() validates or derives (shapes, strides, dtypes,
    devices, alignment, grad needs, the exact option values with their types: True == 1.0
    must not hit) and everything decide() keys on (config, registry, scope, determinism): a
    hit is a call that the full path accepted before and would decide the same way.  Kept
    lean: it is most of what a repeated call costs the dispatcher (issue 5: <= 3 us)."""
    tensor = torch.Tensor
    if (
        type(query) is not tensor
        or type(key) is not tensor
        or type(value) is not tensor
        or type(dropout_p) is not float
        or type(is_causal) is not bool
        or type(enable_gqa) is not bool
        or (scale is not None and type(scale) is not float)
        or (causal is not None and type(causal) is not str)
        or (deterministic is not None and type(deterministic) is not bool)
        or (backend is not None and type(backend) is not str)
        or (
            window is not None
            and not (type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int)
        )
    ):
        return None
    if query.is_nested or torch.compiler.is_compiling():
        return None  # a strided nested tensor has no shape: normalize_call() says what to pass
    qs = query.shape
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if len(qs) != 4:
            return None
        packed = None
    elif (
        len(qs) != 3
        or attn_mask is not None
        or type(cu_seqlens_q) is not tensor
        or type(cu_seqlens_k) is not tensor
        or not offsets_kept_as_given(cu_seqlens_q)
        or not offsets_kept_as_given(cu_seqlens_k)
        or type(max_seqlen_q) is not int
        or type(max_seqlen_k) is not int
    ):
        return None  # normalize_call() would convert the offsets or compute max_seqlen (a device sync)
    else:  # the offsets' values are each call's own (read only on the CPU, as normalize_call does)
        packed = (
            cu_seqlens_q.shape,
            cu_seqlens_k.shape,
            cu_seqlens_q.device,
            cu_seqlens_k.device,
            cu_seqlens_q is cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
        )
    if attn_mask is None:
        mask = None
    elif type(attn_mask) is not tensor or attn_mask.dim() != 4 or not mask_kept_as_given(attn_mask.dtype, query.dtype):
        return None  # not a tensor, or normalize_call() would reshape / convert it
    else:
        mask = (
            attn_mask.shape,
            attn_mask.stride(),
            attn_mask.dtype,
            attn_mask.device,
            attn_mask.requires_grad,
            attn_mask.data_ptr() & 15,
        )
    det = torch.are_deterministic_algorithms_enabled()
    # what length_key() keeps as it is: the last item (its other positions: _POINTERS, _MASK, _PACKED)
    common = (
        query.dtype,
        key.dtype,
        value.dtype,
        query.device,
        key.device,
        value.device,
        torch.is_grad_enabled()
        and (
            query.requires_grad
            or key.requires_grad
            or value.requires_grad
            or (mask is not None and attn_mask.requires_grad)
        ),
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal,
        window,
        deterministic,
        backend,
        id(_config.current_config()),
        _config.config_version(),
        registry.registry_version(),
        _scope.get(),
        det and (1 + torch.is_deterministic_algorithms_warn_only_enabled()),
    )
    return (
        qs,
        query.stride(),
        key.shape,
        key.stride(),
        value.shape,
        value.stride(),
        query.data_ptr() & 15,
        key.data_ptr() & 15,
        value.data_ptr() & 15,
        mask,
        packed,
        common,
    )


def length_key(exact: tuple):
    """``(key, Sk)``: sdpa()'s key of a call without its key length (module doc), from its
    :func:`call_key` ``exact`` (a 4-D query); None for a call with a mask, packed (varlen)
    tensors, a key or value that is not 4-D, or key and value lengths that differ."""
    ks, vs = exact[2], exact[4]
    if exact[_MASK] is not None or exact[_PACKED] is not None or len(ks) != 4 or len(vs) != 4 or vs[2] != ks[2]:
        return None
    sk = ks[2]
    qt, kt, vt = exact[1], exact[3], exact[5]
    common = exact[-1]
    # Problem.aligned_16 (problem._aligned_16: 16-byte pointers, and strides but the last);
    # a call whose tensors' dtypes differ never has an entry (normalize_call refuses it)
    step = max(1, 16 // common[0].itemsize)
    aligned = not (exact[_POINTERS] or exact[_POINTERS + 1] or exact[_POINTERS + 2])
    if aligned:
        for stride in qt[:-1] + kt[:-1] + vt[:-1]:
            if stride % step:
                aligned = False
                break
    key = (
        exact[0],  # query's shape
        ks[0],
        ks[1],
        ks[3],
        vs[0],
        vs[1],
        vs[3],
        qt[-1] == 1 and kt[-1] == 1 and vt[-1] == 1,  # Problem.last_dim_contiguous
        aligned,
        sk.bit_length(),  # the power of two that holds Sk: spans never leave it
        common,  # dtypes, devices, grad, every scalar option, config, registry, scope, determinism
    )
    return key, sk
