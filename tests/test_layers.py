"""The import graph keeps the layers: gateway and evals side by side over the pipeline, the
pipeline over retrieval, the router and the engine, the engine over kernels; no import circle;
and nothing outside the engine reaches into it past its public module (engine/__init__.py).
Lazy imports inside functions count: a circle through one is still a circle."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "gateway", "evals", "pipeline", "retrieval", "router", "engine", "kernels", "models")
# What each part may import of the others (itself always).
MAY_IMPORT = {
    "cli": {"gateway", "evals", "models"},
    "gateway": {"pipeline", "retrieval", "router", "engine", "models"},
    "evals": {"pipeline", "retrieval", "router", "engine", "models"},
    "pipeline": {"retrieval", "router", "engine"},
    "retrieval": {"models"},
    "router": set(),
    "engine": {"kernels", "models"},
    "kernels": set(),
    "models": set(),
}


def modules() -> dict[str, Path]:
    found = {"cli": ROOT / "cli.py"}
    for package in PACKAGES[1:]:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules `name` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from pkg import mod` imports the submodule when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_circles():
    g, index, low, stack, on, circles = graph(), {}, {}, [], set(), []

    def visit(v):                        # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in g:
        if v not in index:
            visit(v)
    assert circles == []


def test_each_part_imports_only_the_layers_below_it():
    bad = [f"{a} imports {b}" for a, targets in graph().items() for b in targets
           if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in MAY_IMPORT[a.split(".")[0]]]
    assert bad == []


def test_only_the_engine_imports_its_inside():
    bad = [f"{a} imports {b}" for a, targets in graph().items() for b in targets
           if b.startswith("engine.") and not a.startswith("engine")]
    assert bad == []
