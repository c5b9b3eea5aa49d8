"""`tokencredit export`: a run's checkpoint as a from_pretrained folder; a LoRA adapter records
its base model as an absolute path (never relative), --merge-lora writes the merged model,
--checkpoint picks a step; bad input is one line."""

from __future__ import annotations

import json

import pytest
import torch

from tokencredit.train.config import (
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
)
from tokencredit.train.export import ExportError, export_run
from tokencredit.testing import tiny_model_and_tokenizer
from tokencredit.train.trainer import Trainer


def crc_reward(completion, example):
    import zlib

    return float(zlib.crc32(completion.encode()) % 2)


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    model, tok = tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _train(tmp_path, base, lora, steps=2, monkeypatch=None):
    cfg = TrainConfig(
        credit="grpo", steps=steps, save_every=1, keep_last=5, output_dir=str(tmp_path / "run"),
        model=ModelConfig(name=str(base), lora=lora, lora_r=2, lora_alpha=4),
        task=TaskConfig(name="add1", n_train=8, n_eval=1, reward_fn="test_export:crc_reward"),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=6, temperature=1.0),
        optim=OptimConfig(lr=1e-2, micro_batch_size=4),
        log=LogConfig(eval_every=100, eval_samples=0, progress=False, eval_at_start=False, save_rollouts=False),
    )
    tr = Trainer(cfg)
    tr.train()
    tr.export()
    return tmp_path / "run", tr


def test_full_model_export_loads_and_equals_the_checkpoint(tmp_path, base_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, tr = _train(tmp_path, base_folder, lora=False)
    out = export_run(str(run), str(tmp_path / "exp1"), checkpoint=1)
    m = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    state = torch.load(run / "checkpoints" / "step_00000001" / "state.pt", weights_only=True)
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), state["model"][n]), n
    base = AutoModelForCausalLM.from_pretrained(base_folder)  # training moved the weights: the export is not the base
    assert any(not torch.equal(a, b) for a, b in zip(base.state_dict().values(), m.state_dict().values()))
    assert json.loads((out / "tokencredit_export.json").read_text())["step"] == 1


def test_lora_export_records_an_absolute_base_and_merges(tmp_path, base_folder, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(base_folder.parent)
    rel = base_folder.name  # the user gave a relative path
    run, tr = _train(tmp_path, rel, lora=True)
    for folder in (run / "final", export_run(str(run), str(tmp_path / "adapter"))):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert cfg["base_model_name_or_path"] == str(base_folder.resolve())
    merged = export_run(str(run), str(tmp_path / "merged"), merge_lora=True)
    assert not (merged / "adapter_config.json").exists()
    m = AutoModelForCausalLM.from_pretrained(merged)
    ids = torch.tensor([[1, 5, 6]])
    expect = tr.model.eval()(input_ids=ids).logits
    assert torch.allclose(m(input_ids=ids).logits, expect, atol=1e-5)
    assert m.generate(ids, max_new_tokens=2, do_sample=False).shape[1] == 5


def test_export_errors_are_one_line(tmp_path, base_folder):
    with pytest.raises(ExportError, match="RUN: expected a tokencredit run folder"):
        export_run(str(tmp_path), str(tmp_path / "x"))
    run, _ = _train(tmp_path, base_folder, lora=False, steps=1)
    with pytest.raises(ExportError, match=r"--checkpoint: expected one of the run's checkpoint steps \[1\], got 7"):
        export_run(str(run), str(tmp_path / "x"), checkpoint=7)
    with pytest.raises(ExportError, match="--merge-lora: the run .* trained the full model"):
        export_run(str(run), str(tmp_path / "x"), merge_lora=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(ExportError, match="--to: expected a new or empty folder"):
        export_run(str(run), str(tmp_path / "full"))
