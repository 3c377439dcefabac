"""CPU checks of benchmarks/gpu_session.sh, the script each GPU call runs: a mode it lists is a mode it has,
and the features.py variants its A/B modes time are ones features.py accepts (session 41 lost a GPU A/B to a
rejected --variants)."""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench_tools

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "benchmarks" / "gpu_session.sh").read_text()


def _case_modes() -> set[str]:
    body = SCRIPT[SCRIPT.index('case "$what" in') :]
    return {mode for alts in re.findall(r"^  ([a-z0-9|]+)\)", body, flags=re.M) for mode in alts.split("|")}


def _usage_modes() -> set[str]:
    usage = re.search(r'echo "usage: \$0 ([a-z0-9|]+)', SCRIPT).group(1)
    return set(usage.split("|"))


def _features_variants() -> tuple[str, ...]:
    tree = ast.parse((ROOT / "benchmarks" / "features.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("VARIANTS", "FA4_VARIANTS"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["VARIANTS"] + found["FA4_VARIANTS"]


def test_usage_lists_exactly_the_modes_the_script_has():
    assert _usage_modes() == _case_modes()
    header = SCRIPT.splitlines()[3]  # the header's call line names the same modes
    assert set(re.search(r"gpu_session\.sh ([a-z0-9|]+)", header).group(1).split("|")) == _case_modes()


@pytest.mark.parametrize(
    "call", re.findall(r"^\s*features_(?:warm|turns) .*$", SCRIPT, flags=re.M), ids=lambda c: c.strip()[:40]
)
def test_features_variants_are_accepted(call):
    words = call.split()
    variants = words[1] if words[0] == "features_warm" else words[2]  # turns: file first
    if variants == '"$ab_variants"':  # patchab's AB_VARIANTS, its default checked here
        variants = re.search(r"ab_variants=\$\{AB_VARIANTS:-([a-z0-9,-]+)\}", SCRIPT).group(1)
    names = variants.split(",")
    assert "plain" in names, call
    assert set(names) <= set(_features_variants()), call


def test_patchab_turns_are_among_the_checked_calls():
    """patchab's features_turns call starts its line, so test_features_variants_are_accepted checks it (a call
    behind `[[ ... ]] &&` had dropped out of its parameters)."""
    turns = re.findall(r"^\s*features_turns .*$", SCRIPT, flags=re.M)
    assert any('"$ab_variants"' in call for call in turns), turns
