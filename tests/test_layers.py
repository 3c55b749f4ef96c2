"""The core's modules import one another one way: no cycle, at module level or inside a function,
and no import up the layers the README's Layout table gives every module.

An import inside a function hides a cycle from Python, not from the design: the code on one side
of it is in the wrong layer. So every import statement in tokenmill/ counts, wherever it stands
(docs/design.md names the layers: leaf, input, engines, outputs, pipeline, policy, record, entry).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "tokenmill"
PACKAGE = "tokenmill"
# bottom to top, as docs/design.md and the README's Layout name them
LAYERS = ("leaf", "input", "engines", "outputs", "pipeline", "policy", "record", "entry")


def core_modules() -> set[str]:
    return {path.stem for path in CORE.glob("*.py") if path.stem != "__init__"}


def imported_modules(node: ast.AST, modules: set[str]) -> set[str]:
    """The core modules one import statement names (`from tokenmill import x` names module x)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.ImportFrom):  # relative: from . import x, from .x import y
        names = [f"{PACKAGE}.{node.module}" if node.module else PACKAGE]
        names += [f"{names[0]}.{alias.name}" for alias in node.names]
    else:
        return set()
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] == PACKAGE and len(parts) > 1 and parts[1] in modules:
            found.add(parts[1])
    return found


def import_graph() -> dict[str, set[str]]:
    """Each core module -> the core modules it imports anywhere in its text."""
    modules = core_modules()
    graph = {}
    for module in sorted(modules):
        tree = ast.parse((CORE / f"{module}.py").read_text(), filename=f"{module}.py")
        graph[module] = set().union(*(imported_modules(node, modules) for node in ast.walk(tree))) - {module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module: each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return components


def shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest import path from start back to start, inside one component."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module] & within):
                if target == start:
                    return paths[module] + [start]
                if target not in paths:
                    paths[target] = paths[module] + [target]
                    following.append(target)
        frontier = following
    return []


def describe_cycles(graph: dict[str, set[str]]) -> list[str]:
    lines = []
    for component in strongly_connected(graph):
        members = set(component)
        lines.append(f"circle of {len(component)} modules: {', '.join(component)}")
        cycles = {tuple(shortest_cycle(graph, module, members)) for module in component}
        lines += [f"  {' -> '.join(cycle)}" for cycle in sorted(cycles, key=lambda c: (len(c), c))]
    return lines


def test_the_import_reader_sees_module_and_function_level_imports():
    source = ("from tokenmill import spec\nimport tokenmill.errors\n"
              "def f():\n    from tokenmill.storage import OutputStore\n    from . import digest\n")
    tree = ast.parse(source)
    modules = {"spec", "errors", "storage", "digest", "shards"}
    found = set().union(*(imported_modules(node, modules) for node in ast.walk(tree)))
    assert found == {"spec", "errors", "storage", "digest"}


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert describe_cycles(graph)[1] == "  a -> b -> c -> a"


def test_no_import_cycle_among_the_core_modules():
    graph = import_graph()
    assert graph, "no modules found under tokenmill/"
    cycles = describe_cycles(graph)
    assert not cycles, "import cycles in tokenmill/ (every import counts, inside functions too):\n" + "\n".join(cycles)


def layout_layers() -> dict[str, str]:
    """module -> layer, from the README's module table (rows `| `module` | layer | what |`)."""
    section = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    return {name.strip().strip("`"): layer.strip() for name, layer in rows if layer.strip() in LAYERS}


def test_the_layout_table_names_every_module_with_its_layer():
    layers = layout_layers()
    missing = sorted(core_modules() - set(layers))
    assert not missing, f"README.md, Layout: add a row (module, layer, what) for {', '.join(missing)}"
    gone = sorted(set(layers) - core_modules())
    assert not gone, f"README.md, Layout names modules tokenmill/ no longer has: {', '.join(gone)}"


def test_no_import_points_up_the_layers():
    layers = layout_layers()
    rank = {module: LAYERS.index(layer) for module, layer in layers.items()}
    upward = [f"{module} ({layers[module]}) imports {target} ({layers[target]})"
              for module, targets in sorted(import_graph().items()) for target in sorted(targets)
              if module in rank and target in rank and rank[target] > rank[module]]
    assert not upward, "imports that point up the layers (README.md, Layout):\n" + "\n".join(upward)
