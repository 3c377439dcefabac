"""Launching the tl backward's three passes: delta = rowsum(dO * O); dK/dV (+ d(bias)), optionally
split over the query heads of a GQA group (and, past head dim 256 in 16-bit, into a dV and a dK pass);
dQ, optionally split over keys; each chunked past the grid's y/z limit.  Arguments are shapes,
strides and python ints: no host synchronisation.  The forward and what both share: launch.py."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import configs as C
from .. import run
from ..bias import bias_constexprs
from ..device import device_info, is_interpreter
from ..params import KernelParams
from ..shapes import KernelShapes, as_dtype, bh_chunks, cdiv, common_constexprs, grid_limit, store_dtype
from .backward import _attn_bwd_dkdv, _attn_bwd_dq
from .backward_delta import _attn_bwd_preprocess
from .common import LOG2E
from .launch import exact_p, score_args, score_constexprs

# Upper bound on the number of key splits of the dQ pass.
MAX_SPLITS = 16


def num_splits_heuristic(
    batch_heads: int,
    num_m_blocks: int,
    num_n_blocks: int,
    num_sms: int,
    deterministic: bool,
    max_splits: int = MAX_SPLITS,
) -> int:
    """How many ways to split the key range of the dQ pass (fp32 workspace + atomics).

    1 when deterministic; else split only when batch*heads*query-tiles fills less than two
    waves of the SMs, keeping at least two key tiles per split."""
    if deterministic or num_n_blocks <= 1:
        return 1
    ctas = max(1, batch_heads * num_m_blocks)
    target = 2 * max(1, num_sms)
    if ctas >= target:
        return 1
    s = min(cdiv(target, ctas), num_n_blocks // 2, max_splits)
    return max(1, s)


def group_splits_heuristic(
    batch_kv_heads: int, num_n_blocks: int, group: int, num_sms: int, deterministic: bool = False
) -> int:
    """How many ways to split the query heads of a GQA/MQA group in the dK/dV pass (each
    split writes an fp32 partial dK/dV, summed in a fixed order).  1 when deterministic or
    when batch*kv_heads*key-tiles already fills two waves of the SMs."""
    if deterministic or group <= 1:
        return 1
    ctas = max(1, batch_kv_heads * num_n_blocks)
    target = 2 * max(1, num_sms)
    if ctas >= target:
        return 1
    return max(1, min(group, cdiv(target, ctas)))


class BackwardArgs(NamedTuple):
    """What the tl backward passes share: tensors standing in for absent ones (the dummies are
    q), their constexprs and config traits, the grid limit, SM count and two stride triples."""

    bias_t: torch.Tensor
    bias_strides: tuple
    seed_t: torch.Tensor
    cu_q_t: torch.Tensor
    cu_k_t: torch.Tensor
    common: dict
    traits: dict
    limit: int
    num_sms: int
    lse_strides: tuple
    do_strides: tuple
    score: tuple  # score_args(): softcap_in, softcap_out, slope strides
    alibi_t: torch.Tensor  # the ALiBi slopes or a stand-in (a leading pointer of the dK/dV and dQ kernels)


def backward_args(
    do,
    q,
    bias_kind: int,
    bias_t,
    bias_strides,
    seed,
    params: KernelParams,
    prob: KernelShapes,
    uses_descriptors: bool,
    cu_q,
    cu_k,
    alibi=None,
    lse_pair: bool = False,
) -> BackwardArgs:
    """The :class:`BackwardArgs` of a call (``bias_kind, bias_t, bias_strides``: :func:`bias.bias_layout`;
    ``lse_pair``: the dK/dV and dQ passes read the forward's (hi, lo) pairs as their lse)."""
    dummy = q
    return BackwardArgs(
        bias_t if bias_t is not None else dummy,
        bias_strides,
        seed if seed is not None and seed.numel() else dummy,
        cu_q if cu_q is not None else dummy,
        cu_k if cu_k is not None else dummy,
        dict(
            common_constexprs(q, params, prob),
            **bias_constexprs(bias_kind, bias_t, bias_strides, prob, uses_descriptors),
            USE_DESC=uses_descriptors,
            HAS_DROPOUT=params.dropout_p > 0,
            **score_constexprs(params, alibi, q.dtype),
            LSE_PAIR=lse_pair,
            EXACT_P=exact_p(q.dtype),
            DP_IN_BRANCH=C.wide_backward(C.block_d(prob.Dqk), C.block_d(prob.Dv), q.dtype),
        ),
        run.table_traits(bias_kind, params, prob),
        grid_limit(params),
        device_info(q.device)[2],
        prob.lse_strides(),
        prob.out_strides(do),
        score_args(params, alibi),
        alibi if alibi is not None else dummy,
    )


def delta_pass(
    do,
    out,
    delta: torch.Tensor,
    prob: KernelShapes,
    a: BackwardArgs,
    lse=None,
    sinks=None,
    grad_lse=None,
    lse_total=None,
    dsink_rows=None,
    do_scaled=None,
) -> None:
    """delta = rowsum(dO * O) into ``delta`` (fp32, lse's shape): every backward's first pass.
    With ``sinks`` (Hq,) it writes ``lse_total`` = logaddexp(lse, sink) and, given
    ``dsink_rows``, each row's share of d(sink); with ``grad_lse`` (lse's layout) delta takes the
    logsumexp's gradient; with both, ``do_scaled`` (dO's shape, contiguous) the dO the later passes
    read (tl/backward_delta.py's _attn_bwd_preprocess: rows the sink outweighs); all of lse's layout."""
    if (sinks is not None and grad_lse is not None) != (do_scaled is not None):
        raise ValueError("do_scaled: given exactly when both sinks and grad_lse are")
    bm_pre = 16 if is_interpreter() else 64
    o_str = prob.out_strides(out)
    dummy = delta
    tensors = (
        lse if lse is not None else dummy,
        sinks if sinks is not None else dummy,
        grad_lse if grad_lse is not None else dummy,
        lse_total if lse_total is not None else dummy,
        dsink_rows if dsink_rows is not None else dummy,
        do if do_scaled is None else do_scaled,  # written only with both sinks and grad_lse
    )
    ds_str = prob.out_strides(tensors[-1])
    for start, cnt in bh_chunks(prob.B * prob.Hq, prob.Hq, a.limit):
        run.launch_one(
            _attn_bwd_preprocess,
            (cdiv(prob.Sq, bm_pre), cnt),
            (out, do, delta, a.cu_q_t, *tensors, *o_str, *prob.out_strides(do), *ds_str, *a.lse_strides)
            + (prob.Hq, prob.Sq, start),
            dict(
                HEAD_DV=prob.Dv,
                IS_VARLEN=prob.varlen,
                HAS_SINKS=sinks is not None,
                SINK_GRAD=dsink_rows is not None,
                HAS_DLSE=grad_lse is not None,
                BLOCK_M=bm_pre,
                BLOCK_DV=a.common["BLOCK_DV"],
            ),
            4,
            3,
        )


def dkdv_pass(
    do,
    q,
    k,
    v,
    lse,
    delta,
    bias,
    bias_grad: bool,
    bcast,
    params: KernelParams,
    prob: KernelShapes,
    a: BackwardArgs,
    dk_out=None,
    dv_out=None,
):
    """(dK, dV, d(bias) or None): key-tile parallel, each program looping over the query heads of
    its GQA group (split over grid axis 2 into fp32 partials summed in a fixed order when the
    grid is small).  ``bcast``: which of the bias's dims broadcast (:func:`bias.bias_layout`).
    ``dk_out``/``dv_out`` (any strides, last dim contiguous): written there without group splits
    (k/v themselves included: a program stores its dK/dV tile after its only read of that tile).
    Where configs.SPLIT_KINDS have entries for a wide_backward call: dV, then dK, in two launches."""
    dev = q.device
    dummy = q
    bias_t, bstr, seed_t, cu_q_t, cu_k_t, common, traits, limit, num_sms, lse_str, do_str, _, _ = a
    sum_rows = sum_heads = False
    if bias_grad:
        sum_rows = bcast[2] and prob.Sq > 1
        sum_heads = bcast[1] and prob.group > 1
        ws_shape = (prob.B, prob.Hkv if sum_heads else prob.Hq, 1 if sum_rows else prob.Sq, prob.Sk)
        db_ws = torch.zeros(ws_shape, device=dev, dtype=torch.float32)
        db_str = db_ws.stride()
    else:
        db_ws = dummy
        db_str = (0, 0, 0, 0)
    parts = {C.BWD_DKDV: dict(DO_DK=True, DO_DV=True)}  # every constexpr passed: relaunchable (compiled_cache)
    if common["DP_IN_BRANCH"] and all(
        run.table_candidates(kind, prob.Dqk, prob.Dv, q.dtype, dev, params, **traits) for kind in C.SPLIT_KINDS
    ):
        parts = {  # d(bias) is dS's: the dK pass's
            C.BWD_DV: dict(DO_DK=False, DO_DV=True, BIAS_GRAD=False),
            C.BWD_DK: dict(DO_DK=True, DO_DV=False),
        }
        dv_out = None  # the dK pass reads V after the dV pass: not into v itself (the caller copies)
    cands = {kind: run.select_config(kind, prob.Dqk, prob.Dv, q.dtype, dev, params, **traits) for kind in parts}
    # group split (GQA/MQA): query heads of a kv head spread over grid axis 2, partial
    # dK/dV in an fp32 workspace summed in a fixed order (never with a head-summed d(bias)).
    if params.deterministic or prob.group == 1 or (bias_grad and sum_heads):
        gsplits = 1
    elif params.num_splits > 0:
        gsplits = min(params.num_splits, prob.group)
    else:
        n_tiles = cdiv(prob.Sk, cands[list(parts)[-1]][0].block_n)
        gsplits = group_splits_heuristic(prob.B * prob.Hkv, n_tiles, prob.group, num_sms)
    per_split = cdiv(prob.group, gsplits)
    gsplits = cdiv(prob.group, per_split)
    if gsplits > 1:
        dk_out = torch.empty((gsplits,) + tuple(k.shape), device=dev, dtype=torch.float32)
        dv_out = torch.empty((gsplits,) + tuple(v.shape), device=dev, dtype=torch.float32)
        dk0, dv0 = dk_out[0], dv_out[0]
        split_str = (dk_out.stride(0), dv_out.stride(0))
    else:
        dk_out = dk0 = _out_or_new(dk_out, k)
        dv_out = dv0 = _out_or_new(dv_out, v)
        split_str = (0, 0)
    if prob.varlen:
        dk_str = (0, dk0.stride(1), dk0.stride(0))
        dv_str = (0, dv0.stride(1), dv0.stride(0))
    else:
        dk_str = (dk0.stride(0), dk0.stride(1), dk0.stride(2))
        dv_str = (dv0.stride(0), dv0.stride(1), dv0.stride(2))
    args = (
        q,
        k,
        v,
        bias_t,
        do,
        lse,
        delta,
        seed_t,
        cu_q_t,
        cu_k_t,
        dk_out,
        dv_out,
        db_ws,
        a.alibi_t,
        params.scale * LOG2E,
        params.scale,
        float(params.dropout_p),
        *a.score,
        *prob.q_strides,
        *prob.k_strides,
        *prob.v_strides,
        *bstr,
        *do_str,
        *lse_str,
        *dk_str,
        *dv_str,
        *db_str,
        prob.Hq,
        prob.B,
        prob.group,
        prob.Hkv,
        prob.Sq,
        prob.Sk,
    )
    for kind, outputs in parts.items():
        kw = dict(common, BIAS_GRAD=bias_grad, DB_SUM_ROWS=sum_rows, DB_SUM_HEADS=sum_heads)
        kw.update(outputs)
        key = (kind, dev, q.dtype, prob.Dqk, prob.Dv, common["USE_DESC"])
        kind_cands = cands[kind]
        for start, cnt in bh_chunks(prob.B * prob.Hkv, prob.Hkv, limit):

            def grid(cfg, cnt=cnt):
                return (cdiv(prob.Sk, cfg.block_n), cnt, gsplits)

            cfg = run.launch_first_fitting(
                kind,
                _attn_bwd_dkdv,
                grid,
                args + (start, params.window_left, params.window_right, per_split, *split_str),
                kw,
                kind_cands,
                key,
            )
            kind_cands = [cfg]
    if gsplits > 1:
        dk, dv = dk_out.sum(0).to(k.dtype), dv_out.sum(0).to(v.dtype)
    else:
        dk, dv = as_dtype(dk_out, k.dtype), as_dtype(dv_out, v.dtype)

    dbias = reduce_dbias(db_ws, bcast, bias) if bias_grad else None
    return dk, dv, dbias


def _out_or_new(out, t):
    """``out`` where the kernel stores in its dtype, else a new tensor of t's shape."""
    dtype = store_dtype(t.dtype)
    return out if out is not None and out.dtype == dtype else torch.empty(t.shape, device=t.device, dtype=dtype)


def reduce_dbias(ws: torch.Tensor, bcast, bias: torch.Tensor) -> torch.Tensor:
    shape4 = [1 if bcast[d] else ws.shape[d] for d in range(4)]
    dims = [d for d in range(4) if bcast[d] and ws.shape[d] != 1]
    if dims:
        ws = ws.sum(dim=dims, keepdim=True)
    return ws.reshape(shape4).reshape(bias.shape).to(bias.dtype)


def dq_pass(
    do, q, k, v, lse, delta, params: KernelParams, prob: KernelShapes, a: BackwardArgs, accumulator=None, out=None
) -> torch.Tensor | None:
    """dQ: query-tile parallel, optionally split over keys (fp32 workspace + atomics).
    ``accumulator`` (float32, q's shape, dense): dQ is atomically added into it instead (None returned).
    ``out`` (q's shape and dtype): dQ written there (directly where no workspace is needed)."""
    dev = q.device
    bias_t, bstr, seed_t, cu_q_t, cu_k_t, common, traits, limit, num_sms, lse_str, do_str, _, _ = a
    cands = run.select_config(C.BWD_DQ, prob.Dqk, prob.Dv, q.dtype, dev, params, **traits)
    bm, bn = cands[0].block_m, cands[0].block_n
    if params.deterministic:
        splits = 1
    elif params.num_splits > 0:
        splits = min(params.num_splits, max(1, cdiv(prob.Sk, bn)))
    else:
        splits = num_splits_heuristic(
            prob.B * prob.Hq, cdiv(prob.Sq, bm), cdiv(prob.Sk, bn), num_sms, params.deterministic
        )
    atomic = splits > 1 or accumulator is not None
    if accumulator is not None:
        dq_ws = accumulator
    elif atomic:
        dq_ws = torch.zeros(q.shape, device=dev, dtype=torch.float32)
    elif out is not None and out.dtype == store_dtype(q.dtype):
        dq_ws = out
    else:
        dq_ws = torch.empty(q.shape, device=dev, dtype=store_dtype(q.dtype))
    dq_str = (
        (0, dq_ws.stride(1), dq_ws.stride(0)) if prob.varlen else (dq_ws.stride(0), dq_ws.stride(1), dq_ws.stride(2))
    )
    args = (
        q,
        k,
        v,
        bias_t,
        do,
        lse,
        delta,
        seed_t,
        cu_q_t,
        cu_k_t,
        dq_ws,
        a.alibi_t,
        params.scale * LOG2E,
        params.scale,
        float(params.dropout_p),
        *a.score,
        *prob.q_strides,
        *prob.k_strides,
        *prob.v_strides,
        *bstr,
        *do_str,
        *lse_str,
        *dq_str,
        prob.Hq,
        prob.B,
        prob.group,
        prob.Sq,
        prob.Sk,
    )
    kw = dict(common, ATOMIC=atomic)
    key = ("dq", dev, q.dtype, prob.Dqk, prob.Dv, common["USE_DESC"])
    for start, cnt in bh_chunks(prob.B * prob.Hq, prob.Hq, limit):

        def grid(cfg, cnt=cnt):
            return (cdiv(prob.Sq, cfg.block_m), cnt, splits)

        cfg = run.launch_first_fitting(
            C.BWD_DQ,
            _attn_bwd_dq,
            grid,
            args + (start, params.window_left, params.window_right, splits),
            kw,
            cands,
            key,
        )
        cands = [cfg]
    if accumulator is not None:
        return None
    dq = as_dtype(dq_ws, q.dtype)
    return dq if out is None or dq is out else out.copy_(dq)
