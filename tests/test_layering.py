"""The package layering that docs/ and the design guide promise, read from the code's own imports (ast).

Every import counts, also one inside a function (a lazy import is still a dependency). Each rule names the
files that break it, so a new import in the wrong place fails here with where it is.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jobrunner"
STDLIB = sys.stdlib_module_names


@cache
def imports_by_file() -> dict[str, set[str]]:
    """``"quant/int8.py" -> {"torch", "jobrunner.quant.dispatch", ...}`` for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import (the rules below read absolute names)"
                names.add(node.module)
        out[path.relative_to(PACKAGE).as_posix()] = names
    return out


def files_importing(top: str) -> set[str]:
    """Files that import ``top`` (a top-level module such as ``ray``, or ``jobrunner.io``), or a submodule."""
    return {f for f, names in imports_by_file().items() if any(n == top or n.startswith(top + ".") for n in names)}


def under(files: set[str], *places: str) -> set[str]:
    """The files of ``files`` that lie under none of ``places`` (``"driver/"``, or one file ``"spec.py"``)."""
    return {f for f in files if not any(f == p or (p.endswith("/") and f.startswith(p)) for p in places)}


def test_the_rules_read_real_imports():
    assert "ray" in {n.split(".")[0] for n in imports_by_file()["driver/pool.py"]}
    assert files_importing("torch") and files_importing("jobrunner.quant")


def test_quant_is_a_torch_only_leaf():
    """quant/ is the state-dict transform and the module swap: torch (and triton, torch's own GPU kernel
    compiler, for the opt-in kernels), the standard library and itself."""
    allowed = {"torch", "triton", "jobrunner"}
    bad = {f"{f}: {n}" for f, names in imports_by_file().items() if f.startswith("quant/") for n in names
           if n.split(".")[0] not in allowed | STDLIB or (n.startswith("jobrunner") and
                                                          not n.startswith("jobrunner.quant"))}
    assert sorted(bad) == [], "quant/ may import only torch, triton, the standard library and jobrunner.quant"


@pytest.mark.parametrize("module", ["ray", "fsspec", "pyarrow", "click", "pydantic", "yaml", "jobrunner.driver",
                                    "jobrunner.io", "jobrunner.cli", "jobrunner.bench", "jobrunner.reports",
                                    "jobrunner.spec"])
def test_the_engine_imports_none_of(module):
    """engine/ runs with torch alone (a notebook, a unit test with a tiny model)."""
    assert sorted(f for f in files_importing(module) if f.startswith("engine/")) == []


@pytest.mark.parametrize(("module", "places"), [
    ("ray", ("driver/",)),
    ("fsspec", ("io/",)),
    # the driver builds its output tables itself (rows -> columns); it reads and writes them through io/
    ("pyarrow", ("io/", "driver/rows.py", "driver/prefix_rows.py", "driver/part_build.py", "driver/output_files.py")),
    ("click", ("cli/",)),
    ("pydantic", ("spec.py", "spec_errors.py", "spec_sections.py")),
])
def test_only_its_owner_imports(module, places):
    assert sorted(under(files_importing(module), *places)) == [], f"{module} outside {places}"


@pytest.mark.parametrize(("lower", "higher"), [
    ("attention/", "jobrunner.engine"), ("attention/", "jobrunner.models"),  # attention sits below both
    ("io/", "jobrunner.models"), ("io/", "jobrunner.engine"), ("io/", "jobrunner.quant"),
    ("models/", "jobrunner.engine"), ("models/", "jobrunner.driver"),
])
def test_no_import_runs_back_up(lower, higher):
    assert sorted(f for f in files_importing(higher) if f.startswith(lower)) == []
