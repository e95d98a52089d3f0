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
    compiler, for the opt-in kernels), the standard library, the native kernel layer and itself."""
    allowed = {"torch", "triton", "jobrunner"}
    bad = {f"{f}: {n}" for f, names in imports_by_file().items() if f.startswith("quant/") for n in names
           if n.split(".")[0] not in allowed | STDLIB or (n.startswith("jobrunner") and
                                                          not n.startswith(("jobrunner.quant", "jobrunner.kernels")))}
    assert sorted(bad) == [], "quant/ may import only torch, triton, the standard library, jobrunner.kernels " \
        "and jobrunner.quant"


def test_kernels_is_the_ground_floor():
    """kernels/ (the C build and loader, capability, signatures, switches) imports torch, ctypes and the
    standard library, and nothing else of jobrunner: everything that runs native code stands on it."""
    bad = {f"{f}: {n}" for f, names in imports_by_file().items() if f.startswith("kernels/") for n in names
           if n.split(".")[0] not in {"torch", "jobrunner"} | STDLIB or (n.startswith("jobrunner") and
                                                                      not n.startswith("jobrunner.kernels"))}
    assert sorted(bad) == [], "kernels/ may import only torch, ctypes (the standard library) and itself"


def test_native_code_is_built_only_by_kernels():
    """One build and loader: no module outside kernels/ compiles C or opens a library of its own (libc's
    madvise in models/huge_pages.py and malloc_trim in quant/at_load.py are the ctypes uses outside it)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text(encoding="utf-8")
        if rel.startswith("kernels/") or rel in ("models/huge_pages.py", "quant/at_load.py"):
            continue
        if "ctypes.CDLL(" in text or ".argtypes" in text or "subprocess.run([compiler" in text:
            offenders.append(rel)
    assert offenders == []
    assert not list(PACKAGE.rglob("csrc")) or [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("csrc")] \
        == ["kernels/csrc"]


@pytest.mark.parametrize("module", ["ray", "fsspec", "pyarrow", "click", "pydantic", "yaml", "jobrunner.driver",
                                    "jobrunner.io", "jobrunner.cli", "jobrunner.bench", "jobrunner.reports",
                                    "jobrunner.spec"])
def test_the_engine_imports_none_of(module):
    """engine/ runs with torch alone (a notebook, a unit test with a tiny model)."""
    assert sorted(f for f in files_importing(module) if f.startswith("engine/")) == []


@pytest.mark.parametrize(("module", "places"), [
    # vllm_backend/server.py runs in vLLM's own venv (never imports jobrunner): its Ray joins the cluster only to
    # hand vLLM's Ray executor the worker's placement group (pipeline stages across nodes)
    ("ray", ("driver/", "vllm_backend/server.py")),
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
    ("kernels/", "jobrunner.attention"), ("kernels/", "jobrunner.models"), ("kernels/", "jobrunner.quant"),
    ("kernels/", "jobrunner.engine"),
])
def test_no_import_runs_back_up(lower, higher):
    assert sorted(f for f in files_importing(higher) if f.startswith(lower)) == []


def module_graph() -> dict[str, set[str]]:
    """``"driver.plan" -> {"driver.shards", "spec", ...}``: the jobrunner modules each module imports (a
    package by its own name; ``from jobrunner.reports import manifest_view`` names the submodule)."""
    modules = {f.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for f in imports_by_file()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix().removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s.removeprefix("jobrunner.") in modules] or [node.module]
            else:
                continue
            graph[name] |= {t.removeprefix("jobrunner.") for t in targets if t.removeprefix("jobrunner.") in modules}
        graph[name].discard(name)
    return graph


def import_circles() -> list[list[str]]:
    """The sets of modules that import each other round a circle (strongly connected components, Tarjan)."""
    graph, index, low, stack, found = module_graph(), {}, {}, [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            circle = []
            while not circle or circle[-1] != node:
                circle.append(stack.pop())
            found.extend([sorted(circle)] if len(circle) > 1 else [])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


# Circles known and owned elsewhere (issue 26): quant's layers <-> Triton probes (item 3, quant/primitives.py);
# the speculator base class lazily importing its draft-model subclass, which imports the base back.
KNOWN_CIRCLES = [
    ["engine.speculative", "engine.speculative.draft_speculator"],
    ["quant.dispatch", "quant.fp8", "quant.int4", "quant.int4_int8", "quant.int8", "quant.triton_quant"],
]


def test_import_circles_are_found():
    assert ["engine.speculative", "engine.speculative.draft_speculator"] in import_circles()
    assert "spec_errors" in module_graph()["spec"] and "io.storage" in module_graph()["driver.output"]


def test_no_import_circle_but_the_known_ones():
    """Two modules that import each other can only be loaded in one order, and hide it with imports placed
    at the bottom or inside functions: spec <-> spec_errors and driver/plan <-> driver/output were such."""
    assert [c for c in import_circles() if c not in KNOWN_CIRCLES] == []
