"""The `triton` backend: this project's own kernel (attention_dispatch.kernels).

On a GPU it needs Triton and CUDA; on the CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported), which is how CI tests it.  Calls against
a KV cache (sdpa_with_kvcache) run kernels/decode.py: the append in place, then split-KV over
the cache, dense or paged, nothing read on the host (on Hopper, many new queries over a dense
cache take the Gluon forward over the whole key tiles and the decode kernel over the rest).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from ..caches import register_cache
from ..dropout_stream import current
from ..problem import KV_LAYOUTS, Problem
from ..route import Route, RouteStep
from ..semantics import band
from .base import Backend, Capabilities, check_backward_options, check_dkv_out, check_dq_accumulator, check_split


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _import_error() -> str:
    """'' when the kernel package imports, else the first line of why not."""
    if importlib.util.find_spec("triton") is None:
        return "not installed: pip install triton"
    try:
        import attention_dispatch.kernels.autograd  # noqa: F401 - the kernels and Triton behind them
    except Exception as exc:  # a broken install must not break the dispatcher
        return f"triton failed to import: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return ""


register_cache("backends.triton.import_error", _import_error.cache_clear, lambda: _import_error.cache_info().currsize)


def _alibi_2d(slopes, batch: int):
    """ALiBi slopes as the kernels take them: (B, Hq), a (Hq,) tensor expanded (stride 0)."""
    if slopes is None or slopes.dim() == 2:
        return slopes
    return slopes.unsqueeze(0).expand(batch, slopes.shape[0])


class TritonBackend(Backend):
    """Every feature of DESIGN.md section 3, forward and backward."""

    name = "triton"

    def __init__(self):
        from ..kernels.limits import KERNEL_LIMITS as L
        from ..semantics import CausalKind

        self.capabilities = Capabilities(
            devices=frozenset(L.device_types),
            min_compute_capability=L.min_compute_capability,
            dtypes=frozenset(L.dtypes),
            head_dim_min=L.min_head_dim,
            head_dim_max=L.max_head_dim,
            different_head_dims=L.head_dim_qk_ne_v,
            causal_kinds=frozenset(CausalKind(k) for k in L.causal_kinds),
            window=L.window,
            bool_mask=L.bool_mask,
            float_bias=L.float_bias,
            bias_grad=L.bias_grad,
            float32_bias=L.float32_bias,
            dropout=L.dropout,
            varlen=L.varlen,
            gqa=L.gqa,
            deterministic_backward=L.deterministic_backward,
            kv_cache=frozenset(L.kv_cache),
            paged_block_size_min=L.paged_block_size_min,
            paged_block_size_pow2=L.paged_block_size_pow2,
            softcap=L.softcap,
            alibi=L.alibi,
            sinks=L.sinks,
            sinks_grad=L.sinks_grad,
            return_lse=L.return_lse,
            lse_grad=L.lse_grad,
            # every dropout call runs the tl kernels (the Gluon and decode routes take no dropout:
            # gluon/route.py, entry.decode_reason), which draw at a block's position (column
            # offsets that are multiples of 4); varlen calls cannot be blocks
            dropout_positions=L.dropout,
            dropout_column_multiple=L.dropout_column_multiple,
            # kernels.attention_backward reads the output and logsumexp it is given
            backward_from_output=True,
            backward_dq_accumulator=True,
            backward_dkv_out=True,
            backward_split=True,
            notes="this project's kernel; CPU only under TRITON_INTERPRET=1",
        )

    def is_available(self) -> bool:
        return not self.unavailable_reason()

    def unavailable_reason(self) -> str:
        if _import_error():
            return _import_error()
        if not torch.cuda.is_available() and not _interpreting():
            return "no CUDA device (set TRITON_INTERPRET=1 before importing triton to run on the CPU)"
        return ""

    def version(self) -> str:
        if importlib.util.find_spec("triton") is None:
            return ""
        import triton

        return triton.__version__

    def check(self, problem: Problem) -> list[str]:
        if problem.device_type == "cpu" and not _interpreting():
            return ["device=cpu needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)"]
        if problem.layout in KV_LAYOUTS:
            return []  # the decode kernel's limits are all in the capabilities (kernels/limits.py)
        from ..kernels import config_reason, configs

        if problem.device_type not in self.capabilities.devices or configs.static_reason(
            problem.head_dim_qk, problem.head_dim_v, problem.dtype
        ):
            return []  # device, dtype and head dims: KERNEL_LIMITS, which the capabilities already report
        reason = config_reason(
            problem.head_dim_qk, problem.head_dim_v, problem.dtype, problem.device_type, problem.compute_capability
        )
        return [reason] if reason else []

    @staticmethod
    def _kv_params(causal, window, scale, softcap=None, **_):
        from ..kernels import KernelParams

        _, left, right = band(causal, window)
        return KernelParams(
            scale=scale, align_bottom_right=True, window_left=left, window_right=right, softcap=softcap or 0.0
        )

    def route_kvcache(self, query, k_cache, v_cache, cache_seqlens, options: dict) -> Route:
        """The kernels of a KV-cache call, from kernels.decode.kv_route (what run_kvcache runs)."""
        from ..kernels.decode import CACHE_GLUON, kv_route

        kernel, why_not = kv_route(
            query,
            k_cache,
            v_cache,
            options["block_table"],
            self._kv_params(**options),
            options.get("alibi_slopes"),
            options.get("sinks"),
        )
        passed = () if why_not is None else ((CACHE_GLUON, why_not),)
        return Route((RouteStep("forward", kernel, passed),))

    def run_kvcache(
        self,
        query,
        k_cache,
        v_cache,
        cache_seqlens,
        *,
        k_new,
        v_new,
        block_table,
        causal,
        window,
        scale,
        softcap=None,
        alibi_slopes=None,
        sinks=None,
        return_lse=False,
    ):
        from ..kernels.decode import kv_forward
        from ..kernels.kv_append import append_kv

        params = self._kv_params(causal, window, scale, softcap)
        # the kernels read rows with unit stride: copy what is not (never the common call); a
        # cache that must be copied gets the new keys first, so they land in the caller's
        if k_new is not None and (k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
            append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
            k_new = v_new = None
            n_new = query.shape[2]
        else:
            n_new = 0
        query, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, k_cache, v_cache))
        if k_new is not None:
            k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_new, v_new))
        if cache_seqlens.stride(0) != 1:
            cache_seqlens = cache_seqlens.contiguous()
        if block_table is not None and block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        if n_new:  # appended above: the kernels read all L_b = cache_seqlens[b] + Sq keys from the cache
            cache_seqlens = cache_seqlens + n_new
        return kv_forward(
            query,
            k_cache,
            v_cache,
            cache_seqlens,
            params,
            block_table,
            k_new,
            v_new,
            alibi=_alibi_2d(alibi_slopes, query.shape[0]),
            sinks=sinks,
            need_lse=return_lse,
        )

    def prepare_kvcache(self, query, k_cache, v_cache, cache_seqlens, options: dict):
        """Base.prepare_kvcache: the decode plan relaunched (kernels.decode.prepare_kv) where the
        call runs the decode kernel without alibi, sinks or logsumexp, else run_kvcache()."""
        fallback = super().prepare_kvcache(query, k_cache, v_cache, cache_seqlens, options)
        if options.get("return_lse") or any(options.get(n) is not None for n in ("softcap", "alibi_slopes", "sinks")):
            return fallback
        from ..kernels.decode import prepare_kv

        runner = prepare_kv(
            query,
            k_cache,
            v_cache,
            cache_seqlens,
            self._kv_params(**options),
            options["block_table"],
            options["k_new"],
            options["v_new"],
            fallback,
        )
        return fallback if runner is None else runner

    @staticmethod
    def _params(causal, window, scale, dropout_p, deterministic, softcap=None, **_):
        from ..kernels import KernelParams

        bottom_right, left, right = band(causal, window)
        return KernelParams(
            scale=scale,
            align_bottom_right=bottom_right,
            window_left=left,
            window_right=right,
            dropout_p=dropout_p,
            deterministic=deterministic,
            softcap=softcap or 0.0,
        )

    @staticmethod
    def _score_tensors(query, options: dict) -> dict:
        """The kernels' alibi / sinks arguments from the call's options (slopes as (B, Hq))."""
        batch = query.shape[0] if options["cu_seqlens_q"] is None else options["cu_seqlens_q"].numel() - 1
        return dict(alibi=_alibi_2d(options.get("alibi_slopes"), batch), sinks=options.get("sinks"))

    def route(self, query, key, value, options: dict) -> Route:
        """The forward's kernel (Gluon or tl) and, for a call that needs gradients, the dK/dV and
        dQ passes' (Gluon, tl, or dQ fused into the Gluon dK/dV pass), from the functions that
        choose them at run time (kernels.entry)."""
        from ..kernels import describe_route

        mask = options["attn_mask"]
        grads = (query, key, value, mask, options.get("sinks"))
        backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grads)
        steps = describe_route(
            query,
            key,
            value,
            mask,
            self._params(**options),
            options["cu_seqlens_q"],
            options["cu_seqlens_k"],
            options["max_seqlen_q"],
            options["max_seqlen_k"],
            backward=backward,
            need_lse=bool(options.get("return_lse")),
            **self._score_tensors(query, options),
        )
        return Route(
            tuple(RouteStep(part, kernel, passed) for part, kernel, passed in steps),
            note="backward route for a contiguous dO" if backward else "",
        )

    def dropout_keep_mask(self, query, key, options: dict):
        """run()'s keep-mask of a dropout call, drawn again (call it with the random state from
        before run(), or in the same dropout_stream.positioned() scope): bool (B, Hq, Sq, Sk); varlen (sequences, Hq, max_seqlen_q, max_seqlen_k),
        local positions (the numerics guard judges dropout calls with it)."""
        from ..kernels import dropout_keep_mask

        if options["cu_seqlens_q"] is None:
            b, hq, sq, sk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        else:
            b, hq = options["cu_seqlens_q"].numel() - 1, query.shape[1]
            sq, sk = options["max_seqlen_q"], options["max_seqlen_k"]
        stream = self._dropout_stream(query, key, options)  # a positioned call's: no seed drawn
        return dropout_keep_mask(b, hq, sq, sk, options["dropout_p"], query.device, seed=stream)

    @staticmethod
    def _dropout_stream(query, key, options: dict):
        """The kernels' stream for a dropout call under dropout_stream.positioned(), else None
        (the kernels draw a seed)."""
        stream = current() if options.get("dropout_p", 0) > 0 else None
        if stream is None:
            return None
        if options["cu_seqlens_q"] is not None:
            raise ValueError(
                "a positioned dropout stream (dropout_stream.positioned) with varlen: the stream is keyed "
                "by (sequence, position in it), so a varlen call cannot be a block of a larger one"
            )
        from ..kernels.dropout import positioned_stream

        return positioned_stream(
            stream.seed.to(query.device),
            query.shape[1],
            stream.batch_offset,
            stream.row_offset,
            stream.col_offset,
            stream.seqlen_q,
            stream.seqlen_k,
            (query.shape[2], key.shape[2]),
        )

    def run(self, query, key, value, *, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
        from ..kernels import triton_attention

        # The mask goes un-expanded: the kernel broadcasts size-1 dims itself and returns the
        # bias gradient in the mask's own shape, with no (B, H, Sq, Sk) workspace.
        score = self._score_tensors(query, dict(options, cu_seqlens_q=cu_seqlens_q))
        result = triton_attention(
            query,
            key,
            value,
            attn_mask,
            self._params(**options),
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            return_lse=bool(options.get("return_lse")),
            alibi_slopes=score["alibi"],
            sinks=score["sinks"],
            dropout_stream=self._dropout_stream(query, key, dict(options, cu_seqlens_q=cu_seqlens_q)),
        )
        if options.get("return_lse") and cu_seqlens_q is not None:  # the kernels' (total_q, Hq) as (Hq, total_q)
            return result[0], result[1].transpose(0, 1)
        return result

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
        """Base.run_backward: the kernels' backward (kernels.attention_backward) with the given
        output and logsumexp (its delta pass reads them and grad_lse), no bias gradient; dq
        added into ``dq_accumulator`` and dk/dv written into ``dkv_out`` by the kernels where given;
        ``only``/``dq_out`` as the kernels' (a separate dQ pass where the route fuses it)."""
        from ..kernels import attention_backward

        check_backward_options(options)
        check_split(only, dq_out, query, dq_accumulator)
        check_dq_accumulator(dq_accumulator, query)
        check_dkv_out(dkv_out, key, value)
        dense = dict(options, cu_seqlens_q=None)
        stream = self._dropout_stream(query, key, dense)
        if options.get("dropout_p", 0) > 0 and stream is None:
            raise ValueError(
                "run_backward with dropout_p > 0 needs the forward's keep-mask: call it under the forward's "
                "dropout_stream.positioned() scope"
            )
        seed = stream if stream is not None else torch.empty(0, dtype=torch.int64, device=query.device)
        dq, dk, dv, _, _ = attention_backward(
            grad_out,
            query,
            key,
            value,
            options["attn_mask"],
            out,
            lse.to(torch.float32).contiguous(),  # the kernels read a contiguous float32 logsumexp
            seed,
            self._params(**options),
            alibi=self._score_tensors(query, dense)["alibi"],
            grad_lse=grad_lse,
            dq_accumulator=dq_accumulator,
            dk_out=None if dkv_out is None else dkv_out[0],
            dv_out=None if dkv_out is None else dkv_out[1],
            only=only,
            dq_out=dq_out,
        )
        return dq, dk, dv

    def prepare(self, query, key, value, options: dict):
        from ..kernels import prepare_attention

        if any(options.get(name) for name in ("softcap", "return_lse", "dropout_p")) or any(
            options.get(name) is not None for name in ("alibi_slopes", "sinks")
        ):
            # the replay plans take none of these; dropout reads its stream's position per call
            return super().prepare(query, key, value, options)

        return prepare_attention(
            query,
            key,
            value,
            options["attn_mask"],
            self._params(**options),
            options["cu_seqlens_q"],
            options["cu_seqlens_k"],
            options["max_seqlen_q"],
            options["max_seqlen_k"],
        )
