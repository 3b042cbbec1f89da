"""The floors of the harness (issue 44): no module imports a floor above its own.

    pytest tests/test_layers.py

bench/ is built in floors, one folder each (docs/architecture.md, "Layers"); `FLOORS`
below is their order, top first, and the one place it is written. Every import is read
from the source (top level, inside functions, under TYPE_CHECKING, relative ones too):
a module may import its own floor and any floor below, never one above. eval/ sits
between the command line (the only bench module that imports it) and the node tools.
A new module must belong to a floor: one outside them all fails, naming it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FLOORS = [
    ("cli", ["bench.cli"]),
    ("eval", ["eval"]),
    ("node", ["bench.node"]),
    ("study", ["bench.study"]),
    ("launch", ["bench.launch", "bench.jobentry"]),  # bench.jobentry: queued jobs' old name
    ("run", ["bench.run"]),
    ("parts", ["bench.config", "bench.data", "bench.model", "bench.network", "bench.optim",
               "bench.memory", "bench.env"]),
    ("algorithms", ["algorithms"]),
]
"""Floors from the top down, each with the module prefixes it holds."""

PACKAGES = ("bench", "eval", "algorithms")


def floor_of(module: str) -> int | None:
    """The index in FLOORS of the floor holding `module` (longest prefix), or None."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = i, len(prefix)
    return best


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool, known: set[str]) -> list[str]:
    """Every module of PACKAGES that `source` imports, wherever the import statement is;
    `from package import name` counts as importing package.name when that is a module."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append(sub if sub in known else target)
    return [name for name in found if name.split(".")[0] in PACKAGES]


def back_arrows(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """'A (floor) imports B (floor above)' for each import that points up; modules outside
    every floor are reported too. `sources`: module name -> (source, is a package)."""
    known = set(sources)
    found = []
    for module, (source, is_package) in sorted(sources.items()):
        if module == "bench":  # bench/__init__.py runs before every floor: it imports none
            found += [f"bench imports {target} (bench/__init__.py imports no floor)"
                      for target in imports(source, module, is_package, known)]
            continue
        own = floor_of(module)
        if own is None:
            found.append(f"{module} belongs to no floor (add it to FLOORS)")
            continue
        for target in imports(source, module, is_package, known):
            floor = floor_of(target)
            if floor is not None and floor < own:
                found.append(f"{module} ({FLOORS[own][0]}) imports {target} "
                              f"({FLOORS[floor][0]}, a floor above)")
    return sorted(set(found))


def read_tree() -> dict[str, tuple[str, bool]]:
    sources = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            sources[module_name(path, REPO)] = (path.read_text(), path.name == "__init__.py")
    return sources


def test_no_module_imports_a_floor_above_its_own():
    assert back_arrows(read_tree()) == []


@pytest.mark.parametrize("folder", ["node", "study", "launch", "run", "config", "data"])
def test_each_floor_folder_says_what_it_owns_and_may_import(folder):
    doc = ast.get_docstring(ast.parse((REPO / "bench" / folder / "__init__.py").read_text()))
    assert doc and f"bench/{folder}:" in doc and "never" in doc, \
        f"bench/{folder}/__init__.py: a paragraph saying what it owns and may import"


@pytest.mark.parametrize("source, module, expected", [
    ("from bench.launch import torchrun", "bench.run.train",
     ["bench.run.train (run) imports bench.launch.torchrun (launch, a floor above)"]),
    ("def f():\n    import bench.study.report\n", "bench.config.checks",
     ["bench.config.checks (parts) imports bench.study.report (study, a floor above)"]),
    ("from ..study.report import render", "bench.launch.run",
     ["bench.launch.run (launch) imports bench.study.report (study, a floor above)"]),
    ("import eval.runner", "bench.study.sweep",
     ["bench.study.sweep (study) imports eval.runner (eval, a floor above)"]),
    ("from bench.run import records\nfrom algorithms.base import STRATEGIES", "bench.launch.run",
     []),
    ("", "bench.hall", ["bench.hall belongs to no floor (add it to FLOORS)"]),
    ("from bench.run import records", "bench",
     ["bench imports bench.run.records (bench/__init__.py imports no floor)"]),
])
def test_the_scan_sees_an_arrow_back_up(source, module, expected):
    tree = {module: (source, False), "bench.launch.torchrun": ("", False),
            "bench.run.records": ("", False)}
    assert back_arrows(tree) == expected
