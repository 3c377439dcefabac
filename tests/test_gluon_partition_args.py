"""The Gluon kernels' partitions take their runtime arguments as one tuple, unpacked by position: every
tuple built for the forward's loader or consumers must have exactly the names they unpack, in order.
CI's Triton (3.9) cannot compile the Gluon kernels (written for the GPU machine's 3.6), so a tuple that
gained or lost an element would only fail on a GPU; this reads the sources instead."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GLUON = Path(__file__).resolve().parents[1] / "attention_dispatch" / "kernels" / "gluon"


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _unpacked_names(fn: ast.FunctionDef) -> list[str]:
    """The names of ``(a, b, ...) = args`` in a partition."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == "args":
            return [e.id for e in node.targets[0].elts]
    raise AssertionError(f"{fn.name} does not unpack args")


def _tuple_built(fn: ast.FunctionDef, name: str) -> list[ast.expr]:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return list(node.value.elts)
    raise AssertionError(f"{fn.name} builds no {name}")


FORWARD = ast.parse((GLUON / "forward.py").read_text())
LOADER = _unpacked_names(_function(FORWARD, "_ws_loader"))


@pytest.mark.parametrize("partition", ["_ws_loader", "_ws_consumer"])
def test_forward_builds_the_tuple_its_partitions_unpack(partition):
    built = _tuple_built(_function(FORWARD, "_attn_fwd_ws"), "args")
    assert [getattr(e, "id", None) for e in built] == _unpacked_names(_function(FORWARD, partition))


def test_dq_pass_builds_the_forward_loaders_tuple():
    """The dQ pass reuses the forward's loader: its tuple has the loader's length, and each name it passes
    once sits where the loader unpacks that name (a name passed several times is also a stand-in for
    arguments the loader does not read)."""
    built = _tuple_built(_function(ast.parse((GLUON / "dq.py").read_text()), "_attn_bwd_dq_ws"), "loader_args")
    assert len(built) == len(LOADER)
    names = [getattr(e, "id", None) for e in built]
    for element, name in zip(built, LOADER):
        if isinstance(element, ast.Name) and element.id in LOADER and names.count(element.id) == 1:
            assert element.id == name, (element.id, name)
