"""Dependencies point one way: no import cycle between tokencredit's modules, no module imports a
layer above its own (errors < credit < engine < data < train < analysis < integrations < cli), and
inside the credit layer methods and losses never import what reads their output."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tokencredit"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict:
    """module -> the tokencredit modules it imports (at module level or inside functions)."""
    mods = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                cands = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            for c in cands:
                if c in mods and c != name:
                    deps.add(c)
        graph[name] = deps
    return graph


def _cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if d.startswith(n + ".") or n.startswith(d + ".") and d == n.rsplit(".", 1)[0]:
                continue  # a package and its own submodules (re-exports)
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = _imports()
    # the methods package imports its modules to register them, and the registry loads the
    # package on first use: that one link is how registration works, not a layering cycle
    graph["tokencredit.credit.registry"] = graph["tokencredit.credit.registry"] - {"tokencredit.credit.methods"}
    graph["tokencredit"] = set()  # the top-level package only re-exports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


# The package's layers, lowest first (docs/architecture.md draws them). A module may import its
# own layer and the layers below it, never one above. `errors` and `testing` are leaves that
# import nothing of tokencredit; the top-level package re-exports the credit API; `cli` is the top.
LAYERS = ("errors", "credit", "engine", "data", "train", "analysis", "integrations", "cli")
LEAVES = ("errors", "testing")


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tokencredit"


def test_the_top_of_the_package_holds_the_layers_and_a_few_modules():
    top = sorted(p.stem if p.is_file() else p.name for p in SRC.iterdir()
                 if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists()))
    assert top == sorted(set(LAYERS) | set(LEAVES)), top


def test_no_module_imports_a_layer_above_its_own():
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for module, deps in _imports().items():
        layer = _layer(module)
        if layer == "tokencredit":
            continue  # the top-level re-exports (checked: it imports only the credit layer)
        for d in sorted(deps):
            target = "credit" if d == "tokencredit" else _layer(d)  # the top-level package: the credit API
            if layer in LEAVES:
                bad.append(f"{module} -> {d} (a leaf imports nothing of tokencredit)")
            elif target in LEAVES or target == layer:
                continue
            elif rank[target] > rank[layer]:
                bad.append(f"{module} ({layer}) -> {d} ({target})")
    assert not bad, "\n".join(bad)


def test_the_top_level_package_reexports_only_the_credit_layer():
    deps = _imports()["tokencredit"]
    assert deps and all(_layer(d) == "credit" for d in deps), sorted(deps)


@pytest.mark.parametrize("layer", ["tokencredit.credit.methods", "tokencredit.credit.losses"])
def test_lower_layers_do_not_import_upper_ones(layer):
    """Inside the credit layer, methods and losses sit below the pieces that read their output."""
    forbidden = ("tokencredit.credit.diagnostics", "tokencredit.credit.plan", "tokencredit.engine", "tokencredit.data",
                 "tokencredit.train", "tokencredit.analysis", "tokencredit.integrations", "tokencredit.cli")
    if layer == "tokencredit.credit.losses":
        forbidden += ("tokencredit.credit.registry", "tokencredit.credit.spec", "tokencredit.credit.methods")
    bad = {m: sorted(d for d in deps if any(d == f or d.startswith(f + ".") for f in forbidden))  # (planning is not plan)
           for m, deps in _imports().items() if m == layer or m.startswith(layer + ".")}
    assert not {m: d for m, d in bad.items() if d}
