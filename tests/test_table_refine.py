"""policy="fastest" refines the performance table (issue 35): with ``fastest_cache`` set, each bucket it
measures on a GPU is written into the user's table for that GPU and those versions, seeded from the
table that applied (stale backends' times left out), so that policy="auto" in later processes ranks
the bucket by the measurement.  A fake GPU stands in for CUDA (test_perf_table's fixtures)."""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch

from attention_dispatch import fastest, perf_table
from test_adapters import problem
from test_perf_table import decision, environment, write

CUDA = torch.device("cuda", 0)


@pytest.fixture
def package(tmp_path, monkeypatch):
    folder = tmp_path / "package"
    folder.mkdir()
    monkeypatch.setattr(perf_table, "PACKAGE_TABLES", folder)
    perf_table.forget()
    return folder


def test_a_measured_bucket_is_written_over_a_copy_of_the_shipped_table(table_dir, fake_gpu, package):
    p, other = problem(), "some|other|bucket"
    write(package, "shipped.json", {perf_table.bucket_key(p): {"triton": 1.0, "flash_attn": 2.0, "cudnn": 2.0},
                                    other: {"triton": 3.0, "cudnn": 1.0}}, grid="full")  # fmt: skip
    assert perf_table.table_choice(decision(p), "auto").backend == "triton"
    path = perf_table.refine(p, CUDA, {"triton": 2.0, "flash_attn": 0.5, "cudnn": 1.5}, {"flash_attn": 0.01}, {})
    assert path == perf_table.user_table_path(environment()) and path.parent == table_dir
    data = json.loads(path.read_text())
    assert data["entries"][other] == {"triton": 3.0, "cudnn": 1.0}  # the rest of the shipped table kept
    assert data["entries"][perf_table.bucket_key(p)] == {"triton": 2.0, "flash_attn": 0.5, "cudnn": 1.5}
    assert data["details"][perf_table.bucket_key(p)]["row"] == "policy=fastest"
    assert data["refined"] == [perf_table.bucket_key(p)] and data["grid"] == "full"
    # a later process (the tables re-read): auto ranks the bucket by the measurement, from the user's table
    got = perf_table.table_choice(decision(p), "auto")
    assert got.backend == "flash_attn" and "flash_attn 0.500 ms" in str(got)
    assert perf_table.applicable_table(CUDA).origin == "user"


def test_refining_again_keeps_earlier_refinements(table_dir, fake_gpu, package):
    p, q = problem(), problem(seqlen_q=4096, seqlen_k=4096)
    perf_table.refine(p, CUDA, {"triton": 1.0, "cudnn": 2.0}, {}, {})
    path = perf_table.refine(q, CUDA, {"triton": 3.0, "cudnn": 1.0}, {}, {"flash_attn": "RuntimeError: no"})
    data = json.loads(path.read_text())
    assert set(data["refined"]) == {perf_table.bucket_key(p), perf_table.bucket_key(q)}
    assert data["entries"][perf_table.bucket_key(p)] == {"triton": 1.0, "cudnn": 2.0}
    assert data["details"][perf_table.bucket_key(q)]["failures"] == {"flash_attn": "RuntimeError: no"}


@pytest.mark.parametrize("failed", [False, True])
def test_a_backend_not_measured_keeps_its_time_and_one_that_failed_loses_it(table_dir, fake_gpu, package, failed):
    """A call under use_backends() or a disabled backend measures fewer backends than the bucket holds."""
    p = problem()
    key = perf_table.bucket_key(p)
    write(package, "shipped.json", {key: {"triton": 1.0, "flash_attn": 2.0, "cudnn": 2.0}},
          details={key: {"row": "r", "host_ms": {"triton": 0.1, "flash_attn": 0.2, "cudnn": 0.3}, "failures": {}}})  # fmt: skip
    failures = {"flash_attn": "RuntimeError: unsupported"} if failed else {}
    path = perf_table.refine(p, CUDA, {"triton": 3.0, "cudnn": 1.0}, {"cudnn": 0.01}, failures)
    data = json.loads(path.read_text())
    want = {"triton": 3.0, "cudnn": 1.0} if failed else {"triton": 3.0, "flash_attn": 2.0, "cudnn": 1.0}
    assert data["entries"][key] == want
    assert data["details"][key]["host_ms"] == ({"cudnn": 0.01} if failed else {"flash_attn": 0.2, "cudnn": 0.01})


def test_a_stale_backends_times_are_not_carried_into_the_refined_table(table_dir, fake_gpu, package):
    p, other = problem(), "some|other|bucket"
    old = environment(triton="0.0.1")  # triton was timed at another version than this process has
    write(package, "shipped.json", {other: {"triton": 1.0, "cudnn": 2.0}}, old,
          details={other: {"row": "r", "host_ms": {"triton": 0.1, "cudnn": 0.2}, "failures": {}}})  # fmt: skip
    path = perf_table.refine(p, CUDA, {"triton": 1.0, "cudnn": 2.0}, {}, {})
    data = json.loads(path.read_text())
    assert data["entries"][other] == {"cudnn": 2.0}
    assert data["details"][other]["host_ms"] == {"cudnn": 0.2}
    assert data["environment"]["backends"]["triton"] == perf_table.backend_versions()["triton"]


def test_refine_writes_nothing_off_cuda_or_where_the_directory_refuses(table_dir, fake_gpu, package, monkeypatch):
    assert perf_table.refine(problem(), torch.device("cpu"), {"triton": 1.0}, {}, {}) is None
    assert not table_dir.exists()

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(perf_table, "write_table", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert perf_table.refine(problem(), CUDA, {"triton": 1.0}, {}, {}) is None
    assert any("could not refine the performance table" in str(w.message) for w in caught)


@pytest.mark.parametrize("cache", [True, False])
def test_policy_fastest_refines_the_table_only_with_its_cache_path(tmp_path, monkeypatch, cache):
    calls = []
    monkeypatch.setattr(fastest, "time_backends", lambda names, *a, **k: {"triton": 2.0, "flash_attn": 1.0})
    monkeypatch.setattr(perf_table, "refine", lambda *args: calls.append(args))
    fastest.forget()
    try:
        call = types.SimpleNamespace(query=torch.empty(1))
        path = str(tmp_path / "fastest.json") if cache else None
        got = fastest.choose_fastest(decision(problem(), eligible=("triton", "flash_attn")), call, path)
    finally:
        fastest.forget()
    assert got.backend == "flash_attn"
    if cache:
        ((p, device, timings, host, failures),) = calls
        assert p == problem() and device.type == "cpu" and timings == {"triton": 2.0, "flash_attn": 1.0}
    else:
        assert calls == []
