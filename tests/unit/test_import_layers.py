"""No import cycles anywhere in tandem/: every module's top-level imports (those run at
import time; `if TYPE_CHECKING:` blocks and imports inside functions excluded) form a graph
without cycles, so each module can be read, and imported, after what it builds on."""

from __future__ import annotations

import ast
from pathlib import Path

import tandem

ROOT = Path(tandem.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The tandem modules `path` imports when it is imported."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in [node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node):
            if isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                found.add(sub.module)
                found.update(f"{sub.module}.{a.name}" for a in sub.names)
    return {m for m in found if m in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_in_tandem():
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    # A package's __init__ runs before its modules: `import tandem.x.y` depends on tandem.x too,
    # but a package never depends on its own submodules by that rule alone.
    graph = {name: top_level_imports(path, modules) - {name} for name, path in paths.items()}
    assert "tandem.scheduler.batch_former" in graph["tandem.scheduler.scheduler"]  # the graph is read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
