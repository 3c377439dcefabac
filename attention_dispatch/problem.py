"""Problem: a frozen, hashable description of one sdpa() or sdpa_with_kvcache() call, holding no tensor."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from fractions import Fraction

import torch

from .semantics import CausalKind


KV_LAYOUTS = frozenset({"kvcache", "paged"})  # the layouts of sdpa_with_kvcache()


@functools.lru_cache(maxsize=None)
def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None elsewhere; cached since it never changes."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """Everything a backend needs to decide whether it can compute a call.

    Shapes are canonical: batch, heads and sequence lengths as in (B, H, S, D); for
    varlen inputs seqlen_q/k are the maximum sequence lengths and batch the number of
    sequences.  For sdpa_with_kvcache() (layout "kvcache": a dense cache, "paged": a block
    table) seqlen_q is the new queries per sequence and seqlen_k the cache's capacity (dense
    S_cache, paged max_blocks * block_size), never the per-sequence lengths, which live on the
    device: every step of a generation is the same Problem.
    """

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim_qk: int
    head_dim_v: int
    dtype: torch.dtype
    device_type: str
    compute_capability: tuple[int, int] | None
    layout: str  # "dense" | "varlen" | "kvcache" (dense KV cache) | "paged" (paged KV cache)
    mask_kind: str  # "none" | "bool" | "float"
    mask_shape: tuple[int, ...] | None  # the mask's own 4-D shape (1 on broadcast dims)
    mask_requires_grad: bool
    causal: CausalKind | None
    window: tuple[int, int] | None
    dropout: bool
    requires_grad: bool
    deterministic: bool
    deterministic_warn_only: bool
    last_dim_contiguous: bool
    aligned_16: bool  # data pointers and non-unit strides allow 16-byte vector loads
    # varlen whose cu_seqlens_q and cu_seqlens_k are one tensor: every sequence has as many
    # queries as keys, so top-left and bottom-right causal coincide (packed self-attention)
    same_offsets: bool = False
    # a float32 bias with float16/bfloat16 inputs: added at float32, as F.sdpa does
    float32_bias: bool = False
    # sdpa_with_kvcache(): the paged cache's block size (None for other layouts), and whether
    # k_new/v_new are appended into the cache before attending
    kv_block_size: int | None = None
    kv_append: bool = False
    # issue 36's features: softcap, ALiBi slopes, attention sinks (and whether they need a
    # gradient), the logsumexp returned with the output
    softcap: bool = False
    alibi: bool = False
    sinks: bool = False
    sinks_grad: bool = False
    return_lse: bool = False
    # the gradients from a given output and logsumexp (Backend.run_backward: a block of context
    # parallelism's merged backward), not from the call's own forward
    backward_from_output: bool = False
    # forward-mode AD: an input is a dual tensor (torch.autograd.forward_ad) whose tangent the
    # output's must carry
    forward_ad: bool = False
    # under a torch.func transform (vmap, grad, jvp): the inputs are its wrappers, without storage
    func_transform: bool = False

    @property
    def kv_cache(self) -> bool:
        """A call of sdpa_with_kvcache() (layout "kvcache" or "paged")."""
        return self.layout in KV_LAYOUTS

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv if self.heads_kv else 1

    @property
    def sequences_match(self) -> bool:
        """True when top-left and bottom-right causal are the same function: dense with
        Sq == Sk, or varlen whose query and key offsets are the same tensor."""
        if self.layout == "varlen":
            return self.same_offsets
        if self.layout in KV_LAYOUTS:  # each sequence has its own length
            return False
        return self.seqlen_q == self.seqlen_k

    def summary(self) -> str:
        """One readable line, used in errors and decision tables."""
        keys = f"cache={self.seqlen_k}" if self.kv_cache else f"Sk={self.seqlen_k}"
        parts = [
            f"{self.layout} B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} "
            f"Sq={self.seqlen_q} {keys} Dqk={self.head_dim_qk} Dv={self.head_dim_v}",
            f"{str(self.dtype).removeprefix('torch.')} on {self.device_type}"
            + (f" sm{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else ""),
        ]
        if self.kv_block_size is not None:
            parts.append(f"block_size={self.kv_block_size}")
        if self.kv_append:
            parts.append("append k_new/v_new")
        if self.mask_kind != "none":
            parts.append(
                f"{'float32' if self.float32_bias else self.mask_kind} mask {self.mask_shape}"
                + (" (grad)" if self.mask_requires_grad else "")
            )
        if self.causal is not None:
            parts.append(f"causal={self.causal}")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.dropout:
            parts.append("dropout")
        features = [
            name
            for name, on in (
                ("softcap", self.softcap),
                ("alibi", self.alibi),
                ("sinks (grad)" if self.sinks_grad else "sinks", self.sinks),
                ("return_lse", self.return_lse),
            )
            if on
        ]
        if features:
            parts.append(" + ".join(features))
        if self.requires_grad:
            parts.append("grad from a given out/lse" if self.backward_from_output else "grad")
        if self.forward_ad:
            parts.append("forward AD")
        if self.func_transform:
            parts.append("under torch.func")
        if self.deterministic:
            parts.append("deterministic" + (" (warn only)" if self.deterministic_warn_only else ""))
        return ", ".join(parts)


def _aligned_16(t: torch.Tensor, tracing: bool = False) -> bool:
    """16-byte aligned start and strides. While tracing (torch.compile: no data pointer),
    only the strides count."""
    elem = t.dtype.itemsize
    if not tracing and t.data_ptr() % 16:
        return False
    for stride in t.stride()[:-1]:
        if (stride * elem) % 16:
            return False
    return True


# ---- a Problem whose key length is traced ------------------------------------------------


class LengthSpan:
    """The key lengths over which every use of a traced seqlen_k seen so far gives the same
    result as at ``value``: the integers ``lo ... hi``.  ``opaque`` once a use could not be
    traced (the span is then ``value`` alone)."""

    __slots__ = ("value", "lo", "hi", "opaque")

    def __init__(self, value: int, lo: int, hi: int):
        self.value, self.lo, self.hi, self.opaque = value, lo, hi, False

    def collapse(self) -> None:
        self.opaque = True
        self.lo = self.hi = self.value

    def hold(self, a: int, b: int, op, c) -> None:
        """Keep ``op(a * s + b, c)`` (op a comparison, c an int or a float) as it is at
        s = value for every s in the span.  a * s + b - c has the sign of a * (s - t) with
        t = (c - b) / a, so the comparison is constant on s < t, on s == t and on s > t: it
        can change between consecutive integers x - 1 and x only for x = ceil(t) or
        floor(t) + 1, and those are the only places the span is cut."""
        if a == 0 or (isinstance(c, float) and not math.isfinite(c)):
            return  # constant in s (a comparison with inf or nan is the same for every int)
        t = (Fraction(c) - b) / a
        for x in {math.ceil(t), math.floor(t) + 1}:
            if op(a * x + b, c) != op(a * (x - 1) + b, c):
                if x <= self.value:
                    self.lo = max(self.lo, x)
                else:
                    self.hi = min(self.hi, x - 1)


_COMPARISONS = (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge)


class TracedLength:
    """``a * seqlen_k + b``, standing for seqlen_k while a decision is taken on a probe
    Problem (:func:`trace_seqlen_k`).  Every use either stays exact over the whole span and
    is traced, or narrows the span (:meth:`LengthSpan.hold`) to where its result is the same
    value, or, where neither can be said, collapses the span to the one length (the result is
    then the plain value's):

    - comparisons with an int, a float or another traced length -> a bool, the span held;
    - + and - with ints or traced lengths, * by an int -> traced; ``abs``, ``bool`` -> held;
    - // and % by a nonzero int -> the quotient as an int (the span held to where it is the
      same), the remainder traced; ``bit_length()`` -> an int, held likewise;
    - ``hash()`` collapses the span and raises TypeError, so that a backend memoising on the
      Problem never keeps a probe in its memo (nor proves anything, should it swallow the error);
    - anything else (``int()``, ``index``, ``float()``, formatting into a reason, other
      operand types, a tensor size) collapses the span.

    It is not an ``int`` on purpose: C code reading an int subclass takes its value without
    asking it (a tensor shape, ``range``); this one is asked, through ``__index__``.  A check
    must therefore not branch on the type of ``seqlen_k`` (DESIGN: it is an int)."""

    __slots__ = ("_span", "_a", "_b")

    def __init__(self, span: LengthSpan, a: int = 1, b: int = 0):
        self._span, self._a, self._b = span, a, b

    def _value(self) -> int:
        return self._a * self._span.value + self._b

    def _plain(self) -> int:
        self._span.collapse()
        return self._value()

    def _linear(self, other) -> tuple[int, int] | None:
        """(a, b) of an int or of a traced length of the same span; None for anything else."""
        if type(other) is int or type(other) is bool:
            return 0, int(other)
        if type(other) is TracedLength and other._span is self._span:
            return other._a, other._b
        return None

    def _compare(self, other, op):
        lin = self._linear(other)
        if lin is not None:
            a, b, c = self._a - lin[0], self._b - lin[1], 0
        elif type(other) is float:
            a, b, c = self._a, self._b, other
        else:
            return op(self._plain(), other)
        self._span.hold(a, b, op, c)
        return op(a * self._span.value + b, c)

    def __eq__(self, other):
        return self._compare(other, operator.eq)

    def __ne__(self, other):
        return self._compare(other, operator.ne)

    def __lt__(self, other):
        return self._compare(other, operator.lt)

    def __le__(self, other):
        return self._compare(other, operator.le)

    def __gt__(self, other):
        return self._compare(other, operator.gt)

    def __ge__(self, other):
        return self._compare(other, operator.ge)

    def __hash__(self):  # the span collapses first: a check that swallows the error proves nothing
        self._span.collapse()
        raise TypeError("a traced seqlen_k is not hashable (a memo of the Problem ends the proof)")

    def __bool__(self):
        return self._compare(0, operator.ne)

    def _affine(self, other, sign: int, reflected: bool = False):
        lin = self._linear(other)
        if lin is None:
            value = self._plain()
            if reflected:
                return other + value if sign > 0 else other - value
            return value + other if sign > 0 else value - other
        if reflected:  # other - self
            return TracedLength(self._span, lin[0] - self._a, lin[1] - self._b)
        return TracedLength(self._span, self._a + sign * lin[0], self._b + sign * lin[1])

    def __add__(self, other):
        return self._affine(other, 1)

    __radd__ = __add__

    def __sub__(self, other):
        return self._affine(other, -1)

    def __rsub__(self, other):
        return self._affine(other, -1, reflected=True)

    def __mul__(self, other):
        lin = self._linear(other)
        if lin is not None and lin[0] == 0:
            return TracedLength(self._span, self._a * lin[1], self._b * lin[1])
        if lin is not None and self._a == 0:
            return TracedLength(self._span, lin[0] * self._b, lin[1] * self._b)
        return self._plain() * other

    __rmul__ = __mul__

    def __neg__(self):
        return TracedLength(self._span, -self._a, -self._b)

    def __pos__(self):
        return self

    def __abs__(self):
        return self if self._compare(0, operator.ge) else -self

    def _quotient(self, m) -> int | None:
        """value // m, the span held to where it stays so; None when m is not a nonzero int."""
        if type(m) is not int or m == 0:
            return None
        q = self._value() // m
        low, high = (m * q, m * q + m - 1) if m > 0 else (m * q + m + 1, m * q)
        self._span.hold(self._a, self._b, operator.ge, low)
        self._span.hold(self._a, self._b, operator.le, high)
        return q

    def __floordiv__(self, other):
        q = self._quotient(other)
        return self._plain() // other if q is None else q

    def __mod__(self, other):
        q = self._quotient(other)
        return self._plain() % other if q is None else TracedLength(self._span, self._a, self._b - other * q)

    def __divmod__(self, other):
        return self // other, self % other

    def bit_length(self) -> int:
        x = self._value()
        n = x.bit_length()
        if x == 0:
            self._span.hold(self._a, self._b, operator.eq, 0)
        else:
            low, high = (1 << (n - 1), (1 << n) - 1) if x > 0 else (1 - (1 << n), -(1 << (n - 1)))
            self._span.hold(self._a, self._b, operator.ge, low)
            self._span.hold(self._a, self._b, operator.le, high)
        return n

    def __index__(self) -> int:
        return self._plain()

    __int__ = __index__

    def __float__(self) -> float:
        return float(self._plain())

    def __format__(self, spec: str) -> str:
        return format(self._plain(), spec)

    def __str__(self) -> str:
        return str(self._plain())

    __repr__ = __str__

    def __getattr__(self, name):  # any other int attribute (numerator, to_bytes, ...): collapsed
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._plain(), name)


def _collapsing(name: str):
    def method(self, *args):
        return getattr(self._plain(), name)(*args)

    method.__name__ = name
    return method


for _name in (
    "__truediv__", "__rtruediv__", "__rfloordiv__", "__rmod__", "__rdivmod__", "__pow__", "__rpow__",
    "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__and__", "__rand__", "__or__", "__ror__",
    "__xor__", "__rxor__", "__invert__", "__round__", "__trunc__", "__floor__", "__ceil__", "__complex__",
):  # fmt: skip
    setattr(TracedLength, _name, _collapsing(_name))


def trace_seqlen_k(problem: Problem, lo: int, hi: int) -> tuple[Problem, LengthSpan]:
    """A copy of ``problem`` whose seqlen_k is traced (:class:`TracedLength`) and the span it
    narrows, starting as ``lo ... hi`` (which holds problem.seqlen_k).  Deciding on the copy
    leaves in the span the key lengths for which every use of seqlen_k gave the result it gave
    at problem.seqlen_k."""
    return trace_lengths(problem, lo, hi)


def trace_lengths(
    problem: Problem, lo: int, hi: int, fields: tuple[str, ...] = ("seqlen_k",), mask_dims: tuple[int, ...] = ()
) -> tuple[Problem, LengthSpan]:
    """trace_seqlen_k for one length that stands in several places: the ``fields`` (seqlen_q,
    seqlen_k: equal in ``problem``) and the ``mask_dims`` of mask_shape (torch.compile's one
    symbolic size of a self-attention call and its mask, tracing.py)."""
    span = LengthSpan(getattr(problem, fields[0]), lo, hi)
    length = TracedLength(span)
    changes = dict.fromkeys(fields, length)
    if mask_dims:
        changes["mask_shape"] = tuple(length if i in mask_dims else n for i, n in enumerate(problem.mask_shape))
    return dataclasses.replace(problem, **changes), span
