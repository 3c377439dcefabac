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

Host time: a repeated call pays for this key and one dictionary lookup on top of its backend
(issue 35: at most 1.3x F.sdpa's host time on the CPU for a tiny call).  Reading a tensor's
metadata from Python is most of it (~0.1-0.2 us per attribute, ~20 of them, then hashing and
comparing the objects read), so the key reads each fact once, is one flat tuple, and calls
torch's C getters directly where the public function is a Python wrapper of one.

The recent signatures (:func:`recent_entry`, checked inline in sdpa()) skip even that: the last
RECENT_LIMIT signatures that hit the dictionary keep a check of their tensors in C++ (torch's
``TensorGuards``, dynamo's check of Python type, dispatch keys, dtype, device, requires_grad,
sizes and strides: ~1 us for three tensors where reading them from Python costs ~3-5 us), and a
call passing it, with the same options, pointer alignment and dispatch state, is a call with
that signature's key: the key's every field is checked, in C++ or in sdpa().  TensorGuards is
private: torch_private.tensor_check adapts it on tested torch releases only (None elsewhere:
no recent entries, every call takes the key).  They live in
``fast_calls`` under the key RECENT, so whatever clears that dictionary clears them.
"""

from __future__ import annotations

import torch

from . import config as _config
from . import registry
from .call import mask_kept_as_given, offsets_kept_as_given
from .debug import _last, _recorders
from .dispatch import _scope, fast_calls
from . import torch_private
from .torch_private import tensor_check

# positions in call_key()'s tuple that length_key() reads: shapes and strides 0 to 5, then
_POINTERS, _MASK, _PACKED, _COMMON = 6, 7, 8, 9

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling  # a function torch.compile knows (a flag would be guarded on)
# is_compiling() is this function (dynamo folds it to True: the flag is never traced) or the flag
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_compiler = torch_private.compiler
_grad_enabled = torch.is_grad_enabled
_deterministic = torch_private.deterministic  # torch.are_deterministic_algorithms_enabled() without its wrapper
_deterministic_warn_only = torch_private.deterministic_warn_only
_scoped_config = _config._scoped.get  # current_config(): the scoped config, else the loaded one
_scope_get = _scope.get
# sdpa()'s hit path reads these without an attribute lookup per call: CPython 3.11 neither
# specializes a method call on a name bound by an import (it makes a bound method each time) nor an
# attribute of a module with a __getattr__ (config's, PEP 562) (experiment 92)
_config_vars = vars(_config)
_recent_get = fast_calls.get
_last_get, _last_set, _recorders_get = _last.get, _last.set, _recorders.get

RECENT = object()  # fast_calls[RECENT] = (None, recent entries, newest first): module doc
RECENT_LIMIT = 4


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
    hit is a call that the full path accepted before and would decide the same way."""
    tensor = _Tensor
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
        or _is_compiling()
    ):
        return None
    try:  # a strided nested tensor has no shape or strides: normalize_call() says what to pass
        qs, ks, vs = query.shape, key.shape, value.shape
        qt, kt, vt = query.stride(), key.stride(), value.stride()
    except RuntimeError:
        return None
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
    dtype = query.dtype
    if attn_mask is None:
        mask = None
        grad = _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    elif type(attn_mask) is not tensor or attn_mask.dim() != 4 or not mask_kept_as_given(attn_mask.dtype, dtype):
        return None  # not a tensor, or normalize_call() would reshape / convert it
    else:
        mask_grad = attn_mask.requires_grad
        mask = (
            attn_mask.shape,
            attn_mask.stride(),
            attn_mask.dtype,
            attn_mask.device,
            mask_grad,
            attn_mask.data_ptr() & 15,
        )
        grad = _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad or mask_grad)
    qp, kp, vp = query.data_ptr(), key.data_ptr(), value.data_ptr()
    # 0 when all three are 16-byte aligned (the usual case), else each one's offset
    pointers = (qp | kp | vp) & 15 and (qp & 15, kp & 15, vp & 15)
    det = _deterministic()
    config = _scoped_config()
    if config is None:
        config = _config._loaded
        if config is None:  # not loaded yet: load it now (that bumps the version the key holds)
            config = _config.current_config()
    # module globals read as they are: config_version(), registry_version() and current_config()
    # are Python calls, a fifth of this key's time
    return (
        qs,
        qt,
        ks,
        kt,
        vs,
        vt,
        pointers,
        mask,
        packed,
        # what length_key() keeps as it is: from _COMMON to the end
        dtype,
        key.dtype,
        value.dtype,
        query.device,
        key.device,
        value.device,
        grad,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal,
        window,
        deterministic,
        backend,
        id(config),
        _config._version,
        registry._version,
        _scope_get(),
        det and (1 + _deterministic_warn_only()),
    )


def dispatch_state() -> tuple:
    """What decide() keys on besides the Problem and the forced backend, as call_key() reads it:
    the current config (by id) and its version, the registry's version, the use_backends()
    scope, and torch's determinism flags (which some backends' checks read)."""
    config = _scoped_config()
    if config is None:
        config = _config._loaded
        if config is None:
            config = _config.current_config()
    det = _deterministic()
    return id(config), _config._version, registry._version, _scope_get(), det and (1 + _deterministic_warn_only())


def length_key(exact: tuple):
    """``(key, Sk)``: sdpa()'s key of a call without its key length (module doc), from its
    :func:`call_key` ``exact`` (a 4-D query); None for a call with a mask, packed (varlen)
    tensors, a key or value that is not 4-D, or key and value lengths that differ."""
    ks, vs = exact[2], exact[4]
    if exact[_MASK] is not None or exact[_PACKED] is not None or len(ks) != 4 or len(vs) != 4 or vs[2] != ks[2]:
        return None
    sk = ks[2]
    qt, kt, vt = exact[1], exact[3], exact[5]
    common = exact[_COMMON:]
    # Problem.aligned_16 (problem._aligned_16: 16-byte pointers, and strides but the last);
    # a call whose tensors' dtypes differ never has an entry (normalize_call refuses it)
    step = max(1, 16 // common[0].itemsize)
    aligned = not exact[_POINTERS]
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


def recent_entry(exact: tuple, decision, runner, query, key, value, attn_mask):
    """The recent entry (sdpa() checks it inline) for a call whose :func:`call_key` is
    ``exact`` and whose tensors are these: (check, has mask, options, scoped config, reads grad
    mode, grad, decision, runner, exact, scope, loaded config, config version, registry
    version, determinism, the runner's ``first_of`` op for a call without a mask else None);
    None for a call it cannot check (packed tensors, a pointer off 16 bytes, one tensor passed
    twice: TensorGuards never matches a repeated tensor).  The dispatch state is kept as the
    objects call_key read (compared by identity: one ``is`` each on a hit)."""
    if tensor_check is None or exact[_POINTERS] or exact[_PACKED] is not None:
        return None
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if query is key or query is value or key is value or any(attn_mask is t for t in (query, key, value)):
        return None
    if attn_mask is not None and exact[_MASK][-1]:
        return None
    common = exact[_COMMON:]
    # common: 3 dtypes, 3 devices, grad, 8 options (dropout_p ... backend), 5 of dispatch state
    scoped, scope, loaded = _scoped_config(), _scope_get(), _config._loaded
    if (id(loaded if scoped is None else scoped), _config._version, registry._version, scope) != common[15:19]:
        return None  # not the state this key was read in
    check = tensor_check(*tensors)
    if check is None:
        return None
    reads_grad = any(t.requires_grad for t in tensors)
    head = (check, attn_mask is not None, common[7:15], scoped, reads_grad, common[6], decision, runner, exact)
    first_of = None if attn_mask is not None else getattr(runner, "first_of", None)  # Backend.prepare
    return head + (scope, loaded, common[16], common[17], common[19], first_of)


def remember_recent(fast_calls: dict, entry) -> None:
    """Put ``entry`` first among fast_calls' recent entries, the oldest beyond RECENT_LIMIT dropped."""
    recent = fast_calls.get(RECENT)
    others = () if recent is None else tuple(e for e in recent[1] if e[8] != entry[8])
    fast_calls[RECENT] = (None, (entry,) + others[: RECENT_LIMIT - 1])


def forget_recent(fast_calls: dict, entry) -> None:
    """Drop ``entry`` and its signature's fast_calls entry (its runner failed)."""
    fast_calls.pop(entry[8], None)
    recent = fast_calls.get(RECENT)
    if recent is not None:
        fast_calls[RECENT] = (None, tuple(e for e in recent[1] if e is not entry))
