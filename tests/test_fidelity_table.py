"""The bundled fidelity tables, pinned byte for byte.

``tokencredit fidelity --reference {spans,spans-crn,tokens,tokens-crn,exact} --claims`` (the table and the numbers
behind docs/fidelity.md's answers to the papers' claims) and the same with ``--json`` print
exactly the text in ``tests/data/fidelity_<set>.txt`` / ``.json``, so that a refactor of the
fidelity package (or of anything the scores replay) cannot change a bundled result unseen.
A change that is meant to change the numbers rewrites the fixtures with

    .venv-test/bin/python tests/test_fidelity_table.py --write

and the diff of tests/data/ shows what moved (docs/fidelity.md quotes these tables).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tokencredit.cli import main

DATA = Path(__file__).parent / "data"
SETS = ("spans", "spans-crn", "tokens", "tokens-crn", "exact")


def _printed(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _argv(ref: str, kind: str):
    return ["fidelity", "--reference", ref, "--claims"] + (["--json"] if kind == "json" else [])


@pytest.mark.parametrize("kind", ["txt", "json"])
@pytest.mark.parametrize("ref", SETS)
def test_the_bundled_table_is_unchanged(ref, kind, capsys):
    expected = (DATA / f"fidelity_{ref}.{kind}").read_text()
    got = _printed(_argv(ref, kind), capsys)
    assert got == expected, f"tokencredit {' '.join(_argv(ref, kind))} differs from tests/data/fidelity_{ref}.{kind}"


if __name__ == "__main__":  # rewrite the fixtures: python tests/test_fidelity_table.py --write
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_fidelity_table.py --write")
    import contextlib
    import io

    for ref in SETS:
        for kind in ("txt", "json"):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(_argv(ref, kind)) == 0
            (DATA / f"fidelity_{ref}.{kind}").write_text(buf.getvalue())
            print(f"wrote tests/data/fidelity_{ref}.{kind}", file=sys.stderr)
