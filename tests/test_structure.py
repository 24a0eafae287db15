"""Structure tier: the import graph of `src/tamer`, built from the source, has no cycle and keeps the layers.

Edges are the `import` statements of each module, at module level and inside functions (both run
at some point); `if TYPE_CHECKING:` blocks are left out (they never run). `from pkg import name`
is an edge to `pkg.name` when that is a module, else to `pkg`. A package's `__init__` is a module
like any other; importing a submodule is not counted as importing its parent package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "tamer").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    return skipped


def import_graph() -> dict[str, set[str]]:
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        skipped, edges = _type_checking_nodes(tree), set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                edges.update(resolve(a.name) for a in node.names if a.name.startswith("tamer"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                if base.startswith("tamer"):
                    edges.update(resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else resolve(base)
                                 for a in node.names)
        graph[module] = {e for e in edges if e and e != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40 and "tamer.cli" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module, must_not_reach", [
    ("tamer.rewards", "tamer.tools.sandbox"),  # the code reward is registered lazily
    ("tamer.tasks", "tamer.tools.sandbox"),  # so is the code task
    ("tamer.models.logprobs", "tamer.rollout"),  # the learner's forward does not import the sampler
    ("tamer.trainers.batch", "tamer.rollout.engine"),  # the learner's data does not need the sampler
    ("tamer.algorithms", "tamer.trainers"),  # the algorithm core is below the trainers
    ("tamer.algorithms", "tamer.models"),
    ("tamer.models", "tamer.rollout"),  # models are below the sampler and the learner
    ("tamer.models", "tamer.trainers"),
    ("tamer.config", "tamer.pipeline"),
])
def test_layers(module, must_not_reach):
    reached = reachable(import_graph(), module)
    assert not any(m == must_not_reach or m.startswith(must_not_reach + ".") for m in reached), sorted(reached)


def test_only_the_cli_module_defines_typer_commands():
    users = [m for m, p in _modules().items() if "import typer" in p.read_text()]
    assert users == ["tamer.cli"]
