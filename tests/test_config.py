"""Config files: loading TOML and YAML, the shipped files, and every kind of error."""

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

import attention_dispatch as ad
from attention_dispatch.config import current_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["default.toml", "deterministic.toml"])
def test_shipped_configs_load(name):
    cfg = ad.load_config(ROOT / "configs" / name)
    assert current_config() is cfg
    assert set(cfg.dispatch.priority) == set(ad.list_backends())


def test_deterministic_config_sets_policy():
    ad.load_config(ROOT / "configs" / "deterministic.toml")
    assert current_config().dispatch.deterministic is True


def test_toml_and_yaml_are_the_same_schema(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text(
        '[dispatch]\npriority = ["math"]\ndisabled = ["torch_cpu"]\non_error = "fallback"\n'
        'math_fallback = "allow"\ndeterministic = false\n'
    )
    yaml = tmp_path / "a.yaml"
    yaml.write_text(
        "dispatch:\n  priority: [math]\n  disabled: [torch_cpu]\n  on_error: fallback\n"
        "  math_fallback: allow\n  deterministic: false\n"
    )
    a, b = ad.read_config(toml), ad.read_config(yaml)
    assert a.dispatch == b.dispatch
    assert a.dispatch.on_error == "fallback" and a.dispatch.deterministic is False


ERRORS = [
    ('[dispatch]\npolicy = "fast"\n', "dispatch.policy", "'priority'"),
    ('[dispatch]\nprioritty = ["math"]\n', "dispatch.prioritty", "unknown key"),
    ('[dispatc]\n', "dispatc", "unknown key"),
    ('[dispatch]\nmath_fallback = "sometimes"\n', "dispatch.math_fallback", "'warn', 'allow' or 'forbid'"),
    ('[dispatch]\non_error = 3\n', "dispatch.on_error", "'raise' or 'fallback'"),
    ('[dispatch]\ndeterministic = "yes please"\n', "dispatch.deterministic", "got 'yes please'"),
    ('[dispatch]\npriority = ["math", "warp_drive"]\n', "dispatch.priority", "unknown backend 'warp_drive'"),
    ('[dispatch]\ndisabled = ["nope"]\n', "dispatch.disabled", "unknown backend 'nope'"),
    ('[dispatch]\npriority = ["math", "math"]\n', "dispatch.priority", "listed twice"),
    ('[backends.nope]\nx = 1\n', "backends.nope", "unknown backend"),
    ('[backends.math]\nchunk = 1\n', "backends.math", "takes no options"),
    ("[dispatch\n", "cannot parse", ""),
]


@pytest.mark.parametrize("text,field,detail", ERRORS, ids=[e[1] + ":" + e[2][:12] for e in ERRORS])
def test_config_errors_name_file_field_and_allowed(tmp_path, text, field, detail):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ad.ConfigError) as err:
        ad.load_config(path)
    msg = str(err.value)
    assert str(path) in msg and field in msg and detail in msg, msg


def test_config_file_errors(tmp_path):
    with pytest.raises(ad.ConfigError, match="cannot read"):
        ad.read_config(tmp_path / "missing.toml")
    other = tmp_path / "c.json"
    other.write_text("{}")
    with pytest.raises(ad.ConfigError, match=r"unknown configuration format '.json'; allowed: .toml, .yaml"):
        ad.read_config(other)
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ad.ConfigError, match="top level must be a table"):
        ad.read_config(bad)


def test_failed_load_keeps_previous_config(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[dispatch]\non_error = "fallback"\n')
    ad.load_config(good)
    bad = tmp_path / "bad.toml"
    bad.write_text('[dispatch]\non_error = "explode"\n')
    with pytest.raises(ad.ConfigError):
        ad.load_config(bad)
    assert current_config().dispatch.on_error == "fallback"


def test_per_backend_options_validated_by_its_model(tmp_path):
    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        block: int = 64

    class WithOptions(ad.Backend):
        name = "withopts"
        options_model = Options

        def run(self, query, key, value, **options):  # never run here
            raise AssertionError

    ad.register_backend(WithOptions())
    ok = tmp_path / "ok.toml"
    ok.write_text("[backends.withopts]\nblock = 128\n")
    assert ad.read_config(ok).backends["withopts"] == {"block": 128}
    bad = tmp_path / "bad.toml"
    bad.write_text('[backends.withopts]\nblock = "big"\ncolour = 1\n')
    with pytest.raises(ad.ConfigError) as err:
        ad.read_config(bad)
    msg = str(err.value)
    assert "backends.withopts" in msg and "block" in msg and "colour: unknown key" in msg


def test_use_config_is_scoped():
    before = current_config()
    with ad.use_config({"dispatch": {"on_error": "fallback"}}) as cfg:
        assert current_config() is cfg
    assert current_config() is before
    with pytest.raises(ad.ConfigError, match="<use_config>"):
        with ad.use_config({"dispatch": {"on_error": "nope"}}):
            pass


def test_every_error_of_a_file_is_reported_together(tmp_path):
    """A field pydantic rejects does not hide the checks after it (was: only the first error)."""
    path = tmp_path / "two.toml"
    path.write_text('[dispatch]\npolicy = "fastest-ish"\npriority = ["math", "nope"]\n[backends.math]\nchunk = 1\n')
    with pytest.raises(ad.ConfigError) as err:
        ad.read_config(path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"{path}: invalid configuration"
    assert sorted(line.split(":")[0].strip() for line in lines[1:]) == [
        "backends.math",
        "dispatch.policy",
        "dispatch.priority",
    ], lines


@pytest.mark.parametrize("value", ['"yes"', '"true"', "1", '"on"'])
def test_deterministic_is_only_auto_true_or_false(tmp_path, value):
    path = tmp_path / "det.toml"
    path.write_text(f"[dispatch]\ndeterministic = {value}\n")
    with pytest.raises(ad.ConfigError) as err:
        ad.read_config(path)
    assert 'dispatch.deterministic: allowed: "auto", true or false' in str(err.value)


@pytest.mark.parametrize("value,parsed", [('"auto"', "auto"), ("true", True), ("false", False)])
def test_deterministic_accepts_auto_true_false(tmp_path, value, parsed):
    path = tmp_path / "det.toml"
    path.write_text(f"[dispatch]\ndeterministic = {value}\n")
    assert ad.read_config(path).dispatch.deterministic == parsed
