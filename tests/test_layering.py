"""The house's import rules (issue 41 item 7), read from the source with ``ast``: every import of
one of mmtier's modules by another, at import time or inside a function (those guarded by
``TYPE_CHECKING`` are for annotations only and left out).

- Packages and top-level modules form layers: no package reaches, directly or through others,
  a package that reaches back (the graph of packages is acyclic), so every import runs down.
  ``LAYERS`` below is that order as it stands, bottom first; a change that adds an import
  running up fails here, naming the edge.
- No cycle among modules, at import time or through imports inside functions.
- No module imports another's private (underscore) name."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mmtier"

# bottom first; a name with ".py" is a top-level module, "mmtier" the package's __init__
LAYERS = [
    {"errors.py", "native", "stats"},
    {"config.py", "content.py"},
    {"core"},
    {"eviction", "pages"},
    {"storage"},
    {"attention", "tiers"},
    {"cache"},
    {"cluster"},
    {"engines", "mmtier"},
    {"chat"},
    {"serve"},
    {"demo"},
    {"cli.py"},
    {"actors", "integrations"},          # old paths kept for configs: one import line a module
]


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(mods: dict[str, Path], *, lazy: bool) -> dict[str, set[tuple[str, str]]]:
    """``module -> {(imported module, name)}`` (name "" for a module imported whole)."""
    edges: dict[str, set[tuple[str, str]]] = collections.defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(nodes, name=name, package=package):
            for node in nodes:
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                        target = ".".join(base + ([node.module] if node.module else []))
                    else:
                        target = node.module or ""
                    if target == "mmtier" or target.startswith("mmtier."):
                        for alias in node.names:
                            sub = f"{target}.{alias.name}"
                            edges[name].add((sub, "") if sub in mods else (target, alias.name))
                elif isinstance(node, ast.Import):
                    edges[name].update((a.name, "") for a in node.names if a.name.startswith("mmtier"))
                elif lazy or isinstance(node, (ast.If, ast.Try)):
                    for field in ("body", "orelse", "finalbody", "handlers"):
                        visit(getattr(node, field, []))

        visit(ast.parse(path.read_text()).body)
    return edges


def node_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "mmtier"
    return parts[1] if (ROOT / parts[1]).is_dir() else parts[1] + ".py"


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected parts of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(part)

    for v in list(graph):
        if v not in index:
            strong(v)
    return found


def test_every_import_runs_down_the_layers():
    mods = modules()
    layer = {n: i for i, names in enumerate(LAYERS) for n in names}
    nodes = {node_of(m) for m in mods}
    assert nodes == set(layer), f"packages not placed in LAYERS: {sorted(nodes ^ set(layer))}"
    up = sorted((a, b) for a, targets in imports(mods, lazy=True).items() for b, _ in targets
                if b in mods and layer[node_of(b)] > layer[node_of(a)])
    assert not up, f"imports that run up a layer: {up[:10]}"


def test_no_module_cycle_at_import_time():
    mods = modules()
    graph = {a: {b for b, _ in targets if b in mods} for a, targets in imports(mods, lazy=False).items()}
    assert cycles(graph) == []


def test_no_module_cycle_through_imports_inside_functions():
    mods = modules()
    graph = {a: {b for b, _ in targets if b in mods} for a, targets in imports(mods, lazy=True).items()}
    assert cycles(graph) == []


def test_no_module_imports_another_modules_private_name():
    mods = modules()
    private = sorted((a, f"{b}.{n}") for a, targets in imports(mods, lazy=True).items()
                     for b, n in targets if n.startswith("_") and not n.startswith("__"))
    assert not private, private
