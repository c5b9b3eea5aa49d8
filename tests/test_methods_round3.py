"""Methods round 3 (issue 32): SEPA's schedule in retrain's order, and the new losses and methods,
each against a transcription of its authors' code (read with the search tool, rewritten here
from the reading) and by properties that fail when the defining line is broken."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tokencredit import CreditPipeline
from tokencredit.methods.sepa import SEPAConfig, SEPAController

from helpers import make_batch


# -- SEPA: retrain's order ---------------------------------------------------------------------


class RetrainSEPA:
    """retrain's ``training/sepa.py`` linear schedule and gate, and its trainer's order
    (``training/trainer.py``: ``resolve_lambda(step=batch_idx)`` before the rollouts, then
    ``observe_correct_rate`` with the share of rewards ``> CORRECT_THRESHOLD`` (0.5,
    ``training/signals.py``) among the step's rewards)."""

    def __init__(self, steps, delay, gate):
        self.steps, self.delay, self.gate = steps, delay, gate
        self.open = gate <= 0.0

    def resolve_lambda(self, step):
        if self.steps <= 0:
            lin = 0.0
        else:
            shifted = step - self.delay
            lin = 0.0 if shifted <= 0.0 else min(shifted / self.steps, 1.0)
        return lin if self.open else 0.0

    def observe_correct_rate(self, rate):
        if self.open or self.gate <= 0.0:
            return
        if rate >= self.gate:
            self.open = True

    def run(self, rewards_per_step):
        lams = []
        for batch_idx, rewards in enumerate(rewards_per_step):
            lams.append(self.resolve_lambda(float(batch_idx)))
            correct = sum(1 for r in rewards if r > 0.5)
            self.observe_correct_rate(correct / len(rewards) if rewards else 0.0)
        return lams


def _sepa_lambdas(config, rewards_per_step):
    """The lambda each step's credit used in a pipeline that steps the controller (the trainers)."""
    pipe = CreditPipeline("sepa", sepa=config)
    base = make_batch(8, 5, 4, seed=0)
    out = []
    for rewards in rewards_per_step:
        out.append(pipe(base.replace(rewards=torch.tensor(rewards, dtype=torch.float32))).metrics["sepa/lambda"])
    return out


@pytest.mark.parametrize("setting", [
    dict(steps=500, delay_steps=50, correct_rate_gate=0.1),  # defaults (retrain's config/schema.py)
    dict(steps=4, delay_steps=1, correct_rate_gate=0.3),
    dict(steps=7, delay_steps=0, correct_rate_gate=0.0),
    dict(steps=3, delay_steps=5, correct_rate_gate=0.6),
])
@pytest.mark.parametrize("seed", range(3))
def test_sepa_lambda_equals_retrains_order_on_random_reward_streams(setting, seed):
    rng = random.Random(seed)
    n = 70 if setting["steps"] == 500 else 14
    # rewards in {0, 0.3, 0.6, 1}: 0.3 is not correct for retrain (r > 0.5), 0.6 is
    p_good = [0.0] * (n // 3) + [rng.choice([0.1, 0.3, 0.7]) for _ in range(n - n // 3)]
    stream = [[rng.choice([0.6, 1.0]) if rng.random() < p else rng.choice([0.0, 0.3]) for _ in range(8)] for p in p_good]
    want = RetrainSEPA(setting["steps"], setting["delay_steps"], setting["correct_rate_gate"]).run(stream)
    got = _sepa_lambdas(setting, stream)
    assert got == pytest.approx(want, abs=1e-12)
    assert any(v > 0 for v in want) or setting["steps"] == 500 and n < 51  # the schedule is exercised


def test_sepa_the_issues_cases():
    """Defaults, every response correct: step 50 has lambda (50 - 50) / 500 = 0 (the controller
    that stepped first had 0.002). Steps 4, delay 1, gate 0.3, the gate reached at step 3: step 3
    still has 0 (0.75 before), step 4 has 0.75. Rewards in {0, 0.3}: retrain's gate never opens."""
    ones = [[1.0] * 8] * 52
    assert _sepa_lambdas({}, ones)[50:] == pytest.approx([0.0, 0.002])
    late = [[0.0] * 8] * 3 + [[1.0] * 8] * 3
    assert _sepa_lambdas(dict(steps=4, delay_steps=1, correct_rate_gate=0.3), late) == pytest.approx(
        [0, 0, 0, 0, 0.75, 1.0])
    low = [[0.3, 0.0] * 4] * 8
    assert _sepa_lambdas(dict(steps=2, delay_steps=0, correct_rate_gate=0.1), low) == [0.0] * 8
    # the threshold is a parameter: at 0 the same stream opens the gate after step 0
    assert _sepa_lambdas(dict(steps=2, delay_steps=0, correct_rate_gate=0.1, correct_threshold=0.0), low)[1:3] == \
        pytest.approx([0.5, 1.0])


def test_sepa_state_round_trip_and_replay_use_the_steps_lambda():
    c = SEPAController(SEPAConfig(steps=4, delay_steps=0, correct_rate_gate=0.0))
    batch = make_batch(4, 3, 2, seed=0)
    for _ in range(3):
        c.update(batch)
    assert c.lam() == 0.5 and c.state_dict() == {"step": 3, "gate_open": True, "lam": 0.5}
    c2 = SEPAController(c.config)
    c2.load_state_dict(c.state_dict())
    assert c2.lam() == 0.5
    c2.update(batch)
    assert c2.lam() == 0.75
    # a state saved before "lam" was recorded replays as that controller computed (at its step)
    c3 = SEPAController(c.config)
    c3.load_state_dict({"step": 3, "gate_open": True})
    assert c3.lam() == 0.75
    with pytest.raises(ValueError, match="sepa state lam"):
        c3.load_state_dict({"step": 3, "gate_open": True, "lam": 1.5})
    with pytest.raises(ValueError, match="sepa correct_threshold"):
        SEPAConfig(correct_threshold=math.nan)
