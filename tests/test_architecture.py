"""The dependency rules of the package, read from the source of every module.

Data flows passes -> schedules -> runtime: a schedule module imports neither passes nor the
runtime, a runtime module imports nothing from passes, and no module depends on itself
through others. Every import counts as a dependency wherever it stands: at module top, inside
a function (a deferred import still needs the other module) and under ``if TYPE_CHECKING:``
(an annotation names the other module's types, so it depends on them too).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("passes", "schedules", "runtime")
FORBIDDEN = {"schedules": {"passes", "runtime"}, "runtime": {"passes"}, "passes": set()}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("hostswap",) + tuple(p for p in parts if p != "__init__"))


def _imports(tree: ast.AST, module: str = "", is_package: bool = False) -> set[str]:
    """Every hostswap import anywhere in ``tree`` (``module`` names it, for relative imports)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hostswap"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            if base.startswith("hostswap"):
                # "from package import submodule" depends on the submodule, not on the package's __init__
                found.update(f"{base}:{a.name}" for a in node.names)
    return found


def _graph_of(sources: dict[str, str], packages: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """Import graph of the modules whose source ``sources`` maps their dotted names to, with
    edges only between those modules (``packages`` names the ones that are packages)."""
    modules = {m: _imports(ast.parse(src), m, m in packages) for m, src in sources.items()}

    def resolve(imported: str) -> str:
        module, _, name = imported.partition(":")
        return f"{module}.{name}" if f"{module}.{name}" in modules else module

    return {m: {r for i in imports if (r := resolve(i)) in modules and r != m} for m, imports in modules.items()}


def _graph() -> dict[str, set[str]]:
    sources, packages = {}, set()
    for layer in LAYERS:
        for path in sorted((ROOT / layer).glob("*.py")):
            sources[_module_name(path)] = path.read_text()
            if path.name == "__init__.py":
                packages.add(_module_name(path))
    # keep edges to modules of the three layers
    return _graph_of(sources, frozenset(packages))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None if it has none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module):
        state[module] = 1
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                return stack[stack.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_flow_passes_schedules_runtime():
    offending = []
    for module, imports in _graph().items():
        layer = module.split(".")[1]
        for imported in imports:
            if imported.split(".")[1] in FORBIDDEN[layer]:
                offending.append(f"{module} imports {imported}")
    assert not offending, offending


def test_no_import_cycles():
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_check_sees_function_and_type_checking_imports():
    """A loop closed by a function-level import one way and a TYPE_CHECKING import the other
    (the shape a deferred import hides) is reported; either edge alone is not a loop."""
    a = "def render(x):\n    from hostswap.schedules.b import draw\n\n    return draw(x)\n"
    b = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hostswap.schedules.a import A\n"
        "def draw(x: A) -> str:\n    return str(x)\n"
    )
    c = "import typing\nif typing.TYPE_CHECKING:\n    from hostswap.schedules import a\n"
    graph = _graph_of({"hostswap.schedules.a": a, "hostswap.schedules.b": b})
    assert graph == {"hostswap.schedules.a": {"hostswap.schedules.b"}, "hostswap.schedules.b": {"hostswap.schedules.a"}}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"hostswap.schedules.a", "hostswap.schedules.b"}, cycle
    # "from package import module" under typing.TYPE_CHECKING counts too, and a relative import
    graph = _graph_of({"hostswap.schedules.a": "from . import c\n", "hostswap.schedules.c": c}, frozenset())
    assert find_cycle(graph) == ["hostswap.schedules.a", "hostswap.schedules.c", "hostswap.schedules.a"]
    assert find_cycle(_graph_of({"hostswap.schedules.a": a, "hostswap.schedules.b": "def draw(x):\n    return x\n"})) is None


def test_rules_are_checked_on_real_imports():
    graph = _graph()
    assert "hostswap.schedules.weight_schedule" in graph["hostswap.passes.weight_offload"]
    assert "hostswap.schedules.custom_ops" in graph["hostswap.runtime.method_loader"]
    assert "hostswap.schedules.op_facts" in graph["hostswap.passes.graph_facts"]


def _module_aliases(tree: ast.AST) -> set[str]:
    """Names a test file binds to modules: ``import a.b as m`` and ``import a`` (as ``a``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
    return names


def test_tests_patch_no_module_globals():
    """Behaviour is chosen through arguments and options, never by patching a module's globals:
    no test calls ``monkeypatch.setattr`` on a module or a dotted path."""
    offending = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = _module_aliases(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("setattr", "delattr")):
                continue
            owner = node.func.value
            if not (isinstance(owner, ast.Name) and owner.id == "monkeypatch") or not node.args:
                continue
            target = node.args[0]
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if (isinstance(target, ast.Constant) and isinstance(target.value, str)) or (isinstance(root, ast.Name) and root.id in modules):
                offending.append(f"{path.name}:{node.lineno}")
    assert not offending, offending
