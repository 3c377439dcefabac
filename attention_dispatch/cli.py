"""python -m attention_dispatch info | explain | bench | tune | config --check FILE | demo"""

from __future__ import annotations

import argparse
import sys

import torch

from . import api, config, debug

_DTYPES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def _cmd_info(args) -> int:
    print(debug.backend_table(markdown=args.markdown), end="")
    print()
    print(_tables_text())
    return 0


def _tables_text() -> str:
    """The performance tables found (policy="auto") and which one applies here."""
    from . import perf_table

    lines = [f"performance tables (policy='auto'; user tables in {perf_table.user_table_dir()}):"]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    found = perf_table.tables_found()
    applies = perf_table.applicable_table(device) if device is not None else None
    for table in found:
        if device is None:
            status = "no CUDA device here"
        elif table is applies:
            status = "APPLIES"
        else:
            status = perf_table.mismatch(table, device) or "another table of this environment comes first"
        lines.append(
            f"  {table.path} ({table.origin}): {table.environment.gpu}, torch {table.environment.torch}, "
            f"{len(table.entries)} buckets, measured {table.created or '?'}: {status}"
        )
    if not found:
        lines.append("  none found: the priority order decides (python -m attention_dispatch tune writes one)")
    return "\n".join(lines)


def _cmd_tune(args) -> int:
    from .tune import tune

    tune(quick=args.quick, out=args.out, device=args.device)
    return 0


def _build_inputs(args):
    """Random tensors of the shapes given on the command line (explain decides, never runs)."""
    dtype = _DTYPES[args.dtype]
    device = torch.device(args.device)
    hkv = args.heads_kv or args.heads
    dv = args.head_dim_v or args.head_dim
    sk = args.seqlen_k or args.seqlen
    grad = not args.no_grad
    kw = dict(dtype=dtype, device=device)
    if args.varlen:
        lengths_q = [args.seqlen] * args.batch
        lengths_k = [sk] * args.batch
        q = torch.randn(sum(lengths_q), args.heads, args.head_dim, **kw, requires_grad=grad)
        k = torch.randn(sum(lengths_k), hkv, args.head_dim, **kw, requires_grad=grad)
        v = torch.randn(sum(lengths_k), hkv, dv, **kw, requires_grad=grad)
        cu_q = torch.tensor([0] + [args.seqlen * (i + 1) for i in range(args.batch)], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0] + [sk * (i + 1) for i in range(args.batch)], dtype=torch.int32, device=device)
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        q = torch.randn(args.batch, args.heads, args.seqlen, args.head_dim, **kw, requires_grad=grad)
        k = torch.randn(args.batch, hkv, sk, args.head_dim, **kw, requires_grad=grad)
        v = torch.randn(args.batch, hkv, sk, dv, **kw, requires_grad=grad)
        extra = {}
    mask = None
    if args.mask == "bool":
        mask = torch.ones(1, 1, args.seqlen, sk, dtype=torch.bool, device=device)
    elif args.mask in ("float", "float-grad"):
        mask = torch.randn(1, args.heads, args.seqlen, sk, **kw, requires_grad=args.mask == "float-grad")
    return q, k, v, mask, extra


def _call_from_args(args):
    """(query, key, value, keyword arguments of sdpa) for the shape flags."""
    if args.config:
        config.load_config(args.config)
    q, k, v, mask, extra = _build_inputs(args)
    kwargs = dict(
        attn_mask=mask,
        dropout_p=args.dropout,
        causal=args.causal,
        window=tuple(args.window) if args.window else None,
        enable_gqa=(args.heads_kv or args.heads) != args.heads,
        deterministic=True if args.deterministic else None,
        **extra,
    )
    return q, k, v, kwargs


def _cmd_explain(args) -> int:
    q, k, v, kwargs = _call_from_args(args)
    decision = api.explain(q, k, v, backend=args.backend, **kwargs)
    print(decision)
    return 0 if decision.backend else 1


def _cmd_bench(args) -> int:
    """Time every eligible backend on the call described by the flags (forward, plus
    backward unless --no-grad), in this process: a quick local comparison, not the
    benchmarks/ suite."""
    from . import fastest

    q, k, v, kwargs = _call_from_args(args)
    call = api.normalize_call(q, k, v, **kwargs)
    decision = api.explain(q, k, v, backend=args.backend, **kwargs)
    print(f"problem: {decision.problem.summary()}")
    sync = torch.cuda.synchronize if q.device.type == "cuda" else (lambda: None)
    for name in decision.candidates:
        if name in decision.rejected:
            print(f"  {name:<16} -  ({'; '.join(decision.rejected[name])})")
            continue
        try:
            print(f"  {name:<16} {fastest._time_backend(name, call, sync):9.3f} ms")
        except Exception as exc:  # a failing backend is reported, the others still run
            print(f"  {name:<16} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return 0 if decision.eligible else 1


def _cmd_config(args) -> int:
    if not args.check:
        print(config.current_config().model_dump_json(indent=2))
        return 0
    status = 0
    for path in args.check:
        try:
            config.read_config(path)
            print(f"{path}: OK")
        except config.ConfigError as exc:
            print(str(exc), file=sys.stderr)
            status = 1
    return status


def _cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attention_dispatch", description="One sdpa() for every attention kernel."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="every registered backend: availability, version, capabilities")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables (docs/backends.md)")
    p.set_defaults(func=_cmd_info)

    shape = argparse.ArgumentParser(add_help=False)
    shape.add_argument("--batch", "-b", type=int, default=2)
    shape.add_argument("--heads", type=int, default=8, help="query heads")
    shape.add_argument("--heads-kv", type=int, default=None, help="key/value heads (GQA); default = --heads")
    shape.add_argument("--seqlen", "-s", type=int, default=128, help="query length (per sequence)")
    shape.add_argument("--seqlen-k", type=int, default=None, help="key length; default = --seqlen")
    shape.add_argument("--head-dim", "-d", type=int, default=64)
    shape.add_argument("--head-dim-v", type=int, default=None)
    shape.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    shape.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    shape.add_argument("--causal", choices=["top_left", "bottom_right"], default=None)
    shape.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=None)
    shape.add_argument("--mask", choices=["none", "bool", "float", "float-grad"], default="none")
    shape.add_argument("--dropout", type=float, default=0.0)
    shape.add_argument("--varlen", action="store_true", help="packed sequences through cu_seqlens")
    shape.add_argument("--no-grad", action="store_true", help="inference: inputs do not require grad")
    shape.add_argument("--deterministic", action="store_true")
    shape.add_argument("--backend", default=None, help="force one backend")
    shape.add_argument("--config", default=None, help="load this config file first")
    p = sub.add_parser("explain", parents=[shape], help="the decision table for a call described on the command line")
    p.set_defaults(func=_cmd_explain)

    bench = sub.add_parser(
        "bench", parents=[shape], help="time every eligible backend on a call described on the command line"
    )
    bench.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "tune",
        help="measure this GPU's backends over a grid of calls and write the performance table policy='auto' reads",
    )
    p.add_argument("--quick", action="store_true", help="a smaller grid (bf16; about 5 minutes on an H100)")
    p.add_argument("--out", default=None, help="table file (default: the user's cache directory, one per GPU)")
    p.add_argument("--device", default="cuda")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("config", help="validate config files, or print the current config")
    p.add_argument("--check", nargs="+", metavar="FILE", help="validate these TOML/YAML files")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("demo", help="a few sdpa() calls on this machine, checked against the reference")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, config.ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
