"""The exact tier (tokencredit.analysis.fidelity.exact): V by enumerating every continuation of a restricted policy,
checked against an independent brute-force sum on the tiny model, and scored as a fidelity file
whose split-half reference is exactly 1."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from tokencredit.analysis.fidelity import FidelityConfig, load_estimates, score, token_credit
from tokencredit.analysis.fidelity.exact import (
    RestrictedPolicy,
    digit_vocabulary,
    exact_estimates,
    exact_tree,
    tree_values,
)


@pytest.fixture(scope="module")
def tiny():
    from tokencredit.testing import tiny_model_and_tokenizer

    return tiny_model_and_tokenizer(seed=0, eos_bias=2.0)


def closeness(text, ex):
    """A reward with many levels: 1 for the answer, less the further the number is from it."""
    try:
        return max(0.0, 1.0 - abs(int(text) - int(ex.answer)) / 20)
    except ValueError:
        return 0.0


def _example(q, a):
    return SimpleNamespace(question=q, answer=a, messages=[{"role": "user", "content": q}])


def test_tree_values_equal_a_brute_force_sum_over_every_continuation(tiny):
    model, tok = tiny
    allowed, stop = digit_vocabulary(tok, "0123")
    pol = RestrictedPolicy(model, allowed, stop, temperature=0.8)
    ex = _example("2*6=", "12")
    prompt = tok(tok.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    tree = exact_tree(pol, prompt, 3)
    V = tree_values(tree, allowed, lambda node: closeness(tok.decode(list(node), skip_special_tokens=True), ex))

    def logp(seq):  # log pi_R(seq | prompt), each step from its own forward of the whole prefix
        total = 0.0
        for t, y in enumerate(seq):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq[:t])])).logits[0, -1].double()
            total += float(torch.log_softmax(logits[allowed] / 0.8, -1)[allowed.index(y)])
        return total

    digits = [a for a in allowed if a not in stop]
    leaves = [s + (stop[0],) for n in range(3) for s in itertools.product(digits, repeat=n)]
    leaves += list(itertools.product(digits, repeat=3))  # the budget ends these
    assert len(leaves) == 1 + 4 + 16 + 64 and len(tree) == 1 + 4 + 16
    probs = [math.exp(logp(s)) for s in leaves]
    assert sum(probs) == pytest.approx(1.0, abs=1e-9)
    brute = sum(p * closeness(tok.decode(list(s), skip_special_tokens=True), ex) for p, s in zip(probs, leaves))
    assert V[()] == pytest.approx(brute, abs=1e-6)  # (the tree reuses the prompt's KV cache: float32 rounding)
    # an inner node: the same sum over its own continuations
    node = (digits[1],)
    below = [(s, p) for s, p in zip(leaves, probs) if s[:1] == node]
    pn = sum(p for _, p in below)
    assert V[node] == pytest.approx(sum(p * closeness(tok.decode(list(s), skip_special_tokens=True), ex) for s, p in below) / pn, abs=1e-6)


def test_exact_estimates_score_with_no_noise_ceiling(tiny, tmp_path):
    model, tok = tiny
    exs = [_example("2*6=", "12"), _example("3*3=", "9"), _example("4+4=", "8")]
    est = exact_estimates(model, tok, exs, closeness, samples=4, max_new_tokens=3, temperature=1.0, seed=1)
    torch.save(est, tmp_path / "exact.pt")
    est = load_estimates(tmp_path / "exact.pt")  # a valid estimates file (format, fingerprint)
    assert est["settings"]["exact"] and est["build"]["exact_nodes"] == 3 * (1 + 10 + 100)
    sig = est["rollouts"]["signals"]
    m = sig["response_mask"].bool()
    # the restricted policy's own signals: a distribution over 11 tokens
    assert bool((sig["entropy"][m] <= math.log(11) + 1e-6).all()) and bool((sig["mode_prob"][m] >= 1 / 11 - 1e-6).all())
    assert bool((sig["logprobs"][m] <= torch.log(sig["mode_prob"][m]) + 1e-6).all())
    # sum of squared probabilities (OTB's signal): between the mode's square and the mode
    assert bool((sig["sum_pi_squared"][m] >= sig["mode_prob"][m] ** 2 - 1e-6).all())
    assert bool((sig["sum_pi_squared"][m] <= sig["mode_prob"][m] + 1e-6).all())
    assert bool((sig["sum_pi_squared"][m] >= 1 / 11 - 1e-6).all())
    res = score(est, ["grpo", "oppo", "grpo+taco", "grpo+surprisal", "otb"], cfg=FidelityConfig(n_boot=20))
    rows = {r["method"]: r for r in res["rows"]}
    assert res["skipped"] == []
    # the two "halves" are the same exact V: the noise reference is perfect, nothing is left to noise
    assert rows["split-half"]["rank_corr"]["mean"] == pytest.approx(1.0)
    assert res["perfect_rank_corr"]["all"] == pytest.approx(1.0)
    # credits telescope to R - V(h_0) exactly
    c = token_credit(est)
    V0 = est["samples"][:, 0, 0]
    torch.testing.assert_close(c.sum(1), sig["rewards"] - V0, atol=1e-5, rtol=0)


def test_a_digit_that_is_not_one_token_is_a_one_line_error(tiny):
    _, tok = tiny
    from tokencredit.analysis.fidelity import FidelityError

    with pytest.raises(FidelityError, match=r"vocabulary: expected '12' to be one token"):
        digit_vocabulary(tok, ["1", "12"])


def test_build_exact_refuses_what_it_cannot_honour_in_one_line(tmp_path):
    from tokencredit.analysis.fidelity import main

    with pytest.raises(SystemExit, match=r"^tokencredit fidelity build: --exact: expected --task .*got ROLLOUTS$"):
        main(["build", str(tmp_path), "-o", str(tmp_path / "x.pt"), "--exact"])
    with pytest.raises(SystemExit, match=r"^tokencredit fidelity build: --exact: expected no --lora, --rows or --crn"):
        main(["build", "--task", "mul1", "-o", str(tmp_path / "x.pt"), "--exact", "--crn"])


def test_the_bundled_exact_set():
    """The shipped exact set (docs/fidelity.md): mul1 prompts answered by SmolLM2 restricted to
    the digits and its end token; V is exact, so the split-half reference and the rank correlation
    perfect credit would reach are 1; every response to one prompt starts from the same root V;
    only the methods that need an adapter, a reference or a critic are not scored."""
    from tokencredit.analysis.fidelity import REFERENCE_EXACT

    est = load_estimates(REFERENCE_EXACT)
    assert est["settings"]["exact"] and est["settings"]["M"] == 2
    s = est["samples"]
    assert torch.equal(torch.nan_to_num(s[..., 0], -1.0), torch.nan_to_num(s[..., 1], -1.0))
    g = est["rollouts"]["signals"]["group_ids"]
    for gid in g.unique():
        roots = s[g == gid, 0, 0]
        assert float(roots.max() - roots.min()) < 1e-6
    res = score(est, cfg=FidelityConfig(n_boot=20))
    assert res["perfect_rank_corr"] == {"all": pytest.approx(1.0), "mixed": pytest.approx(1.0)}
    from tokencredit.credit.registry import get_method, list_methods

    circular = {n for n in list_methods() if "true_values" in get_method(n).requires}  # scored by what they read
    sampled = {n for n in list_methods() if "mc_values" in get_method(n).requires}  # need continuation rollouts
    salient = {f"grpo+{n}" for n in list_methods() if "outcome_saliency" in get_method(n).requires}  # need the model
    assert {x["spec"] for x in res["skipped"]} <= ({"gae", "pact", "grpo+arca", "rloo+arca", "grpo+divergence"} | circular
                                                   | sampled | salient)
    assert "otb" in {r["method"] for r in res["rows"]}  # the exact set carries OTB's sum of squared probabilities
    c = token_credit(est)
    sig = est["rollouts"]["signals"]
    torch.testing.assert_close(c.sum(1), sig["rewards"] - s[:, 0, 0], atol=1e-5, rtol=0)
