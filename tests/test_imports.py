"""The package's imports form no cycle, and none is hidden behind a function-level or dynamic import.

The graph is read from the source with `ast`: an edge A -> B for every `import` of a compiled_attn
module B that runs when A runs, at module level or inside a function. Imports under
`if TYPE_CHECKING:` never run and are left out (a module may name a type of a module that imports
it); importing `compiled_attn.x.y` also runs the packages above it, which are left out too, as
every import tool does. Lazy imports of optional third-party packages (flashinfer, xformers,
triton, tqdm, matplotlib) are fine; a function-level import of one of our modules needs a reason
in LAZY_ALLOWED.
"""

from __future__ import annotations

import ast
from pathlib import Path

import compiled_attn

ROOT = Path(compiled_attn.__file__).parent
PACKAGE = "compiled_attn"
# (importer, imported) -> why the import waits for the call
LAZY_ALLOWED = {
    ("compiled_attn.ops.cache", "compiled_attn.ops.triton_cache"):
        "triton_cache imports triton at module level; CPU builds of torch come without triton",
    ("compiled_attn.backends.flashinfer", "compiled_attn.ops.triton_decode"):
        "triton_decode imports triton at module level; CPU builds of torch come without triton",
    ("compiled_attn.bench.decode_flashinfer", "compiled_attn.ops.triton_decode"):
        "triton_decode imports triton at module level; CPU builds of torch come without triton",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported compiled_attn module, inside a function?, line) for every import that runs."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, bool, int]] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        found = []
        for name in names:
            while name and name not in MODULES:  # `import compiled_attn.x.y as z` -> the longest module
                name = name.rpartition(".")[0]
            if name.startswith(PACKAGE):
                found.append(name)
        return found

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child):
                for other in child.orelse:
                    visit(other, in_function)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.extend((t, in_function, child.lineno) for t in targets(child))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(path.read_text()), False)
    return out


def import_graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in imports(m) if t != m} for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_walk_sees_the_known_edges():
    graph = import_graph()
    assert "compiled_attn.validation" in graph["compiled_attn.abstract"]
    assert "compiled_attn.backends.common" in graph["compiled_attn.backends.torch_sdpa"]
    assert "compiled_attn.ops.torch_sdpa" in graph["compiled_attn.backends.torch_sdpa"]  # `from pkg import mod`
    assert "compiled_attn.abstract" not in graph["compiled_attn.validation"]  # under TYPE_CHECKING only


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_package_imports_have_no_cycle():
    assert cycles(import_graph()) == []


def test_no_function_level_import_of_our_modules_without_a_reason():
    lazy = {(m, t): line for m in MODULES for t, in_function, line in imports(m) if in_function}
    unexplained = [f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {t}"
                   for (m, t), line in sorted(lazy.items()) if (m, t) not in LAZY_ALLOWED]
    assert unexplained == [], "import at module level, or add the reason to LAZY_ALLOWED"
    assert set(LAZY_ALLOWED) <= set(lazy), "LAZY_ALLOWED names an import that is no longer there"


def test_no_dynamic_import_in_the_package():
    # importlib.import_module / __import__ would hide an edge from the walk above
    calls = [f"{MODULES[m].relative_to(ROOT.parent)}:{node.lineno}" for m, path in MODULES.items()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and (
                 (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                 or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")))]
    assert calls == []
