"""flash-attn 2, 3 and 4 (Tri Dao's FlashAttention) behind one backend, ``flash_attn``.

Which implementation runs is decided per call from what imports and the GPU's
architecture, in this order of preference:

- flash-attn 3 (``flash_attn_interface``, built from ``hopper/``): sm90 only; no dropout.
- flash-attn 4 (``flash_attn.cute``, CuTe DSL): sm90 .. sm11x; no dropout; on sm90 its
  backward has no window, no varlen and no deterministic mode.
- flash-attn 2 (``flash_attn.flash_attn_func``): sm80+; the only one with dropout.

A call goes to the first of those that is installed and supports it; the reasons a
call is refused name the implementation ("flash-attn 4: ...").  One function makes that
choice, ``FlashAttnBackend.select``: run(), prepare(), check() and route() all take it, and
route() reports why each preferred generation was passed over (``ad.explain``'s route).
sdpa()'s repeated calls of one flash-attn 4 signature relaunch the compiled call the first
one recorded (``repeat_path``, :mod:`.fa4_relaunch`).

Mapping of our call (DESIGN.md section 3):

- layouts: ours (B, H, S, D) -> theirs (B, S, H, D) by ``transpose(1, 2)``: a view, no
  copy (flash-attn takes any batch/sequence/head strides with a unit last stride), and
  the output goes back the same way; varlen inputs (total, H, D) pass unchanged with
  int32 ``cu_seqlens`` and ``max_seqlen``.
- causal: flash-attn aligns causal bottom-right (``j <= i + Sk - Sq``); top-left equals it
  when Sq == Sk, and for varlen when cu_seqlens_q and cu_seqlens_k are one tensor (every
  sequence then has Sq == Sk); otherwise it is rejected (the shared capability check says so).
- window (left, right), -1 unbounded: flash-attn 2/3 take ``window_size=(left, right)``
  with -1 unbounded, relative to the same bottom-right diagonal (``causal=True`` forces
  right = 0, as our ``band()`` does); flash-attn 4 takes ``None`` for unbounded. flash-attn 2/3
  take a right side past Sk as Sk (or drop the window): where that changes a row (Sq > Sk + 1)
  those generations refuse (:mod:`.window_clamp`).
- GQA: native (key/value with fewer heads; query head h reads kv head h // (Hq / Hkv)).
- scale -> ``softmax_scale``; dropout_p -> ``dropout_p`` (flash-attn 2 only: the mask
  comes from PyTorch's default CUDA generator, so ``torch.manual_seed`` repeats a run, and
  the backward replays the forward's philox state); deterministic -> ``deterministic``.
- no attn_mask / bias: rejected.
- rows with no allowed key (bottom-right causal with Sq > Sk, or a window that misses
  every key): flash-attn documents output 0 for them; verified on the GPU by the tests.

sdpa_with_kvcache() (run_kvcache, the generations' KV-cache capabilities and reasons) is
:mod:`.flash_attn_kvcache`: flash_attn_with_kvcache for 2 and 3, flash_attn_varlen_func with
seqused_k / page_table after our append for 4.  softcap, alibi_slopes, sinks and return_lse
(what each generation takes, its reasons, keywords and logsumexp) are :mod:`.flash_attn_features`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import torch

from ..higher_order import refuse_create_graph_through
from ..problem import KV_LAYOUTS, Problem, compute_capability
from ..route import Route, RouteStep
from ..semantics import CausalKind, band
from .base import Backend, Capabilities, not_supported_reasons
from .empty import empty_attention, is_empty
from .window_clamp import right_bound_cut
from .fa4_compiled import compile_refusal
from .fa4_compiled import flash_attn_func as fa4_compiled_dense
from .fa4_relaunch import ForwardRelauncher, VarlenRelauncher, dist_version, fa4_version, untested_release
from . import flash_attn_backward
from . import flash_attn_features as features
from . import flash_attn_kvcache as kv
from .flash_attn_generations import (
    FA2_CAPS,
    FA3_CAPS,
    FA4_CAPS,
    FA4_HEAD_DIMS,
    INSTALL_HINT,
    LABELS,
    Choice,
    Implementation,
    caps_union,
)

# flash-attn's autograd Functions compute their gradients with kernels and do not refuse create_graph
SECOND_ORDER_WHAT = "the flash_attn backend's attention"
FEATURES = ("softcap", "alibi_slopes", "sinks", "return_lse")  # run()'s options, present only when used
# sdpa()'s repeated calls of one signature (prepare()): flash-attn 4's compiled call relaunched, or
# the library's public function
RELAUNCHED, PUBLIC = "relaunched", "public function"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _missing(error: ImportError, *names: str) -> bool:
    """True when the ImportError says one of `names` itself is not installed (not a dependency)."""
    return isinstance(error, ModuleNotFoundError) and error.name in names


def _needs_grad(query, key, value) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))


class FlashAttnBackend(Backend):
    """flash-attn 2/3/4; `versions` restricts which generations may be used (default all)."""

    name = "flash_attn"

    def __init__(self, versions: tuple[str, ...] = ("fa3", "fa4", "fa2")):
        self.versions = tuple(versions)  # in order of preference
        self.loaded: tuple[list[Implementation], list[str], bool, dict[str, str]] | None = None

    # -- importing ----------------------------------------------------------------
    def load(self) -> tuple[list[Implementation], list[str], bool, dict[str, str]]:
        """(implementations, import errors, anything installed at all, why each generation that
        did not load did not: key -> "not installed" | "import failed: ..."); cached per instance."""
        if self.loaded is not None:
            return self.loaded
        impls: list[Implementation] = []
        errors: list[str] = []
        absent: dict[str, str] = {}
        installed = False
        for key in self.versions:
            try:
                impl = getattr(self, f"_import_{key}")()
            except ImportError as e:
                if _missing(e, "flash_attn", "flash_attn_interface", "flash_attn.cute"):
                    absent[key] = "not installed"
                    continue
                installed = True
                errors.append(f"{key}: {_first_line(e)}")
                absent[key] = f"import failed: {_first_line(e)}"
                continue
            except Exception as e:  # broken install: ABI mismatch, missing CUDA library, ...
                installed = True
                errors.append(f"{key}: {_first_line(e)}")
                absent[key] = f"import failed: {_first_line(e)}"
                continue
            if impl is not None:
                installed = True
                impls.append(impl)
            else:
                absent[key] = "not installed (flash_attn has no flash_attn_func)"
        self.loaded = (impls, errors, installed, absent)
        return self.loaded

    @staticmethod
    def _implementation(key: str, version: str, mod, func, caps: Capabilities, build_flags=None) -> Implementation:
        """One generation's functions in `mod`, and `caps` narrowed to what they take (features, KV cache)."""
        varlen, kv_func = getattr(mod, "flash_attn_varlen_func", None), kv.kv_function(key, mod)
        caps = features.feature_capabilities(key, func, varlen, caps, build_flags)
        caps = kv.kv_capabilities(key, kv_func, caps, build_flags)
        return Implementation(key, LABELS[key], version, func, varlen, caps, kv_func)

    @classmethod
    def _import_fa2(cls) -> Implementation | None:
        mod = importlib.import_module("flash_attn")
        func = getattr(mod, "flash_attn_func", None)
        if func is None:  # e.g. only flash-attn 4's flash_attn.cute is installed
            return None
        version = str(getattr(mod, "__version__", "") or dist_version("flash-attn"))
        return cls._implementation("fa2", version, mod, func, FA2_CAPS)

    @classmethod
    def _import_fa3(cls) -> Implementation | None:
        mod = importlib.import_module("flash_attn_interface")
        version = str(getattr(mod, "__version__", "") or dist_version("flash-attn-3", "flash_attn_3"))
        return cls._implementation("fa3", version, mod, mod.flash_attn_func, FA3_CAPS, kv.fa3_build_flags())

    @classmethod
    def _import_fa4(cls) -> Implementation | None:
        mod = importlib.import_module("flash_attn.cute")
        version = fa4_version(str(getattr(mod, "__version__", "") or ""))
        caps = flash_attn_backward.fa4_capabilities(FA4_CAPS, str(version))
        return cls._implementation("fa4", str(version), mod, mod.flash_attn_func, caps)

    def implementations(self) -> list[Implementation]:
        return self.load()[0]

    # -- availability -------------------------------------------------------------
    def is_available(self) -> bool:
        return not self.unavailable_reason()

    def unavailable_reason(self) -> str:
        impls, errors, _, _ = self.load()
        if not impls:
            if errors:
                return "import failed: " + "; ".join(errors)
            return INSTALL_HINT
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        return ""

    def version(self) -> str:
        return ", ".join(f"{i.label} {i.version}".strip() for i in self.implementations())

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return caps_union([i.caps for i in self.implementations()])

    # -- decisions ----------------------------------------------------------------
    @staticmethod
    def _impl_checks(impl: Implementation, p: Problem) -> list[str]:
        reasons = []
        cc = p.compute_capability
        if (
            impl.key == "fa2"
            and cc is not None
            and p.requires_grad
            and p.dropout
            and p.head_dim_qk > 192
            and cc not in ((8, 0), (9, 0))
        ):
            reasons.append(f"backward with head_dim={p.head_dim_qk} > 192 and dropout needs sm80/sm90")
        if impl.key == "fa4":
            for d in {p.head_dim_qk, p.head_dim_v}:
                if d not in FA4_HEAD_DIMS:
                    reasons.append(f"head_dim={d} not in {{{', '.join(map(str, FA4_HEAD_DIMS))}}}")
            if cc is not None and cc[0] == 9 and p.requires_grad:
                if p.window is not None:
                    reasons.append("backward with a window not supported on sm90")
                if p.layout == "varlen":
                    reasons.append("varlen backward not supported on sm90")
                if p.deterministic and not p.deterministic_warn_only:
                    reasons.append("deterministic backward only on sm100/sm110")
        if impl.key in ("fa2", "fa3") and p.layout not in KV_LAYOUTS:
            cut = right_bound_cut(p.seqlen_q, p.seqlen_k, p.causal, p.window)
            if cut:
                reasons.append(cut)
        if p.layout == "varlen" and impl.varlen_func is None:
            reasons.append("this build has no flash_attn_varlen_func")
        if p.layout in KV_LAYOUTS:
            reasons.extend(kv.kv_reasons(impl.key, impl.version, p))
        reasons.extend(features.feature_reasons(impl.key, impl.version, p))
        return reasons

    def impl_reasons(self, impl: Implementation, p: Problem) -> list[str]:
        return not_supported_reasons(impl.caps, p) + self._impl_checks(impl, p)

    def select(self, p: Problem) -> Choice:
        """The one choice of a flash-attn generation: the first of ``versions`` (fa3, fa4, fa2:
        fastest first) that is installed and supports `p`, with why each one before it was
        passed over.  run(), prepare(), check() and route() all take it."""
        impls, _, _, absent = self.load()
        loaded = {i.key: i for i in impls}
        passed: list[tuple[str, str]] = []
        refusals: list[str] = []
        for key in self.versions:
            impl = loaded.get(key)
            if impl is None:
                passed.append((LABELS.get(key, key), absent.get(key, "not installed")))
                continue
            reasons = self.impl_reasons(impl, p)
            if not reasons:
                return Choice(impl, tuple(passed), tuple(refusals))
            passed.append((impl.label, "; ".join(reasons)))
            refusals.extend(f"{impl.label}: {r}" for r in reasons)
        return Choice(None, tuple(passed), tuple(refusals))

    def choose(self, p: Problem) -> tuple[Implementation | None, list[str]]:
        """The implementation that runs `p` (select()), or None and the reasons of every one."""
        choice = self.select(p)
        return choice.impl, ([] if choice.impl is not None else list(choice.refusals))

    def check(self, problem: Problem) -> list[str]:
        if not self.implementations():
            return []
        impl, reasons = self.choose(problem)
        if impl is not None:
            return []
        shared = set(not_supported_reasons(self.capabilities, problem))
        specific = [r for r in reasons if r.split(": ", 1)[1] not in shared]
        return specific or (["no flash-attn implementation supports this call"] if not shared else [])

    # -- running ------------------------------------------------------------------
    @staticmethod
    def problem_of(
        query,
        key,
        value,
        *,
        dropout_p=0.0,
        causal=None,
        window=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        deterministic=False,
        **features_and_rest,
    ) -> Problem:
        """The Problem of a normalised call (flash-attn never sees a mask)."""
        varlen = cu_seqlens_q is not None
        if varlen:
            batch, sq, sk = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k)
            hq, hkv = query.shape[1], key.shape[1]
        else:
            batch, hq, sq = query.shape[:3]
            hkv, sk = key.shape[1], key.shape[2]
        grad = _needs_grad(query, key, value)
        return Problem(
            batch=batch,
            heads_q=hq,
            heads_kv=hkv,
            seqlen_q=sq,
            seqlen_k=sk,
            head_dim_qk=query.shape[-1],
            head_dim_v=value.shape[-1],
            dtype=query.dtype,
            device_type=query.device.type,
            compute_capability=compute_capability(query.device),
            layout="varlen" if varlen else "dense",
            mask_kind="none",
            mask_shape=None,
            mask_requires_grad=False,
            causal=causal,
            window=window,
            dropout=dropout_p > 0,
            deterministic=bool(deterministic),
            deterministic_warn_only=False,
            last_dim_contiguous=True,
            aligned_16=True,
            same_offsets=varlen and cu_seqlens_k is cu_seqlens_q,
            **features.problem_fields(grad, features_and_rest),
        )

    @staticmethod
    def window_args(impl: Implementation, causal: CausalKind | None, window) -> tuple[bool, tuple]:
        """(causal flag, window_size) in the implementation's convention."""
        is_causal = causal is not None
        if window is None:
            return is_causal, ((None, None) if impl.key == "fa4" else (-1, -1))
        _, left, right = band(causal, window)
        if impl.key == "fa4":
            return is_causal, (None if left < 0 else left, None if right < 0 else right)
        return is_causal, (left, right)

    def run_problem(self, query, key, value, **options) -> Problem:
        """The Problem run() chooses a generation for (options as for run()).  Device and dtype
        were vetted by the dispatcher; the choice here is about features (dropout, window,
        varlen, head dims, arch), which keeps run() usable on fakes."""
        p = self.problem_of(query, key, value, **options)
        return dataclasses.replace(
            p, device_type="cuda", dtype=p.dtype if p.dtype in FA2_CAPS.dtypes else torch.float16
        )

    def _resolve(self, query, key, value, **options) -> tuple[Implementation, dict]:
        """(implementation select() chose, its keyword arguments) for a normalised call."""
        choice = self.select(self.run_problem(query, key, value, **options))
        impl = choice.impl
        if impl is None:
            raise RuntimeError("flash_attn cannot run this call: " + "; ".join(choice.refusals))
        causal, window = options.get("causal"), options.get("window")
        deterministic = bool(options.get("deterministic", False))
        is_causal, window_size = self.window_args(impl, causal, window)
        kwargs = dict(
            softmax_scale=options.get("scale"), causal=is_causal, window_size=window_size, deterministic=deterministic
        )
        if impl.key == "fa2":
            kwargs["dropout_p"] = float(options.get("dropout_p", 0.0))
        if options.get("cu_seqlens_q") is not None:
            kwargs.update(max_seqlen_q=int(options["max_seqlen_q"]), max_seqlen_k=int(options["max_seqlen_k"]))
        kwargs.update(features.feature_kwargs(impl.key, options))
        return impl, kwargs

    @staticmethod
    def repeat_path(impl: Implementation, varlen: bool, grad: bool) -> tuple[str, tuple[tuple[str, str], ...]]:
        """How sdpa()'s repeated calls of one signature reach `impl` (prepare() takes it):
        flash-attn 4's compiled forward RELAUNCHED as the signature's first call recorded it
        (its Python costs ~10x its kernel launch, E59), else the PUBLIC function, with why."""
        if impl.key != "fa4":
            return PUBLIC, ()
        why = untested_release(impl.version)
        if why is None and varlen and grad:
            why = "varlen with autograd: only flash-attn 4's varlen inference forward is relaunched"
        return (PUBLIC, ((RELAUNCHED, why),)) if why else (RELAUNCHED, ())

    def route(self, query, key, value, options: dict) -> Route | None:
        """select()'s generation as run() takes it ("kernel": forward and backward are the same
        generation's), with why each faster one was passed over; for flash-attn 4 also how
        sdpa()'s repeated calls reach it (repeat_path)."""
        if options.get("attn_mask") is not None:
            return None  # rejected by check(); run() raises
        varlen = options.get("cu_seqlens_q") is not None
        choice = self.select(self.run_problem(query, key, value, **options))
        if choice.impl is None:
            return Route((RouteStep("kernel", "none", choice.passed_over),), note="run() raises: no generation runs it")
        if is_empty(query, key, value):
            passed = ((choice.impl.label, "an empty dimension: exact zeros, no kernel"),)
            return Route((RouteStep("output", "zeros", passed),))
        steps = [RouteStep("kernel", choice.impl.label, choice.passed_over)]
        note = ""
        if choice.impl.key == "fa4" and not any(f in options for f in FEATURES):  # sdpa() prepares none of those
            path, passed = self.repeat_path(choice.impl, varlen, _needs_grad(query, key, value))
            steps.append(RouteStep("repeat calls", path, passed))
            if path == RELAUNCHED:
                note = "relaunched as the first call records it; a record that does not fit keeps the public function"
        return Route(tuple(steps), note)

    @staticmethod
    def _dense(func, kwargs: dict, query, key, value, *, lse_of=None):
        """(B, H, S, D) in and out; flash-attn takes (B, S, H, D): transposed views, no copies
        (a contiguous copy costs more than the strided reads, docs/experiments/perf-notes.md).
        ``lse_of``: with return_lse, the generation's key; returns (out, lse) then."""
        result = func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), **kwargs)
        out = (result[0] if isinstance(result, tuple) else result).transpose(1, 2)
        lse = None if lse_of is None else features.library_lse(lse_of, result, query, False)
        refuse_create_graph_through(SECOND_ORDER_WHAT, out, lse)  # flash-attn's Functions would not
        return out if lse_of is None else (out, lse)

    @staticmethod
    def _varlen(func, kwargs: dict, query, key, value, *, cu_seqlens_q, cu_seqlens_k, lse_of=None):
        """Packed (total, H, D) in and out, int32 offsets; ``kwargs`` hold max_seqlen."""
        result = func(query, key, value, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        lse = None if lse_of is None else features.library_lse(lse_of, result, query, True)
        refuse_create_graph_through(SECOND_ORDER_WHAT, out, lse)
        return out if lse_of is None else (out, lse)

    def run(
        self,
        query,
        key,
        value,
        *,
        attn_mask=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        **options,
    ):
        if attn_mask is not None:
            raise ValueError("flash_attn: attn_mask is not supported (rejected by check())")
        impl, kwargs = self._resolve(
            query,
            key,
            value,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            **options,
        )
        varlen = cu_seqlens_q is not None
        lse_of = impl.key if options.get("return_lse") else None
        if is_empty(query, key, value):
            return features.empty_result(empty_attention(query, key, value, varlen), query, varlen, options)
        if varlen:
            offsets = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
            return self._varlen(impl.varlen_func, kwargs, query, key, value, lse_of=lse_of, **offsets)
        if impl.key == "fa4" and torch.compiler.is_compiling() and compile_refusal(impl.version, kwargs) is None:
            return self._dense(fa4_compiled_dense, kwargs, query, key, value, lse_of=lse_of)
        return self._dense(impl.func, kwargs, query, key, value, lse_of=lse_of)

    def run_backward(self, query, key, value, out, lse, grad_out, grad_lse, **options):
        """Base.run_backward on flash-attn 4's backward op (flash_attn_backward.py); no dq_accumulator,
        dkv_out or only/dq_out (not declared: refused, naming them)."""
        return flash_attn_backward.run_backward(self, query, key, value, out, lse, grad_out, grad_lse, options)

    def run_kvcache(self, query, k_cache, v_cache, cache_seqlens, **options):
        return kv.run_kvcache(self, query, k_cache, v_cache, cache_seqlens, **options)

    def prepare(self, query, key, value, options: dict):
        """The implementation and its arguments chosen once for the signature (varlen calls
        pass their own offsets; max_seqlen is part of the signature).  A flash-attn 4 dense
        forward is relaunched from its recorded compiled call (:mod:`.fa4_relaunch`; with
        autograd, flash-attn 4's own backward follows), and so is its varlen inference forward."""
        varlen = options["cu_seqlens_q"] is not None
        if options["attn_mask"] is not None or is_empty(query, key, value) or any(f in options for f in FEATURES):
            return super().prepare(query, key, value, options)  # run() each call; nothing recorded
        impl, kwargs = self._resolve(query, key, value, **options)
        grad = _needs_grad(query, key, value)
        relaunched = self.repeat_path(impl, varlen, grad)[0] == RELAUNCHED
        if not varlen:
            if relaunched:
                return ForwardRelauncher(impl.func, kwargs, training=grad)
            return functools.partial(self._dense, impl.func, kwargs)
        if relaunched:  # inference: relaunched as the dense forward
            return VarlenRelauncher(impl.varlen_func, kwargs, (options["cu_seqlens_q"], options["cu_seqlens_k"]))
        # each call's offsets override these keywords (partial lets call keywords win)
        return functools.partial(
            self._varlen,
            impl.varlen_func,
            kwargs,
            cu_seqlens_q=options["cu_seqlens_q"],
            cu_seqlens_k=options["cu_seqlens_k"],
        )


__all__ = ["FlashAttnBackend", "Implementation", "Choice", "FA2_CAPS", "FA3_CAPS", "FA4_CAPS", "INSTALL_HINT"]
