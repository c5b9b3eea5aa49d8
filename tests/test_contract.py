"""The credit contract: spec parsing, composition, configs, state."""

from __future__ import annotations

import math

import pytest
import torch

import tokencredit as tc
from tokencredit import CreditBatch, CreditPipeline, parse_spec

from helpers import make_batch


def test_bare_calibrator_means_its_papers_pairing():
    for name in tc.list_methods("calibrator"):
        info = tc.get_method(name)
        assert [m.name for m in parse_spec(name)] == [info.paired_with, name]
    assert [m.name for m in parse_spec("oppo+stare")] == ["oppo", "stare"]


@pytest.mark.parametrize("bad,match", [
    ("", "credit spec"),
    ("grpo+", "empty method name"),
    ("nope", "unknown credit method 'nope'"),
    ("taco+grpo", "'grpo' is an estimator"),
    ("grpo+rloo", "'rloo' is an estimator"),
    ("grpo+taco+taco", "appears twice"),
])
def test_bad_specs(bad, match):
    with pytest.raises((ValueError, KeyError), match=match):
        parse_spec(bad)


@pytest.mark.parametrize("cal", tc.list_methods("calibrator"))
@pytest.mark.parametrize("est", ["rloo", "oppo"])
def test_composition_equals_applying_the_two_by_hand(est, cal):
    batch = make_batch(8, 6, 4, seed=11)
    e, c = tc.get_method(est), tc.get_method(cal)
    ecfg, ccfg = e.make_config(), c.make_config()
    base = e.fn(batch, ecfg).advantages
    by_hand = c.fn(batch, base, ccfg, c.state_cls(ccfg) if c.state_cls else None).advantages
    out = CreditPipeline(f"{est}+{cal}")(batch)
    torch.testing.assert_close(out.advantages, by_hand)


# ---- every calibrator acts, and in its defining direction ---------------------------------
#
# One group of two responses of 4 tokens: row 0 correct (GRPO A > 0), row 1 wrong (A < 0).
# Each case sets the signals so that the calibrator, at its default config, must change the
# credit, and states how: +1 = |A'| > |A| (more credit or blame), -1 = |A'| < |A|, 0 = unchanged.
# A calibrator registered without a case fails the test.

_L = math.log
_BASE = dict(
    logprobs=[[_L(0.5)] * 4] * 2,
    entropy=[[1.0] * 4] * 2,
    mode_prob=[[0.5] * 4] * 2,
    hidden_residual=[[1.0] * 4] * 2,
    ref_logprobs=[[_L(0.5)] * 4] * 2,
    planning_mask=[[0] * 4] * 2,
    outcome_saliency=[[1.0] * 4] * 2,
)
_CASES = {
    # a tail token (p = 1e-4 where H = 0.1: surprisal beyond the entropy by > log(1/alpha)) with
    # A > 0 loses credit; the same token with A < 0, and every non-tail token, is untouched
    "taco": (
        dict(logprobs=[[_L(1e-4), _L(0.9), _L(0.9), _L(0.9)]] * 2, entropy=[[0.1] * 4] * 2),
        [[-1, 0, 0, 0], [0, 0, 0, 0]],
    ),
    # batch entropy 0.1 < H_target: the gate is on; the top ceil(P |T+|) = 1 most surprising
    # positive token gets W > 1; variant O1 leaves negative credit alone
    "stare": (
        dict(logprobs=[[_L(1e-4), _L(0.9), _L(0.9), _L(0.9)]] * 2, entropy=[[0.1] * 4] * 2),
        [[+1, 0, 0, 0], [0, 0, 0, 0]],
    ),
    # success: the uncertain decision (mode prob 0.5) gets more credit, confident ones less;
    # failure: the confidently sampled mode token (0.99) gets more blame, non-mode tokens less
    "acpo": (
        dict(mode_prob=[[0.5, 0.99, 0.99, 0.99], [0.99, 0.6, 0.6, 0.6]],
             logprobs=[[_L(0.5), _L(0.99), _L(0.99), _L(0.99)], [_L(0.99), _L(0.1), _L(0.1), _L(0.1)]]),
        [[+1, -1, -1, -1], [+1, -1, -1, -1]],
    ),
    # credit (and blame) follows the adapter residual, whatever the sign of A
    "arca": (
        dict(hidden_residual=[[4.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 4.0]]),
        [[+1, -1, -1, -1], [-1, -1, -1, +1]],
    ),
    "surprisal": (
        dict(logprobs=[[_L(0.01), _L(0.5), _L(0.5), _L(0.5)], [_L(0.5), _L(0.5), _L(0.5), _L(0.01)]]),
        [[+1, -1, -1, -1], [-1, -1, -1, +1]],
    ),
    # one entropy spike followed by flat entropy: the spike leads both in H_t and in the
    # entropy reduction max(0, H_t - H_next)
    "entropy": (
        dict(entropy=[[3.0, 0.5, 0.5, 0.5], [0.5, 0.5, 3.0, 0.5]]),
        [[+1, -1, -1, -1], [-1, -1, +1, -1]],
    ),
    # a planning token (strategic gram) gets A + alpha |A|: more credit in the success, less
    # blame in the failure; execution tokens untouched
    "hicra": (
        dict(planning_mask=[[1, 0, 0, 0], [0, 0, 0, 1]]),
        [[+1, 0, 0, 0], [0, 0, 0, -1]],
    ),
    # at the first steps the pooling strength is 0 (delay): GTPO's surprisal weights, the
    # surprising token gains, the others lose, whatever the sign of A
    "sepa": (
        dict(logprobs=[[_L(0.01), _L(0.5), _L(0.5), _L(0.5)], [_L(0.5), _L(0.5), _L(0.5), _L(0.01)]]),
        [[+1, -1, -1, -1], [-1, -1, -1, +1]],
    ),
    # the top ceil(0.2 * 8) = 2 entropy tokens keep their credit, scaled by N / K = 4 (the
    # authors' loss averages over them only); every other token loses it
    "forking": (
        dict(entropy=[[3.0, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 2.0]]),
        [[+1, -1, -1, -1], [-1, -1, -1, +1]],
    ),
    # the most outcome-salient reasoning token (q = 0.8: the top fifth) is boosted, the others
    # suppressed, the response's mass kept; the last (outcome) token is untouched
    "oar": (
        dict(outcome_saliency=[[5.0, 0.0, 0.0, 1.0], [0.0, 0.0, 5.0, 1.0]]),
        [[+1, -1, -1, 0], [-1, -1, +1, 0]],
    ),
    "divergence": (
        dict(ref_logprobs=[[_L(0.5) - 2.0, _L(0.5) - 0.1, _L(0.5) - 0.1, _L(0.5) - 0.1],
                           [_L(0.5) - 0.1, _L(0.5) - 2.0, _L(0.5) - 0.1, _L(0.5) - 0.1]]),
        [[+1, -1, -1, -1], [-1, +1, -1, -1]],
    ),
}


def _case_batch(overrides):
    sig = {k: torch.tensor(overrides.get(k, v), dtype=torch.float64) for k, v in _BASE.items()}
    return CreditBatch(
        response_mask=torch.ones(2, 4, dtype=torch.int64),
        rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
        group_ids=torch.tensor([0, 0]),
        **sig,
    )


@pytest.mark.parametrize("cal", tc.list_methods("calibrator"))
def test_every_calibrator_acts_in_its_defining_direction(cal):
    assert cal in _CASES, f"calibrator {cal!r} has no case here: add a batch on which it must act"
    overrides, want = _CASES[cal]
    batch = _case_batch(overrides)
    base = CreditPipeline("grpo")(batch).advantages
    assert (base[0] > 0).all() and (base[1] < 0).all()
    out = CreditPipeline(f"grpo+{cal}")(batch).advantages
    assert (out * base >= 0).all(), "a calibrator reweights credit, it never flips its sign"
    ratio = out.abs() / base.abs()
    got = torch.where(ratio > 1 + 1e-9, 1, torch.where(ratio < 1 - 1e-9, -1, 0))
    assert got.tolist() == want, f"{cal}: |A'| / |A| = {ratio.tolist()}"


def test_configs_by_dict_and_dataclass_and_errors():
    info = tc.get_method("grpo")
    p = CreditPipeline("grpo", grpo={"std_normalize": False})
    assert p.configs["grpo"].std_normalize is False
    p = CreditPipeline("grpo", grpo=info.config_cls(eps=1e-3))
    assert p.configs["grpo"].eps == 1e-3
    with pytest.raises(ValueError, match=r"grpo config: unknown key\(s\) \['bogus'\]"):
        CreditPipeline("grpo", grpo={"bogus": 1})
    with pytest.raises(ValueError, match="not in credit spec"):
        CreditPipeline("grpo", taco={})
    with pytest.raises(ValueError, match="eps"):
        CreditPipeline("grpo", grpo={"eps": 0.0})


def test_required_signals_are_the_union():
    p = CreditPipeline("oppo+taco")
    assert p.required_signals == tc.get_method("oppo").requires | tc.get_method("taco").requires
    assert CreditPipeline("grpo").required_signals == frozenset()


def test_pipeline_state_round_trip():
    p = CreditPipeline("stare", stare={"adaptive": True})
    batch = make_batch(8, 6, 4, seed=2)
    for _ in range(3):
        p(batch)
    sd = p.state_dict()
    q = CreditPipeline("stare", stare={"adaptive": True})
    assert q.state_dict() != sd
    q.load_state_dict(sd)
    assert q.state_dict() == sd
    torch.testing.assert_close(q(batch, update_state=False).advantages, p(batch, update_state=False).advantages)
    with pytest.raises(KeyError, match="missing"):
        q.load_state_dict({})


def test_metrics_are_namespaced_floats():
    batch = make_batch(8, 6, 4, seed=5)
    for spec in tc.list_methods():
        out = CreditPipeline(spec)(batch)
        for k, v in out.metrics.items():
            assert "/" in k and isinstance(v, float), (spec, k, v)


def _registered_method_bodies():
    """(method name, source file, the registered function's AST) for every built-in method."""
    import ast
    import inspect

    out = []
    for name in tc.list_methods():
        fn = inspect.unwrap(tc.get_method(name).fn)
        path = inspect.getsourcefile(fn)
        tree = ast.parse(open(path).read())
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == fn.__name__)
        out.append((name, path, node))
    return out


def test_a_method_states_its_signals_once_in_its_registration():
    """The decorator's ``requires`` is the one statement of what a method reads: no method body
    repeats it with ``batch.require``."""
    import ast

    repeats = [f"{name} ({path}:{n.lineno})" for name, path, body in _registered_method_bodies()
               for n in ast.walk(body)
               if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "require"]
    assert not repeats, repeats


@pytest.mark.parametrize("name", sorted(m for m in tc.list_methods() if tc.get_method(m).requires))
def test_a_direct_call_without_a_declared_signal_names_it(name):
    """Calling a registered method directly (not through a pipeline) on a batch lacking one of its
    declared signals fails as the pipeline would: a CreditInputError naming the field."""
    info = tc.get_method(name)
    missing = sorted(info.requires)[0]
    batch = make_batch(8, 6, 4, seed=3, signals=sorted(info.requires - {missing}))
    cfg = info.config_cls()
    args = (cfg,) if info.kind == "estimator" else (torch.zeros(batch.mask.shape), cfg, None)
    with pytest.raises(tc.CreditInputError, match=f"{missing}: method '{name}' needs this signal"):
        info.fn(batch, *args)
