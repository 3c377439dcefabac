"""python -m attention_dispatch info | explain | config --check | demo"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch.cli import main
from attention_dispatch.debug import backend_table

ROOT = Path(__file__).resolve().parents[1]


def test_info_lists_every_backend_with_status_and_capabilities(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ad.list_backends():
        backend = ad.get_backend(name)
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        if backend.is_available():
            assert "available" in line and "unavailable" not in line
        else:
            assert "unavailable: " + backend.unavailable_reason() in line
    assert "head dim" in out and "deterministic bwd" in out


def test_info_text_table_never_cuts_a_value(capsys):
    """Every capability value of every backend appears whole in its column (float64 in the
    CPU backends' dtypes was cut at 24 characters), within 120 characters a line."""
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[
        lines.index("") + 1 : next(i for i, line in enumerate(lines) if line.startswith("performance tables"))
    ]
    for name in ad.list_backends():
        header = next(i for i, line in enumerate(table) if line.startswith(" ") and f" {name} " in line + " ")
        start = table[header].index(f" {name}") + 1
        for offset, (feature, value) in enumerate(ad.get_backend(name).capabilities.rows(), 1):
            row = table[header + offset]
            assert row.startswith(feature + " ") and row[start : start + len(value)] == value, (name, feature, row)
            assert row[start + len(value) : start + len(value) + 1] in ("", " "), (name, feature, row)
    assert max(len(line) for line in table) <= 120


def test_info_markdown(capsys):
    assert main(["info", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| backend | status | version |")
    assert "| feature | " + " | ".join(f"`{n}`" for n in ad.list_backends()) + " |" in out


def test_explain_prints_the_decision(capsys):
    rc = main(
        [
            "explain",
            "--batch",
            "1",
            "--heads",
            "8",
            "--heads-kv",
            "2",
            "--seqlen",
            "16",
            "--seqlen-k",
            "24",
            "--head-dim",
            "32",
            "--causal",
            "bottom_right",
            "--mask",
            "float-grad",
            "--backend",
            "math",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "attention_dispatch: math (order from backend= argument)" in out
    assert "Hq=8 Hkv=2 Sq=16 Sk=24 Dqk=32" in out and "causal=bottom_right" in out and "float mask" in out


def test_bench_times_each_eligible_backend(capsys):
    rc = main(
        [
            "bench",
            "--batch",
            "1",
            "--heads",
            "2",
            "--seqlen",
            "16",
            "--head-dim",
            "16",
            "--causal",
            "bottom_right",
            "--seqlen-k",
            "24",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "causal=bottom_right" in out
    assert "timed: training, forward + backward" in out
    decision = ad.explain(*(torch.randn(1, 2, s, 16, requires_grad=True) for s in (16, 24, 24)), causal="bottom_right")
    for name in decision.candidates:
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        if name in decision.rejected:
            assert decision.rejected[name][0] in line
        else:
            assert line.rstrip().endswith(" ms") and float(line.split()[1]) > 0


def test_bench_labels_a_forward_only_run(capsys):
    assert main(["bench", "--no-grad", "--backend", "math", "--seqlen", "8", "--head-dim", "8", "--heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "timed: forward only, inference" in out and "timed: training" not in out


def _gpu_here() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


@pytest.mark.skipif(_gpu_here() == (9, 0), reason="asks about an sm90 GPU that is not here")
def test_explain_for_a_gpu_that_is_not_here(capsys):
    """From declared capabilities, naming what could not be checked (was: a traceback,
    'Torch not compiled with CUDA enabled')."""
    assert main(["explain", "--dtype", "bf16", "--device", "cuda", "--arch", "sm90"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16 on cuda sm90" in out
    assert "torch_cpu        no: device=cuda not in {cpu}" in out
    assert "note: declared capabilities only: no cuda sm90 device here" in out
    assert "not checked: whether each backend is installed and available there" in out
    assert "not checked: the performance table" in out
    first = next(n for n in ad.list_backends() if n != "torch_cpu")
    assert out.startswith(f"attention_dispatch: {first} (order from default)")


@pytest.mark.skipif(_gpu_here() == (7, 5), reason="asks about an sm75 GPU that is not here")
def test_explain_for_an_older_gpu_rejects_by_compute_capability(capsys):
    assert main(["explain", "--dtype", "fp16", "--device", "cuda", "--arch", "7.5", "--varlen", "--no-grad"]) == 0
    out = capsys.readouterr().out
    triton = next(line for line in out.splitlines() if line.strip().startswith("triton "))
    assert "compute capability sm75 < sm80" in triton and "varlen" in out


def test_explain_arch_errors_name_the_argument(capsys):
    assert main(["explain", "--device", "cuda", "--arch", "hopper"]) == 2
    assert "--arch 'hopper': expected a CUDA compute capability such as sm90" in capsys.readouterr().err
    assert main(["explain", "--device", "cpu", "--arch", "sm90"]) == 2
    assert "--arch 'sm90' applies to --device cuda only (got --device 'cpu')" in capsys.readouterr().err
    assert main(["explain", "--device", "gpu"]) == 2
    assert "--device 'gpu': Expected one of cpu, cuda" in capsys.readouterr().err


def test_explain_exit_code_when_nothing_fits(capsys):
    rc = main(["explain", "--head-dim", "512", "--dtype", "float16", "--backend", "torch_cpu", "--window", "4", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "NO BACKEND" in out and "window" in out


def test_explain_help_runs_as_module():
    res = subprocess.run(
        [sys.executable, "-m", "attention_dispatch", "explain", "--help"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and "--causal" in res.stdout and "--window" in res.stdout
    help_text = " ".join(res.stdout.split())  # argparse wraps lines
    for default in ("(default: 2)", "(default: 128)", "(default: 64)", "(default: float32)", "(default: 0.0)"):
        assert default in help_text
    assert "default = --heads" in help_text and "(default: None)" not in help_text


def test_output_into_a_closed_pipe_is_no_traceback():
    """`python -m attention_dispatch info | head -1`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "attention_dispatch", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()


def test_config_check(tmp_path, capsys):
    good = ROOT / "configs" / "default.toml"
    bad = tmp_path / "bad.toml"
    bad.write_text('[dispatch]\npolicy = "fastest-ish"\n')
    assert main(["config", "--check", str(good)]) == 0
    assert f"{good}: OK" in capsys.readouterr().out
    assert main(["config", "--check", str(good), str(bad)]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "dispatch.policy" in err


def test_bad_arguments_exit_2(capsys):
    assert main(["explain", "--dropout", "1.5"]) == 2
    assert "dropout_p must be a float in [0, 1]" in capsys.readouterr().err


def test_docs_backends_md_is_current():
    """docs/backends.md is `python -m attention_dispatch info --markdown` (make docs) on the
    CPU machine: regenerate it when a capability or backend changes."""
    committed = (ROOT / "docs" / "backends.md").read_text()
    fresh = backend_table(markdown=True)

    # Availability and versions depend on the machine; capabilities must match exactly.
    def capability_part(text):
        return text[text.index("| feature |") :]

    assert capability_part(committed) == capability_part(fresh), "docs/backends.md is stale: run `make docs`"


@pytest.mark.slow
def test_demo_runs():
    res = subprocess.run(
        [sys.executable, "-m", "attention_dispatch", "demo"], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "calls match the float64 reference" in res.stdout and "MISMATCH" not in res.stdout
