"""Faults: a backend failing at run time (a library error, a simulated CUDA out-of-memory), an
optional library whose import breaks, corrupt config and fastest-cache files, two processes
writing one cache file at once."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import fastest

ROOT = Path(__file__).resolve().parents[1]


class Failing(ad.Backend):
    def __init__(self, name, error):
        self.name, self.error, self.runs = name, error, 0

    def run(self, query, key, value, **options):
        self.runs += 1
        raise self.error


def qkv():
    return tuple(torch.randn(1, 2, 8, 16) for _ in range(3))


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
        ValueError("flash_attn: unsupported head dim"),
    ],
    ids=["cuda-oom", "library-error", "value-error"],
)
def test_a_backend_failing_at_run_time(error):
    ad.register_backend(Failing("flaky", error), priority="first")
    q, k, v = qkv()
    with ad.use_backends("flaky", "torch_cpu", "math"):
        with pytest.raises(ad.BackendRunError, match=f"backend 'flaky' failed while running: {type(error).__name__}"):
            ad.sdpa(q, k, v)
        with ad.use_config({"dispatch": {"on_error": "fallback"}}):
            out = ad.sdpa(q, k, v)
            d = ad.last_decision()
    assert d.backend == "torch_cpu"
    assert d.failures["flaky"].startswith(f"{type(error).__name__}: {str(error).splitlines()[0]}")
    assert "flaky failed at run time; fell back" in d.notes
    torch.testing.assert_close(out, ad.sdpa(q, k, v, backend="math"))


def test_every_eligible_backend_failing_says_so():
    ad.register_backend(Failing("one", RuntimeError("boom 1")), priority="first")
    ad.register_backend(Failing("two", torch.OutOfMemoryError("CUDA out of memory")), priority="first")
    with ad.use_backends("two", "one"), ad.use_config({"dispatch": {"on_error": "fallback"}}):
        with pytest.raises(ad.BackendRunError, match="every eligible backend failed while running; last was 'one'"):
            ad.sdpa(*qkv())


def run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "failure",
    [
        "raise ImportError('libcudart.so.13: cannot open shared object file')",
        "raise RuntimeError('CUDA driver version is insufficient for CUDA runtime version')",
        "raise OSError('undefined symbol: _ZN3c104cuda9SetDeviceEi')",
    ],
    ids=["ImportError", "RuntimeError", "OSError"],
)
def test_an_optional_library_whose_import_breaks(tmp_path, failure):
    for package in ("xformers", "flash_attn"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(failure + "\n")
    code = textwrap.dedent(
        """
        import torch, attention_dispatch as ad
        q = torch.randn(1, 2, 8, 16)
        ad.sdpa(q, q, q)
        for name in ("xformers", "flash_attn"):
            b = ad.get_backend(name)
            print(name, b.is_available(), b.unavailable_reason())
        d = ad.explain(q, q, q)
        print("chosen", d.backend)
        """
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    message = failure.split("(", 1)[1].strip("')")
    for name, line in zip(("xformers", "flash_attn"), lines):
        assert line.startswith(f"{name} False ") and message[:30] in line, line
    assert lines[-1].startswith("chosen ")


@pytest.mark.parametrize(
    "name, text",
    [
        ("truncated.toml", '[dispatch]\npriority = ["math", "torch'),
        ("garbage.toml", "\x00\x01 not toml at all ]]]"),
        ("truncated.yaml", "dispatch:\n  priority: [math, torch_cpu\n"),
        ("list.yaml", "- a\n- b\n"),
        ("empty-key.toml", "[guard]\nmode = \n"),
    ],
)
def test_a_corrupt_config_file_is_a_clear_error_naming_it(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ad.ConfigError) as info:
        ad.load_config(path)
    assert str(path) in str(info.value)
    assert ad.explain(*qkv()).backend  # the previous (default) config still works


def fixed_timings(monkeypatch):
    def time_backends(names, call, sync, failures=None, samples_out=None, host_out=None):
        return {name: 1.0 + i for i, name in enumerate(names)}

    monkeypatch.setattr(fastest, "time_backends", time_backends)


@pytest.mark.parametrize(
    "text",
    ['{"truncated": {"backend": "ma', "[1, 2, 3]", '"a string"', '{"key": 3}', "\x00\x00"],
    ids=["truncated", "list", "string", "entry-not-object", "binary"],
)
def test_a_corrupt_fastest_cache_is_rebuilt_with_a_warning(tmp_path, monkeypatch, caplog, text):
    fixed_timings(monkeypatch)
    monkeypatch.setattr(fastest, "_file_key", lambda problem, device: "key")
    path = tmp_path / "fastest.json"
    path.write_text(text)
    with ad.use_config({"dispatch": {"policy": "fastest", "fastest_cache": str(path)}}):
        with ad.use_backends("torch_cpu", "math"):
            ad.sdpa(*qkv())
            assert ad.last_decision().backend == "torch_cpu"
    if not text.startswith('{"key"'):
        assert any("fastest cache" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    data = json.loads(path.read_text())  # rebuilt: a valid file holding the new measurement
    assert isinstance(data, dict) and any(v["backend"] == "torch_cpu" for v in data.values() if isinstance(v, dict))
    # a file with a valid entry next to a broken one keeps working from the cache
    fastest.forget()
    with ad.use_config({"dispatch": {"policy": "fastest", "fastest_cache": str(path)}}):
        with ad.use_backends("torch_cpu", "math"):
            ad.sdpa(*qkv())


def test_two_processes_writing_one_cache_file_never_tear_it(tmp_path):
    path = tmp_path / "fastest.json"
    writer = textwrap.dedent(
        f"""
        import sys
        from attention_dispatch import fastest
        for i in range(150):
            fastest._store_file({str(path)!r}, f"{{sys.argv[1]}}-{{i}}", "math", {{"math": float(i)}})
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", writer, tag], env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        for tag in ("a", "b")
    ]
    reads = 0
    while any(p.poll() is None for p in procs):
        if path.exists():
            json.loads(path.read_text())  # never half a file
            reads += 1
    assert all(p.wait() == 0 for p in procs)
    data = json.loads(path.read_text())
    assert reads > 0 and (
        "a-149" in data or "b-149" in data
    )  # the last writer wins; entries may be lost, never the file
