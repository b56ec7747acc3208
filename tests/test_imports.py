"""Every ``flashmask`` module imports on its own, and no two ``flashmask`` modules import each
other, directly or through others.

The import graph is read from the source with ``ast``: every ``import`` / ``from ... import``
statement, at module level or inside a function (a lazy import closes a cycle just the same when
it runs), and ``importlib.import_module("...")`` with a literal name. ``from package import
name`` counts as an import of the submodule ``package.name`` when there is one, else of the
package. Importing a submodule also runs its packages' ``__init__``; those implicit edges are
left out, as every submodule would otherwise close a cycle with a package that re-exports it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import flashmask

PACKAGE_DIR = Path(flashmask.__file__).parent
# Third-party packages some modules need that a plain install may lack (optional extras).
OPTIONAL = {"transformers", "peft", "trl", "matplotlib", "tqdm"}


def _modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the package."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imported(name: str, path: Path) -> set[str]:
    """The ``flashmask`` modules that ``name`` (at ``path``) imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(module: str, names: list[str]) -> None:
        for item in names:
            if f"{module}.{item}" in MODULES:
                found.add(f"{module}.{item}")
            elif module in MODULES:
                found.add(module)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            add(module, [alias.name for alias in node.names])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in MODULES
        ):
            found.add(node.args[0].value)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    return {name: _imported(name, path) for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_module_level_and_function_level_imports():
    graph = import_graph()
    assert {"flashmask.mask", "flashmask.compose"} <= set(graph)
    assert "flashmask.mask" in graph["flashmask.compose"]  # module level
    assert "flashmask.distributed.report" in graph["flashmask.cli"]  # inside a function
    assert "flashmask.bench" in graph["flashmask.cli"]  # importlib.import_module
    assert "flashmask.kernels" in graph["flashmask.ops"]  # from flashmask import kernels
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_flashmask_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"flashmask.__main__"}))
def test_every_module_imports(name):
    try:
        importlib.import_module(name)
    except ImportError as error:
        missing = getattr(error, "name", None) or ""
        cause = getattr(error.__cause__, "name", None) or ""
        if {missing.split(".")[0], cause.split(".")[0]} & OPTIONAL:
            pytest.skip(f"{name} needs an optional package: {error}")
        raise
