"""``python -m attention_dispatch tune [--quick] [--out FILE]``: measure this GPU's backends over a
grid of calls and write a performance table (perf_table.py) that ``policy = "auto"`` reads.

Each grid row is timed as ``policy = "fastest"`` times a bucket (fastest.time_backends: short
interleaved turns, the lower quartile), every eligible backend but the reference.  The table
is written after every row (atomically), so an interrupted run resumes where it stopped: rows
whose bucket the file already holds, for this environment, are skipped.
"""

from __future__ import annotations

import dataclasses
import datetime
import random
import sys
import time
import warnings
from pathlib import Path

import torch

from . import perf_table, registry
from .call import normalize_call
from .dispatch import decide

# Tokens per row (B * S) and model width (H * D) of the training rows, as benchmarks/bench.py's grid.
TOKENS = 16384
HIDDEN = 2048


@dataclasses.dataclass(frozen=True)
class GridRow:
    """One call of the grid (dense, bottom-right causal where Sq != Sk)."""

    label: str
    batch: int
    heads: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype
    causal: bool = False
    training: bool = False
    dropout: float = 0.0
    window: tuple[int, int] | None = None
    lengths: tuple[int, ...] = ()  # packed sequences (varlen) of these lengths; () = dense


def packed_lengths(total: int = TOKENS, n: int = 16, seed: int = 0) -> tuple[int, ...]:
    """n random positive lengths summing to total (Python's random with ``seed``: the lengths
    of benchmarks/grid.py's varlen rows)."""
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    edges = [0] + cuts + [total]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def _square(dtype, d, s, causal, training, **extra) -> GridRow:
    h = HIDDEN // d
    mode = "training" if training else "inference"
    label = f"{str(dtype).removeprefix('torch.')} d{d} S={s}{' causal' if causal else ''} {mode}"
    for name, value in extra.items():
        label += f" {name}={value}"
    return GridRow(label, max(1, TOKENS // s), h, h, s, s, d, dtype, causal, training, **extra)


def _extras(dtype) -> list[GridRow]:
    """Decode, dropout, GQA and a window: the rows the square grid lacks."""
    name = str(dtype).removeprefix("torch.")
    rows = [
        GridRow(f"{name} d128 decode B=64 Sk=4096 GQA 32/8", 64, 32, 8, 1, 4096, 128, dtype),
        GridRow(f"{name} d128 decode B=8 Sk=32768 GQA 32/8", 8, 32, 8, 1, 32768, 128, dtype),
        GridRow(f"{name} d128 decode B=64 Sk=4096 MHA", 64, 32, 32, 1, 4096, 128, dtype),
        _square(dtype, 128, 4096, False, True, dropout=0.1),
    ]
    for causal in (False, True):
        for training in (False, True):
            mode = "training" if training else "inference"
            label = f"{name} d128 S=4096 GQA 16/4{' causal' if causal else ''} {mode}"
            rows.append(GridRow(label, 4, 16, 4, 4096, 4096, 128, dtype, causal, training))
    for training in (False, True):
        for s in (4096, 16384):
            rows.append(_square(dtype, 128, s, False, training, window=(1024, 0)))
        for causal in (False, True):
            mode = "training" if training else "inference"
            label = f"{name} d128 varlen 16 seqs{' causal' if causal else ''} {mode}"
            lengths = packed_lengths()
            rows.append(
                GridRow(label, 16, 16, 16, max(lengths), max(lengths), 128, dtype, causal, training, lengths=lengths)
            )
    rows.append(_square(dtype, 128, 4096, False, False, dropout=0.1))
    return rows


def grid(quick: bool = False) -> list[GridRow]:
    """The rows ``tune`` measures: bf16 (and fp16 unless quick), head dims 64/128/256, S from
    512 (1k quick) to 16k, causal and not, inference and training, and :func:`_extras`."""
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)
    lengths = (1024, 4096, 16384) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    rows = []
    for dtype in dtypes:
        for d in (64, 128, 256):
            for s in lengths:
                for causal in (False, True):
                    for training in (False, True):
                        rows.append(_square(dtype, d, s, causal, training))
        rows += _extras(dtype)
    return rows


def make_call(row: GridRow, device: torch.device):
    """Fresh random inputs for ``row`` on ``device``, normalised as sdpa() would (the Call)."""
    kw = dict(device=device, dtype=row.dtype, requires_grad=row.training)
    if row.lengths:
        total = sum(row.lengths)
        q, k, v = (torch.randn(total, h, row.head_dim, **kw) for h in (row.heads, row.heads_kv, row.heads_kv))
        offsets = torch.tensor((0,) + row.lengths, device=device).cumsum(0).to(torch.int32)
        top = max(row.lengths)
        return normalize_call(
            q,
            k,
            v,
            dropout_p=row.dropout,
            is_causal=row.causal,
            window=row.window,
            cu_seqlens_q=offsets,
            cu_seqlens_k=offsets,
            max_seqlen_q=top,
            max_seqlen_k=top,
        )
    q = torch.randn(row.batch, row.heads, row.seqlen_q, row.head_dim, **kw)
    k = torch.randn(row.batch, row.heads_kv, row.seqlen_k, row.head_dim, **kw)
    v = torch.randn(row.batch, row.heads_kv, row.seqlen_k, row.head_dim, **kw)
    bottom_right = row.causal and row.seqlen_q != row.seqlen_k
    return normalize_call(
        q,
        k,
        v,
        dropout_p=row.dropout,
        is_causal=row.causal and not bottom_right,
        enable_gqa=row.heads != row.heads_kv,
        causal="bottom_right" if bottom_right else None,
        window=row.window,
    )


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` (1 <= K <= N) as (K, N): the K-th of N disjoint parts of the grid."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard: expected K/N with integers 1 <= K <= N, got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard: expected K/N with 1 <= K <= N, got {text!r}")
    return k, n


def shard_rows(rows: list[GridRow], shard: tuple[int, int] | None) -> list[GridRow]:
    """The rows of part ``shard`` = (K, N): every N-th row from the K-th (all rows for None), so
    N processes on N GPUs of one kind measure the grid once between them (merge with merge_tables)."""
    if shard is None:
        return rows
    k, n = shard
    return rows[k - 1 :: n]


def merge_tables(paths: list[Path], out: Path, log=sys.stderr) -> Path:
    """One table from several written by ``tune`` in one environment (the shards of one grid);
    a ValueError naming the file whose environment differs from the first's, or that is not a
    table.  The earliest creation time is kept; a bucket in several files keeps the last one's."""
    tables = []
    for path in paths:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            table = perf_table.read_table(Path(path), "user")
        if table is None:
            raise ValueError(f"--merge: {path} is not a performance table this version reads")
        if tables and table.environment != tables[0].environment:
            raise ValueError(
                f"--merge: {path} was measured in another environment ({table.environment.label()}, "
                f"{dict(table.environment.backends)}) than {tables[0].path} ({tables[0].environment.label()}, "
                f"{dict(tables[0].environment.backends)})"
            )
        tables.append(table)
    if not tables:
        raise ValueError("--merge: no table given")
    entries: dict[str, dict[str, float]] = {}
    details: dict[str, dict] = {}
    grids = set()
    for table in tables:
        entries.update(table.entries)
        extra = perf_table.read_extra(Path(table.path))
        details.update(extra.get("details", {}))
        grids.add(extra.get("grid", "full"))
    created = min(t.created for t in tables)
    grid_name = grids.pop() if len(grids) == 1 else "mixed"
    perf_table.write_table(Path(out), tables[0].environment, created, entries, {"details": details, "grid": grid_name})
    perf_table.forget()
    print(f"tune: merged {len(tables)} tables into {out} ({len(entries)} buckets)", file=log)
    return Path(out)


def tune(
    quick: bool = False,
    out: Path | None = None,
    device: str = "cuda",
    log=sys.stderr,
    shard: tuple[int, int] | None = None,
) -> Path:
    """Measure :func:`grid` (its part ``shard``, see shard_rows) on ``device`` and write the
    table (resuming a file of the same environment); returns its path."""
    from .fastest import time_backends

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("tune measures a CUDA GPU; none is available here")
    dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    env = perf_table.device_environment(dev)
    path = Path(out) if out is not None else perf_table.user_table_path(env)
    entries: dict[str, dict[str, float]] = {}
    details: dict[str, dict] = {}
    if path.exists():
        old = perf_table.read_table(path, "user")
        if old is not None and old.environment == env:
            entries = dict(old.entries)
            details = dict(perf_table.read_extra(path).get("details", {}))
            print(f"tune: resuming {path} ({len(entries)} buckets measured)", file=log)
    rows = shard_rows(grid(quick), shard)
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    began = time.perf_counter()
    done = 0
    for i, row in enumerate(rows):
        call = make_call(row, dev)
        key = perf_table.bucket_key(call.problem)
        if key in entries:
            continue
        elapsed = time.perf_counter() - began
        left = f", ~{_clock(elapsed / done * (len(rows) - i))} left" if done else ""
        print(f"[{i + 1:3d}/{len(rows)}] {_clock(elapsed)} elapsed{left}  {row.label}", file=log, flush=True)
        decision = decide(call.problem, raise_if_none=False)
        names = tuple(n for n in decision.eligible if not registry.get_backend(n).reference)
        failures: dict[str, str] = {}
        host: dict[str, float] = {}
        with torch.random.fork_rng(devices=[dev]):
            timings = time_backends(names, call, torch.cuda.synchronize, failures, None, host)
        entries[key] = {n: round(ms, 5) for n, ms in timings.items()}
        details[key] = {"row": row.label, "host_ms": host, "failures": failures}
        perf_table.write_table(path, env, created, entries, {"details": details, "grid": "quick" if quick else "full"})
        done += 1
        del call
    perf_table.forget()
    total = _clock(time.perf_counter() - began)
    print(f"tune: {len(entries)} buckets in {path} ({done} measured now, {total})", file=log)
    return path
