"""The dependency rules of the package, read from the source of every module.

Data flows passes -> schedules -> runtime: a schedule module imports neither passes nor the
runtime, a runtime module imports nothing from passes, and no module depends on itself
through others. Imports under ``if TYPE_CHECKING:`` (annotations only) do not count.
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


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hostswap"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hostswap"):
            # "from package import submodule" depends on the submodule, not on the package's __init__
            found.update(f"{node.module}:{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).glob("*.py")):
            modules[_module_name(path)] = _imports(ast.parse(path.read_text()))
    def resolve(imported: str) -> str:
        module, _, name = imported.partition(":")
        return f"{module}.{name}" if f"{module}.{name}" in modules else module

    # keep edges to modules of the three layers
    return {m: {r for i in imports if (r := resolve(i)) in modules and r != m} for m, imports in modules.items()}


def test_flow_passes_schedules_runtime():
    offending = []
    for module, imports in _graph().items():
        layer = module.split(".")[1]
        for imported in imports:
            if imported.split(".")[1] in FORBIDDEN[layer]:
                offending.append(f"{module} imports {imported}")
    assert not offending, offending


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module):
        state[module] = 1
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(imported):] + [imported]))
            if imported not in state:
                visit(imported)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


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
