"""A call's shapes and strides as the kernels take them (dense or varlen), and the small
argument helpers every launch shares: constexprs, dtypes, grid chunks, row layouts."""

from __future__ import annotations

import functools

import torch

from . import configs as C
from .device import is_interpreter
from .limits import MAX_GRID_YZ
from .params import KernelParams

# Under the CPU interpreter, keep P and dS in fp32 for the second matmuls of fp16/bf16
# inputs (the interpreter is a correctness harness: its half-precision results then match
# PyTorch's CPU math path, which upcasts).  False reproduces the GPU rounding exactly.
INTERPRETER_FP32_PRODUCTS = True


class KernelShapes:
    """Shapes and strides of one call (dense or varlen), normalised for the kernels."""

    def __init__(self, q, k, v, cu_q, cu_k, max_sq, max_sk):
        self.varlen = cu_q is not None
        if self.varlen:
            if cu_k is None or q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
                raise ValueError("varlen: query/key/value must be (total, H, D) with cu_seqlens_q and cu_seqlens_k")
            self.B = cu_q.numel() - 1
            self.Hq, self.Dqk = q.shape[1], q.shape[2]
            self.Hkv, self.Dv = k.shape[1], v.shape[2]
            if max_sq is None or max_sk is None:
                raise ValueError("varlen: max_seqlen_q and max_seqlen_k are required (python ints)")
            self.Sq, self.Sk = int(max_sq), int(max_sk)
            self.q_strides = (0, q.stride(1), q.stride(0))
            self.k_strides = (0, k.stride(1), k.stride(0))
            self.v_strides = (0, v.stride(1), v.stride(0))
            self.out_shape = (q.shape[0], self.Hq, self.Dv)
            self.lse_shape = (q.shape[0], self.Hq)
            self.total_q = q.shape[0]
        else:
            if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
                raise ValueError("dense: query/key/value must be (B, H, S, D)")
            self.B, self.Hq, self.Sq, self.Dqk = q.shape
            self.Hkv, self.Sk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
            self.q_strides = q.stride()[:3]
            self.k_strides = k.stride()[:3]
            self.v_strides = v.stride()[:3]
            self.out_shape = (self.B, self.Hq, self.Sq, self.Dv)
            self.lse_shape = (self.B, self.Hq, self.Sq)
            if k.shape[0] != self.B or v.shape[0] != self.B or v.shape[2] != self.Sk or v.shape[1] != self.Hkv:
                raise ValueError(f"inconsistent shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
        if k.shape[-1] != self.Dqk:
            raise ValueError(f"key head dim {k.shape[-1]} != query head dim {self.Dqk}")
        if self.Hkv == 0 or self.Hq % self.Hkv != 0:
            if not (self.Hq == 0 and self.Hkv == 0):
                raise ValueError(f"query heads {self.Hq} not a multiple of key/value heads {self.Hkv}")
        self.group = self.Hq // self.Hkv if self.Hkv else 1

    def lse_strides(self):
        if self.varlen:
            return (0, 1, self.Hq)
        return (self.Hq * self.Sq, self.Sq, 1)

    def out_strides(self, o):
        if self.varlen:
            return (0, o.stride(1), o.stride(0))
        return (o.stride(0), o.stride(1), o.stride(2))

    def empty(self) -> bool:
        if self.varlen:
            return self.B == 0 or self.Hq == 0 or self.total_q == 0 or self.Sq == 0
        return self.B == 0 or self.Hq == 0 or self.Sq == 0 or self.Sk == 0


def check_inputs(q, k, v):
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query/key/value dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    r = C.static_reason(q.shape[-1], v.shape[-1], q.dtype)
    if r:
        raise ValueError(r)


def last_dim_contiguous(t):
    if t is None:
        return None
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return t


def common_constexprs(q, params, prob):
    """Constexpr arguments shared by every kernel of a call (memoised: built on every launch)."""
    return _common_constexprs_of(
        q.dtype,
        prob.Dqk,
        prob.Dv,
        prob.varlen,
        bool(params.align_bottom_right),
        params.window_left >= 0,
        params.window_right >= 0,
        INTERPRETER_FP32_PRODUCTS,
    )


@functools.lru_cache(maxsize=256)
def _common_constexprs_of(dtype, dqk, dv, varlen, align_br, has_wl, has_wr, fp32_products):
    interp = is_interpreter()
    return dict(
        HEAD_DQK=dqk,
        HEAD_DV=dv,
        IS_VARLEN=varlen,
        ALIGN_BR=align_br,
        HAS_WL=has_wl,
        HAS_WR=has_wr,
        BLOCK_DQK=C.block_d(dqk),
        BLOCK_DV=C.block_d(dv),
        DOT_UPCAST=interp and dtype != torch.float32,
        DOT_IEEE=dtype == torch.float32,
        ROUND_P=not (interp and fp32_products),
    )


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest even):
    there, bf16 results are written as fp32 and rounded by torch on the host."""
    return torch.float32 if dtype == torch.bfloat16 and is_interpreter() else dtype


def grid_limit(params: KernelParams) -> int:
    return params.max_grid or MAX_GRID_YZ


def cdiv(a: int, b: int) -> int:
    # triton.cdiv is a ConstexprFunction in recent Triton: ~6 us per host-side call (3.9, CPU)
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << max(0, n - 1).bit_length()


def bh_chunks(n: int, inner: int, limit: int):
    """Split the flattened (batch x heads) grid axis of length n into launches of at most
    `limit` programs; chunks are whole batches (multiples of `inner`) when inner <= limit.
    Yields (start, count)."""
    step = (limit // inner) * inner if inner <= limit else limit
    step = max(1, step)
    start = 0
    while start < n:
        cnt = min(step, n - start)
        yield start, cnt
        start += cnt


def rows_layout(*tensors, strided: bool = False) -> int:
    """1: every tensor is (B, H, S, D) in memory (contiguous), 2: (B, S, H, D) memory seen as
    (B, H, S, D), the layout of a model that keeps tokens first; 0: anything else.
    ``strided``: a slice of such a tensor's rows (S) counts too (see :func:`seq_rows`)."""
    if all(t.is_contiguous() for t in tensors):
        return 1
    if all(t.transpose(1, 2).is_contiguous() for t in tensors):
        return 2
    for layout in (1, 2) if strided else ():
        if all(seq_rows(t, layout) is not None for t in tensors):
            return layout
    return 0


def seq_rows(t: torch.Tensor, layout: int) -> int | None:
    """The rows between two sequences' first rows in the matrix of rows layout ``layout`` of
    ``t`` (B, H, S, D): S where ``t`` is that layout, more where it is a slice of a longer
    one's rows (a block's rows of a rank's shard); None where its memory is not such rows.
    Sequences are (b, h) pairs in layout 1, batches in layout 2 (rows of H * D)."""
    B, H, S, D = t.shape
    sb, sh, ss, sd = t.stride()
    width = D if layout == 1 else H * D
    if width == 0 or (sd != 1 and D > 1):
        return None
    if layout == 1:
        if S > 1 and ss != D:
            return None
        # a size-1 dim's stride says nothing
        apart = sh if H > 1 else sb if B > 1 else S * D
        if B > 1 and H > 1 and sb != H * sh:
            return None
    else:
        if (H > 1 and sh != D) or (S > 1 and ss != width):
            return None
        apart = sb if B > 1 else S * width
    if apart % width or apart < S * width:
        return None
    return apart // width


def row_matrix(t: torch.Tensor, layout: int) -> tuple[int, int]:
    """(rows, row length) of ``t`` (B, H, S, D) seen as the matrix of its rows layout (see
    rows_layout): (B * H * S, D) for 1, (B * S, H * D) for 2 (a head's columns at h * D); a
    slice of a longer tensor's rows spans from its first row to its last (:func:`seq_rows`)."""
    B, H, S, D = t.shape
    seqs, width = (B * H, D) if layout == 1 else (B, H * D)
    return (seqs - 1) * seq_rows(t, layout) + S, width
