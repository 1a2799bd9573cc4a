"""Programmatic dependent launch: every kernel the package launches waits for its predecessor before touching
memory (the order of a PDL stream rests on each kernel doing so), and the switch that turns it off."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

import fastdiff.kernels as kernels_pkg
import fastdiff.kernels.conv2d_gluon  # noqa: F401 - outside REGISTRY: imported so that MODULES holds it
from fastdiff.kernels import common
from fastdiff.kernels.common import PDL_ENV, pdl_launch, programmatic_launch

MODULES = [m for m in (getattr(kernels_pkg, name) for name in dir(kernels_pkg)) if inspect.ismodule(m)]


def _is_jit(node: ast.FunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(d) for d in node.decorator_list)


def _launches(tree: ast.Module) -> list[ast.Call]:
    """``kernel[grid](...)`` calls."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]


def _is_gluon(node: ast.FunctionDef) -> bool:
    return any("gluon.jit" in ast.unparse(d) for d in node.decorator_list)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_launch_is_programmatic_and_waits(module):
    """Every Triton kernel launch is programmatic and its kernel starts with ``grid_dependency_sync(PDL)``. A Gluon
    kernel (``kernels/conv2d_gluon.py``) has no such sync yet, so it must launch in plain stream order (no
    ``launch_pdl``, no spread launch arguments): it waits for every kernel before it, and the next kernel's sync
    waits for it to finish."""
    tree = ast.parse(inspect.getsource(module))
    jit = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and _is_jit(n)}
    gluon = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and _is_gluon(n)}
    for call in _launches(tree):
        spread = [k.value for k in call.keywords if k.arg is None]
        where = f"{module.__name__} line {call.lineno}"
        if isinstance(call.func.value, ast.Name) and call.func.value.id in gluon:
            assert not spread and "launch_pdl" not in [k.arg for k in call.keywords], where
            continue
        assert any(isinstance(v, ast.Call) and ast.unparse(v.func) == "pdl_launch" for v in spread), where
        target = call.func.value
        if isinstance(target, ast.Name) and target.id in jit:  # a plain kernel: it must take PDL
            assert "PDL" in [a.arg for a in jit[target.id].args.args], where
    for node in jit.values():
        if "PDL" not in [a.arg for a in node.args.args] or node.name == "grid_dependency_sync":
            continue
        body = (
            node.body[1:]
            if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
            else node.body
        )
        assert ast.unparse(body[0]) == "grid_dependency_sync(PDL)", f"{module.__name__}.{node.name}"


def test_launched_kernels_found():
    """The scan above sees the package's kernels (a scan that finds nothing would pass)."""
    launched = sum(len(_launches(ast.parse(inspect.getsource(m)))) for m in MODULES)
    assert len(MODULES) >= 11 and launched >= 17


def test_switch_and_devices(monkeypatch):
    assert pdl_launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv(PDL_ENV, "0")
    assert not programmatic_launch(torch.device("cuda", 0))  # off before any CUDA query
    monkeypatch.setenv(PDL_ENV, "1")
    monkeypatch.setattr(common, "_supports_pdl", lambda index: index == 0)
    assert programmatic_launch(torch.device("cuda", 0))
    assert not programmatic_launch(torch.device("cuda", 1))
