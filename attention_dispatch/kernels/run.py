"""Running a kernel: the configuration table's candidates for a call (config_reason,
select_config) and the launch loop that takes the first candidate fitting the device.

Every kernel launch goes through :func:`launch_one` (tests replace it to watch launches)."""

from __future__ import annotations

import torch

from ..caches import register_cache
from . import configs as C
from .compiled_cache import COMPILED
from .device import SMEM_BY_CC, device_info, is_interpreter, run_with_scratch
from .params import KernelParams
from .shapes import KernelShapes


def config_reason(
    head_dim_qk: int, head_dim_v: int, dtype: torch.dtype, device, compute_capability: tuple[int, int] | None = None
) -> str | None:
    """Why the kernel cannot run this (head dims, dtype, device), or None when it can.

    ``device``: a torch.device or a device string/type ("cuda", "cuda:1", "cpu");
    ``compute_capability``: optional, else queried from the device."""
    r = C.static_reason(head_dim_qk, head_dim_v, dtype)
    if r:
        return r
    device = torch.device(device)
    if device.type == "cpu":
        if not is_interpreter():
            return "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
        return None
    if device.type != "cuda":
        return f"device type {device.type!r} not supported (cuda, or cpu under TRITON_INTERPRET=1)"
    if getattr(torch.version, "hip", None):
        return "ROCm is not supported by this kernel's configuration table"
    if is_interpreter():
        return None
    if torch.cuda.is_available():
        cc, smem, _ = device_info(device)
        if compute_capability is not None and tuple(compute_capability) != cc:
            cc = tuple(compute_capability)
            smem = SMEM_BY_CC.get(cc, 99 * 1024)
    elif compute_capability is not None:
        cc = tuple(compute_capability)
        smem = SMEM_BY_CC.get(cc, 99 * 1024)
    else:
        return "no CUDA device"
    return C.arch_reason(head_dim_qk, head_dim_v, dtype, cc, smem)


def select_config(
    kind: str,
    head_dim_qk: int,
    head_dim_v: int,
    dtype: torch.dtype,
    device,
    params: KernelParams | None = None,
    extras: bool = False,
    grouped: bool = False,
) -> list[C.KernelConfig]:
    """Candidate configurations, best first (a forced block_m/block_n replaces the tiles, in
    one tile: no sub-tiles).  ``extras``: a bias, mask or dropout; ``grouped``: GQA / MQA."""
    cands = table_candidates(kind, head_dim_qk, head_dim_v, dtype, device, params, extras, grouped)
    if not cands:
        cc, smem, _ = device_info(device)
        raise RuntimeError(C.arch_reason(head_dim_qk, head_dim_v, dtype, cc, smem) or f"no {kind} configuration")
    if params is not None and (params.block_m or params.block_n):
        cands = list(
            dict.fromkeys(
                C.KernelConfig(params.block_m or c.block_m, params.block_n or c.block_n, c.num_warps, c.num_stages)
                for c in cands
            )
        )
    return cands


def table_candidates(
    kind: str,
    head_dim_qk: int,
    head_dim_v: int,
    dtype: torch.dtype,
    device,
    params: KernelParams | None = None,
    extras: bool = False,
    grouped: bool = False,
) -> list[C.KernelConfig]:
    """The table's entries for the call that fit the device, best first ([] when none; the
    interpreter's fixed tiles on the CPU): :func:`select_config` without forced tiles."""
    if is_interpreter() or torch.device(device).type != "cuda":
        return [C.INTERPRETER_CONFIGS[kind]]
    cc, smem, _ = device_info(device)
    banded = params is not None and (params.window_left >= 0 or params.window_right >= 0)
    return C.candidate_configs(kind, head_dim_qk, head_dim_v, dtype, cc, smem, banded, extras, grouped)


CHOSEN: dict = {}
register_cache("kernels.run.chosen_configs", CHOSEN.clear, CHOSEN.__len__)


def table_traits(bias_kind: int, params: KernelParams, prob: KernelShapes) -> dict:
    """What the config table keys a call on besides dtype, head dims and band (which
    select_config reads from params), the same for every pass: ``extras`` (a bias, a mask or
    dropout) and ``grouped`` (GQA / MQA)."""
    return dict(extras=bias_kind != 0 or params.dropout_p > 0, grouped=prob.group > 1)


def out_of_resources(e: Exception) -> bool:
    return type(e).__name__ in ("OutOfResources", "OutOfResourcesError") or "out of resource" in str(e).lower()


def launch_one(kernel, grid, args, constexprs, num_warps, num_stages, **options):
    """One launch: compiled kernels are relaunched directly (compiled_cache.py); the
    interpreter always goes through Triton."""
    if is_interpreter():
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **options)
    else:
        COMPILED.launch(kernel, grid, args, constexprs, num_warps, num_stages, **options)


def launch_first_fitting(kind, kernel, grid, args, kw, cands, key, tail=None):
    """Launch with the first candidate that compiles within the device's resources
    (PyTorch-style loop over candidate kernels); the winner is remembered per key and
    constexpr values (a bias tile or dropout changes what fits).  ``tail(cfg)``: the
    (last positional arguments, their constexprs) that depend on the candidate beyond its
    tiles (the forward's sub-tiles and host-built descriptors)."""
    key = key + (tuple(cands), tuple(kw.values()))
    start = CHOSEN.get(key, 0)
    last = None
    for idx in range(start, len(cands)):
        cfg = cands[idx]
        try:
            constexprs = dict(kw, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
            cfg_args = args
            if tail is not None:
                extra_args, extra_kw = tail(cfg)
                cfg_args = args + extra_args
                constexprs.update(extra_kw)
            run_with_scratch(
                args[0].device,
                kw.get("USE_DESC", False),
                launch_one,
                kernel,
                grid(cfg),
                cfg_args,
                constexprs,
                cfg.num_warps,
                cfg.num_stages,
            )
            CHOSEN[key] = idx
            return cfg
        except Exception as e:  # noqa: BLE001
            if not out_of_resources(e):
                raise
            last = e
    raise RuntimeError(f"no {kind} configuration fits this device: {last}")
