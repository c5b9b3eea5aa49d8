"""Issue 31's Done-when: one rollout batch through the three trainers' credit paths gives the same
advantages and the same saved credit state.

The batch: two prompts of the ``add1`` task, four fixed responses each (chosen by the prompt's
question, so any trainer asking for a prompt gets the same tokens), rewards from one function of
the response text. Each trainer runs its own code on it:

(a) the own trainer: ``Trainer.train`` for one step on a ``ReplayRollout`` that serves the fixed
    responses (``train_step``: its passes, ``_credit``, the update; its checkpoint), read back
    through its public outputs: ``save_rollouts`` (the credit it trained on, the signals) and the
    checkpoint's ``state_dict`` (``"credit"``);
(b) ``TokenCreditGRPOTrainer``: ``train`` for one step on the same prompts with a ``rollout_func``
    that returns the same tokens (``_generate_and_score_completions``: its passes,
    ``_credit_batch``, the credit call), with ``credit_state.json`` and the rollouts record written
    by its checkpoint;
(c) the verl plugin: the trainer mode's driver step ``_compute_advantage`` (the controllers' step
    from the declared signals, the ``tc_grpo`` estimator inside verl's ``compute_advantage``), then
    the loss function it ships to the actor (``set_loss_fn``), run on the batch as verl's engine
    hands a micro-batch to it (the calibrators in the ``tokencredit`` policy loss), and its
    ``_save_checkpoint`` (``tokencredit_state.json``). verl's workers, Ray and TransferQueue are
    not here (as in ``test_verl_methods``): a stand-in TransferQueue serves the fields the
    driver step reads, verl's own ``PPOTrainerSync._compute_advantage`` (TransferQueue in and
    out) is replaced by verl's ``compute_advantage`` on a ``DataProto`` of the same rows, and the
    signals are the own trainer's (the entropy and log-probs verl's old-log-prob pass and update
    forward would compute on the same weights).

Tolerances: (a) and (c) see the same signal tensors, so their advantages are compared exactly.
(a) and (b) each compute the signals with their own forward (the own trainer's update forwards in
micro-batches of 4, TRL's no-grad pass with ``logits_to_keep``), which agree to float32 rounding
(checked below, 1e-5), so their advantages are compared to 1e-5 as well. The saved states are
compared exactly: STARE's controller moves by a fixed step in the direction of the sign of the
entropy's distance to its target, which rounding does not change.
"""

from __future__ import annotations

import json
import sys
import zlib

import numpy as np
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("verl")
pytest.importorskip("hydra")
datasets = pytest.importorskip("datasets")

from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402
from verl.trainer.ppo.v1 import PPOTrainerSync  # noqa: E402

from tokencredit import CreditBatch, CreditPipeline  # noqa: E402
from tokencredit.data.tasks import make_task  # noqa: E402
from tokencredit.engine.rollout import ReplayRollout  # noqa: E402
from tokencredit.integrations import verl as tcv  # noqa: E402
from tokencredit.integrations.trl import CREDIT_STATE_NAME, TokenCreditGRPOTrainer  # noqa: E402
from tokencredit.integrations.verl import trainer as tct  # noqa: E402
from tokencredit.testing import tiny_model_and_tokenizer  # noqa: E402
from tokencredit.train.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from tokencredit.train.config import (  # noqa: E402
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    apply_recipe,
)
from tokencredit.train.records import RolloutsRecord  # noqa: E402
from tokencredit.train.trainer import Trainer  # noqa: E402

from test_trainer import crc_reward  # noqa: E402
from test_trl import _args  # noqa: E402
from test_verl import TRAINER_OVERRIDES, _engine_micro_batch, compose_verl  # noqa: E402
from test_verl_methods import PaddedTransferQueue  # noqa: E402

P, K, MAX_NEW = 2, 4, 6  # prompts, samples per prompt, response budget
TEMPERATURE = 0.8  # not 1: a trainer that left the temperature out of its signals would differ
TOL = dict(rtol=1e-5, atol=1e-5)  # (a) vs (b): two forwards of the same weights (module doc)
# EOS likelier than the rest: a random model is otherwise so near uniform that no token is in
# TACO's tail (surprisal above entropy); alpha = 1 makes the tail every token rarer than average
EOS_BIAS = 2.0
CAPTURE_LOSS = "tc_test_capture"  # a verl policy loss that records the advantages it receives

# a stateless spec and a stateful one; both calibrators weigh tokens, so the product is exercised
SPECS = {
    "grpo+taco": {"taco": {"alpha": 1.0}},
    # STARE's gate open (the tiny model's entropy, ~4.4 nats, is under the target) and its W and M
    # on both signs (C2): the credit reads the controller's stepped W = 1.15, M = 0.85
    "grpo+taco+stare": {"taco": {"alpha": 1.0},
                        "stare": {"adaptive": True, "H_target": 5.0, "a": 0.05, "variant": "C2", "P": 0.25}},
}


def _question(messages) -> str:
    return [m for m in messages if m["role"] == "user"][-1]["content"]


def fixed_response(tok, question: str, sample: int) -> list:
    """Sample ``sample``'s tokens for ``question``: non-special tokens drawn with numpy from the
    question's crc and the sample, ended by EOS (or cut at the budget)."""
    special = set(tok.all_special_ids)
    vocab = np.array([i for i in range(len(tok)) if i not in special])
    g = np.random.default_rng([zlib.crc32(question.encode()), sample])
    n = int(g.integers(2, MAX_NEW + 1))
    ids = [int(t) for t in vocab[g.integers(0, vocab.size, n)]]
    return ids if n == MAX_NEW else ids + [int(tok.eos_token_id)]


class FixedRollout(ReplayRollout):
    """The own trainer's rollout backend: tokencredit's ``ReplayRollout`` serving
    :func:`fixed_response` of each row's prompt; keeps the prompts it was asked for."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer, responses=self._row)
        self.asked = []

    def generate(self, prompts, *, num_samples: int = 1, **kw):
        self.asked.append(([list(p) for p in prompts], int(num_samples)))
        return super().generate(prompts, num_samples=num_samples, **kw)

    def _row(self, key, row, max_new_tokens):
        prompts, k = self.asked[-1]
        return fixed_response(self.tokenizer, _question(prompts[row // k]), row % k)


def trl_rollout(tok):
    """TRL's ``rollout_func`` serving the same tokens: TRL passes each prompt once per completion
    (``num_generations`` in a row); the j-th copy of a prompt gets its sample j."""

    def rollout(prompts, trainer):
        seen, out = {}, {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for p in prompts:
            q = _question(p)
            j = seen[q] = seen.get(q, -1) + 1
            text = tok.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True)
            ids = fixed_response(tok, q, j)
            out["prompt_ids"].append(tok(text, add_special_tokens=False)["input_ids"])
            out["completion_ids"].append(ids)
            out["logprobs"].append([0.0] * len(ids))  # the sampler's: read only by a rollout correction (off)
        return out

    return rollout


def trl_reward(completions, **kwargs):
    """TRL's reward function: the own trainer's ``task.reward_fn`` (``test_trainer:crc_reward``,
    which verl's ``rm_scores`` carry below) on the completion's text."""
    return [crc_reward(c if isinstance(c, str) else c[-1]["content"], None) for c in completions]


@pytest.fixture(autouse=True)
def _clean_verl_settings(monkeypatch):
    monkeypatch.delenv(tcv.ENV_VAR, raising=False)
    tcv.install_settings(None)
    yield
    tcv.install_settings(None)


# -- (a) the own trainer ---------------------------------------------------------------------


def run_own(tmp_path, spec):
    args = tuple(f"{m}.{k}={json.dumps(v)}" for m, kv in SPECS[spec].items() for k, v in kv.items())
    cfg = apply_recipe(TrainConfig(
        credit=spec, credit_args=args, steps=1, save_every=1, output_dir=str(tmp_path / "own"),
        model=ModelConfig(name="tiny"),
        task=TaskConfig(name="add1", n_train=P, n_eval=1, reward_fn="test_trainer:crc_reward"),
        rollout=RolloutConfig(prompts_per_step=P, samples_per_prompt=K, max_new_tokens=MAX_NEW, temperature=TEMPERATURE),
        optim=OptimConfig(lr=1e-3, micro_batch_size=4, ppo_epochs=1),
        log=LogConfig(eval_every=100, eval_samples=1, progress=False, eval_at_start=False),
    ))
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=EOS_BIAS)
    task = make_task("add1", seed=cfg.seed, n_train=P, n_eval=1, reward_fn=cfg.task.reward_fn)
    tr = Trainer(cfg, model=model, tokenizer=tok, task=task, rollout=FixedRollout)
    tr.train()
    tr.save_rollouts(tmp_path / "own_rollouts.pt")
    record = RolloutsRecord.load(tmp_path / "own_rollouts.pt")
    state = load_checkpoint(latest_checkpoint(tmp_path / "own" / "checkpoints"))["credit"]
    prompts, k = tr.rollout.asked[0]  # the training call (the eval one comes after)
    assert k == K and len(prompts) == P
    return record, state, prompts


# -- (b) TokenCreditGRPOTrainer ----------------------------------------------------------------


def run_trl(tmp_path, spec, prompts):
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=EOS_BIAS)
    # the own trainer's prompts in its order (no shuffling), so that the rows line up one to one
    ds = datasets.Dataset.from_list([{"prompt": p} for p in prompts])
    args = _args(tmp_path / "trl", max_steps=1, per_device_train_batch_size=P * K, num_generations=K,
                 max_completion_length=MAX_NEW, save_strategy="steps", save_steps=1, shuffle_dataset=False)
    assert args.temperature == TEMPERATURE
    trainer = TokenCreditGRPOTrainer(model=model, reward_funcs=trl_reward, args=args, train_dataset=ds,
                                     processing_class=tok, rollout_func=trl_rollout(tok), credit=spec,
                                     credit_config=SPECS[spec])
    trainer.train()
    folder = tmp_path / "trl" / "out" / "checkpoint-1"
    record = RolloutsRecord.load(tmp_path / "trl" / "out" / "eval" / "rollouts_step_00000001.pt")
    saved = json.loads((folder / CREDIT_STATE_NAME).read_text())
    return record, saved, trainer.last_credit_output


# -- (c) the verl plugin -------------------------------------------------------------------------


def run_verl(tmp_path, spec, monkeypatch, batch: CreditBatch):
    """The trainer mode's driver step and the loss it ships, on ``batch``'s rows and signals."""
    captured = []

    def capture(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        captured.append(advantages.detach().clone())
        return get_policy_loss_fn("vanilla")(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                                             response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                                             rollout_is_weights=rollout_is_weights)

    monkeypatch.setitem(POLICY_LOSS_REGISTRY, CAPTURE_LOSS, capture)
    overrides = [f"+tokencredit.{m}.{k}={v}" for m, kv in SPECS[spec].items() for k, v in kv.items()]
    cfg = compose_verl(TRAINER_OVERRIDES + [
        f"+tokencredit.spec={spec}", f"+tokencredit.base_loss_mode={CAPTURE_LOSS}", f"actor_rollout_ref.rollout.n={K}",
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", f"trainer.default_local_dir={tmp_path / 'verl'}",
    ] + overrides)

    # the trainer mode as TokenCreditPPOTrainerSync.__init__ sets it up, without verl's workers
    tr = object.__new__(tct.TokenCreditPPOTrainerSync)
    tr.config = cfg
    tr.tokencredit_settings = tct.check_trainer_config(cfg)
    tcv.install_settings(tr.tokencredit_settings)
    tr.tokencredit_credit, tr.tokencredit_plan = tct.trainer_plan(cfg, tr.tokencredit_settings)
    shipped = []
    tr.actor_rollout_wg = type("ActorGroup", (), {"set_loss_fn": lambda self, fn: shipped.append(fn)})()
    monkeypatch.setattr(PPOTrainerSync, "on_init_end", lambda self: None)  # verl's part: the workers
    tr.on_init_end()  # the actor's loss function, shipped once at start

    mask = batch.response_mask.float()
    lens = mask.sum(1).long()
    rm_scores = torch.zeros_like(mask)
    rm_scores[torch.arange(len(lens)), lens - 1] = batch.rewards  # verl's outcome on the last token
    uid = np.array([f"prompt-{int(g)}" for g in batch.group_ids], dtype=object)
    rows = {f"k{i}": {"response_mask": torch.ones(int(n), dtype=torch.int64), "rm_scores": rm_scores[i, :n],
                      "entropy": batch.entropy[i, :n], "old_log_probs": batch.logprobs[i, :n]}
            for i, n in enumerate(lens.tolist())}

    monkeypatch.setitem(sys.modules, "transfer_queue", PaddedTransferQueue(rows))  # what the driver step reads

    def verl_advantage_step(step_batch, metrics):
        # verl's advantage step (PPOTrainerSync._compute_advantage without TransferQueue): the
        # tc_grpo estimator through verl's compute_advantage, inside the driver signals opened
        data = DataProto.from_dict(tensors={"token_level_rewards": rm_scores, "response_mask": mask}, non_tensors={"uid": uid})
        return compute_advantage(data, adv_estimator="tc_grpo", config=AlgoConfig())

    monkeypatch.setattr(tr, "_tc_estimate", verl_advantage_step)
    out = tr._compute_advantage(type("Meta", (), {"keys": list(rows), "partition_id": "train"})(), {})
    estimated = out.batch["advantages"]

    # the worker: the loss function the driver shipped last, on one engine micro-batch (the whole
    # batch); the update's forward is the pre-update policy (first micro-batch of the first epoch)
    loss_fn = shipped[-1]
    model_output, micro = _engine_micro_batch(batch.logprobs * mask, batch.logprobs * mask, estimated, mask,
                                              batch.entropy * mask)
    loss_fn(model_output=model_output, data=micro, dp_group=None)
    (advantages,) = captured

    monkeypatch.setattr(PPOTrainerSync, "_save_checkpoint", lambda self: None)  # verl's part: the weights
    tr.global_steps = 1
    tr._save_checkpoint()
    path = tmp_path / "verl" / "global_step_1" / tct.STATE_FILE
    saved = json.loads(path.read_text()) if path.exists() else None
    return advantages, saved, estimated


# -- the test ------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", list(SPECS))
def test_one_batch_through_three_trainers(tmp_path, spec, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL's note that rollout_func is experimental
    own, own_state, prompts = run_own(tmp_path, spec)
    trl, trl_saved, trl_out = run_trl(tmp_path, spec, prompts)

    # the same batch reached both: tokens, mask, rewards, groups, row for row
    a, b = own.credit_batch(), trl.credit_batch()
    m = a.mask
    assert torch.equal(a.response_mask.bool(), b.response_mask.bool()) and a.mask.shape == (P * K, MAX_NEW)
    T = m.shape[1]
    assert torch.equal(own.to_dict()["response_ids"][:, :T] * m, trl.to_dict()["response_ids"][:, :T] * m)
    assert torch.equal(a.rewards, b.rewards) and torch.equal(a.group_ids, b.group_ids)
    assert all(len(set(a.rewards[a.group_ids == g].tolist())) > 1 for g in range(P))  # every group has signal
    # the declared signals, each from the trainer's own forward: equal to rounding
    for s in ("logprobs", "entropy"):
        torch.testing.assert_close(getattr(a, s)[m], getattr(b, s)[m], **TOL)

    # advantages: (a) == (b) to rounding; the credit is the spec's on the batch (no trainer-made step)
    torch.testing.assert_close(own.advantages, trl.advantages, **TOL)
    torch.testing.assert_close(trl_out.advantages, trl.advantages, rtol=0, atol=0)
    torch.testing.assert_close(own.advantages, CreditPipeline(spec, SPECS[spec])(a).advantages, rtol=0, atol=0)
    grpo = CreditPipeline("grpo")(a).advantages
    assert not torch.allclose(own.advantages, grpo, atol=1e-4)  # the calibrators acted
    if "stare" in spec:  # and the credit read the state stepped from this batch
        unstepped = CreditPipeline(spec, SPECS[spec])(a, update_state=False).advantages
        assert not torch.allclose(own.advantages, unstepped, atol=1e-4)
    tw = own.to_dict()["token_weights"]
    torch.testing.assert_close(tw, trl.to_dict()["token_weights"], **TOL)

    # (c) verl on the own trainer's signals: the same advantages, bit for bit
    verl_adv, verl_saved, verl_est = run_verl(tmp_path, spec, monkeypatch, a)
    torch.testing.assert_close(verl_est, grpo, rtol=0, atol=0)  # the driver's half: the estimator alone
    torch.testing.assert_close(verl_adv * m, own.advantages, rtol=0, atol=0)

    # the saved credit state: the own trainer's checkpoint, TRL's credit_state.json, verl's
    # tokencredit_state.json
    assert trl_saved == {"spec": spec, "state": own_state}
    assert own.to_dict()["credit_state"] == own_state  # the state the step's credit read
    if "stare" in spec:
        assert own_state["stare"] == {"W": 1.1 + 0.05, "M": 0.9 - 0.05, "step": 1}  # one step up
        assert verl_saved == {"spec": spec, "state": own_state}
    else:
        assert own_state == {} and verl_saved is None  # nothing to save; verl writes no file
