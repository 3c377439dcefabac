"""CPU tests of the ncu probe's parser and table (benchmarks/ncu_summary.py, perf-notes E113) on small
files in the forms Nsight Compute exports (`--page raw --csv`, `--page source --csv --print-source sass`),
and of the metric filter (benchmarks/ncu_metrics.py) that keeps an unknown name from failing a profile."""

import csv
import io
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench_tools

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is no installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import ncu_metrics, ncu_summary  # noqa: E402

FIXED = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size", "Grid Size"]
TENSOR = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
XU = "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"
XU_COUNT = "smsp__inst_executed_pipe_xu.sum"
DURATION = "gpu__time_duration.sum"
PC = ncu_metrics.PCSAMP_PREFIX


def raw_csv(kernels: list[tuple[str, dict[str, str]]], duration_unit: str = "nsecond") -> str:
    """`ncu -i REP --page raw --csv` output: header, units row, a row a kernel, with ncu's log lines."""
    names = sorted({m for _, metrics in kernels for m in metrics})
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(FIXED + names)
    w.writerow([""] * len(FIXED) + [duration_unit if m == DURATION else ("%" if "pct" in m else "") for m in names])
    for i, (name, metrics) in enumerate(kernels):
        fixed = [str(i), "4242", "python3", "127.0.0.1", name, "1", "7", "(384, 1, 1)", "(132, 1, 1)"]
        w.writerow(fixed + [metrics.get(m, "n/a") for m in names])
        w.writerow([])  # a blank line: skipped, not a kernel
    return "==PROF== Connected to process 4242\n" + buf.getvalue() + "==PROF== Disconnected from process 4242\n"


def source_csv(name: str, rows: list[tuple[str, str, int, dict[str, int]]]) -> str:
    """`--page source --csv --print-source sass`: a row naming the kernel, a header, a row an instruction."""
    reasons = ["stall_math", "stall_math (Not Issued)", "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(["Kernel Name", name])
    w.writerow(
        ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)"]
        + reasons
        + ["Instructions Executed"]
    )
    for address, sass, samples, why in rows:
        # a not-issued twin holds part of its reason's samples: the parser must not count it again
        twins = [str(why.get(r.split(" ")[0], 0) // 2) if "Not Issued" in r else str(why.get(r, 0)) for r in reasons]
        w.writerow([address, sass, f"{samples:,}", "0"] + twins + ["8"])
    return buf.getvalue()


def kernel_metrics(ms: float, tensor: float, xu: float, xu_count: int, stalls: dict[str, int]) -> dict[str, str]:
    m = {DURATION: f"{ms * 1e6:,.0f}", TENSOR: str(tensor), XU: str(xu), XU_COUNT: f"{xu_count:,}"}
    m.update(dict(zip(ncu_metrics.BALANCE, ("450,000", "500,000"))))
    m.update({PC + r: str(v) for r, v in stalls.items()})
    m[ncu_metrics.PCSAMP_TOTAL] = str(sum(v for r, v in stalls.items() if not r.endswith("_not_issued")))
    return m


GLUON = "_attn_fwd_ws(float *, bf16 *, int)"
SETUP = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, T2, T3)"


def write_case(tmp_path, case, ms, tensor, xu, xu_count, stalls, sass):
    raw = raw_csv([(GLUON, kernel_metrics(ms, tensor, xu, xu_count, stalls)), (SETUP, {DURATION: "2,000"})])
    (tmp_path / f"ncu_{case}.csv").write_text(raw)
    (tmp_path / f"ncu_{case}.source.csv").write_text(source_csv(GLUON, sass) + source_csv(SETUP, []))
    (tmp_path / f"ncu_{case}.log").write_text("==PROF== Disconnected\n")


def test_parse_raw_reads_numbers_units_and_kernels():
    text = raw_csv([(GLUON, kernel_metrics(0.25, 71.5, 98.0, 1234567, {"wait": 10}))], duration_unit="usecond")
    kernels = ncu_summary.parse_raw(text)
    assert [k.name for k in kernels] == [GLUON]
    k = kernels[0]
    assert k.get(XU_COUNT) == 1234567.0  # thousands separators stripped
    assert k.column("tensor%") == 71.5 and k.column("xu%") == 98.0
    assert k.duration_ms() == pytest.approx(250.0)  # "usecond": ncu printed 250,000 us
    assert k.column("issue%") is None  # not collected: "-", not a crash


def test_parse_raw_without_a_header_is_empty():
    assert ncu_summary.parse_raw("==ERROR== ERR_NVGPUCTRPERM - no permission\n") == []


def test_stalls_are_sample_shares_without_not_issued_and_fall_back_to_ratios():
    k = ncu_summary.Kernel("k", {PC + "math_pipe_throttle": 60.0, PC + "wait": 40.0, PC + "wait_not_issued": 39.0})
    basis, pairs = k.stalls()
    assert basis == "% of samples"
    assert pairs == [("math_pipe_throttle", 60.0), ("wait", 40.0)]
    ratio = ncu_summary.Kernel(
        "k",
        {
            "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": 0.5,
            "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": 2.0,
        },
    )
    assert ratio.stalls() == ("cycles per issue", [("long_scoreboard", 2.0), ("barrier", 0.5)])


def test_parse_source_blocks_opcodes_and_reasons():
    text = source_csv(
        GLUON,
        [
            ("0x7f3a00000a10", "@!P0 MUFU.TANH R5, R4 ;", 1200, {"stall_math": 900, "stall_wait": 300}),
            ("0x7f3a00000a20", "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", 300, {"stall_barrier": 0}),
        ],
    ) + source_csv(SETUP, [("0x7f3a00000010", "EXIT ;", 0, {})])
    blocks = ncu_summary.parse_source(text)
    assert [name for name, _ in blocks] == [GLUON, SETUP]
    first = blocks[0][1]
    assert [i.opcode for i in first] == ["MUFU.TANH", "WARPGROUP.DEPBAR.LE"]
    assert first[0].samples == 1200.0  # "1,200"
    assert first[0].reasons == {"math": 900.0, "wait": 300.0}  # zero and not-issued columns left out
    lines = ncu_summary.instruction_lines(first)
    assert "MUFU.TANH" in lines[1] and "80.0%" in lines[1] and "math 75%" in lines[1]
    assert lines[-1].startswith("    by opcode: MUFU 80.0%, WARPGROUP 20.0%")


def _loop_kernel(base: int, steps: int, copies: int, mufu_wait: int) -> list:
    """Instructions of a kernel: a 4-instruction prologue run once a warp, then ``copies`` loop bodies of
    120 instructions run ``steps`` times each (0x2000 apart, as one copy a consumer warpgroup), a
    retry branch between them run more often but too short to be a loop."""
    I = ncu_summary.Instruction
    out = [I(f"{base + 16 * n:#x}", "MOV R1, R2 ;", 5, {"wait": 5}, 8) for n in range(4)]
    for c in range(copies):
        start = base + 0x1000 + 0x2000 * c
        for n in range(120):
            sass, why = (
                ("MUFU.EX2 R1, R2 ;", {"wait": mufu_wait, "selected": 2})
                if n % 2
                else ("FADD R1, R2, R3 ;", {"selected": 2})
            )
            out.append(I(f"{start + 16 * n:#x}", sass, sum(why.values()), why, steps))
        out.append(I(f"{start + 16 * 120:#x}", "@!P0 BRA 0x10 ;", 50, {"long_sb": 50}, steps * 40))
    return out


def test_main_loop_is_the_most_executed_long_run_in_every_copy():
    ours = _loop_kernel(0x7F3A00000000, steps=1000, copies=2, mufu_wait=10)
    loop = ncu_summary.main_loop(ours)
    assert len(loop) == 240 and {i.executed for i in loop} == {1000}  # not the retry branch run 40x as often
    assert ncu_summary.loop_steps(loop) == 2000  # two copies, 1000 warp-steps each
    lines = ncu_summary.loop_lines(ours)
    assert lines[0].startswith("    main loop: 240 instructions (all copies), 2000 warp-steps")
    assert "wait" in lines[1] and lines[2].lstrip().startswith("MUFU") and "x120" in lines[2]
    assert ncu_summary.loop_lines(ours[:4]) == ["    main loop: none found (no execution counts in the source view)"]


def test_loop_pair_compares_stall_samples_a_warp_step():
    slow = _loop_kernel(0x7F3A00000000, steps=1000, copies=2, mufu_wait=10)
    fast = _loop_kernel(0x7F3B00000000, steps=2000, copies=1, mufu_wait=4)
    line = ncu_summary.loop_pair_line("ours / fa4", slow, fast)
    # samples are a code copy's over all its executions: slow 2 x (60 MUFU x 12 + 60 FADD x 2) = 1680 over
    # 2000 warp-steps, fast 60 x 6 + 60 x 2 = 480 over 2000
    assert line.startswith("ours / fa4 loop: stall samples per 1000 warp-steps 840.0 vs 240.0 (x3.500)")
    assert "by reason wait +480.0, selected +120.0" in line
    assert ncu_summary.loop_pair_line("none", slow[:4], fast) is None


def test_short_name_drops_arguments_and_templates():
    assert ncu_summary.short_name(SETUP) == "vectorized_elementwise_kernel"
    assert ncu_summary.short_name("x" * 50, 10) == "x" * 8 + ".."


def test_summary_of_cases_table_last_pairs_and_a_failed_case(tmp_path, capsys):
    mufu = [("0x7f3a00000a10", "MUFU.EX2 R1, R2 ;", 500, {"stall_math": 400})]
    write_case(tmp_path, "plain", 0.200, 80.0, 50.0, 1_000_000, {"wait": 30, "selected": 70}, mufu)
    write_case(tmp_path, "softcap", 0.250, 65.0, 99.0, 2_000_000, {"math_pipe_throttle": 80, "wait": 20}, mufu)
    (tmp_path / "ncu_kv-chunk.log").write_text(
        "==PROF== Connected\n==ERROR== ERR_NVGPUCTRPERM - The user does not have permission\n"
    )
    files = sorted(tmp_path.iterdir())
    assert ncu_summary.main([str(p) for p in files]) == 0
    out = capsys.readouterr().out
    # cases in the probe's order, whatever the glob's: plain, softcap, then kv-chunk
    assert out.index("== plain") < out.index("== softcap") < out.index("== kv-chunk")
    assert "no ncu data: ==ERROR== ERR_NVGPUCTRPERM" in out
    assert "vectorized_elementwise_kernel" in out  # every kernel of the call is listed
    assert "xu 1.00" in out and "SM busy avg/max 0.900" in out
    table = out[out.rindex("case ") :].splitlines()
    assert table[1].startswith("plain ") and "_attn_fwd_ws" in table[1]  # the longest kernel is the case's
    assert "0.200" in table[1] and "80.0" in table[1] and "selected 70" in table[1]
    assert table[3].startswith("kv-chunk") and "no data" in table[3]
    pair = next(line for line in table if line.startswith("softcap / plain:"))
    assert "time x1.250" in pair and "tensor% 65.0 vs 80.0" in pair and "xu inst x2.00" in pair
    assert not any(line.startswith("ours / fa4 chunk") for line in table)  # neither ran


def test_a_patched_profile_is_set_beside_its_base_case(tmp_path, capsys):
    """gpu_session.sh ncu with PATCH= and NCU_CASES="softcap softcap@patch": the patched tree's profile is
    listed right after its case and compared with it like the issues' pairs."""
    mufu = [("0x7f3a00000a10", "MUFU.EX2 R1, R2 ;", 500, {"stall_math": 400})]
    write_case(tmp_path, "softcap@patch", 0.240, 70.0, 80.0, 1_500_000, {"wait": 50}, mufu)
    write_case(tmp_path, "softcap", 0.250, 65.0, 99.0, 2_000_000, {"wait": 20}, mufu)
    write_case(tmp_path, "plain", 0.200, 80.0, 50.0, 1_000_000, {"wait": 30}, mufu)
    assert ncu_summary.main([str(p) for p in sorted(tmp_path.iterdir())]) == 0
    out = capsys.readouterr().out
    assert out.index("== plain") < out.index("== softcap\n") < out.index("== softcap@patch")
    pair = next(line for line in out.splitlines() if line.startswith("softcap@patch / softcap:"))
    assert "time x0.960" in pair and "xu inst x0.75" in pair


def test_log_reason_names_the_target_error_ncu_error_and_status():
    log = (
        "==PROF== Connected to process 7\n"
        "Traceback (most recent call last):\n"
        '  File "benchmarks/ncu_target.py", line 60, in chunk_call\n'
        "ModuleNotFoundError: No module named 'flash_attn'\n"
        "==ERROR== The application returned an error code (1).\n"
        "ncu rc 1\n"
    )
    assert ncu_summary.log_reason(log) == (
        "ModuleNotFoundError: No module named 'flash_attn' | ==ERROR== The application returned an error code (1)."
        " | ncu rc 1"
    )
    assert ncu_summary.log_reason("==PROF== Disconnected from process 7\n") == "==PROF== Disconnected from process 7"
    assert ncu_summary.log_reason("") == "no output (did ncu run?)"


def test_summary_without_case_files_says_so(tmp_path, capsys):
    assert ncu_summary.main([str(tmp_path / "query_metrics.txt")]) == 1
    assert "no ncu_<case> files" in capsys.readouterr().out


def test_metric_filter_keeps_only_names_this_ncu_lists():
    query = (
        "Device NVIDIA H100 80GB HBM3 (GH100)\n"
        "---------------------------------------- ----------- ---------\n"
        "Metric Name                              Metric Type Metric Unit Metric Description\n"
        "gpu__time_duration                       Counter     nsecond     total duration\n"
        "sm__inst_executed_pipe_xu                Counter     inst        # of warp instructions executed by xu\n"
        "sm__pipe_tensor_op_hmma_cycles_active    Counter     cycle       # of cycles where HMMA pipe was active\n"
    )
    got = ncu_metrics.available(query)
    assert got == [
        "gpu__time_duration.sum",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        XU,
        "sm__inst_executed_pipe_xu.sum",
    ]
    assert "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active" in ncu_metrics.wanted()
    assert ncu_metrics.available("") == []  # no query output: sections only
