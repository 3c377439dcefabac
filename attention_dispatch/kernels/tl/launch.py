"""Launching the tl forward (with host-built K/V descriptors on long calls), chunked past the
grid's y/z limit, and what the backward's launches (launch_backward.py) share with it: the score
transforms' arguments, the logsumexp's strides and form, EXACT_P.  Arguments are shapes, strides
and python ints: no host synchronisation."""

from __future__ import annotations


import torch

from .. import configs as C
from .. import run
from ..bias import bias_constexprs
from ..compiled_cache import TensorDescriptor
from ..device import is_interpreter
from ..params import KernelParams
from ..shapes import (
    KernelShapes,
    as_dtype,
    bh_chunks,
    cdiv,
    common_constexprs,
    grid_limit,
    row_matrix,
    rows_layout,
)
from .common import LOG2E
from .forward import _attn_fwd

# Host-built descriptors cost ~20-30 us of host time per call (Triton's launcher encodes each
# tensormap): only for calls of at least this many products B * Hq * Sq * Sk * D (~40 us, E30).
HOST_KV_MIN_WORK = 1 << 32


def host_kv_descriptors(k, v, prob: KernelShapes, uses_descriptors: bool, block_dqk: int, block_dv: int):
    """For dense K/V read through descriptors, with D equal to its block, laid out as
    (B, Hkv, Sk, D) or (B, Sk, Hkv, D) in memory, in a call of at least HOST_KV_MIN_WORK:
    ``descriptors(cfg)`` -> (K descriptor, V descriptor, KV_HOST) built here over the rows of
    K/V as a matrix ((B * Hkv * Sk, D), KV_HOST=1, or (B * Sk, Hkv * D), KV_HOST=2), or None
    when the configuration keeps in-kernel ones or Sk is not a multiple of its key tile (a
    tile would reach into the next head or sequence).  None when K/V are not read that way.
    A host descriptor saves each program the tensormap write and fence of an in-kernel one
    (E30)."""
    if (
        not uses_descriptors
        or TensorDescriptor is None
        or prob.varlen
        or prob.Dqk != block_dqk
        or prob.Dv != block_dv
        or prob.B * prob.Hkv * prob.Sk >= 2**31
        or prob.B * prob.Hq * prob.Sq * prob.Sk * max(prob.Dqk, prob.Dv) < HOST_KV_MIN_WORK
    ):
        return None
    layout = rows_layout(k, v)
    if layout == 0:
        return None
    (k_rows, k_len), (v_rows, v_len) = row_matrix(k, layout), row_matrix(v, layout)

    def descriptors(cfg):
        block_n = cfg.block_n
        if not cfg.host_kv or prob.Sk % block_n:
            return None
        # the base is k / v itself (Triton reads only its address and dtype): a relaunch
        # recognises it (ForwardPlan)
        return (
            TensorDescriptor(k, [k_rows, k_len], [k_len, 1], [block_n, prob.Dqk]),
            TensorDescriptor(v, [v_rows, v_len], [v_len, 1], [block_n, prob.Dv]),
            layout,
        )

    return descriptors


def forward(
    q,
    k,
    v,
    out,
    lse,
    seed,
    bias_kind: int,
    bias_t,
    bias_strides,
    params: KernelParams,
    prob: KernelShapes,
    uses_descriptors: bool,
    cu_q=None,
    cu_k=None,
    alibi=None,
    sinks=None,
    lse_pair=None,
) -> torch.Tensor:
    """The tl forward into ``out`` (and ``lse`` unless None); returns out in q's dtype.
    ``lse_pair`` (float32 (*lse_shape, 2), float32 inputs): the kernel writes the log2 logsumexp
    there as hi + lo for the backward (issue 38) and lse = hi * ln 2 is taken from it.
    ``bias_kind, bias_t, bias_strides``: :func:`bias.bias_layout` of the call's bias; ``seed``:
    the dropout seed (empty without dropout); ``alibi`` (B, Hq) fp32 slopes, ``sinks`` (Hq,)
    contiguous, or None."""
    kind, bt, bstr, desc, need_lse, dev = bias_kind, bias_t, bias_strides, uses_descriptors, lse is not None, q.device
    cands = run.select_config(C.FWD, prob.Dqk, prob.Dv, q.dtype, dev, params, **run.table_traits(kind, params, prob))
    # A row whose first key block may be entirely masked needs the -inf-safe running max.
    may_empty = (
        kind != 0
        or params.window_left >= 0
        or (
            params.window_right >= 0
            and params.align_bottom_right
            and (prob.varlen or prob.Sk - prob.Sq + params.window_right < 0)
        )
    )
    dummy = q
    args = (
        q,
        k,
        v,
        bt if bt is not None else dummy,
        out,
        lse_pair if lse_pair is not None else lse if need_lse else out,
        seed if seed.numel() else dummy,
        cu_q if cu_q is not None else dummy,
        cu_k if cu_k is not None else dummy,
        alibi if alibi is not None else dummy,
        sinks if sinks is not None else dummy,
        params.scale * LOG2E,
        float(params.dropout_p),
        *score_args(params, alibi),
        *prob.q_strides,
        *prob.k_strides,
        *prob.v_strides,
        *bstr,
        *prob.out_strides(out),
        *(lse_strides(prob, lse_pair is not None) if need_lse else (0, 0, 0)),
        prob.Hq,
        prob.B,
        prob.group,
        prob.Sq,
        prob.Sk,
    )
    kw = dict(
        common_constexprs(q, params, prob),
        **bias_constexprs(kind, bt, bstr, prob, desc),
        HAS_DROPOUT=params.dropout_p > 0,
        USE_DESC=desc,
        MAY_EMPTY=may_empty,
        SCALE_POS=params.scale > 0,
        STORE_LSE=need_lse,
        HAS_SINKS=sinks is not None,
        **score_constexprs(params, alibi, q.dtype),
        LSE_PAIR=lse_pair is not None,
        EXACT_P=exact_p(q.dtype),
    )
    n_bh = prob.B * prob.Hq
    key = ("fwd", dev, q.dtype, prob.Dqk, prob.Dv, desc)
    kv_descriptors = host_kv_descriptors(k, v, prob, desc, kw["BLOCK_DQK"], kw["BLOCK_DV"])

    def fwd_tail(cfg):
        kv = kv_descriptors(cfg) if kv_descriptors is not None else None
        return (kv[:2] if kv else (0, 0)), {"SUBTILES": cfg.subtiles, "KV_HOST": kv[2] if kv else 0}

    for start, cnt in bh_chunks(n_bh, prob.Hq, grid_limit(params)):

        def grid(cfg, cnt=cnt):
            return (cdiv(prob.Sq, cfg.block_m), cnt)

        cfg = run.launch_first_fitting(
            C.FWD, _attn_fwd, grid, args + (start, params.window_left, params.window_right), kw, cands, key, fwd_tail
        )
        cands = [cfg]
    if lse_pair is not None:
        natural_lse(lse_pair, lse)
    return as_dtype(out, q.dtype)


def exact_p(dtype: torch.dtype) -> int:
    """EXACT_P of the forward, dK/dV and dQ kernels (tl/common.py): float32 inputs recompute the
    forward's probabilities exactly in the backward (issue 38); 2 under the interpreter (its tl.dot
    sums in an order of its own)."""
    if dtype != torch.float32:
        return 0
    return 2 if is_interpreter() else 1


def natural_lse(pair: torch.Tensor, lse: torch.Tensor) -> None:
    """lse = hi * ln 2 from the forward's log2 (hi, lo) pairs (what the kernel writes without them)."""
    torch.mul(pair[..., 0], 0.6931471805599453, out=lse)


def lse_strides(prob: KernelShapes, pair: bool) -> tuple:
    """lse's (batch, head, row) strides, or those of the (*lse_shape, 2) pairs."""
    return tuple(2 * x for x in prob.lse_strides()) if pair else prob.lse_strides()


def score_args(params: KernelParams, alibi) -> tuple:
    """The score transforms' scalar arguments of every tl attention kernel (tl/score.py):
    (softcap_in, softcap_out, slope strides (batch, head)); the slopes themselves (or a stand-in)
    go with the leading pointers, so that the compiled-kernel cache can relaunch the kernel."""
    cap = params.softcap
    strides = (alibi.stride(0), alibi.stride(1)) if alibi is not None else (0, 0)
    return (params.scale / cap if cap else 0.0, cap * LOG2E, *strides)


# Input dtypes whose softcap takes the GPU's tanh.approx.f32 (one MUFU op, relative error 2^-11,
# below the 16-bit inputs' rounding; FlashAttention's softcap uses it) instead of the exact
# exp2-and-division tanh (tl/score.py), as the Gluon kernels always do: a Gluon forward and a tl
# backward then see the same scores.  Never under the interpreter, which has no inline asm.
TANH_APPROX_DTYPES: tuple = (torch.float16, torch.bfloat16)


def score_constexprs(params: KernelParams, alibi, dtype: torch.dtype) -> dict:
    """SOFTCAP (0 off, 1 exact tanh, 2 tanh.approx) and HAS_ALIBI of every tl attention kernel."""
    softcap = 0
    if params.softcap > 0:
        softcap = 2 if dtype in TANH_APPROX_DTYPES and not is_interpreter() else 1
    return dict(SOFTCAP=softcap, HAS_ALIBI=alibi is not None)
