"""The fidelity package's place in the layers: it imports the core and nothing in the core
imports it (only the top-level command line dispatches to it), and within it only
``claims.py`` names methods (it reports named papers' claims); every other module scores
whatever the registry holds, as methods declare it."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import SRC, _imports

PKG = "tokencredit.analysis.fidelity"


def test_nothing_in_the_core_imports_fidelity():
    users = {m for m, deps in _imports().items()
             if not (m == PKG or m.startswith(PKG + ".")) and any(d == PKG or d.startswith(PKG + ".") for d in deps)}
    assert "tokencredit.cli" in users  # the check sees an import where there is one (the dispatch)
    assert users <= {"tokencredit.cli"}, sorted(users)


def _named_methods(path: Path, names, signals):
    """(line, what) of each string constant that is a method name or a spec of them (a signal
    that shares a method's name, "entropy", is not one) and each import of a method module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value not in signals:
            parts = node.value.split("+")
            if all(p in names for p in parts):
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module == "methods" or node.module.startswith("methods.")
                                                                  or ".methods" in node.module):
            found.append((node.lineno, f"import {node.module}"))
    return found


def test_only_claims_names_methods():
    from tokencredit.credit.batch import SIGNALS
    from tokencredit.credit.registry import list_methods

    names = set(list_methods())
    pkg = SRC / "analysis" / "fidelity"
    assert _named_methods(pkg / "claims.py", names, set(SIGNALS))  # the check sees names where they are
    named = {p.name: _named_methods(p, names, set(SIGNALS)) for p in sorted(pkg.glob("*.py")) if p.name != "claims.py"}
    assert not {k: v for k, v in named.items() if v}
