"""Dependencies point one way: no import cycle between tokencredit's modules, and the method
and loss layers never import the layers above them (diagnostics, the trainer, integrations)."""

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
    graph["tokencredit.registry"] = graph["tokencredit.registry"] - {"tokencredit.methods"}
    graph["tokencredit"] = set()  # the top-level package only re-exports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


@pytest.mark.parametrize("layer", ["tokencredit.methods", "tokencredit.losses"])
def test_lower_layers_do_not_import_upper_ones(layer):
    forbidden = ("tokencredit.diagnostics", "tokencredit.trainer", "tokencredit.integrations", "tokencredit.cli",
                 "tokencredit.plan", "tokencredit.passes", "tokencredit.compare", "tokencredit.inspector",
                 "tokencredit.records")
    if layer == "tokencredit.losses":
        forbidden += ("tokencredit.registry", "tokencredit.spec", "tokencredit.methods")
    bad = {m: sorted(d for d in deps if any(d == f or d.startswith(f + ".") for f in forbidden))  # (planning is not plan)
           for m, deps in _imports().items() if m == layer or m.startswith(layer + ".")}
    assert not {m: d for m, d in bad.items() if d}
