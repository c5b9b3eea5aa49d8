"""scripts/bench_fidelity.py: the rank correlation between credit fidelity and headroom across
specs (with its seed bootstrap), and the step-0 fidelity of a bench policy's batch, where the
oracle's credit is the exact true credit and must score 1."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_fidelity.py"


@pytest.fixture(scope="module")
def bf():
    spec = importlib.util.spec_from_file_location("bench_fidelity", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _auc(heads, n=6, seed=0):
    """Per-seed AUCs whose headroom is ``heads[spec]`` on every seed (grpo 0.2, oracle 0.4 + noise)."""
    rng = np.random.default_rng(seed)
    g = 0.2 + 0.01 * rng.standard_normal(n)
    o = g + 0.2
    auc = {"grpo": g.tolist(), "oracle": o.tolist()}
    for s, h in heads.items():
        auc[s] = (g + h * 0.2).tolist()
    return auc


def test_correlation_follows_the_order_of_fidelity_and_headroom(bf):
    heads = {"a": 0.1, "b": 0.4, "c": 0.7, "d": 0.9}
    auc = _auc(heads)
    specs = ["grpo"] + list(heads)
    up = {s: [{"m": f} for _ in range(6)] for s, f in zip(specs, (0.1, 0.2, 0.3, 0.5, 0.8))}
    rho, lo, hi, n = bf.correlate(up, auc, specs, "m", n_boot=200)
    assert (rho, lo, hi, n) == (pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0), 5)
    down = {s: [{"m": f} for _ in range(6)] for s, f in zip(specs, (0.8, 0.5, 0.3, 0.2, 0.1))}
    assert bf.correlate(down, auc, specs, "m", n_boot=200)[0] == pytest.approx(-1.0)
    # ties in fidelity are average ranks; a constant fidelity gives no correlation
    flat = {s: [{"m": 0.5} for _ in range(6)] for s in specs}
    assert np.isnan(bf.correlate(flat, auc, specs, "m", n_boot=50)[0])
    # a spec whose metric is undefined on every seed drops out of the count
    up["d"] = [{} for _ in range(6)]
    assert bf.correlate(up, auc, specs, "m", n_boot=50)[3] == 4


def test_step0_fidelity_scores_the_oracle_as_the_true_credit(bf):
    per, skipped = bf.seed_fidelity("keytok", 0, ["grpo", "oracle", "rloo", "pact"], samples=2)
    assert per["oracle"]["sign_agreement"] == pytest.approx(1.0) and per["oracle"]["rank_corr"] == pytest.approx(1.0)
    assert "rank_corr" not in per["grpo"] or np.isnan(per["grpo"]["rank_corr"])  # uniform credit has no ranking
    assert 0.5 < per["grpo"]["sign_agreement"] < 1.0
    assert skipped == ["pact"]  # its critic exists only inside a run
