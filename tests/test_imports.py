"""The import graph of miles/ and plugins/ has no cycles, function-local imports included (a
lazy import that closes a cycle hides it until the order of first use changes)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    out = {}
    for base in ("miles", "plugins"):
        for f in (ROOT / base).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (not under `if TYPE_CHECKING`).
    `from pkg import sub` is an import of pkg.sub where that is a module, else of pkg."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = ".".join([*package[:len(package) - n.level + 1], *([n.module] if n.module else [])]) if n.level \
                else n.module
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in n.names}
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_among_the_projects_modules():
    known = modules()
    graph = {m: imports(m, f, known) for m, f in known.items()}
    assert sum(map(len, graph.values())) > 100, "the import graph came out nearly empty: the parser is wrong"
    assert "plugins.deepseek_v4.ops" in graph["plugins.deepseek_v4.model"]  # `from . import ops` is seen
    assert cycles(graph) == [], "import cycles (break each by moving what both need into a module of its own)"


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import(tmp_path):
    """The check itself: a function-local import that closes a loop is a cycle."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import c\n")
    (tmp_path / "c.py").write_text("from a import x\n")
    known = {m: tmp_path / f"{m}.py" for m in "abc"}
    graph = {m: imports(m, f, known) for m, f in known.items()}
    assert cycles(graph) == [["a", "b", "c"]]
