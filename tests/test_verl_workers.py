"""Worker-side signals in verl (ACPO's ``mode_prob``, ARCA's ``hidden_residual``): tokencredit's
actor engine (``integrations/verl/engine.py``) run on a tiny LoRA model through verl's own
``prepare_model_inputs`` / ``prepare_model_outputs`` gives the signals of the core's
``run_passes`` on the same batch, in both of verl's input layouts; the advantages that reach verl's
policy loss through the trainer mode's engine loss equal the core ``CreditPipeline``'s, per
micro-batch; the trainer mode asks the engine for exactly the signals the plan declares.
CPU only: no FSDP, no Ray (verl's ``forward_step`` wants an accelerator, so the test runs its
three steps: inputs, the module, outputs)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("hydra")
pytest.importorskip("peft")

import numpy as np  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn, register_policy_loss  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from tokencredit import CreditBatch, CreditInputError, CreditPipeline  # noqa: E402
from tokencredit.integrations import verl as tcv  # noqa: E402
from tokencredit.integrations.verl import trainer as tct  # noqa: E402
from tokencredit.integrations.verl.engine import TokenCreditFSDPEngine  # noqa: E402
from tokencredit.engine.passes import PassInputs, PassModels, run_passes  # noqa: E402
from tokencredit.credit.plan import plan_signals  # noqa: E402

from test_verl import TRAINER_OVERRIDES, actor_config, compose_verl  # noqa: E402

TEMPERATURE = 0.7
P, T = 4, 5  # prompt width (left-padded), response width (right-padded)


@pytest.fixture(autouse=True)
def _clean_settings(monkeypatch):
    monkeypatch.delenv(tcv.ENV_VAR, raising=False)
    tcv.install_settings(None)
    yield
    tcv.install_settings(None)


@pytest.fixture(scope="module")
def lora_model():
    from tokencredit.engine.models import add_lora
    from tokencredit.testing import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(seed=0)
    model = add_lora(model, r=4, alpha=8)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # peft starts with B = 0 (adapter on == off): give the adapter an effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.eval()
    return model, tok


def rollout_batch(vocab: int):
    """Two prompts x two responses, in verl's left/right-padded layout."""
    gen = torch.Generator().manual_seed(4)
    plens, rlens = [4, 4, 3, 3], [5, 3, 4, 2]
    B = len(rlens)
    prompts = torch.zeros(B, P, dtype=torch.long)
    pmask = torch.zeros(B, P, dtype=torch.long)
    for g in (0, 2):  # rows g, g + 1 share their prompt
        ids = torch.randint(3, vocab, (plens[g],), generator=gen)
        for b in (g, g + 1):
            prompts[b, P - plens[b]:] = ids
            pmask[b, P - plens[b]:] = 1
    responses = torch.randint(3, vocab, (B, T), generator=gen)
    rmask = (torch.arange(T)[None] < torch.tensor(rlens)[:, None]).long()
    responses = responses * rmask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    uid = np.array(["p0", "p0", "p1", "p1"], dtype=object)
    return prompts, pmask, responses, rmask, rewards, uid


def engine_data(prompts, pmask, responses, rmask, *, want, use_remove_padding):
    """The batch as verl's actor worker hands it to the engine (nested, no padding)."""
    from tensordict import TensorDict

    attn = torch.cat([pmask, rmask], dim=1)
    td = TensorDict(
        {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
         "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp_min(0), "response_mask": rmask},
        batch_size=[len(prompts)],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, use_remove_padding=use_remove_padding, temperature=TEMPERATURE, dp_size=1,
                         batch_num_tokens=None, global_batch_size=None)
    tu.assign_non_tensor(td, **{tcv.WORKER_SIGNAL_KEYS[s]: True for s in want})
    return td


def cpu_engine(model) -> TokenCreditFSDPEngine:
    """The engine's forward-side state, without FSDP or a device (what the overrides read)."""
    eng = TokenCreditFSDPEngine.__new__(TokenCreditFSDPEngine)
    eng.module = model
    eng._is_lora = True
    eng.use_ulysses_sp = False
    eng.pad_to_length = False
    eng._autocast_dtype = torch.float32
    eng.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    return eng


def engine_forward(eng, micro_batch, loss_function=None):
    """verl's FSDPEngineWithLMHead.forward_step without the device move and autocast."""
    model_inputs, output_args = eng.prepare_model_inputs(micro_batch=micro_batch)
    raw = eng.module(**model_inputs, use_cache=False)
    return eng.prepare_model_outputs(output=raw, output_args=output_args, micro_batch=micro_batch,
                                     logits_processor_func=loss_function)


def micro_batches(data, use_remove_padding):
    # without flash-attention a packed (remove-padding) forward would attend across sequences on
    # CPU, so that layout runs one sequence per micro-batch; the padded layout runs all at once
    return tu.chunk_tensordict(data, len(data)) if use_remove_padding else [data]


def core_signals(model, prompts, pmask, responses, rmask, spec):
    plan = plan_signals(CreditPipeline(spec), lora=True)
    inp = PassInputs(input_ids=torch.cat([prompts, responses], 1), attention_mask=torch.cat([pmask, rmask], 1),
                     prompt_len=P, response_ids=responses, response_mask=rmask)
    return run_passes(plan, PassModels(policy=model), inp, temperature=TEMPERATURE, micro_batch_size=len(prompts))


# -- (1) the engine's signals equal the core's passes ----------------------------------------


@pytest.mark.parametrize("use_remove_padding", [False, True], ids=["padded", "packed"])
def test_engine_signals_equal_core_passes(lora_model, use_remove_padding):
    model, tok = lora_model
    prompts, pmask, responses, rmask, _, _ = rollout_batch(len(tok))
    core = core_signals(model, prompts, pmask, responses, rmask, "grpo+acpo+arca")
    assert (core["hidden_residual"][rmask.bool()] > 0).all()  # the adapter has an effect on every token
    data = engine_data(prompts, pmask, responses, rmask, want=("mode_prob", "hidden_residual"),
                       use_remove_padding=use_remove_padding)
    eng = cpu_engine(model)
    got = {"log_probs": [], "mode_prob": [], "hidden_residual": []}
    for mb in micro_batches(data, use_remove_padding):
        out = engine_forward(eng, mb)
        for k in got:
            got[k].append(no_padding_2_padding(out[k], mb))
    got = {k: torch.cat(v) for k, v in got.items()}
    m = rmask.bool()
    torch.testing.assert_close(got["log_probs"][m], core["logprobs"][m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["mode_prob"][m], core["mode_prob"][m], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["hidden_residual"][m], core["hidden_residual"][m], rtol=1e-4, atol=1e-5)
    # the adapter-off forward left the adapter on, and a batch that asks for nothing gets nothing
    plain = engine_data(prompts, pmask, responses, rmask, want=(), use_remove_padding=use_remove_padding)
    out = engine_forward(eng, micro_batches(plain, use_remove_padding)[0])
    assert "mode_prob" not in out and "hidden_residual" not in out
    torch.testing.assert_close(no_padding_2_padding(out["log_probs"], micro_batches(plain, use_remove_padding)[0])[0][m[0]],
                               core["logprobs"][0][m[0]], rtol=1e-5, atol=1e-5)


def test_engine_refuses_what_it_cannot_give(lora_model):
    model, tok = lora_model
    prompts, pmask, responses, rmask, _, _ = rollout_batch(len(tok))
    eng = cpu_engine(model)
    eng._is_lora = False
    data = engine_data(prompts, pmask, responses, rmask, want=("hidden_residual",), use_remove_padding=False)
    with pytest.raises(ValueError, match="LoRA actor"):
        engine_forward(eng, data)
    eng._is_lora = True
    tu.assign_non_tensor(data, use_fused_kernels=True)
    with pytest.raises(ValueError, match="use_fused_kernels=False"):
        engine_forward(eng, data)


def test_engine_is_registered_under_its_model_type_and_builds_verls_language_model():
    assert EngineRegistry.get_engine_cls(tcv.ENGINE_MODEL_TYPE, "fsdp2") is TokenCreditFSDPEngine
    eng = TokenCreditFSDPEngine.__new__(TokenCreditFSDPEngine)
    seen = []
    eng.model_config = SimpleNamespace(model_type=tcv.ENGINE_MODEL_TYPE)

    def fake_build(self):  # what verl's _build_module branches on
        seen.append(self.model_config.model_type)
        return "module"

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    orig = FSDPEngineWithLMHead._build_module
    FSDPEngineWithLMHead._build_module = fake_build
    try:
        assert eng._build_module() == "module"
    finally:
        FSDPEngineWithLMHead._build_module = orig
    assert seen == ["language_model"] and eng.model_config.model_type == tcv.ENGINE_MODEL_TYPE


# -- (2) the advantages reaching verl's loss equal the core's ---------------------------------

SEEN = []


@register_policy_loss("tc_test_capture")
def _capture(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
    SEEN.append(advantages.detach().clone())
    return get_policy_loss_fn("vanilla")(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                                         response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                                         rollout_is_weights=rollout_is_weights)


@pytest.mark.parametrize("method,cfg", [("acpo", {"beta_pos": 0.8, "beta_neg": 1.0}), ("arca", {"sharpening": 2.0})])
def test_advantages_reaching_verls_loss_equal_core(lora_model, method, cfg):
    model, tok = lora_model
    prompts, pmask, responses, rmask, rewards, uid = rollout_batch(len(tok))
    spec = f"grpo+{method}"
    settings = tcv.settings_from_dict({"spec": spec, "base_loss_mode": "tc_test_capture", method: cfg})
    # the driver: verl's compute_advantage with tokencredit's estimator
    tlr = torch.zeros(rmask.shape)
    tlr[torch.arange(len(rmask)), rmask.sum(1) - 1] = rewards
    dp = DataProto.from_dict(tensors={"token_level_rewards": tlr, "response_mask": rmask.float()}, non_tensors={"uid": uid})
    adv = compute_advantage(dp, adv_estimator="tc_grpo", config=AlgoConfig()).batch["advantages"]
    # the worker: the request the trainer mode makes for this plan, the engine's forward, the engine loss
    plan = tct.trainer_plan(compose_verl(TRAINER_OVERRIDES + [f"+tokencredit.spec={spec}", "actor_rollout_ref.model.lora_rank=4"]),
                            settings)[1]
    want = tct.worker_signals(plan)
    assert want == {"acpo": ("mode_prob",), "arca": ("hidden_residual",)}[method]
    data = engine_data(prompts, pmask, responses, rmask, want=want, use_remove_padding=True)
    data["old_log_probs"] = torch.zeros(rmask.shape)  # ratio = exp(logp): the clip is not what this checks
    data["advantages"] = adv
    loss_fn = partial(tcv.tokencredit_ppo_loss, config=actor_config(), settings=settings)
    eng = cpu_engine(model)
    SEEN.clear()
    for mb in micro_batches(data, True):  # one sequence per micro-batch: the calibrator's per-micro-batch view
        out = engine_forward(eng, mb, loss_fn)
        loss, metrics = loss_fn(model_output=out, data=mb, dp_group=None)
        assert any(k.startswith(f"tokencredit/{method}/") for k in metrics)
    reached = torch.cat(SEEN)

    core_sig = core_signals(model, prompts, pmask, responses, rmask, spec)
    _, gids = np.unique(uid.astype(str), return_inverse=True)
    fields = {k: core_sig[k] for k in ("logprobs", "mode_prob", "hidden_residual") if k in core_sig}
    core = CreditPipeline(spec, **{method: cfg})(CreditBatch(response_mask=rmask, rewards=rewards, group_ids=torch.as_tensor(gids), **fields))
    assert not torch.allclose(core.advantages, adv * rmask)  # the calibrator changed the credit
    torch.testing.assert_close(reached * rmask, core.advantages, rtol=1e-4, atol=1e-6)

    # without the engine's signal the loss says how to get it
    plain = engine_data(prompts, pmask, responses, rmask, want=(), use_remove_padding=False)
    plain["old_log_probs"], plain["advantages"] = torch.zeros(rmask.shape), adv
    out = engine_forward(eng, plain)
    with pytest.raises(CreditInputError, match=tcv.ENGINE_MODEL_TYPE):
        loss_fn(model_output=out, data=plain, dp_group=None)


# -- (3) the trainer mode's checks ------------------------------------------------------------


def test_trainer_config_for_acpo_and_arca():
    engine = f"+actor_rollout_ref.model.model_type={tcv.ENGINE_MODEL_TYPE}"
    ok = {
        "grpo+acpo": [engine],
        "grpo+arca": [engine, "actor_rollout_ref.model.lora_rank=8"],
    }
    for spec, extra in ok.items():
        cfg = compose_verl(TRAINER_OVERRIDES + [f"+tokencredit.spec={spec}", *extra])
        settings = tct.check_trainer_config(cfg)
        plan = tct.trainer_plan(cfg, settings)[1]
        assert plan.passes == {"grpo+acpo": ("policy",), "grpo+arca": ("policy", "adapter_off")}[spec]
    bad = [
        (["+tokencredit.spec=grpo+acpo"], "model_type=tokencredit_language_model"),
        (["+tokencredit.spec=grpo+arca", engine], "expected a LoRA actor"),
        (["+tokencredit.spec=grpo+arca", "actor_rollout_ref.model.lora_rank=8"], "model_type=tokencredit_language_model"),
        (["+tokencredit.spec=grpo+acpo", engine, "actor_rollout_ref.model.use_fused_kernels=True"], "use_fused_kernels=False"),
    ]
    for extra, match in bad:
        with pytest.raises(ValueError, match=match):
            tct.check_trainer_config(compose_verl(TRAINER_OVERRIDES + extra))
