"""Fake `flash_attn` / `flash_attn_interface` / `flash_attn.cute` and `xformers` packages.

They compute through tests/naive.py's float64 `naive_attention` with *their own*
library's semantics (flash-attn: causal aligned bottom-right, window_size relative to
that diagonal; xformers: its attn_bias types), and record every call's arguments, so a
wrong mapping in an adapter gives a wrong number or a wrong recorded argument.
Install them with `install(monkeypatch, modules)`.
"""

from __future__ import annotations

import math
import sys
import types

import torch

from tests.naive import _allowed, naive_attention


def install(monkeypatch, modules: dict[str, types.ModuleType]) -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in {m.split(".")[0] for m in modules}:
            monkeypatch.delitem(sys.modules, name, raising=False)
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)


def _record(calls, fn, q, k, v, kwargs):
    calls.append(dict(fn=fn, q=q, k=k, v=v, q_ptr=q.data_ptr(), q_shape=tuple(q.shape), **kwargs))


def _dropout_keep(shape, p):
    return torch.rand(shape, dtype=torch.float64) >= p


# ---------------------------------------------------------------- flash-attn -----
def _fa_window(window_size, v4, seqlen_k=None):
    """The window a generation computes. flash-attn 2/3 (flash_api.cpp's set_params_fprop): a side >= Sk
    becomes unbounded, then an unbounded side beside a bounded one becomes Sk (which cuts the first rows'
    keys when Sq > Sk + 1)."""
    left, right = window_size
    if v4:
        left = -1 if left is None else left
        right = -1 if right is None else right
    elif seqlen_k is not None:
        left, right = (-1 if w >= seqlen_k else w for w in (left, right))
        if left < 0 and right >= 0:
            left = seqlen_k
        if left >= 0 and right < 0:
            right = seqlen_k
    return None if (left, right) == (-1, -1) else (left, right)


_SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # flash_attn.cute's _LEARNABLE_SINK_DTYPES


def _fa2_causal_kernel(window_size, causal, seqlen_k) -> bool:
    """flash-attn 2's causal kernel (flash_api.cpp): window sides >= Sk unbounded, causal makes
    right 0, causal = left unbounded with right 0."""
    left, right = (-1 if w >= seqlen_k else w for w in window_size)
    right = 0 if causal else right
    return left < 0 and right == 0


def _fa_features(
    version,
    q,
    k,
    v,
    *,
    softmax_scale,
    causal,
    window_size,
    dropout_p=0.0,
    softcap=0.0,
    alibi_slopes=None,
    learnable_sink=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_k=None,
):
    """What generation `version` computes for a call with softcap, ALiBi slopes or sinks, or one
    that asks for its logsumexp: (out, lse) in its layouts (out (B, S, H, Dv) or (total, H, Dv)
    in q's dtype, differentiable; lse float32 (B, H, Sq) or (H, total_q)) and with its meaning:
    flash-attn 2 marks an empty row +inf and its causal kernel adds ALiBi as slope * j (a
    logsumexp larger by slope * (i + Sk - Sq)); flash-attn 4's includes the sink."""
    v4, varlen, hq = version == 4, cu_seqlens_q is not None, q.shape[-2]
    nb = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    if version == 2 and softcap and dropout_p:
        raise RuntimeError("Softcapping does not support dropout for now")
    if alibi_slopes is not None:
        assert version == 2, "only flash-attn 2 takes alibi_slopes"
        assert alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32"
        assert alibi_slopes.stride(-1) == 1, "ALiBi slopes tensor must have contiguous last dimension"
        assert tuple(alibi_slopes.shape) in ((hq,), (nb, hq))
    if learnable_sink is not None:
        assert v4 and tuple(learnable_sink.shape) == (hq,) and learnable_sink.dtype in _SINK_DTYPES
    kw = dict(
        causal="bottom_right" if causal else None,
        window=_fa_window(window_size, v4, max_seqlen_k if varlen else k.shape[1]),
        scale=softmax_scale,
        softcap=softcap or None,
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.double(),
        sinks=None if learnable_sink is None else learnable_sink.double(),
        return_lse=True,
    )
    if varlen:
        out, lse = naive_attention(
            q.double(), k.double(), v.double(), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **kw
        )
        lse = lse.t()  # (total_q, H) -> (H, total_q)
        lens_q, lens_k = cu_seqlens_q.diff().long(), cu_seqlens_k.diff().long()
        seq = torch.repeat_interleave(torch.arange(nb), lens_q)
        position = torch.arange(q.shape[0]) - cu_seqlens_q[:-1].long()[seq] + (lens_k - lens_q)[seq]  # i + off
        seqlen_k = max_seqlen_k
    else:
        keep = _dropout_keep((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), dropout_p) if dropout_p else None
        qb, kb, vb = (t.transpose(1, 2).double() for t in (q, k, v))  # theirs BSHD -> BHSD
        out, lse = naive_attention(qb, kb, vb, keep=keep, dropout_p=dropout_p, **kw)
        out = out.transpose(1, 2)
        seq = None
        position = torch.arange(q.shape[1]) + k.shape[1] - q.shape[1]
        seqlen_k = k.shape[1]
    if version == 2:
        left_right = (-1, -1) if window_size is None else tuple(window_size)
        if alibi_slopes is not None and _fa2_causal_kernel(left_right, causal, seqlen_k):
            slopes = alibi_slopes.double().reshape(-1, hq).expand(nb, hq)
            shift = slopes[seq].t() * position if varlen else slopes[:, :, None] * position
            lse = lse + shift
        lse = lse.masked_fill(lse == -math.inf, math.inf)
    if v4 and learnable_sink is not None:
        sinks = learnable_sink.double()
        lse = torch.logaddexp(lse, sinks[:, None] if varlen else sinks[None, :, None])
    lse = lse.float()
    return out.to(q.dtype), (lse if v4 else lse.detach())  # 2 and 3: their backward ignores it


def _given(x) -> bool:
    """A feature keyword other than its default (None, 0.0 softcap, False)."""
    return x is not None and x is not False and not (isinstance(x, (int, float)) and x == 0)


def make_flash_attn(version: int, calls: list) -> dict[str, types.ModuleType]:
    """Modules of one flash-attn generation (2, 3 or 4), each public function with its library's
    signature (tests/test_adapters.py compares them with the installed library's)."""
    v4 = version == 4

    def run_dense(q, k, v, *, dropout_p, softmax_scale, causal, window_size, deterministic, extra, **feat):
        """feat: softcap, alibi_slopes, learnable_sink, return_lse (as each generation names them)."""
        feat = {n: x for n, x in feat.items() if _given(x)}
        _record(
            calls,
            "dense",
            q,
            k,
            v,
            dict(
                dropout_p=dropout_p,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                deterministic=deterministic,
                extra=extra,
                **feat,
            ),
        )
        wants_lse = feat.pop("return_lse", False)
        if feat or wants_lse:
            out, lse = _fa_features(
                version, q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                dropout_p=dropout_p, **feat,
            )  # fmt: skip
            if version == 4:  # (out, lse): lse differentiable only when asked for, as FlashAttnFunc
                grad = torch.is_grad_enabled() and any(
                    t.requires_grad for t in (q, k, v, feat.get("learnable_sink")) if t is not None
                )
                return out, (lse if wants_lse else lse.detach() if grad else None)
            if version == 3:
                return (out, lse) if wants_lse else out
            return (out, lse, None) if wants_lse else out
        if v4:  # through the fake interface's compiled call (and backward), as flash_attn.cute does
            return _FakeFlashAttnFunc.apply(q, k, v, interface, softmax_scale, causal, window_size, deterministic)
        return dense_math(q, k, v, dropout_p, softmax_scale, causal, window_size)

    def dense_math(q, k, v, dropout_p, softmax_scale, causal, window_size):
        assert q.dim() == 4 and q.stride(-1) == 1
        qb, kb, vb = (t.transpose(1, 2).double() for t in (q, k, v))  # theirs BSHD -> BHSD
        keep = _dropout_keep((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), dropout_p) if dropout_p else None
        out = naive_attention(
            qb,
            kb,
            vb,
            causal="bottom_right" if causal else None,
            window=_fa_window(window_size, v4, k.shape[1]),
            scale=softmax_scale,
            keep=keep,
            dropout_p=dropout_p,
        )
        return out.transpose(1, 2).to(q.dtype).contiguous()

    def run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dropout_p, softmax_scale,
                   causal, window_size, deterministic, extra, **feat):  # fmt: skip
        feat = {n: x for n, x in feat.items() if _given(x)}
        _record(
            calls,
            "varlen",
            q,
            k,
            v,
            dict(
                dropout_p=dropout_p,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                deterministic=deterministic,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                extra=extra,
                **feat,
            ),
        )
        assert cu_seqlens_q.dtype == torch.int32 and isinstance(max_seqlen_q, int)
        wants_lse = feat.pop("return_lse", False)
        if feat or wants_lse:
            out, lse = _fa_features(
                version, q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                dropout_p=dropout_p, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_k=max_seqlen_k, **feat,
            )  # fmt: skip
            if version == 4:
                return out, (lse if wants_lse else lse.detach())
            if version == 3:
                return (out, lse) if wants_lse else out
            return (out, lse, None) if wants_lse else out
        if v4 and not any(t.requires_grad for t in (q, k, v)):
            # inference through the fake interface's compiled call, as flash_attn.cute does (the
            # fake has no varlen backward: with grad, plain math)
            return interface._flash_attn_fwd(
                q,
                k,
                v,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size_left=window_size[0],
                window_size_right=window_size[1],
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
            )
        out = varlen_math(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size)
        return (out, None) if version in (3, 4) else out

    def varlen_math(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size):
        out = naive_attention(
            q.double(),
            k.double(),
            v.double(),
            causal="bottom_right" if causal else None,
            window=_fa_window(window_size, v4, int(cu_seqlens_k.diff().max()) if cu_seqlens_k.numel() > 1 else 0),
            scale=softmax_scale,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
        )
        return out.to(q.dtype)

    if version == 2:
        fa = types.ModuleType("flash_attn")
        fa.__version__ = "2.8.3"

        def flash_attn_func(
            q,
            k,
            v,
            dropout_p=0.0,
            softmax_scale=None,
            causal=False,
            window_size=(-1, -1),
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            return_attn_probs=False,
            **extra,
        ):
            return run_dense(
                q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                deterministic=deterministic, extra=extra, softcap=softcap, alibi_slopes=alibi_slopes,
                return_lse=return_attn_probs,
            )  # fmt: skip

        def flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=None,
            causal=False,
            window_size=(-1, -1),
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            return_attn_probs=False,
            **extra,
        ):
            return run_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
                softmax_scale=softmax_scale, causal=causal, window_size=window_size, deterministic=deterministic,
                extra=extra, softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_attn_probs,
            )  # fmt: skip

        fa.flash_attn_func, fa.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
        fa.__path__ = []
        return {"flash_attn": fa}
    if version == 3:
        fa3 = types.ModuleType("flash_attn_interface")

        def flash_attn_func(  # noqa: F811 - flash-attn 3's
            q,
            k,
            v,
            softmax_scale=None,
            causal=False,
            window_size=(-1, -1),
            softcap=0.0,
            deterministic=False,
            return_attn_probs=False,
            **kw,
        ):
            assert "dropout_p" not in kw, "flash-attn 3 has no dropout"
            return run_dense(
                q, k, v, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                deterministic=deterministic, extra=kw, softcap=softcap, return_lse=return_attn_probs,
            )  # fmt: skip

        def flash_attn_varlen_func(  # noqa: F811 - flash-attn 3's
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale=None,
            causal=False,
            window_size=(-1, -1),
            softcap=0.0,
            deterministic=False,
            return_attn_probs=False,
            **kw,
        ):
            assert "dropout_p" not in kw, "flash-attn 3 has no dropout"
            return run_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                softmax_scale=softmax_scale, causal=causal, window_size=window_size, deterministic=deterministic,
                extra=kw, softcap=softcap, return_lse=return_attn_probs,
            )  # fmt: skip

        fa3.flash_attn_func, fa3.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
        return {"flash_attn_interface": fa3}
    pkg = types.ModuleType("flash_attn")  # flash-attn 4 alone: a namespace without flash_attn_func
    pkg.__path__ = []
    cute = types.ModuleType("flash_attn.cute")
    cute.__version__ = "4.0.0b36"

    interface = _fa4_interface(dense_math, varlen_math)

    def flash_attn_func(  # noqa: F811 - flash-attn 4's
        q,
        k,
        v,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
        softcap=0.0,
        deterministic=False,
        return_lse=False,
        **kw,
    ):
        assert "dropout_p" not in kw, "flash-attn 4 has no dropout"
        assert all(w is None or w >= 0 for w in window_size), "flash-attn 4 takes None for unbounded"
        # features computed from their definitions; otherwise through the fake interface's compiled
        # call (and backward), as flash_attn.cute does; other keywords are recorded (extra)
        return run_dense(
            q, k, v, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            deterministic=deterministic, extra=kw, softcap=softcap, learnable_sink=learnable_sink,
            return_lse=return_lse,
        )  # fmt: skip

    def flash_attn_varlen_func(  # noqa: F811 - flash-attn 4's
        q,
        k,
        v,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
        softcap=0.0,
        deterministic=False,
        return_lse=False,
        **kw,
    ):
        assert "dropout_p" not in kw, "flash-attn 4 has no dropout"
        assert all(w is None or w >= 0 for w in window_size)
        return run_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, deterministic=deterministic,
            extra=kw, softcap=softcap, learnable_sink=learnable_sink, return_lse=return_lse,
        )  # fmt: skip

    cute.flash_attn_func, cute.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    cute.interface = interface
    pkg.cute = cute
    return {"flash_attn": pkg, "flash_attn.cute": cute, "flash_attn.cute.interface": interface}


class _FakeFlashAttnFunc(torch.autograd.Function):
    """flash_attn.cute's FlashAttnFunc: _flash_attn_fwd, then _flash_attn_bwd."""

    @staticmethod
    def forward(ctx, q, k, v, interface, softmax_scale, causal, window_size, deterministic):
        out, lse = interface._flash_attn_fwd(
            q,
            k,
            v,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (interface, softmax_scale, causal, window_size, deterministic)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        interface, softmax_scale, causal, (left, right), deterministic = ctx.args
        dq, dk, dv = interface._flash_attn_bwd(
            q,
            k,
            v,
            out,
            dout,
            lse,
            softmax_scale,
            causal,
            0.0,
            window_size_left=left,
            window_size_right=right,
            deterministic=deterministic,
        )
        return dq, dk, dv, None, None, None, None, None


def _backward_from_output(q, k, v, out, dout, lse, dlse, scale, causal, window, softcap):
    """flash-attn 4's backward as it computes it, in float64: P = exp(s - lse) from the GIVEN
    logsumexp, dS = P (dO V^T - rowsum(dO out) + dlse) (tanh's derivative with softcap); (B, S, H, D)
    in and out, in q's dtype."""
    qb, kb, vb, ob, gb = (t.transpose(1, 2).double() for t in (q, k, v, out, dout))
    group = qb.shape[1] // kb.shape[1]
    kr, vr = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    raw = scale * qb @ kr.transpose(-1, -2)
    s = softcap * torch.tanh(raw / softcap) if softcap else raw
    allowed = _allowed(qb.shape[2], kb.shape[2], "bottom_right" if causal else None, window)
    p = torch.exp(s - lse.double().unsqueeze(-1)).masked_fill(~allowed, 0.0)
    delta = (gb * ob).sum(-1) - (0.0 if dlse is None else dlse.double())
    ds = p * (gb @ vr.transpose(-1, -2) - delta.unsqueeze(-1))
    if softcap:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = scale * ds @ kr
    dk = (scale * ds.transpose(-1, -2) @ qb).unflatten(1, (kb.shape[1], group)).sum(2)
    dv = (p.transpose(-1, -2) @ gb).unflatten(1, (kb.shape[1], group)).sum(2)
    return tuple(t.transpose(1, 2).to(q.dtype) for t in (dq, dk, dv))


class AuxData(tuple):
    """flash_attn.cute.utils.AuxData: a NamedTuple (tensors, scalars)."""

    def __new__(cls, tensors=None, scalars=None):
        return super().__new__(cls, (tensors, scalars))


def _fa4_interface(dense_math, varlen_math) -> types.ModuleType:
    """`flash_attn.cute.interface` as far as its inference forward goes: `_flash_attn_fwd`
    looks its compiled kernel up in `_flash_attn_fwd.compile_cache` by a compile key and calls
    it as (q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    page_table, window_size_left, window_size_right, learnable_sink, block sparsity, AuxData);
    the varlen kernel computes from the offsets it is given.
    A forward for a backward (an input requires grad) also gets an LSE tensor, filled with a
    per-call value that `_flash_attn_bwd` checks.  `launches` / `backwards` list the compiled
    calls and backward calls; `extra_tensor` makes the compiled call take one more tensor (as
    split-KV partials do), `copy_query` makes it copy the query first (as a misaligned layout
    does), `copy_offsets` the varlen offsets (as misaligned offsets are)."""
    interface = types.ModuleType("flash_attn.cute.interface")
    interface.launches, interface.backwards, interface.extra_tensor, interface.copy_query = [], [], False, False
    interface.marked_lse = True
    # True: _flash_attn_bwd computes from the out and lse it is given (a real logsumexp), as flash-attn
    # 4's does; False: by autograd through its own forward (the forward's lse may be a marker)
    interface.backward_from_lse = False
    interface.copy_offsets = False

    def compiled_for(causal, extra_tensor, varlen):
        def compiled(
            q, k, v, out, lse, softmax_scale, cu_q, cu_k, used_q, used_k, pages, left, right, sink, sparse, aux
        ):
            interface.launches.append(
                dict(
                    q_ptr=q.data_ptr(),
                    out_ptr=out.data_ptr(),
                    left=left,
                    right=right,
                    scale=softmax_scale,
                    causal=causal,
                    cu_q=cu_q,
                    cu_k=cu_k,
                )
            )
            assert (sink is not None) == extra_tensor and (cu_q is not None) == varlen
            assert not q.requires_grad and not out.requires_grad
            if varlen:
                out.copy_(varlen_math(q, k, v, cu_q, cu_k, softmax_scale, causal, (left, right)))
            else:
                out.copy_(dense_math(q, k, v, 0.0, softmax_scale, causal, (left, right)))
            if lse is not None:
                lse.fill_(float(q.sum()))  # a value of this call's inputs

        return compiled

    def _flash_attn_fwd(
        q,
        k,
        v,
        softmax_scale=None,
        causal=False,
        window_size_left=None,
        window_size_right=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
    ):
        grad = any(t.requires_grad for t in (q, k, v))
        if interface.copy_query:
            q = q.contiguous().clone()
        if interface.copy_offsets and cu_seqlens_q is not None:
            cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.clone(), cu_seqlens_k.clone()
        extra, varlen = interface.extra_tensor, cu_seqlens_q is not None
        key = (
            q.dtype,
            q.shape[-1],
            causal,
            window_size_left is not None,
            window_size_right is not None,
            extra,
            varlen,
            max_seqlen_q,
            max_seqlen_k,
        )
        if key not in _flash_attn_fwd.compile_cache:
            _flash_attn_fwd.compile_cache[key] = compiled_for(causal, extra, varlen)
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32) if grad else None
        _flash_attn_fwd.compile_cache[key](
            q.detach(),
            k.detach(),
            v.detach(),
            out.detach(),
            lse,
            softmax_scale,
            cu_seqlens_q,
            cu_seqlens_k,
            None,
            None,
            None,
            window_size_left,
            window_size_right,
            torch.zeros(1) if extra else None,
            None,
            AuxData(),
        )
        return out, lse

    def _flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=None,
        causal=False,
        softcap=0.0,
        window_size_left=None,
        window_size_right=None,
        deterministic=False,
        dlse=None,
        learnable_sink=None,
    ):
        assert learnable_sink is None, "the fake's backward takes no learnable_sink"
        assert dlse is None or interface.backward_from_lse, "dlse: only the backward from the given lse takes it"
        interface.backwards.append(
            dict(
                q_ptr=q.data_ptr(),
                out_ptr=out.data_ptr(),
                lse_ptr=lse.data_ptr(),
                softcap=softcap,
                deterministic=deterministic,
            )
        )
        if interface.marked_lse:  # False: the LSE came from the public function (return_lse=True)
            assert torch.all(lse == float(q.detach().sum())), "the LSE is not this call's"
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        if interface.backward_from_lse:  # flash-attn 4's backward from out and lse as given
            window = _fa_window((window_size_left, window_size_right), True)
            return _backward_from_output(q, k, v, out, dout, lse, dlse, softmax_scale, causal, window, softcap)
        # torch.func.vjp, not autograd: a custom op's implementation (fa4_compiled) runs below
        # the autograd dispatch key, where a tape would record nothing
        window = (window_size_left, window_size_right)
        _, vjp = torch.func.vjp(lambda q, k, v: dense_math(q, k, v, 0.0, softmax_scale, causal, window), q, k, v)
        return vjp(dout.to(q.dtype))

    _flash_attn_fwd.compile_cache = {}
    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    interface._LEARNABLE_SINK_DTYPES = _SINK_DTYPES
    return interface


# ---------------------------------------------------------------- xformers -------
class _Bias:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __repr__(self):
        return f"{type(self).__name__}({self.__dict__})"


class LowerTriangularMask(_Bias):
    causal, window = "top_left", None


class LowerTriangularFromBottomRightMask(_Bias):
    causal, window = "bottom_right", None


class LocalAttentionFromBottomRightMask(_Bias):
    causal = None

    @property
    def window(self):
        return (self.window_left, self.window_right)


class BlockDiagonalMask(_Bias):
    causal = None

    @property
    def window(self):
        return None

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, **kw):
        return cls(q_seqlen=list(q_seqlen), kv_seqlen=list(kv_seqlen if kv_seqlen is not None else q_seqlen), **kw)


class BlockDiagonalCausalMask(BlockDiagonalMask):
    causal = "top_left"  # xformers: causal from the top-left of each block


class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalMask):
    causal = "top_left"

    @property
    def window(self):  # key j allowed when i - window_size < j <= i
        return (self.window_size - 1, 0)


class _NanGradient(torch.autograd.Function):
    """Identity whose gradient is NaN where ``rows`` is set (a kernel's unspecified gradient)."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.masked_fill(rows, math.nan), None


def make_xformers(
    calls: list, refuse_head_dim_over: int = 128, no_operator: bool = False
) -> dict[str, types.ModuleType]:
    """A fake xformers whose dispatcher refuses, as 0.0.35's does, head dims over
    ``refuse_head_dim_over``, a two-sided local mask in float32 (cutlass's only dtype there) and, with
    ``no_operator`` (C++/CUDA extensions that did not load), every call; its kernel gives NaN for rows
    a mask type leaves without a key (unspecified in xformers)."""
    xf = types.ModuleType("xformers")
    xf.__version__ = "0.0.35"
    xf.__path__ = []
    ops = types.ModuleType("xformers.ops")
    ops.__path__ = []
    fmha = types.ModuleType("xformers.ops.fmha")
    fmha.__path__ = []
    ab = types.ModuleType("xformers.ops.fmha.attn_bias")
    dispatch = types.ModuleType("xformers.ops.fmha.dispatch")
    for cls in (
        LowerTriangularMask,
        LowerTriangularFromBottomRightMask,
        LocalAttentionFromBottomRightMask,
        BlockDiagonalMask,
        BlockDiagonalCausalMask,
        BlockDiagonalCausalLocalAttentionMask,
    ):
        setattr(ab, cls.__name__, cls)

    class Inputs:
        def __init__(self, query, key, value, attn_bias=None, p=0.0, scale=None, **kw):
            self.query, self.key, self.value, self.attn_bias, self.p, self.scale = (
                query,
                key,
                value,
                attn_bias,
                p,
                scale,
            )

    class _ForwardOp:
        VARLEN_LSE_PACKED = True

    def _dispatch_fw(inp, needs_gradient):
        reasons = []
        if max(inp.query.shape[-1], inp.value.shape[-1]) > refuse_head_dim_over:
            reasons.append(f"max(query.shape[-1], value.shape[-1]) > {refuse_head_dim_over}")
        if inp.query.dtype == torch.float32 and type(inp.attn_bias) is LocalAttentionFromBottomRightMask:
            reasons.append(f"attn_bias type is {type(inp.attn_bias)}")
        if no_operator:
            reasons.append("xFormers wasn't build with CUDA support")
        if reasons:
            raise NotImplementedError(
                "No operator found for `memory_efficient_attention_forward` with inputs:\n"
                f"     query       : shape={tuple(inp.query.shape)}\n"
                "`cutlassF-pt` is not supported because:\n"
                + "".join(f"    {r}\n" for r in reasons)
                + "`fa2F@2.8.3` is not supported because:\n    xFormers wasn't build with CUDA support\n"
            )
        return _ForwardOp

    def _dispatch_bw(inp, varlen_lse_packed):  # xformers >= 0.0.28's signature
        return "cutlassB-pt"

    dispatch._dispatch_fw, dispatch._dispatch_bw = _dispatch_fw, _dispatch_bw

    def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, **kw):
        for name, t in (("query", query), ("key", key), ("value", value)):  # as 0.0.35's operators check
            if t.stride(-1) > 1 or t.stride(-2) % 8:
                raise NotImplementedError(f"No operator found: {name}.stride() = {t.stride()}")
        calls.append(dict(q=query, k=key, v=value, attn_bias=attn_bias, p=p, scale=scale, q_ptr=query.data_ptr()))
        five = query.dim() == 5
        if five:  # BMGHK: key/value arrive expanded over the group dimension
            query, key, value = (t.flatten(2, 3) for t in (query, key, value))
        q, k, v = (t.transpose(1, 2).double() for t in (query, key, value))  # BMHK -> BHSD
        if isinstance(attn_bias, BlockDiagonalMask):
            cu_q = torch.tensor([0] + attn_bias.q_seqlen).cumsum(0).to(torch.int32)
            cu_k = torch.tensor([0] + attn_bias.kv_seqlen).cumsum(0).to(torch.int32)
            with torch.no_grad():  # rows without a key: xformers' gradient for them is unspecified (NaN here)
                _, lse = naive_attention(
                    *(t[0].transpose(0, 1) for t in (q, k, v)),
                    causal=attn_bias.causal,
                    window=attn_bias.window,
                    cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k,
                    return_lse=True,
                )
            q = _NanGradient.apply(q, (lse == -math.inf).t()[None, :, :, None])
            out = naive_attention(
                q[0].transpose(0, 1),
                k[0].transpose(0, 1),
                v[0].transpose(0, 1),
                causal=attn_bias.causal,
                window=attn_bias.window,
                scale=scale,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
            )
            out = out.transpose(0, 1).unsqueeze(0)
        elif isinstance(attn_bias, torch.Tensor):
            bias = attn_bias.flatten(1, 2) if five else attn_bias
            assert bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), bias.shape
            out = naive_attention(q, k, v, mask=bias.double(), scale=scale)
        elif attn_bias is None:
            out = naive_attention(q, k, v, scale=scale)
        else:
            window = attn_bias.window
            if window is not None and query.dtype in (torch.float16, torch.bfloat16):  # its flash-attn 2 operator
                window = _fa_window(window, False, k.shape[2])
            out, lse = naive_attention(q, k, v, causal=attn_bias.causal, window=window, scale=scale, return_lse=True)
            out = out.masked_fill(lse.unsqueeze(-1) == -math.inf, math.nan)  # unspecified rows
        out = out.transpose(1, 2).to(query.dtype)
        if five:  # back to BMGHK
            g, hg = calls[-1]["k"].shape[2], calls[-1]["k"].shape[3]
            out = out.unflatten(2, (g, hg))
        return out

    fmha.Inputs, fmha.dispatch, fmha.attn_bias = Inputs, dispatch, ab
    fmha.memory_efficient_attention = memory_efficient_attention
    ops.memory_efficient_attention, ops.fmha = memory_efficient_attention, fmha
    xf.ops = ops
    return {
        "xformers": xf,
        "xformers.ops": ops,
        "xformers.ops.fmha": fmha,
        "xformers.ops.fmha.attn_bias": ab,
        "xformers.ops.fmha.dispatch": dispatch,
    }
