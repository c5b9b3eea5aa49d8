"""Properties every registered credit method and spec composition must have (hypothesis).

For any valid batch: finite advantages, exactly 0 on masked positions, unchanged by extra
padding; and a clear error (naming the field) for each kind of bad input.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokencredit as tc
from tokencredit import CreditBatch, CreditInputError, CreditPipeline

from helpers import make_batch, pad_batch

ESTIMATORS = tc.list_methods("estimator")
CALIBRATORS = tc.list_methods("calibrator")
# every method alone (calibrators in their paper's pairing) plus cross compositions
SPECS = ESTIMATORS + CALIBRATORS + [f"{e}+{c}" for e in ("rloo", "oppo") for c in CALIBRATORS] + [
    "grpo+taco+stare",
    "gae+acpo",
]


def test_all_six_methods_and_baselines_are_registered():
    names = set(tc.list_methods())
    for n in ["grpo", "dr_grpo", "rloo", "gae", "gtpo", "opd", "oppo", "pact",
              "taco", "stare", "acpo", "arca", "surprisal", "entropy", "divergence"]:
        assert n in names, n


batch_params = st.tuples(
    st.integers(1, 3),  # groups
    st.integers(2, 4),  # group size
    st.integers(1, 9),  # T
    st.integers(0, 10_000),  # seed
    st.booleans(),  # binary rewards
)


def _batch(params):
    n_groups, gsize, T, seed, binary = params
    return make_batch(n_groups * gsize, T, gsize, seed=seed, binary_rewards=binary)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=15, deadline=None)
@given(params=batch_params, extra=st.integers(1, 4))
def test_finite_zero_on_mask_and_padding_invariant(spec, params, extra):
    batch = _batch(params)
    out = CreditPipeline(spec)(batch)
    adv = out.advantages
    assert adv.shape == batch.response_mask.shape
    assert torch.isfinite(adv).all()
    assert (adv[~batch.mask] == 0).all()
    if out.token_weights is not None:
        assert torch.isfinite(out.token_weights).all()
    for v in out.metrics.values():
        assert math.isfinite(v), out.metrics

    padded = CreditPipeline(spec)(pad_batch(batch, extra))
    T = batch.num_positions
    torch.testing.assert_close(padded.advantages[:, :T], adv, rtol=1e-5, atol=1e-6)
    assert (padded.advantages[:, T:] == 0).all()


def test_empty_rows_get_zero_credit():
    batch = make_batch(8, 5, 4, seed=3, lengths=[3, 0, 5, 2, 1, 4, 0, 5])
    for spec in SPECS:
        out = CreditPipeline(spec)(batch)
        assert (out.advantages[1] == 0).all() and (out.advantages[6] == 0).all(), spec


# ---- bad input: each kind gives a clear error naming the field ------------------------


def _kw(batch):
    return batch.to_dict()


def test_b_zero_and_t_zero():
    with pytest.raises(CreditInputError, match="response_mask.*B = 0"):
        CreditBatch(response_mask=torch.ones(0, 3), rewards=torch.ones(0), group_ids=torch.zeros(0, dtype=torch.long))
    with pytest.raises(CreditInputError, match="response_mask.*T = 0"):
        CreditBatch(response_mask=torch.ones(2, 0), rewards=torch.ones(2), group_ids=torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("field", ["response_mask", "rewards", "group_ids"] + list(tc.SIGNALS))
def test_wrong_shape_names_field(field):
    kw = _kw(make_batch(4, 3, 2))
    x = kw[field]
    kw[field] = x[..., :-1] if x.dim() == 2 else x[:-1]
    if field == "response_mask":
        # a narrower mask makes every other field disagree; the error must still name a field
        with pytest.raises(CreditInputError, match="expected shape|expected a tensor of shape"):
            CreditBatch(**kw)
    else:
        with pytest.raises(CreditInputError, match=field):
            CreditBatch(**kw)


def test_mask_not_binary():
    kw = _kw(make_batch(4, 3, 2))
    kw["response_mask"] = kw["response_mask"].float() * 0.5
    with pytest.raises(CreditInputError, match="response_mask.*0/1"):
        CreditBatch(**kw)
    kw["response_mask"] = torch.full((4, 3), 2)
    with pytest.raises(CreditInputError, match="response_mask.*0/1.*2"):
        CreditBatch(**kw)


@pytest.mark.parametrize("field", list(tc.TOKEN_SIGNALS) + ["values"])
def test_nan_on_valid_position_names_field(field):
    kw = _kw(make_batch(4, 3, 2, lengths=[3, 3, 3, 3]))
    x = kw[field].clone()
    x[1, 1] = float("nan")
    kw[field] = x
    with pytest.raises(CreditInputError, match=f"{field}.*finite.*\\(1, 1\\)"):
        CreditBatch(**kw)


def test_nan_on_padding_is_fine():
    batch = pad_batch(make_batch(4, 3, 2), 2)
    assert torch.isnan(batch.logprobs[:, -1]).all()


def test_nonfinite_reward_and_float_group_ids():
    kw = _kw(make_batch(4, 3, 2))
    kw["rewards"] = torch.tensor([1.0, float("inf"), 0.0, 1.0])
    with pytest.raises(CreditInputError, match="rewards.*finite"):
        CreditBatch(**kw)
    kw = _kw(make_batch(4, 3, 2))
    kw["group_ids"] = kw["group_ids"].float()
    with pytest.raises(CreditInputError, match="group_ids.*integer"):
        CreditBatch(**kw)


GROUP_METHODS = [n for n in tc.list_methods("estimator") if tc.get_method(n).needs_groups]


@pytest.mark.parametrize("spec", GROUP_METHODS)
def test_singleton_group_rejected(spec):
    kw = _kw(make_batch(4, 3, 2))
    kw["group_ids"] = torch.tensor([0, 0, 0, 1])
    with pytest.raises(CreditInputError, match="group_ids.*group 1 with 1"):
        CreditPipeline(spec)(CreditBatch(**kw))


@pytest.mark.parametrize("spec", GROUP_METHODS)
def test_empty_group_rejected(spec):
    batch = make_batch(4, 3, 2, lengths=[2, 1, 0, 0])
    with pytest.raises(CreditInputError, match="response_mask.*no"):
        CreditPipeline(spec)(batch)


@pytest.mark.parametrize("name", [n for n in tc.list_methods() if tc.get_method(n).requires])
def test_missing_signal_names_it(name):
    needed = sorted(tc.get_method(name).requires)
    batch = make_batch(4, 3, 2, signals=[s for s in tc.SIGNALS if s != needed[0]])
    with pytest.raises(CreditInputError, match=f"{needed[0]}.*'{name}'"):
        CreditPipeline(name)(batch)


@pytest.mark.parametrize("name", CALIBRATORS)
def test_calibrator_rejects_wrong_advantage_shape(name):
    info = tc.get_method(name)
    batch = make_batch(4, 3, 2)
    cfg = info.make_config()
    state = info.state_cls(cfg) if info.state_cls else None
    with pytest.raises(CreditInputError, match="advantages"):
        info.fn(batch, torch.zeros(4, 2), cfg, state)


def test_wrong_type_mask():
    with pytest.raises(CreditInputError, match="response_mask.*torch.Tensor"):
        CreditBatch(response_mask=[[1, 1]], rewards=torch.ones(1), group_ids=torch.zeros(1, dtype=torch.long))
