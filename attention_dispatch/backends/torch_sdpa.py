"""PyTorch's own fused kernels, each pinned with ``torch.nn.attention.sdpa_kernel``.

Four backends share one code path (`TorchSdpaBackend`); each subclass only declares
which ``SDPBackend`` it pins and the limits PyTorch applies to that kernel, so that the
dispatcher never picks one that PyTorch would refuse ("No available kernel") or, worse,
silently reroute. The limits mirror PyTorch's filters (2.11 .. 2.13):

- ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: ``can_use_flash_attention``,
  ``can_use_mem_efficient_attention``, ``can_use_cudnn_attention`` and their
  ``check_*`` filters (arch ranges, dtypes, head dims, cuDNN shape limits, determinism);
- ``aten/src/ATen/native/transformers/sdp_utils_cpp.{h,cpp}``: ``use_flash_attention_cpp``
  (the CPU flash path: no dropout, no nested, no mask requiring grad, equal head dims),
  ``check_attn_mask_shape`` (a mask requiring grad disables cuDNN and the CPU kernel);
- ``aten/src/ATen/native/transformers/cuda/attention_backward.cu``: the flash and
  efficient backwards are deterministic only under ``torch.use_deterministic_algorithms(True)``
  (they read the global flag, not an argument);
- ``torch/nested/_internal/sdpa.py``: jagged nested tensors (our varlen) reach flash
  (causal aligned bottom-right per sequence) and efficient (``custom_mask_type=1``: causal
  aligned top-left, and no training), never a mask, never a zero-length sequence;
- ``torch/nn/attention/bias.py``: ``causal_lower_right`` runs flash/efficient natively
  and materialises a boolean mask otherwise.

How our call maps onto ``F.scaled_dot_product_attention``:

- causal top-left without a mask: ``is_causal=True``.
- causal bottom-right without a mask: Sq == Sk is the same as top-left, and Sq == 1 (a
  decode step) allows every key, i.e. no causal at all; Sq < Sk goes
  through ``causal_lower_right`` (flash, efficient) or a folded boolean mask (cuDNN, CPU);
  Sq > Sk runs only the last Sk query rows as a square causal problem and returns zeros
  for the first Sq - Sk rows, which have no allowed key (no NaN, gradient 0).
- an ``attn_mask`` together with causal: the causal band is folded into the mask
  (PyTorch refuses ``is_causal`` with a mask); a bool mask stays bool, a float mask gets
  ``-inf`` outside the band (its gradient is 0 there).
- window: rejected (no PyTorch SDPA kernel expresses it).
- rows without any allowed key (a mask row all False / all -inf): the CUDA kernels' result
  for them is not documented, so for cuDNN and efficient the adapter lets those rows attend
  to everything inside the kernel (finite numbers) and replaces their output by 0; since
  their incoming gradient is then 0, they contribute exactly 0 to every gradient. The CPU
  flash kernel already returns 0 with zero gradient for them (tested), so it runs as is.
- GQA without mask, causal or dropout on the CPU kernel (``fold_gqa``): the G = Hq / Hkv query
  heads of each kv head folded into rows, (B, Hkv, G * Sq, D), where that pays (``fold_pays``):
  the same attention (each row attends on its own), with each K/V tile read once for G heads.
- a dense KV cache (sdpa_with_kvcache; backends that take a bool mask): k_new/v_new written
  into the cache in place (kernels/kv_append.py), then F.sdpa over the whole cache with a bool mask
  built on the device from ``cache_seqlens`` (key j < L_b, causal aligned to L_b), the rows
  past each L_b zeroed in a copy (``torch.where``: a mask leaves a NaN there in the sum):
  nothing is read on the host, so it can be captured in a CUDA graph.  Paged caches, windows:
  no.  The CPU backend reads the lengths (free there) and computes each sequence over its own
  keys only (``TorchCpuBackend.run_kvcache``).
- varlen (cu_seqlens): ``torch.nested.nested_tensor_from_jagged`` on the packed tensors;
  GQA is expanded to full heads first (nested inputs broadcast heads only without grad);
  sequences of length 0 are left out of the kernel call (their rows are 0).

Which of those forms a call takes is chosen by one function, ``call_form`` (run() branches on
it); whether sdpa()'s repeated calls call the pinned kernel's ATen op directly, by
``direct_reasons`` (prepare() takes it).  ``route()`` reports both with why a faster form or
the ATen op was passed over (``ad.explain``'s route).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from ..higher_order import refuse_create_graph_through
from ..problem import Problem
from ..route import Route, RouteStep
from ..semantics import CausalKind
from ..kernels.kv_append import append_kv
from .base import Backend

HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})

# How a call reaches F.scaled_dot_product_attention (call_form; the names are route()'s)
EMPTY = "zeros"  # an empty dimension: exact zeros, no kernel
PLAIN = "F.sdpa"
IS_CAUSAL = "F.sdpa(is_causal)"
TAIL = "F.sdpa(is_causal) on the last Sk rows"  # bottom-right, Sq > Sk: the first Sq - Sk rows have no key
LOWER_RIGHT = "F.sdpa(causal_lower_right)"
BAND_MASK = "F.sdpa(bool mask of the causal band)"
MASK = "F.sdpa(attn_mask)"
MASK_BAND = "F.sdpa(attn_mask with the causal band folded in)"
NESTED = "F.sdpa(nested jagged)"
# GQA without mask or causal (a decode step): the Hq / Hkv query heads of each kv head as rows
# of one head, (B, Hkv, G * Sq, D) against K/V (B, Hkv, Sk, D); each row attends on its own, so
# this is the same attention, with each K/V tile read once for the G heads (fold_gqa backends)
FOLDED = "F.sdpa(query heads folded into rows)"
# why a form keeps sdpa()'s repeated calls off the ATen op (direct_reasons)
_NOT_DIRECT = {
    EMPTY: "an empty dimension",
    TAIL: "causal=bottom_right with Sq != Sk",
    LOWER_RIGHT: "causal=bottom_right with Sq != Sk",
    BAND_MASK: "causal=bottom_right with Sq != Sk",
    MASK: "an attn_mask",
    MASK_BAND: "an attn_mask",
    NESTED: "varlen (nested) inputs",
}


def deterministic_flag() -> tuple[bool, bool]:
    """(torch deterministic algorithms on, warn only)."""
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _empty_like_call(query, key, value):
    """The output of a call with an empty dimension (B, H, Sq or Sk = 0), on the graph.

    `(q k^T) v` over an empty axis is an exact zero of the right shape whose gradient
    is zero; the score matrix is empty, so this costs nothing."""
    heads = 1 if query.dim() == 3 else -3  # packed (total, H, D) or (B, H, S, D)
    if key.shape[heads] != query.shape[heads]:
        group = query.shape[heads] // max(key.shape[heads], 1)
        key = key.repeat_interleave(group, dim=heads)
        value = value.repeat_interleave(group, dim=heads)
    if query.dim() == 3:  # packed (total, H, D): called with an empty query or key axis
        return torch.einsum("qhk,khe->qhe", torch.einsum("qhd,khd->qhk", query, key), value)
    return (query @ key.transpose(-1, -2)) @ value


def _band_mask(sq: int, sk: int, causal: CausalKind | None, device) -> torch.Tensor | None:
    """(Sq, Sk) bool: True where causal allows key j for query i (None without causal)."""
    if causal is None:
        return None
    off = 0 if causal is CausalKind.TOP_LEFT else sk - sq
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return j <= i + off


def _kv_mask(lengths, sq: int, capacity: int, causal) -> torch.Tensor:
    """(B, 1, Sq or 1, capacity) bool: key j allowed for query i of sequence b (L_b =
    lengths[b]): j < L_b, and with causal j <= i + L_b - Sq."""
    lengths = lengths.view(-1, 1, 1, 1)
    j = torch.arange(capacity, device=lengths.device)
    allowed = j < lengths
    if causal is not None:
        allowed = allowed & (j <= torch.arange(sq, device=lengths.device).view(1, 1, sq, 1) + (lengths - sq))
    return allowed


class PinnedKernel:
    """``sdpa_kernel([SDPBackend.X])`` for one backend, without its generator and list
    bookkeeping (~9 us a call on the CPU): the same process-wide flags through
    ``torch.backends.cuda``'s public getters and setters, restored on exit."""

    _FLAGS = {  # SDPBackend member -> (getter, setter) of torch.backends.cuda
        "FLASH_ATTENTION": ("flash_sdp_enabled", "enable_flash_sdp"),
        "EFFICIENT_ATTENTION": ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
        "MATH": ("math_sdp_enabled", "enable_math_sdp"),
        "CUDNN_ATTENTION": ("cudnn_sdp_enabled", "enable_cudnn_sdp"),
    }
    __slots__ = ("wanted", "previous")

    def __init__(self, backend: str):
        self.wanted = backend
        self.previous = None

    def __enter__(self):
        flags = torch.backends.cuda
        self.previous = [(name, getattr(flags, get)()) for name, (get, _) in self._FLAGS.items()]
        for name, (_, set_) in self._FLAGS.items():
            getattr(flags, set_)(name == self.wanted)
        return self

    def __exit__(self, *exc):
        flags = torch.backends.cuda
        for name, enabled in self.previous:
            getattr(flags, self._FLAGS[name][1])(enabled)
        return False


# The CPU kernel's query block for short queries (FlashAttentionKernel.cpp: q_split_size 32
# below 192 rows): the rows one task of its parallel loop over (B, H, query blocks) computes
_CPU_Q_BLOCK = 32


def fold_pays(batch: int, heads_kv: int, rows: int) -> bool:
    """Whether FOLDED is faster on the CPU kernel for a call whose folded heads have ``rows``
    query rows (G * Sq): they fit one query block (one task reads each K/V tile once for all
    of them, where the unfolded call's G tasks each read it: 0.4-0.7x the time for Sq <= 4 on
    2 cores, 32/8 and 16/2 heads, Sk 64-2048), and B * Hkv tasks still give every thread one
    (the unfolded call has G times more)."""
    return rows <= _CPU_Q_BLOCK and batch * heads_kv >= torch.get_num_threads()


def fold_rows(query, heads_kv: int):
    """(B, Hq, Sq, D) -> (B, Hkv, G * Sq, D): query head h * G + g, row i -> kv head h, row g * Sq + i."""
    b, hq, sq, d = query.shape
    return query.reshape(b, heads_kv, hq // heads_kv * sq, d)


def unfold_rows(out, heads_q: int):
    """fold_rows' inverse on the output: (B, Hkv, G * Sq, Dv) -> (B, Hq, Sq, Dv)."""
    b, hkv, rows, dv = out.shape
    return out.reshape(b, heads_q, rows * hkv // heads_q, dv)


class CpuPinnedKernel:
    """``PinnedKernel("FLASH_ATTENTION")`` for CPU tensors, in the flags that matter there.
    PyTorch's CPU choice (``sdp_utils_cpp.cpp``: ``select_sdp_backend_cpp``) reads only two of
    them: the fused flash kernel when the flash flag is on and ``use_flash_attention_cpp``
    passes, else math when the math flag is on, else "No available kernel"; the efficient,
    cuDNN and overrideable flags are never read for a CPU tensor.  Flash on and math off pin the
    fused kernel (no silent math fallback) exactly as the four-flag pin does, in two reads and,
    with PyTorch's defaults, one write and its restore instead of twelve calls."""

    __slots__ = ("changed",)

    def __init__(self):
        self.changed = ()

    def __enter__(self):
        flags = torch.backends.cuda
        flash_off = not flags.flash_sdp_enabled()
        math_on = flags.math_sdp_enabled()
        if flash_off:
            flags.enable_flash_sdp(True)
        if math_on:
            flags.enable_math_sdp(False)
        self.changed = (flash_off, math_on)
        return self

    def __exit__(self, *exc):
        flash_off, math_on = self.changed
        flags = torch.backends.cuda
        if flash_off:
            flags.enable_flash_sdp(False)
        if math_on:
            flags.enable_math_sdp(True)
        return False


class TorchSdpaBackend(Backend):
    """The shared adapter; subclasses set the class attributes below."""

    sdp_backend: str = ""  # name of the torch.nn.attention.SDPBackend member
    device_type: str = "cuda"
    native_lower_right = False  # causal_lower_right runs natively (flash, efficient)
    fix_empty_rows = False  # neutralise rows without allowed keys (see module doc)
    varlen_causal: CausalKind | None = None  # causal alignment of the nested path
    determinism_from_global_flag = False  # backward deterministic only under use_deterministic_algorithms
    direct_op: str = ""  # torch.<op> that F.sdpa calls under the pin for plain dense calls (prepare())
    direct_gqa = False  # direct_op takes Hq != Hkv itself (as F.sdpa passes it with enable_gqa)
    fold_gqa = False  # GQA without mask or causal as FOLDED where fold_pays() (the CPU kernel)

    # -- availability -------------------------------------------------------------
    def is_available(self) -> bool:
        return not self.unavailable_reason()

    def unavailable_reason(self) -> str:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401

            getattr(SDPBackend, self.sdp_backend)
        except (ImportError, AttributeError) as e:
            return f"this PyTorch ({torch.__version__}) has no SDPBackend.{self.sdp_backend}: {e}"
        if self.device_type == "cuda":
            if not torch.cuda.is_available():
                return "no CUDA device (torch.cuda.is_available() is False)"
            built = self._built()
            if built:
                return built
        return ""

    def _built(self) -> str:
        return ""

    def version(self) -> str:
        return f"torch {torch.__version__}"

    # -- decisions ----------------------------------------------------------------
    def check(self, problem: Problem) -> list[str]:
        p = problem
        reasons = []
        if p.layout == "varlen":
            if p.mask_kind != "none":
                reasons.append(
                    "attn_mask with varlen/nested inputs not supported (PyTorch: 'Masks are not yet supported')"
                )
            if (
                p.causal is not None
                and self.varlen_causal is not None
                and p.causal is not self.varlen_causal
                and not p.sequences_match
            ):
                reasons.append(
                    f"causal={p.causal} with varlen (PyTorch's nested path aligns causal {self.varlen_causal})"
                )
        if p.requires_grad and p.deterministic and not p.deterministic_warn_only and self.determinism_from_global_flag:
            on, warn_only = deterministic_flag()
            if not on or warn_only:
                reasons.append(
                    "deterministic backward needs torch.use_deterministic_algorithms(True) "
                    "(PyTorch's kernel reads only that global flag)"
                )
        return reasons + self._kernel_checks(p)

    def _kernel_checks(self, p: Problem) -> list[str]:
        return []

    # -- running ------------------------------------------------------------------
    def _context(self):
        if torch.compiler.is_compiling():
            # dynamo cannot trace the flag getters (non-tensor results: a graph break), but it
            # traces sdpa_kernel itself and pins the kernel inside the graph
            from torch.nn.attention import SDPBackend, sdpa_kernel

            return sdpa_kernel([getattr(SDPBackend, self.sdp_backend)])
        return self._eager_pin()

    def _eager_pin(self):
        """The pin outside torch.compile: the flags themselves, faster than sdpa_kernel."""
        return PinnedKernel(self.sdp_backend)

    def call_form(self, query, key, *, has_mask: bool, causal: CausalKind | None, varlen: bool, dropout: bool = False):
        """(form, passed_over): how run() hands this call to F.sdpa (one of the module's form
        names) and, for each faster form not taken, (form, why).  run() branches on it."""
        hq, hkv = query.shape[1], key.shape[1]  # (B, H, S, D) and packed (total, H, D) alike

        def expanded(why: str) -> tuple[tuple[str, str], ...]:  # GQA: K/V repeated to Hq heads
            return (("F.sdpa(enable_gqa)", f"{why}: K/V expanded to Hq={hq} heads"),) if hkv != hq else ()

        if varlen:
            if query.shape[0] == 0 or key.shape[0] == 0 or hq == 0:
                return EMPTY, (("F.sdpa", "an empty dimension: nothing to compute"),)
            return NESTED, expanded("nested inputs broadcast heads only without grad")
        b, _, sq, _ = query.shape
        sk = key.shape[2]
        if 0 in (b, hq, sq, sk):
            return EMPTY, (("F.sdpa", "an empty dimension: nothing to compute"),)
        if causal is CausalKind.BOTTOM_RIGHT:
            if sq == sk:
                causal = CausalKind.TOP_LEFT  # the same function
            elif sq == 1:
                causal = None  # one query row at the diagonal Sk - 1: every key is allowed
        if has_mask:
            if causal is None:
                return MASK, ()
            return MASK_BAND, ((IS_CAUSAL, "PyTorch refuses is_causal together with an attn_mask"),)
        if causal is None:
            if hkv != hq and self.fold_gqa and not dropout and fold_pays(b, hkv, hq // hkv * sq):
                return FOLDED, ()
            return PLAIN, ()
        if causal is CausalKind.TOP_LEFT:
            return IS_CAUSAL, ()
        if sq > sk:
            return TAIL, ()
        top_left = (IS_CAUSAL, f"causal=bottom_right with Sq={sq} < Sk={sk} (is_causal aligns top-left)")
        if self.native_lower_right:
            return LOWER_RIGHT, (top_left, *expanded("the lower-right path calls the kernels without enable_gqa"))
        native = (LOWER_RIGHT, "native only in CUDA flash/efficient attention; elsewhere PyTorch builds this mask")
        return BAND_MASK, (top_left, native)

    def _form(self, query, key, options: dict) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.call_form(
            query,
            key,
            has_mask=options.get("attn_mask") is not None,
            causal=options.get("causal"),
            varlen=options.get("cu_seqlens_q") is not None,
            dropout=bool(options.get("dropout_p")),
        )

    def direct_reasons(self, query, key, value, options: dict) -> list[str]:
        """Why sdpa()'s repeated calls of this signature cannot call ``torch.<direct_op>``
        (what F.sdpa calls under the pin for a plain dense call) themselves; empty: they do
        (prepare()).  Only for a backend with a ``direct_op``."""
        if getattr(torch, self.direct_op, None) is None:
            return [f"this PyTorch ({torch.__version__}) has no torch.{self.direct_op}"]
        reasons = []
        form, _ = self._form(query, key, options)
        if form in _NOT_DIRECT:
            reasons.append(_NOT_DIRECT[form])
        if options.get("dropout_p"):
            reasons.append("dropout")
        if options.get("window") is not None:
            reasons.append("a window")
        if form not in (EMPTY, NESTED) and key.shape[1] != query.shape[1] and not self.direct_gqa:
            reasons.append(f"GQA (Hq={query.shape[1]} != Hkv={key.shape[1]})")
        if form != EMPTY and 0 in (query.shape[-1], key.shape[-1]):
            reasons.append("head_dim=0")
        if not all(t.stride(-1) == 1 for t in (query, key, value)):
            reasons.append("a last dimension that is not contiguous")
        return reasons

    def _direct_call(self, op, is_causal: bool, scale, grad: bool, fold: bool = False, head_dim: int = 0):
        """A runner ``(query, key, value) -> out`` calling ``op`` (``torch.<direct_op>``);
        ``fold``: on the call's FOLDED form (its query heads as rows, module doc); ``head_dim``:
        the query's."""
        raise NotImplementedError

    def prepare(self, query, key, value, options: dict):
        """Plain dense calls (no mask or dropout, Hq == Hkv, causal top-left or none, unit last
        strides: direct_reasons() empty) call the ATen op that F.scaled_dot_product_attention
        picks for them under the pin (it ran this signature's first call, and passes such
        tensors to the op unchanged), without its backend selection and the pin's flag
        toggling: cuDNN on the H100's host 15-40 us less per call, where its forward at S=512
        runs 0.1 ms; the CPU flash kernel 4.4 us less on a tiny call
        (docs/experiments/perf-notes.md experiment 59).  Anything else, or a backend without
        such an op (torch_flash, torch_efficient: F.sdpa pads or converts there): run()."""
        if self.direct_op and not self.direct_reasons(query, key, value, options):
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            form = self._form(query, key, options)[0]
            return self._direct_call(
                getattr(torch, self.direct_op),
                form == IS_CAUSAL,
                options["scale"],
                grad,
                fold=form == FOLDED,
                head_dim=query.shape[-1],
            )
        return super().prepare(query, key, value, options)

    def route(self, query, key, value, options: dict) -> Route | None:
        """call_form's form ("call": every call run() makes), and for a backend with an ATen op how sdpa()'s
        repeated calls run ("repeat calls": the op, or F.sdpa with direct_reasons)."""
        form, passed = self._form(query, key, options)
        steps = [RouteStep("output" if form == EMPTY else "call", form, passed)]
        if self.direct_op:
            op = f"torch.{self.direct_op}"
            reasons = self.direct_reasons(query, key, value, options)
            steps.append(
                RouteStep("repeat calls", "F.sdpa", ((op, "; ".join(reasons)),))
                if reasons
                else RouteStep("repeat calls", op)
            )
        return Route(tuple(steps))

    def run(
        self,
        query,
        key,
        value,
        *,
        attn_mask=None,
        dropout_p=0.0,
        causal=None,
        window=None,
        scale=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        enable_gqa=False,
        deterministic=False,
        **_,
    ):
        if window is not None:
            raise ValueError(f"{self.name}: window={window} is not supported (rejected by check())")
        varlen = cu_seqlens_q is not None
        form, _ = self.call_form(
            query, key, has_mask=attn_mask is not None, causal=causal, varlen=varlen, dropout=bool(dropout_p)
        )
        if form == EMPTY:
            out = _empty_like_call(query, key, value)
            if attn_mask is not None and attn_mask.requires_grad:  # its gradient: zeros, not None
                out = out + attn_mask.sum().to(out.dtype) * 0
            return out
        if form == NESTED:
            out = self._run_varlen(
                query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal, scale
            )
            # under create_graph=True the nested backward fails inside a nested op, naming only that op
            refuse_create_graph_through(f"the {self.name} backend's varlen attention", out)
            return out
        return self._run_dense(query, key, value, attn_mask, dropout_p, causal, scale, form)

    @staticmethod
    def _last_dim_contiguous(t):
        return t if t.stride(-1) == 1 else t.contiguous()

    def _sdpa(self, q, k, v, mask, dropout_p, is_causal, scale, gqa):
        with self._context():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
            )

    def _run_dense(self, query, key, value, mask, dropout_p, causal, scale, form):
        """A non-empty dense call in call_form's `form`."""
        b, hq, sq, _ = query.shape
        hkv, sk = key.shape[1], key.shape[2]
        # ints: symbolic heads (torch.compile dynamic=True) would make a SymBool, which F.sdpa refuses
        gqa = operator.index(hkv) != operator.index(hq)
        query, key, value = (self._last_dim_contiguous(t) for t in (query, key, value))
        if form in (PLAIN, IS_CAUSAL):
            return self._sdpa(query, key, value, None, dropout_p, form == IS_CAUSAL, scale, gqa)
        if form == FOLDED:
            out = self._sdpa(fold_rows(query, hkv), key, value, None, 0.0, False, scale, False)
            return unfold_rows(out, hq)
        if form == TAIL:
            # rows i < Sq - Sk have no allowed key; the last Sk rows form a square causal problem
            tail = self._sdpa(query[:, :, sq - sk :], key, value, None, dropout_p, True, scale, gqa)
            head = tail.new_zeros(b, hq, sq - sk, tail.shape[-1])
            return torch.cat([head, tail], dim=2)
        if form == LOWER_RIGHT:
            from torch.nn.attention.bias import causal_lower_right

            if gqa:  # the lower-right path calls the kernels directly, without enable_gqa
                group = hq // hkv
                key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
            return self._sdpa(query, key, value, causal_lower_right(sq, sk), dropout_p, False, scale, False)
        if form == BAND_MASK:
            mask = _band_mask(sq, sk, causal, query.device).view(1, 1, sq, sk)
        elif form == MASK_BAND:
            band = _band_mask(sq, sk, causal, query.device)
            mask = mask & band if mask.dtype == torch.bool else mask.masked_fill(~band, -math.inf)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        row_ok = None
        if self.fix_empty_rows:
            row_ok = (
                mask.any(-1, keepdim=True) if mask.dtype == torch.bool else (mask > -math.inf).any(-1, keepdim=True)
            )
            fill = True if mask.dtype == torch.bool else 0.0
            mask = torch.where(row_ok, mask, torch.full((), fill, dtype=mask.dtype, device=mask.device))
        out = self._sdpa(query, key, value, mask, dropout_p, False, scale, gqa)
        if row_ok is not None:
            out = torch.where(row_ok, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out

    def run_kvcache(self, query, k_cache, v_cache, cache_seqlens, *, k_new, v_new, block_table, causal, window, scale):
        """A dense KV cache: the append (kernels/kv_append.py), then F.sdpa over the whole cache with
        a bool mask built on the device from cache_seqlens, rows past the lengths zeroed in a
        copy (module doc)."""
        if block_table is not None or window is not None:
            raise ValueError(f"{self.name}: a paged KV cache or a window is not supported (rejected by check())")
        b, hq, sq, _ = query.shape
        capacity = k_cache.shape[2]
        lengths = cache_seqlens
        if k_new is not None:
            append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new)
            lengths = cache_seqlens + sq
        if 0 in (b, hq, sq, capacity):
            return query.new_zeros(b, hq, sq, v_cache.shape[-1])
        mask = _kv_mask(lengths, sq, capacity, causal)
        # rows past L_b may hold NaN/Inf (torch.empty): a False mask entry leaves them in the
        # sum (score NaN + -inf, or P = 0 times NaN), so the kernel gets zeros there instead
        valid = (torch.arange(capacity, device=lengths.device) < lengths.view(-1, 1, 1)).unsqueeze(-1)
        zero = torch.zeros((), dtype=k_cache.dtype, device=k_cache.device)
        key, value = torch.where(valid, k_cache, zero), torch.where(valid, v_cache, zero)
        return self._run_dense(query, key, value, mask, 0.0, None, scale, MASK)

    def _run_varlen(self, query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale):
        """A non-empty varlen call (call_form NESTED)."""
        hq, hkv = query.shape[1], key.shape[1]
        if hkv != hq:
            group = hq // hkv
            key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        query, key, value = (self._last_dim_contiguous(t) for t in (query, key, value))
        lq = (cu_q[1:] - cu_q[:-1]).tolist()
        lk = (cu_k[1:] - cu_k[:-1]).tolist()
        keep = [i for i in range(len(lq)) if lq[i] > 0 and lk[i] > 0]
        if len(keep) < len(lq):  # nested kernels refuse zero-length sequences
            if not keep:
                return _empty_like_call(query, key[:0], value[:0])
            cq, ck = cu_q.tolist(), cu_k.tolist()
            q_idx = torch.cat([torch.arange(cq[i], cq[i + 1]) for i in keep]).to(query.device)
            k_idx = torch.cat([torch.arange(ck[i], ck[i + 1]) for i in keep]).to(key.device)
            sub_cq = torch.tensor(
                [0] + [sum(lq[i] for i in keep[: n + 1]) for n in range(len(keep))], device=cu_q.device
            )
            sub_ck = torch.tensor(
                [0] + [sum(lk[i] for i in keep[: n + 1]) for n in range(len(keep))], device=cu_k.device
            )
            sub = self._nested(
                query[q_idx],
                key[k_idx],
                value[k_idx],
                sub_cq,
                sub_ck,
                max(lq[i] for i in keep),
                max(lk[i] for i in keep),
                dropout_p,
                causal,
                scale,
            )
            out = sub.new_zeros(query.shape[0], hq, sub.shape[-1])
            return out.index_copy(0, q_idx, sub)
        return self._nested(query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale)

    def _nested(self, query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale):
        from torch.nested import nested_tensor_from_jagged as njt

        off_q = cu_q.to(torch.int64)
        off_k = off_q if cu_k is cu_q else cu_k.to(torch.int64)
        q = njt(query, off_q, max_seqlen=max_q).transpose(1, 2)
        k = njt(key, off_k, max_seqlen=max_k).transpose(1, 2)
        v = njt(value, off_k, max_seqlen=max_k).transpose(1, 2)
        with self._context():
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=causal is not None, scale=scale
            )
        return out.transpose(1, 2).values()
