"""Which calls the Gluon kernels serve, each answer a reason: the forward (ws_forward_reason,
forward_scope_reason), the dK/dV and dQ passes (ws_backward_reason) and dQ fused into dK/dV
(fuse_dq_reason).  Importable without Gluon; kernels/entry.py acts on these answers and
the triton backend's route() reports them."""

from __future__ import annotations

import math

import torch
import triton

from .. import configs as C
from ..device import device_info, tma_compatible
from ..limits import MAX_GRID_YZ
from ..params import KernelParams
from ..shapes import KernelShapes, grid_limit, row_matrix, rows_layout
from .launch import GLUON_IMPORT_ERROR, WG_ROWS

# The Gluon kernels run calls of at least this many query-key-dim products B * Hq * Sq * Sk * D,
# as the tl forward's host-built descriptors (tl/launch.HOST_KV_MIN_WORK): each pass builds four
# or more descriptors on the host, ~20-30 us (E30).
WS_MIN_WORK = 1 << 32


# The Gluon kernels are written for, compiled and verified with Triton 3.6's Gluon API (the H100
# machine's Triton).  Gluon's API is unstable and changes between releases: Triton 3.9 removed
# tma.async_copy_global_to_shared (async_load replaces it), so the kernels do not compile there.
# Other versions keep the tl kernels until the Gluon ones are ported and verified on them.
GLUON_TRITON_VERSIONS = ("3.6.",)


def gluon_reason() -> str | None:
    """None when this Triton runs the Gluon kernels, else why not."""
    if GLUON_IMPORT_ERROR is not None:
        return f"this Triton has no Gluon ({GLUON_IMPORT_ERROR})"
    if not triton.__version__.startswith(GLUON_TRITON_VERSIONS):
        tested = ", ".join(v.rstrip(".") for v in GLUON_TRITON_VERSIONS)
        return (
            f"Triton {triton.__version__}: the Gluon kernels are written for Triton {tested}'s Gluon API, "
            "which changes between releases"
        )
    return None


# Narrower windows keep the tl kernels: (256, 256) ran 0.89x forward+backward on the Gluon kernels,
# (1024, 0) 1.20x (E53).
WS_MIN_WINDOW = 1024


def one_length(params: KernelParams, prob: KernelShapes) -> int | None:
    """The keys every sequence reads when the Gluon forward computes this call as a KV-cache call
    (kernels/entry.GLUON_LENGTHS: lengths 0 and this many new keys, the bottom-right causal mask,
    the keys past them in the last tile masked): Sk for causal aligned bottom-right with
    Sq < Sk, Sq for top-left (no row sees a key past Sq - 1); None for any other call."""
    causal = params.window_left < 0 and params.window_right == 0
    if not causal or prob.Sq >= prob.Sk:
        return None
    return prob.Sk if params.align_bottom_right else prob.Sq


def ws_forward_reason(
    prob: KernelShapes,
    bias_reason: str | None,
    params: KernelParams,
    dtype: torch.dtype,
    cc: tuple[int, int],
    uses_descriptors: bool,
    q_rows: int,
    kv_rows: int,
    lengths: bool = False,
) -> str | None:
    """None when the warp-specialised sm90 kernels (forward, dK/dV, dQ; the forward only where
    :func:`ws_forward_serves` says) compute this call, else why not (one line).
    ``bias_reason``: :func:`ws_bias_reason` of the call's bias; ``uses_descriptors``:
    :func:`use_descriptors` of q, k, v; ``q_rows`` / ``kv_rows``: :func:`rows_layout` of q and
    of (k, v); ``lengths``: the forward asks, which also computes causal calls with Sq < Sk
    (:func:`one_length`; the backward passes do not)."""
    banded = params.window_left >= 0 or params.window_right >= 0
    keys = one_length(params, prob) if lengths else None
    cfg = C.WS_FWD_CONFIGS.get(prob.Dqk)
    gluon = gluon_reason()
    if gluon is not None:
        return gluon
    if cc != (9, 0):
        return f"compute capability {cc[0]}.{cc[1]}: the warp-specialised forward is sm90 only"
    if not uses_descriptors:
        return "no TMA descriptors for this call (dtype, 16-byte alignment, interpreter or descriptors=0)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype}: float16 or bfloat16 only"
    if cfg is None or prob.Dv != prob.Dqk:
        return f"head dims {prob.Dqk}/{prob.Dv}: equal and one of {sorted(C.WS_FWD_CONFIGS)} only"
    if prob.varlen:
        return "varlen: dense calls only"
    if bias_reason is not None:
        return bias_reason
    if params.dropout_p > 0:
        return "dropout: not in the warp-specialised kernels"
    if banded and prob.Sq != prob.Sk and keys is None:
        if lengths:
            return "window, or causal with Sq > Sk: with Sq != Sk the Gluon forward takes causal with Sq < Sk only"
        return "window or causal with Sq != Sk: banded calls with Sq == Sk only"
    width = (
        math.inf if params.window_left < 0 or params.window_right < 0 else params.window_left + params.window_right + 1
    )
    if width < WS_MIN_WINDOW:
        return (
            f"window ({params.window_left}, {params.window_right}): narrower than {WS_MIN_WINDOW} keys, "
            "the tl kernels' smaller tiles waste less"
        )
    if params.scale <= 0:
        return f"scale {params.scale}: positive only (the running max is taken before scaling)"
    if params.block_m or params.block_n:
        return "tiles forced by the call's parameters"
    # a program's rows (forward, dQ) and keys (dK/dV), and the forward's key tile, cover whole heads
    rows, tile = 2 * WG_ROWS, math.lcm(2 * WG_ROWS, cfg.block_n)
    if keys is not None and prob.Sq % rows:  # the last key tile is masked past the length
        return f"Sq={prob.Sq}: a multiple of {rows} only (causal with Sq < Sk)"
    if keys is None and (prob.Sq % rows or prob.Sk % tile):
        return f"Sq={prob.Sq}, Sk={prob.Sk}: multiples of {rows} and {tile} only"
    if q_rows == 0 or kv_rows == 0:
        return "memory layout: query and key/value each (B, H, S, D) or (B, S, H, D) contiguous"
    if prob.B * prob.Hq > grid_limit(params) or max(prob.B * prob.Hq * prob.Sq, prob.B * prob.Hkv * prob.Sk) >= 2**31:
        return "grid or row count past the kernel's 32-bit limits"
    if prob.B * prob.Hq * prob.Sq * (keys or prob.Sk) * prob.Dqk < WS_MIN_WORK:
        return f"below WS_MIN_WORK ({WS_MIN_WORK} query-key-dim products): the host descriptors cost more"
    return None


# ALiBi's distances travel as float32 of MAGIC-biased ints (common._small_int_f32): exact below 2^22
ALIBI_MAX_SEQ = 1 << 21


def score_features_reason(
    params: KernelParams, has_alibi: bool, has_sinks: bool, part: str, longest: int = 0
) -> str | None:
    """Why the Gluon ``part`` ("forward", "backward", "cache forward" (the KV-cache one,
    kernels/decode.cache_forward) or "one-length forward" (:func:`one_length`'s calls)) cannot
    take a call's score transforms, or None (``longest``: the longer of Sq and Sk).  The forward
    and the backward compute the softcap and ALiBi (common._score_transform); the backward reads
    the sink only through the logsumexp and delta that the tl delta pass prepares, so sinks (and
    a logsumexp gradient) pass there.  The forward's key-length modes take none of them."""
    lengths = part in ("cache forward", "one-length forward")
    if params.softcap > 0 and lengths:
        return f"softcap: not in the Gluon {part}"
    if has_alibi and lengths:
        return f"alibi_slopes: not in the Gluon {part}"
    if has_alibi and longest >= ALIBI_MAX_SEQ:
        return f"alibi_slopes with {longest} keys or queries: the Gluon kernels' distances stay below {ALIBI_MAX_SEQ}"
    if has_sinks and lengths:
        return f"sinks: not in the Gluon {part}"
    return None


def ws_reason(
    q,
    k,
    v,
    bias_reason: str | None,
    params: KernelParams,
    prob: KernelShapes,
    uses_descriptors: bool,
    q_strided: bool = False,
    lengths: bool = False,
) -> tuple[str | None, tuple[int, int] | None]:
    """(None, (q rows layout, k/v rows layout)) when the Gluon kernels can compute this call
    (:func:`ws_forward_reason`, ``lengths`` as there), else (why not, None).  ``bias_reason``:
    :func:`ws_bias_reason` of the call's bias; ``uses_descriptors``: :func:`use_descriptors` of
    the call's tensors; ``q_strided``: q may be a slice of a longer tensor's rows (the backward
    passes take it)."""
    rows = (rows_layout(q, strided=q_strided), rows_layout(k, v)) if uses_descriptors else (0, 0)
    cc = device_info(q.device)[0]
    reason = ws_forward_reason(prob, bias_reason, params, q.dtype, cc, uses_descriptors, *rows, lengths=lengths)
    return reason, (None if reason else rows)


def forward_scope_reason(cfg: C.WsConfig, has_bias: bool, params: KernelParams) -> str | None:
    """Why the Gluon forward leaves a call it could compute to the tl forward (its head dim's
    config: ``forward`` off, or ``forward_scope`` "dense": no bias, not causal, no window), or None."""
    if not cfg.forward:
        return "this head dim's config keeps the tl forward (WsConfig.forward)"
    banded = params.window_left >= 0 or params.window_right >= 0
    if cfg.forward_scope != "all" and (has_bias or banded):
        return "this head dim's config runs the Gluon forward on dense calls only (no bias, causal or window)"
    return None


# The fused dQ against the separate dQ pass, whole d128 backward: 0.96x at 1k, 1.01x at 2k,
# 1.04-1.10x from 4k keys (E54).
FUSE_DQ_MIN_KEYS = 4096


def fuse_dq_reason(params: KernelParams, prob: KernelShapes, has_bias: bool, has_alibi: bool) -> str | None:
    """None when the Gluon dK/dV pass computes dQ too (FA3's way: fp32 partials added by TMA
    reduce-add), else why not: it runs where it was measured faster (no bias, Sk >=
    FUSE_DQ_MIN_KEYS, no band unless the head dim's config says so, or a causal call with a
    softcap and no ALiBi) and never when the call asks for determinism (its reduce-adds land in
    any order)."""
    cfg = C.WS_BWD_CONFIGS[prob.Dqk]
    banded = params.window_left >= 0 or params.window_right >= 0
    # a separate dQ pass recomputes tanh and exp2: twice the MUFU ops of the fused pass (E109)
    causal_softcap = params.softcap > 0 and not has_alibi and (params.window_left, params.window_right) == (-1, 0)
    if not cfg.fuse_dq:
        return "this head dim's config keeps a separate dQ pass (WsConfig.fuse_dq)"
    if banded and not cfg.fuse_dq_banded and not causal_softcap:
        return "causal or window: measured slower fused (0.96-0.97x, E54)"
    if params.deterministic:
        return "deterministic: the fused dQ's reduce-adds land in any order"
    if has_bias:
        return "bias: not measured fused"
    if prob.Sk < FUSE_DQ_MIN_KEYS:
        return f"Sk={prob.Sk} < {FUSE_DQ_MIN_KEYS}: measured slower fused (E54)"
    return None


def ws_backward_reason(
    do, q, k, v, bias_reason: str | None, params: KernelParams, prob: KernelShapes, uses_descriptors: bool
) -> tuple[str | None, tuple[int, int, int] | None]:
    """(None, (q rows layout, k/v rows layout, dO rows layout)) when the Gluon dK/dV pass serves
    this backward (the Gluon dQ pass too where configs.WS_DQ_CONFIGS has the head dim), else
    (why not, None).  ``bias_reason``: :func:`ws_bias_reason` of the call's bias and whether its
    gradient is needed; ``uses_descriptors``: :func:`use_descriptors` of q, k, v and dO."""
    # q and dO may be a block's rows of longer tensors (context parallelism): read where they lie
    reason, rows = ws_reason(q, k, v, bias_reason, params, prob, uses_descriptors, q_strided=True)
    if reason is not None:
        return reason, None
    if prob.Dqk not in C.WS_BWD_CONFIGS:
        return f"head dim {prob.Dqk}: the Gluon dK/dV pass has configs for {sorted(C.WS_BWD_CONFIGS)} only", None
    do_rows = rows_layout(do, strided=True)
    if not do_rows:
        return "memory layout: dO neither (B, H, S, D) nor (B, S, H, D) rows (or a slice of their S)", None
    if max(row_matrix(q, rows[0])[0], row_matrix(do, do_rows)[0]) >= 2**31:
        return "q's or dO's rows (a slice of longer tensors) past the kernel's 32-bit row index", None
    return None, (*rows, do_rows)


# A KV-cache call with at least this many new queries per sequence runs the Gluon forward over
# the cache's whole key tiles (kernels/decode.cache_forward): its rows fill the 128-row tiles,
# where the decode kernel's 64-row tiles, made for a few queries, leave the tensor cores idle.
CACHE_FORWARD_MIN_SQ = 2 * WG_ROWS


def cache_forward_reason(q, k_cache, v_cache, block_table, params: KernelParams) -> str | None:
    """None when the Gluon forward computes this sdpa_with_kvcache() call (the new keys already
    appended; q (B, Hq, Sq, D), a dense cache (B, Hkv, S, D)), else why not (one line)."""
    B, Hq, Sq, D = q.shape
    gluon = gluon_reason()
    if gluon is not None:
        return gluon
    if q.device.type != "cuda" or device_info(q.device)[0] != (9, 0):
        return "the warp-specialised forward is sm90 only"
    if block_table is not None:
        return "paged cache: TMA reads the dense cache only"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}: float16 or bfloat16 only"
    cfg = C.WS_FWD_CONFIGS.get(D)
    if cfg is None or v_cache.shape[-1] != D:
        return f"head dim {D}: one of {sorted(C.WS_FWD_CONFIGS)} only"
    if Sq < CACHE_FORWARD_MIN_SQ or Sq % (2 * WG_ROWS):
        return f"Sq={Sq}: multiples of {2 * WG_ROWS} only (fewer new queries: the decode kernel)"
    if params.window_left >= 0 or params.window_right > 0:
        return "window: causal or no band only"
    if params.scale <= 0:
        return f"scale {params.scale}: positive only (the running max is taken before scaling)"
    scope = forward_scope_reason(cfg, False, params)
    if scope is not None:
        return scope
    if rows_layout(q) == 0 or rows_layout(k_cache, v_cache) == 0:
        return "memory layout: query and the cache each (B, H, S, D) or (B, S, H, D) contiguous"
    if not all(tma_compatible(t) for t in (q, k_cache, v_cache)):
        return "TMA needs 16-byte aligned rows"
    if B * Hq > MAX_GRID_YZ or B * Hq * Sq >= 2**31 or k_cache.numel() // D >= 2**31:
        return "grid or row count past the kernel's 32-bit limits"
    if B * Hq * Sq * k_cache.shape[2] * D < WS_MIN_WORK:
        return f"below WS_MIN_WORK ({WS_MIN_WORK} query-key-dim products): the host descriptors cost more"
    return None
