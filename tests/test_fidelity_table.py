"""The bundled fidelity tables, pinned.

``tokencredit fidelity --reference {spans,spans-crn,tokens,tokens-crn,exact} --claims`` (the table and the numbers
behind docs/fidelity.md's answers to the papers' claims) and the same with ``--json`` print
the text in ``tests/data/fidelity_<set>.txt`` / ``.json``, so that a refactor of the fidelity
package (or of anything the scores replay) cannot change a bundled result unseen.

What is pinned holds on any CPU: the JSON's structure, keys, strings, integers and booleans
exactly, its floats to the tolerances below; the table's text exactly, its printed numbers to
one unit of their last printed digit (a value on a rounding boundary may print either way).
Measured: the tables printed on an AMD EPYC (AVX2; where the fixtures were first written) and on
an Intel Xeon (AVX-512, AMX) under ATEN_CPU_CAPABILITY avx512 (its default), avx2 (with
MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2: bit-identical to the AMD's) and
default (no vector kernels) differ by at most 2.8e-6 relative or 4.6e-8 absolute, except the
rank correlations: near-tied credits swap order between kernel sets and a bootstrap bound
jumps, by at most 1.7e-4 (OPPO's lower bound on the per-token set under ``default``). Each
tolerance is about 10x its measurement. A change that is meant to change the numbers rewrites the fixtures with

    .venv-test/bin/python tests/test_fidelity_table.py --write

and the diff of tests/data/ shows what moved (docs/fidelity.md quotes these tables).
"""

from __future__ import annotations

import json
import math
import re
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


#: a JSON float may differ by max(REL * |value|, ABS); a rank correlation's by ABS_RANK (see above)
REL, ABS, ABS_RANK = 3e-5, 5e-7, 2e-3
_NUMBER = re.compile(r"-?\d+(?:\.(\d+))?(?:e[-+]?\d+)?")


def same_json(got, want, where: str = "") -> None:
    """``got == want``, floats to ``REL`` relative (1e-12 absolute near 0); an AssertionError names
    the first place they differ."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        tol = ABS_RANK if "rank_corr" in where else max(REL * abs(want), ABS)
        same = got == want or (math.isnan(got) and math.isnan(want)) or abs(got - want) <= tol
        assert same, f"{where}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: keys {list(got) if isinstance(got, dict) else got!r} != {list(want)}"
        for k in want:
            same_json(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            same_json(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def same_text(got: str, want: str) -> None:
    """The same text up to the printed numbers, each within one unit of its last printed digit."""
    g_lines, w_lines = got.splitlines(), want.splitlines()
    assert len(g_lines) == len(w_lines), f"{len(g_lines)} lines != {len(w_lines)}"
    for i, (g, w) in enumerate(zip(g_lines, w_lines)):
        assert _NUMBER.sub("#", g) == _NUMBER.sub("#", w), f"line {i + 1}: {g!r} != {w!r}"
        for mg, mw in zip(_NUMBER.finditer(g), _NUMBER.finditer(w)):
            unit = 10.0 ** -len(mw.group(1) or "") if "e" not in mw.group(0) else abs(float(mw.group(0))) * 1e-3
            assert abs(float(mg.group(0)) - float(mw.group(0))) <= unit * 1.0001, f"line {i + 1}: {mg.group(0)} != {mw.group(0)}: {g!r}"


@pytest.mark.parametrize("kind", ["txt", "json"])
@pytest.mark.parametrize("ref", SETS)
def test_the_bundled_table_is_unchanged(ref, kind, capsys):
    expected = (DATA / f"fidelity_{ref}.{kind}").read_text()
    got = _printed(_argv(ref, kind), capsys)
    try:
        same_json(json.loads(got), json.loads(expected)) if kind == "json" else same_text(got, expected)
    except AssertionError as e:
        raise AssertionError(f"tokencredit {' '.join(_argv(ref, kind))} differs from tests/data/fidelity_{ref}.{kind}: {e}") from None


def test_the_comparison_fails_on_a_changed_value():
    """The tolerant comparisons still see a change in a pinned number (0.1% of a mass, 0.01 of a
    rank correlation, one printed digit) or a word."""
    want = json.loads((DATA / "fidelity_exact.json").read_text())
    same_json(json.loads(json.dumps(want)), want)
    moved = json.loads(json.dumps(want))
    moved["rows"][1]["pivotal_mass"]["mean"] *= 1 + 1e-3
    with pytest.raises(AssertionError, match="pivotal_mass"):
        same_json(moved, want)
    moved = json.loads(json.dumps(want))
    moved["rows"][1]["rank_corr"]["mean"] += 0.01
    with pytest.raises(AssertionError, match="rank_corr"):
        same_json(moved, want)
    text = (DATA / "fidelity_exact.txt").read_text()
    same_text(text, text)
    with pytest.raises(AssertionError):
        same_text(text.replace("0.", "0.9", 1) if "0." in text else text + "x", text)
    with pytest.raises(AssertionError):
        same_text(text.replace("random", "rando", 1), text)


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
