"""The package layout holds: every module imports on its own, no import cycles (imports inside functions
counted), a pure fleet core.

``docs/architecture.md`` ("Layout") draws the tree; these tests keep the code to it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import narwhal

PACKAGE_DIR = Path(narwhal.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    """Every module of the package, ``__main__`` entry points excluded (importing one runs it)."""
    return {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py")) if path.stem != "__main__"}


def _is_type_checking_block(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def module_imports(name: str, path: Path) -> set[str]:
    """The narwhal modules ``name`` imports, at module level or inside functions (TYPE_CHECKING blocks aside).

    An import inside a function still ties the two modules together: it only
    moves the cycle from import time to call time, so it counts.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.stmt) and _is_type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the narwhal modules (and, implicitly, their parent packages) it imports, anywhere in it."""
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for target in module_imports(name, path):
            parts = target.split(".")
            # Importing a.b.c runs a, a.b and a.b.c: each is an edge.
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate in modules and candidate != name and not name.startswith(candidate + "."):
                    edges.add(candidate)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    # Each module is imported with no narwhal module loaded before it, as if it were
    # the first import of a fresh interpreter, so an order-dependent cycle shows.
    script = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {sorted(all_modules())!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'narwhal' or m.startswith('narwhal.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_import_cycles_between_modules() -> None:
    # None allowed: the last one (config <-> tls, certificates read inside parse_config) went with issue 26.
    assert cycles(import_graph()) == []


def test_imports_inside_functions_count(tmp_path: Path) -> None:
    # A cycle closed only by an import inside a function is still a cycle; TYPE_CHECKING imports never run.
    path = tmp_path / "x.py"
    path.write_text("import typing\nif typing.TYPE_CHECKING:\n    from narwhal.app import state\n\n"
                    "def f():\n    from narwhal.config import Config\n")
    assert module_imports("narwhal.x", path) == {"typing", "narwhal.config", "narwhal.config.Config"}


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The test above must be able to fail.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


SHELL_PACKAGES = ("narwhal.control", "narwhal.app", "narwhal.router", "narwhal.serving", "narwhal.stages",
                  "narwhal.pools", "narwhal.http1", "narwhal.state", "narwhal.obs", "narwhal.tools", "narwhal.cli",
                  "narwhal.workers", "narwhal.tls")
# The fleet decides from what it is told, with `now` as an argument: no I/O, no clock, no logging.
IMPURE_LIBRARIES = ("trio", "httpx", "httptools", "logging", "time", "socket", "quart", "quart_trio", "hypercorn")


def test_the_fleet_core_imports_nothing_from_the_shell() -> None:
    fleet_modules = {name: path for name, path in all_modules().items()
                     if name == "narwhal.fleet" or name.startswith("narwhal.fleet.")}
    assert len(fleet_modules) >= 7
    offending = []
    for name, path in fleet_modules.items():
        # Function-level imports count here too: the fleet must not reach the shell at all.
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module]
            else:
                continue
            for target in targets:
                root = target.split(".")[0]
                if root in IMPURE_LIBRARIES or any(target == p or target.startswith(p + ".")
                                                   for p in SHELL_PACKAGES):
                    offending.append(f"{name} imports {target}")
    assert offending == []


def test_the_package_data_carries_the_c_modules_headers_and_stubs() -> None:
    """An sdist, and a wheel built from it, needs the header the C sources include (else the optional modules
    are silently not built) and their type stubs."""
    import re
    import tomllib

    pyproject = tomllib.loads((PACKAGE_DIR.parent / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]

    def listed(path: Path) -> bool:
        package = ".".join(path.parent.relative_to(PACKAGE_DIR.parent).parts)
        return any(path.match(pattern) for pattern in package_data.get(package, []))

    sources = sorted(PACKAGE_DIR.rglob("*.c"))
    assert len(sources) >= 3
    for source in sources:
        for header in re.findall(r'#include "([^"]+)"', source.read_text()):
            assert listed((source.parent / header).resolve()), (source.name, header)
        stub = source.with_suffix(".pyi")
        assert stub.exists() and listed(stub), stub
