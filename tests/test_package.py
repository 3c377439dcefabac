"""The package as installed and started: import cost, Makefile targets, extras, README."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# Imported on first use only: torch._dynamo alone was half of `import attention_dispatch` (4.0 s
# against 2.0 s for `import torch`); the optional libraries cost seconds more where installed;
# pydantic (~0.5 s, --help at 1.25x `import torch`) is for configuration only, loaded with the first one
DEFERRED = (
    "torch._dynamo",
    "torch._inductor",
    "triton",
    "transformers",
    "flash_attn",
    "xformers",
    "matplotlib",
    "pydantic",
)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\nprint(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return set(out.split())


def test_import_and_help_defer_heavy_modules():
    """`import attention_dispatch` and the CLI's --help and explain --help (which import it: one
    subprocess)."""
    loaded = _modules_after(
        "import contextlib, io\n"
        "from attention_dispatch.cli import build_parser\n"
        "build_parser().format_help()\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    build_parser().parse_args(['explain', '--help'])"
    )
    assert "attention_dispatch.api" in loaded
    assert [m for m in DEFERRED if m in loaded] == []


def test_configuration_loads_pydantic_on_first_use():
    """The deferral keeps configuration whole: the first call loads the default Config (and
    pydantic with it); ad.Config is the model."""
    loaded = _modules_after(
        "import attention_dispatch as ad, torch\n"
        "assert 'pydantic' not in sys.modules\n"
        "ad.sdpa(*[torch.randn(1, 1, 4, 8)] * 3)\n"
        "assert ad.Config().dispatch.deterministic == 'auto'"
    )
    assert {"pydantic", "attention_dispatch.config_models"} <= loaded


def _phony_targets() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    return re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()


def test_every_declared_make_target_has_a_recipe():
    """`make bench` was declared and did nothing."""
    text = (ROOT / "Makefile").read_text()
    for target in _phony_targets():
        assert re.search(rf"^{re.escape(target)}:", text, re.M), f"make {target}: declared without a rule"


def test_make_bench_runs_the_benchmark():
    res = subprocess.run(
        ["make", "-n", "bench", "BENCH_ARGS=--quick"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    if res.returncode != 0 and "No such file" in res.stderr:
        pytest.skip("make is not installed")
    assert res.returncode == 0, res.stderr
    assert re.search(r"python benchmarks/bench\.py --quick$", res.stdout, re.M), res.stdout


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements) -> set[str]:
    return {re.split(r"[<>=!~\[;\s]", r, maxsplit=1)[0].lower() for r in requirements}


def test_extras_transformers_and_all():
    """all: every extra a plain pip install takes (flash-attn needs --no-build-isolation,
    xformers pins one torch), by reference to those extras."""
    extras = _project()["optional-dependencies"]
    assert _names(extras["transformers"]) == {"transformers"}
    assert extras["all"] == ["attention_dispatch[triton,transformers]"]


def test_numpy_declared_and_pinned_for_the_triton_interpreter():
    """numpy in the base dependencies (torch warns on every import without it); the dev extra,
    which runs Triton's interpreter, below 2.4 (Triton 3.6's interpreter fails on numpy 2.4)."""
    project = _project()
    assert "numpy" in _names(project["dependencies"])
    dev_numpy = [r for r in project["optional-dependencies"]["dev"] if r.startswith("numpy")]
    assert dev_numpy == ["numpy>=1.22,<2.4"]


def test_readme_says_how_flash_attn_installs():
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install --no-build-isolation '.[flash-attn]'" in install
    assert "pip install flash-attn --no-build-isolation" in install
    assert "pip install '.[all]'" in install and "pip install '.[transformers]'" in install
