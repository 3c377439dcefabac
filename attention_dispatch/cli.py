"""python -m attention_dispatch info | explain | bench | tune | config --check FILE | demo"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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
    if not args.markdown:  # docs/backends.md holds what is the same on every machine
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
    from .tune import merge_tables, parse_shard, tune

    if args.merge:
        if args.out is None or args.shard is not None:
            raise ValueError("--merge takes --out FILE (the merged table) and no --shard")
        merge_tables([Path(p) for p in args.merge], Path(args.out))
        return 0
    tune(quick=args.quick, out=args.out, device=args.device, shard=parse_shard(args.shard) if args.shard else None)
    return 0


def _declared_only(args) -> bool:
    """Whether the call is for a device that is not here (or another --arch than its GPU's):
    explain then answers from declared capabilities (declared.py)."""
    from .declared import device_present, parse_arch

    try:
        device = torch.device(args.device)
    except RuntimeError as exc:  # torch's own message lists the device types it knows
        raise ValueError(f"--device {args.device!r}: {exc}") from None
    if args.arch is not None and device.type != "cuda":
        raise ValueError(f"--arch {args.arch!r} applies to --device cuda only (got --device {args.device!r})")
    if not device_present(device.type):
        return True
    return args.arch is not None and parse_arch(args.arch) != torch.cuda.get_device_capability(device)


def _build_inputs(args, device=None):
    """Random tensors of the shapes given on the command line (explain decides, never runs);
    ``device`` overrides --device (meta: shapes only, for a device that is not here)."""
    dtype = _DTYPES[args.dtype]
    device = torch.device(device or args.device)
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
        # the lengths given: nothing read back from the device (nor from meta tensors)
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=args.seqlen, max_seqlen_k=sk)
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


def _call_from_args(args, device=None):
    """(query, key, value, keyword arguments of sdpa) for the shape flags."""
    if args.config:
        config.load_config(args.config)
    q, k, v, mask, extra = _build_inputs(args, device)
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
    if _declared_only(args):
        decision = _explain_declared(args)
    else:
        q, k, v, kwargs = _call_from_args(args)
        decision = api.explain(q, k, v, backend=args.backend, **kwargs)
    print(decision)
    return 0 if decision.backend else 1


def _explain_declared(args):
    """explain for a device that is not here: the call normalised on meta tensors (shapes
    only), decided from declared capabilities."""
    from .call import make_problem, normalize_call
    from .declared import explain_declared, hypothetical_problem, parse_arch

    q, k, v, kwargs = _call_from_args(args, device="meta")
    problem = make_problem(normalize_call(q, k, v, **kwargs).facts)
    arch = parse_arch(args.arch) if args.arch is not None else None
    return explain_declared(hypothetical_problem(problem, torch.device(args.device).type, arch), args.backend)


def _cmd_bench(args) -> int:
    """Time every eligible backend on the call described by the flags (forward, plus
    backward unless --no-grad), in this process: a quick local comparison, not the
    benchmarks/ suite."""
    from . import fastest

    if _declared_only(args):
        raise ValueError(
            f"bench runs the call, and --device {args.device}"
            + (f" --arch {args.arch}" if args.arch else "")
            + " is not here; explain answers for it from declared capabilities"
        )
    q, k, v, kwargs = _call_from_args(args)
    call = api.normalize_call(q, k, v, **kwargs)
    decision = api.explain(q, k, v, backend=args.backend, **kwargs)
    print(f"problem: {decision.problem.summary()}")
    if decision.problem.requires_grad:
        print("timed: training, forward + backward (ms per step; --no-grad times the forward alone)")
    else:
        print("timed: forward only, inference (ms per call; without --no-grad: forward + backward)")
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


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default, except where its help already says it or there is
    none to show (a flag off by default, an option that is unset unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        if "default" in text:
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attention_dispatch",
        description="One sdpa() for every attention kernel.",
        formatter_class=DefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add_parser(name, **kwargs):
        return sub.add_parser(name, formatter_class=DefaultsHelpFormatter, **kwargs)

    p = add_parser("info", help="every registered backend: availability, version, capabilities")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables (docs/backends.md)")
    p.set_defaults(func=_cmd_info)

    shape = argparse.ArgumentParser(add_help=False)
    shape.add_argument("--batch", "-b", type=int, default=2, help="batch size (varlen: number of sequences)")
    shape.add_argument("--heads", type=int, default=8, help="query heads")
    shape.add_argument("--heads-kv", type=int, default=None, help="key/value heads (GQA); default = --heads")
    shape.add_argument("--seqlen", "-s", type=int, default=128, help="query length (per sequence)")
    shape.add_argument("--seqlen-k", type=int, default=None, help="key length; default = --seqlen")
    shape.add_argument("--head-dim", "-d", type=int, default=64, help="query/key head dim")
    shape.add_argument("--head-dim-v", type=int, default=None, help="value head dim; default = --head-dim")
    shape.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="input dtype")
    shape.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="a device that is not here makes explain answer from declared capabilities",
    )
    shape.add_argument(
        "--arch", default=None, help="CUDA compute capability asked about, e.g. sm90 (default: the GPU present)"
    )
    shape.add_argument(
        "--causal", choices=["top_left", "bottom_right"], default=None, help="causal alignment; default: not causal"
    )
    shape.add_argument(
        "--window",
        type=int,
        nargs=2,
        metavar=("LEFT", "RIGHT"),
        default=None,
        help="sliding window (-1: unbounded on that side); default: none",
    )
    shape.add_argument(
        "--mask",
        choices=["none", "bool", "float", "float-grad"],
        default="none",
        help="attn_mask kind (float-grad: a bias that requires grad)",
    )
    shape.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    shape.add_argument("--varlen", action="store_true", help="packed sequences through cu_seqlens")
    shape.add_argument("--no-grad", action="store_true", help="inference: inputs do not require grad")
    shape.add_argument(
        "--deterministic", action="store_true", help="ask for a deterministic backward (default: torch's setting)"
    )
    shape.add_argument("--backend", default=None, help="force one backend; default: the dispatcher's choice")
    shape.add_argument("--config", default=None, help="load this config file first; default: none")
    p = add_parser("explain", parents=[shape], help="the decision table for a call described on the command line")
    p.set_defaults(func=_cmd_explain)

    bench = add_parser(
        "bench", parents=[shape], help="time every eligible backend on a call described on the command line"
    )
    bench.set_defaults(func=_cmd_bench)

    p = add_parser(
        "tune",
        help="measure this GPU's backends over a grid of calls and write the performance table policy='auto' reads",
    )
    p.add_argument("--quick", action="store_true", help="a smaller grid (bf16; about 5 minutes on an H100)")
    p.add_argument("--out", default=None, help="table file (default: the user's cache directory, one per GPU)")
    p.add_argument("--device", default="cuda", help="the GPU to measure")
    p.add_argument(
        "--shard",
        default=None,
        metavar="K/N",
        help="measure only the K-th of N parts of the grid (N GPUs of one kind, on separate hosts: side by side on one host, shards timed flash-attn 4 up to 1.6x slow; then --merge)",
    )
    p.add_argument("--merge", nargs="+", metavar="FILE", help="merge tables of one environment into --out (no GPU)")
    p.set_defaults(func=_cmd_tune)

    p = add_parser("config", help="validate config files, or print the current config")
    p.add_argument("--check", nargs="+", metavar="FILE", help="validate these TOML/YAML files")
    p.set_defaults(func=_cmd_config)

    p = add_parser("demo", help="a few sdpa() calls on this machine, checked against the reference")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, config.ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`... info | head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush cannot fail again
        return 0
