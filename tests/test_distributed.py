"""attention_dispatch.distributed: context_parallel_sdpa on 2 and 4 gloo CPU processes equals
one ad.sdpa() call on the whole sequence (math backend, float64, within 1e-10), output and every
gradient, for each feature, both layouts and both exchanges; shard/unshard; clear errors.

The processes are spawned once per world size (a module fixture); each runs every case inside
one process group and reports per case, so that each case is its own test here.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attention_dispatch as ad
from attention_dispatch.distributed import context_parallel_sdpa, cross_rank_checks, shard, unshard
from attention_dispatch.distributed import context_parallel_sdpa as _context_parallel_sdpa
from attention_dispatch.distributed.api import default_backward, last_backward
from attention_dispatch.distributed.layout import segments, shard_of, unshard_from
from attention_dispatch.distributed.steps import _whole_rows

TOLERANCE = 1e-10
DEADLINE_S = 900  # the spawned processes' whole run (~2 min on 2 idle cores, ~9 min at load 10)
TOLERANCES = {"float32": 2e-5, "dropout_triton": 2e-5, "triton": 2e-5, "triton_mask": 2e-5}  # where not float64
WORLDS = (2, 4)
B, H, D = 2, 2, 8

# name -> options; "s": global length per rank-chunk unit (global S = s * 2W, divisible for zigzag)
FEATURES = {
    "plain": {},
    "top_left": {"causal": "top_left"},
    "is_causal": {"is_causal": True},
    "bottom_right": {"causal": "bottom_right"},
    "top_left_longer_keys": {"causal": "top_left", "sk_factor": 2},
    "bottom_right_longer_keys": {"causal": "bottom_right", "sk_factor": 2},
    "bottom_right_longer_queries": {"causal": "bottom_right", "sq_factor": 2},
    "window": {"window": (3, 2)},
    "window_left_causal": {"causal": "top_left", "window": (5, -1)},
    "window_right_only": {"window": (-1, 3)},
    "gqa": {"heads_q": 4, "enable_gqa": True, "causal": "top_left"},
    "sinks": {"sinks": True, "causal": "top_left"},
    "sinks_plain": {"sinks": True},
    "softcap": {"softcap": 2.0, "causal": "bottom_right"},
    "alibi": {"alibi": True, "causal": "top_left"},
    "bias_grad": {"bias": "float", "causal": "top_left"},
    "bias_plain": {"bias": "float"},
    "bool_mask": {"bias": "bool", "window": (4, 4)},
    "return_lse": {"return_lse": True, "causal": "top_left", "window": (3, -1)},
    # dropout: each block draws its part of one call's keep-mask (the same seed as that call)
    "dropout": {"dropout_p": 0.3},
    "dropout_causal": {"dropout_p": 0.3, "causal": "top_left"},
    "dropout_everything": {
        "dropout_p": 0.25,
        "heads_q": 4,
        "enable_gqa": True,
        "causal": "bottom_right",
        "sk_factor": 2,
        "sinks": True,
        "bias": "float",
        "return_lse": True,
        "alibi": True,
    },
    # the triton kernels' dropout (interpreter, float32) at the blocks' positions: key segments
    # of 4 keys or more (column offsets multiples of 4); the reference is one math call
    "dropout_triton": {
        "dropout_p": 0.3,
        "backend": "triton",
        "dtype": torch.float32,
        "causal": "top_left",
        "sq_factor": 2,
        "sk_factor": 2,
    },
    # the triton kernels (interpreter, float32): the blocks' backward from the merged output
    # (Backend.run_backward; the other modes' triton path is dropout_triton's)
    "triton": {
        "modes": ("merged",),
        "backend": "triton",
        "dtype": torch.float32,
        "heads_q": 4,
        "enable_gqa": True,
        "causal": "bottom_right",
        "sk_factor": 2,
        "softcap": 2.0,
        "alibi": True,
        "sinks": True,
        "return_lse": True,
    },
    "triton_mask": {
        "modes": ("merged",),
        "backend": "triton",
        "dtype": torch.float32,
        "bias": "bool",
        "window": (4, 4),
    },
    "varlen": {"varlen": True},
    "varlen_causal": {"varlen": True, "causal": "top_left"},
    "varlen_window_alibi": {"varlen": True, "causal": "bottom_right", "window": (3, -1), "alibi": True},
    # float32: the merge in float32 against one float32 call (a dtype path, not the 1e-10 claim)
    "float32": {"dtype": torch.float32, "causal": "top_left", "bias": "float", "sinks": True, "alibi": True},
    "everything": {
        "scale": 0.37,
        "heads_q": 4,
        "enable_gqa": True,
        "causal": "bottom_right",
        "sinks": True,
        "softcap": 3.0,
        "bias": "float",
        "return_lse": True,
        "alibi": True,
    },
}
BACKWARDS = ("recompute", "autograd")
# the Function behind each mode's output (autograd mode: none of them)
NODES = {"recompute": "_RecomputedAttentionBackward", "merged": "_MergedAttentionBackward"}
# the triton backend's cases run under its interpreter only (the spawned ranks inherit the setting)
TRITON = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def _cases(world: int) -> list[tuple[str, str, str, str]]:
    """(feature, layout, exchange, backward): every feature in both layouts and both exchanges;
    the backward mode alternates so that world sizes 2 and 4 together run every combination."""
    cases = []
    for f in FEATURES:
        if FEATURES[f].get("backend") == "triton" and not TRITON:
            continue
        for i, lay in enumerate(("zigzag", "contiguous")):
            for j, ex in enumerate(("ring", "allgather")):
                if "modes" not in FEATURES[f]:
                    cases.append((f, lay, ex, BACKWARDS[(i + j + (world == 4)) % 2]))
        # merged: 2 of the 4 layout x exchange pairs per world size, all 4 over both; where it
        # cannot serve the feature, backward=None (the fallback, checked with its reason)
        pairs = (("zigzag", "ring"), ("contiguous", "allgather"))
        if world == 4:
            pairs = (("zigzag", "allgather"), ("contiguous", "ring"))
        if FEATURES[f].get("backend") == "triton":  # the interpreter's: one pair per world size
            pairs = pairs[:1]
        for lay, ex in pairs:
            cases.append((f, lay, ex, "merged" if _merged_serves(FEATURES[f]) else "default"))
    cases.append(("gqa", "zigzag", "ring", "default"))  # backward=None: merged where it serves the call
    return cases


def _merged_serves(feature: dict) -> bool:
    """Whether backward="merged" computes the feature: not a float mask's gradient (math and
    triton declare Capabilities.backward_from_output)."""
    return feature.get("bias") != "float"


def _expected_backward(feature: dict, asked: str, world: int) -> str:
    if asked != "default":
        return asked
    return "merged" if _merged_serves(feature) else default_backward(world)


CASES = {world: _cases(world) for world in WORLDS}


def _case_id(case) -> str:
    return "-".join(case)


def _inputs(feature: dict, world: int, seed: int):
    """Whole-sequence inputs (the same on every rank: seeded) and the call's options."""
    gen = torch.Generator().manual_seed(seed)

    dtype = feature.get("dtype", torch.float64)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    unit = 2 * world  # zigzag needs the global length divisible by 2W
    sq, sk = 2 * unit * feature.get("sq_factor", 1), 2 * unit * feature.get("sk_factor", 1)
    hq, hkv = feature.get("heads_q", H), H
    names = ("causal", "window", "softcap", "enable_gqa", "is_causal", "scale", "dropout_p")
    options = {n: feature[n] for n in names if n in feature}
    options["return_lse"] = feature.get("return_lse", False)
    t = {}
    if feature.get("varlen"):
        lengths = [3, sq - 3 - 5, 5]  # documents crossing every rank boundary of both layouts
        cu = torch.tensor([0, 3, sq - 5, sq], dtype=torch.int32)
        assert sum(lengths) == sq
        t["query"], t["key"], t["value"] = rand(sq, hq, D), rand(sq, hkv, D), rand(sq, hkv, D)
        t["grad_out"] = rand(sq, hq, D)
        options["cu_seqlens_q"] = options["cu_seqlens_k"] = cu
        seq_dim = 0
        batch = 3
    else:
        t["query"], t["key"], t["value"] = rand(B, hq, sq, D), rand(B, hkv, sk, D), rand(B, hkv, sk, D)
        t["grad_out"] = rand(B, hq, sq, D)
        seq_dim = 2
        batch = B
    if feature.get("bias") == "float":
        t["attn_mask"] = rand(B, 1, sq, sk)
    elif feature.get("bias") == "bool":
        t["attn_mask"] = torch.rand(1, hq, sq, sk, generator=gen) > 0.3
    if feature.get("sinks"):
        t["sinks"] = rand(hq)
    if feature.get("alibi"):
        options["alibi_slopes"] = torch.rand(batch, hq, generator=gen, dtype=torch.float32)
    if options["return_lse"]:
        t["grad_lse"] = rand(hq, sq) if feature.get("varlen") else rand(B, hq, sq)
    return t, options, seq_dim


def _loss(out, lse, t):
    loss = (out * t["grad_out"]).sum()
    if lse is not None:  # -inf rows have no gradient to check
        loss = loss + torch.where(torch.isfinite(lse), lse * t["grad_lse"], torch.zeros_like(lse)).sum()
    return loss


def _one_case(case, group, seed: int) -> float:
    """Max abs difference between the sharded call (this rank's shard) and the reference."""
    name, layout, exchange, backward = case
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    t, options, seq_dim = _inputs(FEATURES[name], world, seed)
    grads = [n for n in ("query", "key", "value", "sinks") if n in t]
    if "attn_mask" in t and t["attn_mask"].dtype != torch.bool:
        grads.append("attn_mask")
    # reference: one call on the whole sequence
    whole = {
        n: t[n].clone().requires_grad_(n in grads) for n in ("query", "key", "value", "attn_mask", "sinks") if n in t
    }
    torch.manual_seed(seed)  # dropout: the same seed for both calls (every rank's; rank 0's is used)
    result = ad.sdpa(**whole, **options, backend="math")
    ref_out, ref_lse = result if options["return_lse"] else (result, None)
    _loss(ref_out, ref_lse, t).backward()

    def mine(x, dim=seq_dim):
        return shard_of(x, rank, world, layout, dim)

    local = {n: mine(t[n]).clone().requires_grad_(n in grads) for n in ("query", "key", "value")}
    if "attn_mask" in t:  # rows of this rank's queries, every key column
        local["attn_mask"] = mine(t["attn_mask"], -2).clone().requires_grad_("attn_mask" in grads)
    if "sinks" in t:
        local["sinks"] = t["sinks"].clone().requires_grad_()
    torch.manual_seed(seed)
    asked = None if backward == "default" else backward
    result = context_parallel_sdpa(
        **local,
        **options,
        group=group,
        layout=layout,
        exchange=exchange,
        backward=asked,
        backend=FEATURES[name].get("backend", "math"),
    )
    out, lse = result if options["return_lse"] else (result, None)
    nodes = _graph_nodes(out)
    backward = _expected_backward(FEATURES[name], backward, world)
    choice = last_backward()
    for mode, node in NODES.items():
        if (node in nodes) != (backward == mode) or choice.mode != backward:
            raise AssertionError(f"backward={backward!r} did not run: {choice}, graph nodes {sorted(nodes)}")
    if asked is None and backward != "merged" and "attn_mask requires grad" not in choice.reason:
        raise AssertionError(f"the fallback from merged does not say why: {choice}")
    shard_t = dict(t, grad_out=mine(t["grad_out"]))
    if lse is not None:
        shard_t["grad_lse"] = mine(t["grad_lse"], -1)
    _loss(out, lse, shard_t).backward()
    # no assertion before the last collective (the sinks' all_reduce): a rank that raised early
    # would leave the others waiting in it
    errors = [(out - mine(ref_out)).abs().max().item()]
    if lse is not None:
        want = mine(ref_lse, -1)
        same_empty_rows = torch.equal(torch.isinf(lse), torch.isinf(want))
        errors.append(
            (torch.where(torch.isinf(want), 0, lse - want)).abs().max().item() if same_empty_rows else math.inf
        )
    for n in grads:
        got, want = local[n].grad, whole[n].grad
        if n == "sinks":  # replicated: each rank holds its rows' share of the gradient
            got = torch.zeros_like(local[n]) if got is None else got
            dist.all_reduce(got, group=group)
        elif n == "attn_mask":
            want = mine(want, -2)
        else:
            want = mine(want)
        errors.append(math.inf if got is None else (got - want).abs().max().item())
    if not all(math.isfinite(e) for e in errors):
        raise AssertionError(f"non-finite error, a missing gradient or -inf rows that differ: {errors}")
    return max(errors)


def _graph_nodes(out) -> set[str]:
    """The names of the autograd nodes behind ``out``."""
    seen, stack, names = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def _error_cases(group) -> dict[str, str]:
    """Each bad setup's error message on this rank ('' if nothing was raised)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    cu = torch.tensor([0, 4 * world], dtype=torch.int32)

    def context_parallel_sdpa(*args, **kwargs):
        return _context_parallel_sdpa(*args, group=group, **kwargs)

    cases = {
        "odd_local_zigzag": lambda: context_parallel_sdpa(x[:, :, :3], x[:, :, :3], x[:, :, :3]),
        "shapes_differ": lambda: context_parallel_sdpa(
            x[:, :, : 2 + 2 * (rank % 2)], x[:, :, : 2 + 2 * (rank % 2)], x[:, :, : 2 + 2 * (rank % 2)]
        ),
        "options_differ": lambda: context_parallel_sdpa(x, x, x, causal="top_left" if rank else None),
        "meta_device": lambda: context_parallel_sdpa(*(torch.empty(1, 2, 4, 8, device="meta"),) * 3),
        "dropout_varlen": lambda: context_parallel_sdpa(
            *(x[0].transpose(0, 1),) * 3, dropout_p=0.1, cu_seqlens_q=cu, cu_seqlens_k=cu
        ),
        "dropout_backend": lambda: context_parallel_sdpa(x, x, x, dropout_p=0.1, backend="torch_cpu"),
        "dropout_range": lambda: context_parallel_sdpa(x, x, x, dropout_p=1.5),
        # zigzag key segments of 2 keys: the triton kernels draw at column offsets that are multiples of 4
        "dropout_column_offsets": lambda: context_parallel_sdpa(x, x, x, dropout_p=0.1, backend="triton"),
        "layout": lambda: context_parallel_sdpa(x, x, x, layout="striped"),
        "exchange": lambda: context_parallel_sdpa(x, x, x, exchange="alltoall"),
        "backward": lambda: context_parallel_sdpa(x, x, x, backward="manual"),
        "merged_mask_grad": lambda: context_parallel_sdpa(
            x, x, x, torch.zeros(1, 1, 4, 4 * world, dtype=torch.float64, requires_grad=True), backward="merged"
        ),
        "merged_backend": lambda: context_parallel_sdpa(
            x.clone().requires_grad_(), x, x, backend="torch_cpu", backward="merged"
        ),
        "mask_shape": lambda: context_parallel_sdpa(x, x, x, torch.zeros(1, 1, 4, 4, dtype=torch.float64)),
        "shard_divisible": lambda: shard(torch.zeros(1, 1, 2 * world + 2, 1), group, "zigzag"),
        "contiguous_ok": lambda: context_parallel_sdpa(x[:, :, :3], x[:, :, :3], x[:, :, :3], layout="contiguous"),
        "odd_local_unchecked": lambda: _unchecked(lambda: context_parallel_sdpa(x[:, :, :3], x[:, :, :3], x[:, :, :3])),
    }
    messages = {}
    for name, fn in cases.items():
        try:
            fn()
            messages[name] = ""
        except Exception as exc:  # noqa: BLE001 - the parent checks type and message
            messages[name] = f"{type(exc).__name__}: {exc}"
    return messages


def _unchecked(fn):
    with cross_rank_checks(False):  # the local checks still run
        return fn()


def _check_gathers(group) -> list[str]:
    """The cross-rank check's all-gathers (counted by patching) per call: a new signature, its
    repeat, a mismatch in a new signature (its error), then the agreed call once more."""
    from attention_dispatch.distributed import exchange

    rank, real, counts = dist.get_rank(group), exchange.gather_facts, []
    x = torch.randn(1, 2, 12, 8, dtype=torch.float64)  # a shape no other call of this run uses

    def counted(*args, **kwargs):
        counts[-1] += 1
        return real(*args, **kwargs)

    calls = [
        lambda: _context_parallel_sdpa(x, x, x, group=group, causal="top_left"),
        lambda: _context_parallel_sdpa(x, x, x, group=group, causal="top_left"),
        # both ranks' signatures new (a rank repeating a checked one would not gather: see api.py)
        lambda: _context_parallel_sdpa(x[:, :, : 4 + 4 * (rank % 2)], x, x, group=group, causal="top_left"),
        lambda: _context_parallel_sdpa(x, x, x, group=group, causal="top_left"),
    ]
    exchange.gather_facts, results = counted, []
    try:
        for call in calls:
            counts.append(0)
            try:
                call()
                error = ""
            except ValueError as exc:
                error = str(exc)
            results.append(f"{counts[-1]} {error}".strip())
    finally:
        exchange.gather_facts = real
    return results


def _roundtrip(group) -> float:
    """unshard(shard(x)) == x for both layouts, and unshard's gradient reaches each shard."""
    world = dist.get_world_size(group)
    x = torch.arange(2 * 3 * 8 * world * 2, dtype=torch.float64).reshape(2, 3, 8 * world, 2)
    err = 0.0
    for layout in ("zigzag", "contiguous"):
        part = shard(x, group, layout).requires_grad_()
        back = unshard(part, group, layout)
        err = max(err, (back - x).abs().max().item())
        (back * x).sum().backward()  # d/dpart = world copies of x's rows (each rank's loss)
        err = max(err, (part.grad - world * shard(x, group, layout)).abs().max().item())
    return err


def _pair_of(world: int, index: int) -> int:
    """Which of the two groups of 2 runs case ``index`` (world size 2 splits the cases), or 0."""
    return index % 2 if world == 2 else 0


def _report(group, seed: int, into: dict, pair: int = 0) -> dict:
    """This rank's results of its cases, the round trip and the bad setups in ``group``, filled
    into ``into`` as they come (a case that raises ends the run)."""
    report = into
    world = dist.get_world_size(group)
    for i, case in enumerate(CASES[world]):
        if _pair_of(world, i) != pair:
            continue
        try:
            report["cases"][_case_id(case)] = _one_case(case, group, seed=seed + i)
        except Exception:  # noqa: BLE001 - reported per case to the parent
            report["cases"][_case_id(case)] = traceback.format_exc()
            # the ranks may now be out of step (one waits in a collective another skipped):
            # stop here rather than wait out the group's timeout once per remaining case
            raise RuntimeError(f"case {_case_id(case)} raised; the later cases were not run") from None
    report["roundtrip"] = _roundtrip(group)
    report["errors"] = _error_cases(group)
    report["check_gathers"] = _check_gathers(group)
    return report


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """World size 4: first two groups of 2 (ranks 0-1 and 2-3, not the default group: peers are
    translated to global ranks), each running half of the world-size-2 cases, then all 4."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    reports = {2: {"cases": {}, "errors": {}, "roundtrip": None}, 4: {"cases": {}, "errors": {}, "roundtrip": None}}
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        reports[2] = _report(pairs[rank // 2], seed=1000, into=reports[2], pair=rank // 2)
        reports[4] = _report(None, seed=5000, into=reports[4])
    except RuntimeError:
        pass  # reported per case: the parent's tests fail on the missing or failed cases
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(reports, f)
        dist.destroy_process_group()


_REPORTS: dict[int, list[dict]] = {}


def _reports(world: int) -> list[dict]:
    """Every rank's report for one world size (the processes are spawned once per module). A
    rank still running after DEADLINE_S (a hang: some rank waits for a message never sent) is
    killed and reports nothing, so the tests fail instead of waiting forever."""
    if not _REPORTS:
        with tempfile.TemporaryDirectory() as tmp:
            context = mp.start_processes(
                _worker, args=(4, os.path.join(tmp, "init"), tmp), nprocs=4, join=False, start_method="spawn"
            )
            deadline = time.monotonic() + DEADLINE_S
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        process.kill()
                    break
            for r in range(4):
                path = os.path.join(tmp, f"rank{r}.json")
                missing = {"cases": {}, "errors": {}, "roundtrip": f"rank {r} hung: killed after {DEADLINE_S} s"}
                if os.path.exists(path):
                    with open(path) as f:
                        reports = json.load(f)
                else:
                    reports = {"2": missing, "4": missing}
                for size, report in reports.items():
                    _REPORTS.setdefault(int(size), []).append(report)
    return _REPORTS[world]


@pytest.mark.parametrize(
    ("world", "case"),
    [(w, c) for w in WORLDS for c in CASES[w]],
    ids=[f"W{w}-{_case_id(c)}" for w in WORLDS for c in CASES[w]],
)
def test_equals_one_sdpa_call(world, case):
    pair = _pair_of(world, CASES[world].index(case))
    for rank, report in enumerate(_reports(world)[pair * world : (pair + 1) * world]):
        result = report["cases"].get(
            _case_id(case), f"not run: an earlier case raised or the rank hung ({report['roundtrip']})"
        )
        assert not isinstance(result, str), f"rank {rank}:\n{result}"
        tolerance = TOLERANCES.get(case[0], TOLERANCE)
        assert result <= tolerance, f"rank {rank}: max abs difference {result:.3e} > {tolerance}"


@pytest.mark.parametrize("world", WORLDS)
def test_shard_unshard_roundtrip_across_ranks(world):
    for rank, report in enumerate(_reports(world)):
        assert report["roundtrip"] == 0.0, f"rank {rank}: {report['roundtrip']}"


@pytest.mark.parametrize("world", WORLDS)
def test_cross_rank_check_runs_once_per_signature(world):
    for rank, report in enumerate(_reports(world)):
        first, repeat, mismatch, again = report.get("check_gathers") or ["not run"] * 4
        assert first == "1", f"rank {rank}: a new signature must be checked: {first!r}"
        assert repeat == "0", f"rank {rank}: a checked signature's repeat must not gather: {repeat!r}"
        assert mismatch.startswith("1 query shape differs across the ranks"), f"rank {rank}: {mismatch!r}"
        assert again == "0", f"rank {rank}: {again!r}"


EXPECTED_ERRORS = {
    "odd_local_zigzag": ("ValueError", "local sequence length 3 is not divisible by 2"),
    "shapes_differ": ("ValueError", "query shape differs across the ranks"),
    "options_differ": ("ValueError", "options (causal, window, scale, ...) differs across the ranks"),
    "meta_device": ("ValueError", "cannot send meta tensors"),
    "dropout_varlen": ("ValueError", "dropout_p=0.1 with cu_seqlens"),
    "dropout_backend": ("ValueError", "no candidate backend (torch_cpu, from backend= argument)"),
    "dropout_range": ("ValueError", "dropout_p=1.5 must be in [0, 1]"),
    "dropout_column_offsets": ("ValueError", "multiples of the layout's key segment (2 keys"),
    "layout": ("ValueError", "layout='striped' is not allowed"),
    "exchange": ("ValueError", "exchange='alltoall' is not allowed"),
    "backward": ("ValueError", "backward='manual' is not allowed"),
    "merged_mask_grad": ("ValueError", "backward='merged' cannot serve this call: attn_mask requires grad"),
    "merged_backend": ("ValueError", "(torch_cpu, from backend= argument) declares Capabilities.backward_from_output"),
    "mask_shape": ("ValueError", "attn_mask of shape (1, 1, 4, 4)"),
    "shard_divisible": ("ValueError", "is not divisible by"),
    "contiguous_ok": ("", ""),
    "odd_local_unchecked": ("ValueError", "local sequence length 3 is not divisible by 2"),
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", EXPECTED_ERRORS)
def test_bad_setups_raise_clear_errors_on_every_rank(world, name):
    kind, text = EXPECTED_ERRORS[name]
    for rank, report in enumerate(_reports(world)):
        message = report["errors"].get(name, "not run: a case raised before the bad setups")
        if not kind:
            assert message == "", f"rank {rank}: {message}"
            continue
        assert message.startswith(kind + ":") and text in message, f"rank {rank}: {message!r}"


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_of_and_unshard_from_invert_each_other(layout, world):
    x = torch.randn(2, 3, 4 * world, 5)
    shards = [shard_of(x, r, world, layout) for r in range(world)]
    assert torch.equal(unshard_from(shards, layout), x)
    covered = sorted(
        p
        for r in range(world)
        for s in segments(layout, r, world, 4 * world)
        for p in range(s.start, s.start + s.length)
    )
    assert covered == list(range(4 * world))


def test_zigzag_pairs_head_and_tail_chunks():
    assert segments("zigzag", 0, 2, 8) == ((0, 2, 0), (6, 2, 2))
    assert segments("zigzag", 1, 2, 8) == ((2, 2, 0), (4, 2, 2))
    with pytest.raises(ValueError, match="not divisible by 8"):
        shard_of(torch.zeros(1, 1, 12, 1), 0, 4, "zigzag")


def test_importing_attention_dispatch_does_not_import_distributed():
    import subprocess
    import sys

    code = "import sys, attention_dispatch; print('attention_dispatch.distributed' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_default_backward_without_merged_is_autograd_up_to_two_ranks():
    assert [default_backward(w) for w in (1, 2, 3, 4, 8)] == ["autograd"] * 2 + ["recompute"] * 3


@pytest.mark.parametrize("memory", ["BHSD", "BSHD"])
def test_blocks_get_whole_row_layouts(memory):
    """A part of S of a (B, H, S, D) shard is copied to a contiguous block (the Gluon kernels read
    whole-row layouts only); a part of (1, S, H, D) memory (packed varlen shards) and whole
    tensors are passed as they are."""
    whole = torch.randn(2, 3, 8, 4) if memory == "BHSD" else torch.randn(1, 8, 3, 4).transpose(1, 2)
    part = whole[:, :, 2:6]
    got = _whole_rows(part)
    assert torch.equal(got, part)
    assert got.is_contiguous() or got.transpose(1, 2).is_contiguous()
    assert (got.data_ptr() == part.data_ptr()) == (memory == "BSHD")
    assert _whole_rows(whole) is whole


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_merge_blocks_equals_softmax_over_the_union_of_keys(out_dtype):
    """Blocks over overlapping, nested and missing rows (the merge's pieces), one block's row
    empty (lse_b -inf): output and every gradient against one float64 softmax over each row's
    keys; the output written in out_dtype."""
    from attention_dispatch.distributed.merge import merge_blocks

    g = torch.Generator().manual_seed(int(time.time()))
    length, d, spans = 10, 3, [(0, 6), (2, 4), (4, 5)]  # row 9 covered by none, rows 4-5 by three
    empty = (1, 3)  # (block, global row): that block's row has no key
    scores = [torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for _, n in spans]
    values = [torch.randn(1, 2, 4, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in spans]
    parts = []
    for b, ((r0, n), s, v) in enumerate(zip(spans, scores, values)):
        lse = torch.logsumexp(s, -1)
        if b == empty[0]:
            lse = lse.index_fill(2, torch.tensor([empty[1] - r0]), -math.inf)
        parts.append((r0, torch.softmax(s, -1) @ v, lse))
    out, lse = merge_blocks(parts, length, out_dtype)
    assert out.dtype == (out_dtype or torch.float64) and lse.dtype == torch.float64
    ref_out, ref_lse = [], []
    for r in range(length):
        cols = [
            (s[:, :, r - r0], v)
            for b, ((r0, n), s, v) in enumerate(zip(spans, scores, values))
            if r0 <= r < r0 + n and (b, r) != empty
        ]
        if not cols:
            ref_out.append(torch.zeros(1, 2, d, dtype=torch.float64))
            ref_lse.append(torch.full((1, 2), -math.inf, dtype=torch.float64))
            continue
        s, v = torch.cat([c for c, _ in cols], -1), torch.cat([v for _, v in cols], 2)
        ref_out.append((torch.softmax(s, -1).unsqueeze(-2) @ v).squeeze(-2))
        ref_lse.append(torch.logsumexp(s, -1))
    ref_out, ref_lse = torch.stack(ref_out, 2), torch.stack(ref_lse, 2)
    assert (out.double() - ref_out).abs().max() <= (1e-12 if out_dtype is None else 1e-2)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite) and (lse - ref_lse)[finite].abs().max() <= 1e-12
    dout, dlse = torch.randn(out.shape, generator=g, dtype=out.dtype), torch.randn(lse.shape, generator=g).double()
    leaves = scores + values
    got = torch.autograd.grad((out, lse.masked_fill(~finite, 0.0)), leaves, (dout, dlse))
    want = torch.autograd.grad((ref_out, ref_lse.masked_fill(~finite, 0.0)), leaves, (dout.double(), dlse))
    for a, b in zip(got, want):
        assert a.isfinite().all() and (a - b).abs().max() <= (1e-12 if out_dtype is None else 1e-2)


def test_merge_sums_several_blocks_part_by_part():
    """Two bf16 blocks over most rows (rank 1's merge in the 2-rank causal zigzag ring, where
    both cover all its rows): the merge's new storage peaks at its output and one part's float32
    sum (~1.6 outputs with the logsumexps and weights), not the whole sum beside it (~2.6: that
    rank's step peak, issue 40); the values within one bf16 rounding of the float64 merge."""
    import sys

    from attention_dispatch.distributed.merge import merge_blocks

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from cp_memory import LiveBytes

    g = torch.Generator().manual_seed(int(time.time()))
    h, d, n, shift = 8, 128, 4096, 512  # rows [512, 4096) in both blocks: 3.5M elements a sum
    outs = [torch.randn(1, h, n, d, generator=g).to(torch.bfloat16) for _ in range(2)]
    lses = [4 * torch.randn(1, h, n, generator=g) for _ in range(2)]
    mode = LiveBytes()
    with mode:
        out, lse = merge_blocks([(0, outs[0], lses[0]), (shift, outs[1], lses[1])], n + shift, torch.bfloat16)
    unit = out.numel() * out.element_size()
    assert mode.peak / unit <= 1.7, f"peak {mode.peak / unit:.2f} outputs (at {mode.peak_op})"
    ref_out = torch.zeros(1, h, n + shift, d, dtype=torch.float64)
    ref_lse = torch.full((1, h, n + shift), -math.inf, dtype=torch.float64)
    for r0, l_b in ((0, lses[0]), (shift, lses[1])):
        ref_lse[:, :, r0 : r0 + n] = torch.logaddexp(ref_lse[:, :, r0 : r0 + n], l_b.double())
    for r0, o_b, l_b in ((0, outs[0], lses[0]), (shift, outs[1], lses[1])):
        w = torch.exp(l_b.double() - ref_lse[:, :, r0 : r0 + n]).unsqueeze(-1)
        ref_out[:, :, r0 : r0 + n] += w * o_b.double()
    assert ((out.double() - ref_out).abs() <= 2**-8 * ref_out.abs() + 1e-6).all()
    assert (lse.double() - ref_lse).abs().max() <= 1e-5


def test_signature_is_sdpa_s_with_the_group_options():
    """context_parallel_sdpa spells out sdpa()'s arguments (help() and editors show them): the
    same names, kinds, defaults and order, the group's keyword-only options after ``enable_gqa``."""
    import inspect

    ours = list(inspect.signature(_context_parallel_sdpa).parameters.values())
    theirs = list(inspect.signature(ad.sdpa).parameters.values())
    group = ["group", "exchange", "layout", "backward"]
    assert [p.name for p in ours] == [p.name for p in theirs[:8]] + group + [p.name for p in theirs[8:]]
    by_name = {p.name: p for p in ours}
    for p in theirs:
        assert (by_name[p.name].kind, by_name[p.name].default) == (p.kind, p.default), p.name
    assert all(by_name[name].kind is inspect.Parameter.KEYWORD_ONLY for name in group)


def test_autocast_derivative_modes_and_torch_func_on_one_rank(tmp_path):
    """As ad.sdpa(): under torch.autocast the shards run at the autocast dtype (the output bfloat16, equal
    to the cast call); dual tensors and torch.func's tensors are refused by name (the exchanges carry no
    tangent and take plain tensors), before any communication. One rank of a gloo group, in process."""
    import torch.autograd.forward_ad as fwAD

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = context_parallel_sdpa(q, k, v, is_causal=True)
        want = context_parallel_sdpa(*(t.bfloat16() for t in (q, k, v)), is_causal=True)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        with fwAD.dual_level(), pytest.raises(TypeError, match="forward-mode AD .* carry no tangent"):
            context_parallel_sdpa(fwAD.make_dual(q, torch.randn_like(q)), k, v, is_causal=True)
        with pytest.raises(TypeError, match="query is a tensor of a torch.func transform"):
            torch.func.vmap(lambda x: context_parallel_sdpa(x, k, v, is_causal=True))(torch.stack([q, q]))
    finally:
        dist.destroy_process_group()


def test_the_options_hold_every_keyword_parameter():
    """context_parallel_sdpa gathers its keyword parameters into one ``options`` dict, which the call (under
    autocast too) runs on: one added to the signature but not there would be dropped, silently."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(_context_parallel_sdpa))
    built = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "options" and isinstance(n.value, ast.Call)
    ]
    assert len(built) == 1
    params = list(inspect.signature(_context_parallel_sdpa).parameters)
    unused = {"max_seqlen_q", "max_seqlen_k"}  # the blocks' lengths come from the offsets
    assert {k.arg: k.value.id for k in built[0].keywords} == {p: p for p in params[8:] if p not in unused}
