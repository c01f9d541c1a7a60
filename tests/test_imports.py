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


def megatron_first(path: Path) -> list[str]:
    """Imports of megatron that run when `path` loads (outside function bodies: inside `if`,
    `try` and class bodies too), in source order, before its import of
    miles.train.megatron_import (all of them when it has none)."""
    loads = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                loads.append(child)
            elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child)

    visit(ast.parse(path.read_text()))
    seen, out = False, []
    for n in sorted(loads, key=lambda n: (n.lineno, n.col_offset)):
        names = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
        seen |= "miles.train.megatron_import" in names
        out += [f"{path.name}:{n.lineno}" for m in names if m.split(".")[0] == "megatron" and not seen]
    return out


def test_every_module_importing_megatron_at_load_imports_it_through_megatron_import(tmp_path):
    """A module that imports megatron.core at module level before miles.train.megatron_import
    would import it with its ~40 fused functions compiled at import (Dynamo and Inductor
    loaded, ~2 s of CPU in every actor). The check itself is checked on a planted module."""
    found = {m: megatron_first(f) for m, f in modules().items() if m != "miles.train.megatron_import"}
    assert "miles.train.worker" in found and not found["miles.train.worker"]
    assert [w for m in found.values() for w in m] == []
    (tmp_path / "bad.py").write_text("import torch\nfrom megatron.core import parallel_state\n"
                                     "try:\n    import megatron.core.jit\nexcept ImportError:\n    pass\n"
                                     "def f():\n    import megatron.core.utils\n")
    assert megatron_first(tmp_path / "bad.py") == ["bad.py:2", "bad.py:4"]  # not the function's


FIRST_CALL = """
import sys, torch
import miles.train.worker  # megatron.core and the training worker
from megatron.core import jit
from megatron.core.fusions.fused_bias_swiglu import swiglu
assert "torch._dynamo" not in sys.modules and "torch._inductor.compile_fx" not in sys.modules, "compiled at import"
assert jit.jit_fuser is not torch.compile
from miles.train.megatron_import import _compile_on_first_call
seen = []
def backend(gm, example_inputs):  # records that it compiled, runs the graph as traced
    seen.append(len(example_inputs))
    return gm.forward
lazy = _compile_on_first_call(torch.compile)
double = lazy(lambda x: 2 * x + 1, backend=backend)
assert not seen and "torch._dynamo" not in sys.modules, "compiled before the first call"
x = torch.randn(5, 3)
assert torch.equal(double(x), 2 * x + 1) and seen == [1], seen
@lazy(backend=backend)
def triple(x):
    return 3 * x - 1
assert torch.equal(triple(x), 3 * x - 1) and seen == [1, 1], seen
assert torch.equal(lazy(model=lambda x: x - 2, backend=backend)(x), x - 2) and len(seen) == 3
y = torch.randn(4, 6)
a, b = y.chunk(2, -1)
assert torch.isfinite(y).all() and torch.allclose(swiglu.__wrapped__(y), torch.nn.functional.silu(a) * b)
print("ok")
"""


def test_megatron_imports_with_its_fusions_compiled_on_first_call():
    """Importing the training worker loads neither Dynamo nor Inductor (megatron's jit_fuser is
    the first-call wrapper), and the wrapper compiles with the options given (a recording
    backend) when first called, not before, in each of torch.compile's forms (a function, a
    decorator with options, model=), and returns what the function returns."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", FIRST_CALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
