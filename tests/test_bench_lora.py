"""tokencredit bench in its LoRA setting (``policy="lora"``): grpo+arca runs end to end through the
own trainer, every spec of a seed trains the same adapter (only the adapter: base weights and the
frozen logit bias stay), the full-weight setting still refuses ARCA, the two settings never mix,
bad input is one line, and a resumed LoRA bench equals an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import InterruptingBench

from tokencredit.analysis import bench
from tokencredit.analysis.compare import read_metrics, run_config

SPECS = "grpo,oracle,grpo+arca"
KW = dict(tasks="keytok", specs=SPECS, seeds="0", quick=True, progress=False, workers=1, policy="lora")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_lora")
    return out, bench.run_bench(output_dir=out, **KW)


def _lora_cfg(task, spec, seed, out):
    return run_config(bench.bench_config(task, policy="lora"), spec, seed, bench.task_dir(out, task, "lora"))


def test_lora_bench_runs_grpo_arca_end_to_end(whole):
    out, result = whole
    assert set(result["runs"].values()) == {"started"} and len(result["runs"]) == 3
    s = result["summary"]["keytok"]
    assert set(s["specs"]) == {"grpo", "oracle", "grpo+arca"} and s["seeds"] == [0]
    assert "headroom" in s["specs"]["grpo+arca"] and "auc_vs_grpo" in s["specs"]["grpo+arca"]
    # its own task directory, nothing in the full-weight one; the setting recorded
    assert (out / "keytok-lora" / "grpo+arca" / "seed0" / "metrics.jsonl").exists() and not (out / "keytok").exists()
    assert json.loads((out / "bench.json").read_text())["policy"] == "lora"
    for spec in SPECS.split(","):  # every spec trained through the same adapter setting
        cfg = json.loads((out / "keytok-lora" / spec / "seed0" / "config.json").read_text())
        assert cfg["model"]["lora"] is True and cfg["model"]["lora_r"] == bench.LORA.r
        assert cfg["optim"]["lr"] == bench.LORA.lr
    # ARCA read a residual: zero at step 1 (peft's B = 0: adapter off = on), then not
    rows = [r for r in read_metrics(out / "keytok-lora" / "grpo+arca" / "seed0" / "metrics.jsonl") if "arca/gini" in r]
    assert rows[0]["arca/zero_residual_frac"] == 1.0
    assert all(r["arca/zero_residual_frac"] == 0.0 and r["arca/gini"] > 0 for r in rows[1:])
    assert "report.md" in {p.name for p in out.iterdir()} and "lora" in (out / "report.md").read_text()


def test_every_spec_of_a_seed_starts_from_the_same_adapter_and_only_the_adapter_trains(tmp_path):
    """The adapter is drawn from the run's seed (not the global RNG); one step changes the
    adapter's weights and no other: the base weights and the -1e4 logit bias stay as built."""
    init = str(tmp_path / "init")
    a = bench.make_trainer(_lora_cfg("keytok", "grpo", 0, tmp_path / "a"), init_dir=init)
    torch.rand(100)  # the global RNG moves between the two
    b = bench.make_trainer(_lora_cfg("keytok", "grpo+arca", 0, tmp_path / "b"), init_dir=init)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    lora_keys = [k for k in sa if "lora_" in k]
    assert lora_keys and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    trainable = {n for n, p in a.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    bias = [p for n, p in a.model.named_parameters() if n.endswith("lm_head.bias")]
    assert len(bias) == 1 and not bias[0].requires_grad
    before = {k: v.detach().clone() for k, v in a.model.state_dict().items()}
    a.train_step()
    after = a.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)  # the adapter trained, nothing else
    assert any("lora_B" in k for k in changed)
    assert torch.equal(bias[0], before[[k for k in before if k.endswith("lm_head.bias")][0]])
    assert float(bias[0].min()) == bench_mask()


def bench_mask():
    from tokencredit.analysis.bench_policy import MASK_BIAS

    return MASK_BIAS


def test_the_full_weight_setting_still_refuses_arca(tmp_path):
    with pytest.raises(bench.BenchError, match=r"^--credit: grpo\+arca cannot run on keytok: credit 'grpo\+arca': arca reads "
                                               r"the LoRA adapter's effect; expected a model with a LoRA adapter"):
        bench.run_bench(**{**KW, "policy": "full", "output_dir": tmp_path / "b"})
    assert not (tmp_path / "b").exists()


def test_bad_policy_is_one_line_before_any_run(tmp_path, capsys):
    with pytest.raises(bench.BenchError, match=r"^--policy: expected one of \['full', 'lora'\], got 'LoRA'$"):
        bench.run_bench(**{**KW, "policy": "LoRA", "output_dir": tmp_path / "b"})
    assert not (tmp_path / "b").exists()
    from tokencredit.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--policy", "qlora", "--output-dir", str(tmp_path / "c")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["tokencredit bench: --policy: expected one of ['full', 'lora'], got 'qlora'"]
    assert not (tmp_path / "c").exists()


def test_a_bench_directory_holds_one_setting(whole):
    out, _ = whole
    with pytest.raises(bench.BenchError, match=r"^--policy: .* holds a bench of the 'lora' setting; expected the same \('full'\)"):
        bench.run_bench(**{**KW, "specs": "grpo,oracle", "policy": "full", "output_dir": out})
    assert not (out / "keytok").exists()


def test_lora_settings_leave_the_full_weight_ones_alone():
    for t in bench.SUITE:
        assert bench.task_settings(t, "full") == bench.SETTINGS[t]
        assert bench.task_settings(t, "lora") == bench.SETTINGS[t].__class__(**{**bench.SETTINGS[t].__dict__, "lr": bench.LORA.lr})
        assert bench.bench_config(t).model.lora is False and bench.bench_config(t, policy="lora").model.lora is True


def test_a_resumed_lora_bench_equals_an_uninterrupted_one(whole, tmp_path):
    out, result = whole
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(output_dir=tmp_path, trainer_factory=InterruptingBench(str(tmp_path / "init"), "grpo+arca"), **KW)
    cut = tmp_path / "keytok-lora" / "grpo+arca" / "seed0"
    assert 0 < max(r["step"] for r in read_metrics(cut / "metrics.jsonl")) < bench.QUICK_STEPS
    resumed = bench.run_bench(output_dir=tmp_path, **KW)
    assert resumed["runs"][("keytok", "grpo+arca", 0)] == "resumed" and resumed["runs"][("keytok", "grpo", 0)] == "skipped"
    keys = ("bench/success", "reward", "arca/gini", "eval/greedy_acc")
    a = read_metrics(out / "keytok-lora" / "grpo+arca" / "seed0" / "metrics.jsonl")
    b = read_metrics(cut / "metrics.jsonl")
    assert [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]
    assert json.loads((out / "summary.json").read_text()) == json.loads((tmp_path / "summary.json").read_text())
    wa, wb = (bench.kept_weights(d / "keytok-lora" / "grpo+arca" / "seed0", bench.QUICK_STEPS) for d in (out, tmp_path))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
