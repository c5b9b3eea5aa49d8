"""The verl plugin: registered by the ``verl.plugins`` entry point on a bare ``import verl``; verl's
own advantage and policy-loss code paths give exactly tokencredit's core results; the trainer
mode's loss wrapper hands entropy to the calibrators; the ``tokencredit`` config section passes
verl's config machinery and changes the result; bad setups fail with a message naming the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("hydra")

import numpy as np  # noqa: E402
import verl  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402

from tokencredit import CreditBatch, CreditInputError, CreditPipeline, get_method  # noqa: E402
from tokencredit.integrations import verl as tcv  # noqa: E402
from tokencredit.credit.losses import PPOLossConfig, ppo_loss  # noqa: E402

CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0


@pytest.fixture(autouse=True)
def _clean_settings(monkeypatch):
    monkeypatch.delenv(tcv.ENV_VAR, raising=False)
    tcv.install_settings(None)
    yield
    tcv.install_settings(None)


def rollout(seed=0, B=8, T=7, group_size=4):
    """An outcome-reward rollout batch as verl stores it: reward on the last valid token."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.randint(0, 2, (B,), generator=gen).float()
    rewards[0], rewards[1] = 0.0, 1.0  # every group varies...
    rewards[group_size], rewards[group_size + 1] = 1.0, 0.0
    rewards[2] = 0.5  # ...and not only in {0, 1}
    tlr = torch.zeros(B, T)
    tlr[torch.arange(B), lengths - 1] = rewards
    uid = np.array([f"prompt-{i // group_size}" for i in range(B)], dtype=object)
    return tlr, mask, uid, rewards


def policy_tensors(mask, seed=1):
    gen = torch.Generator().manual_seed(seed)
    B, T = mask.shape
    logp = -torch.rand(B, T, generator=gen) * 4.0
    # far enough from the old policy that both clips and the dual clip are active somewhere
    old = logp + torch.randn(B, T, generator=gen) * 0.6
    old[0, 0] = logp[0, 0] - 1.5  # row 0 (reward 0, A < 0): ratio e^1.5 > clip_ratio_c = 3
    logp, old = logp * mask, old * mask  # verl zeroes padding
    return logp, old


def actor_config(**overrides):
    base = {
        "_target_": "verl.workers.config.FSDPActorConfig",
        "strategy": "fsdp",
        "rollout_n": 4,
        "ppo_micro_batch_size_per_gpu": 4,
        "clip_ratio_low": CLIP_LOW,
        "clip_ratio_high": CLIP_HIGH,
        "clip_ratio_c": CLIP_C,
        "policy_loss": {"loss_mode": "tokencredit"},
    }
    base.update(overrides)
    return omega_conf_to_dataclass(OmegaConf.create(base))


def by_hand_ppo(logp, old, adv, mask):
    """tokencredit's own PPO loss with verl vanilla's settings (dual clip c = clip_ratio_c)."""
    cfg = PPOLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=CLIP_C, agg_mode="token-mean")
    return ppo_loss(logp, old, adv, mask, cfg)[0]


def grpo_advantages(tlr, mask, uid):
    _, gids = np.unique(uid.astype(str), return_inverse=True)
    batch = CreditBatch(response_mask=mask, rewards=tlr.sum(-1), group_ids=torch.as_tensor(gids))
    return CreditPipeline("grpo")(batch).advantages


# -- (1) entry point --------------------------------------------------------------------------

PROBE = (
    "import verl, json\n"
    "from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY\n"
    "from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY\n"
    "from verl.workers.engine.base import EngineRegistry\n"
    "print(json.dumps({'est': sorted(k for k in ADV_ESTIMATOR_REGISTRY if k.startswith('tc_')),\n"
    "  'loss': 'tokencredit' in POLICY_LOSS_REGISTRY, 'trainer': 'tokencredit_sync' in TRAINER_REGISTRY,\n"
    "  'engine': 'tokencredit_language_model' in EngineRegistry._engines}))\n"
)


def test_entry_point_registers_on_bare_import():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("tokencredit") == "tokencredit.integrations.verl"

    # a fresh interpreter that imports nothing of tokencredit; with plugins off as the control
    def start(policy):
        env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
        env["VERL_USE_EXTERNAL_PLUGINS"] = policy
        return subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, text=True)

    procs = {p: start(p) for p in ("auto", "none")}
    seen = {}
    for policy, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        seen[policy] = json.loads(out.strip().splitlines()[-1])
    assert seen["auto"] == {"est": sorted(tcv.estimator_names()), "loss": True, "trainer": True, "engine": True}
    assert {"tc_grpo", "tc_gtpo", "tc_oppo", "tc_opd", "tc_gae", "tc_pact"} <= set(seen["auto"]["est"])
    assert seen["none"] == {"est": [], "loss": False, "trainer": False, "engine": False}


# -- (2) verl's advantage path ----------------------------------------------------------------


@pytest.mark.parametrize("name,verl_name,verl_norm", [("grpo", "grpo", True), ("rloo", "rloo", True), ("dr_grpo", "grpo", False)])
def test_compute_advantage_runs_our_estimator(name, verl_name, verl_norm):
    tlr, mask, uid, rewards = rollout()
    data = DataProto.from_dict(tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uid})
    out = compute_advantage(data, adv_estimator=f"tc_{name}", config=AlgoConfig())
    _, gids = np.unique(uid.astype(str), return_inverse=True)
    core = CreditPipeline(name)(CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.as_tensor(gids)))
    torch.testing.assert_close(out.batch["advantages"], core.advantages, rtol=0, atol=0)
    torch.testing.assert_close(out.batch["returns"], core.advantages, rtol=0, atol=0)
    # and verl's own estimator of the same method agrees (up to float order of operations)
    ref = DataProto.from_dict(tensors={"token_level_rewards": tlr.clone(), "response_mask": mask}, non_tensors={"uid": uid})
    ref = compute_advantage(ref, adv_estimator=verl_name, norm_adv_by_std_in_grpo=verl_norm, config=AlgoConfig())
    torch.testing.assert_close(out.batch["advantages"], ref.batch["advantages"], rtol=1e-5, atol=1e-6)


def test_padding_rows_are_left_out_of_group_statistics():
    tlr, mask, uid, _ = rollout()
    # verl's synthetic padding sample: a copy of a real sample's uid, no valid token, reward 0
    tlr_p = torch.cat([tlr, torch.zeros(1, tlr.shape[1])])
    mask_p = torch.cat([mask, torch.zeros(1, mask.shape[1])])
    uid_p = np.concatenate([uid, uid[:1]])
    data = DataProto.from_dict(tensors={"token_level_rewards": tlr_p, "response_mask": mask_p}, non_tensors={"uid": uid_p})
    adv = compute_advantage(data, adv_estimator="tc_grpo", config=AlgoConfig()).batch["advantages"]
    torch.testing.assert_close(adv[:-1], grpo_advantages(tlr, mask, uid), rtol=0, atol=0)
    assert torch.equal(adv[-1], torch.zeros_like(adv[-1]))


# -- (3) verl's policy-loss path --------------------------------------------------------------


def test_policy_loss_equals_calibrated_tokencredit_ppo_by_hand():
    tlr, mask, uid, _ = rollout()
    adv = grpo_advantages(tlr, mask, uid)
    logp, old = policy_tensors(mask)
    tcv.install_settings(tcv.settings_from_dict({"spec": "grpo+surprisal", "surprisal": {"kappa": 0.7}}))

    lp_verl = logp.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("tokencredit")(
        old_log_prob=old, log_prob=lp_verl, advantages=adv, response_mask=mask,
        loss_agg_mode="token-mean", config=actor_config(), rollout_is_weights=None,
    )
    loss.backward()

    # by hand: tokencredit's surprisal calibrator, then tokencredit's PPO loss
    info = get_method("surprisal")
    batch = CreditBatch(response_mask=mask, rewards=torch.zeros(len(mask)), group_ids=torch.arange(len(mask)), logprobs=logp)
    cal = info.fn(batch, adv, info.make_config({"kappa": 0.7}), None).advantages
    assert not torch.allclose(cal, adv)  # the calibrator changed something
    lp_hand = logp.clone().requires_grad_(True)
    expected = by_hand_ppo(lp_hand, old, cal, mask)
    expected.backward()

    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp_verl.grad, lp_hand.grad, rtol=1e-5, atol=1e-8)
    assert "tokencredit/surprisal/gini" in metrics and metrics["actor/pg_clipfrac_lower"] > 0  # dual clip active
    # the uncalibrated loss differs: the calibration reached verl's loss
    plain = by_hand_ppo(logp, old, adv, mask)
    assert not torch.allclose(loss.detach(), plain)


def _engine_micro_batch(logp, old, adv, mask, entropy, ref=None, prompt_len=3):
    """One micro-batch as verl's engine hands it to its loss function (padded layout): model
    outputs are flat over the packed prompt+response tokens, data holds the padded tensors."""
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    B, R = mask.shape
    resp_lens = mask.sum(1).long()
    prompts = torch.ones(B, prompt_len, dtype=torch.long)
    attn = torch.cat([torch.ones(B, prompt_len, dtype=torch.long), mask.long()], dim=1)
    flat_lp, flat_ent = [], []
    for b in range(B):
        n = int(resp_lens[b])
        # position i of a packed sequence holds the output for the token at i + 1
        seq_lp = torch.cat([torch.zeros(prompt_len - 1), logp[b, :n], torch.zeros(1)])
        seq_ent = torch.cat([torch.zeros(prompt_len - 1), entropy[b, :n], torch.zeros(1)])
        flat_lp.append(seq_lp)
        flat_ent.append(seq_ent)
    model_output = {"log_probs": torch.cat(flat_lp), "entropy": torch.cat(flat_ent)}
    data = TensorDict(
        {"prompts": prompts, "responses": torch.ones(B, R, dtype=torch.long), "attention_mask": attn,
         "response_mask": mask, "old_log_probs": old, "advantages": adv},
        batch_size=[B],
    )
    if ref is not None:
        data["ref_log_prob"] = ref
    tu.assign_non_tensor_data(data, "dp_size", 1)
    tu.assign_non_tensor_data(data, "batch_num_tokens", None)
    tu.assign_non_tensor_data(data, "global_batch_size", None)
    return model_output, data


@pytest.mark.parametrize("method,cfg", [("taco", {"alpha": 0.5, "lam": 0.8}), ("divergence", {"kappa": 0.8})])
def test_trainer_mode_loss_hands_signals_to_the_calibrator(method, cfg):
    tlr, mask, uid, _ = rollout()
    adv = grpo_advantages(tlr, mask, uid)
    logp, old = policy_tensors(mask)
    gen = torch.Generator().manual_seed(3)
    entropy = torch.rand(mask.shape, generator=gen) * 0.2 * mask
    ref = (logp + torch.randn(mask.shape, generator=gen) * 0.5) * mask
    settings = tcv.settings_from_dict({"spec": f"grpo+{method}", method: cfg})
    model_output, data = _engine_micro_batch(logp, old, adv, mask, entropy, ref=ref)
    # exactly what the trainer mode ships to the workers through set_loss_fn
    loss_fn = partial(tcv.tokencredit_ppo_loss, config=actor_config(calculate_entropy=True), settings=settings)
    loss, metrics = loss_fn(model_output=model_output, data=data, dp_group=None)

    info = get_method(method)
    batch = CreditBatch(response_mask=mask, rewards=torch.zeros(len(mask)), group_ids=torch.arange(len(mask)),
                        logprobs=logp, entropy=entropy, ref_logprobs=ref)
    cal = info.fn(batch, adv, info.make_config(cfg), None).advantages
    assert not torch.allclose(cal, adv)
    torch.testing.assert_close(loss, by_hand_ppo(logp, old, cal, mask), rtol=1e-6, atol=1e-7)
    assert any(k.startswith(f"tokencredit/{method}/") for k in metrics)
    # outside the wrapper the same loss lacks the signal and says how to get it
    hint = "calculate_entropy=True" if method == "taco" else "use_kl_loss=True"
    with pytest.raises(CreditInputError, match=hint):
        with tcv.loss_context(settings, {}):
            get_policy_loss_fn("tokencredit")(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                                              loss_agg_mode="token-mean", config=actor_config())


# -- (4) the hyperparameter channel -----------------------------------------------------------


def compose_verl(overrides):
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


TRAINER_OVERRIDES = [
    "algorithm.adv_estimator=tc_grpo",
    "actor_rollout_ref.actor.policy_loss.loss_mode=tokencredit",
    "trainer.v1.trainer_mode=tokencredit_sync",
    "actor_rollout_ref.actor.calculate_entropy=True",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.n=4",
]


def test_config_section_passes_verl_config_machinery_and_changes_the_loss():
    cfg = compose_verl(TRAINER_OVERRIDES + ["+tokencredit.spec=grpo+taco", "+tokencredit.taco.lam=0.3",
                                            "+tokencredit.taco.alpha=0.5"])
    # verl's dataclass conversions of the sections it types still succeed
    algo = omega_conf_to_dataclass(cfg.algorithm)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(algo, AlgoConfig) and actor.policy_loss.loss_mode == "tokencredit" and actor.calculate_entropy
    from verl.trainer.ppo.v1 import get_trainer_cls

    assert get_trainer_cls(cfg.trainer.v1.trainer_mode).__name__ == "TokenCreditPPOTrainerSync"

    from tokencredit.integrations.verl.trainer import check_trainer_config

    settings = check_trainer_config(cfg)
    assert settings.spec == "grpo+taco" and settings.configs["taco"] == {"lam": 0.3, "alpha": 0.5}

    tlr, mask, uid, _ = rollout()
    adv = grpo_advantages(tlr, mask, uid)
    logp, old = policy_tensors(mask)
    entropy = torch.full(mask.shape, 0.05) * mask

    def loss_with(s):
        model_output, data = _engine_micro_batch(logp, old, adv, mask, entropy)
        return tcv.tokencredit_ppo_loss(actor, model_output, data, settings=s)[0]

    default = tcv.settings_from_dict({"spec": "grpo+taco", "taco": {"alpha": 0.5}})  # lam = 0.9
    assert not torch.allclose(loss_with(settings), loss_with(default))

    # a key inside verl's algorithm section would not survive verl's AlgoConfig: why we use our own
    bad = OmegaConf.create({**OmegaConf.to_container(cfg.algorithm), "tokencredit": {"spec": "grpo"}})
    with pytest.raises(Exception, match="tokencredit"):
        omega_conf_to_dataclass(bad)


def test_env_channel_and_verl_norm_key_reach_the_estimator(monkeypatch):
    tlr, mask, uid, rewards = rollout()

    def tc_grpo(**algo):
        data = DataProto.from_dict(tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uid})
        return compute_advantage(data, adv_estimator="tc_grpo", config=AlgoConfig(**algo)).batch["advantages"]

    default = tc_grpo()
    monkeypatch.setenv(tcv.ENV_VAR, json.dumps({"grpo": {"eps": 0.5}}))
    bigger_eps = tc_grpo()
    assert not torch.allclose(default, bigger_eps)
    _, gids = np.unique(uid.astype(str), return_inverse=True)
    core = CreditPipeline("grpo", grpo={"eps": 0.5})(
        CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.as_tensor(gids)))
    torch.testing.assert_close(bigger_eps, core.advantages, rtol=0, atol=0)
    # verl's own key selects std normalisation
    monkeypatch.delenv(tcv.ENV_VAR)
    no_std = tc_grpo(norm_adv_by_std_in_grpo=False)
    dr = CreditPipeline("dr_grpo")(CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.as_tensor(gids)))
    torch.testing.assert_close(no_std, dr.advantages, rtol=0, atol=0)



def test_verl_std_switch_reaches_any_estimator_with_the_field(monkeypatch):
    """verl's ``norm_adv_by_std_in_grpo`` sets the estimator config field the plugin names
    (``STD_NORMALIZE_FIELD``), for any estimator whose config has it (no method name in the
    plugin); an estimator without it (rloo) gives the same advantages either way."""
    from dataclasses import dataclass

    from tokencredit.credit import registry
    from tokencredit.credit.registry import CreditOutput, register_estimator

    @dataclass
    class SwitchConfig:
        std_normalize: bool = True

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_estimator("test_std_switch", config=SwitchConfig, provenance="reconstructed", summary="test", needs_groups=True)(
        lambda batch, config: CreditOutput(advantages=batch.response_mask.float() * (1.0 if config.std_normalize else 2.0))
    )
    tlr, mask, uid, _ = rollout()
    est = tcv.make_estimator("test_std_switch")
    on, _ = est(token_level_rewards=tlr, response_mask=mask, config=AlgoConfig(norm_adv_by_std_in_grpo=True), index=uid)
    off, _ = est(token_level_rewards=tlr, response_mask=mask, config=AlgoConfig(norm_adv_by_std_in_grpo=False), index=uid)
    torch.testing.assert_close(on, mask)
    torch.testing.assert_close(off, 2 * mask)
    rloo = tcv.make_estimator("rloo")
    torch.testing.assert_close(
        rloo(token_level_rewards=tlr, response_mask=mask, config=AlgoConfig(norm_adv_by_std_in_grpo=False), index=uid)[0],
        rloo(token_level_rewards=tlr, response_mask=mask, config=AlgoConfig(norm_adv_by_std_in_grpo=True), index=uid)[0],
    )



def test_core_shows_the_live_call_contexts():
    """``core._DRIVER`` and ``core._LOSS_CONTEXT`` (read by tests/verl_e2e/tc_capture.py in verl's
    processes) are the contexts open now, though they live in the estimator and loss modules."""
    core = tcv.core
    mask = torch.ones(2, 3)
    assert core._DRIVER is None and core._LOSS_CONTEXT is None
    with tcv.driver_signals(mask, {"entropy": torch.zeros(2, 3)}):
        assert core._DRIVER is not None and set(core._DRIVER.signals) == {"entropy"}
        with tcv.loss_context(tcv.VerlCreditSettings(spec="grpo"), {"entropy": torch.zeros(2, 3)}, None):
            assert core._LOSS_CONTEXT.settings.spec == "grpo"
    assert core._DRIVER is None and core._LOSS_CONTEXT is None
    with pytest.raises(AttributeError, match="_NOPE"):
        core._NOPE


# -- (5) clear errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"spec": "grpo+taco", "taco": {"lamda": 0.5}}, "unknown key.*lamda"),
        ({"spec": "grpo+nosuch"}, "unknown credit method 'nosuch'"),
        ({"spec": "grpo", "base_loss_mode": "tokencredit"}, "base_loss_mode"),
        ({"spec": "grpo", "rloo": {}}, "not in credit spec"),
    ],
)
def test_unsupported_or_bad_settings_fail_clearly(settings, match):
    with pytest.raises((ValueError, KeyError, TypeError), match=match):
        tcv.settings_from_dict(settings)


def test_bad_estimator_inputs_fail_clearly(monkeypatch):
    tlr, mask, uid, _ = rollout()
    est = tcv.make_estimator("grpo")
    with pytest.raises(CreditInputError, match="index"):
        est(token_level_rewards=tlr, response_mask=mask, config=AlgoConfig(), index=None)
    singleton = uid.copy()
    singleton[0] = "alone"
    with pytest.raises(CreditInputError, match="group_ids.*at least 2"):
        est(token_level_rewards=tlr, response_mask=mask, config=AlgoConfig(), index=singleton)
    monkeypatch.setenv(tcv.ENV_VAR, json.dumps({"spec": "rloo+surprisal"}))
    with pytest.raises(ValueError, match="estimator 'rloo'.*tc_grpo"):
        est(token_level_rewards=tlr, response_mask=mask, config=AlgoConfig(), index=uid)
    monkeypatch.setenv(tcv.ENV_VAR, json.dumps({"grpo": {"std_normalize": True}}))
    with pytest.raises(ValueError, match="norm_adv_by_std_in_grpo"):
        est(token_level_rewards=tlr, response_mask=mask, config=AlgoConfig(norm_adv_by_std_in_grpo=False), index=uid)
    monkeypatch.setenv(tcv.ENV_VAR, "{spec: grpo")
    with pytest.raises(ValueError, match=tcv.ENV_VAR):
        tcv.current_settings()


def test_loss_without_spec_and_bad_trainer_configs_fail_clearly():
    tlr, mask, uid, _ = rollout()
    logp, old = policy_tensors(mask)
    with pytest.raises(ValueError, match="needs a credit spec"):
        get_policy_loss_fn("tokencredit")(old_log_prob=old, log_prob=logp, advantages=mask, response_mask=mask,
                                          loss_agg_mode="token-mean", config=actor_config())

    from tokencredit.integrations.verl.trainer import check_trainer_config

    def without(prefix):
        return [o for o in TRAINER_OVERRIDES if not o.startswith(prefix)]

    cases = [
        (TRAINER_OVERRIDES, "needs a credit spec"),
        (without("actor_rollout_ref.actor.policy_loss") + ["+tokencredit.spec=grpo+taco"], "loss_mode=tokencredit"),
        (without("actor_rollout_ref.actor.calculate_entropy") + ["+tokencredit.spec=grpo+taco"], "calculate_entropy=True"),
        (TRAINER_OVERRIDES + ["+tokencredit.spec=grpo+divergence"], "reference log-probs"),
        (TRAINER_OVERRIDES + ["+tokencredit.spec=rloo+taco"], "adv_estimator=tc_rloo"),
    ]
    for overrides, match in cases:
        with pytest.raises(ValueError, match=match):
            check_trainer_config(compose_verl(overrides))


def test_version_guard_names_both_versions():
    tcv.check_verl_version("0.9.1")
    with pytest.raises(RuntimeError, match="0.9.x.*installed verl is 0.10.0"):
        tcv.check_verl_version("0.10.0")
