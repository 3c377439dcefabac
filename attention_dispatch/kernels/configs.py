"""Launch-configuration table of the Triton attention kernels.

Mirrors what PyTorch's ``attention_backward.cu`` / ``attention.cu`` do for the
memory-efficient kernels: a list of candidate kernel configurations per
(kernel kind, head dim, dtype, compute capability), tried best-first; a candidate
is taken when its shared-memory estimate fits the device's opt-in limit.  When no
candidate fits, :func:`config_reason` says why (the adapter turns that into a
dispatcher rejection reason).

Pure data + small pure functions: no Triton, no torch device queries here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .limits import KERNEL_LIMITS

# Kernel kinds.
FWD = "fwd"
BWD_DKDV = "bwd_dkdv"  # key-block parallel: dK, dV (and d(bias))
BWD_DQ = "bwd_dq"  # query-block parallel: dQ (optionally split over keys)
KINDS = (FWD, BWD_DKDV, BWD_DQ)
# The dK/dV pass as two launches where these have entries (wide_backward calls, E108): dV alone,
# then dK (and d(bias)) alone, each holding one BN x D fp32 accumulator; elsewhere BWD_DKDV.
BWD_DV = "bwd_dv"
BWD_DK = "bwd_dk"
SPLIT_KINDS = (BWD_DV, BWD_DK)

SUPPORTED_DTYPES = KERNEL_LIMITS.dtypes
MIN_HEAD_DIM = KERNEL_LIMITS.min_head_dim
MAX_HEAD_DIM = KERNEL_LIMITS.max_head_dim
MIN_COMPUTE_CAPABILITY = KERNEL_LIMITS.min_compute_capability
BF16_MIN_COMPUTE_CAPABILITY = KERNEL_LIMITS.bf16_min_compute_capability


class KernelConfig(NamedTuple):
    """A launch configuration (a tuple: hashed in C on every launch's chosen-config lookup)."""

    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int = 4
    num_stages: int = 2
    subtiles: int = 1  # forward only: the query tile as 2 halves sharing each K/V block
    host_kv: bool = True  # forward only: K/V through host-built descriptors where the call allows

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return (
            f"BM={self.block_m} BN={self.block_n} warps={self.num_warps} stages={self.num_stages}"
            + (f" subtiles={self.subtiles}" if self.subtiles > 1 else "")
            + ("" if self.host_kv else " host_kv=off")
        )


@dataclass(frozen=True)
class ConfigEntry:
    kind: str
    min_cc: tuple[int, int]
    max_cc: tuple[int, int]  # inclusive
    max_block_d: int  # applies when the padded head dim (max of qk, v) <= this
    dtypes: tuple[torch.dtype, ...]  # element types it is meant for
    config: KernelConfig
    banded: bool | None = None  # only for causal/window calls (True), only for dense (False), any (None)
    extras: bool | None = None  # only for calls with a bias/mask or dropout (True), only without (False), any
    grouped: bool | None = None  # only for GQA/MQA calls (True), only for Hq == Hkv (False), any

    def serves(self, banded: bool, extras: bool, grouped: bool = False) -> bool:
        """Whether the entry may be chosen for a call that is (not) banded, has (no) extras and
        does (not) share kv heads between query heads."""
        return (
            (self.banded is None or self.banded == banded)
            and (self.extras is None or self.extras == extras)
            and (self.grouped is None or self.grouped == grouped)
        )


_HALF = (torch.float16, torch.bfloat16)
_F32 = (torch.float32,)
_ALL = _HALF + _F32

_SM90 = ((9, 0), (9, 9))
_SM80 = ((8, 0), (8, 0))  # A100 / A30: 164 KiB shared memory
_ANY = ((7, 5), (99, 9))  # fallbacks that fit small shared memories


def _e(kind, cc, max_d, dtypes, bm, bn, w, s, banded=None, subtiles=1, extras=None, host_kv=True, grouped=None):
    return ConfigEntry(
        kind, cc[0], cc[1], max_d, dtypes, KernelConfig(bm, bn, w, s, subtiles, host_kv), banded, extras, grouped
    )


# Ordered best-first within each (kind, arch); the first entry that matches and fits wins.
CONFIG_TABLE: tuple[ConfigEntry, ...] = (
    # ---------------- forward ----------------
    # sm90: the sweep's best tiles (E5); two sub-tiles only where they won: d=128 dense, d=64 causal,
    # no extras (E22); host K/V descriptors off for d=64 dense, which they slowed 3-8% (E30).
    _e(FWD, _SM90, 64, _HALF, 128, 128, 4, 3, banded=False, host_kv=False),
    _e(FWD, _SM90, 64, _HALF, 128, 128, 4, 3, banded=True, subtiles=2, extras=False),
    _e(FWD, _SM90, 64, _HALF, 128, 64, 8, 3),
    _e(FWD, _SM90, 64, _HALF, 128, 64, 4, 3),
    _e(FWD, _SM90, 128, _HALF, 256, 64, 8, 3, banded=False, subtiles=2, extras=False),
    _e(FWD, _SM90, 128, _HALF, 64, 64, 4, 3, banded=True),
    _e(FWD, _SM90, 128, _HALF, 128, 128, 8, 3),
    _e(FWD, _SM90, 128, _HALF, 128, 64, 8, 3),
    _e(FWD, _SM90, 128, _HALF, 128, 32, 8, 2),
    _e(FWD, _SM90, 256, _HALF, 64, 64, 4, 3),
    _e(FWD, _SM90, 256, _HALF, 128, 64, 8, 2),
    _e(FWD, _SM90, 256, _HALF, 64, 64, 4, 2),
    # d257-512 (issue 36, docs/experiments/head-dim-512.md): 64 query rows over 8 warps keep the
    # 64x512 fp32 accumulator at 128 registers a thread; Q and one stage of 64-key K/V tiles fill
    # 192 KiB.  H200 bf16 d512 4k: 229 TFLOP/s, 64x32 in two stages 195, 64x32x4 warps 62 (spills),
    # 128x32x16 warps a ptxas internal error.
    _e(FWD, _SM90, 512, _HALF, 64, 64, 8, 1),
    _e(FWD, _SM90, 512, _HALF, 64, 32, 8, 2),
    _e(FWD, _SM90, 512, _HALF, 32, 32, 4, 2),
    _e(FWD, _SM80, 64, _HALF, 128, 64, 4, 3),
    _e(FWD, _SM80, 128, _HALF, 128, 64, 8, 2),
    _e(FWD, _SM80, 256, _HALF, 64, 64, 4, 2),
    _e(FWD, _SM80, 512, _HALF, 64, 32, 8, 1),
    _e(FWD, _ANY, 64, _F32, 64, 64, 4, 2),
    _e(FWD, _ANY, 128, _F32, 64, 32, 4, 2),
    _e(FWD, _ANY, 256, _F32, 32, 32, 4, 2),
    _e(FWD, _ANY, 64, _HALF, 64, 64, 4, 2),
    _e(FWD, _ANY, 128, _HALF, 64, 32, 4, 2),
    _e(FWD, _ANY, 256, _ALL, 32, 32, 4, 1),
    _e(FWD, _ANY, 256, _ALL, 16, 16, 2, 1),
    _e(FWD, _ANY, 512, _HALF, 32, 32, 4, 1),
    _e(FWD, _ANY, 512, _ALL, 16, 16, 4, 1),
    # ---------------- backward dK/dV (BM = query tile, BN = key tile) ----------------
    # sm90: the sweep's best tiles (E5); d=128 dense 32x64x4x4: +2.6-3.3% at 2k-8k (E33), not GQA / MQA
    # (GQA 16/4 16k -4.8%, E38).
    _e(BWD_DKDV, _SM90, 64, _HALF, 32, 64, 4, 3),
    _e(BWD_DKDV, _SM90, 64, _HALF, 32, 128, 4, 3),
    _e(BWD_DKDV, _SM90, 128, _HALF, 32, 64, 4, 3, banded=True),
    _e(BWD_DKDV, _SM90, 128, _HALF, 32, 64, 4, 4, banded=False, grouped=False),
    _e(BWD_DKDV, _SM90, 128, _HALF, 64, 128, 8, 3),
    _e(BWD_DKDV, _SM90, 128, _HALF, 64, 128, 8, 2),
    _e(BWD_DKDV, _SM90, 128, _HALF, 32, 128, 8, 2),
    _e(BWD_DKDV, _SM90, 256, _HALF, 64, 64, 8, 2),
    _e(BWD_DKDV, _SM90, 256, _HALF, 32, 64, 8, 2),
    # d257-512 (issue 36): the dK and dV accumulators (2 x BN x 512 fp32) at 128 registers a
    # thread over 8 warps with 32 keys per program.  H200 bf16 d512 4k forward+backward: 118 TFLOP/s;
    # 16x64x8x2 61, 32x64x8x1 79 (spills).
    _e(BWD_DKDV, _SM90, 512, _HALF, 32, 32, 8, 2),
    _e(BWD_DKDV, _SM90, 512, _HALF, 16, 64, 8, 2),
    _e(BWD_DKDV, _SM90, 512, _HALF, 16, 32, 4, 2),
    _e(BWD_DKDV, _SM80, 64, _HALF, 64, 128, 8, 2),
    _e(BWD_DKDV, _SM80, 128, _HALF, 32, 128, 8, 2),
    _e(BWD_DKDV, _SM80, 256, _HALF, 32, 64, 8, 1),
    _e(BWD_DKDV, _SM80, 512, _HALF, 32, 32, 8, 1),
    _e(BWD_DKDV, _ANY, 64, _ALL, 32, 64, 4, 2),
    _e(BWD_DKDV, _ANY, 128, _ALL, 32, 64, 4, 1),
    _e(BWD_DKDV, _ANY, 256, _ALL, 16, 32, 4, 1),
    _e(BWD_DKDV, _ANY, 256, _ALL, 16, 16, 2, 1),
    _e(BWD_DKDV, _ANY, 512, _ALL, 16, 16, 4, 1),
    # ---------------- backward dV alone, then dK alone (SPLIT_KINDS; padded head dims > 256) ----------------
    # sm90 d512 (E108; H100 2026-11-27: backward x1.41 dense, x1.59 causal over one pass): 64 keys a program over 8 warps is one 64 x 512
    # fp32 accumulator at 128 registers a thread and wgmma (64 x 256 a warpgroup) instead of mma.sync; no
    # spill in either loop.  dV: S^T and dV only, 168 KiB in two stages.  dK: K and V stay (128 KiB), so
    # 32 query rows fit one stage (its products N = 16 a warpgroup), 16 rows two stages (N = 8).
    _e(BWD_DV, _SM90, 512, _HALF, 32, 64, 8, 2),
    _e(BWD_DV, _SM90, 512, _HALF, 32, 64, 8, 1),
    _e(BWD_DK, _SM90, 512, _HALF, 32, 64, 8, 1),
    _e(BWD_DK, _SM90, 512, _HALF, 16, 64, 8, 2),
    # ---------------- backward dQ ----------------
    # sm90: the sweep's best tiles (E5; 128x64x8x3 re-checked at d=128, E33).
    _e(BWD_DQ, _SM90, 64, _HALF, 128, 64, 8, 3),
    _e(BWD_DQ, _SM90, 64, _HALF, 64, 64, 4, 3),
    _e(BWD_DQ, _SM90, 128, _HALF, 128, 64, 8, 3),
    _e(BWD_DQ, _SM90, 128, _HALF, 128, 64, 8, 2),
    _e(BWD_DQ, _SM90, 128, _HALF, 128, 32, 8, 2),
    _e(BWD_DQ, _SM90, 256, _HALF, 128, 32, 8, 2),
    _e(BWD_DQ, _SM90, 256, _HALF, 64, 32, 8, 2),
    # d257-512 (issue 36): dQ's 64x512 fp32 accumulator over 8 warps; one K/V stage fits beside Q, dO.
    # H200 bf16 d512 4k forward+backward: 119 TFLOP/s; 32x32x8x2 105, 64x16x8x2 96.
    _e(BWD_DQ, _SM90, 512, _HALF, 64, 32, 8, 1),
    _e(BWD_DQ, _SM90, 512, _HALF, 32, 32, 8, 2),
    _e(BWD_DQ, _SM90, 512, _HALF, 32, 32, 4, 2),
    _e(BWD_DQ, _SM80, 64, _HALF, 128, 64, 8, 2),
    _e(BWD_DQ, _SM80, 128, _HALF, 128, 32, 8, 2),
    _e(BWD_DQ, _SM80, 256, _HALF, 64, 32, 8, 1),
    _e(BWD_DQ, _SM80, 512, _HALF, 32, 32, 4, 1),
    _e(BWD_DQ, _ANY, 64, _ALL, 64, 32, 4, 2),
    _e(BWD_DQ, _ANY, 128, _ALL, 64, 32, 4, 1),
    _e(BWD_DQ, _ANY, 256, _ALL, 32, 16, 4, 1),
    _e(BWD_DQ, _ANY, 256, _ALL, 16, 16, 2, 1),
    _e(BWD_DQ, _ANY, 512, _ALL, 16, 16, 4, 1),
)


class WsConfig(NamedTuple):
    """A warp-specialised kernel's launch (gluon/; its rows per program: ``consumers``
    warpgroups of gluon.common.WG_ROWS in the forward, two in the dK/dV and dQ passes):
    ``block_n`` key rows per ring slot (forward and dQ), ``stages`` ring slots."""

    block_n: int = 128
    stages: int = 2
    bias_stages: int = 2  # slots of the bias ring (forward and dQ; dK/dV: one per (Q, dO) slot)
    consumer_regs: int = 240  # registers per thread of the second consumer (setmaxnreg)
    max_regs: int = 168  # kernel-wide limit: 12 warps * 32 * 168 fit the register file
    # dK/dV pass: dQ too (FA3's structure, fp32 reduce-adds), for the calls gluon.route.fuse_dq_reason
    # admits (where it measured faster than the separate dQ pass, E54)
    fuse_dq: bool = True
    # ... for causal and windowed calls too (d64 causal 1.03-1.08x; d128 0.96-1.06x: off, E82)
    fuse_dq_banded: bool = False
    # the forward runs this kernel; False: only the backward passes do (the route is the same)
    forward: bool = True
    # consumer warpgroups of the forward (64 query rows each); the dK/dV and dQ passes have two
    consumers: int = 2
    # the calls on the route whose forward runs this kernel: "all", or "dense" (no bias, not causal,
    # no window: the others keep the tl forward; the backward passes follow the route).  "all"
    # needs two consumers for a bias (its TMA tile's rows are a power of two)
    forward_scope: str = "all"
    # dK/dV pass: query rows per (Q, dO) tile, 64 or 128 (FA3's tile at d64: half the steps, each
    # product twice as wide); 64 with a bias
    bwd_block_m: int = 64
    # forward, causal without a bias: each consumer reads only its key tiles up to its own diagonal (the
    # others' ring slots released unread); pays where a warpgroup's rows end a whole key tile before its
    # program's last (three consumers over 64-key tiles), costs 1% elsewhere (E151)
    own_tiles: bool = False
    # forward, two consumers: K/V slots go back per warp on named barriers (gluon.common._release_slot), no
    # warpgroup bar.sync a release (E156)
    warp_release: bool = False

    def forward_own_tiles(self, window_left: int, window_right: int, has_bias: bool) -> bool:
        """The forward's OWN_TILES constexpr for a launch of this config: own_tiles on a causal call without a bias."""
        return self.own_tiles and window_left < 0 and window_right == 0 and not has_bias


# sm90 only, by head dim (Dqk == Dv; the kernel is written for any, these are the measured ones).
# d128: 1.14-1.25x the tl forward with two ring slots (E40), short causal calls too (E45).
# d64: three consumer warpgroups of 64 rows at 160 registers (16 warps x 32 x 128 fill the file)
# over 128-key slots, FA3's tile: 1.09-1.16x the tl forward (E76, E77); dense calls only (causal
# 0.92-0.97x: 192-row tiles waste more of the diagonal).
# d256: 64-key slots, what fits shared memory (196,904 B; 229,768 B with a bias ring, E85).
WS_FWD_CONFIGS = {
    128: WsConfig(),
    64: WsConfig(consumers=3, consumer_regs=160, max_regs=128, forward_scope="dense"),
    256: WsConfig(block_n=64),
}
# A bounded softcap alone, dense or causal (ws_forward_config), at d128: three consumer warpgroups at 160 registers
# over three 64-key slots, so two consumers' tanh and exp2 run under the third's products: forward 6-8% faster
# than on the config above (x of plain 1.26 -> 1.17 dense, 1.30 -> 1.24 causal); plain calls 5% slower on it (E130).
# Causal, each consumer stops at its own diagonal: 6.2% faster (E151)
WS_FWD_SOFTCAP_CONFIGS = {
    128: WsConfig(consumers=3, block_n=64, stages=3, consumer_regs=160, max_regs=128, own_tiles=True)
}
# A KV-cache or one-length launch (no bias) at d128: three K/V ring slots (229,752 B of shared memory): chunked
# prefill 0.5-0.7% faster, Sq=128 over 16k 2.5%; dense and causal forwards 0.5-0.7% slower on it, so they keep two
# (E128 read by CUPTI kernel durations, E149). Slots released per warp: B8 Sq=128 over 16k 0.7% faster, MHA Sq=256
# over 4k 2.2%, chunked prefill 0.1% (E156)
WS_FWD_CACHE_CONFIGS = {128: WsConfig(stages=3, warp_release=True)}


def ws_forward_config(
    head_d: int,
    bounded_softcap: bool,
    *,
    has_bias: bool,
    has_alibi: bool,
    window_left: int,
    window_right: int,
    kv_lens_mode: int,
) -> WsConfig:
    """The warp-specialised forward's launch: WS_FWD_SOFTCAP_CONFIGS for a bounded softcap
    (gluon/launch.forward_softcap) where it has the head dim, without a bias, ALiBi, a window (causal,
    (-1, 0), is not one) or a KV-cache or one-length launch (``kv_lens_mode`` != 0): it was measured
    and tested on dense and causal calls only; WS_FWD_CACHE_CONFIGS for a KV-cache or one-length launch
    without a bias where it has the head dim; WS_FWD_CONFIGS for every other call."""
    window = window_left >= 0 or window_right > 0
    if bounded_softcap and not (has_bias or has_alibi or window or kv_lens_mode):
        return WS_FWD_SOFTCAP_CONFIGS.get(head_d, WS_FWD_CONFIGS[head_d])
    if kv_lens_mode and not has_bias:
        return WS_FWD_CACHE_CONFIGS.get(head_d, WS_FWD_CONFIGS[head_d])
    return WS_FWD_CONFIGS[head_d]


# The warp-specialised dK/dV pass (gluon/dkdv.py, E41): 128 keys per program in two consumer
# warpgroups, ``stages`` slots of (Q, dO) tiles of ``bwd_block_m`` rows (block_n is not read: no
# K/V ring); calls the forward above serves.  No d256: a warpgroup's dK and dV accumulators alone
# would take 256 registers a thread (E85).
# d64: forward+backward 1.07-1.09x the tl kernels (E58); 128-row query tiles (E79) with dQ fused,
# causal and windowed too (1.03-1.11x the separate dQ pass, E81, E82).
WS_BWD_CONFIGS = {128: WsConfig(), 64: WsConfig(bwd_block_m=128, fuse_dq_banded=True)}
# The warp-specialised dQ pass (gluon/dq.py, E42): the forward's K/V ring and loader, dP = dO V^T
# and dQ += dS K in the consumers; after the dK/dV pass above, for the same calls.
# With a bias one bias slot: Q, dO, the K/V ring and a (128, 128) bias tile fill 224 of the 227 KiB
# of shared memory (64-key tiles with two or three bias slots ran 0.81x, E50).
WS_DQ_CONFIGS = {128: WsConfig(bias_stages=1), 64: WsConfig()}


# Under TRITON_INTERPRET=1 (CPU) there is no shared memory and no warps: small,
# deliberately asymmetric tiles so that the small test shapes cross several tiles.
INTERPRETER_CONFIGS = {
    FWD: KernelConfig(32, 16, 1, 1, subtiles=2),  # forced tiles (tests) run the one-tile path
    BWD_DKDV: KernelConfig(16, 32, 1, 1),
    BWD_DQ: KernelConfig(32, 16, 1, 1),
    BWD_DV: KernelConfig(16, 32, 1, 1),
    BWD_DK: KernelConfig(32, 16, 1, 1),
}


def wide_backward(block_dqk: int, block_dv: int, dtype: torch.dtype) -> bool:
    """Padded head dims > 256 in 16-bit dtypes (E108): the backward computes dP apart from the other
    products' warp layout (DP_IN_BRANCH) and splits the dK/dV pass where SPLIT_KINDS have entries.
    float32 keeps one dK/dV pass (its small fallback tiles; its scores must match bit for bit, issue 38)."""
    return max(block_dqk, block_dv) > 256 and dtype in _HALF


def block_d(head_dim: int) -> int:
    """Head dim padded to the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << max(0, int(head_dim) - 1).bit_length())


def shared_memory_estimate(kind: str, cfg: KernelConfig, block_dqk: int, block_dv: int, elem_size: int) -> int:
    """Rough shared-memory bytes of one program (operand tiles x pipeline stages)."""
    bm, bn, st = cfg.block_m, cfg.block_n, max(1, cfg.num_stages)
    if kind == FWD:
        return (bm * block_dqk + st * bn * (block_dqk + block_dv)) * elem_size
    if kind == BWD_DV:  # K stays; Q and dO stream
        return (bn * block_dqk + st * bm * (block_dqk + block_dv)) * elem_size + bm * bn * elem_size
    if kind in (BWD_DKDV, BWD_DK):
        return (bn * (block_dqk + block_dv) + st * bm * (block_dqk + block_dv)) * elem_size + 2 * bm * bn * elem_size
    if kind == BWD_DQ:
        return (bm * (block_dqk + block_dv) + st * bn * (block_dqk + block_dv)) * elem_size + bm * bn * elem_size
    raise ValueError(f"unknown kernel kind {kind!r}")


def candidate_configs(
    kind: str,
    head_dim_qk: int,
    head_dim_v: int,
    dtype: torch.dtype,
    cc: tuple[int, int],
    smem_limit: int,
    banded: bool = False,
    extras: bool = False,
    grouped: bool = False,
) -> list[KernelConfig]:
    """All table entries that match and fit, best first (like PyTorch's candidate loop).
    ``banded``: the call is causal or windowed; ``extras``: it has a bias, a mask or dropout;
    ``grouped``: query heads share kv heads (GQA / MQA).  Entries may be reserved for either
    side of each."""
    return list(
        _candidates(
            kind, head_dim_qk, head_dim_v, dtype, tuple(cc), smem_limit, bool(banded), bool(extras), bool(grouped)
        )
    )


@functools.lru_cache(maxsize=1024)  # pure function of hashable facts; called on every launch
def _candidates(
    kind: str,
    head_dim_qk: int,
    head_dim_v: int,
    dtype: torch.dtype,
    cc: tuple[int, int],
    smem_limit: int,
    banded: bool,
    extras: bool,
    grouped: bool,
) -> tuple[KernelConfig, ...]:
    bdq, bdv = block_d(head_dim_qk), block_d(head_dim_v)
    bd = max(bdq, bdv)
    esize = torch.empty((), dtype=dtype).element_size()
    out: list[KernelConfig] = []
    for e in CONFIG_TABLE:
        if e.kind != kind or not (e.min_cc <= tuple(cc) <= e.max_cc):
            continue
        if bd > e.max_block_d or dtype not in e.dtypes:
            continue
        if not e.serves(banded, extras, grouped):
            continue
        if shared_memory_estimate(kind, e.config, bdq, bdv, esize) > smem_limit:
            continue
        if e.config not in out:
            out.append(e.config)
    return tuple(out)


def static_reason(head_dim_qk: int, head_dim_v: int, dtype: torch.dtype) -> str | None:
    """Device-independent limits: dtype and head dims."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype={dtype} not in (float16, bfloat16, float32)"
    for name, d in (("head_dim_qk", head_dim_qk), ("head_dim_v", head_dim_v)):
        if d > MAX_HEAD_DIM:
            return f"{name}={d} > {MAX_HEAD_DIM}"
        if d < MIN_HEAD_DIM:
            return f"{name}={d} < {MIN_HEAD_DIM}"
    return None


def arch_reason(
    head_dim_qk: int, head_dim_v: int, dtype: torch.dtype, cc: tuple[int, int], smem_limit: int
) -> str | None:
    """Reason why no configuration of some kernel kind fits this GPU, or None."""
    r = static_reason(head_dim_qk, head_dim_v, dtype)
    if r:
        return r
    if tuple(cc) < MIN_COMPUTE_CAPABILITY:
        return f"compute capability {cc[0]}.{cc[1]} < {MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}"
    if dtype == torch.bfloat16 and tuple(cc) < BF16_MIN_COMPUTE_CAPABILITY:
        return f"bfloat16 needs compute capability >= 8.0 (device has {cc[0]}.{cc[1]})"
    for kind in KINDS:
        if not candidate_configs(kind, head_dim_qk, head_dim_v, dtype, cc, smem_limit):
            bdq, bdv = block_d(head_dim_qk), block_d(head_dim_v)
            esize = torch.empty((), dtype=dtype).element_size()
            need = min(
                (shared_memory_estimate(kind, e.config, bdq, bdv, esize) for e in CONFIG_TABLE if e.kind == kind),
                default=0,
            )
            return (
                f"no {kind} kernel configuration for head_dim=({head_dim_qk}, {head_dim_v}) {dtype} "
                f"fits sm_{cc[0]}{cc[1]} shared memory ({smem_limit} bytes; smallest needs ~{need})"
            )
    return None
