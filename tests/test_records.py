"""``tokencredit.train.records``: the saved-rollouts format has one owner. The three writers (the own
trainer, ``TokenCreditGRPOTrainer``, the verl plugin's driver) build the same record from the same
batch; a record saves as plain tensors and strings (``weights_only``), loads back equal and
replays the credit it was trained with; a malformed file is refused in one line naming the field."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from tokencredit import CreditBatch, CreditPipeline
from tokencredit.train.records import RECORD_KEYS, RolloutsRecord, check_rollouts, load_rollouts

B, T, STEP = 4, 5, 3
LENGTHS = [5, 3, 4, 2]
EOS = 1


class Tok:
    """Token i decodes to one letter; EOS is special (dropped with skip_special_tokens)."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<eos>" if i == EOS else chr(97 + i % 26) for i in ids if not (skip_special_tokens and i == EOS))


def _batch():
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    ids = (torch.randint(2, 26, (B, T), generator=g) * mask).long()
    ids[0, LENGTHS[0] - 1] = EOS
    lp = (-torch.rand(B, T, generator=g) * 3) * mask
    lp[0, 1] = -9.0  # a tail token: TACO weighs it, so token_weights are not all ones
    ent = (torch.rand(B, T, generator=g) * 0.3 + 0.1) * mask
    cb = CreditBatch(response_mask=mask, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), group_ids=torch.tensor([0, 0, 1, 1]),
                     logprobs=lp, entropy=ent)
    credit = CreditPipeline("grpo+taco")
    out = credit(cb, update_state=False)
    questions = ["q0", "q0", "q1", "q1"]
    return cb, credit, out, ids, questions


def _record():
    cb, credit, out, ids, questions = _batch()
    return RolloutsRecord.build(credit, cb, out, response_ids=ids, tokenizer=Tok(), questions=questions, step=STEP)


def test_three_writers_build_one_record():
    from tokencredit.train.evaluation import rollouts_record

    cb, credit, out, ids, questions = _batch()
    assert out.token_weights is not None and not torch.equal(out.token_weights, torch.ones_like(out.token_weights) * cb.fmask)
    tok = Tok()
    texts = [tok.decode([int(t) for t, m in zip(r, mr) if m], skip_special_tokens=True) for r, mr in zip(ids, cb.response_mask)]
    step_batch = SimpleNamespace(response_ids=ids, texts=texts, prompt_index=torch.tensor([0, 0, 1, 1]),
                                 examples=[SimpleNamespace(question="q0"), SimpleNamespace(question="q1")])
    own = rollouts_record(credit, {"batch": step_batch, "credit_batch": cb, "credit": out, "credit_state": credit.state_dict()},
                          tok, STEP)
    assert list(own) == list(RECORD_KEYS)
    torch.testing.assert_close(own["token_weights"], out.token_weights)

    trl = pytest.importorskip("tokencredit.integrations.trl")
    stub = SimpleNamespace(_gather_rows=lambda x, pad: x, _tokenizer=tok, prompt_column="prompt", credit=credit,
                           accelerator=SimpleNamespace(num_processes=1),
                           state=SimpleNamespace(global_step=STEP - 1))  # TRL counts finished steps: this batch trains STEP
    inputs = [{"prompt": q} for q in questions]
    from_trl = trl.TokenCreditGRPOTrainer._rollouts_record(stub, {"completion_ids": ids}, inputs, cb, out).to_dict()

    record = pytest.importorskip("tokencredit.integrations.verl.record")
    rm = torch.zeros(B, T)
    rm[torch.arange(B), torch.tensor(LENGTHS) - 1] = cb.rewards  # verl's rm_scores: the reward on the last token
    data = {"responses": ids, "response_mask": cb.response_mask, "advantages": out.advantages, "rm_scores": rm,
            "old_log_probs": cb.logprobs, "entropy": cb.entropy, "uid": ["u0", "u0", "u1", "u1"],
            "raw_prompt": [[{"role": "user", "content": q}] for q in questions]}
    from_verl = record.rollouts_record(data, tok, credit, STEP).to_dict()

    for other in (from_trl, from_verl):
        assert list(other) == list(own)
        for k in ("credit", "credit_configs", "credit_state", "step", "tokens", "texts", "questions"):
            assert other[k] == own[k], k
        torch.testing.assert_close(other["response_ids"], own["response_ids"])
        torch.testing.assert_close(other["advantages"], own["advantages"])
        assert set(own["signals"]) >= set(other["signals"])
        for k, v in other["signals"].items():
            torch.testing.assert_close(v, own["signals"][k], check_dtype=False)
    torch.testing.assert_close(from_trl["token_weights"], own["token_weights"])
    assert from_verl["token_weights"] is None  # verl's calibrators run in the actor's loss
    assert own["tokens"][0][-1] == "<eos>" and not own["texts"][0].endswith("<eos>")


def test_save_load_replay(tmp_path):
    rec = _record()
    path = rec.save(tmp_path / "run" / "eval" / f"rollouts_step_{STEP:08d}.pt")
    raw = torch.load(path, weights_only=True)  # plain tensors and strings only
    assert list(raw) == list(RECORD_KEYS)
    back = RolloutsRecord.load(tmp_path / "run")  # a run directory: its latest rollouts file
    assert (back.credit, back.step, back.tokens, back.texts, back.questions) == (rec.credit, STEP, rec.tokens, rec.texts, rec.questions)
    assert back.credit_configs == rec.credit_configs and back.extra == {}
    for k, v in rec.signals.items():
        torch.testing.assert_close(back.signals[k], v)
    torch.testing.assert_close(back.credit_batch().logprobs, rec.signals["logprobs"])
    insp = back.replay(["grpo+taco"])
    saved, replayed = insp.views[0], insp.views[1]
    assert (saved.source, replayed.source, replayed.spec) == ("saved", "replayed", "grpo+taco")
    torch.testing.assert_close(replayed.advantages, saved.advantages)
    torch.testing.assert_close(replayed.token_weights, rec.token_weights)
    # keys a writer adds (a fidelity file's reference rows) survive the round trip
    d = dict(raw, reference_rows={"true": torch.zeros(B, T)})
    assert list(RolloutsRecord.from_dict(d).to_dict()) == list(RECORD_KEYS) + ["reference_rows"]


def _bad(mutate):
    d = copy.deepcopy(_record().to_dict())
    mutate(d)
    return d


BAD = {
    "advantages": (lambda d: d.update(advantages=torch.zeros(B, T + 1)), r"advantages: expected shape \(4, 5\) \(response_mask's\), got \(4, 6\)"),
    "token_weights": (lambda d: d.update(token_weights=torch.zeros(B - 1, T)), r"token_weights: expected shape \(4, 5\)"),
    "signals.rewards": (lambda d: d["signals"].update(rewards=torch.zeros(B + 1)), r"signals\.rewards: expected a tensor with 4 rows"),
    "signals.entropy": (lambda d: d["signals"].update(entropy=[0.0] * B), r"signals\.entropy: expected a tensor with 4 rows \(response_mask's\), got list"),
    "signals.response_mask": (lambda d: d["signals"].update(response_mask=torch.ones(B)), r"signals\.response_mask: expected a tensor \[B, T\]"),
    "signals": (lambda d: d.update(signals=[1]), r"signals: expected a dict of tensors, got list"),
    "response_ids": (lambda d: d.update(response_ids=torch.zeros(B - 1, T, dtype=torch.long)), r"response_ids: expected a tensor \[4, T'\]"),
    "tokens": (lambda d: d["tokens"][1].append("x"), r"tokens\[1\] has 4 entries, response_mask row 1 has 3"),
    "texts": (lambda d: d.update(texts=d["texts"][:2]), r"texts: expected 4 entries \(one a response\), got 2"),
    "questions": (lambda d: d.update(questions=d["questions"] + ["x"]), r"questions: expected 4 entries"),
    "no tokens": (lambda d: d.pop("tokens"), r"missing key\(s\) \['tokens'\]"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_record_is_one_line_naming_the_field(name):
    mutate, pattern = BAD[name]
    d = _bad(mutate)
    with pytest.raises(ValueError, match=pattern) as e:
        check_rollouts(d, "r.pt")
    assert "\n" not in str(e.value) and str(e.value).startswith("r.pt: ")
    with pytest.raises(ValueError, match=pattern):
        RolloutsRecord.from_dict(d)


def test_inspect_refuses_a_malformed_file_in_one_line(tmp_path):
    from tokencredit.cli import main

    p = tmp_path / "bad.pt"
    torch.save(_bad(BAD["advantages"][0]), p)
    with pytest.raises(ValueError, match="advantages: expected shape"):
        load_rollouts(p)
    with pytest.raises(SystemExit, match=r"advantages: expected shape \(4, 5\)") as e:
        main(["inspect", str(p)])
    assert "\n" not in str(e.value)
