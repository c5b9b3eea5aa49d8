"""No module of tokencredit uses another module's private names: what one module needs of
another is public (no underscore, a docstring, in ``__all__`` where the module has one).

Found with Python's ast, in every module under ``src/tokencredit``:

* an import of a name that starts with one underscore from a tokencredit module
  (``from .config import _from_dict``), or of a private module from outside its package;
* an attribute ``x._name`` (``getattr(x, "_name")`` too), where ``x`` is not ``self`` / ``cls``
  and ``_name`` is not one of this module's own names but is defined by another tokencredit
  module (a function, class, constant, method or ``self._name`` attribute there): another
  module's internals reached through its module, class or object (``trainer._open_logs()``,
  ``ro._stop_ids``). A private name no tokencredit module defines is a third-party library's
  (torch's, transformers', verl's) and out of scope here.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

SRC = Path(__file__).resolve().parents[1] / "src" / "tokencredit"

#: (module, private name) -> why it is allowed: a use of another module's private name that is
#: justified (none is, today; an entry needs its reason, and the second test drops a stale one).
ALLOWED: Dict[Tuple[str, str], str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _modules() -> Dict[str, Path]:
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _target(node: ast.ImportFrom, pkg: str) -> str:
    if not node.level:
        return node.module or ""
    base = pkg.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _defined(tree: ast.AST) -> Set[str]:
    """The private names a module defines: top-level and class-level functions, classes and
    assignments, and attributes it assigns on ``self`` / ``cls``."""
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out.add(n.id)
                    elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                        out.add(n.attr)
    return {n for n in out if _private(n)}


def private_uses() -> List[Tuple[str, int, str, str]]:
    """(module, line, private name, what) for every cross-module private use in src/tokencredit."""
    mods = _modules()
    trees = {name: ast.parse(path.read_text()) for name, path in mods.items()}
    defined = {name: _defined(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        pkg = _package(name, mods[name])
        own = defined[name]
        others = set().union(*(d for m, d in defined.items() if m != name))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _target(node, pkg)
                if not (target == "tokencredit" or target.startswith("tokencredit.")) or target == name:
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:  # a submodule: private if its name is, and then only for its own package
                        if _private(a.name) and pkg != target:
                            found.append((name, node.lineno, a.name, f"imports the private module {sub}"))
                    elif _private(a.name):
                        found.append((name, node.lineno, a.name, f"imports {target}.{a.name}"))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("tokencredit.") and any(_private(p) for p in a.name.split(".")):
                        found.append((name, node.lineno, a.name, f"imports the private module {a.name}"))
            else:
                attr, obj = None, None
                if isinstance(node, ast.Attribute):
                    attr, obj = node.attr, node.value
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
                      and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                    attr, obj = node.args[1].value, node.args[0]
                if attr is None or not _private(attr) or attr in own or attr not in others:
                    continue
                if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                    continue
                if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super":
                    continue
                where = ", ".join(sorted(m for m, d in defined.items() if m != name and attr in d))
                found.append((name, node.lineno, attr, f"uses {ast.unparse(obj)}.{attr} (defined in {where})"))
    return sorted(found)


def test_no_cross_module_private_names():
    bad = [f"{m}:{line}: {what}" for m, line, attr, what in private_uses() if (m, attr) not in ALLOWED]
    assert not bad, "another module's private names (make them public, or move them to their user):\n" + "\n".join(bad)


def test_allow_list_is_current():
    """Every allowed use still exists (an entry left after its use is gone allows a new one)."""
    used = {(m, attr) for m, _, attr, _ in private_uses()}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allow-list entries with no use any more: {stale}"
