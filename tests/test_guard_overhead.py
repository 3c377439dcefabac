"""CPU tests of benchmarks/guard_overhead.py: the fixed sample pattern through the real guard,
paired rounds, the verdict's three readings, a smoke run."""

import gc
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.policy import guard

pytestmark = pytest.mark.bench_tools


@pytest.fixture(autouse=True)
def _torch_cpu():
    """torch's own CPU kernel: under TRITON_INTERPRET=1 the triton backend would be chosen and interpreted (~0.2 s a call)."""
    with ad.use_backends("torch_cpu"):
        yield


ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is no installed package: its modules import from the checkout
    sys.path.insert(0, str(ROOT))

spec = importlib.util.spec_from_file_location("_bench_guard_overhead", ROOT / "benchmarks" / "guard_overhead.py")
go = importlib.util.module_from_spec(spec)
spec.loader.exec_module(go)


@pytest.mark.parametrize("mode", go.SAMPLED)
def test_fixed_sampling_checks_exactly_one_call_in_a_hundred(mode, monkeypatch):
    """Through the real guard: 300 calls after the first check run exactly 3 checks, at calls 50, 150, 250."""
    checked = []
    payload = guard.payload
    monkeypatch.setattr(guard, "payload", lambda *a, **k: checked.append(calls[0]) or payload(*a, **k))
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    calls = [0]
    with go.fixed_sampling() as draws, ad.use_config({"guard": go.MODES[mode]}):
        ad.sdpa(q, k, v, is_causal=True)  # the decision's first call: checked, no draw
        ad.sdpa(q, k, v, is_causal=True)
        checked.clear()
        draws.reset()
        for calls[0] in range(300):
            ad.sdpa(q, k, v, is_causal=True)
        ad.guard_flush()
    assert checked == [50, 150, 250] and draws.hits == 3 and draws.draws == 300
    assert not isinstance(guard._rng, go.EveryNth)  # restored


def _result(name, sample, aa, iqr, rounds=100):
    pct = {m: dict(median=0.0, q1=-iqr / 2, q3=iqr / 2, iqr=iqr) for m in go.SHOWN}
    pct["sample"] = dict(median=sample, q1=sample - iqr / 2, q3=sample + iqr / 2, iqr=iqr)
    pct["off2"] = dict(median=aa, q1=aa - iqr / 2, q3=aa + iqr / 2, iqr=iqr)
    return dict(name=name, rounds=rounds, overhead_pct=pct, off_ms=0.1)


@pytest.mark.parametrize(
    ("samples", "iqr", "said"),
    [
        ((0.5, 1.2), 1.0, "met"),  # notch 0.157: 1.2 + 0.157 <= 2
        ((0.5, 1.9), 1.0, "within noise"),  # 1.9 + 0.157 > 2 >= 1.9 - 0.157
        ((0.5, 2.5), 1.0, "not met"),  # 2.5 - 0.157 > 2
        ((0.5, 1.2), 10.0, "within noise"),  # notch 1.57: 1.2 + 1.57 > 2
    ],
)
def test_verdict_reads_the_worst_median_against_its_notch(samples, iqr, said):
    results = [_result(f"row{i}", s, 0.1, iqr) for i, s in enumerate(samples)]
    line = go.verdict(results)
    assert line.startswith(f"worst sample overhead {max(samples):+.2f}% (target <= 2%): {said} (A/A IQR {iqr:.2f}%")


def test_overheads_are_paired_per_round():
    ms = {m: [1.0, 2.0, 4.0] for m in go.MODES}
    ms["sample"] = [1.01, 2.02, 4.04]  # +1% each round, though the rounds differ 4x
    ms["first"] = [2.0, 1.0, 4.0]
    out = go.summarize(ms, {m: [0, 0, 0] for m in go.MODES})
    assert out["overhead_pct"]["sample"] == pytest.approx(dict(median=1.0, q1=1.0, q3=1.0, iqr=0.0))
    assert out["overhead_pct"]["off2"]["iqr"] == 0.0 and out["overhead_pct"]["first"]["median"] == 0.0
    assert out["rounds"] == 3 and out["off_ms"] == 1.5


@pytest.mark.parametrize("argv", [["--calls", "150"], ["--calls", "0"], ["--min-rounds", "1"], ["--passes", "bwd"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        go.parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_smoke_cpu_rounds_interleave_every_mode_with_one_check_a_turn(tmp_path, capsys):
    out = tmp_path / "guard.json"
    argv = ["--device", "cpu", "--seqlens", "8", "--passes", "fwd", "--budget-s", "0", "--min-rounds", "3"]
    assert gc.isenabled()
    go.main([*argv, "--json", str(out)])
    assert gc.isenabled()
    (row,) = json.loads(out.read_text())
    assert row["rounds"] == 3 and all(len(t) == 3 for t in row["ms"].values())
    assert all(sorted(o) == sorted(go.MODES) for o in row["orders"]) and row["orders"][1] != row["orders"][2]
    assert row["checks_per_turn"] == {m: [1] if m in go.SAMPLED else [0] for m in go.MODES}
    text = capsys.readouterr().out.splitlines()
    assert text[-1].startswith("worst sample overhead") and "A/A IQR" in text[-1]
    assert text[-2].startswith("B=1 H=4 S=8 D=64 fwd")
