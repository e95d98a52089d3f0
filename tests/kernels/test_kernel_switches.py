"""The switches table (jobrunner/kernels/switches.py): the only reader of ``JOBRUNNER_*`` variables, every one
the package names is in it and in the docs' table, and its typed values."""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.kernels import switches
from jobrunner.kernels.switches import SWITCHES, is_off, setting, switch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jobrunner"
READERS = {("os", "getenv"), ("environ", "get"), ("environ", "pop"), ("environ", "setdefault")}


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "JOBRUNNER_..."`` assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


@functools.cache
def package_constants() -> dict[str, str]:
    """Every module-level ``NAME = "JOBRUNNER_..."`` of the package (names imported elsewhere resolve too)."""
    out: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        out.update({k: v for k, v in _constants(ast.parse(path.read_text(encoding="utf-8"))).items()
                    if v.startswith("JOBRUNNER_")})
    return out


def _names_variable(node: ast.AST, constants: dict[str, str]) -> bool:
    """Whether an expression is a ``JOBRUNNER_*`` literal or a name / attribute bound to one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("JOBRUNNER_")
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name is not None and constants.get(name, "").startswith("JOBRUNNER_")


def env_reads(path: Path) -> list[str]:
    """``file:line`` of every read of a ``JOBRUNNER_*`` variable from the environment in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants = {**package_constants(), **_constants(tree)}
    found = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = node.func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) \
                else ""
            if (owner_name, node.func.attr) in READERS:
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            arg = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In) for op in node.ops) and any(
                isinstance(c, ast.Attribute) and c.attr == "environ" for c in node.comparators):
            arg = node.left
        if arg is not None and _names_variable(arg, constants):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_scan_finds_an_environment_read(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nX_ENV = "JOBRUNNER_X"\na = os.environ.get(X_ENV, "1")\nb = os.getenv("JOBRUNNER_Y")\n'
                      'c = os.environ["JOBRUNNER_Z"]\nd = "JOBRUNNER_W" in os.environ\ne = os.environ.get("HOME")\n',
                      encoding="utf-8")
    (tmp_path / "x").mkdir()
    found = [f.rsplit(":", 1)[1] for f in env_reads_under(tmp_path, sample)]
    assert found == ["3", "4", "5", "6"]


def env_reads_under(root: Path, path: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, root
    try:
        return env_reads(path)
    finally:
        ROOT = saved


def test_only_the_switches_table_reads_jobrunner_variables():
    """Every other module asks :func:`switch` / :func:`setting`: a new read elsewhere fails here, named."""
    reads = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "switches.py" for hit in env_reads(path)]
    assert reads == []


def test_every_variable_the_package_names_is_in_the_table():
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\bJOBRUNNER_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
    assert sorted(named - set(SWITCHES)) == []
    assert len(SWITCHES) == 27 and sum(row.kernel for row in SWITCHES.values()) == 19


def test_the_docs_table_lists_every_switch():
    text = (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
    table = text[text.index("### Switches"):]
    missing = [name for name in SWITCHES if f"| `{name}`" not in table]
    assert missing == []


def test_typed_values(monkeypatch):
    monkeypatch.delenv("JOBRUNNER_FUSED_OPS", raising=False)
    monkeypatch.delenv("JOBRUNNER_PACKED_GEMM", raising=False)
    assert switch("JOBRUNNER_FUSED_OPS") is True and not is_off("JOBRUNNER_FUSED_OPS")  # default 1
    assert switch("JOBRUNNER_PACKED_GEMM") is None  # the capability decides
    monkeypatch.setenv("JOBRUNNER_PACKED_GEMM", " 0 ")
    assert switch("JOBRUNNER_PACKED_GEMM") is False and is_off("JOBRUNNER_PACKED_GEMM")
    monkeypatch.setenv("JOBRUNNER_PACKED_GEMM", "1")
    assert switch("JOBRUNNER_PACKED_GEMM") is True
    monkeypatch.setenv("JOBRUNNER_PACKED_GEMM", "maybe")
    with pytest.raises(ValueError, match=r"JOBRUNNER_PACKED_GEMM='maybe': expected 0 or 1"):
        switch("JOBRUNNER_PACKED_GEMM")
    monkeypatch.setenv("JOBRUNNER_HUGE_PAGES", "Weights")
    assert switch("JOBRUNNER_HUGE_PAGES") == "weights"
    monkeypatch.setenv("JOBRUNNER_HUGE_PAGES", "some")
    with pytest.raises(ValueError, match="JOBRUNNER_HUGE_PAGES='some': expected one of 0, weights, all"):
        switch("JOBRUNNER_HUGE_PAGES")
    monkeypatch.delenv("JOBRUNNER_METRICS_INTERVAL_S", raising=False)
    assert switch("JOBRUNNER_METRICS_INTERVAL_S") == 2.0
    monkeypatch.setenv("JOBRUNNER_METRICS_INTERVAL_S", "0.5")
    assert switch("JOBRUNNER_METRICS_INTERVAL_S") == 0.5
    assert setting("JOBRUNNER_CACHE", {"JOBRUNNER_CACHE": "/data/cache"}) == "/data/cache"
    assert setting("JOBRUNNER_CACHE", {}) == "~/.cache/jobrunner"
    with pytest.raises(KeyError, match="JOBRUNNER_NOT_A_SWITCH is not in"):
        switch("JOBRUNNER_NOT_A_SWITCH")


def test_the_switches_module_needs_no_torch():
    """CLI and spec modules read switches: the table imports only the standard library."""
    tree = ast.parse(Path(switches.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} - sys.stdlib_module_names == set()


def test_doctor_prints_the_capability_and_every_switch(monkeypatch):
    from jobrunner.cli import main

    monkeypatch.setenv("JOBRUNNER_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("JOBRUNNER_FUSED_OPS", "0")
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "CPU capability: avx2 (forced by JOBRUNNER_CPU_CAPABILITY)" in result.output
    assert "  JOBRUNNER_FUSED_OPS=0  default 1; onoff; applies: all" in result.output
    assert all(f"  {name}=" in result.output for name in SWITCHES)
