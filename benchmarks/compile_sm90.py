"""Compile every sm90 kernel of the configuration table for sm90, without a GPU.

    python benchmarks/compile_sm90.py [--kinds fwd,bwd_dkdv,bwd_dq,fwd_ws,fwd_d512] [--limit N] [--ptx-hashes]
        [--spills] [--sass] [--only REGEX]

The warp-specialised Gluon forward (kind fwd_ws) is compiled for each head dim, causal
flag and row layout it serves, the Gluon d512 forward (kind fwd_d512) dense and causal over
each row layout.  Each sm90 table entry (kernel kind, head dim, tiles, warps, stages) is compiled with the
installed Triton down to a cubin (ptxas runs), for every feature set the entry can be
chosen for: causal, dense, float bias through a TMA descriptor with dropout, float bias,
bool mask, dropout; forward kernels with K/V through in-kernel and through host-built
descriptors (over (B, H, S, D) and (B, S, H, D) memory).  Triton 3.6's ptxas crashed
(SIGSEGV) on one of these combinations (docs/experiments/perf-notes.md, experiment 29); this finds
such a crash on the development machine (`pip install triton==<the GPU's version>` in a
scratch venv) before a GPU run does.
Prints one line per failure and a summary; exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attention_dispatch.kernels import configs as C  # noqa: E402
from attention_dispatch.kernels.tl import KERNELS as TL_KERNELS  # noqa: E402

KERNELS = {kind: TL_KERNELS[kind] for kind in (C.FWD, C.BWD_DKDV, C.BWD_DQ)}
# the split dK/dV passes (configs.SPLIT_KINDS): the dK/dV kernel with one of its outputs
KERNELS.update({kind: TL_KERNELS[C.BWD_DKDV] for kind in C.SPLIT_KINDS})
SPLIT_CONSTEXPRS = {
    C.BWD_DV: dict(DO_DK=False, BIAS_GRAD=False),
    C.BWD_DK: dict(DO_DV=False),
}  # as tl/launch_backward.py
POINTERS = dict(
    {n: "*bf16" for n in ("Q", "K", "V", "Bias", "O", "DO", "DK", "DV", "DQ", "DB")},
    LSE="*fp32",
    Delta="*fp32",
    Seed="*i64",
    CuQ="*i32",
    CuK="*i32",
    Alibi="*fp32",
    Sinks="*fp32",
)
FLOATS = ("qk_scale", "sm_scale", "dropout_p", "softcap_in", "softcap_out")
# (label, causal, bias kind, bias through a descriptor, dropout)
FEATURES = (
    ("causal", True, 0, False, False),
    ("dense", False, 0, False, False),
    ("bias-desc+dropout", True, 1, True, True),
    ("bias-desc", False, 1, True, False),
    ("bool-mask", False, 2, False, False),
    ("dropout", False, 0, False, True),
)
# issue 36's score transforms, each compiled with the "causal" and "dense" features above:
# (label, SOFTCAP (0 off, 1 exact tanh, 2 tanh.approx), HAS_ALIBI, HAS_SINKS)
SCORE_FEATURES = (("", 0, False, False), ("+softcap", 1, False, False), ("+softcap-approx+alibi+sinks", 2, True, True))


def kernel_cases(kinds=tuple(KERNELS), entries=C.CONFIG_TABLE):
    """(kind, entry, feature label, constexprs) for every sm90 entry and the features it serves."""
    for e in entries:
        if e.kind not in kinds or e.min_cc != (9, 0):
            continue
        d, cfg = e.max_block_d, e.config
        for label, causal, bias, bias_desc, dropout in FEATURES:
            if not e.serves(causal, bias != 0 or dropout):
                continue
            # the forward reads K/V through host-built descriptors (dense calls) or in-kernel ones
            for kv_host in (0, 1, 2) if e.kind == C.FWD and cfg.host_kv else (0,):
                for score_label, softcap, alibi, sinks in (
                    SCORE_FEATURES if label in ("causal", "dense") else (("", 0, False, False),)
                ):
                    yield (
                        e.kind,
                        e,
                        label + ("", "+host-kv", "+host-kv-bshd")[kv_host] + score_label,
                        dict(
                            _feature_constexprs(d, cfg, causal, bias, bias_desc, dropout),
                            KV_HOST=kv_host,
                            SOFTCAP=softcap,
                            HAS_ALIBI=alibi,
                            HAS_SINKS=sinks,
                            **SPLIT_CONSTEXPRS.get(e.kind, {}),
                        ),
                    )


def _feature_constexprs(d, cfg, causal, bias, bias_desc, dropout):
    return dict(
        HEAD_DQK=d,
        HEAD_DV=d,
        IS_VARLEN=False,
        ALIGN_BR=causal,
        HAS_WL=False,
        HAS_WR=causal,
        BIAS_KIND=bias,
        BIAS_DESC=bias_desc,
        HAS_DROPOUT=dropout,
        BATCH_MINOR=False,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_DQK=d,
        BLOCK_DV=d,
        DOT_UPCAST=False,
        DOT_IEEE=False,
        ROUND_P=True,
        USE_DESC=True,
        MAY_EMPTY=causal or bias != 0,
        SCALE_POS=True,
        STORE_LSE=True,
        SUBTILES=cfg.subtiles,
        BIAS_GRAD=bias == 1,
        DB_SUM_ROWS=False,
        DB_SUM_HEADS=False,
        ATOMIC=False,
        LSE_PAIR=False,  # float32 only (issue 38): bf16 compiles without it
        EXACT_P=0,  # float32 only (issue 38)
        # constexprs with defaults are passed too: a missing one would compile as a runtime argument
        DO_DK=True,
        DO_DV=True,
        DP_IN_BRANCH=C.wide_backward(d, d, torch.bfloat16),
    )


def _compile(src, options: dict):
    """(None, compiled kernel) or (the error's first line, None)."""
    try:
        return None, triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:  # noqa: BLE001 - a compiler failure is the finding
        if os.environ.get("COMPILE_SM90_TRACE"):  # the whole message (a CompilationError's source lines)
            traceback.print_exception(e, file=sys.stderr)
        return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:200], None


def ptx_fingerprint(ptx: str) -> str:
    """Hash of the PTX without line info, comments, debug sections and the debug-scope labels of
    inlined calls: a refactor that keeps every fingerprint compiles to the same code."""
    ptx = ptx[: ptx.find(".section")] if ".section" in ptx else ptx
    lines = [
        ln
        for ln in ptx.splitlines()
        if not ln.strip().startswith((".loc", ".file", "//")) and not re.fullmatch(r"\$L__tmp\d+:", ln.strip())
    ]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]


def compile_case(kind: str, entry, constexprs: dict):
    """Compile one kernel for sm90 (bf16): (None, kernel) when it compiled, else (the error's first line, None)."""
    fn = KERNELS[kind]
    names = fn.arg_names
    const = {k: v for k, v in constexprs.items() if k in names}
    sig = {n: "constexpr" if n in const else POINTERS.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    if const.get("KV_HOST"):  # the host-built K/V descriptors (tl/launch.host_kv_descriptors)
        sig["KD"] = sig["VD"] = f"tensordesc<bf16[{const['BLOCK_N']}, {const['BLOCK_DQK']}]>"
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return _compile(src, dict(num_warps=entry.config.num_warps, num_stages=entry.config.num_stages))


# (label, window left, window right): dense, causal and two windows (-1: unbounded)
WS_BANDS = (("dense", -1, -1), ("causal", -1, 0), ("window 256/0", 256, 0), ("window 100/60", 100, 60))


def _ws_variants(n_rows: int):
    """(label, constexprs) of the features every warp-specialised kernel takes: each band with
    each row layout, and a bias (launched batch-fastest) over (B, H, S, D) rows."""
    layouts = ((1,) * n_rows, (2,) * n_rows, (1, 2, 1)[:n_rows])
    for band, left, right in WS_BANDS:
        for rows, has_bias in [(r, False) for r in layouts] + [((1,) * n_rows, True)]:
            if band.startswith("window") and (rows != (1,) * n_rows):
                continue
            label = f"{band} rows={rows}" + (" bias" if has_bias else "")
            yield (
                label,
                dict(
                    WINDOW_LEFT=left,
                    WINDOW_RIGHT=right,
                    Q_ROWS=rows[0],
                    KV_ROWS=rows[1],
                    HAS_BIAS=has_bias,
                    BATCH_MINOR=has_bias,
                    **({"DO_ROWS": rows[2]} if n_rows == 3 else {}),
                ),
            )


def ws_cases():
    """The warp-specialised forward (kernels/gluon/) for every head dim it serves
    (:func:`_ws_variants`), with and without the logsumexp."""
    served = [(d, cfg, f"d={d}") for d, cfg in C.WS_FWD_CONFIGS.items()]
    if C.WS_FWD_CONFIGS[64].consumers != 2:  # two warpgroups at d64: tested, not served
        served.append((64, C.WsConfig(), "d=64 two warpgroups"))
    for d, cfg, name in served:
        for label, const in _ws_variants(2):
            if const["HAS_BIAS"] and cfg.consumers != 2:  # a bias tile's rows: a power of two
                continue
            # KV_LENS: a KV-cache call (kernels/decode.cache_forward; no bias, causal or not), which a
            # dense causal call with Sq < Sk launches too (kernels/entry.GLUON_LENGTHS)
            band = label.split()[0]
            kv_cache = (0, 1) if not const["HAS_BIAS"] and band in ("dense", "causal") else (0,)
            for store_lse, kv_lens in [(lse, kv) for kv in kv_cache for lse in (True, False)]:
                # issue 36's softcap, sinks and ALiBi (not in a KV-cache call) with the logsumexp, each
                # alone too over (B, H, S, D) rows without a bias
                for scores in _ws_score_variants(store_lse and not kv_lens, const):
                    # the launch gluon/launch.forward takes for these constexprs (a bounded softcap's own)
                    launched = cfg
                    if cfg is C.WS_FWD_CONFIGS[d]:
                        launched = C.ws_forward_config(
                            d,
                            scores["SOFTCAP"] == 2,
                            has_bias=const["HAS_BIAS"],
                            has_alibi=scores["HAS_ALIBI"],
                            window_left=const["WINDOW_LEFT"],
                            window_right=const["WINDOW_RIGHT"],
                            kv_lens_mode=kv_lens,
                        )
                    yield (
                        d,
                        launched,
                        f"ws {name} {label} lse={store_lse}"
                        + ("", " kv-cache")[kv_lens]
                        + _score_label(scores)
                        + (
                            f" consumers={launched.consumers} block_n={launched.block_n} stages={launched.stages}"
                            if launched is not cfg
                            else ""
                        ),
                        dict(
                            const,
                            STORE_LSE=store_lse,
                            BLOCK_N=launched.block_n,
                            STAGES=launched.stages,
                            BIAS_STAGES=launched.bias_stages,
                            CONSUMER_REGS=launched.consumer_regs,
                            NUM_WG=launched.consumers,
                            OWN_TILES=launched.forward_own_tiles(
                                const["WINDOW_LEFT"], const["WINDOW_RIGHT"], const["HAS_BIAS"]
                            ),
                            WARP_RELEASE=launched.warp_release,
                            KV_LENS=kv_lens,
                            **scores,
                        ),
                    )


def _ws_score_variants(takes_scores: bool, const: dict, sinks: bool = True):
    """Issue 36's score constexprs to compile with a variant: none; all of them where the kernel
    ``takes_scores``; each alone too over (B, H, S, D) rows without a bias (``sinks``: the kernel
    has a HAS_SINKS)."""
    off = dict(SOFTCAP=False, HAS_ALIBI=False, **({"HAS_SINKS": False} if sinks else {}))
    yield off
    if not takes_scores:
        return
    yield {k: True for k in off}
    if const["Q_ROWS"] == 1 and const["KV_ROWS"] == 1 and not const["HAS_BIAS"]:
        yield dict(off, SOFTCAP=True)
        if sinks:  # the forward's softmax without a running max under a cap up to ~52 (gluon/common.py)
            yield dict(off, SOFTCAP=2)
        yield dict(off, HAS_ALIBI=True)


def _score_label(scores: dict) -> str:
    on = [n for n, k in (("softcap", "SOFTCAP"), ("sinks", "HAS_SINKS"), ("alibi", "HAS_ALIBI")) if scores.get(k)]
    on = ["softcap-bounded" if n == "softcap" and scores["SOFTCAP"] == 2 else n for n in on]
    return " " + "+".join(on) if on else ""


def ws_backward_cases():
    """The warp-specialised dK/dV and dQ passes for every head dim each serves
    (:func:`_ws_variants` with dO's row layout); the dQ pass also takes the forward's key tile
    (BLOCK_N) and bias ring depth."""
    for kind, configs in (("dkdv", C.WS_BWD_CONFIGS), ("dq", C.WS_DQ_CONFIGS)):
        for d, cfg in configs.items():
            for label, const in _ws_variants(3):
                tiles = dict(BLOCK_N=cfg.block_n, BIAS_STAGES=cfg.bias_stages) if kind == "dq" else {}
                for fuse in (False, True) if kind == "dkdv" and cfg.fuse_dq else (False,):
                    extra = dict(FUSE_DQ=fuse) if kind == "dkdv" else {}
                    for scores in _ws_score_variants(True, const, sinks=False):
                        yield (
                            d,
                            cfg,
                            f"ws {kind}{'+dq' if fuse else ''} d={d} {label}" + _score_label(scores),
                            dict(const, **tiles, **extra, **scores, STAGES=cfg.stages, CONSUMER_REGS=cfg.consumer_regs),
                        )


def compile_ws_case(d: int, cfg, constexprs: dict):
    """Compile one warp-specialised kernel for sm90 (bf16): as compile_case."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from attention_dispatch.kernels.gluon.launch import DQ_ACC_SWIZZLE, KERNELS, WG_ROWS

    fwd, dkdv, dq = KERNELS["fwd_ws"], KERNELS["bwd_dkdv_ws"], KERNELS["bwd_dq_ws"]

    fn = fwd if "DO_ROWS" not in constexprs else dq if "BLOCK_N" in constexprs else dkdv
    names = fn.arg_names

    def desc(rows, cols=d):
        lay = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {cols}],{lay!r}>"

    def dq_desc(rows, cols):  # the fused dQ's fp32 partials (gluon/launch.dq_acc_descriptor)
        return f"tensordesc<fp32[{rows}, {cols}],{gl.NVMMASharedLayout(DQ_ACC_SWIZZLE, 32, 2)!r}>"

    wg = WG_ROWS
    if fn is dq:
        sig = dict(
            q_desc=desc(wg),
            k_desc=desc(cfg.block_n),
            v_desc=desc(cfg.block_n),
            do_desc=desc(wg),
            dq_desc=desc(wg),
            bias_desc=desc(2 * wg, cfg.block_n),
            lse_ptr="*fp32",
            delta_ptr="*fp32",
            qk_scale="fp32",
            sm_scale="fp32",
            softcap_in="fp32",
            softcap="fp32",
            alibi_ptr="*fp32",
        )
    elif fn is dkdv:
        m = cfg.bwd_block_m if not constexprs["HAS_BIAS"] else wg
        sig = dict(
            q_desc=desc(m),
            k_desc=desc(wg),
            v_desc=desc(wg),
            do_desc=desc(m),
            dk_desc=desc(wg),
            dv_desc=desc(wg),
            bias_desc=desc(m, 2 * wg),
            lse_ptr="*fp32",
            delta_ptr="*fp32",
            dq_desc=dq_desc(wg, d if m == 2 * wg else d // 2),
            qk_scale="fp32",
            sm_scale="fp32",
            softcap_in="fp32",
            softcap="fp32",
            alibi_ptr="*fp32",
        )
    else:
        sig = dict(
            q_desc=desc(wg),
            k_desc=desc(cfg.block_n),
            v_desc=desc(cfg.block_n),
            o_desc=desc(wg),
            bias_desc=desc(cfg.consumers * wg, cfg.block_n),
            lse_ptr="*fp32" if constexprs["STORE_LSE"] else "*bf16",
            kv_lens="*i32" if constexprs["KV_LENS"] == 1 else "*bf16",
            sinks_ptr="*fp32" if constexprs["HAS_SINKS"] else "*bf16",
            qk_scale="fp32",
            softcap_in="fp32",
            softcap="fp32",
            alibi_ptr="*fp32" if constexprs["HAS_ALIBI"] else "*bf16",
        )
    consts = dict(constexprs)
    if not consts["HAS_BIAS"]:  # gluon/launch.py passes None: a constexpr argument
        consts["bias_desc"] = None
    if fn is dkdv and not consts["FUSE_DQ"]:
        consts["dq_desc"] = None
    sig = {n: "constexpr" if n in consts else sig.get(n, "i32") for n in names}
    # pointers 16-byte aligned, as the launches specialise them (vector atomics need it)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=aligned)
    return _compile(src, dict(num_warps=4, maxnreg=cfg.max_regs))


def d512_cases():
    """(label, constexprs) of the Gluon d512 forward (kernels/gluon/forward_d512.py): dense and
    causal, each row layout pairing with the logsumexp, (B, H, S, D) rows without it."""
    from attention_dispatch.kernels.gluon import launch_d512

    for causal in (False, True):
        for rows, store_lse in (((1, 1), True), ((2, 2), True), ((1, 2), True), ((1, 1), False)):
            label = f"d512 {'causal' if causal else 'dense'} rows={rows} lse={store_lse}"
            yield label, launch_d512.constexprs(*rows, causal, store_lse)


def compile_d512_case(constexprs: dict):
    """Compile the Gluon d512 forward for sm90 (bf16) with its launch's options: as compile_case."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from attention_dispatch.kernels.gluon import launch_d512

    fn = launch_d512.KERNELS["fwd_d512"]
    names = fn.arg_names
    sig = {
        f"{name}_desc": f"tensordesc<bf16[{r}, {c}],{gl.NVMMASharedLayout.get_default_for([r, c], gl.bfloat16)!r}>"
        for name, (r, c) in launch_d512.tiles().items()
    }
    sig.update(lse_ptr="*fp32" if constexprs["STORE_LSE"] else "*bf16", qk_scale="fp32")
    sig = {n: "constexpr" if n in constexprs else sig.get(n, "i32") for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=aligned)
    return _compile(src, dict(num_warps=launch_d512.WARPS, num_stages=launch_d512.WS_STAGES))


def ptxas_usage(ptx: str) -> str:
    """ptxas -v's register and spill summary of ``ptx`` (sm_90a): 'N registers, S bytes spill
    stores, L bytes spill loads'."""
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        err = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
        ).stderr
    regs = re.findall(r"Used (\d+) registers", err)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", err)
    st, ld = spills[-1] if spills else ("?", "?")
    return f"{regs[-1] if regs else '?'} registers, {st} bytes spill stores, {ld} bytes spill loads"


# SASS opcodes that --sass counts: the MUFU (ex2, tanh, rcp) and conversion pipes, the FP32 pipe
SASS_OPS = ("MUFU", "I2F", "I2FP", "F2I", "FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "IADD3", "LOP3", "F2FP")


def sass_counts(kernel) -> str:
    """Static counts of SASS_OPS in the kernel's cubin (cuobjdump -sass), each per HGMMA instruction
    too: variants of one kernel compare per HGMMA (at d128 a forward's 64 x 128 score tile takes 16,
    64 scores per thread: per score = per HGMMA / 4)."""
    import collections
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(
        m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    )
    per = ops["HGMMA"] or 1
    return f"HGMMA={ops['HGMMA']} " + " ".join(f"{o}={ops[o]}({ops[o] / per:.2f})" for o in SASS_OPS)


def _report(label: str, err, kernel, hashes: bool, spills: bool = False, sass: bool = False) -> int:
    if err:
        print(f"FAILED {label}: {err}", flush=True)
        return 1
    if sass:
        print(f"{sass_counts(kernel)}: {label}", flush=True)
    if hashes:
        print(f"{ptx_fingerprint(kernel.asm['ptx'])} {label}", flush=True)
    if spills:
        print(f"{ptxas_usage(kernel.asm['ptx'])}, {kernel.metadata.shared} B shared: {label}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--kinds",
        type=lambda s: tuple(s.split(",")),
        default=tuple(KERNELS) + ("fwd_ws", "fwd_d512"),
        help="fwd, bwd_dkdv, bwd_dq, bwd_dv, bwd_dk, fwd_ws (the warp-specialised Gluon kernels), fwd_d512 (the Gluon "
        "d512 forward)",
    )
    p.add_argument("--limit", type=int, default=0, help="compile only the first N cases (0: all)")
    p.add_argument(
        "--ws-one-each",
        action="store_true",
        help="fwd_ws, fwd_d512: compile only the first (dense) case of each Gluon kernel and head dim",
    )
    p.add_argument(
        "--ptx-hashes",
        action="store_true",
        help="print each case's PTX fingerprint (diff two runs to check that a refactor changes no code)",
    )
    p.add_argument(
        "--spills", action="store_true", help="print each case's registers, spills (ptxas -v) and shared memory"
    )
    p.add_argument(
        "--sass", action="store_true", help="print each case's SASS opcode counts, per HGMMA in brackets (sass_counts)"
    )
    p.add_argument("--only", default="", help="compile only the cases whose label matches this regex")
    p.add_argument(
        "--fwd-configs",
        default="",
        help="instead of the table: tl forward configs 'BM,BN,warps,stages[,subtiles,host_kv];...' "
        "(KernelConfig's fields) at --head-dim, e.g. to check a sweep's candidates",
    )
    p.add_argument("--head-dim", type=int, default=512, help="the head dim of --fwd-configs")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: the interpreter compiles nothing; run without it")
        return 2
    failed = n = 0
    entries = C.CONFIG_TABLE
    if args.fwd_configs:
        cfgs = [C.KernelConfig(*(int(x) for x in c.split(","))) for c in args.fwd_configs.split(";") if c.strip()]
        entries = [C.ConfigEntry(C.FWD, (9, 0), (9, 9), args.head_dim, (torch.bfloat16,), c) for c in cfgs]
    for kind, entry, label, const in kernel_cases(args.kinds, entries):
        if args.limit and n >= args.limit:
            break
        label = f"{kind} d<={entry.max_block_d} {entry.config} {label}"
        if not re.search(args.only, label):
            continue
        n += 1
        err, kernel = compile_case(kind, entry, const)
        failed += _report(label, err, kernel, args.ptx_hashes, args.spills)
    if "fwd_ws" in args.kinds:
        seen = set()
        for d, cfg, label, const in list(ws_cases()) + list(ws_backward_cases()):
            # "ws dkdv+dq d=128"; a launch of its own (a bounded softcap's) counts apart
            kernel_name = re.split(r" (?:dense|causal|window) ", label)[0] + "".join(
                re.findall(r" consumers=.*", label)
            )
            if (args.ws_one_each and kernel_name in seen) or not re.search(args.only, label):
                continue
            seen.add(kernel_name)
            n += 1
            err, kernel = compile_ws_case(d, cfg, const)
            failed += _report(label, err, kernel, args.ptx_hashes, args.spills, args.sass)
    if "fwd_d512" in args.kinds:
        cases = [(label, const) for label, const in d512_cases() if re.search(args.only, label)]
        for label, const in cases[:1] if args.ws_one_each else cases:
            n += 1
            err, kernel = compile_d512_case(const)
            failed += _report(label, err, kernel, args.ptx_hashes, args.spills, args.sass)
    print(f"triton {triton.__version__}: {n} kernels compiled for sm90, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
