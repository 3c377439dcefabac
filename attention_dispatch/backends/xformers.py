"""xformers' ``memory_efficient_attention`` with its ``attn_bias`` types.

Mapping of our call (DESIGN.md section 3):

- layouts: ours (B, H, S, D) -> xformers' BMHK (B, S, H, D) by ``transpose(1, 2)`` (a view);
  GQA -> BMGHK: query viewed as (B, S, Hkv, Hq/Hkv, D), key/value expanded (stride 0,
  no copy) to the same 5-D shape, so query head h reads kv head h // (Hq / Hkv).
- no mask: causal top-left -> ``LowerTriangularMask``; bottom-right ->
  ``LowerTriangularFromBottomRightMask``; a window -> ``LocalAttentionFromBottomRightMask``
  (``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; an unbounded side becomes Sq + Sk).
  A top-left window with Sq != Sk has no xformers type: rejected.
- a mask: bool -> float bias (0 / -inf, query's dtype); causal and window are folded in as
  -inf; passed as a tensor bias expanded to (B, H, Sq, Sk) (padded to a multiple of 8
  columns when xformers' row alignment needs it). Its gradient flows when it requires grad.
- a band xformers' types cannot run exactly goes as a tensor bias (one (Sq, Sk) matrix, expanded):
  rows without an allowed key (e.g. bottom-right causal with Sq > Sk), whose result xformers
  leaves unspecified, and a float32 window (float32 runs on cutlass only, which has no two-sided
  local mask and no backward for its causal one). ``route()`` says which form a call takes.
- rows without an allowed key in a tensor bias get a neutral bias inside the kernel and output 0
  (gradient 0 everywhere).
- an empty dimension: exact zeros on the graph, no kernel (xformers refuses some such shapes).
- varlen: ``BlockDiagonalMask`` / ``BlockDiagonalCausalMask`` (top-left per sequence) /
  ``BlockDiagonalCausalLocalAttentionMask`` (top-left window, right = 0) from the
  sequence lengths, on (1, total, H, D); bottom-right causal and masks are rejected.
- dropout: rejected (xformers' RNG is not PyTorch's generator, so DESIGN.md's
  repeatability rule cannot be promised); no deterministic backward.
- xformers' own dispatcher decides whether an operator exists: its "No operator found"
  answer (per operator, the reasons) becomes our rejection reasons in ``check()``.
- ``import xformers`` failing (an ABI mismatch with this PyTorch, or xformers tripping over
  a ``flash_attn`` package without ``flash_attn_interface``) makes the backend unavailable
  with the error's first line; so does an xformers that imports but finds no operator for a
  plain bfloat16 call (its C++/CUDA extensions built for another PyTorch or CUDA load with
  only a warning, and then every operator is refused).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re

import torch

from ..higher_order import refuse_create_graph_through
from ..problem import Problem
from ..route import Route, RouteStep
from ..semantics import CausalKind, band
from .base import Backend, Capabilities
from .empty import empty_attention, is_empty
from .window_clamp import right_bound_cut

INSTALL_HINT = "not installed: pip install xformers"
PROBE_DEVICE = "cuda"  # where unavailable_reason() asks xformers' dispatcher about a plain call


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def dispatch_backward(dispatch, inp, forward_op):
    """xformers' private ``fmha.dispatch._dispatch_bw``, the one place we call it: from 0.0.28 it
    takes ``(inp, varlen_lse_packed)``, the forward operator's LSE layout (earlier: ``(inp)``)."""
    bw = dispatch._dispatch_bw
    if len(inspect.signature(bw).parameters) >= 2:
        return bw(inp, getattr(forward_op, "VARLEN_LSE_PACKED", None))
    return bw(inp)


def _dense_empty_rows(sq: int, sk: int, causal, window) -> bool:
    """True when some query row of a dense (Sq, Sk) band has no allowed key."""
    if causal is None and window is None:
        return False
    bottom_right, left, right = band(causal, window)
    off = sk - sq if bottom_right else 0
    first_hi = off + right if right >= 0 else math.inf  # row 0, last allowed key
    last_lo = sq - 1 + off - left if left >= 0 else -math.inf  # last row, first allowed key
    return sq > 0 and (first_hi < 0 or last_lo > sk - 1)


def band_as_tensor(sq: int, sk: int, causal, window, dtype) -> str:
    """Why a dense call's band (no mask) goes to xformers as a tensor bias, "" when one of its mask
    types runs it exactly."""
    if _dense_empty_rows(sq, sk, causal, window):
        return "rows without an allowed key, which xformers' mask types leave unspecified"
    if window is not None and dtype == torch.float32:
        return "float32 runs on cutlass only, which has no two-sided local mask (nor a backward for its causal one)"
    return right_bound_cut(sq, sk, causal, window, "xformers' half-precision operator (flash-attn 2)")


def _strides_taken(t) -> bool:
    """Strides xformers' kernels take as they are: a unit last one, the others multiples of 8 elements
    (its operators' alignment; the dispatcher is asked on stride-0 stand-ins, so run() copies the rest)."""
    strides = t.stride()
    if strides[-1] == 1 and all(s % 8 == 0 for s in strides[:-1]):
        return True
    fresh, step = [], 1  # a clone's strides: cloning a tensor that has them changes nothing
    for size in reversed(t.shape):
        fresh.append(step)
        step *= size
    return strides == tuple(reversed(fresh))


def _varlen_rows_with_a_key(cu_seqlens_q, lq: list, lk: list, left: int):
    """A varlen call's (total_q, 1, 1) rows that have an allowed key, or None when all do (from the lengths
    attn_bias reads anyway). Keyless: the rows of a sequence without keys and, with a top-left window
    (left, 0), local rows i >= Sk + left. xformers leaves their output and gradient unspecified."""
    limits = [0 if k == 0 else (k + left if left >= 0 else q) for q, k in zip(lq, lk)]
    if all(q <= limit for q, limit in zip(lq, limits)):
        return None
    device, total = cu_seqlens_q.device, sum(lq)
    lengths = torch.tensor(lq, device=device)
    local = torch.arange(total, device=device) - torch.repeat_interleave(
        cu_seqlens_q[:-1].long(), lengths, output_size=total
    )
    limit = torch.repeat_interleave(torch.tensor(limits, device=device), lengths, output_size=total)
    return (local < limit)[:, None, None]


def _varlen_mask_type(causal, window) -> str:
    """The block-diagonal xformers mask type a varlen call maps to (top-left per sequence)."""
    if causal is None:
        return "BlockDiagonalMask"
    return "BlockDiagonalCausalMask" if window is None else "BlockDiagonalCausalLocalAttentionMask"


def _mask_type(causal, window) -> str:
    """The xformers mask type a dense band without a mask maps to."""
    if window is not None:
        return "LocalAttentionFromBottomRightMask"
    if causal is None:
        return "none"
    return "LowerTriangularMask" if causal is CausalKind.TOP_LEFT else "LowerTriangularFromBottomRightMask"


def parse_no_operator(message: str) -> list[str]:
    """xformers' "No operator found ..." message -> one reason per operator."""
    reasons: list[str] = []
    op, items = None, []
    for line in message.splitlines():
        m = re.match(r"\s*`([^`]+)` is not supported because:", line)
        if m:
            if op:
                reasons.append(f"xformers {op}: {'; '.join(items) or 'not supported'}")
            op, items = m.group(1), []
        elif op and line.strip():
            items.append(line.strip())
    if op:
        reasons.append(f"xformers {op}: {'; '.join(items) or 'not supported'}")
    return reasons or [f"xformers: {message.strip().splitlines()[0] if message.strip() else 'no operator found'}"]


class XformersBackend(Backend):
    """xformers.ops.memory_efficient_attention."""

    name = "xformers"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        causal_kinds=frozenset(CausalKind),
        window=True,
        bool_mask=True,
        float_bias=True,
        bias_grad=True,
        float32_bias=False,  # attn_bias must have the query's dtype
        mask_with_causal=True,
        dropout=False,
        varlen=True,
        gqa=True,
        deterministic_backward=False,
        notes="operators and their limits decided by xformers' own dispatcher",
    )

    def __init__(self):
        self._mods = None
        self._error = None
        self._no_operator: str | None = None  # unavailable_reason's dispatcher probe, once
        self._verdicts: dict = {}

    # -- importing ----------------------------------------------------------------
    def _load(self):
        if self._mods is None and self._error is None:
            try:
                xformers = importlib.import_module("xformers")
                ops = importlib.import_module("xformers.ops")
                fmha = importlib.import_module("xformers.ops.fmha")
                attn_bias = importlib.import_module("xformers.ops.fmha.attn_bias")
                self._mods = (xformers, ops, fmha, attn_bias)
            except ModuleNotFoundError as e:
                self._error = INSTALL_HINT if e.name == "xformers" else "import failed: " + _first_line(e)
            except Exception as e:  # ABI mismatch ("undefined symbol"), flash_attn without flash_attn_interface...
                self._error = "import failed: " + _first_line(e)
        return self._mods

    def is_available(self) -> bool:
        return not self.unavailable_reason()

    def unavailable_reason(self) -> str:
        if self._load() is None:
            return self._error or INSTALL_HINT
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        if self._no_operator is None:
            self._no_operator = self._plain_call_refused()
        return self._no_operator

    def _plain_call_refused(self) -> str:
        """xformers' dispatcher asked once for a plain bfloat16 (1, 128, 1, 64) call: "" when an operator
        takes it, else why none does."""
        fmha = self._load()[2]
        q = torch.empty(1, dtype=torch.bfloat16, device=PROBE_DEVICE).expand(1, 128, 1, 64)
        try:
            fmha.dispatch._dispatch_fw(fmha.Inputs(query=q, key=q, value=q, attn_bias=None, p=0.0, scale=None), False)
            return ""
        except NotImplementedError as e:
            reasons = "; ".join(parse_no_operator(str(e)))
        except Exception as e:
            reasons = _first_line(e)
        return (
            f"xformers {self.version()} has no operator for a plain bfloat16 call ({reasons}); "
            "`python -m xformers.info` says whether its C++/CUDA extensions loaded"
        )

    def version(self) -> str:
        mods = self._load()
        return str(getattr(mods[0], "__version__", "")) if mods else ""

    # -- building xformers' arguments ---------------------------------------------
    def attn_bias(
        self,
        *,
        batch,
        heads_q,
        heads_kv,
        sq,
        sk,
        causal,
        window,
        mask,
        dtype,
        device,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
    ):
        """(attn_bias for xformers, row_ok or None): the bias object or tensor of one call."""
        ab = self._load()[3]
        if cu_seqlens_q is not None:
            lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
            lk = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
            left = -1 if causal is None else band(causal, window)[1]
            kind = _varlen_mask_type(causal, window)
            extra = {} if left < 0 else dict(window_size=left + 1)
            bias = getattr(ab, kind).from_seqlens(q_seqlen=lq, kv_seqlen=lk, **extra)
            return bias, _varlen_rows_with_a_key(cu_seqlens_q, lq, lk, left)
        if mask is None and band_as_tensor(sq, sk, causal, window, dtype):
            mask = torch.zeros((), dtype=dtype, device=device).expand(sq, sk)  # the band is folded in below
        if mask is None:
            kind = _mask_type(causal, window)
            if kind == "none":
                return None, None
            if window is None:
                return getattr(ab, kind)(), None
            _, left, right = band(causal, window)
            big = sq + sk
            return ab.LocalAttentionFromBottomRightMask(
                window_left=left if left >= 0 else big, window_right=right if right >= 0 else big
            ), None
        # a tensor bias: bool -> 0/-inf, band folded in, empty rows neutralised
        if mask.dtype == torch.bool:
            mask = torch.zeros((), dtype=dtype, device=device).masked_fill(~mask, -math.inf)
        if causal is not None or window is not None:
            bottom_right, left, right = band(causal, window)
            off = sk - sq if bottom_right else 0
            i = torch.arange(sq, device=device).unsqueeze(1) + off
            j = torch.arange(sk, device=device).unsqueeze(0)
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
            if left >= 0:
                allowed &= j >= i - left
            if right >= 0:
                allowed &= j <= i + right
            mask = mask.masked_fill(~allowed, -math.inf)
        row_ok = (mask > -math.inf).any(-1, keepdim=True)
        mask = torch.where(row_ok, mask, torch.zeros((), dtype=mask.dtype, device=mask.device))
        if mask.shape[-1] == sk and mask.stride(-2) % 8 and mask.stride(-2) != 0:
            pad = (-sk) % 8
            mask = torch.nn.functional.pad(mask, (0, pad))[..., :sk]
        mask = mask.expand(batch, heads_q, sq, sk)
        if heads_kv != heads_q:
            mask = mask.unflatten(1, (heads_kv, heads_q // heads_kv))
        return mask, row_ok

    @staticmethod
    def layout(query, key, value, packed: bool):
        """BMHK (or BMGHK for GQA) views of our tensors."""
        if packed:
            q, k, v = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        else:
            q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        hq, hkv = q.shape[2], k.shape[2]
        if hq != hkv:
            g = hq // hkv
            q = q.unflatten(2, (hkv, g))
            k = k.unsqueeze(3).expand(k.shape[0], k.shape[1], hkv, g, k.shape[-1])
            v = v.unsqueeze(3).expand(v.shape[0], v.shape[1], hkv, g, v.shape[-1])
        return q, k, v

    # -- decisions ----------------------------------------------------------------
    def check(self, problem: Problem) -> list[str]:
        p = problem
        reasons = []
        if p.layout == "varlen":
            if p.mask_kind != "none":
                reasons.append("attn_mask with varlen not supported (xformers' block-diagonal biases carry no tensor)")
            if p.causal is CausalKind.BOTTOM_RIGHT:
                reasons.append(
                    "causal=bottom_right with varlen not supported (rows without keys in sequences "
                    "with Sq > Sk are unspecified in xformers)"
                )
            if p.window is not None and p.causal is None:
                reasons.append(f"window={p.window} without causal in varlen not supported")
        else:
            if (
                p.window is not None
                and p.causal is CausalKind.TOP_LEFT
                and p.seqlen_q != p.seqlen_k
                and p.mask_kind == "none"
            ):
                reasons.append(
                    f"window with causal=top_left and Sq={p.seqlen_q} != Sk={p.seqlen_k} has no xformers mask type"
                )
        if reasons or self._load() is None:
            return reasons
        return self.operator_reasons(p)

    def operator_reasons(self, p: Problem) -> list[str]:
        """xformers' own dispatcher asked on stand-in tensors of the problem's shape (no memory)."""
        if p in self._verdicts:
            return self._verdicts[p]
        if 0 in (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim_qk, p.head_dim_v):
            return []  # run() returns zeros without asking xformers
        _, _, fmha, _ = self._load()
        device = torch.device(p.device_type)
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("meta")

        def stand_in(*shape):
            return torch.empty(1, dtype=p.dtype, device=device).expand(*shape)

        varlen = p.layout == "varlen"
        if varlen:
            total_q, total_k = p.batch * p.seqlen_q, p.batch * p.seqlen_k
            q, k, v = (
                stand_in(total_q, p.heads_q, p.head_dim_qk),
                stand_in(total_k, p.heads_kv, p.head_dim_qk),
                stand_in(total_k, p.heads_kv, p.head_dim_v),
            )
            cu_q = torch.arange(0, total_q + 1, max(p.seqlen_q, 1), dtype=torch.int32)[: p.batch + 1]
            cu_k = torch.arange(0, total_k + 1, max(p.seqlen_k, 1), dtype=torch.int32)[: p.batch + 1]
        else:
            q = stand_in(p.batch, p.heads_q, p.seqlen_q, p.head_dim_qk)
            k = stand_in(p.batch, p.heads_kv, p.seqlen_k, p.head_dim_qk)
            v = stand_in(p.batch, p.heads_kv, p.seqlen_k, p.head_dim_v)
            cu_q = cu_k = None
        mask = None
        if p.mask_kind != "none":  # bool masks become a float bias in run(): stand in with one
            leaf = torch.empty(1, dtype=p.dtype, device=device, requires_grad=p.mask_requires_grad)
            mask = leaf.expand(*p.mask_shape)
        elif not varlen and band_as_tensor(p.seqlen_q, p.seqlen_k, p.causal, p.window, p.dtype):
            mask = torch.empty(1, dtype=p.dtype, device=device).expand(p.seqlen_q, p.seqlen_k)
        try:
            bias, _ = self._stand_in_bias(p, mask, device, cu_q, cu_k)
            qx, kx, vx = self.layout(q, k, v, varlen)
            inp = fmha.Inputs(query=qx, key=kx, value=vx, attn_bias=bias, p=0.0, scale=None)
            forward_op = fmha.dispatch._dispatch_fw(inp, p.requires_grad)
            if p.requires_grad:
                dispatch_backward(fmha.dispatch, inp, forward_op)
            verdict: list[str] = []
        except NotImplementedError as e:
            verdict = parse_no_operator(str(e))
        except Exception as e:  # xformers could not even describe the inputs
            verdict = [f"xformers: {_first_line(e)}"]
        self._verdicts[p] = verdict
        return verdict

    def _stand_in_bias(self, p, mask, device, cu_q, cu_k):
        if mask is not None:  # the shape and dtype are what matter to the dispatcher
            bias = mask.expand(p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)
            if p.heads_kv != p.heads_q:
                bias = bias.unflatten(1, (p.heads_kv, p.heads_q // p.heads_kv))
            return bias, None
        return self.attn_bias(
            batch=p.batch,
            heads_q=p.heads_q,
            heads_kv=p.heads_kv,
            sq=p.seqlen_q,
            sk=p.seqlen_k,
            causal=p.causal,
            window=p.window,
            mask=None,
            dtype=p.dtype,
            device=device,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
        )

    def route(self, query, key, value, options: dict) -> Route | None:
        """The form the call's band and mask reach memory_efficient_attention in: one of xformers' mask
        types, a tensor bias (with why), or exact zeros for an empty dimension."""
        if is_empty(query, key, value):
            return Route((RouteStep("output", "zeros", (("xformers", "an empty dimension: no kernel"),)),))
        causal, window = options.get("causal"), options.get("window")
        if options.get("cu_seqlens_q") is not None:
            return Route((RouteStep("attn_bias", _varlen_mask_type(causal, window)),))
        if options.get("attn_mask") is not None:
            return Route((RouteStep("attn_bias", "tensor (the mask, the band folded in)"),))
        sq, sk = query.shape[2], key.shape[2]
        why = band_as_tensor(sq, sk, causal, window, query.dtype)
        if why:
            passed = ((_mask_type(causal, window), why),)
            return Route((RouteStep("attn_bias", f"tensor (the band as one {sq} x {sk} matrix)", passed),))
        return Route((RouteStep("attn_bias", _mask_type(causal, window)),))

    # -- running ------------------------------------------------------------------
    def run(
        self,
        query,
        key,
        value,
        *,
        attn_mask=None,
        dropout_p=0.0,
        causal=None,
        window=None,
        scale=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        enable_gqa=False,
        deterministic=False,
        **_,
    ):
        if dropout_p:
            raise ValueError("xformers: dropout is not supported (rejected by check())")
        mods = self._load()
        if mods is None:
            raise RuntimeError(f"xformers unavailable: {self._error}")
        ops = mods[1]
        packed = cu_seqlens_q is not None
        if is_empty(query, key, value):
            out = empty_attention(query, key, value, packed)
            if attn_mask is not None and attn_mask.requires_grad:  # a zero gradient, as query's
                out = out + attn_mask.sum().to(out.dtype) * 0
            return out
        # a clone, not .contiguous(): a size-1 dim's stride counts for xformers, not for is_contiguous()
        query, key, value = (
            t if _strides_taken(t) else t.clone(memory_format=torch.contiguous_format) for t in (query, key, value)
        )
        if packed:
            b, sq, sk = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k)
        else:
            b, _, sq, _ = query.shape
            sk = key.shape[2]
        bias, row_ok = self.attn_bias(
            batch=b,
            heads_q=query.shape[-3 if not packed else 1],
            heads_kv=key.shape[-3 if not packed else 1],
            sq=sq,
            sk=sk,
            causal=causal,
            window=window,
            mask=attn_mask,
            dtype=query.dtype,
            device=query.device,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
        )
        if packed and row_ok is not None:  # keyless rows: xformers' gradient for them goes to a detached copy
            query = torch.where(row_ok, query, query.detach())
        q, k, v = self.layout(query, key, value, packed)
        out = ops.memory_efficient_attention(q, k, v, attn_bias=bias, p=0.0, scale=scale)
        if out.dim() == 5:
            out = out.flatten(2, 3)
        out = out.squeeze(0) if packed else out.transpose(1, 2)
        if row_ok is not None:
            out = torch.where(row_ok, out, torch.zeros((), dtype=out.dtype, device=out.device))
        refuse_create_graph_through("the xformers backend's attention", out)  # its Function's gradients have no graph
        return out


__all__ = ["XformersBackend", "parse_no_operator", "dispatch_backward", "INSTALL_HINT"]
