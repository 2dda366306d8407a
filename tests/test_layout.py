"""The project's layout rules, read from its source: imports point one way (no cycle between
project modules, flowtrain reaches sims and tui only from its CLI and the tune API, and only
when called, no private name imported
across modules), task names are spelled only in flowtrain/plan, and no module grows past 600
lines. Each rule names what breaks it."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import REPO

PACKAGES = ("flowtrain", "sims", "tui", "cuda_numba")
MAX_LINES = 600
# a task name's first part, as flowtrain.plan.names makes them
TASK_NAME = re.compile(r"^(forward|backward|reduce|gather|optimizer|send_act|recv_act|send_grad|"
                       r"recv_grad|allgather|copy|tp|handoff|overhead|comm)/")


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> Iterator[tuple[str, str | None, int]]:
    """(imported project module, imported name or None, line) of every import statement in
    ``module``, at any depth (function-local and TYPE_CHECKING imports included)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target:
                    yield target, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = _resolve(full if full in MODULES else base)
                if target:
                    yield target, alias.name, node.lineno


def graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in imports(m) if t != m} for m in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_project_modules() -> None:
    assert cycles(graph()) == []


# the doors that call into the simulator or the monitor, each importing them only when called:
# the CLI and the Python API of `flowtrain tune`
DOORS = ("flowtrain.cli", "flowtrain.tune")


def test_flowtrain_reaches_sims_and_tui_only_from_its_cli() -> None:
    found = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith("flowtrain")
             and m not in DOORS for t, _, line in imports(m)
             if t.split(".")[0] in ("sims", "tui")]
    assert found == []


def test_the_doors_import_sims_and_tui_only_when_called() -> None:
    found = []
    for door in DOORS:
        tree = ast.parse(MODULES[door].read_text())
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                found += [f"{door}:{node.lineno} imports {n} at import time" for n in names
                          if n.split(".")[0] in ("sims", "tui")]
    assert found == []


def test_tui_reads_flowtrain_only_through_its_telemetry() -> None:
    found = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith("tui")
             for t, _, line in imports(m)
             if t.startswith("flowtrain") and not t.startswith("flowtrain.telemetry")]
    assert found == []


def test_cuda_numba_imports_no_other_project_package() -> None:
    found = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith("cuda_numba")
             for t, _, line in imports(m) if not t.startswith("cuda_numba")]
    assert found == []


def test_no_private_name_is_imported_across_modules() -> None:
    """A module's ``_name`` is its own; a package's private submodule (``cuda_numba._bits``) may
    be imported inside its package, as anyio's are."""
    found = []
    for m in MODULES:
        for target, name, line in imports(m):
            if not name or not name.startswith("_") or name.startswith("__") or target == m:
                continue
            submodule = target.rpartition(".")[2] == name
            if submodule and target.rpartition(".")[0] == m.rpartition(".")[0]:
                continue  # a private submodule of this module's own package
            found.append(f"{m}:{line} imports {target}.{name}")
    assert found == []


def test_task_names_are_spelled_only_in_flowtrain_plan() -> None:
    found = []
    for m, path in MODULES.items():
        if m.startswith("flowtrain.plan"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            parts = node.values if isinstance(node, ast.JoinedStr) else [node]
            for part in parts[:1]:
                if isinstance(part, ast.Constant) and isinstance(part.value, str) and \
                        TASK_NAME.match(part.value):
                    found.append(f"{m}:{node.lineno} {part.value!r}")
    assert found == []


@pytest.mark.parametrize("top", ["flowtrain", "sims", "tui", "cuda_numba", "tests",
                                 "benchmarks", "examples"])
def test_no_module_over_600_lines(top: str) -> None:
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in sorted((REPO / top).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert long == []
