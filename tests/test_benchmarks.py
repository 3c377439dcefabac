"""CPU tests of the benchmark's pure helpers: FLOP and pair counting, grid, support table,
ratios, table / Markdown / JSON output, argument parsing. No timing here."""

import gc
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench_tools  # the benchmark scripts' own tests (they guard the report)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is no installed package: its modules import from the checkout
    sys.path.insert(0, str(ROOT))

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.timing import lower_quartile  # noqa: E402
from benchmarks import grid, report, targets  # noqa: E402
from benchmarks.details_log import Log  # noqa: E402
from benchmarks.runner import Runner  # noqa: E402
from benchmarks.turns import pair_choices, slow_turns, turn_order, warm_calls  # noqa: E402


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load("bench")
Row = grid.Row


def brute_pairs(sq, sk, causal_top_left, window):
    """Allowed (i, j) per DESIGN.md section 3, by enumeration."""
    off = 0 if causal_top_left else sk - sq
    left, right = window if window is not None else (-1, -1)
    if causal_top_left:
        right = 0
    n = 0
    for i in range(sq):
        for j in range(sk):
            if left >= 0 and j < i + off - left:
                continue
            if right >= 0 and j > i + off + right:
                continue
            n += 1
    return n


# ---- pairs and FLOPs --------------------------------------------------------------------------


def test_dense_flops_match_the_issue_formula():
    r = Row("bf16", 128, 4096, False)
    assert (r.B, r.Hq, r.Hkv) == (4, 16, 16)
    assert grid.flops(r, "fwd") == 4 * 4 * 16 * 4096 * 4096 * 128
    assert grid.flops(r, "fwd+bwd") == 3.5 * grid.flops(r, "fwd")


def test_causal_is_half_of_dense():
    dense, causal = Row("fp16", 64, 2048, False), Row("fp16", 64, 2048, True)
    assert grid.flops(causal, "fwd") == grid.flops(dense, "fwd") / 2
    assert causal.Hq == 32 and causal.B == 8


@pytest.mark.parametrize(
    "sq,sk,left,right",
    [(16, 16, 4, 0), (16, 16, 3, 2), (10, 16, 2, 1), (16, 10, 5, 0), (16, 16, -1, 0), (16, 16, 0, -1), (8, 8, 100, 0)],
)
def test_window_pairs_match_enumeration(sq, sk, left, right):
    assert grid.window_pairs(sq, sk, left, right) == brute_pairs(sq, sk, False, (left, right))


def test_window_row_counts_only_allowed_pairs():
    r = Row("bf16", 128, 4096, False, "window")
    left = grid.WINDOW[0]
    per_seq = sum(min(i, left) + 1 for i in range(4096))
    assert grid.allowed_pairs(r) == r.B * per_seq
    assert grid.flops(r, "fwd") == 4 * r.Hq * r.D * r.B * per_seq
    assert grid.allowed_pairs(r) < grid.allowed_pairs(Row("bf16", 128, 4096, True)) * 0.5


def test_window_row_16k_is_much_cheaper_than_dense():
    w, d = Row("bf16", 128, 16384, False, "window"), Row("bf16", 128, 16384, False)
    assert 16 < grid.flops(d, "fwd") / grid.flops(w, "fwd") < 17  # ~ 16384 / (1025 - 32)


def test_varlen_lengths_reproducible_and_sum():
    a, b = grid.varlen_lengths(), grid.varlen_lengths()
    assert a == b and len(a) == 16 and sum(a) == 16384 and min(a) >= 1
    assert grid.varlen_lengths(seed=1) != a
    assert sum(grid.varlen_lengths(100, 100, 3)) == 100
    with pytest.raises(ValueError):
        grid.varlen_lengths(3, 4)


def test_varlen_pairs_sum_of_squares():
    lengths = (3, 5, 8)
    full = Row("bf16", 128, 16, False, "varlen", tokens=16, lengths=lengths)
    causal = Row("bf16", 128, 16, True, "varlen", tokens=16, lengths=lengths)
    assert grid.allowed_pairs(full) == 9 + 25 + 64
    assert grid.allowed_pairs(causal) == (9 + 25 + 64) / 2
    assert full.B == 3 and full.max_seqlen == 8
    assert grid.flops(full, "fwd") == 4 * full.Hq * 128 * 98


def test_gqa_counts_query_heads():
    r = Row("bf16", 128, 4096, False, "gqa")
    assert (r.Hq, r.Hkv) == (16, 4)
    assert grid.flops(r, "fwd") == grid.flops(Row("bf16", 128, 4096, False), "fwd")


def test_bad_mode():
    with pytest.raises(ValueError):
        grid.flops(Row("bf16", 128, 512, False), "bwd")


def test_tflops():
    r = Row("bf16", 128, 4096, False)
    assert grid.tflops(r, "fwd", 1.0) == pytest.approx(grid.flops(r, "fwd") / 1e-3 / 1e12)


# ---- grid, rows, support ------------------------------------------------------------------------


def test_full_grid_covers_issue_5():
    rows = grid.build_grid()
    dense = [r for r in rows if r.feature == "dense"]
    assert len(dense) == 2 * 3 * 6 * 2
    assert {(r.dtype, r.D) for r in dense} == {(d, h) for d in ("bf16", "fp16") for h in (64, 128, 256)}
    assert all(r.B * r.S == 16384 and r.Hq * r.D == 2048 for r in dense)
    feats = {r.feature for r in rows}
    assert feats == set(grid.FEATURES)
    assert rows[0].id == "bf16-d128-s512-full"  # most important first
    assert len({r.id for r in rows}) == len(rows)


def test_quick_grid():
    rows = grid.build_grid(quick=True)
    assert {r.S for r in rows if r.feature == "dense"} == {4096, 16384}
    assert {(r.dtype, r.D) for r in rows} == {("bf16", 128)}
    assert {r.feature for r in rows} == set(grid.FEATURES)


def test_row_ids_and_json_roundtrip():
    rows = grid.build_grid(quick=True)
    ids = [r.id for r in rows]
    assert "bf16-d128-s4096-causal" in ids and "bf16-d128-s4096-full-bias" in ids
    assert "bf16-d128-varlen16-causal" in ids and "bf16-d128-s16384-full-window" in ids
    for r in rows:
        d = json.loads(json.dumps(r.to_json()))
        assert Row.from_json(d) == r
        assert d["flops_fwd"] == grid.flops(r, "fwd")


def test_select_rows_patterns():
    rows = grid.build_grid()
    assert {r.id for r in grid.select_rows(rows, ["bf16-d128-s4096-*"])} == {
        "bf16-d128-s4096-full",
        "bf16-d128-s4096-causal",
        "bf16-d128-s4096-full-bias",
        "bf16-d128-s4096-full-window",
        "bf16-d128-s4096-full-gqa",
        "bf16-d128-s4096-causal-gqa",
        "bf16-d128-s4096-full-dropout",
    }
    assert all("varlen" in r.id for r in grid.select_rows(rows, ["varlen"]))
    assert grid.select_rows(rows, None) == rows
    assert grid.select_rows(rows, ["nothing-like-this"]) == []


def test_support_table():
    s = grid.support
    window = Row("bf16", 128, 4096, False, "window")
    for impl in ("cudnn", "torch_flash", "torch_efficient"):
        assert s(impl, window, "fwd")  # "-", never routed elsewhere
    assert s("triton", window, "fwd") is None and s("sdpa", window, "fwd+bwd") is None
    assert s("fa4", window, "fwd") is None and s("fa4", window, "fwd+bwd")
    assert s("flex", window, "fwd") is None
    bias = Row("bf16", 128, 4096, False, "bias")
    assert s("torch_flash", bias, "fwd") and s("cudnn", bias, "fwd") is None and s("fa4", bias, "fwd")
    drop = Row("bf16", 128, 4096, False, "dropout")
    assert s("flex", drop, "fwd") and s("fa4", drop, "fwd") and s("torch_flash", drop, "fwd") is None
    assert s("fa4", Row("bf16", 256, 4096, False), "fwd")
    only = grid.FlexScope(from_s=0)  # bf16 hdim 64/128 only
    assert s("flex", Row("bf16", 256, 4096, False), "fwd", only)
    assert s("flex", Row("fp16", 128, 4096, False), "fwd", only)
    assert s("flex", Row("fp16", 128, 4096, False), "fwd", grid.FlexScope(dtypes=("bf16", "fp16"), from_s=0)) is None
    varlen = Row("bf16", 128, 16384, False, "varlen", lengths=grid.varlen_lengths())
    assert s("torch_efficient", varlen, "fwd") is None and s("torch_efficient", varlen, "fwd+bwd")
    with pytest.raises(ValueError):
        s("nope", window, "fwd")


# ---- results, ratios, formatting ------------------------------------------------------------------


def ok(tf, ms=1.0, **kw):
    return dict(status="ok", tflops=tf, ms=ms, **kw)


def make_entry(row, per_impl):
    res = {}
    for impl in grid.IMPLS:
        v = per_impl.get(impl)
        if v is None:
            res[impl] = {m: dict(status="unsupported", note="no") for m in grid.MODES}
        elif v == "err":
            res[impl] = {m: dict(status="error", note="RuntimeError: boom") for m in grid.MODES}
        else:
            res[impl] = {m: ok(tf, ms=grid.flops(row, m) / (tf * 1e9)) for m, tf in zip(grid.MODES, v)}
    return {"row": row.to_json(), "results": res}


def test_flex_scope_covers_every_config_from_the_target_length():
    """By default Flex runs at bf16 hdim 64/128 everywhere and, at every dtype and head dim, on
    the dense rows with S >= 4k (where our kernel's ratios are read); not on shorter or feature rows
    of the other configs.  The compile workers get the same scope."""
    flex = bench.parse_args([]).flex
    assert flex == grid.FlexScope((64, 128), ("bf16",), 4096)
    s = grid.support
    for dtype, D in (("bf16", 256), ("fp16", 64), ("fp16", 128), ("fp16", 256)):
        for S in (4096, 8192, 16384):
            for causal in (False, True):
                assert s("flex", Row(dtype, D, S, causal), "fwd+bwd", flex) is None
        assert "S >= 4096" in s("flex", Row(dtype, D, 2048, False), "fwd", flex)
    assert s("flex", Row("bf16", 128, 512, True), "fwd", flex) is None
    assert s("flex", Row("fp16", 128, 4096, False, "bias"), "fwd", flex)
    measured = [r.id for r in grid.build_grid() if s("flex", r, "fwd", flex) is None]
    assert len(measured) == 24 + 8 + 4 * 6 - 1  # bf16 d64/d128, their feature rows but dropout, 4 x 6
    narrow = bench.parse_args(["--flex-from-s", "0", "--flex-dims", "128"]).flex
    assert s("flex", Row("fp16", 128, 16384, False), "fwd", narrow) and "only" in narrow.describe()
    argv = bench._worker_argv(bench.parse_args(["--flex-from-s", "8192"]), ["x"])
    assert argv[argv.index("--flex-from-s") + 1] == "8192"
    assert bench.parse_args(argv[2:]).flex == grid.FlexScope(from_s=8192)


def test_best_anchor_and_ratios():
    e = make_entry(
        Row("bf16", 128, 4096, False),
        {
            "triton": (500, 400),
            "sdpa": (510, 410),
            "cudnn": (600, 500),
            "flex": (450, 420),
            "fa4": (650, 480),
            "torch_flash": "err",
        },
    )
    targets.add_ratios(e)
    assert e["best_anchor"] == {"fwd": "fa4", "fwd+bwd": "cudnn"}
    assert e["results"]["triton"]["fwd"]["ratio_to_best_anchor"] == pytest.approx(500 / 650)
    assert e["results"]["triton"]["fwd+bwd"]["ratio_to_best_anchor"] == pytest.approx(400 / 500)
    assert e["results"]["cudnn"]["fwd+bwd"]["ratio_to_best_anchor"] == pytest.approx(1.0)
    assert e["results"]["torch_flash"]["fwd"]["ratio_to_best_anchor"] is None
    assert report.fmt_ratio(e["results"]["triton"]) == "0.77 / 0.80"
    assert targets.ratio_between(e, "triton", "flex", "fwd") == pytest.approx(500 / 450)
    assert targets.ratio_between(e, "triton", "torch_efficient", "fwd") is None


def test_ratios_to_the_named_anchors_per_row_and_per_config():
    """Every row reports our kernel against cuDNN, Flex and flash-attn 4; every dtype and head dim
    its worst such ratio over the dense rows with S >= 4k ('-' where the anchor ran none)."""
    rows = [
        make_entry(Row("fp16", 256, 4096, False), {"triton": (400, 300), "cudnn": (500, 400), "flex": (200, 150)}),
        make_entry(Row("fp16", 256, 16384, True), {"triton": (450, 320), "cudnn": (500, 500), "flex": (300, 160)}),
        make_entry(Row("fp16", 256, 2048, False), {"triton": (100, 100), "cudnn": (500, 500)}),
        make_entry(Row("bf16", 128, 4096, False, "bias"), {"triton": (100, 100), "cudnn": (500, 500)}),
        make_entry(Row("bf16", 64, 8192, False), {"triton": (600, 500), "fa4": (700, 600)}),
    ]
    h, lines = report.anchor_ratio_lines(rows)
    assert h == ["row", "triton/cuDNN", "triton/Flex", "triton/FA4"]
    assert lines[0] == ["S=4096", "0.80 / 0.75", "2.00 / 2.00", "- / -"]
    h, lines = report.config_ratio_lines(rows)
    assert lines == [
        ["bf16 d64", "- / -", "- / -", "0.86 / 0.83"],
        ["fp16 d256", "0.80 / 0.64", "1.50 / 2.00", "- / -"],
    ]  # S=2048 and the bias row not read
    assert [e["row"]["S"] for e in targets.target_rows(rows)] == [4096, 8192, 16384]


def test_no_anchor_no_ratio():
    e = make_entry(Row("bf16", 128, 4096, False, "window"), {"triton": (100, 90)})
    targets.add_ratios(e)
    assert e["best_anchor"] == {"fwd": None, "fwd+bwd": None}
    assert report.fmt_ratio(e["results"]["triton"]) == "- / -"


def test_cells():
    assert report.fmt_cell({"fwd": ok(612.4)}, "fwd") == "612"
    assert report.fmt_cell({"fwd": ok(612.4)}, "fwd+bwd") == "?"
    assert report.fmt_cell({"fwd": dict(status="unsupported")}, "fwd") == "-"
    assert report.fmt_cell({"fwd": dict(status="error")}, "fwd") == "err"
    assert report.fmt_cell({"fwd": dict(status="skipped")}, "fwd") == "skip"
    assert report.fmt_cell({"fwd": ok(10), "mismatch": True}, "fwd") == "10!"
    assert report.fmt_pair({"fwd": ok(1), "fwd+bwd": dict(status="unsupported")}) == "1 / -"
    assert report.s_label(512) == "512" and report.s_label(16384) == "16k"


def test_text_and_markdown_tables():
    t = report.text_table(["a", "bb"], [["xxx", "1"], ["y", "22"]]).splitlines()
    assert t[0].startswith("a  ") and set(t[1].replace(" ", "")) == {"-"} and len(t) == 4
    m = report.md_table(["a", "b"], [["1", "2"]]).splitlines()
    assert m == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def fake_data():
    rows = [r for r in grid.build_grid(quick=True)]
    entries = []
    for r in rows:
        per = {
            "triton": (500, 450),
            "sdpa": (500, 450),
            "cudnn": (600, 520),
            "flex": (400, 380),
            "fa4": (650, 560),
            "torch_flash": (330, 300),
            "torch_efficient": (170, 150),
        }
        per = {k: v for k, v in per.items() if not grid.support(k, r, "fwd")}
        if r.feature == "window":
            per["triton"] = (500, 450)
        entries.append(make_entry(r, per))
    entries[0]["results"]["sdpa"]["backend"] = "triton"
    meta = dict(
        gpu="Fake GPU",
        torch="2.11",
        triton="3.6",
        cudnn=91900,
        fa4="4.0",
        commit="abc",
        date="d",
        quick=True,
        impls=list(grid.IMPLS),
        elapsed_s=12.0,
        command="x",
        notes=["a note"],
    )
    return {"meta": meta, "rows": entries}


def test_targets():
    data = fake_data()
    for e in data["rows"]:
        targets.add_ratios(e)
    t = {x["target"]: x for x in targets.evaluate_targets(data["rows"])}
    fwd_cudnn = next(v for k, v in t.items() if k.startswith("fwd >= 0.85x cuDNN"))
    assert fwd_cudnn["status"] == "not met" and fwd_cudnn["worst"] == pytest.approx(500 / 600, abs=1e-3)
    assert len(fwd_cudnn["ratios"]) == 4
    flex = next(v for k, v in t.items() if k.startswith("fwd >= 1.2x Flex"))
    assert flex["status"] == "met"
    win = next(v for k, v in t.items() if k.startswith("window") and "fwd+bwd" not in k)
    # same TFLOP/s on ~16x fewer FLOPs: the window run is ~16x faster than the dense one
    assert win["status"] == "met" and 16 < win["worst"] < 17
    bias = next(v for k, v in t.items() if k.startswith("bias"))
    assert bias["status"] == "not met"


def test_targets_not_measured_when_missing():
    assert targets.evaluate_targets([]) == []
    e = make_entry(Row("bf16", 128, 4096, False), {"triton": (500, 450)})
    targets.add_ratios(e)
    assert all(t["status"] == "not measured" for t in targets.evaluate_targets([e]))


def test_write_outputs_json_doc_and_table(tmp_path):
    data = fake_data()
    doc = tmp_path / "docs" / "benchmarks.md"
    table = bench.write_outputs(data, tmp_path / "out", doc, plot=False)
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(saved["rows"]) == len(grid.build_grid(quick=True)) and saved["targets"]
    assert saved["rows"][0]["best_anchor"]["fwd"] == "fa4"
    text = doc.read_text()
    for needle in (
        "Fake GPU",
        "2.11",
        "3.6",
        "91900",
        "abc",
        "| row |",
        "S=4096 causal",
        "Targets of issue 5",
        "Peak memory",
        "sdpa() chose: triton",
        "a note",
        "window (1024,0) S=16384",
        "Our kernel against cuDNN, Flex and flash-attn 4",
        "| triton/FA4 |",
        "The same ratios for every dtype and head dim",
        "| bf16 d128 | 0.83 / 0.87 |",
    ):
        assert needle in text, needle
    assert "bf16 hdim 128" in table and "S=16384 causal" in table and "targets (triton)" in table
    assert "triton's worst ratios per config" in table
    assert "Fake GPU" in table.splitlines()[-1]
    assert "untimed call" not in text  # older runs did not sample that way: not claimed
    data["meta"].update(rounds=5, sampling=report.SAMPLING_ONE_CALL)
    bench.write_outputs(data, tmp_path / "out", doc, plot=False)
    assert "take turns in 5 rounds (order rotated), each turn opening with one untimed call" in doc.read_text()
    data["meta"].update(rounds=3, sampling=report.SAMPLING, turn_warm_ms=20.0)
    bench.write_outputs(data, tmp_path / "out", doc, plot=False)
    assert (
        "take turns in 3 rounds (order rotated), each turn opening with at least 20 ms of untimed calls"
        in doc.read_text()
    )
    data["meta"].update(turn_warm_ms=0.0)
    bench.write_outputs(data, tmp_path / "out", doc, plot=False)
    assert "take turns in 3 rounds (order rotated), each turn opening with one untimed call" in doc.read_text()
    data["meta"].update(rounds=7, sampling=report.SAMPLING_SHUFFLED)
    bench.write_outputs(data, tmp_path / "out", doc, plot=False)
    assert (
        "take turns in 7 rounds (order shuffled each round), each turn opening with one untimed call" in doc.read_text()
    )
    assert "stops after" not in doc.read_text()  # slow turns off (runs before experiment 66): not claimed
    data["meta"].update(slow_factor=1.5, slow_rounds=3, min_per_turn=2)
    bench.write_outputs(data, tmp_path / "out", doc, plot=False)
    assert (
        "one untimed call, timing at least 2 calls; a turn over 1.5x its row's fastest in the first "
        "round stops after 3 rounds, with Python's garbage collector off"
    ) in doc.read_text()
    data["meta"].update(slow_factor=3.0, min_per_turn=1)
    bench.write_outputs(data, tmp_path / "out", doc, plot=False)
    assert (
        "one untimed call; a turn over 3x its row's fastest in the first round stops after 3 rounds, "
        "with Python's garbage collector off"
    ) in doc.read_text()


def test_turn_order_varies_each_turns_predecessor():
    """Round 0 runs the turns as listed; later rounds shuffle them (the same way for the same row,
    round and seed), so that over the default rounds a turn follows many different turns: the
    clock a turn starts with depends on the turn before it."""
    n, rounds = 16, bench.parse_args([]).rounds
    orders = [turn_order(n, "bf16-d128-s4096-full", r, 0) for r in range(rounds)]
    assert orders[0] == list(range(n)) and all(sorted(o) == list(range(n)) for o in orders)
    assert orders == [turn_order(n, "bf16-d128-s4096-full", r, 0) for r in range(rounds)]
    assert orders[1] != turn_order(n, "bf16-d128-s8192-full", 1, 0)
    predecessors = {t: {o[o.index(t) - 1] for o in orders if o.index(t)} for t in range(n)}
    assert rounds >= 5 and min(len(p) for p in predecessors.values()) >= 3


def test_turn_warm_up_lasts_turn_warm_ms():
    """Each turn opens with enough untimed calls for --turn-warm-ms at the estimated time per
    call (at least one, at most 200 for host-bound tiny calls), then its timed repetitions."""
    import contextlib

    assert [warm_calls(est, 20.0) for est in (0.05, 0.3, 2.0, 7.0, 40.0)] == [200, 67, 10, 3, 1]
    assert warm_calls(2.0, 0.0) == 1 and bench.parse_args([]).turn_warm_ms == bench.TURN_WARM_MS
    runner = Runner(bench.parse_args(["--smoke-cpu", "--rounds", "2", "--turn-warm-ms", "6"]), Log(None, echo=False))
    calls = []
    w = dict(est=2.0, reps=4, inner=1, first_call_s=0.0)
    entry = {"results": {"a": {"fwd": {"status": "pending", "peak_mib": None}}}}
    runner.measure_rounds(
        grid.smoke_grid()[0], entry, [("a", "fwd", lambda: calls.append(1), contextlib.nullcontext, w)]
    )
    assert len(calls) == 2 * (3 + 2) and entry["results"]["a"]["fwd"]["reps"] == 4  # 3 untimed + 2 timed per turn


def test_run_row_records_each_modes_choice():
    """A smoke row on the CPU through run_row: sdpa() and policy="fastest" record the backend
    they chose in each mode (the forward may choose a forward-only backend), "fastest" the
    backends it timed, and every result is measured and checked.  Independent of the machine's
    speed: no time budget (a loaded machine once ran past the default's 550 s and skipped a
    mode), and two CPU backends to choose from (the Triton interpreter's calls take seconds)."""
    args = bench.parse_args(
        ["--smoke-cpu", "--impls", "sdpa,fastest", "--rounds", "1", "--target-ms", "1", "--max-reps", "3"]
        + ["--budget-s", "inf"]
    )
    runner = Runner(args, Log(None, echo=False))
    row = grid.select_rows(grid.smoke_grid(), ["*s128-full"])[0]
    with ad.use_backends("torch_cpu", "math"):
        entry = runner.run_row(row, ["sdpa", "fastest"])
    for impl in ("sdpa", "fastest"):
        for m in grid.MODES:
            r = entry["results"][impl][m]
            assert r["status"] == "ok" and r["backend"] and r["ms"] > 0, (impl, m, r)
    for m in grid.MODES:
        fastest = entry["results"]["fastest"][m]
        assert fastest["backend"] in fastest["measured"] and len(fastest["measured"]) >= 2
        assert set(fastest["measured"]) <= set(fastest["eligible"]) and fastest["failed"] == {}
        assert set(fastest["measured_samples"]) == set(fastest["measured"])


def test_plot_links_are_relative(tmp_path):
    pytest.importorskip("matplotlib")
    data = fake_data()
    doc = tmp_path / "docs" / "benchmarks.md"
    bench.write_outputs(data, tmp_path / "out", doc, plot=True)
    assert (tmp_path / "out" / "bench_bf16_d128.png").stat().st_size > 10000
    assert "](../out/bench_bf16_d128.png)" in doc.read_text()


def test_error_notes_group_rows():
    rows = grid.build_grid(quick=True)[:5]
    entries = [make_entry(r, {"triton": "err"}) for r in rows]
    notes = report.error_notes(entries)
    assert len(notes) == 2  # fwd and fwd+bwd
    assert "and 2 more" in notes[0] and "RuntimeError: boom" in notes[0]


# ---- arguments ------------------------------------------------------------------------------------


def test_parse_args_defaults():
    a = bench.parse_args([])
    assert not a.quick and a.out == Path("benchmarks/results") and a.doc == Path("docs/benchmarks.md")
    assert a.budget_s == bench.DEFAULT_BUDGET_S and a.flex_budget_s == bench.DEFAULT_FLEX_BUDGET_S
    assert a.impls == grid.IMPLS and a.flex_dims == (64, 128) and a.flex_dtypes == ("bf16",)


def test_parse_args_quick_and_lists():
    a = bench.parse_args(
        [
            "--quick",
            "--out",
            "/tmp/x",
            "--doc",
            "/tmp/x/b.md",
            "--commit",
            "abc",
            "--rows",
            "bf16-d128-s4096-*",
            "varlen",
            "--impls",
            "triton,cudnn",
            "--flex-dims",
            "128",
        ]
    )
    assert a.quick and a.budget_s == bench.QUICK_BUDGET_S and a.flex_budget_s == bench.QUICK_FLEX_BUDGET_S
    assert a.out == Path("/tmp/x") and a.commit == "abc" and a.rows == ["bf16-d128-s4096-*", "varlen"]
    assert a.impls == ("triton", "cudnn") and a.flex_dims == (128,)
    assert bench.parse_args(["--budget-s", "100"]).budget_s == 100


@pytest.mark.parametrize(
    "argv",
    [
        ["--impls", "nope"],
        ["--flex-dtypes", "fp8"],
        ["--flex-dims", "x"],
        ["--flex-from-s", "-1"],
        ["--slow-rounds", "0"],
        ["--min-per-turn", "0"],
    ],
)
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_git_commit_explicit():
    assert bench.git_commit("cafe") == "cafe"
    assert isinstance(bench.git_commit(None), str)


def test_main_list_rows_and_from_json(tmp_path, capsys):
    assert bench.main(["--quick", "--list-rows"]) == 0
    assert "bf16-d128-s16384-full-window" in capsys.readouterr().out
    src = tmp_path / "in.json"
    src.write_text(json.dumps(fake_data()))
    assert (
        bench.main(
            ["--from-json", str(src), "--out", str(tmp_path / "o"), "--doc", str(tmp_path / "b.md"), "--no-plot"]
        )
        == 0
    )
    assert "bf16 hdim 128" in capsys.readouterr().out and (tmp_path / "b.md").exists()


def test_help_runs(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out


def test_overhead_script_imports():
    mod = _load("overhead")
    calls = []
    med, best = mod.per_call_us(lambda: calls.append(1), n=5, repeat=3, sync=lambda: None)
    assert best <= med and len(calls) == 10 + 15


def test_overhead_paired_ratio_times_both_in_every_round():
    """The interleaved ratio times each function in every round, alternating which goes
    first, and reports the median of the per-round ratios."""
    mod = _load("overhead")
    order = []

    def slow():
        order.append("slow")
        time.sleep(0.002)

    def fast():
        order.append("fast")

    ratio, rounds = mod.paired_ratio(fast, slow, n=3, repeat=4, sync=lambda: None)
    timed = order[20:]  # after 10 warm-up calls of each
    assert (
        timed
        == ["fast"] * 3
        + ["slow"] * 3
        + ["slow"] * 3
        + ["fast"] * 3
        + ["fast"] * 3
        + ["slow"] * 3
        + ["slow"] * 3
        + ["fast"] * 3
    )
    assert len(rounds) == 4 and ratio == statistics.median(rounds) and min(rounds) > 10


def test_fastest_ratio_counts_our_backends_per_mode():
    """policy="fastest" is compared with the best backend it could choose in that mode: a
    forward-only backend counts for the (no_grad) forward, FlexAttention (not a backend of
    ours) never does."""

    def cell(fwd, fwd_bwd=None):
        c = {"fwd": {"status": "ok", "tflops": fwd}}
        c["fwd+bwd"] = {"status": "ok", "tflops": fwd_bwd} if fwd_bwd else {"status": "unsupported"}
        return c

    entry = {
        "results": {
            "fastest": cell(90.0, 60.0),
            "fa4": cell(100.0),
            "cudnn": cell(80.0, 75.0),
            "flex": cell(500.0, 500.0),
        }
    }
    assert targets.choice_ratio(entry, "fwd") == pytest.approx(0.9)
    assert targets.choice_ratio(entry, "fwd+bwd") == pytest.approx(0.8)
    # only the backends it timed (those claiming the row) count, when the run recorded them
    entry["results"]["fastest"]["fwd"]["measured"] = ["triton", "cudnn"]
    assert targets.choice_ratio(entry, "fwd") == pytest.approx(90.0 / 80.0)
    entry["results"]["fastest"]["fwd"]["measured"] = ["cudnn", "flash_attn"]
    assert targets.choice_ratio(entry, "fwd") == pytest.approx(0.9)
    # an eligible backend that failed while timed still counts: pinned, it runs its column
    entry["results"]["fastest"]["fwd"].update(
        measured=["triton", "cudnn"],
        eligible=["flash_attn", "triton", "cudnn"],
        failed={"flash_attn": "TypeError: ..."},
    )
    assert targets.choice_ratio(entry, "fwd") == pytest.approx(0.9)
    entry["results"]["fastest"]["fwd"] = {"status": "err"}
    assert targets.choice_ratio(entry, "fwd") is None


def test_fastest_misses_say_whether_the_choice_was_the_best_column(tmp_path):
    """A row where policy="fastest" reads below 0.97 of the best backend is listed with its
    choice: the best column's own backend (two measurements of one kernel) or another one (a
    wrong choice); both reach the target's line in the printed and Markdown reports."""
    rows = [Row("bf16", 128, 512, True), Row("bf16", 128, 4096, False), Row("fp16", 64, 16384, False)]
    per = {"triton": (500, 450), "cudnn": (480, 440), "fa4": (520, 430)}
    entries = [make_entry(r, dict(per, fastest=f)) for r, f in zip(rows, [(520, 430), (515, 440), (510, 400)])]
    for e, chose in zip(entries, [("flash_attn", "triton"), ("flash_attn", "triton"), ("flash_attn", "cudnn")]):
        for m, name in zip(grid.MODES, chose):
            e["results"]["fastest"][m]["backend"] = name
    misses = targets.choice_misses(entries, "fwd+bwd")
    assert [(m["row"], m["chose"], m["best"], m["same_backend"]) for m in misses] == [
        ("bf16-d128-s512-causal", "triton", "triton", True),  # 430 / 450: ours, timed twice
        ("fp16-d64-s16384-full", "cudnn", "triton", False),
    ]  # 400 / 450: a wrong choice
    assert misses[0]["ratio"] == pytest.approx(430 / 450, abs=1e-3)
    assert targets.choice_misses(entries, "fwd") == []  # 0.98-1.0 of flash-attn 4's 520
    data = {"meta": dict(gpu="g", impls=list(grid.IMPLS)), "rows": entries}
    table = bench.write_outputs(data, tmp_path, None, plot=False)
    assert (
        "below: bf16-d128-s512-causal 0.96 (chose triton, the best column: one kernel timed twice); "
        "fp16-d64-s16384-full 0.89 (chose cudnn, the best: triton)"
    ) in table
    target = next(t for t in data["targets"] if t["target"].startswith("policy=fastest fwd+bwd"))
    assert target["status"] == "not met" and len(target["misses"]) == 2
    assert "one kernel timed twice" in report.targets_table(data["targets"])[1][-1][-1]


def test_time_fn_enqueues_repetitions_back_to_back(monkeypatch):
    """Repetitions are not separated by synchronisations (steady-state device time): one
    sync after the warm-up call, one at the end; every repetition has its own events."""
    args = bench.parse_args(["--smoke-cpu", "--target-ms", "5", "--max-reps", "7"])
    runner = Runner(args, Log(None, echo=False))
    log = []
    monkeypatch.setattr(runner, "sync", lambda: log.append("sync"))

    def fn():
        log.append(("call", gc.isenabled()))
        sum(range(20000))  # ~0.5-1 ms on the host clock

    assert gc.isenabled()
    r = runner.time_fn(fn)
    assert gc.isenabled()  # restored after the timed repetitions
    log = [x if x == "sync" else x[0] + ("" if x[1] else "-gc-off") for x in log]
    assert r["reps"] >= 3 and r["ms"] > 0 and len(r["samples_ms"]) == r["reps"]
    assert abs(r["ms"] - lower_quartile(r["samples_ms"])) < 1e-3
    assert abs(r["ms_median"] - statistics.median(r["samples_ms"])) < 1e-3 and r["ms"] <= r["ms_median"]
    timed = log[log.index("sync", 2) + 1 :]  # after the first call's two syncs
    assert timed.count("sync") == 1 and timed[-1] == "sync"
    calls = [x for x in timed if x != "sync"]
    # estimate + warm-up with the collector on, then the timed repetitions with it off
    assert calls == ["call"] * 2 + ["call-gc-off"] * (r["reps"] * r["inner"])


def test_ratios_summary_and_targets():
    from benchmarks import ratios

    s = ratios.summarise([400.0, 500.0, 450.0])
    assert s["tflops"] == 450.0 and abs(s["spread"] - 100 / 450) < 1e-12
    cell = lambda f, fb: {"fwd": {"tflops": f}, "fwd+bwd": {"tflops": fb}}  # noqa: E731
    results = {
        "bf16-d128-s4096-full": {"triton": cell(500, 400), "cudnn": cell(625, 500), "flex": cell(400, 400)},
        "bf16-d128-s4096-causal": {"triton": cell(450, 380), "cudnn": cell(500, 400)},
        "bf16-d128-s4096-full-bias": {"triton": cell(400, 360), "cudnn": cell(300, 300)},
    }
    text = "\n".join(ratios.ratio_lines(results))
    assert "triton/cudnn fwd      worst 0.80  (rows: 0.80 0.90)  target 0.85" in text
    assert "triton/cudnn fwd+bwd  worst 0.80" in text and "triton/flex fwd      worst 1.25" in text
    assert "bias fwd+bwd triton/cudnn 1.20  target 1.5" in text and "fa4" not in text


def test_merge_runs_of_a_grid_measured_in_parts(tmp_path, capsys):
    """Two device calls, each with --rows, one report: every row once, a row measured in both
    parts keeps the entry with more measured cells, both parts named in the notes."""
    full = fake_data()
    first = {"meta": dict(full["meta"], commit="aaa", elapsed_s=300.0), "rows": full["rows"][:5]}
    second = {
        "meta": dict(full["meta"], commit="bbb", date="e", elapsed_s=200.0, notes=["other"]),
        "rows": full["rows"][4:],
    }
    skipped = {impl: {m: dict(status="skipped", note="time budget") for m in grid.MODES} for impl in grid.IMPLS}
    second["rows"][0] = {"row": full["rows"][4]["row"], "results": skipped}  # ran out of time in part 2
    merged = bench.merge_runs([first, second])
    ids = [grid.Row.from_json(e["row"]).id for e in merged["rows"]]
    assert ids == [grid.Row.from_json(e["row"]).id for e in full["rows"]]
    assert merged["rows"][4] is first["rows"][4]
    assert merged["meta"]["commit"] == "aaa + bbb" and merged["meta"]["elapsed_s"] == 500.0
    assert "a note" in merged["meta"]["notes"] and "other" in merged["meta"]["notes"]
    assert any("merged from 2 runs" in n for n in merged["meta"]["notes"])
    assert bench.merge_runs([first]) is first
    paths = []
    for i, part in enumerate((first, second)):
        paths.append(tmp_path / f"p{i}.json")
        paths[-1].write_text(json.dumps(part))
    assert (
        bench.main(
            [
                "--from-json",
                *map(str, paths),
                "--out",
                str(tmp_path / "o"),
                "--doc",
                str(tmp_path / "b.md"),
                "--no-plot",
            ]
        )
        == 0
    )
    assert "aaa + bbb" in (tmp_path / "b.md").read_text()


def test_compile_groups_keep_shared_kernels_together_and_balance():
    """Rows differing only in S share their Triton kernels: one worker gets all of them;
    every row lands in exactly one part; the heaviest groups (Flex compiles per shape) are
    spread first, so no part is empty while another holds two heavy groups."""
    rows = grid.build_grid()
    impls = list(grid.IMPLS)
    parts = bench.compile_groups(rows, impls, workers=8)
    assert len(parts) == 8
    assert sorted(r.id for p in parts for r in p) == sorted(r.id for r in rows)
    where = {r.id: i for i, p in enumerate(parts) for r in p}
    for r in rows:
        for other in rows:
            if (r.dtype, r.D, r.causal, r.feature) == (other.dtype, other.D, other.causal, other.feature):
                assert where[r.id] == where[other.id]
    bf16_d128 = [i for i, p in enumerate(parts) for r in p if r.id in ("bf16-d128-s512-full", "bf16-d128-s512-causal")]
    assert bf16_d128[0] != bf16_d128[1]  # two of the heaviest groups: different workers
    one = bench.compile_groups(rows, impls, workers=1)
    assert len(one) == 1 and sorted(r.id for r in one[0]) == sorted(r.id for r in rows)
    assert len(bench.compile_groups(rows[:3], impls, workers=8)) <= 3  # never an empty part


def test_precompile_workers_run_every_row_and_report_errors(tmp_path):
    """The compile workers (this script with --compile-only) run each selected row once per
    implementation and mode; a failure inside a worker is reported, not raised (on the CPU,
    Flex has no backward: its fwd+bwd call fails in every row)."""
    args = bench.parse_args(
        # no time limit that a loaded machine could reach: what is tested is the count, not the speed
        ["--smoke-cpu", "--out", str(tmp_path), "--impls", "sdpa,flex,cudnn", "--precompile-workers", "2"]
        + ["--precompile-s", "3600"]
    )
    rows = grid.select_rows(grid.smoke_grid(), ["*s128-full", "*varlen4-causal"])
    lines = []
    summary = bench.precompile(args, rows, lines.append)
    assert summary["workers"] == 2 and summary["killed"] == 0
    assert summary["rows"] == summary["of"] == len(rows) == 2
    assert len(summary["errors"]) == 2 and all("flex: NotImplementedError" in e for e in summary["errors"])
    assert lines and lines[0].startswith("precompile: 2/2 rows compiled by 2 workers")
    assert sorted(p.name for p in tmp_path.glob("precompile-*.log")) == ["precompile-0.log", "precompile-1.log"]
    # nothing compiles: no worker at all
    quiet = bench.parse_args(["--smoke-cpu", "--out", str(tmp_path), "--impls", "cudnn", "--precompile-workers", "2"])
    assert bench.precompile(quiet, rows, lines.append) == {"workers": 0}
    assert bench.parse_args(["--smoke-cpu"]).precompile_workers == 0


def test_smoke_cpu_never_replaces_the_gpu_report(tmp_path):
    """The committed docs/benchmarks.md, bench.json and plots are the GPU grid's: a CPU smoke
    run writes into benchmarks/results/smoke-cpu (git-ignored) and its report into --out unless
    --doc says otherwise; a GPU run regenerates the committed ones."""
    assert bench.parse_args(["--smoke-cpu", "--out", str(tmp_path)]).doc == tmp_path / "benchmarks.md"
    smoke = bench.parse_args(["--smoke-cpu"])
    assert smoke.out == Path("benchmarks/results/smoke-cpu") and smoke.doc == smoke.out / "benchmarks.md"
    gpu = bench.parse_args([])
    assert gpu.out == Path("benchmarks/results") and gpu.doc == Path("docs/benchmarks.md")
    assert bench.parse_args(["--smoke-cpu", "--doc", str(tmp_path / "x.md")]).doc == tmp_path / "x.md"
    assert bench.parse_args([]).precompile_workers == bench.DEFAULT_PRECOMPILE_WORKERS


def test_measure_rounds_interleave_in_turn_order():
    """A row's measurements run in --rounds rounds, each in turn_order's order, each turn
    opening with untimed calls (here the minimum, one); each result is the median of all its
    timed repetitions; a call that fails is reported as an error and skipped in later rounds."""
    import contextlib

    args = bench.parse_args(["--smoke-cpu", "--rounds", "3", "--turn-warm-ms", "0"])
    runner = Runner(args, Log(None, echo=False))
    order = []

    def make(name, fail=False):
        def fn():
            order.append(name)
            if fail:
                raise RuntimeError("boom")

        return fn

    w = dict(est=1.0, reps=6, inner=1, first_call_s=0.0)
    entry = {"results": {n: {"fwd": {"status": "pending", "peak_mib": None}} for n in "abc"}}
    pending = [(n, "fwd", make(n, fail=n == "c"), contextlib.nullcontext, w) for n in "abc"]
    row = grid.smoke_grid()[0]
    runner.measure_rounds(row, entry, pending)
    want = "".join("abc"[i] * (3 if i < 2 else 1) for i in turn_order(3, row.id, 0, args.seed))
    for rnd in (1, 2):
        want += "".join("ab"[i] * 3 for i in turn_order(3, row.id, rnd, args.seed) if i < 2)
    assert "".join(order) == want and want.startswith("aaabbbc")
    for n in "ab":
        r = entry["results"][n]["fwd"]
        assert r["status"] == "ok" and r["reps"] == 6 and r["rounds"] == 3 and r["ms"] > 0 and r["tflops"] > 0
    assert entry["results"]["c"]["fwd"] == {"status": "error", "note": "RuntimeError: boom"}


def test_read_run_takes_plain_and_gzipped_json(tmp_path):
    import gzip

    data = {"meta": {"commit": "abc"}, "rows": [{"row": {"S": 512}}]}
    (tmp_path / "a.json").write_text(json.dumps(data))
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    assert bench.read_run(tmp_path / "a.json") == data == bench.read_run(tmp_path / "b.json.gz")


def test_slow_turns_compare_within_a_mode():
    """A turn is slow when its first-round time exceeds the factor times the fastest of the
    same mode (a forward is never compared with a training call); factor 0 keeps all."""
    first = {0: ("fwd", 1.0), 1: ("fwd", 1.49), 2: ("fwd", 1.51), 3: ("fwd+bwd", 3.0), 4: ("fwd+bwd", 4.6)}
    assert slow_turns(first, 1.5) == {2, 4}
    assert slow_turns(first, 0) == set() and slow_turns({}, 1.5) == set()
    assert slow_turns(first, 1.5, keep={2}) == {4}  # kept turns are never trimmed


def test_measure_rounds_stop_slow_turns_and_time_contenders_longer():
    """After the first round, a turn over --slow-factor times its row's fastest takes only
    --slow-rounds rounds; every other turn times at least --min-per-turn calls, even a long
    call whose repetitions (3) would give one per round.  policy="fastest" (as sdpa and triton)
    is never trimmed, however slow its first turn."""
    import contextlib
    import time

    args = bench.parse_args(
        [
            "--smoke-cpu",
            "--rounds",
            "5",
            "--turn-warm-ms",
            "0",
            "--slow-rounds",
            "2",
            "--slow-factor",
            "1.5",
            "--min-per-turn",
            "2",
        ]
    )
    runner = Runner(args, Log(None, echo=False))
    calls = {"fast": 0, "close": 0, "slow": 0, "fastest": 0}

    def make(name, seconds):
        def fn():
            calls[name] += 1
            time.sleep(seconds)

        return fn

    w = dict(est=8.0, reps=3, inner=1, first_call_s=0.0)
    entry = {"results": {n: {"fwd": {"status": "pending", "peak_mib": None}} for n in calls}}
    pending = [
        (n, "fwd", make(n, s), contextlib.nullcontext, w)
        for n, s in (("fast", 0.010), ("close", 0.010), ("slow", 0.060), ("fastest", 0.060))
    ]
    runner.measure_rounds(grid.smoke_grid()[0], entry, pending)
    per_turn = 1 + 2  # one untimed call, then the timed ones
    assert calls == {"fast": 5 * per_turn, "close": 5 * per_turn, "slow": 2 * per_turn, "fastest": 5 * per_turn}
    res = {n: entry["results"][n]["fwd"] for n in calls}
    assert [res[n]["rounds"] for n in calls] == [5, 5, 2, 5]
    assert [res[n]["reps"] for n in calls] == [5 * 2] * 2 + [2 * 2] + [5 * 2]
    assert max(res["fast"]["ms"], res["close"]["ms"]) < res["slow"]["ms"]


def test_pair_choices_put_our_policies_next_to_their_choice():
    """policy="fastest"'s turn of each mode lands right after the turn of the column it chose in
    even rounds and right before it in odd ones, default sdpa()'s the other way round, so both sit
    next to their choice every round even when they chose one column; every turn stays once; a
    choice without a column in the row leaves the order alone."""
    turns = [
        ("sdpa", "fwd"),
        ("fastest", "fwd"),
        ("triton", "fwd"),
        ("fa4", "fwd"),
        ("sdpa", "fwd+bwd"),
        ("fastest", "fwd+bwd"),
        ("triton", "fwd+bwd"),
        ("cudnn", "fwd+bwd"),
    ]
    chosen = {
        ("fastest", "fwd"): "fa4",
        ("sdpa", "fwd"): "fa4",  # both policies chose one column
        ("fastest", "fwd+bwd"): "triton",
        ("sdpa", "fwd+bwd"): "cudnn",
    }
    for rnd in range(6):
        order = turn_order(len(turns), "bf16-d128-s512-causal", rnd, 0)
        paired = pair_choices(order, turns, chosen, rnd)
        assert sorted(paired) == list(range(len(turns)))
        for (impl, mode), column in chosen.items():
            f, c = paired.index(turns.index((impl, mode))), paired.index(turns.index((column, mode)))
            side = 1 if impl == "fastest" else -1
            assert f - c == (side if rnd % 2 == 0 else -side), (impl, mode, rnd, paired)
        mine = {"fastest", "sdpa"}
        others = [i for i in paired if turns[i][0] not in mine]
        assert others == [i for i in order if turns[i][0] not in mine]  # the rest keep their order
    order = turn_order(len(turns), "x", 3, 0)
    assert pair_choices(order, turns, {("fastest", "fwd"): "math"}, 3) == order
    assert pair_choices(order, turns, {}, 3) == order


def test_measure_rounds_time_fastest_next_to_its_choice():
    """Through measure_rounds: the "fastest" turn follows its choice's turn in even rounds and
    precedes it in odd ones (PAIR_FASTEST), rounds 2k and 2k + 1 in one order; --no-pair-fastest
    leaves the shuffled order."""
    import contextlib

    seen = []
    for flags, paired in (([], True), (["--no-pair-fastest"], False)):
        args = bench.parse_args(["--smoke-cpu", "--rounds", "6", "--turn-warm-ms", "0", "--slow-factor", "0"] + flags)
        assert args.pair_fastest is paired
        runner = Runner(args, Log(None, echo=False))
        log = []
        names = ("sdpa", "fastest", "triton", "cudnn", "fa4")

        def make(name):
            return lambda: log.append(name)

        w = dict(est=0.6, reps=6, inner=1, first_call_s=0.0)
        entry = {"results": {n: {"fwd": {"status": "pending", "peak_mib": None}} for n in names}}
        entry["results"]["fastest"]["fwd"]["backend"] = "flash_attn"  # the fa4 column's backend
        pending = [(n, "fwd", make(n), contextlib.nullcontext, w) for n in names]
        runner.measure_rounds(grid.smoke_grid()[0], entry, pending)
        assert len(log) == 6 * len(names) * 2  # a turn: one untimed call and one timed (6 reps / 6 rounds)
        turns = log[::2]
        rounds = [turns[r * len(names) : (r + 1) * len(names)] for r in range(6)]
        assert all(sorted(r) == sorted(names) for r in rounds)
        steps = [r.index("fastest") - r.index("fa4") for r in rounds]
        seen.append(steps)
        if paired:
            assert steps == [1, -1, 1, -1, 1, -1]
            assert entry["results"]["fastest"]["fwd"]["paired_with"] == "fa4"  # the reading pairs them

            # rounds 2k and 2k + 1: one order, only the pair swapped, so both sides go first after
            # the same turn; the pairs of rounds differ (shuffled)
            def pair_as_one(r):
                return [n for n in r if n != "fastest"]

            for k in range(3):
                a, b = rounds[2 * k], rounds[2 * k + 1]
                assert pair_as_one(a) == pair_as_one(b)
                first_a, first_b = a.index("fa4"), b.index("fastest")
                assert first_a == first_b and a[:first_a] == b[:first_b]
            assert len({tuple(pair_as_one(r)) for r in rounds}) > 1
        else:
            assert "paired_with" not in entry["results"]["fastest"]["fwd"]
    assert seen[1] != seen[0]  # unpaired, the shuffle decides


def test_measure_rounds_time_the_default_on_the_other_side_of_its_choice():
    """Default sdpa() chose the same backend as policy="fastest": in each round the default goes
    right before that column and fastest right after it (even rounds), the other way in odd ones;
    both cells name the column they were paired with, which the default's target then reads."""
    import contextlib

    args = bench.parse_args(["--smoke-cpu", "--rounds", "6", "--turn-warm-ms", "0", "--slow-factor", "0"])
    runner = Runner(args, Log(None, echo=False))
    log = []
    names = ("sdpa", "fastest", "triton", "cudnn", "fa4")
    w = dict(est=0.6, reps=6, inner=1, first_call_s=0.0)
    entry = {"results": {n: {"fwd": {"status": "pending", "peak_mib": None}} for n in names}}
    for policy in ("sdpa", "fastest"):
        entry["results"][policy]["fwd"]["backend"] = "flash_attn"  # the fa4 column's backend
    pending = [(n, "fwd", (lambda n=n: log.append(n)), contextlib.nullcontext, w) for n in names]
    runner.measure_rounds(grid.smoke_grid()[0], entry, pending)
    turns = log[::2]
    rounds = [turns[r * len(names) : (r + 1) * len(names)] for r in range(6)]
    assert [r.index("fastest") - r.index("fa4") for r in rounds] == [1, -1] * 3
    assert [r.index("sdpa") - r.index("fa4") for r in rounds] == [-1, 1] * 3
    assert all(entry["results"][p]["fwd"]["paired_with"] == "fa4" for p in ("sdpa", "fastest"))


def test_default_target_reads_the_default_paired_with_its_choice(tmp_path):
    """Issue 35's target (default sdpa() >= 0.95x the best eligible backend in every row) reads the
    default like policy="fastest": paired with the column it chose where both took one call a turn,
    so one kernel timed twice reads ~1.0; a wrong choice is a miss naming the best backend."""
    import random

    rng = random.Random(7)
    base = [4.0 * (1 + 0.2 * rng.random()) for _ in range(11)]  # a 20% spread between rounds
    e = paired_entry([b * 1.01 for b in base], base)  # fastest (= fa4 column) 1% slower
    res = e["results"]
    f = grid.flops(Row.from_json(e["row"]), "fwd+bwd")
    res["sdpa"] = {"fwd+bwd": dict(res["fastest"]["fwd+bwd"], samples_ms=[x * 1.005 for x in base])}
    direct = lower_quartile([x * 1.005 for x in base])  # its lower quartile read 6% high (a slow clock)
    res["sdpa"]["fwd+bwd"].update(ms=direct * 1.06, tflops=f / (direct * 1.06 * 1e9))
    assert targets.choice_ratio(e, "fwd+bwd", "sdpa", paired=False) == pytest.approx(1 / 1.005 / 1.06, abs=2e-3)
    assert targets.choice_ratio(e, "fwd+bwd", "sdpa") == pytest.approx(1 / 1.005, abs=2e-3)
    data = {"meta": dict(gpu="g", impls=list(grid.IMPLS), pair_fastest=True, pair_default=True), "rows": [e]}
    bench.write_outputs(data, tmp_path, None, plot=False)
    target = next(t for t in data["targets"] if t["target"].startswith("default sdpa() (auto) fwd+bwd >= 0.95x"))
    assert target["status"] == "met" and target["paired_rows"] == 1 and target["misses"] == []
    # the default chose cuDNN, 20% slower than flash-attn 4's column: a miss, the best named
    res["sdpa"]["fwd+bwd"] = dict(res["cudnn"]["fwd+bwd"], backend="cudnn")
    res["cudnn"]["fwd+bwd"] = dict(res["cudnn"]["fwd+bwd"], samples_ms=[x * 1.2 for x in base])
    res["cudnn"]["fwd+bwd"].update(ms=lower_quartile(res["cudnn"]["fwd+bwd"]["samples_ms"]))
    res["cudnn"]["fwd+bwd"]["tflops"] = f / (res["cudnn"]["fwd+bwd"]["ms"] * 1e9)
    res["sdpa"]["fwd+bwd"].update(samples_ms=res["cudnn"]["fwd+bwd"]["samples_ms"], paired_with="cudnn")
    for k in ("ms", "tflops"):
        res["sdpa"]["fwd+bwd"][k] = res["cudnn"]["fwd+bwd"][k]
    misses = targets.choice_misses([e], "fwd+bwd", 0.95, "sdpa")
    assert [(m["chose"], m["best"], m["same_backend"], m["paired"]) for m in misses] == [
        ("cudnn", "flash_attn", False, True)
    ]
    assert misses[0]["ratio"] == pytest.approx(1 / 1.2, abs=5e-3)


def paired_entry(fastest_ms, column_ms, best_ms=None, per_turn=1):
    """A row whose fastest (fwd+bwd) chose flash_attn and was paired with the fa4 column; cuDNN
    at ``best_ms`` (default: slower than both).  Samples per round as given."""
    row = Row("bf16", 128, 16384, False)
    f = grid.flops(row, "fwd+bwd")

    def cell(samples, **kw):
        ms = lower_quartile(samples)
        return dict(
            status="ok", ms=ms, tflops=f / (ms * 1e9), samples_ms=samples, rounds=len(samples) // per_turn, **kw
        )

    best_ms = best_ms or [2 * max(column_ms)] * len(column_ms)
    results = {
        "fastest": {"fwd+bwd": cell(fastest_ms, backend="flash_attn", paired_with="fa4")},
        "fa4": {"fwd+bwd": cell(column_ms)},
        "cudnn": {"fwd+bwd": cell(best_ms)},
    }
    return {"row": row.to_json(), "results": results}


def test_paired_reading_cancels_the_turn_order():
    """One kernel timed twice, its turns side by side: the turn that goes second runs ~8% slower
    (the clock state the first left).  fastest goes second in even rounds, so with 11 rounds it
    is second 6 times: the plain median of the per-round ratios reads it slower; the ABBA reading
    (even and odd rounds' medians averaged) reads 1.0."""
    import random

    rng = random.Random(5)
    base = [14.0 * (1 + 0.004 * rng.random()) for _ in range(11)]
    slow = 1.08
    fastest = [b * (slow if r % 2 == 0 else 1.0) for r, b in enumerate(base)]
    column = [b * (1.0 if r % 2 == 0 else slow) for r, b in enumerate(base)]
    e = paired_entry(fastest, column)
    logs = [math.log(c / f) for f, c in zip(fastest, column)]
    assert statistics.median(logs) < math.log(0.95)  # the naive paired median
    assert abs(targets.paired_log_ratio(e, "fwd+bwd")) < 0.005
    assert targets.choice_ratio(e, "fwd+bwd") == pytest.approx(1.0, abs=0.005)
    # a real difference survives: fastest 5% slower in every round, whatever the order
    e = paired_entry([x * 1.05 for x in fastest], column)
    assert targets.choice_ratio(e, "fwd+bwd") == pytest.approx(1 / 1.05, abs=0.005)
    # and a wrong choice still counts: the chosen column against a faster best column
    e = paired_entry(fastest, column, best_ms=[12.0] * 11)
    assert targets.choice_ratio(e, "fwd+bwd") == pytest.approx(
        lower_quartile([e["results"]["cudnn"]["fwd+bwd"]["ms"]]) / e["results"]["fa4"]["fwd+bwd"]["ms"], abs=0.005
    )


def test_paired_reading_only_for_one_call_a_turn_of_paired_columns():
    """No pairing recorded, a different number of rounds or several calls a turn (short cells,
    host-bound at times): the lower quartiles' ratio."""
    fastest, column = [14.0, 15.0] * 6, [15.0, 14.0] * 6
    for change in ("unpaired", "rounds", "per_turn"):
        e = paired_entry(fastest, column, per_turn=2 if change == "per_turn" else 1)
        cell = e["results"]["fastest"]["fwd+bwd"]
        if change == "unpaired":
            cell.pop("paired_with")
        if change == "rounds":
            e["results"]["fa4"]["fwd+bwd"]["rounds"] -= 1
        assert targets.paired_log_ratio(e, "fwd+bwd") is None, change
        assert targets.choice_ratio(e, "fwd+bwd") == targets.choice_ratio(e, "fwd+bwd", paired=False)


def test_read_run_names_the_paired_column_of_older_runs(tmp_path):
    """Runs with pair_fastest from before paired_with was recorded: the loader names the chosen
    column (the one measure_rounds paired with); runs without pair_fastest get none."""
    e = paired_entry([14.0] * 11, [14.0] * 11)
    e["results"]["fastest"]["fwd+bwd"].pop("paired_with")
    for paired in (True, False):
        path = tmp_path / f"run{paired}.json"
        path.write_text(json.dumps({"meta": {"pair_fastest": paired}, "rows": [e]}))
        cell = bench.read_run(path)["rows"][0]["results"]["fastest"]["fwd+bwd"]
        assert cell.get("paired_with") == ("fa4" if paired else None)


def test_fastest_target_reports_the_direct_reading_too(tmp_path):
    """The fastest target's note says how many rows were read paired and what the lower
    quartiles alone would read."""
    # the column's first turns (even rounds) found a faster clock than fastest's first turns (odd
    # rounds); each second turn ran 8% slower than the first: lower quartiles read 13 / 14
    fastest = [13.0 * 1.08 if r % 2 == 0 else 14.0 for r in range(11)]
    column = [13.0 if r % 2 == 0 else 14.0 * 1.08 for r in range(11)]
    entries = [paired_entry(fastest, column)]
    target = next(t for t in targets.evaluate_targets(entries) if t["target"].startswith("policy=fastest fwd+bwd"))
    assert target["status"] == "met" and target["paired_rows"] == 1
    assert target["direct_below"] == 1 and target["direct_worst"] < 0.97
    assert "1 rows read paired" in report.target_note(target) and "lower quartiles alone" in report.target_note(target)
    # a row read paired and missed: its note gives the lower quartiles' reading beside it
    entries = [paired_entry([x * 1.05 for x in fastest], column)]
    target = next(t for t in targets.evaluate_targets(entries) if t["target"].startswith("policy=fastest fwd+bwd"))
    miss = target["misses"][0]
    assert target["status"] == "not met" and miss["paired"] and miss["direct"] < miss["ratio"] < 0.97
    assert (
        f"{miss['ratio']:.2f} (chose flash_attn, the best column: one kernel timed twice; read paired, "
        f"lower quartiles {miss['direct']:.2f})" in report.target_note(target)
    )


def test_pair_fastest_in_the_legend(tmp_path):
    data = fake_data()
    data["meta"].update(rounds=11, sampling=report.SAMPLING_SHUFFLED, pair_fastest=True)
    doc = tmp_path / "b.md"
    bench.write_outputs(data, tmp_path / "out", doc, plot=False)
    assert (
        "policy=\"fastest\" takes its turn next to the backend it chose (after it in even rounds, before it in odd ones"
    ) in doc.read_text()
    data["meta"].pop("pair_fastest")
    bench.write_outputs(data, tmp_path / "out", doc, plot=False)
    assert "takes its turn next to" not in doc.read_text()


# ----------------------------------------------------------------------------- compile_sm90.py


def test_compile_sm90_covers_every_sm90_entry_and_compiles_one():
    """Every sm90 table entry yields at least one case, each case's feature set is one the
    entry can be chosen for, and the smallest forward case compiles for sm90 on this
    GPU-less machine (in a process without the interpreter, which compiles nothing)."""
    import os
    import subprocess
    import torch

    cs = _load("compile_sm90")
    from attention_dispatch.kernels import configs as C

    cases = list(cs.kernel_cases())
    sm90 = [e for e in C.CONFIG_TABLE if e.min_cc == (9, 0)]
    assert {id(e) for _, e, _, _ in cases} == {id(e) for e in sm90}
    for kind, e, label, const in cases:  # the features a case compiles are ones the entry is chosen for
        banded, extras = const["HAS_WR"], const["BIAS_KIND"] != 0 or const["HAS_DROPOUT"]
        assert (
            C.candidate_configs(
                kind, e.max_block_d, e.max_block_d, torch.bfloat16, e.min_cc, 1 << 30, banded, extras
            ).count(e.config)
            == 1
        ), (e, label)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compile_sm90.py"), "--kinds", "fwd", "--limit", "1"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "1 kernels compiled for sm90, 0 failed" in run.stdout, (
        run.stdout + run.stderr[-2000:]
    )


def test_compile_sm90_ws_one_each_compiles_every_gluon_kernel_once(monkeypatch, capsys):
    """--ws-one-each: one case of each Gluon kernel and head dim the configs serve (forward per
    WS_FWD_CONFIGS, WS_FWD_SOFTCAP_CONFIGS and WS_FWD_CACHE_CONFIGS entry, and d64's two-warpgroup forward; dK/dV per
    WS_BWD_CONFIGS entry, fused too where it fuses; dQ per WS_DQ_CONFIGS entry), the first of its
    cases (dense)."""
    cs = _load("compile_sm90")
    from attention_dispatch.kernels import configs as C

    compiled = []
    monkeypatch.setattr(
        cs, "compile_ws_case", lambda d, cfg, const: (compiled.append((d, cfg, const)), (None, None))[1]
    )
    monkeypatch.setattr(cs, "_report", lambda *args: 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cs.main(["--kinds", "fwd_ws", "--ws-one-each"]) == 0
    every = list(cs.ws_cases()) + list(cs.ws_backward_cases())
    firsts = {}
    for d, cfg, label, const in every:
        kernel = (d, cfg, const.get("FUSE_DQ"), "STORE_LSE" in const, "BLOCK_N" in const)
        firsts.setdefault(kernel, (d, cfg, const))
    assert compiled == list(firsts.values())
    want = (
        len(C.WS_FWD_CONFIGS)
        + len(C.WS_FWD_SOFTCAP_CONFIGS)
        + len(C.WS_FWD_CACHE_CONFIGS)
        + (C.WS_FWD_CONFIGS[64].consumers != 2)
        + len(C.WS_BWD_CONFIGS)
        + sum(c.fuse_dq for c in C.WS_BWD_CONFIGS.values())
        + len(C.WS_DQ_CONFIGS)
    )
    assert len(compiled) == want
    assert all(c["WINDOW_LEFT"] < 0 and c["WINDOW_RIGHT"] < 0 and not c["HAS_BIAS"] for _, _, c in compiled)
    assert f"{want} kernels compiled for sm90, 0 failed" in capsys.readouterr().out


def test_compile_sm90_reports_a_compiler_crash(monkeypatch, capsys):
    cs = _load("compile_sm90")

    def crash(*a, **k):
        raise RuntimeError("PTXAS error: `ptxas` failed with error code -11")

    monkeypatch.setattr(cs.triton, "compile", crash)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cs.main(["--limit", "1"]) == 2 and "interpreter compiles nothing" in capsys.readouterr().out
    monkeypatch.delenv("TRITON_INTERPRET")
    assert cs.main(["--kinds", "bwd_dq", "--limit", "2"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAILED bwd_dq") == 2 and "error code -11" in out
    assert "2 kernels compiled for sm90, 2 failed" in out


def test_lower_quartile_is_robust_to_one_lucky_repetition_and_to_slow_ones():
    # Slowdowns (clock state, host hiccups) are one-sided: slow repetitions must not move the cell,
    # and one lucky repetition must not set it either (as the minimum would).
    steady = [1.00, 1.01, 1.02, 1.00, 1.01, 1.02, 1.00, 1.01]
    assert lower_quartile(steady + [1.5, 2.0, 3.0]) == pytest.approx(lower_quartile(steady), abs=0.011)
    assert lower_quartile(steady + [0.5]) >= 1.0
    for n in (2, 3, 5, 11, 22):
        xs = [1.0 + 0.37 * ((i * 7) % n) for i in range(n)]
        q = lower_quartile(xs)
        assert min(xs) <= q <= statistics.median(xs)
        # about a quarter of the repetitions lie below it, about three quarters above
        assert sum(x < q for x in xs) <= n / 4 + 1 and sum(x > q for x in xs) <= 3 * n / 4 + 1
    assert lower_quartile([2.5]) == 2.5


def test_fastest_statistics_replays_each_statistic_from_the_samples():
    """benchmarks/fastest_statistics.py: from a cell's recorded samples, the median picks the
    backend whose timing a disturbance inflated (cuDNN, 0.90x the best eligible column),
    the lower quartile our kernel (the best column); a cell without samples is not judged."""
    from benchmarks import fastest_statistics as fs

    ours = [1.0] * 5 + [1.5] * 6  # six of eleven samples disturbed
    cudnn = [1.1] * 11

    def cell(tflops):
        return {"fwd": {"status": "ok", "tflops": tflops}, "fwd+bwd": {"status": "unsupported"}}

    timed = {
        "status": "ok",
        "tflops": 90.0,
        "eligible": ["triton", "cudnn", "flash_attn"],
        "measured": ["triton", "cudnn"],
        "measured_samples": {"triton": ours, "cudnn": cudnn},
    }
    entry = {
        "row": {"id": "r1"},
        "results": {
            "fastest": {"fwd": timed},
            "triton": cell(100.0),
            "cudnn": cell(90.0),
            "fa4": cell(95.0),
            "flex": cell(300.0),
        },
    }
    bare = {
        "row": {"id": "r2"},
        "results": {"fastest": {"fwd": {"status": "ok", "tflops": 1.0}}, "triton": cell(100.0)},
    }
    assert fs.replay(entry, "fwd", fs.STATISTICS["median"]) == ("cudnn", pytest.approx(0.9))
    assert fs.replay(entry, "fwd", fs.STATISTICS["lower quartile"]) == ("triton", pytest.approx(1.0))
    got = fs.summarise([entry, bare])
    assert got["median fwd"]["cells"] == 1 and got["median fwd"]["misses"] == [("r1", "cudnn", 0.9)]
    assert got["lower quartile fwd"]["below"] == 0 and got["lower quartile fwd"]["worst"] == pytest.approx(1.0)
    assert got["median fwd+bwd"]["cells"] == 0
    assert got["lower quartile, host x1.25 fwd"]["cells"] == 0  # no host times recorded: not judged
    # our kernel's host time (0.9 ms a call) nears its 1.0 ms: with a margin of 1.25 cuDNN
    # (host 0.2) costs less, at 1.0 ours still does
    timed["measured_host_ms"] = {"triton": 0.9, "cudnn": 0.2}
    assert fs.replay(entry, "fwd", fs.STATISTICS["lower quartile"], 1.0) == ("triton", pytest.approx(1.0))
    assert fs.replay(entry, "fwd", fs.STATISTICS["lower quartile"], 1.25) == ("cudnn", pytest.approx(0.9))
    assert fs.summarise([entry])["lower quartile, host x1.5 fwd"]["misses"] == [("r1", "cudnn", 0.9)]
    # the library's near-tie rule: cuDNN 10% behind is no tie; 2% behind, it takes the host-heavy lead
    assert fs.replay(entry, "fwd", fs.STATISTICS["lower quartile"], host_tie=True) == ("triton", pytest.approx(1.0))
    timed["measured_samples"]["cudnn"] = [1.02] * 11
    assert fs.replay(entry, "fwd", fs.STATISTICS["lower quartile"], host_tie=True) == ("cudnn", pytest.approx(0.9))
    assert fs.summarise([entry])["lower quartile, near-tie to host fwd"]["misses"] == [("r1", "cudnn", 0.9)]


def test_fastest_statistics_by_rounds_judges_the_first_k_rounds():
    """The choice from the first k samples only (one per round), by the leader's band: cuDNN
    runs 2.9 ms from round 5 on (its first four samples disturbed), so it leads our 3.0 once a
    quarter of the k samples are fast: k <= 5 picks ours, at 0.95 of the best column."""
    from benchmarks import fastest_statistics as fs

    def cell(tflops):
        return {"fwd": {"status": "ok", "tflops": tflops}, "fwd+bwd": {"status": "unsupported"}}

    ours = [3.0, 3.0, 3.0, 3.0, 3.3, 3.3, 3.3, 3.3, 3.3, 3.3, 3.3]
    cudnn = [3.4, 3.4, 3.4, 3.4, 2.9, 2.9, 2.9, 2.9, 2.9, 2.9, 2.9]
    timed = {
        "status": "ok",
        "tflops": 1.0,
        "eligible": ["triton", "cudnn"],
        "measured": ["triton", "cudnn"],
        "measured_samples": {"triton": ours, "cudnn": cudnn},
    }
    entry = {"row": {"id": "r"}, "results": {"fastest": {"fwd": timed}, "triton": cell(95.0), "cudnn": cell(100.0)}}
    got = fs.by_rounds([entry], counts=(3, 5, 8, 11))
    long = got["leader 2 ms or more"]
    assert {k: c["below"] for k, c in long.items()} == {3: 1, 5: 1, 8: 0, 11: 0}
    assert long[3]["worst"] == pytest.approx(0.95) and long[11]["worst"] == pytest.approx(1.0)
    assert got["leader under 1 ms"] == {} and all(c["cells"] == 1 for c in long.values())


def test_fastest_statistics_agreement_of_one_kernel_measured_twice():
    """The fastest cell against the column of the backend it chose, by the column's length:
    a flash-attn 4 choice reads the fa4 column; fastest 4% slower counts below 0.97.  The paired
    estimate (targets.paired_log_ratio), only where both took one sample a round, paired."""
    from benchmarks import fastest_statistics as fs

    def cell(ms, **kw):
        return dict(status="ok", ms=ms, tflops=1.0 / ms, **kw)

    entries = [
        {
            "row": {},
            "results": {
                "fastest": {
                    "fwd": cell(0.52, backend="triton"),
                    "fwd+bwd": cell(5.2, backend="flash_attn", samples_ms=[5.0, 5.6, 5.2], rounds=3, paired_with="fa4"),
                },
                "triton": {"fwd": cell(0.50), "fwd+bwd": cell(6.0)},
                "fa4": {"fwd": cell(0.40), "fwd+bwd": cell(5.0, samples_ms=[5.1, 5.0, 5.3], rounds=3)},
            },
        },
        {
            "row": {},
            "results": {
                "fastest": {"fwd": cell(2.0, backend="cudnn"), "fwd+bwd": cell(1.0, backend="math")},
                "cudnn": {"fwd": cell(2.0), "fwd+bwd": {"status": "unsupported"}},
            },
        },
    ]
    got = fs.agreement(entries)
    assert got["under 1 ms"]["cells"] == 1 and got["under 1 ms"]["below"] == 1
    assert got["under 1 ms"]["median_abs"] == pytest.approx(math.log(0.52 / 0.50))
    assert got["1-3.6 ms"] == dict(
        cells=1, median_abs=0.0, below=0, paired_cells=0, paired_median_abs=None, paired_below=0
    )
    assert got["longer"]["cells"] == 1 and got["longer"]["below"] == 1  # 5.2 against the fa4 column's 5.0
    # per round 5.1/5.0, 5.0/5.6, 5.3/5.2: even rounds' median and the odd round averaged, below 0.97
    paired = (math.log(5.1 / 5.0) + math.log(5.3 / 5.2)) / 4 + math.log(5.0 / 5.6) / 2
    assert got["longer"]["paired_cells"] == 1 and got["longer"]["paired_below"] == 1
    assert got["longer"]["paired_median_abs"] == pytest.approx(abs(paired))
    assert got["under 1 ms"]["paired_cells"] == 0 and got["under 1 ms"]["paired_median_abs"] is None


@pytest.mark.parametrize(
    "impl",
    ["ws", "tl", "ws-tl-dq", "ws-bwd-stages", "ws-no-fuse", "ws-fuse-banded", "ws-bwd-block-m", "ws-lpt0", "ws-lpt32"],
)
def test_forward_ab_configured_changes_one_thing_and_restores_it(impl):
    """forward_ab.configured: inside, the impl's one change to the launch glue or the Gluon configs
    (an A/B that leaked a change into the next impl's turn would compare the wrong kernels);
    after, everything as shipped."""
    import torch
    from attention_dispatch.kernels import KernelParams, configs
    from attention_dispatch.kernels.gluon import launch as gluon_launch, route
    from attention_dispatch.kernels.shapes import KernelShapes

    ab = _load("forward_ab")

    def state():
        return (
            route.WS_MIN_WORK,
            dict(configs.WS_BWD_CONFIGS),
            dict(configs.WS_DQ_CONFIGS),
            route.fuse_dq_reason,
            dict(gluon_launch.KERNELS),
            gluon_launch.lpt_rows,
        )

    shipped = state()
    q = torch.empty(1, 4, 4096, 128)
    prob = KernelShapes(q, q, q, None, None, None, None)
    causal = KernelParams(scale=0.1, window_left=-1, window_right=0)
    with ab.configured(impl, route.WS_MIN_WORK, bwd_stages=3, bwd_block_m=128):
        inside = state()
        fuses_causal = route.fuse_dq_reason(causal, prob, False, False) is None
        groups = (
            gluon_launch.lpt_rows(causal, prob, None, q, 32),
            gluon_launch.lpt_rows(KernelParams(scale=0.1), prob, None, q, 32),
        )
    changed = [
        name
        for name, a, b in zip(
            ("WS_MIN_WORK", "WS_BWD_CONFIGS", "WS_DQ_CONFIGS", "fuse_dq_reason", "KERNELS", "lpt_rows"), shipped, inside
        )
        if a != b
    ] + (["fuse_dq"] if fuses_causal else [])
    expected = {
        "ws": [],
        "tl": ["WS_MIN_WORK"],
        "ws-tl-dq": ["WS_DQ_CONFIGS"],
        "ws-bwd-stages": ["WS_BWD_CONFIGS"],
        "ws-no-fuse": ["WS_BWD_CONFIGS"],
        "ws-fuse-banded": ["WS_BWD_CONFIGS", "fuse_dq"],
        "ws-bwd-block-m": ["WS_BWD_CONFIGS"],
        "ws-lpt0": ["lpt_rows"],
        "ws-lpt32": ["lpt_rows"],
    }[impl]
    assert changed == expected
    if impl.startswith("ws-lpt"):  # the causal call's groups only; the dense one keeps the grid's order
        assert groups == (int(impl[6:]), 0)
    assert state() == shipped


def test_context_parallel_trace_peak_ends_an_allocation_at_its_free_request():
    """A buffer another stream used (NCCL's) has its free_completed late, after the allocations
    that followed its free: memory_allocated fell at free_requested, so does the trace's peak."""
    mod = _load("context_parallel")
    events = [
        dict(action="alloc", addr=1, size=100),  # a received buffer
        dict(action="free_requested", addr=1, size=100),
        dict(action="alloc", addr=2, size=60),
        dict(action="free_completed", addr=1, size=100),  # its stream's work seen done
        dict(action="alloc", addr=3, size=30),
    ]
    peak, alive, _ = mod._peak_allocations(events)
    assert peak == 100 and set(alive) == {1}
    events[-1]["size"] = 50
    peak, alive, _ = mod._peak_allocations(events)
    assert peak == 110 and set(alive) == {2, 3}


def test_context_parallel_trace_summary_gives_every_rank_s_peak_rank_0_first():
    """--memory-trace's summary: a line of every rank's peak naming the highest (the rank the
    step's max-over-ranks reports), then each rank's allocations alive at its own peak, rank 0's
    first, with their frames."""
    mod = _load("context_parallel")

    def events(*mib):  # allocations, each by its own line of merge.py, the last freed again
        frames = [[dict(filename="/x/attention_dispatch/distributed/merge.py", line=i, name="forward")] for i in mib]
        made = [dict(action="alloc", addr=i, size=n << 20, frames=f) for i, (n, f) in enumerate(zip(mib, frames))]
        return made + [dict(action="free_requested", addr=len(mib) - 1, size=mib[-1] << 20)]

    text = mod._trace_summary([mod._peak_lines(0, events(256, 128, 64)), mod._peak_lines(1, events(512, 128, 32))])
    head, rank0, rank1 = text.rstrip("\n").split("\n\n")
    assert head.endswith("rank 0 0.438, rank 1 0.656 (highest: rank 1)")
    assert rank0.startswith("rank 0: peak 0.438 GiB") and rank1.startswith("rank 1: peak 0.656 GiB")
    assert rank1.splitlines()[2:] == [
        "    512.00 distributed/merge.py:512 forward",
        "    128.00 distributed/merge.py:128 forward",
        "     32.00 distributed/merge.py:32 forward",
    ]


def test_cp_first_call_dry_run_reports_each_layouts_first_and_second_step(tmp_path):
    """benchmarks/cp_first_call.py on 2 gloo processes (--cpu): a line per layout with both
    steps' times and the blocks' backends, and the profile tables written."""
    import subprocess

    cmd = [sys.executable, str(ROOT / "benchmarks" / "cp_first_call.py"), "--cpu", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(("zigzag ", "contiguous "))]
    assert len(lines) == 2 and all("first fwd" in line and "second fwd" in line and ": 2}" in line for line in lines), (
        lines
    )
    assert sorted(p.name for p in tmp_path.glob("first_call_*.txt")) == [
        "first_call_contiguous.txt",
        "first_call_zigzag.txt",
    ]


def test_context_parallel_correctness_rows_time_each_case_apart_from_the_reference(tmp_path, monkeypatch):
    """_correctness's rows: each case's seconds end at a sync of its own work, the one-GPU reference's
    apart (reference_s, on the first case). On a GPU the float32 reference runs asynchronously and was
    paid at the next case's first host sync: the first contiguous case of each feature took its
    O(S^2) time (13 s at 32k, 100 / 200 s at 128k causal / full). Simulated here: the reference leaves
    a debt that the next sync (_sync, or _err's .item()) pays."""
    import argparse

    import torch
    import torch.distributed as dist

    mod = _load("context_parallel")
    mod._configure(argparse.Namespace(modes="", profile=False, out=str(tmp_path), cpu=True))
    debt = {"s": 0.0}
    single, err = mod._single, mod._err

    def pay():
        time.sleep(debt["s"])
        debt["s"] = 0.0

    def queued_single(*args):
        debt["s"] += 2.5  # a case takes ~0.6 s here
        return single(*args)

    monkeypatch.setattr(mod, "_single", queued_single)
    monkeypatch.setattr(mod, "_sync", pay)
    monkeypatch.setattr(mod, "_err", lambda a, b: (pay(), err(a, b))[1])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        rows = mod._correctness(0, torch.device("cpu"), [16], ["full"])
    finally:
        dist.destroy_process_group()
    assert [(r["exchange"], r["layout"]) for r in rows] == [
        ("ring", "zigzag"),
        ("ring", "contiguous"),
        ("allgather", "zigzag"),
        ("allgather", "contiguous"),
    ]
    assert all(r["ok"] for r in rows), rows
    assert rows[0]["reference_s"] >= 5 and all("reference_s" not in r for r in rows[1:])
    assert all(r["case_s"] < 2.5 for r in rows), rows  # no case pays the reference


def _sass(program):
    """cuobjdump -sass text of ``program``: (opcode, operands) lines at addresses 0x00, 0x10, ..."""
    return "\n".join(f"        /*{16 * i:04x}*/    {op} {args} ;" for i, (op, args) in enumerate(program))


def test_sass_loop_reports_the_innermost_step_not_its_outer_region():
    """sass_loop.loops: a step of 8 + 4 HGMMA (the three-consumer forward's 64-key step) inside an outer
    loop that holds two such steps' HGMMA is reported as the step (the outer region is not), a loop
    under --min-hgmma is dropped, and a retry stub holding the EXIT is never a loop."""
    sl = _load("sass_loop")
    step = [("HGMMA.64x64x16.F32.BF16", "R88, gdesc[UR12], R88")] * 8 + [("HGMMA.64x128x16.F32.BF16", "R24, R120")] * 4
    program = (
        [("NOP", "")]
        + step  # 0x10..: outer loop's own products (the peeled first step)
        + step  # 0xd0..: the inner step loop
        + [("BRA", "0xd0")]  # 0x190: inner back edge
        + [("BRA", "0x10")]  # 0x1a0: outer back edge
        + [("EXIT", ""), ("SYNCS.PHASECHK.TRANS64.TRYWAIT", "P0, [R1]"), ("BRA", "0x100")]  # into the step
    )
    ins = sl.instructions(_sass(program))
    assert sl.loops(ins, 8) == [(0xD0, 0x190)]
    assert sl.loops(ins, 12) == [(0xD0, 0x190)]
    assert sl.loops(ins, 16) == []  # the step has 12: too few, and the outer region is not a step


def test_kernel_ab_loads_the_other_tree_beside_this_one(tmp_path):
    # benchmarks/kernel_ab.py times two trees' kernels in one process: the other tree's package must
    # be a second, separate copy (its own KernelParams, its own source files), this one untouched
    kernel_ab = _load("kernel_ab")
    other = tmp_path / "tree"
    other.mkdir()
    (other / "attention_dispatch").symlink_to(ROOT / "attention_dispatch")
    decode_b, entry_b, params_b = kernel_ab.load_other(other)
    from attention_dispatch.kernels import entry, params

    assert params_b.KernelParams is not params.KernelParams
    assert decode_b.__name__ == "attention_dispatch_b.kernels.decode"
    assert Path(entry_b.__file__).parent.parent != Path(entry.__file__).parent.parent
    with pytest.raises(SystemExit, match="no attention_dispatch folder"):
        kernel_ab.load_other(tmp_path)


def test_kernel_ab_pairs_each_b_with_a_in_rotating_turns():
    # every B's ratio is A's time over its own in the same round; the turns rotate so no tree always runs first
    import torch

    kernel_ab = _load("kernel_ab")
    out = torch.ones(3)
    calls = {"A": lambda: out, "B1": lambda: out * 2, "B2": lambda: out}
    cost = {"A": 1.0, "B1": 0.5, "B2": 1.25}
    firsts, clock = [], iter(range(10**6))

    def timer(call, reps, spin):
        name = next(n for n, c in calls.items() if c is call)
        if spin != 50.0:  # a timed turn (50 ms: the host-time probe)
            firsts.append(name)
        drift = 1 + next(clock) * 1e-4  # slow drift: cancels within a round's pairs
        return cost[name] * drift, 0.01

    r = kernel_ab.run_row("row", calls, 1e9, 6, 10, timer=timer)
    assert r["b_speedup"]["B1"]["median"] == pytest.approx(2.0, rel=1e-2)
    assert r["b_speedup"]["B2"]["median"] == pytest.approx(0.8, rel=1e-2)
    assert r["max_abs_diff"] == {"B1": 1.0, "B2": 0.0}
    assert {firsts[i * 3] for i in range(6)} == {"A", "B1", "B2"}  # each tree leads some round


def test_kernel_ab_compares_backward_gradients_each():
    # the bwd case's calls return (dQ, dK, dV): max |A - B| is the largest difference of any of them
    import torch

    kernel_ab = _load("kernel_ab")
    grads = tuple(torch.ones(2, 3) for _ in range(3))
    other = (grads[0], grads[1] + 0.5, grads[2] - 2.0)
    r = kernel_ab.run_row(
        "bwd", {"A": lambda: grads, "B1": lambda: other}, 1e9, 2, 1, timer=lambda c, r, s: (1.0, 0.01)
    )
    assert r["max_abs_diff"] == {"B1": 2.0}


def test_kv_device_ab_reads_each_ratio_across_processes(tmp_path, capsys):
    # gpu_session.sh kvprocs: each row's ratios against flash-attn 4 as the median (min-max) over the runs' files
    import json

    kv_device_ab = _load("kv_device_ab")

    def run(device, idle):
        rows = [
            dict(row="chunk", device_vs_fa4=device, idle_vs_fa4=idle),
            dict(row="uneven", device_vs_fa4={}, idle_vs_fa4={}),
        ]
        return dict(meta={}, results=rows)

    runs = [
        run({"ours": 0.96, "ad-kv": 0.99}, {"ours": 1.02}),
        run({"ours": 0.97, "ad-kv": 0.96}, {"ours": 1.04}),
        run({"ours": 0.95, "ad-kv": 0.98}, {"ours": 1.00}),
    ]
    got = kv_device_ab.across(runs)
    assert got == {
        "chunk": {
            "device": {"ours": (0.96, 0.95, 0.97), "ad-kv": (0.98, 0.96, 0.99)},
            "idle": {"ours": (1.02, 1.00, 1.04)},
        }
    }
    paths = []
    for i, r in enumerate(runs):
        paths.append(tmp_path / f"kvprocs_{i}.json")
        paths[-1].write_text(json.dumps(r))
    assert kv_device_ab.main(["--across", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "chunk" in out and "over 3 runs: ours 0.960 (0.950-0.970) ad-kv 0.980 (0.960-0.990)" in out


def test_clock_sampler_reads_nvidia_smi_lines_and_windows():
    from benchmarks.gpu_clocks import parse_line, window_stats

    when, mhz, watts = parse_line("2026/11/29 05:10:11.250, 1785, 693.14, 690.02")
    assert (mhz, watts) == (1785.0, 693.14)
    assert when == pytest.approx(time.mktime(time.strptime("2026/11/29 05:10:11", "%Y/%m/%d %H:%M:%S")) + 0.25)
    assert parse_line("2026/11/29 05:10:11.250, 1785, [N/A], 690.02")[2] == 690.02  # no instant power: the average
    assert parse_line("timestamp, clocks.sm [MHz], power.draw [W]") is None
    assert parse_line("") is None
    samples = [(1.0, 1980.0, 100.0), (2.0, 1700.0, 690.0), (3.0, 1750.0, 695.0), (9.0, 1980.0, 80.0)]
    assert window_stats(samples, [(1.5, 3.5)]) == {"mhz": 1725.0, "watts": 692.5, "samples": 2}
    assert window_stats(samples, [(4.0, 5.0)]) == {}


def test_decode_rows_time_every_call_in_turns_whose_order_changes(monkeypatch):
    decode = _load("decode")
    order = []

    def loop_ms(fn, reps):  # one timed loop: each call's name says which, its ms fixed
        order.append(fn())
        return {"a": 1.0, "b": 2.0, "c": 3.0}[order[-1]]

    monkeypatch.setattr(decode, "loop_ms", loop_ms)
    monkeypatch.setattr(decode.torch.cuda, "synchronize", lambda: None)
    fns = {n: (lambda n=n: n) for n in "abc"}
    got = decode.timed_in_turns(fns, "gqa B=4 Sq=512 8k causal", reps=5, rounds=6)
    assert got == {"a": 1.0, "b": 2.0, "c": 3.0}
    rounds = [tuple(order[i : i + 3]) for i in range(0, len(order), 3)]
    assert len(rounds) == 6 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert len({r[0] for r in rounds}) > 1  # not always the same call first


def test_kernel_way_sums_the_gpu_events_a_call(monkeypatch):
    import torch
    from torch import profiler

    decode = _load("decode")
    gpu, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    calls = []

    class Event:
        def __init__(self, device_type, us):
            self.device_type, self.device_time_total = device_type, us

    class Profile:  # CUPTI's records of a burst: two kernels a call, and host events that must not count
        def __init__(self, activities):
            assert activities == [profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [Event(gpu, 300.0), Event(gpu, 100.0), Event(cpu, 5000.0)] * len(calls)

    monkeypatch.setattr(profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert decode.kernel_ms(lambda: calls.append(1), reps=4) == pytest.approx(0.4)
    assert len(calls) == 4
    assert "kernel" in _load("timing_methods").WAYS and "kernel" in _load("kernel_ab").TIMERS


def test_timing_methods_train_rows_run_the_backward_of_their_forward(monkeypatch):
    # issue 36's training rows: each step is the kernel forward, then the backward of that forward's output and
    # logsumexp with the row's params; softcap rows are read against the plain row of their band
    import torch

    timing_methods = _load("timing_methods")
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None, dtype=None: randn(*shape, dtype=dtype))
    calls = []

    class Entry:
        @staticmethod
        def attention_forward(q, k, v, bias, p):
            calls.append(("fwd", p.softcap, p.window_right))
            return "out", "lse", "seed"  # as kernels/entry.attention_forward: out, logsumexp, dropout stream

        @staticmethod
        def attention_backward(do, q, k, v, bias, out, lse, seed, p):
            calls.append(("bwd", out, lse, seed, p.softcap, p.window_right))
            return "grads"

    monkeypatch.setattr(timing_methods, "entry", Entry)
    monkeypatch.setattr(timing_methods, "FWD_SHAPE", (1, 2, 8, 16))
    rows = timing_methods.train_entries()
    assert [(label, base) for label, base, _, _ in rows] == [
        ("train plain", "train plain"),
        ("train softcap", "train plain"),
        ("train causal plain", "train causal plain"),
        ("train causal softcap", "train causal plain"),
    ]
    assert rows[1][3] == 3.5 * 4 * 2 * 8 * 8 * 16 and rows[3][3] == rows[1][3] / 2
    assert rows[3][2]() == "grads"
    assert calls == [("fwd", 30.0, 0), ("bwd", "out", "lse", "seed", 30.0, 0)]
    with pytest.raises(SystemExit):
        timing_methods.main(["--cases", "fwd,training"])


def test_train_and_bwd_rows_run_through_the_real_kernel_entry(monkeypatch):
    # the fakes above stand in for kernels.entry; here the real one (the interpreter, a tiny shape) takes the
    # calls timing_methods' train rows and kernel_ab's bwd rows make: a changed return or signature fails here
    import torch

    from attention_dispatch.kernels import entry, params

    timing_methods, kernel_ab = _load("timing_methods"), _load("kernel_ab")
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None, dtype=None: randn(*shape, dtype=dtype))
    monkeypatch.setattr(timing_methods, "FWD_SHAPE", (1, 2, 16, 16))
    monkeypatch.setattr(kernel_ab, "FWD_SHAPE", (1, 2, 16, 16))
    grads = timing_methods.train_entries()[3][2]()  # train causal softcap
    assert all(torch.isfinite(g).all() for g in grads[:3])
    _, calls, _ = kernel_ab.bwd_calls(("fwd causal softcap", True, 30.0), {"A": (None, entry, params)})
    dq, dk, dv = calls["A"]()
    assert dq.shape == dk.shape == dv.shape == (1, 2, 16, 16) and torch.isfinite(dq).all()


def test_features_kernel_timer_times_each_variant_by_its_kernels(monkeypatch, capsys):
    import torch

    features = _load("features")
    bursts = []
    monkeypatch.setattr(features, "make_call", lambda name, *a: (lambda: name))
    monkeypatch.setattr(features, "kernel_ms", lambda fn, reps: bursts.append((fn(), reps)) or 2.0)
    monkeypatch.setattr(features, "do_bench", lambda *a, **k: pytest.fail("do_bench with --timer kernel"))
    randn = torch.randn
    monkeypatch.setattr(features.torch, "randn", lambda *a, device=None, **k: randn(*a, **k))
    monkeypatch.setattr(features.torch.cuda, "get_device_name", lambda *a: "fake GPU")
    argv = ["--timer", "kernel", "--variants", "plain,softcap", "--rounds", "1", "--seq", "64", "--batch", "1"]
    assert features.main(argv) == 0
    assert sorted(bursts) == sorted([("plain", 10), ("softcap", 10)] * 2)  # fwd and fwd+bwd each
    out = capsys.readouterr().out
    assert "timer kernel" in out and "2.000 ms" in out and "x1.000 of plain" in out


def test_features_turns_the_order_each_round_and_pairs_each_round_with_plain(monkeypatch, capsys):
    # round r starts at variant r: softcap is timed before plain in round 1; "paired" reads each round's own
    # ratio (softcap 3 ms against plain 2 ms, then 6 against 4: x1.5 both), the drift between rounds cancels
    import torch

    features = _load("features")
    order = []
    ms = {"plain": iter([2.0, 2.0, 4.0, 4.0]), "softcap": iter([3.0, 3.0, 6.0, 6.0])}  # fwd, fwd+bwd a round
    monkeypatch.setattr(features, "make_call", lambda name, *a: (lambda: name))
    monkeypatch.setattr(features, "kernel_ms", lambda fn, reps: order.append(fn()) or next(ms[fn()]))
    randn = torch.randn
    monkeypatch.setattr(features.torch, "randn", lambda *a, device=None, **k: randn(*a, **k))
    monkeypatch.setattr(features.torch.cuda, "get_device_name", lambda *a: "fake GPU")
    argv = ["--timer", "kernel", "--variants", "plain,softcap", "--rounds", "2", "--seq", "64", "--batch", "1"]
    assert features.main(argv) == 0
    assert order == ["plain", "softcap"] * 2 + ["softcap", "plain"] * 2
    line = next(x for x in capsys.readouterr().out.splitlines() if "fwd " in x and "softcap" in x)
    assert "x1.500 of plain" in line and "paired x1.500 (1.500-1.500)" in line
    assert features.paired_ratios([3.0, 5.0, 4.0], [2.0, 2.0, 2.0]) == (1.5, 2.0, 2.5)


def test_decode_kernel_timer_reads_cupti_bursts_and_says_so(monkeypatch):
    decode = _load("decode")
    bursts = []
    monkeypatch.setattr(decode, "kernel_ms", lambda fn, reps: bursts.append((fn(), reps)) or 0.5)
    monkeypatch.setattr(decode, "loop_ms", lambda fn, reps: pytest.fail("an event loop with --timer kernel"))
    monkeypatch.setattr(decode.torch.cuda, "synchronize", lambda: None)
    fns = {n: (lambda n=n: n) for n in "ab"}
    assert decode.timed_in_turns(fns, "row", reps=7, rounds=3, timer="kernel") == {"a": 0.5, "b": 0.5}
    assert sorted(bursts) == sorted([("a", 7), ("b", 7)] * 3)
    monkeypatch.setattr(decode.torch.cuda, "get_device_name", lambda *a: "fake GPU")
    assert "CUPTI durations" in decode.report("| table |", "abc", "kernel")
    assert "CUDA-event timed loops" in decode.report("| table |", "abc")
