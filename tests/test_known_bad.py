"""The known-bad list (policy/known_bad.py): shipped entries, config entries, conditions as data."""

import dataclasses

import pytest
import torch

import attention_dispatch as ad
from attention_dispatch import dispatch
from attention_dispatch.api import normalize_call
from attention_dispatch.policy import known_bad


def problem(sq=100, sk=100, hkv=8, cc=(9, 0), **kw):
    q = torch.randn(1, 8, sq, 64, dtype=torch.float16)
    k = torch.randn(1, hkv, sk, 64, dtype=torch.float16)
    p = normalize_call(q, k, k, enable_gqa=hkv != 8).problem
    return dataclasses.replace(p, device_type="cuda", compute_capability=cc, **kw)


@pytest.fixture
def cudnn_version(monkeypatch):
    real = known_bad._read_version

    def set_version(version):
        known_bad._versions.clear()
        monkeypatch.setattr(known_bad, "_read_version", lambda lib: version if lib == "cudnn" else real(lib))

    return set_version


def test_shipped_entries_cudnn_seqlen_not_multiple_of_128(cudnn_version):
    cudnn_version("9.10.2")
    assert known_bad.reasons("cudnn", None, problem(sq=128, sk=100)) == [
        "known bad: cuDNN < 9.15.1 with Sk % 128 != 0 gives wrong results (pytorch#169849)"
    ]
    assert len(known_bad.reasons("cudnn", None, problem(sq=100, sk=100))) == 2
    assert known_bad.reasons("cudnn", None, problem(sq=128, sk=256)) == []
    assert known_bad.reasons("torch_flash", None, problem(sq=100, sk=100)) == []
    cudnn_version("9.15.1")
    assert known_bad.reasons("cudnn", None, problem(sq=100, sk=100)) == []
    cudnn_version(None)  # no cuDNN: no version to be bad
    assert known_bad.reasons("cudnn", None, problem(sq=100, sk=100)) == []


def test_shipped_entry_cudnn_blackwell_few_kv_heads(cudnn_version):
    cudnn_version("9.19.0")
    (reason,) = known_bad.reasons("cudnn", None, problem(sq=128, sk=128, hkv=4, cc=(10, 0)))
    assert "fewer than 8 KV heads" in reason and "pytorch#193893" in reason
    assert known_bad.reasons("cudnn", None, problem(sq=128, sk=128, hkv=8, cc=(10, 0))) == []
    assert known_bad.reasons("cudnn", None, problem(sq=128, sk=128, hkv=4, cc=(9, 0))) == []
    assert known_bad.reasons("cudnn", None, problem(sq=128, sk=128, hkv=4, cc=None)) == []


def test_the_dispatcher_skips_a_backend_listed_in_the_config(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        "[[known_bad]]\n"
        'backend = "torch_cpu"\nlibrary = "torch"\nversions = ">=2.0"\n'
        'when = [{ field = "head_dim_qk", op = "==", value = 24 }, { field = "dtype", op = "in", value = ["float32"] }]\n'
        'reason = "a made-up bug of head dim 24"\nlink = "example#1"\n'
    )
    q = torch.randn(1, 2, 8, 24)
    with ad.use_backends("torch_cpu", "math"):
        assert ad.explain(q, q, q).backend == "torch_cpu"
        ad.load_config(path)
        d = ad.explain(q, q, q)
        assert d.backend != "torch_cpu"
        assert d.rejected["torch_cpu"] == ["known bad: a made-up bug of head dim 24 (example#1)"]
        assert "no: known bad: a made-up bug of head dim 24 (example#1)" in str(d)
        ad.sdpa(q, q, q)
        assert ad.last_decision().backend != "torch_cpu"
        q32 = torch.randn(1, 2, 8, 32)
        assert ad.explain(q32, q32, q32).backend == "torch_cpu"  # the condition does not hold
        with ad.use_config({"known_bad": [{"backend": "torch_cpu", "versions": "<1.0", "reason": "old"}]}):
            assert ad.explain(q, q, q).backend == "torch_cpu"  # torch is not < 1.0


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"backend": "x", "reason": "r", "when": [{"field": "seqlen", "op": "<", "value": 1}]},
            "unknown Problem field 'seqlen'",
        ),
        ({"backend": "x", "reason": "r", "when": [{"field": "seqlen_k", "op": "~", "value": 1}]}, "when.0.op"),
        ({"backend": "x", "reason": "r", "when": [{"field": "dtype", "op": "in", "value": "float16"}]}, "needs a list"),
        ({"backend": "x", "reason": "r", "versions": "9.15"}, "is not like '<9.15.1'"),
        ({"backend": "x"}, "reason: Field required"),
        ({"backend": "x", "reason": "r", "code": "import os"}, "code: Extra inputs are not permitted"),
    ],
)
def test_malformed_entries_are_config_errors_naming_the_entry(tmp_path, entry, message):
    with pytest.raises(ad.ConfigError, match=r"known_bad\[0\]") as info:
        ad.use_config({"known_bad": [entry]}).__enter__()
    assert message in str(info.value)


def test_versions_compare_by_release():
    assert known_bad.release("2.13.0+cpu") == (2, 13, 0)
    assert known_bad.release("9.15.0rc1") == (9, 15, 0)
    assert known_bad.version_matches("9.10.2", "<9.15.1")
    assert not known_bad.version_matches("9.15.1", "<9.15.1")
    assert known_bad.version_matches("2.6", ">=2.5,<2.7") and not known_bad.version_matches("2.7.0", ">=2.5,<2.7")
    assert known_bad.version_matches("10.0", ">9.15.1") and known_bad.version_matches("1.2.3", "")


def test_a_condition_on_seqlen_k_keeps_the_span_provable():
    """Conditions compare with plain operators: a decode decision's span over Sk is narrowed to
    where the entry's verdict is the same (dispatch.seqlen_k_span), not lost."""
    entry = {"backend": "torch_cpu", "reason": "short keys", "when": [{"field": "seqlen_k", "op": "<", "value": 40}]}
    with ad.use_config({"known_bad": [entry]}), ad.use_backends("torch_cpu", "math"):
        q = torch.randn(1, 2, 1, 16)
        for sk, span, chosen in ((48, (40, 63), "torch_cpu"), (36, (32, 39), "math")):
            k = torch.randn(1, 2, sk, 16)
            d = dispatch.decide(normalize_call(q, k, k).problem)
            assert d.backend == chosen and dispatch.seqlen_k_span(d) == span
        entry["when"] = [{"field": "seqlen_k", "modulo": 8, "op": "!=", "value": 0}]
    with ad.use_config({"known_bad": [entry]}), ad.use_backends("torch_cpu", "math"):
        k = torch.randn(1, 2, 48, 16)
        d = dispatch.decide(normalize_call(q, k, k).problem)
        assert d.backend == "torch_cpu" and dispatch.seqlen_k_span(d) == (48, 48)
