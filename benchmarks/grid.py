"""The benchmark's grid: its rows (problems), its columns (implementations), FLOPs and which
implementation supports which row.  Pure Python: no torch, so that `bench.py --from-json`,
`--list-rows` and `--help` run anywhere."""

from __future__ import annotations

import dataclasses
import fnmatch
import random


TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp16")
WINDOW = (1024, 0)
VARLEN_SEQS = 16
VARLEN_SEED = 0
GQA_GROUP = 4
DROPOUT = 0.1
FEATURES = ("dense", "bias", "window", "varlen", "gqa", "dropout")
MODES = ("fwd", "fwd+bwd")
BWD_FACTOR = 3.5

IMPLS = ("sdpa", "fastest", "triton", "cudnn", "torch_flash", "torch_efficient", "flex", "fa4")
# Our own columns: attention_dispatch.sdpa() (auto and policy="fastest") and our kernel forced.
OURS = ("sdpa", "fastest", "triton")
# What policy="fastest" can choose from (FlexAttention is an anchor, not a backend of ours).
BACKEND_IMPLS = ("triton", "cudnn", "torch_flash", "torch_efficient", "fa4")
ANCHORS = ("cudnn", "torch_flash", "torch_efficient", "flex", "fa4")
BACKEND_NAMES = {"fa4": "flash_attn"}  # column -> attention_dispatch backend name, where they differ
BACKEND_COLUMNS = {backend: column for column, backend in BACKEND_NAMES.items()}  # backend -> column
LABELS = {
    "sdpa": "sdpa (auto)",
    "fastest": "sdpa (fastest)",
    "triton": "triton (ours)",
    "cudnn": "cuDNN",
    "torch_flash": "torch flash",
    "torch_efficient": "torch eff",
    "flex": "Flex",
    "fa4": "FA4",
}
FA4_HEAD_DIMS = (64, 96, 128)  # flash_attn.cute 4.0 on sm90 (as attention_dispatch.backends.flash_attn)
QUICK_SEQLENS = (4096, 16384)
# Implementations whose first call compiles (Triton, Inductor, CuTe DSL): the compile workers run these.
COMPILING_IMPLS = ("sdpa", "triton", "flex", "fa4")


@dataclasses.dataclass(frozen=True)
class Row:
    """One problem of the grid. For varlen, S is the packed length (= TOKENS) and B the
    number of sequences; `lengths` holds the sequence lengths."""

    dtype: str
    D: int
    S: int
    causal: bool
    feature: str = "dense"
    tokens: int = TOKENS
    hidden: int = HIDDEN
    lengths: tuple[int, ...] = ()

    @property
    def Hq(self) -> int:
        return self.hidden // self.D

    @property
    def Hkv(self) -> int:
        return self.Hq // GQA_GROUP if self.feature == "gqa" else self.Hq

    @property
    def B(self) -> int:
        return len(self.lengths) if self.feature == "varlen" else max(1, self.tokens // self.S)

    @property
    def window(self) -> tuple[int, int] | None:
        return WINDOW if self.feature == "window" else None

    @property
    def dropout_p(self) -> float:
        return DROPOUT if self.feature == "dropout" else 0.0

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths) if self.feature == "varlen" else self.S

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.feature == "varlen":
            return f"{self.dtype}-d{self.D}-varlen{len(self.lengths)}-{mask}"
        tail = mask if self.feature == "dense" else f"{mask}-{self.feature}"
        return f"{self.dtype}-d{self.D}-s{self.S}-{tail}"

    def describe(self) -> str:
        """Short human label used in tables: 'S=4096 causal', 'bias S=4096', ..."""
        mask = " causal" if self.causal else ""
        if self.feature == "dense":
            return f"S={self.S}{mask}"
        if self.feature == "varlen":
            return f"varlen {len(self.lengths)} seqs{mask}"
        if self.feature == "window":
            return f"window ({WINDOW[0]},{WINDOW[1]}) S={self.S}"
        if self.feature == "gqa":
            return f"GQA {self.Hq}/{self.Hkv} S={self.S}{mask}"
        if self.feature == "dropout":
            return f"dropout {DROPOUT} S={self.S}{mask}"
        return f"{self.feature} S={self.S}{mask}"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["lengths"] = list(self.lengths)
        d.update(
            id=self.id,
            B=self.B,
            Hq=self.Hq,
            Hkv=self.Hkv,
            window=self.window,
            dropout_p=self.dropout_p,
            pairs=allowed_pairs(self),
            flops_fwd=flops(self, "fwd"),
            flops_fwd_bwd=flops(self, "fwd+bwd"),
        )
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Row":
        return cls(
            dtype=d["dtype"],
            D=d["D"],
            S=d["S"],
            causal=d["causal"],
            feature=d["feature"],
            tokens=d.get("tokens", TOKENS),
            hidden=d.get("hidden", HIDDEN),
            lengths=tuple(d.get("lengths", ())),
        )


def varlen_lengths(total: int = TOKENS, n: int = VARLEN_SEQS, seed: int = VARLEN_SEED) -> tuple[int, ...]:
    """n random positive lengths summing to total (reproducible: Python's random with `seed`)."""
    if n < 1 or total < n:
        raise ValueError(f"need 1 <= n <= total, got n={n}, total={total}")
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    edges = [0] + cuts + [total]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def window_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """Pairs (i, j) with i + off - left <= j <= i + off + right, off = sk - sq (bottom-right,
    as a window without causal is aligned); -1 = unbounded on that side."""
    off = sk - sq
    total = 0
    for i in range(sq):
        lo = 0 if left < 0 else max(0, i + off - left)
        hi = sk - 1 if right < 0 else min(sk - 1, i + off + right)
        if hi >= lo:
            total += hi - lo + 1
    return total


def allowed_pairs(row: Row) -> float:
    """(query, key) pairs the row computes, summed over the batch (per head).

    Dense: B*S*S, halved when causal (the usual convention, not S(S+1)/2); window: the exact
    count; varlen: sum of L*L over the sequences (halved when causal)."""
    half = 0.5 if row.causal else 1.0
    if row.feature == "varlen":
        return half * sum(n * n for n in row.lengths)
    if row.feature == "window":
        left, right = row.window
        if row.causal:
            right = 0
        return float(row.B * window_pairs(row.S, row.S, left, right))
    return half * row.B * row.S * row.S


def flops(row: Row, mode: str) -> float:
    """4 * Hq * D * pairs for the forward; x3.5 for forward+backward."""
    f = 4.0 * row.Hq * row.D * allowed_pairs(row)
    if mode == "fwd":
        return f
    if mode == "fwd+bwd":
        return BWD_FACTOR * f
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def tflops(row: Row, mode: str, ms: float) -> float:
    return flops(row, mode) / (ms * 1e-3) / 1e12


def build_grid(quick: bool = False) -> list[Row]:
    """Every row, in the order they are measured (most important first, so that a time
    budget that runs out cuts the least important ones): bf16 hdim 128, its feature rows,
    then the other head dims and fp16."""
    seqlens = QUICK_SEQLENS if quick else SEQLENS
    configs = (
        [("bf16", 128)]
        if quick
        else [("bf16", 128), ("bf16", 64), ("bf16", 256), ("fp16", 128), ("fp16", 64), ("fp16", 256)]
    )
    rows: list[Row] = []
    for dtype, D in configs:
        for S in seqlens:
            for causal in (False, True):
                rows.append(Row(dtype, D, S, causal))
        if (dtype, D) == ("bf16", 128):
            rows.extend(feature_rows(dtype, D))
    return rows


def feature_rows(dtype: str = "bf16", D: int = 128) -> list[Row]:
    lengths = varlen_lengths()
    return [
        Row(dtype, D, 4096, False, "bias"),
        Row(dtype, D, 4096, False, "window"),
        Row(dtype, D, 16384, False, "window"),
        Row(dtype, D, TOKENS, False, "varlen", lengths=lengths),
        Row(dtype, D, TOKENS, True, "varlen", lengths=lengths),
        Row(dtype, D, 4096, False, "gqa"),
        Row(dtype, D, 4096, True, "gqa"),
        Row(dtype, D, 4096, False, "dropout"),
    ]


def smoke_grid() -> list[Row]:
    """Tiny rows for --smoke-cpu (checks the pipeline on a machine without a GPU)."""
    kw = dict(tokens=256, hidden=256)
    lengths = varlen_lengths(256, 4, VARLEN_SEED)
    return [
        Row("bf16", 64, 128, False, **kw),
        Row("bf16", 64, 128, True, **kw),
        Row("bf16", 64, 256, False, **kw),
        Row("bf16", 64, 128, False, "bias", **kw),
        Row("bf16", 64, 256, False, "window", **kw),
        Row("bf16", 64, 256, False, "varlen", lengths=lengths, **kw),
        Row("bf16", 64, 256, True, "varlen", lengths=lengths, **kw),
        Row("bf16", 64, 128, False, "gqa", **kw),
        Row("bf16", 64, 128, False, "dropout", **kw),
    ]


def select_rows(rows: list[Row], patterns: list[str] | None) -> list[Row]:
    """Rows whose id matches any fnmatch pattern (a pattern without wildcards matches as a
    substring); no patterns: all rows."""
    if not patterns:
        return list(rows)
    pats = [p if any(c in p for c in "*?[") else f"*{p}*" for p in patterns]
    return [r for r in rows if any(fnmatch.fnmatchcase(r.id, p) for p in pats)]


@dataclasses.dataclass(frozen=True)
class FlexScope:
    """Where the grid measures FlexAttention, whose compilation is the grid's slowest part: every
    row of ``dtypes`` x ``dims``, and at every dtype and head dim the dense rows with S >=
    ``from_s`` (the rows our kernel's ratios are read on, so each config has its ratio to Flex;
    0: only ``dtypes`` x ``dims``)."""

    dims: tuple[int, ...] = (64, 128)
    dtypes: tuple[str, ...] = ("bf16",)
    from_s: int = 4096

    def why_not(self, row: Row) -> str | None:
        """None when Flex is measured on ``row``; otherwise why not."""
        if row.D in self.dims and row.dtype in self.dtypes:
            return None
        if self.from_s and row.feature == "dense" and row.S >= self.from_s:
            return None
        return f"Flex not measured here: {self.describe()} (compile time; widen with --flex-dims/--flex-dtypes)"

    def describe(self) -> str:
        where = f"{'/'.join(self.dtypes)} hdim {'/'.join(map(str, self.dims))}"
        return where + (
            f", and dense rows with S >= {self.from_s} at every dtype and head dim" if self.from_s else " only"
        )

    def argv(self) -> list[str]:
        """The command-line options that give this scope (for the compile workers)."""
        return [
            "--flex-dims",
            ",".join(map(str, self.dims)),
            "--flex-dtypes",
            ",".join(self.dtypes),
            "--flex-from-s",
            str(self.from_s),
        ]


def support(impl: str, row: Row, mode: str, flex: FlexScope = FlexScope()) -> str | None:
    """None when `impl` runs this row and mode; otherwise why not (shown as "-")."""
    f = row.feature
    if impl in OURS:
        return None
    if impl in ("cudnn", "torch_flash", "torch_efficient"):
        if f == "window":
            return "no sliding window in PyTorch's SDPA kernels"
        if impl == "torch_flash" and f == "bias":
            return "torch flash takes no attn_mask"
        if impl == "torch_efficient" and f == "varlen" and mode == "fwd+bwd":
            return "torch efficient: no training with jagged nested tensors"
        if impl == "cudnn" and f == "varlen" and row.D > 128:
            return "cuDNN nested: head_dim <= 128"
        return None
    if impl == "fa4":
        if row.D not in FA4_HEAD_DIMS:
            return f"flash-attn 4 on sm90: head_dim {row.D} not in {FA4_HEAD_DIMS}"
        if f in ("bias", "dropout"):
            return f"flash-attn 4: no {'attn_mask' if f == 'bias' else 'dropout'}"
        if f in ("window", "varlen") and mode == "fwd+bwd":
            return f"flash-attn 4 on sm90: no {f} backward"
        return None
    if impl == "flex":
        if f == "dropout":
            return "FlexAttention has no dropout"
        return flex.why_not(row)
    raise ValueError(f"unknown implementation {impl!r}")
