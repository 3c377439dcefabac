"""Backend: the shape every adapter has, and Capabilities: what it supports, as data.

`not_supported_reasons(capabilities, problem)` is the one function that turns a
backend's declaration into readable reasons; a backend supports a call when the list
is empty. Every reason names what was asked and what the backend allows.
"""

from __future__ import annotations

import dataclasses

import torch

from ..problem import KV_LAYOUTS, Problem
from ..route import Route
from ..semantics import CausalKind

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend computes exactly. The defaults allow everything."""

    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    min_compute_capability: tuple[int, int] | None = None  # CUDA only
    max_compute_capability: tuple[int, int] | None = None
    dtypes: frozenset[torch.dtype] = FLOAT_DTYPES
    head_dim_min: int = 1
    head_dim_max: int | None = None  # applies to Dqk and Dv
    head_dim_multiple: int = 1  # e.g. 8 for kernels that load 16-byte vectors
    different_head_dims: bool = True  # Dqk != Dv
    causal_kinds: frozenset[CausalKind] = frozenset(CausalKind)
    window: bool = True
    bool_mask: bool = True
    float_bias: bool = True
    bias_grad: bool = True
    float32_bias: bool = True  # a float32 bias with 16-bit inputs, added without rounding it
    mask_with_causal: bool = True  # an attn_mask together with causal/window
    dropout: bool = True
    dense: bool = True
    varlen: bool = True
    gqa: bool = True
    backward: bool = True
    # gradients of gradients (create_graph=True) computed; otherwise the backward raises there (never
    # a gradient whose graph silently misses its terms through q, k, v)
    second_derivatives: bool = False
    # forward-mode AD (dual tensors, torch.autograd.forward_ad): the output's tangent computed; kernels
    # that carry none are refused for such a call (never an output whose tangent is silently zero)
    forward_ad: bool = False
    # under torch.func's transforms (vmap, grad, jvp and their compositions): computed on their wrapped
    # tensors; kernels that read data pointers are refused there (torch.func would fail inside them)
    func_transforms: bool = False
    deterministic_backward: bool = True  # can the backward be made bitwise repeatable
    max_seqlen: int | None = None
    max_batch_heads: int | None = None
    needs_last_dim_contiguous: bool = False  # the adapter does not copy a strided last dim
    # sdpa_with_kvcache(): which caches run_kvcache() takes, "dense" (B, Hkv, S, D) and/or
    # "paged" (num_blocks, block_size, Hkv, D) with a block table; empty: no KV-cache path
    # (the one default that allows nothing: run_kvcache() must be implemented)
    kv_cache: frozenset[str] = frozenset()
    paged_block_size_min: int = 1  # a paged cache's block_size: at least this,
    paged_block_size_multiple: int = 1  # a multiple of this,
    paged_block_size_pow2: bool = False  # and a power of two when set
    kv_append: bool = True  # k_new/v_new written into the cache before attending
    kv_multi_query: bool = True  # Sq > 1 new queries per sequence (chunked prefill, speculative decoding)
    kv_cache_declined: str = ""  # why kv_cache is empty although the kernel has a KV path (in the reason)
    # why a call of a new sequence length builds a new plan (what that costs), "" when it does not:
    # policy="auto" then avoids this backend where a loop changes lengths (perf_table.table_choice)
    plans_per_length: str = ""
    # why the first call of each exact shape costs extra host time (no plan: a slower first call),
    # "" when it does not: policy="auto" avoids this backend for a decode step, whose key length grows
    first_call_per_shape: str = ""
    # Features added after the first backends were written: off by default, so a backend that
    # never heard of them (a custom one included) rejects them instead of ignoring them.
    softcap: bool = False  # softcap * tanh(score / softcap) before bias and ALiBi
    alibi: bool = False  # alibi_slopes: -slope * |i + off - j| added per head
    sinks: bool = False  # one extra logit per head in the softmax denominator
    sinks_grad: bool = False  # a gradient for sinks that require grad
    return_lse: bool = False  # the rows' logsumexp returned with the output
    lse_grad: bool = False  # that logsumexp differentiable (its gradient reaches q, k, v, bias)
    # dropout's keep-mask drawn at a block's offset inside a larger call when
    # dropout_stream.positioned() is in scope (context parallelism's dropout blocks)
    dropout_positions: bool = False
    dropout_column_multiple: int = 1  # those blocks' column offsets: multiples of this
    # run_backward(): a call's dq, dk, dv from a given output and logsumexp (those of a larger
    # call it is one block of: context parallelism's backward="merged")
    backward_from_output: bool = False
    # run_backward(dq_accumulator=): the query's gradient added, unrounded, into a given tensor
    # of the lse dtype (a rank's sum over its blocks) instead of returned
    backward_dq_accumulator: bool = False
    # run_backward(dkv_out=): dk and dv written into given tensors, which may be the key and value
    # themselves (a ring's received keys, read no more: no new buffers for their gradients)
    backward_dkv_out: bool = False
    # run_backward(only="dq" | "dkv", dq_out=): one of the two gradients' passes alone (a caller
    # running them at different times), dq written into a given tensor of the query's dtype
    backward_split: bool = False
    notes: str = ""  # free text for `info`, never used to decide

    def _backward_extras(self) -> str:
        extras = [
            n
            for n, on in (
                ("dq accumulator", self.backward_dq_accumulator),
                ("dk/dv into given tensors", self.backward_dkv_out),
                ("dq or dk/dv alone", self.backward_split),
            )
            if on
        ]
        return f" ({', '.join(extras)})" if extras else ""

    def paged_block_sizes(self) -> str:
        """The block sizes a paged cache may have, in words ("powers of two >= 16")."""
        low, step = self.paged_block_size_min, self.paged_block_size_multiple
        if self.paged_block_size_pow2:
            low = max(1 << max(0, low - 1).bit_length(), step)
            return f"powers of two >= {low}"
        if step > 1:
            return f"multiples of {step}" + (f" >= {low}" if low > step else "")
        return f">= {low}" if low > 1 else "any"

    def paged_block_size_ok(self, block_size: int) -> bool:
        return (
            block_size >= max(1, self.paged_block_size_min)
            and block_size % self.paged_block_size_multiple == 0
            and (not self.paged_block_size_pow2 or block_size & (block_size - 1) == 0)
        )

    def rows(self) -> list[tuple[str, str]]:
        """(feature, value) pairs for the `info` table."""

        def names(items):
            return ", ".join(sorted(dtype_name(i) if isinstance(i, torch.dtype) else str(i) for i in items)) or "-"

        def yes(flag):
            return "yes" if flag else "no"

        arch = "any"
        if self.min_compute_capability or self.max_compute_capability:
            lo = "sm%d%d" % self.min_compute_capability if self.min_compute_capability else ""
            hi = "sm%d%d" % self.max_compute_capability if self.max_compute_capability else ""
            arch = f"{lo}..{hi}"
        head = f"{self.head_dim_min}..{self.head_dim_max or 'any'}"
        if self.head_dim_multiple > 1:
            head += f", multiple of {self.head_dim_multiple}"
        return [
            ("devices", names(self.devices)),
            ("CUDA arch", arch),
            ("dtypes", names(self.dtypes)),
            ("head dim", head),
            ("Dqk != Dv", yes(self.different_head_dims)),
            ("causal", names(self.causal_kinds)),
            ("window", yes(self.window)),
            ("bool mask", yes(self.bool_mask)),
            ("float bias", yes(self.float_bias)),
            ("bias grad", yes(self.bias_grad)),
            ("fp32 bias, 16-bit inputs", yes(self.float32_bias)),
            ("mask + causal", yes(self.mask_with_causal)),
            ("dropout", yes(self.dropout)),
            ("dense", yes(self.dense)),
            ("varlen", yes(self.varlen)),
            ("GQA", yes(self.gqa)),
            ("backward", yes(self.backward)),
            ("deterministic bwd", yes(self.deterministic_backward)),
            ("grad of grad", "yes" if self.second_derivatives else "refused"),
            ("forward AD", yes(self.forward_ad)),
            ("torch.func", yes(self.func_transforms)),
            ("max seqlen", str(self.max_seqlen or "any")),
            ("max B*H", str(self.max_batch_heads or "any")),
            ("KV cache", names(self.kv_cache)),
            ("paged block size", self.paged_block_sizes() if "paged" in self.kv_cache else "-"),
            ("KV append", yes(self.kv_append) if self.kv_cache else "-"),
            ("KV Sq > 1", yes(self.kv_multi_query) if self.kv_cache else "-"),
            ("softcap", yes(self.softcap)),
            ("ALiBi", yes(self.alibi)),
            ("sinks", yes(self.sinks) + (" (grad)" if self.sinks and self.sinks_grad else "")),
            ("return lse", yes(self.return_lse) + (" (grad)" if self.return_lse and self.lse_grad else "")),
            (
                "dropout at offsets",
                yes(self.dropout and self.dropout_positions)
                + (
                    f" (columns: multiples of {self.dropout_column_multiple})"
                    if self.dropout_column_multiple > 1
                    else ""
                ),
            ),
            (
                "backward from out/lse",
                yes(self.backward_from_output) + self._backward_extras(),
            ),
        ]


def not_supported_reasons(caps: Capabilities, problem: Problem) -> list[str]:
    """Every reason `caps` cannot compute `problem`; empty means supported."""
    reasons: list[str] = []
    p = problem
    kv = p.layout in KV_LAYOUTS
    if p.device_type not in caps.devices:
        reasons.append(f"device={p.device_type} not in {{{', '.join(sorted(caps.devices))}}}")
    if p.compute_capability is not None:
        cc = p.compute_capability
        if caps.min_compute_capability and cc < caps.min_compute_capability:
            reasons.append("compute capability sm%d%d < sm%d%d" % (*cc, *caps.min_compute_capability))
        if caps.max_compute_capability and cc > caps.max_compute_capability:
            reasons.append("compute capability sm%d%d > sm%d%d" % (*cc, *caps.max_compute_capability))
    if p.dtype not in caps.dtypes:
        allowed = ", ".join(sorted(dtype_name(d) for d in caps.dtypes))
        reasons.append(f"dtype={dtype_name(p.dtype)} not in {{{allowed}}}")
    dims = (
        {"head_dim": p.head_dim_qk}
        if p.head_dim_qk == p.head_dim_v
        else {"head_dim_qk": p.head_dim_qk, "head_dim_v": p.head_dim_v}
    )
    for label, dim in dims.items():
        if caps.head_dim_max is not None and dim > caps.head_dim_max:
            reasons.append(f"{label}={dim} > {caps.head_dim_max}")
        if dim < caps.head_dim_min:
            reasons.append(f"{label}={dim} < {caps.head_dim_min}")
        if dim % caps.head_dim_multiple:
            reasons.append(f"{label}={dim} is not a multiple of {caps.head_dim_multiple}")
    if p.head_dim_qk != p.head_dim_v and not caps.different_head_dims:
        reasons.append(f"head_dim_qk={p.head_dim_qk} != head_dim_v={p.head_dim_v} (needs equal head dims)")
    if p.causal is not None and p.causal not in caps.causal_kinds:
        if not caps.causal_kinds:
            reasons.append(f"causal={p.causal} not supported")
        elif not p.sequences_match:  # with Sq == Sk both alignments are the same function
            where = _unequal_lengths(p)
            only = ", ".join(str(k) for k in sorted(caps.causal_kinds))
            reasons.append(f"causal={p.causal} with {where} (the backend aligns causal {only})")
    if p.window is not None:
        if not caps.window:
            reasons.append(f"window={p.window} not supported")
        elif p.causal is None and CausalKind.BOTTOM_RIGHT not in caps.causal_kinds and not p.sequences_match:
            reasons.append(
                f"window={p.window} aligned bottom-right with {_unequal_lengths(p)} (supports only top_left)"
            )
    if p.mask_kind == "bool" and not caps.bool_mask:
        reasons.append("bool attn_mask not supported")
    if p.mask_kind == "float":
        if not caps.float_bias:
            reasons.append("float attn_mask (bias) not supported")
        elif p.mask_requires_grad and not caps.bias_grad:
            reasons.append("gradient of a float attn_mask not supported")
        if p.float32_bias and caps.float_bias and not caps.float32_bias:
            reasons.append(
                f"float32 attn_mask with {dtype_name(p.dtype)} inputs (the backend would round the bias "
                f"to {dtype_name(p.dtype)}; cast the mask to the query's dtype to allow it)"
            )
    if p.mask_kind != "none" and (p.causal is not None or p.window is not None) and not caps.mask_with_causal:
        reasons.append("attn_mask together with causal/window not supported")
    if p.dropout and not caps.dropout:
        reasons.append("dropout_p > 0 not supported")
    if p.layout == "dense" and not caps.dense:
        reasons.append("dense (B, H, S, D) inputs not supported (varlen only)")
    if p.layout == "varlen" and not caps.varlen:
        reasons.append("varlen (cu_seqlens / nested) inputs not supported")
    if kv:
        reasons.extend(_kv_reasons(caps, p))
    if p.heads_q != p.heads_kv and not caps.gqa:
        reasons.append(f"GQA (Hq={p.heads_q}, Hkv={p.heads_kv}) not supported")
    if p.func_transform and not caps.func_transforms:
        reasons.append("under a torch.func transform (vmap, grad, jvp): its kernels take no wrapped tensors")
    if p.forward_ad and not caps.forward_ad:
        reasons.append("forward-mode AD (a dual tensor among the inputs): its kernels carry no tangent")
    if p.requires_grad and not caps.backward:
        reasons.append("backward (inputs require grad) not supported")
    if p.backward_from_output and not caps.backward_from_output:
        reasons.append("backward from a given output and logsumexp (run_backward) not supported")
    if p.requires_grad and p.deterministic and not p.deterministic_warn_only and not caps.deterministic_backward:
        reasons.append("deterministic algorithms requested but the backward is nondeterministic")
    if caps.max_seqlen is not None and max(p.seqlen_q, p.seqlen_k) > caps.max_seqlen:
        reasons.append(f"seqlen={max(p.seqlen_q, p.seqlen_k)} > {caps.max_seqlen}")
    if caps.max_batch_heads is not None and p.batch * p.heads_q > caps.max_batch_heads:
        reasons.append(f"batch*heads={p.batch * p.heads_q} > {caps.max_batch_heads}")
    if caps.needs_last_dim_contiguous and not p.last_dim_contiguous:
        reasons.append("last dimension of query/key/value not contiguous")
    if p.softcap and not caps.softcap:
        reasons.append("softcap not supported")
    if p.alibi and not caps.alibi:
        reasons.append("alibi_slopes not supported")
    if p.sinks and not caps.sinks:
        reasons.append("sinks not supported")
    elif p.sinks_grad and not caps.sinks_grad:
        reasons.append("gradient of sinks not supported (sinks require grad)")
    if p.return_lse and not caps.return_lse:
        reasons.append("return_lse not supported")
    elif p.return_lse and p.requires_grad and not caps.lse_grad:
        reasons.append("return_lse with gradients: the returned logsumexp is not differentiable")
    return reasons


def check_backward_options(options: dict) -> None:
    """run_backward()'s limits, raised naming the argument: dense calls without sinks (a given
    logsumexp is without the sinks; apply them after, as context parallelism does)."""
    for name in ("cu_seqlens_q", "cu_seqlens_k", "sinks"):
        if options.get(name) is not None:
            raise ValueError(f"run_backward: {name} given; it takes dense calls without sinks")


def check_dq_accumulator(acc, query) -> None:
    """run_backward()'s ``dq_accumulator``: the query's shape and device, the lse dtype."""
    want = torch.float64 if query.dtype == torch.float64 else torch.float32  # features.lse_dtype
    if acc is not None and (acc.dtype != want or acc.shape != query.shape or acc.device != query.device):
        raise ValueError(
            f"run_backward: dq_accumulator must be {want} of the query's shape {tuple(query.shape)} on "
            f"{query.device}, got {acc.dtype} {tuple(acc.shape)} on {acc.device}"
        )


def check_split(only, dq_out, query, dq_accumulator) -> None:
    """run_backward()'s ``only`` (None, "dq" or "dkv") and ``dq_out`` (None or a contiguous tensor
    of the query's shape, dtype and device; not with ``dq_accumulator`` nor only="dkv")."""
    if only not in (None, "dq", "dkv"):
        raise ValueError(f'run_backward: only must be None, "dq" or "dkv", got {only!r}')
    if dq_out is None:
        return
    if dq_accumulator is not None or only == "dkv":
        raise ValueError("run_backward: dq_out is not taken with dq_accumulator nor with only='dkv'")
    if (dq_out.dtype, dq_out.shape, dq_out.device) != (query.dtype, query.shape, query.device) or (
        not dq_out.is_contiguous()
    ):
        raise ValueError(
            f"run_backward: dq_out must be a contiguous {query.dtype} tensor of the query's shape "
            f"{tuple(query.shape)} on {query.device}, got {dq_out.dtype} {tuple(dq_out.shape)} strides "
            f"{tuple(dq_out.stride())} on {dq_out.device}"
        )


def check_dkv_out(dkv_out, key, value) -> None:
    """run_backward()'s ``dkv_out``: None or (dk, dv) of the key's and value's shapes, dtypes and
    device, each the key/value itself or memory shared with neither."""
    if dkv_out is None:
        return
    if not isinstance(dkv_out, (tuple, list)) or len(dkv_out) != 2:
        raise ValueError(f"run_backward: dkv_out must be a pair (dk, dv) of tensors, got {type(dkv_out).__name__}")
    for name, out, t, other in (("dk", dkv_out[0], key, value), ("dv", dkv_out[1], value, key)):
        if out.dtype != t.dtype or out.shape != t.shape or out.device != t.device or out.stride(-1) != 1:
            raise ValueError(
                f"run_backward: dkv_out's {name} must be {t.dtype} of shape {tuple(t.shape)} on {t.device} with a "
                f"contiguous last dim, got {out.dtype} {tuple(out.shape)} strides {tuple(out.stride())} on {out.device}"
            )
        same = out.data_ptr() == t.data_ptr() and out.stride() == t.stride()
        shared = {x.untyped_storage().data_ptr() for x in (t, other)}
        if out.numel() and not same and out.untyped_storage().data_ptr() in shared:
            raise ValueError(
                f"run_backward: dkv_out's {name} shares memory with the key or value without being that tensor"
            )


def _unequal_lengths(p: Problem) -> str:
    if p.layout == "varlen":
        return "varlen"
    if p.layout in KV_LAYOUTS:
        return "a KV cache (aligned to each sequence's length)"
    return f"Sq={p.seqlen_q} != Sk={p.seqlen_k}"


def _kv_reasons(caps: Capabilities, p: Problem) -> list[str]:
    """The reasons of an sdpa_with_kvcache() call (layout "kvcache" or "paged")."""
    if not caps.kv_cache:
        why = f": {caps.kv_cache_declined}" if caps.kv_cache_declined else ""
        return [f"KV-cache calls (sdpa_with_kvcache) not supported{why}"]
    reasons = []
    kind = "paged" if p.layout == "paged" else "dense"
    if kind not in caps.kv_cache:
        reasons.append(f"{kind} KV cache not supported (only {', '.join(sorted(caps.kv_cache))})")
    elif kind == "paged" and not caps.paged_block_size_ok(p.kv_block_size or 0):
        reasons.append(f"paged block_size={p.kv_block_size} not supported (allowed: {caps.paged_block_sizes()})")
    if p.kv_append and not caps.kv_append:
        reasons.append("k_new/v_new (appending into the cache) not supported")
    if p.seqlen_q > 1 and not caps.kv_multi_query:
        reasons.append(f"Sq={p.seqlen_q} new queries per sequence not supported (only Sq=1)")
    return reasons


class Backend:
    """Base class of every backend; subclass it for a custom one.

    Subclasses set `name` and `capabilities`, may override `is_available` (with
    `unavailable_reason`), `check` (extra reasons) and must implement `run`.
    """

    name: str = ""
    capabilities: Capabilities = Capabilities()
    options_model = None  # optional pydantic model for [backends.<name>] config options
    # A reference implementation: exact, quadratic in time, never fast. Custom backends registered
    # without a priority go before the first one; on CUDA inputs dispatch.math_fallback governs it;
    # policy="fastest" does not time it on a GPU while another backend can run the call.
    reference: bool = False

    def is_available(self) -> bool:
        return True

    def unavailable_reason(self) -> str:
        return ""

    def version(self) -> str:
        return ""

    def check(self, problem: Problem) -> list[str]:
        """Reasons beyond the capabilities (e.g. a launch limit); default none."""
        return []

    def reasons(self, problem: Problem) -> list[str]:
        """All reasons this backend cannot compute `problem` (not counting availability).
        A KV-cache call to a backend without a KV-cache path gets the capabilities' reasons
        alone: check() is written for sdpa()'s layouts."""
        reasons = not_supported_reasons(self.capabilities, problem)
        if problem.layout in KV_LAYOUTS and not self.capabilities.kv_cache:
            return reasons
        return reasons + list(self.check(problem))

    def route(self, query, key, value, options: dict) -> Route | None:
        """Which implementation inside this backend computes the call (``options`` as for
        run()), with why each faster one does not; None for a backend with one implementation.
        Must use the same functions that choose the implementation at run time."""
        return None

    def route_kvcache(self, query, k_cache, v_cache, cache_seqlens, options: dict) -> Route | None:
        """route() for an sdpa_with_kvcache() call (``options`` as for run_kvcache()); None for
        a backend with one implementation."""
        return None

    def run(self, query, key, value, **options):
        """Compute the call; options are the normalised arguments (DESIGN.md section 4)."""
        raise NotImplementedError(f"backend {self.name!r} does not implement run()")

    def run_backward(
        self,
        query,
        key,
        value,
        out,
        lse,
        grad_out,
        grad_lse,
        dq_accumulator=None,
        dkv_out=None,
        only=None,
        dq_out=None,
        **options,
    ):
        """(dq, dk, dv) of a dense call (``options`` as run() took them; no sinks, no mask gradient)
        whose probabilities are ``exp(s - lse)`` for a given ``lse`` (B, Hq, Sq) (lse dtype) and
        output ``out`` (B, Hq, Sq, Dv): dS = P (dO V^T - rowsum(dO out) + grad_lse), with ``grad_out``
        (dO) and ``grad_lse`` (None: zero) the gradients of out and lse. With the call's own out and
        lse it is the call's backward; with a larger call's, this block's share of it. Dropout:
        under the forward's dropout_stream.positioned() scope. Only for a backend declaring
        ``Capabilities.backward_from_output``. ``dq_accumulator`` (declared by
        ``Capabilities.backward_dq_accumulator``): a tensor of the query's shape in the lse dtype
        that dq is added into (then dq is None). ``dkv_out`` (declared by
        ``Capabilities.backward_dkv_out``): (dk, dv) tensors the gradients are written into and
        returned as, each the key/value itself (read no more by the caller) or separate memory.
        ``only`` and ``dq_out`` (declared by ``Capabilities.backward_split``): "dq" computes dq
        alone (dk, dv None), "dkv" dk and dv alone (dq None); ``dq_out``: a contiguous tensor of
        the query's shape and dtype dq is written into and returned as."""
        raise NotImplementedError(f"backend {self.name!r} does not implement run_backward()")

    def run_kvcache(self, query, k_cache, v_cache, cache_seqlens, *, k_new, v_new, block_table, causal, window, scale):
        """sdpa_with_kvcache()'s call, validated (only for a backend whose capabilities name
        ``kv_cache``): query (B, Hq, Sq, D); a dense cache (B, Hkv, S, D) or, with block_table
        (int32 (B, max_blocks)), a paged one (num_blocks, block_size, Hkv, D); cache_seqlens int32
        (B,) on the query's device; k_new/v_new None or (B, Hkv, Sq, D), written into the cache in
        place at positions cache_seqlens[b]... first; causal None or CausalKind.BOTTOM_RIGHT,
        window None or (left, right), both aligned to each sequence's length; scale a float.
        Returns (B, Hq, Sq, D) in query's dtype; called under torch.no_grad()."""
        raise NotImplementedError(f"backend {self.name!r} does not implement run_kvcache()")

    def prepare_kvcache(self, query, k_cache, v_cache, cache_seqlens, options: dict):
        """A callable ``(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table) -> out``
        that sdpa_with_kvcache() caches for repeated calls of this one's signature
        (kv_fast_key.kv_call_key: the same shapes, strides, dtypes, devices and 16-byte alignment of
        query, the cache and k_new/v_new, and these other ``options``, run_kvcache()'s; the
        lengths and block table keep only their shapes, dtypes and devices).  Override it to skip
        per-call work (the `triton` backend relaunches its decode plan); the default calls
        run_kvcache()."""
        fixed = {name: value for name, value in options.items() if name not in ("k_new", "v_new", "block_table")}

        def runner(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table):
            return self.run_kvcache(
                query, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new, block_table=block_table, **fixed
            )

        return runner

    def prepare(self, query, key, value, options: dict):
        """A callable ``(query, key, value[, attn_mask], *, cu_seqlens_q, cu_seqlens_k) -> out``
        that sdpa() caches for repeated calls whose tensors (a mask included) have these
        shapes, strides, dtypes, devices and 16-byte alignment, under the same grad mode and
        requires_grad, with these other options.  ``options`` are this call's normalised
        options; when they hold a mask, each call passes its own as the fourth argument (only
        the mask's kind may be relied on); varlen calls pass their own offsets (same shapes and
        max_seqlen; omitted, the prepared call's are used).  Override it to skip per-call work
        (the `triton` backend relaunches its compiled kernel); the default calls run().  A runner
        with a true ``any_key_length`` attribute also serves dense calls without a mask that
        differ from this one only in the key length and the strides (sdpa()'s decode steps:
        fast_key.length_key); without it those calls go to run().  A runner with a
        ``first_of`` attribute computes ``first_of(q, k, v)[0]`` for calls without a mask:
        sdpa()'s recent hits call that C function themselves (a Python frame less)."""
        rest = {
            name: value for name, value in options.items() if name not in ("attn_mask", "cu_seqlens_q", "cu_seqlens_k")
        }
        cu_q0, cu_k0 = options["cu_seqlens_q"], options["cu_seqlens_k"]

        def runner(query, key, value, attn_mask=None, *, cu_seqlens_q=cu_q0, cu_seqlens_k=cu_k0):
            return self.run(
                query, key, value, attn_mask=attn_mask, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **rest
            )

        return runner

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
