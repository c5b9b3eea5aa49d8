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


def test_fidelity_along_a_run_scores_each_kept_checkpoint_against_its_own_true_credit(bf, tmp_path, monkeypatch):
    """A quick bench keeps 0, 3, 6; at each, the oracle's credit replayed on a batch of its own
    run's policy is that checkpoint's exact true credit (scores 1), and the reference log-probs
    are the initial policy's (0 divergence at step 0, not at step 6 of a run that moved)."""
    import torch

    from tokencredit.analysis import bench

    out = tmp_path / "b"
    bench.run_bench(tasks="keytok", specs="grpo,oracle", seeds="0", quick=True, output_dir=out, workers=1, progress=False)
    res = bf.run_fidelity(out, "keytok", 0, ["grpo", "oracle", "pact"], 2, [0, 3, 6])
    assert sorted(res) == [0, 3, 6]
    for step, (per, skipped) in res.items():
        assert per["oracle"]["sign_agreement"] == pytest.approx(1.0) and per["oracle"]["rank_corr"] == pytest.approx(1.0)
        assert 0.0 < per["grpo"]["sign_agreement"] <= 1.0
        assert "pact" in skipped
    # each later batch is sampled from that spec's own run at that step, its reference the initial policy
    seen = []
    real = bf.batch_fidelity

    def spy(task, seed, specs, samples, model, ref, **kw):
        seen.append((tuple(specs), kw["sample_seed"], {k: v.clone() for k, v in model.state_dict().items()},
                     {k: v.clone() for k, v in ref.state_dict().items()}))
        return real(task, seed, specs, samples, model, ref, **kw)

    monkeypatch.setattr(bf, "batch_fidelity", spy)
    bf.run_fidelity(out, "keytok", 0, ["grpo", "oracle"], 2, [0, 6])
    init = torch.load(out / "init" / "keytok_seed0.pt", weights_only=True)
    for specs, _, model_sd, ref_sd in seen:
        assert all(torch.equal(ref_sd[k], init[k]) for k in init)
    assert [(sp, ss) for sp, ss, _, _ in seen] == [(("grpo", "oracle"), 0), (("grpo",), 6), (("oracle",), 6)]
    for (specs, _, model_sd, _), run in zip(seen[1:], ("grpo", "oracle")):
        kept = bench.kept_weights(out / "keytok" / run / "seed0", 6)
        assert all(torch.equal(model_sd[k], kept[k]) for k in kept)
    monkeypatch.undo()
    m6 = bf.kept_policy(out, "keytok", "oracle", 0, 6)
    m0 = bf.kept_policy(out, "keytok", "oracle", 0, 0)
    assert not all(torch.equal(a, b) for a, b in zip(m6.parameters(), m0.parameters()))
    # the reference log-probs of a step-6 batch are the initial policy's, not the batch's own
    from tokencredit.analysis.fidelity.exact import exact_estimates
    from tokencredit.data.controlled import CONTROLLED, REWARDS, build
    from tokencredit.engine.exactvalue import alphabet_ids

    tok = bf._tokenizer()
    _, ev = build("keytok", 0, 100, 2)
    space = CONTROLLED["keytok"].space
    est = exact_estimates(m6, tok, ev, REWARDS["keytok"], samples=2, max_new_tokens=space.length, temperature=1.0, seed=0,
                          allowed=alphabet_ids(tok, space) + [tok.eos_token_id], stop=[tok.eos_token_id])
    own = est["rollouts"]["signals"]["logprobs"]
    assert bf._ref_logprobs(m6, est, 1.0) == pytest.approx(own, abs=1e-4)  # the forward agrees with the exact tier's
    assert (bf._ref_logprobs(m0, est, 1.0) - own).abs().max() > 1e-3


def test_headroom_column_from_another_summary_the_correlation_from_the_scored_seeds(bf, tmp_path, capsys):
    """``--headroom``: the table's headroom column is that summary's (e.g. over more seeds), while
    the correlation still pairs fidelity with the AUCs of the scored seeds (the runs' summary)."""
    import json

    specs = ["grpo", "oracle", "a", "b", "c"]
    auc = _auc({"a": 0.1, "b": 0.4, "c": 0.7}, n=2)

    def summary(head):
        return {"fork": {"seeds": [0, 1], "budget": 40, "specs": {
            s: {"per_seed_auc": auc[s], "headroom": [h, h - 0.1, h + 0.1]} for s, h in zip(specs, head)}}}

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "summary.json").write_text(json.dumps(summary([0.0, 1.0, 0.1, 0.4, 0.7])))
    ten = tmp_path / "ten.json"
    ten.write_text(json.dumps(summary([0.0, 1.0, -0.31, 0.52, 0.93])))
    cache = tmp_path / "cache"
    cache.mkdir()
    fid = dict(zip(specs, (0.5, 1.0, 0.6, 0.7, 0.8)))
    for k in (0, 1):
        per = {s: {"sign_agreement": f, "rank_corr": f, "pivotal_mass": f} for s, f in fid.items()}
        (cache / f"fork_seed{k}_samples8.json").write_text(json.dumps({"0": [per, []], "10": [per, []]}))

    def table(*extra):
        out = tmp_path / "o.json"
        bf.main(["--task", "fork", "--runs", str(runs), "--cache", str(cache), "-o", str(out), *extra])
        rows = {}
        for ln in capsys.readouterr().out.splitlines():  # the first table's rows (the step table follows)
            if ln.startswith("| `"):
                rows.setdefault(ln.split("|")[1].strip(" `"), ln.split("|")[2].strip())
        return rows, json.loads(out.read_text())

    own, res_own = table()
    other, res_other = table("--headroom", str(ten))
    assert [own[s] for s in ("a", "b", "c")] == ["0.10", "0.40", "0.70"]
    assert [other[s] for s in ("a", "b", "c")] == ["-0.31", "0.52", "0.93"]
    assert res_other["headroom_from"] == str(ten) and "headroom_from" not in res_own
    assert res_other["correlation"] == res_own["correlation"]
    assert res_own["correlation"]["sign_agreement"]["rho"] == pytest.approx(1.0)
