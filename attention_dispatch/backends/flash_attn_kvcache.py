"""sdpa_with_kvcache() through flash-attn 2, 3 and 4: ``FlashAttnBackend.run_kvcache`` and the
KV-cache part of each generation's capabilities.

What each generation's public API computes, read in its source (Dao-AILab/flash-attention;
flash-attn 2 at v2.8.3, flash-attn 3 ``hopper/`` at 0251105a, flash-attn 4 in the 4.0.0b36 wheel):

- flash-attn 2: ``flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, ...,
  cache_seqlens=None, ..., block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
  ...)`` (flash_attn/flash_attn_interface.py:1464).  k/v are written into the cache in place at
  cache_seqlens[b] ... and attended to (docstring :1534, kernel flash_fwd_kernel.h Append_KV);
  causal and window are aligned bottom-right against cache_seqlens[b] + seqlen_new (docstring
  :1509-1522, block_info.h actual_seqlen_k).  Paged: block_table int32, page_block_size a
  multiple of 256 (docstring :1531, csrc/flash_attn/flash_api.cpp:1264).  The caches need a unit
  last stride (interface :1572, flash_api.cpp), any other strides; q/k/v are copied only when
  their last stride is not 1.  A window side >= the cache's capacity becomes unbounded
  (flash_api.cpp:1286-1287): exact for left, not for right < Sq - 1 (rejected).  Sq = 1 with GQA
  regroups the query heads as rows and then checks them against the cache length when k is given
  (:1278, :1356; rejected when they exceed it).  A row with no key gives 0 (kernel :537 writes 0
  and LSE -inf; the split combine maps all -inf to 0, :1189-1197).
- flash-attn 3: ``flash_attn_interface.flash_attn_with_kvcache`` (hopper/flash_attn_interface.py:942):
  the same semantics (docstring :998-1023, seqlen.h:88 seqlen_k = seqused_k + seqlen_k_new), but
  the table keyword is ``page_table`` and page_block_size "can be arbitrary" (:1020); windows
  past the lengths become unbounded only where that is exact (hopper/flash_api.cpp:796-797);
  head dim a multiple of 8 (:855).  A build may leave out paged KV, the append or varlen
  (``flash_attn_config.CONFIG["build_flags"]``): the capabilities follow them.
- flash-attn 4 (``flash_attn.cute``): no KV-cache function and no append.  Its public
  ``flash_attn_varlen_func(q, k, v, ..., seqused_k=None, ..., page_table=None, softmax_scale=None,
  causal=False, window_size=(None, None), ...)`` (flash_attn/cute/interface.py:4214) takes a
  dense batch (B, S, H, D) with per-sequence key lengths ``seqused_k`` (seqlen_info.py:118; causal
  and window are aligned to them, block_info.py) and a paged cache (num_pages, page_size, H, D)
  with ``page_table`` (interface.py:764-771); on sm90 pages of the kernel's key tile load by TMA,
  any other page size by cp.async (interface.py:1652, paged_kv.py:148): every page size.  Paged
  KV on sm90 came with 4.0.0b5 (4.0.0b0-b4 assert "paged KV not supported on SM 9.0").  So
  k_new/v_new are written first with our ``append_kv`` (kernels/kv_append.py), then the call reads
  ``seqused_k = cache_seqlens + Sq``.  A sequence with no key gives 0 (flash_fwd_sm90.py:1231,
  softmax.py:277).  Its docstring warns (interface.py:4277) that with pages loaded by TMA, rows
  past seqused_k in a sequence's last page are read and must be finite (P = 0 times NaN); a
  dense cache's last key tile loads by TMA the same way (bounded by the capacity, not seqused_k;
  read in the source, not yet run: tests/test_flash_attn_kvcache.py's gpu test records it).
  Rows past the lengths are not part of our call (a cache from torch.empty may hold NaN there),
  so flash-attn 4 declares no KV path (``FA4_KV_DECLINED``, named in its reason) and its mapping
  here does not run.

Our layouts are (B, H, S, D); theirs (B, S, H, D): query, dense caches and k_new/v_new go as
``transpose(1, 2)`` views (no copy: the append lands in the caller's cache), paged caches as they
are (the same layout), and the output comes back transposed.  Which generation runs is
``FlashAttnBackend.select`` on the call's Problem, as for sdpa().
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re

import torch

from ..problem import Problem, compute_capability
from ..semantics import band
from .base import Capabilities
from .window_clamp import right_bound_cut
from .fa4_relaunch import fa4_version
from ..kernels.kv_append import append_kv

_PAGED_ANY_SIZE = dict(paged_block_size_min=1, paged_block_size_multiple=1, paged_block_size_pow2=False)
# The KV-cache fields of each generation's Capabilities (flash_attn.py's FA2/FA3/FA4_CAPS).
FA2_KV = dict(
    kv_cache=frozenset({"dense", "paged"}),
    paged_block_size_min=256,
    paged_block_size_multiple=256,
    kv_append=True,
    kv_multi_query=True,
)
FA3_KV = dict(kv_cache=frozenset({"dense", "paged"}), kv_append=True, kv_multi_query=True, **_PAGED_ANY_SIZE)
# flash-attn 4 declines (module doc): rows past the lengths are not part of a call, and it reads
# some of them; its mapping below (our append, then flash_attn_varlen_func) is what a release that
# reads nothing past seqused_k would run, declared then as FA3_KV
FA4_KV_DECLINED = (
    "flash-attn 4 reads key/value rows past seqused_k (the rest of a sequence's last key tile or "
    "TMA page; P = 0 times a NaN there is NaN), which a cache from torch.empty may hold, and "
    "zeroing them would copy the cache"
)
FA4_KV = dict(FA3_KV, kv_cache=frozenset(), kv_cache_declined=FA4_KV_DECLINED)

# The function each generation's KV-cache call goes through, and its keywords for the
# per-sequence lengths and the block table.
KV_FUNCTION = {"fa2": "flash_attn_with_kvcache", "fa3": "flash_attn_with_kvcache", "fa4": "flash_attn_varlen_func"}
LENGTHS_KEYWORD = {"fa2": "cache_seqlens", "fa3": "cache_seqlens", "fa4": "seqused_k"}
TABLE_KEYWORD = {"fa2": "block_table", "fa3": "page_table", "fa4": "page_table"}
FA4_PAGED_SM90 = (4, 0, 0, 5)  # flash-attn 4.0.0b5: the first release with paged KV on sm90
_HALF = (torch.float16, torch.bfloat16)


def _parameters(func) -> set[str] | None:
    try:
        return set(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: trust the documented one
        return None


def kv_function(key: str, module):
    """The generation's KV-cache function in `module`, or None when it has none."""
    return getattr(module, KV_FUNCTION[key], None)


def fa3_build_flags() -> dict:
    """flash-attn 3's build flags (hopper/setup.py writes flash_attn_config.py); {} if absent."""
    try:
        from flash_attn_config import CONFIG  # type: ignore[import-not-found]

        return dict(CONFIG.get("build_flags", {}))
    except Exception:
        return {}


def kv_capabilities(key: str, func, caps: Capabilities, build_flags: dict | None = None) -> Capabilities:
    """`caps` with the KV-cache fields of what `func` (kv_function(); None: no KV path) takes:
    no KV cache without the function or its lengths (and, for 2/3, k/v) keywords; paged only
    with the table keyword; what a flash-attn 3 build left out (build_flags) left out here."""
    params = _parameters(func) if func is not None else set()
    needed = {LENGTHS_KEYWORD[key]} | ({"k", "v"} if key != "fa4" else set())
    flags = build_flags or {}
    if func is None or (params is not None and not needed <= params) or flags.get("FLASHATTENTION_DISABLE_VARLEN"):
        return dataclasses.replace(caps, kv_cache=frozenset())
    kinds = set(caps.kv_cache)
    if (params is not None and TABLE_KEYWORD[key] not in params) or flags.get("FLASHATTENTION_DISABLE_PAGEDKV"):
        kinds.discard("paged")
    append = caps.kv_append and not flags.get("FLASHATTENTION_DISABLE_APPENDKV")
    return dataclasses.replace(caps, kv_cache=frozenset(kinds), kv_append=append)


def kv_union(caps: list[Capabilities]) -> dict:
    """The loosest KV-cache fields over `caps` (for caps_union)."""
    paged = [c for c in caps if "paged" in c.kv_cache]
    with_kv = [c for c in caps if c.kv_cache]
    return dict(
        kv_cache=frozenset().union(*(c.kv_cache for c in caps)),
        paged_block_size_min=min((c.paged_block_size_min for c in paged), default=1),
        paged_block_size_multiple=math.gcd(*(c.paged_block_size_multiple for c in paged)) if paged else 1,
        paged_block_size_pow2=bool(paged) and all(c.paged_block_size_pow2 for c in paged),
        kv_append=any(c.kv_append for c in with_kv),
        kv_multi_query=any(c.kv_multi_query for c in with_kv),
        kv_cache_declined="" if with_kv else "; ".join(c.kv_cache_declined for c in caps if c.kv_cache_declined),
    )


def _release(version: str) -> tuple[int, int, int, float] | None:
    """(major, minor, patch, beta) of '4.0.0b36' (a final release: beta inf); None if unknown."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)(?:\.?b(?:eta)?\.?(\d+))?", version or "")
    if not m or m.group(1, 2, 3) == ("0", "0", "0"):
        return None
    beta = float(m.group(4)) if m.group(4) is not None else math.inf
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), beta


@functools.lru_cache(maxsize=None)
def fa4_release(version: str) -> tuple[int, int, int, float] | None:
    """flash-attn 4's release from its module's version, or from the installed distribution's
    metadata when the module says '0.0.0' (4.0.0b36's __init__ asks for a distribution "fa4" that
    the wheel "flash-attn-4" does not install)."""
    return _release(fa4_version(version))


def passed_window(causal, window) -> tuple[int, int]:
    """(left, right) as FlashAttnBackend.window_args passes them, -1 unbounded."""
    if window is None:
        return -1, -1
    _, left, right = band(causal, window)
    return left, right


def kv_reasons(key: str, version: str, p: Problem) -> list[str]:
    """Reasons one generation cannot compute the KV-cache call `p`, beyond its capabilities."""
    reasons = []
    if not p.last_dim_contiguous:
        reasons.append(
            "a query/cache/k_new/v_new whose last dimension is not contiguous (flash-attn reads and writes "
            "the cache in place with a unit last stride)"
        )
    if key in ("fa2", "fa3") and not p.aligned_16:
        reasons.append("a tensor not 16-byte aligned (flash-attn 2/3 take the cache in place, in 16-byte loads)")
    left, right = passed_window(p.causal, p.window)
    cut = right_bound_cut(p.seqlen_q, p.seqlen_k, p.causal, p.window) if key in ("fa2", "fa3") else ""
    if cut:
        reasons.append(cut + " (Sk: the cache's capacity)")
    group = p.heads_q // max(p.heads_kv, 1)
    if (
        key == "fa2"
        and p.kv_append
        and p.seqlen_q == 1
        and group > 1
        and left < 0
        and right < 0
        and p.head_dim_qk % 8 == 0
        and group > p.seqlen_k
    ):
        reasons.append(
            f"k_new with Sq=1 and {group} query heads per kv head > the cache's capacity {p.seqlen_k} "
            "(flash-attn 2 checks its regrouped query rows against the cache length)"
        )
    cc = p.compute_capability
    if key == "fa4" and p.layout == "paged" and cc is not None and cc[0] == 9:
        release = fa4_release(version)
        if release is None or release < FA4_PAGED_SM90:
            reasons.append(
                f"paged KV cache on sm90 needs flash-attn 4 >= 4.0.0b5 (this is {version or 'an unknown version'})"
            )
    return reasons


def kv_problem(query, k_cache, v_cache, k_new, v_new, block_table, causal, window) -> Problem:
    """The Problem run_kvcache() chooses a generation for: kvcache.kv_problem's, as run_problem()
    for sdpa(): device and dtype were vetted by the dispatcher, the choice here is about features
    (which keeps it usable on fakes on the CPU)."""
    from ..kvcache import kv_problem as problem_of

    p = problem_of(query, k_cache, v_cache, k_new, v_new, block_table, causal, window)
    return dataclasses.replace(
        p,
        dtype=query.dtype if query.dtype in _HALF else torch.float16,
        device_type="cuda",
        compute_capability=compute_capability(query.device),
    )


def run_kvcache(backend, query, k_cache, v_cache, cache_seqlens, *, k_new, v_new, block_table, causal, window, scale):
    """FlashAttnBackend.run_kvcache: the generation select() chooses for this call, called as
    the module docstring says.  Returns (B, Hq, Sq, D)."""
    choice = backend.select(kv_problem(query, k_cache, v_cache, k_new, v_new, block_table, causal, window))
    impl = choice.impl
    if impl is None:
        raise RuntimeError("flash_attn cannot run this KV-cache call: " + "; ".join(choice.refusals))
    capacity = k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    if query.numel() == 0 or capacity == 0:  # nothing to append (Sq = 0, or no room), no key: zeros
        return query.new_zeros(query.shape)
    is_causal, window_size = backend.window_args(impl, causal, window)
    lengths = cache_seqlens
    kwargs = dict(softmax_scale=scale, causal=is_causal, window_size=window_size)
    if k_new is not None:
        if impl.key == "fa4":  # no in-place append in flash-attn 4: ours first, then the longer lengths
            append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
            lengths = cache_seqlens + query.shape[2]
        else:
            kwargs.update(k=k_new.transpose(1, 2), v=v_new.transpose(1, 2))
    kwargs[LENGTHS_KEYWORD[impl.key]] = lengths if lengths.is_contiguous() else lengths.contiguous()
    if block_table is not None:
        kwargs[TABLE_KEYWORD[impl.key]] = block_table
    else:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    out = impl.kv_func(query.transpose(1, 2), k_cache, v_cache, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


__all__ = [
    "FA2_KV",
    "FA3_KV",
    "FA4_KV",
    "FA4_KV_DECLINED",
    "kv_capabilities",
    "kv_function",
    "kv_problem",
    "kv_reasons",
    "kv_union",
    "run_kvcache",
]
