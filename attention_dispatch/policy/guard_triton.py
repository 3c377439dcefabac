"""The numerics guard's sampled check of a dense 16-bit call as one Triton kernel
(kernels/tl/guard_check.py): the same rows, rule and verdict as guard_rows.measure(), in 3
device ops (the picks' copy, the kernel, the payload's copy to the host) instead of ~30 small
ones, with no gathered or float64 copies of the keys; each row's keys split across programs.  Calls with a mask, ALiBi, softcap, sinks,
a returned lse, dropout, varlen or other dtypes keep guard_rows' path; so does every call after
the kernel failed to build (logged once)."""

from __future__ import annotations

import contextlib
import logging

import torch

from ..semantics import band
from . import guard_rows as _rows

logger = logging.getLogger("attention_dispatch")

_broken: list[str] = []  # why the kernel is off for this process (its build failed)
MAX_HEAD_DIM = 256
# keys a program (kernels/tl/guard_check.py): Sk / 64 programs a row fill the GPU; half for head dims over 128
BLOCK_N = 64


def _pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def supported(query, key, value, options: dict, out, lse, keep) -> bool:
    """A dense bf16/fp16 call whose rows the kernel computes (see the module doc)."""
    if _broken or query.dtype not in (torch.bfloat16, torch.float16) or lse is not None or keep is not None:
        return False
    if not key.dtype == value.dtype == out.dtype == query.dtype or query.dim() != 4:
        return False
    features = ("cu_seqlens_q", "attn_mask", "alibi_slopes", "softcap", "sinks")
    if any(options.get(name) is not None for name in features) or options["dropout_p"] > 0:
        return False
    return max(query.shape[-1], value.shape[-1]) <= MAX_HEAD_DIM


def block_n(d: int, dv: int) -> int:
    """Keys a program: BLOCK_N, half of it where a head dim passes 128 (its tiles in registers)."""
    return BLOCK_N if max(d, dv) <= 128 else max(BLOCK_N // 2, 16)


def payload(query, key, value, options: dict, out, columns) -> torch.Tensor | None:
    """guard.payload()'s float64 tensor for a supported call (columns: guard_rows.dense_columns'
    host picks): [output error, base, then the rows' batch, head, row]; None if the kernel fails
    to build (then never again in this process) or its partials would pass guard_rows.CHUNK_ELEMENTS."""
    n, sk = len(columns[0]), key.shape[2]
    d, dv = query.shape[-1], value.shape[-1]
    block = block_n(d, dv)
    splits = -(-sk // block) or 1
    if n * splits * (4 + 2 * dv) > _rows.CHUNK_ELEMENTS:  # its scratch: the torch path goes in chunks
        return None
    host = torch.tensor([0.0, 0.0, *(x for c in columns for x in c), options["scale"], *[0.0] * n], dtype=torch.float64)
    buf = host if query.device.type == "cpu" else host.pin_memory().to(query.device, non_blocking=True)
    parts = torch.empty((n, splits, 4 + 2 * dv), dtype=torch.float64, device=query.device)  # the kernel's own
    _, left, right = band(options["causal"], options["window"])
    try:
        from ..kernels.tl.guard_check import _guard_check  # Triton: imported on the first check

        on_device = torch.cuda.device(query.device) if query.device.type == "cuda" else contextlib.nullcontext()
        with on_device:  # Triton launches on the current device: the call's may be another
            _guard_check[(n, splits)](
                query, key, value, out, buf, buf.view(torch.int64), parts,
                *query.stride(), *key.stride(), *value.stride(), *out.stride(),
                n, sk, d, dv, splits,
                HAS_LO=left >= 0, HAS_HI=right >= 0, IS_BF16=query.dtype == torch.bfloat16,
                BLOCK_N=block, BLOCK_P=16, BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), num_warps=8,
            )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - no Triton, or its compiler's error: the torch path checks the call
        _broken.append(repr(exc))
        logger.warning("numerics guard: its one-kernel check is off (torch ops instead): %s", exc)
        return None
    return buf[: 2 + 3 * n]
