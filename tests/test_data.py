"""Own data through `datasets` (tokencredit.data.datasource): the layouts users bring (a JSONL of
question/solution, TRL's prompt-only and conversational layouts, verl's parquet, CSV, a folder of
splits) load without conversion; columns, templates, system prompts and eval splits are the
user's choice; a missing column is one line naming it and the columns present, before any model."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")

from tokencredit.train.config import DataConfig, ModelConfig, TaskConfig, TrainConfig  # noqa: E402
from tokencredit.data.datasource import DatasetError, load_own_data  # noqa: E402
from tokencredit.data.tasks import make_data_task  # noqa: E402


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _qa(n=10):
    return [{"question": f"What is {i} + {i}?", "solution": str(2 * i), "topic": "add"} for i in range(n)]


def test_a_jsonl_of_questions_and_solutions(tmp_path):
    d = load_own_data(DataConfig(path=_jsonl(tmp_path / "qa.jsonl", _qa()), prompt_column="question",
                                 answer_column="solution", eval_fraction=0.2), seed=0, n_train=100, n_eval=100)
    assert len(d.train) == 8 and len(d.eval) == 2  # eval_fraction 0.2 of 10 rows
    assert not {e.question for e in d.train} & {e.question for e in d.eval}
    ex = d.train[0]
    q = ex.question
    i = int(q.split()[2])
    # no instruction appended, no system prompt: the prompt as it is
    assert ex.messages == ({"role": "user", "content": f"What is {i} + {i}?"},) and ex.prompt == q
    assert ex.answer == str(2 * i)
    assert ex.columns() == {"solution": str(2 * i), "topic": "add"}  # every column but the prompt


def test_template_and_system_prompt_are_the_users(tmp_path):
    d = load_own_data(DataConfig(path=_jsonl(tmp_path / "qa.jsonl", _qa()), prompt_column="question",
                                 system_prompt="Be brief.", prompt_template="{prompt} Put the answer in \\boxed{}."),
                      seed=0, n_train=100, n_eval=1)
    ex = d.train[0]
    assert ex.messages[0] == {"role": "system", "content": "Be brief."}
    assert ex.messages[1]["content"].endswith("? Put the answer in \\boxed{}.")
    assert d.answer_column == "solution"  # found without being named


def test_trl_conversational_and_prompt_only_layouts(tmp_path):
    conv = [{"prompt": [{"role": "user", "content": f"Say {i}"}], "answer": str(i)} for i in range(6)]
    d = load_own_data(DataConfig(path=_jsonl(tmp_path / "c.jsonl", conv), eval_fraction=0.2), seed=0, n_train=10, n_eval=10)
    ex = d.train[0]
    assert ex.conversational and ex.messages == tuple(ex.prompt) and ex.question.startswith("Say ")
    assert ex.columns() == {"answer": ex.answer}
    plain = [{"prompt": f"Say {i}", "answer": i} for i in range(6)]
    d = load_own_data(DataConfig(path=_jsonl(tmp_path / "p.jsonl", plain), eval_fraction=0.2), seed=0, n_train=10, n_eval=10)
    assert not d.train[0].conversational and d.train[0].answer == d.train[0].question.split()[1]


def test_verls_parquet_layout(tmp_path):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"Q{i}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"split": "train", "index": i}}
            for i in range(8)]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    d = load_own_data(DataConfig(path=str(path), eval_fraction=0.25), seed=0, n_train=10, n_eval=10)
    assert d.answer_column == "reward_model.ground_truth"
    ex = d.train[0]
    assert ex.answer == ex.question[1:]  # Q3 -> "3"
    assert ex.columns()["reward_model"]["ground_truth"] == ex.answer and ex.columns()["data_source"] == "openai/gsm8k"


def test_csv_and_a_folder_with_a_test_split(tmp_path):
    csv = tmp_path / "qa.csv"
    csv.write_text("question,solution\n" + "".join(f"q{i},{i}\n" for i in range(5)))
    d = load_own_data(DataConfig(path=str(csv), prompt_column="question", eval_fraction=0.2), seed=0, n_train=10, n_eval=10)
    assert len(d.train) == 4 and d.train[0].answer == d.train[0].question[1:]
    folder = tmp_path / "ds"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", _qa(6))
    _jsonl(folder / "test.jsonl", [{"question": "held out?", "solution": "1", "topic": "t"}])
    d = load_own_data(DataConfig(path=str(folder), prompt_column="question"), seed=0, n_train=10, n_eval=10)
    assert [e.question for e in d.eval] == ["held out?"] and len(d.train) == 6  # the test split, not a cut


def test_a_separate_eval_file(tmp_path):
    d = load_own_data(DataConfig(path=_jsonl(tmp_path / "a.jsonl", _qa(4)), prompt_column="question",
                                 eval_path=_jsonl(tmp_path / "b.jsonl", [{"question": "other", "solution": "0", "topic": "x"}])),
                      seed=0, n_train=10, n_eval=10)
    assert len(d.train) == 4 and [e.question for e in d.eval] == ["other"]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("prompt_column", "query", "data.prompt_column: expected a column 'query' in .*qa.jsonl, got columns \\['question', 'solution', 'topic'\\]"),
        ("answer_column", "answer", "data.answer_column: expected a column 'answer' in .*qa.jsonl, got columns \\['question', 'solution', 'topic'\\]"),
        ("split", "test", "data.split: expected one of the splits \\['train'\\] of .*qa.jsonl, got 'test'"),
    ],
)
def test_a_missing_column_or_split_is_one_line(tmp_path, field, value, match):
    kw = {"prompt_column": "question", field: value}
    with pytest.raises(DatasetError, match=match) as e:
        load_own_data(DataConfig(path=_jsonl(tmp_path / "qa.jsonl", _qa()), **kw), seed=0, n_train=10, n_eval=10)
    assert "\n" not in str(e.value)


def test_a_bad_jsonl_line_is_named(tmp_path):
    f = tmp_path / "qa.jsonl"
    f.write_text('{"question": "a", "solution": "1"}\n{"question": "b" "solution": 2}\n')
    with pytest.raises(DatasetError, match=f"{f}:2 is not JSON"):
        load_own_data(DataConfig(path=str(f), prompt_column="question"), seed=0, n_train=10, n_eval=10)


def test_the_trainer_refuses_a_missing_column_before_any_model_loads(tmp_path, monkeypatch):
    import tokencredit.engine.models as models
    from tokencredit.train.trainer import Trainer

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr(models, "resolve_model", boom)
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), model=ModelConfig(name="tiny"),
                      data=DataConfig(path=_jsonl(tmp_path / "qa.jsonl", _qa()), prompt_column="prompt"))
    with pytest.raises(DatasetError, match="data.prompt_column: expected a column 'prompt' in .*, got columns \\['question', 'solution', 'topic'\\]"):
        Trainer(cfg)


def test_own_data_without_an_answer_needs_reward_funcs(tmp_path):
    from tokencredit.data.rewards import RewardFnError
    from tokencredit.train.trainer import Trainer

    rows = [{"prompt": f"Write {i}"} for i in range(5)]
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), model=ModelConfig(name="tiny"), task=TaskConfig(n_eval=1),
                      data=DataConfig(path=_jsonl(tmp_path / "p.jsonl", rows)))
    with pytest.raises(RewardFnError, match="reward.funcs: expected reward functions"):
        Trainer(cfg)
    task = make_data_task(cfg.data, n_eval=1)
    assert task.answer_column is None and not task.has_default_reward


def test_a_config_from_before_the_data_and_reward_sections_matches_their_defaults():
    """A run written before `data` / `reward` existed trained with their defaults: --resume and
    compare recognise it; a changed reward setting is still a difference."""
    from tokencredit.train.config import config_diff, config_to_dict

    new = json.loads(json.dumps(config_to_dict(TrainConfig())))
    old = {k: v for k, v in new.items() if k not in ("data", "reward")}
    assert config_diff(old, new) == []
    changed = dict(new, reward=dict(new["reward"], funcs=["math"]))
    assert config_diff(old, changed) == ["reward.funcs: [] -> ['math']"]


def test_without_an_eval_choice_a_tenth_is_held_out_and_said(tmp_path, caplog):
    """A 22-row file is no longer cut 11 / 11: data.eval_fraction's default (0.1) holds out 2 rows,
    and the log says how to choose otherwise."""
    import logging

    with caplog.at_level(logging.WARNING, logger="tokencredit.data.datasource"):
        d = load_own_data(DataConfig(path=_jsonl(tmp_path / "qa.jsonl", _qa(22)), prompt_column="question"),
                          seed=0, n_train=100, n_eval=32)
    assert (len(d.train), len(d.eval)) == (20, 2)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "held out 2 of 22 rows" in msg and "set data.eval_path, data.eval_split or data.eval_fraction" in msg
