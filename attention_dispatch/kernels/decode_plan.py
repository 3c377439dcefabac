"""The decode kernels' launch parameters (tl/decode.py) and :class:`DecodePlan`, which repeats a
decode call of one signature with only its pointers (and, for a cache whose length changes per
call, a few ints) computed per call: no route, no configuration, no compiled-cache key (issue 34:
~60 us of host time per step through the launch glue before, on the H200).

Workspace rule: a call's split partials live in one float32 tensor allocated per call from
PyTorch's caching allocator, which orders reuse by stream and gives a CUDA-graph capture memory
of the graph's own pool.  No workspace outlives its call: one kept across calls would be shared
by calls on two streams, by two threads interleaving their split and combine launches on one
stream, and by a captured graph's replays beside eager calls.
"""

from __future__ import annotations

import torch

from ..caches import register_cache
from . import configs as C
from . import run
from .compiled_cache import COMPILED, hooks_installed, relaunch
from .device import device_info, is_interpreter
from .limits import MAX_GRID_YZ
from .params import KernelParams
from .shapes import cdiv, next_pow2
from .tl.common import LOG2E
from .tl.decode import _decode_combine, _decode_split
from .tl.launch import score_args, score_constexprs

# A split covers at least this many keys: below it the combine pass and the partials' traffic
# outweigh the parallelism gained.
MIN_KEYS_PER_SPLIT = 256
MAX_DECODE_SPLITS = 64  # B=1 GQA over 128k on the H200: 64 splits 4.08 TB/s, 128 3.81-3.93 (E138)
UNEVEN_PROGRAMS_PER_SM = 20
EQUAL_PROGRAMS_PER_SM = 4  # H100 (E121): 2 was 3% faster on MHA B=8 Sk=32k, level elsewhere
# The split partials' workspace at most (the four-wave rule's largest was ~69 MB, d512 with 64-row blocks).
MAX_SPLIT_WORKSPACE = 64 << 20


def decode_splits(programs: int, capacity: int, num_sms: int, equal_lengths: bool = False, split_bytes: int = 0) -> int:
    """Key splits per (sequence, kv head, row block) (``programs``: the grid without splits), each
    split at least MIN_KEYS_PER_SPLIT keys of the cache's ``capacity`` (the longest a sequence can
    be: no read of cache_seqlens), the total rounded down so the grid stays at or under its target
    (a grid just past what the SMs hold leaves a slow tail: 768 programs ran slow on both GPUs, E121,
    E138).  Per-sequence lengths (``equal_lengths`` False) may differ: about
    UNEVEN_PROGRAMS_PER_SM programs an SM, so that long sequences spread (H200: uniform 1..32k over
    B=64 2 splits 4.07 TB/s, 5 splits 4.31).  Every sequence the whole cache (plain sdpa()):
    about EQUAL_PROGRAMS_PER_SM programs an SM, the best count of each of E138's ten equal-length rows
    on the H200 (timed with a lengths tensor; GQA B=8 Sk=32k 4 splits 3.86-3.95 TB/s, 8 splits 4.31;
    MHA B=8 Sk=32k 1 split 4.23, 2 splits 4.49).  ``split_bytes``: the workspace one split adds (its
    float32 partials of every row), the splits' together held to MAX_SPLIT_WORKSPACE."""
    if num_sms <= 1:  # the interpreter (one "SM"): small grids split, so CPU tests run the split path
        wanted = 4 // programs if equal_lengths else cdiv(4, programs)
    else:
        wanted = (EQUAL_PROGRAMS_PER_SM if equal_lengths else UNEVEN_PROGRAMS_PER_SM) * num_sms // programs
    if split_bytes > 0:
        wanted = min(wanted, MAX_SPLIT_WORKSPACE // split_bytes)
    return max(1, min(wanted, cdiv(capacity, MIN_KEYS_PER_SPLIT), MAX_DECODE_SPLITS))


def tiles(group: int, sq: int, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, row blocks) of the split pass for a GQA group, Sq and head dim."""
    block_m = max(16, min(64, next_pow2(group * sq)))
    block_n = 32 if is_interpreter() else (64 if d <= 128 else 32)
    return block_m, block_n, C.block_d(d), cdiv(group * sq, block_m)  # the head dim's padding is masked


def key_splits(
    programs: int,
    capacity: int,
    block_n: int,
    forced: int,
    num_sms: int,
    equal_lengths: bool = False,
    split_bytes: int = 0,
) -> tuple[int, int]:
    """(splits, keys per split) over a cache of ``capacity`` keys; ``forced`` > 0 asks for that many."""
    splits = forced if forced > 0 else decode_splits(programs, capacity, num_sms, equal_lengths, split_bytes)
    per_split = max(1, cdiv(cdiv(capacity, splits), block_n)) * block_n  # an empty cache: one split
    return max(1, cdiv(capacity, per_split)), per_split


def cache_geometry(k_cache, v_cache, block_table) -> tuple:
    """(page, Hkv, capacity, k strides, v strides, block table row stride, num_blocks) of a dense
    (B, Hkv, S, D) or paged (num_blocks, page, Hkv, D) cache (dense: num_blocks 0, not read),
    strides as (block or batch, head, row)."""
    if block_table is not None:
        ks, vs = k_cache.stride(), v_cache.stride()
        page = k_cache.shape[1]
        return (
            page,
            k_cache.shape[2],
            block_table.shape[1] * page if k_cache.shape[0] else 0,  # no blocks: no key is readable
            (ks[0], ks[2], ks[1]),
            (vs[0], vs[2], vs[1]),
            block_table.stride(0),
            k_cache.shape[0],
        )
    return 1, k_cache.shape[1], k_cache.shape[2], k_cache.stride()[:3], v_cache.stride()[:3], 0, 0


def split_constexprs(q, params, alibi, group, tile, paged, page, split, append, bh_axis0, sinks, lse, full):
    """The split pass's constexprs (``tile``: :func:`tiles`'s)."""
    block_m, block_n, block_d, _ = tile
    return dict(
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_D=q.shape[3],
        BLOCK_D=block_d,
        PAGED=paged,
        PAGE=page,
        HAS_WL=params.window_left >= 0,
        HAS_WR=params.window_right >= 0,
        SPLIT=split,
        APPEND=append,
        BH_AXIS0=bh_axis0,
        DOT_UPCAST=is_interpreter() and q.dtype != torch.float32,
        DOT_IEEE=q.dtype == torch.float32,
        HAS_SINKS=sinks,
        STORE_LSE=lse,
        **score_constexprs(params, alibi, q.dtype),
        FULL_LENGTH=full,
    )


def combine_constexprs(splits: int, d: int, block_d: int, sinks: bool, lse: bool) -> dict:
    """The combine pass's constexprs: the split count only as its power of two (it is an argument)."""
    return dict(SPLITS_P2=next_pow2(splits), HEAD_D=d, BLOCK_D=block_d, HAS_SINKS=sinks, STORE_LSE=lse)


def split_warps(block_d: int) -> int:
    return 8 if block_d > 256 else 4  # d512: the (BLOCK_M, 512) fp32 accumulator over 8 warps


def split_grid(bh: int, splits: int, row_blocks: int) -> tuple:
    # B * Hkv past the y axis' 65535 goes on axis 0 (tl/decode.py)
    return (bh, splits, row_blocks) if bh > MAX_GRID_YZ else (splits, bh, row_blocks)


def split_tensors(q, k_cache, v_cache, lens, table, out, o_part, l_part, k_new, v_new, alibi, sinks, lse):
    """The split pass's 13 pointer arguments, in signature order (absent ones point at q or the cache)."""
    return (
        q,
        k_cache,
        v_cache,
        lens,
        table,
        out,
        o_part,
        l_part,
        k_new if k_new is not None else k_cache,
        v_new if v_new is not None else v_cache,
        alibi if alibi is not None else q,
        sinks if sinks is not None else q,
        lse if lse is not None else q,
    )


def _scalar_parts(params, alibi, q_str, out_str, new_str, hq, hkv, sq) -> tuple[tuple, tuple, tuple]:
    """The split pass's scalar arguments that do not change with the cache's geometry (DecodePlan keeps them)."""
    head = (params.scale * LOG2E, *score_args(params, alibi), *q_str)
    mid = (*out_str, *new_str, hq, hkv, sq)
    return head, mid, (max(params.window_left, 0), max(params.window_right, 0))


def _int_class(v: int) -> int:
    """What Triton can specialise an int argument >= 0 on, or finer, as bits: 1, divisible by 16, past int32."""
    return (v == 1) | ((v & 15) == 0) << 1 | (v >= 2**31) << 2


_LAUNCH_ONE = run.launch_one  # a replaced one (a test or benchmark watching launches) sees every launch


class _Step:
    """One launch of a plan: kernel, grid, scalars after the pointers, constexprs, warps, stages,
    and the compiled kernel's entry (compiled_cache.relaunch) once a launch has given it."""

    __slots__ = ("kernel", "grid", "scalars", "constexprs", "warps", "stages", "key", "entry")

    def __init__(self, kernel, grid, scalars, constexprs, warps, stages, key, entry):
        self.kernel, self.grid, self.scalars, self.constexprs = kernel, grid, scalars, constexprs
        self.warps, self.stages, self.key, self.entry = warps, stages, key, entry


class _Geometry:
    """A plan's launches for one cache geometry (capacity and strides)."""

    __slots__ = ("split", "combine", "o_numel", "ws_numel", "route")

    def __init__(self, split, combine, o_numel, ws_numel):
        self.split, self.combine, self.o_numel, self.ws_numel = split, combine, o_numel, ws_numel
        self.route = None  # kernels.decode.kv_forward's kernel for this geometry, once chosen


class DecodePlan:
    """The decode launches of one call signature (:func:`plan_key`): query shape, strides, dtype,
    device and alignment, the cache's heads, page and alignment, which optional tensors come and
    their layouts, params.  The cache's capacity and strides may change per call (plain sdpa()'s
    key length grows by one per decode step): the launches of the last geometry are kept, another
    one costs a few ints.  A call allocates its output and one workspace (module doc) and
    relaunches the compiled kernels with their addresses; the first launch of a specialisation
    (compiled_cache) and the interpreter go through :func:`run.launch_one`."""

    __slots__ = (
        "params",
        "device",
        "shape",
        "dtype",
        "out_like_q",
        "full",
        "n_new",
        "forced",
        "paged",
        "append",
        "has_alibi",
        "has_sinks",
        "need_lse",
        "fixed",
        "fixed_parts",
        "combine_cx",
        "num_sms",
        "entries",
        "last",
        "launches",
    )

    def __init__(
        self, q, params: KernelParams, cache_seqlens, block_table, k_new, alibi, sinks, need_lse, n_new, forced
    ):
        B, Hq, Sq, D = q.shape
        self.params, self.device, self.shape, self.dtype = params, q.device, tuple(q.shape), q.dtype
        self.out_like_q = q.is_contiguous()  # empty_like gives the contiguous layout of the strides below
        self.full, self.n_new, self.forced = cache_seqlens is None, n_new, forced
        self.paged, self.append = block_table is not None, k_new is not None
        self.has_alibi, self.has_sinks, self.need_lse = alibi is not None, sinks is not None, need_lse
        out_str = (Hq * Sq * D, Sq * D, D)
        # what every geometry shares: q, out and k_new strides, the alibi strides (score_args)
        self.fixed = (q.stride()[:3], out_str, k_new.stride()[:3] if k_new is not None else (0, 0, 0), alibi)
        self.num_sms = device_info(q.device)[2]
        self.fixed_parts = None  # _fixed_parts, on the first geometry
        self.combine_cx: dict = {}  # the combine pass's constexprs by its SPLITS_P2
        self.entries: dict = {}  # (step, its varying scalars' classes) -> compiled entry
        self.last = (None, None)  # (geometry key, _Geometry) of the last call: one tuple, read at once by threads
        self.launches = 0  # launches through this plan (tests)

    def geometry(self, q, k_cache, v_cache, block_table) -> _Geometry:
        """The launches for this cache's capacity and strides (the last geometry's are kept)."""
        gkey = (
            k_cache.shape,
            k_cache.stride(),
            v_cache.stride(),
            None if block_table is None else (block_table.shape, block_table.stride()),
        )
        last = self.last
        return last[1] if gkey == last[0] else self._geometry(gkey, q, k_cache, v_cache, block_table)

    def _geometry(self, gkey, q, k_cache, v_cache, block_table) -> _Geometry:
        B, Hq, Sq, D = self.shape
        page, hkv, cap, k_str, v_str, bt_stride, num_blocks = cache_geometry(k_cache, v_cache, block_table)
        fixed = self.fixed_parts
        if fixed is None:  # what no geometry changes (heads and page are in plan_key), made once
            fixed = self.fixed_parts = self._fixed_parts(q, hkv, page)
        tile, grid_bh, head, mid, tail, constexprs, warps = fixed
        rows = B * Hq * Sq
        split_floats = rows * (tile[2] + 1)  # one split's workspace: each row's partial output and logsumexp
        splits, per_split = key_splits(
            grid_bh * tile[3], cap, tile[1], self.forced, self.num_sms, self.full, split_floats * 4
        )
        split = splits > 1
        scalars = head + k_str + v_str + (bt_stride,) + mid + (per_split, self.n_new, cap, num_blocks) + tail
        varying = (*k_str, *v_str, bt_stride, per_split, cap, num_blocks)
        # _int_class inline (no call per value: a tenth of a growing-Sk step's host time); strides >= 0
        key = ("split", split, tuple([(x == 1) | ((x & 15) == 0) << 1 | (x >= 2**31) << 2 for x in varying]))
        first = _Step(
            _decode_split,
            split_grid(grid_bh, splits, tile[3]),
            scalars,
            constexprs[split],
            warps,
            2,
            key,
            self.entries.get(key),
        )
        combine, o_numel = None, 0
        if split:
            p2 = next_pow2(splits)
            cx = self.combine_cx.get(p2)
            if cx is None:
                cx = self.combine_cx[p2] = combine_constexprs(splits, D, tile[2], self.has_sinks, self.need_lse)
            key = ("combine", p2, _int_class(splits))
            combine = _Step(
                _decode_combine, (rows,), (rows, splits, Hq, Sq, *self.fixed[1]), cx, 4, 1, key, self.entries.get(key)
            )
            o_numel = splits * rows * tile[2]
        geo = _Geometry(first, combine, o_numel, splits * split_floats)
        self.last = (gkey, geo)
        return geo

    def _fixed_parts(self, q, hkv: int, page: int) -> tuple:
        """(tile, B * Hkv, scalars before the cache strides, between them and the split sizes,
        after those, the split pass's constexprs by SPLIT, its warps)."""
        B, Hq, Sq, D = self.shape
        group = Hq // hkv
        tile = tiles(group, Sq, D)
        q_str, out_str, new_str, alibi = self.fixed
        head, mid, tail = _scalar_parts(self.params, alibi, q_str, out_str, new_str, Hq, hkv, Sq)
        constexprs = {
            split: split_constexprs(
                q,
                self.params,
                alibi,
                group,
                tile,
                self.paged,
                page,
                split,
                self.append,
                B * hkv > MAX_GRID_YZ,
                self.has_sinks,
                self.need_lse,
                self.full,
            )
            for split in (False, True)
        }
        return tile, B * hkv, head, mid, tail, constexprs, split_warps(tile[2])

    def __call__(self, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, alibi, sinks, geo=None):
        """(out, lse or None) of one call of this signature (decode_forward's arguments; ``geo``:
        :meth:`geometry`'s for these tensors, when the caller has it)."""
        if geo is None:
            geo = self.geometry(q, k_cache, v_cache, block_table)
        dev = self.device
        out = torch.empty_like(q) if self.out_like_q else torch.empty(self.shape, device=dev, dtype=self.dtype)
        lse = torch.empty(self.shape[:3], device=dev, dtype=torch.float32) if self.need_lse else None
        ws = torch.empty(geo.ws_numel, device=dev, dtype=torch.float32) if geo.combine is not None else None
        first, second = geo.split, geo.combine
        direct = (
            first.entry is not None
            and (second is None or second.entry is not None)
            and run.launch_one is _LAUNCH_ONE
            and not hooks_installed()
        )
        lens = q if cache_seqlens is None else cache_seqlens  # FULL_LENGTH reads no lengths
        table = block_table if block_table is not None else lens
        if direct:  # addresses: Triton's launcher takes an int as the pointer itself
            qp = q.data_ptr()
            lp = lens.data_ptr()
            op = out.data_ptr()
            ep = lse.data_ptr() if lse is not None else qp
            kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
            pointers = (
                qp,
                kp,
                vp,
                lp,
                table.data_ptr() if block_table is not None else lp,
                op,
                ws.data_ptr() if ws is not None else op,
                ws.data_ptr() + 4 * geo.o_numel if ws is not None else ep,
                k_new.data_ptr() if k_new is not None else kp,
                v_new.data_ptr() if v_new is not None else vp,
                alibi.data_ptr() if alibi is not None else qp,
                sinks.data_ptr() if sinks is not None else qp,
                ep,
            )
            relaunch(first.entry, first.grid, pointers + first.scalars)
            COMPILED.record(None, first.grid, pointers, first.constexprs)  # an outer capture cannot replay it
            if second is not None:
                pointers = (pointers[6], pointers[7], op, pointers[11], ep)
                relaunch(second.entry, second.grid, pointers + second.scalars)
                COMPILED.record(None, second.grid, pointers, second.constexprs)
            self.launches += 1 + (second is not None)
            return out, lse
        o_part = ws[: geo.o_numel] if ws is not None else out
        l_part = ws[geo.o_numel :] if ws is not None else (lse if lse is not None else out)
        tensors = split_tensors(q, k_cache, v_cache, lens, table, out, o_part, l_part, k_new, v_new, alibi, sinks, lse)
        self._launch(first, tensors)
        if second is not None:
            self._launch(second, (o_part, l_part, out, tensors[11], tensors[12]))
        return out, lse

    def _launch(self, step: _Step, tensors: tuple) -> None:
        """Through run.launch_one, keeping the compiled entry it gives for later direct launches."""
        with COMPILED.capture() as seen:
            run.launch_one(step.kernel, step.grid, tensors + step.scalars, step.constexprs, step.warps, step.stages)
        entry = seen[-1][0] if seen else None  # none under the interpreter
        if entry is not None:
            step.entry = self.entries[step.key] = entry
        COMPILED.record(None, step.grid, tensors, step.constexprs)
        self.launches += 1


def plan_key(q, cache_seqlens, k_cache, v_cache, block_table, k_new, v_new, alibi, sinks, params, rest) -> tuple:
    """A decode call's signature but the cache's capacity and strides (DecodePlan); ``rest``:
    (need_lse, n_new, forced splits)."""
    paged = block_table is not None
    return (
        q.shape,
        q.stride(),
        q.dtype,
        q.device,
        q.data_ptr() & 15,
        k_cache.shape[1],
        k_cache.shape[2] if paged else -1,
        k_cache.data_ptr() & 15,
        v_cache.data_ptr() & 15,
        -1 if cache_seqlens is None else cache_seqlens.data_ptr() & 15,
        -1 if not paged else block_table.data_ptr() & 15,
        None if k_new is None else (k_new.stride(), v_new.stride(), k_new.data_ptr() & 15, v_new.data_ptr() & 15),
        None if alibi is None else (alibi.stride(), alibi.data_ptr() & 15),
        None if sinks is None else (sinks.dtype, sinks.data_ptr() & 15),
        params,
        rest,
    )


PLANS: dict = {}
register_cache("kernels.decode_plan.PLANS", PLANS.clear, PLANS.__len__)
MAX_PLANS = 256


def plan_for(
    q, k_cache, v_cache, cache_seqlens, params, block_table, k_new, v_new, alibi, sinks, need_lse, n_new, forced
):
    """The :class:`DecodePlan` of this call's signature (made on its first call)."""
    key = plan_key(
        q, cache_seqlens, k_cache, v_cache, block_table, k_new, v_new, alibi, sinks, params, (need_lse, n_new, forced)
    )
    plan = PLANS.get(key)
    if plan is None:
        if len(PLANS) >= MAX_PLANS:
            PLANS.clear()
        plan = PLANS[key] = DecodePlan(
            q, params, cache_seqlens, block_table, k_new, alibi, sinks, need_lse, n_new, forced
        )
    return plan


class DecodeRunner:
    """Plain sdpa()'s decode route, prepared (kernels.autograd.prepare_attention): a call of the
    prepared one's signature but for its key length and the keys' strides (what sdpa()'s span
    hits pass: fast_key.length_key) runs ``plan`` (full length: no lengths tensor) directly, its
    launch parameters for a new key length computed by :meth:`DecodePlan.geometry`; a call the
    plan does not cover (fewer than ``min_keys`` keys, another query stride or pointer alignment)
    goes to ``fallback(q, k, v)``, the backend's whole path."""

    any_key_length = True  # Backend.prepare: sdpa() may pass it calls of other key lengths
    __slots__ = ("plan", "q_stride", "align", "min_keys", "fallback")

    def __init__(self, plan: DecodePlan, q, k, v, min_keys: int, fallback):
        self.plan, self.q_stride, self.min_keys, self.fallback = plan, q.stride(), min_keys, fallback
        self.align = (q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15)

    def __call__(self, q, k, v):
        if (
            k.shape[2] < self.min_keys
            or q.stride() != self.q_stride
            or (q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15) != self.align
        ):
            return self.fallback(q, k, v)
        return self.plan(q, k, v, None, None, None, None, None, None)[0]


class KvRunner:
    """sdpa_with_kvcache()'s repeated calls of one signature through the decode kernel, prepared
    (kernels.decode.prepare_kv): ``plan`` relaunched with the prepared ``geo`` (the signature
    fixes the cache's shape and strides), none of run_kvcache()'s argument processing.  The
    signature does not fix the lengths' and block table's strides and alignment: a call whose
    differ from the prepared call's goes to ``fallback`` (the backend's whole path)."""

    __slots__ = ("plan", "geo", "lens_align", "table_layout", "fallback")

    def __init__(self, plan: DecodePlan, geo: _Geometry, cache_seqlens, block_table, fallback):
        self.plan, self.geo, self.fallback = plan, geo, fallback
        self.lens_align = cache_seqlens.data_ptr() & 15
        self.table_layout = None if block_table is None else (block_table.stride(), block_table.data_ptr() & 15)

    def __call__(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table):
        if (
            cache_seqlens.stride(0) != 1
            or cache_seqlens.data_ptr() & 15 != self.lens_align
            or (block_table is not None and (block_table.stride(), block_table.data_ptr() & 15) != self.table_layout)
        ):
            return self.fallback(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
        return self.plan(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, None, None, self.geo)[0]
