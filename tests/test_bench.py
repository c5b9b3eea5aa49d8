"""tokencredit bench: the controlled tasks' exact V against brute force, fork's structure, the oracle estimator's
telescoping credit, the plan's refusal without a response space, the bench's output, its
one-line refusals, and a resumed bench equal to an uninterrupted one."""

from __future__ import annotations

import itertools
import json
from functools import partial

import pytest
import torch

from helpers import InterruptingBench

from tokencredit.analysis import bench
from tokencredit.analysis.bench_policy import bench_policy
from tokencredit.data.controlled import CONTROLLED, REWARDS, build
from tokencredit.engine.exactvalue import ExactValueError, alphabet_ids, batch_true_values, prompt_values

TASKS = ("keytok", "carry", "fork")


def _prompt(tok, ex):
    text = tok.apply_chat_template(list(ex.messages), tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _brute_value(model, tok, ex, prefix, ids, length, reward, temperature):
    """V(prefix): sum over every completion of prod_t pi(y_t | prompt, y_<t) x R, each probability
    from a plain full-vocabulary softmax of one batched forward over whole sequences (no tree, no
    prompt cache, no renormalisation over the alphabet)."""
    prompt = _prompt(tok, ex)
    rest = length - len(prefix)
    if rest == 0:
        return reward(tok.decode(list(prefix)), ex)
    conts = [list(prefix) + list(c) for c in itertools.product(ids, repeat=rest)]
    seqs = torch.tensor([prompt + c for c in conts])
    with torch.no_grad():
        logits = model(input_ids=seqs).logits.double()
    lp = torch.log_softmax(logits / temperature, -1)
    P = len(prompt)
    total = 0.0
    for i, c in enumerate(conts):
        logp = sum(float(lp[i, P - 1 + t, c[t]]) for t in range(len(prefix), length))
        total += float(torch.tensor(logp).exp()) * reward(tok.decode(c), ex)
    return total


@pytest.mark.parametrize("task", TASKS)
def test_exact_values_equal_a_brute_force_sum(task):
    model, tok = bench_policy(task, seed=3, warm=False)
    with torch.no_grad():  # a policy that is not near uniform, so that V varies along a response
        model.lm_head.weight.mul_(10.0)
    space = CONTROLLED[task].space
    ids = alphabet_ids(tok, space)
    _, ev = build(task, 0, 100, 2)
    ex = ev[0]
    prompt = _prompt(tok, ex)
    resp = [ids[space.alphabet.index(ch)] for ch in ex.answer]  # the right response, one token changed
    k = space.length // 2
    resp[k] = ids[(space.alphabet.index(ex.answer[k]) + 1) % len(ids)]
    inp = torch.tensor([prompt + resp])
    V = batch_true_values(model, inp, torch.ones_like(inp), len(prompt), torch.tensor([resp]), torch.ones(1, space.length),
                          torch.tensor([0]), ids, space.length,
                          lambda row, leaves: torch.tensor([REWARDS[task](tok.decode(x), ex) for x in leaves.tolist()]),
                          temperature=0.9)
    brute = [_brute_value(model, tok, ex, resp[:t], ids, space.length, REWARDS[task], 0.9) for t in range(space.length)]
    assert len(set(round(b, 6) for b in brute)) > 1  # the check sees values that differ
    assert V[0].tolist() == pytest.approx(brute, abs=1e-6)
    # prompt_values (the bench's success rate) is the same V(h_0)
    assert float(prompt_values(model, tok, [ex], space, REWARDS[task], temperature=0.9)[0]) == pytest.approx(brute[0], abs=1e-6)


def test_a_policy_with_mass_outside_the_alphabet_is_refused_in_one_line():
    from tokencredit.testing import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(seed=0)
    _, ev = build("keytok", 0, 10, 1)
    with pytest.raises(ExactValueError, match=r"^policy: expected probability <= 1e-06 outside the response alphabet .* got 0\.9"):
        prompt_values(model, tok, ev, CONTROLLED["keytok"].space, REWARDS["keytok"], temperature=1.0)


@pytest.mark.parametrize("task", TASKS)
def test_initial_success_rate_is_between_5_and_50_percent(task, quick):
    from tokencredit.analysis.bench_policy import cached_policy

    model, tok = cached_policy(task, 0, quick[0] / "init")  # the quick bench's seed-0 policy (warm-started once)
    _, ev = build(task, 0, 100, 64)
    v = prompt_values(model, tok, ev, CONTROLLED[task].space, REWARDS[task], temperature=bench.SETTINGS[task].temperature)
    assert 0.05 <= float(v.mean()) <= 0.5


def test_rewards_read_what_the_task_says():
    ex = {e.question: e for e in build("keytok", 0, 100, 100)[1]}["key bab"]
    assert REWARDS["keytok"]("abbaaaba", ex) == 1.0  # positions 1, 4, 6 = b, a, b; the rest free
    assert REWARDS["keytok"]("bbbbabbb", ex) == 1.0
    assert REWARDS["keytok"]("aabaaaba", ex) == 0.0
    ex = {e.question: e for e in build("carry", 0, 100, 100)[1]}["11+01"]  # 3 + 1 = 4 = 100
    assert ex.answer == "011011001"  # column 0: c0=0 x0=1 y0=1 s0=0; column 1: c1=1 x1=1 y1=0 s1=0; c2=1
    assert REWARDS["carry"]("011011001", ex) == 1.0
    assert REWARDS["carry"]("100000101", ex) == 1.0  # every work letter flipped: the work (carries in, digits) is not graded
    assert REWARDS["carry"]("011111001", ex) == 0.0  # s0 wrong
    assert REWARDS["carry"]("011011011", ex) == 0.0  # s1 wrong
    assert REWARDS["carry"]("011011000", ex) == 0.0  # c2 wrong
    assert REWARDS["carry"]("01101100", ex) == 0.0  # not the task's length
    for e in build("carry", 0, 100, 100)[1]:  # every answer is the sum, every written carry the column's
        a, b = (int(x, 2) for x in e.question.split("+"))
        assert int(e.answer[8] + e.answer[7] + e.answer[3], 2) == a + b
        assert e.answer[0] == "0" and int(e.answer[4]) == ((a & 1) + (b & 1)) >> 1
    ex = {e.question: e for e in build("fork", 0, 100, 100)[1]}["fork ca"]
    assert REWARDS["fork"]("cabbca", ex) == 1.0  # the fork (first letter) is the prompt's first letter; the rest free
    assert REWARDS["fork"]("cccccc", ex) == 1.0
    assert REWARDS["fork"]("acccca", ex) == 0.0
    assert REWARDS["fork"]("ccccc", ex) == 0.0  # not the task's length


def test_fork_structure_one_early_choice_decides_and_the_rest_is_free():
    """fork's exact V, against a direct computation: V(h_0) is the policy's probability of the
    right first letter, V after the fork is exactly 1 (right) or 0 (wrong, unreachable), so the
    true credit of every token after the fork is 0; and no policy that ignores the prompt beats
    chance: each letter is the fork of exactly a third of the questions."""
    from tokencredit.credit.methods.oracle import true_credit
    from tokencredit.credit.batch import CreditBatch

    task = "fork"
    space = CONTROLLED[task].space
    assert (space.alphabet, space.length) == ("abc", 6)
    train, ev = build(task, 0, 100, 100)
    assert len(ev) == 9 and sorted(e.answer[0] for e in ev) == sorted("aaabbbccc")
    model, tok = bench_policy(task, seed=2, warm=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    ids = alphabet_ids(tok, space)
    for ex in ev[:3]:
        prompt = _prompt(tok, ex)
        with torch.no_grad():
            first = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
        right = ids[space.alphabet.index(ex.answer[0])]
        for fork in ids:  # one response per fork letter, its free letters drawn at random
            g = torch.Generator().manual_seed(fork)
            resp = [fork] + [ids[int(i)] for i in torch.randint(0, len(ids), (space.length - 1,), generator=g)]
            inp = torch.tensor([prompt + resp])
            V = batch_true_values(model, inp, torch.ones_like(inp), len(prompt), torch.tensor([resp]),
                                  torch.ones(1, space.length), torch.tensor([0]), ids, space.length,
                                  lambda row, leaves: torch.tensor([REWARDS[task](tok.decode(x), ex) for x in leaves.tolist()]),
                                  temperature=1.0)
            assert float(V[0, 0]) == pytest.approx(float(first[right]), abs=1e-6)
            assert 0.01 < float(V[0, 0]) < 0.99  # a policy where the fork is uncertain
            after = 1.0 if fork == right else 0.0
            assert V[0, 1:].tolist() == pytest.approx([after] * (space.length - 1), abs=1e-6)
            r = torch.tensor([REWARDS[task](tok.decode(resp), ex)])
            assert float(r) == after
            c = true_credit(CreditBatch(response_mask=torch.ones(1, space.length, dtype=torch.long), rewards=r,
                                        group_ids=torch.tensor([0]), true_values=V))
            assert c[0, 1:].abs().max() < 1e-6  # the free letters' true credit is 0
            assert float(c[0, 0]) == pytest.approx(after - float(first[right]), abs=1e-6)  # the fork carries it all


def test_carry_structure_a_wrong_answer_bit_decides_and_the_work_is_not_graded():
    """carry's exact V, against what the task says: after a wrong answer bit (s0, s1 or c2) V is
    exactly 0 for the rest of the response (success unreachable), and the value of a prefix does
    not depend on the reward reading the work: a response with the right answer and wrong work has
    V = 1 at its end, and before its last answer bit V equals the policy's probability of that bit."""
    from tokencredit.data.controlled import CARRY_ANSWER

    task = "carry"
    space = CONTROLLED[task].space
    assert (space.alphabet, space.length, CARRY_ANSWER) == ("01", 9, (3, 7, 8))
    model, tok = bench_policy(task, seed=2, warm=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    ids = alphabet_ids(tok, space)
    ex = {e.question: e for e in build(task, 0, 100, 100)[1]}["10+11"]  # 2 + 3 = 5 = 101
    prompt = _prompt(tok, ex)

    def values(resp_text):
        resp = [ids[space.alphabet.index(ch)] for ch in resp_text]
        inp = torch.tensor([prompt + resp])
        return batch_true_values(model, inp, torch.ones_like(inp), len(prompt), torch.tensor([resp]),
                                 torch.ones(1, space.length), torch.tensor([0]), ids, space.length,
                                 lambda row, leaves: torch.tensor([REWARDS[task](tok.decode(x), ex) for x in leaves.tolist()]),
                                 temperature=1.0)[0], resp

    assert ex.answer == "001101101"  # column 0: c0=0 x0=0 y0=1 s0=1; column 1: c1=0 x1=1 y1=1 s1=0; c2=1
    for pos in CARRY_ANSWER:  # one wrong answer bit: V is 0 from the step after it on
        wrong = list(ex.answer)
        wrong[pos] = "1" if wrong[pos] == "0" else "0"
        V, _ = values("".join(wrong))
        assert 0.0 < float(V[pos]) < 1.0
        assert V[pos + 1:].tolist() == pytest.approx([0.0] * (space.length - pos - 1), abs=1e-9)
    text = "110" + ex.answer[3] + "100" + ex.answer[7:]  # right answer, wrong work
    assert text != ex.answer and REWARDS[task](text, ex) == 1.0
    V, resp = values(text)
    with torch.no_grad():
        last = torch.softmax(model(input_ids=torch.tensor([prompt + resp[:8]])).logits[0, -1].double(), -1)
    assert float(V[8]) == pytest.approx(float(last[resp[8]]), abs=1e-6)


def _credit_batch(B=5, T=6, seed=0):
    from tokencredit.credit.batch import CreditBatch

    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([6, 3, 1, 6, 4])
    mask = (torch.arange(T).unsqueeze(0) < lens.unsqueeze(1)).long()
    return CreditBatch(response_mask=mask, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]),
                       group_ids=torch.tensor([0, 0, 0, 1, 1]), true_values=torch.rand(B, T, generator=g))


@pytest.mark.parametrize("normalize", ["none", "group", "batch"])
def test_oracle_credit_telescopes_to_reward_minus_v0(normalize):
    from tokencredit.credit.methods.oracle import OracleConfig, oracle, true_credit

    cb = _credit_batch()
    out = oracle(cb, OracleConfig(normalize=normalize))
    c = true_credit(cb)
    assert (c.sum(1) - (cb.rewards - cb.true_values[:, 0])).abs().max() < 1e-6
    assert (out.advantages[~cb.mask] == 0).all()
    if normalize == "none":
        assert torch.allclose(out.advantages, c)
    else:  # a positive scale per row: the credit's placement is unchanged
        ratio = out.advantages[cb.mask] / c[cb.mask]
        assert (ratio > 0).all()
    # the credit of a middle token is the value's step
    assert float(c[0, 2]) == pytest.approx(float(cb.true_values[0, 3] - cb.true_values[0, 2]))


def test_plan_refuses_oracle_without_a_response_space():
    from tokencredit.train.config import ConfigError, ModelConfig, TaskConfig, TrainConfig
    from tokencredit.credit.plan import PlanError, plan_signals
    from tokencredit.credit.spec import CreditPipeline
    from tokencredit.train.trainer import Trainer

    with pytest.raises(PlanError, match="oracle reads true_values .* expected a task with a response space"):
        plan_signals(CreditPipeline("oracle"), lora=False)
    assert plan_signals(CreditPipeline("oracle"), lora=False, enumerable=True).passes == ("policy", "enumeration")
    with pytest.raises(ConfigError, match="true_values"):  # before any model loads
        Trainer(TrainConfig(credit="oracle", model=ModelConfig(name="no/such-model"), task=TaskConfig(name="mul1")))


# ---------------------------------------------------------------------------------------
# the bench


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_quick")
    result = bench.run_bench(quick=True, specs=bench.QUICK_SPECS, seeds=bench.QUICK_SEEDS, output_dir=out, workers=1, progress=False)
    return out, result


def test_quick_bench_writes_a_report_with_every_task_and_spec(quick):
    out, result = quick
    assert len(result["runs"]) == 3 * 2 * 2 and set(result["runs"].values()) == {"started"}
    report = (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == list(TASKS)
    for t in TASKS:
        assert f"## {t}" in report and (out / "plots" / f"{t}.png").stat().st_size > 1000
        s = summary[t]
        assert s["seeds"] == [0, 1] and s["budget"] == bench.QUICK_STEPS
        assert set(s["specs"]) == {"grpo", "oracle"}
        assert "headroom" in s["specs"]["oracle"] and "auc_vs_grpo" in s["specs"]["oracle"]
        for r in s["specs"].values():
            lo_est_hi = r["auc"]
            assert lo_est_hi[1] <= lo_est_hi[0] <= lo_est_hi[2]
            # paired seeds: every spec of a seed starts from the same policy
        assert s["specs"]["grpo"]["initial"] == s["specs"]["oracle"]["initial"]
        assert sorted(map(int, s["specs"]["oracle"]["curve"])) == [0, 3, 6]


def test_a_kept_checkpoint_changed_since_it_was_written_is_refused_in_one_line(quick, tmp_path):
    """The kept weights are read as the trainer's checkpoints are: one changed byte (its sha256) or
    a weight of another shape is refused, naming the file, before anything is loaded."""
    import shutil

    from tokencredit.analysis.bench_policy import bench_policy
    from tokencredit.errors import CheckpointError

    out, _ = quick
    run = tmp_path / "run"
    shutil.copytree(out / TASKS[0] / "grpo" / "seed1", run)
    model, _ = bench_policy(TASKS[0], 1, warm=False)
    bench.load_kept(model, run, 3)  # as kept: loads
    f = bench.kept_path(run, 3) / "state.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        bench.load_kept(model, run, 3)
    assert "\n" not in str(err.value) and "sha256" in str(err.value) and str(f) in str(err.value)
    small = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError) as err:
        bench.load_kept(small, run, 0)
    assert "\n" not in str(err.value) and "expected" in str(err.value)


def test_a_bench_keeps_the_weights_of_its_fixed_steps_and_only_those(quick):
    """Every run keeps its policy at kept_steps() (quick: 0, 3, 6; the full budget: 0, 10, ..., 40),
    fixed before the runs: step 0 is the seed's initial policy, the last step the final checkpoint's."""
    from tokencredit.train.checkpoint import load_latest_checkpoint

    assert bench.kept_steps("carry") == [0, 10, 20, 30, 40]
    assert bench.kept_steps("fork", quick=True) == [0, 3, 6]
    out, _ = quick
    for t in TASKS:
        init = torch.load(out / "init" / f"{t}_seed1.pt", weights_only=True)
        for spec in bench.QUICK_SPECS:
            run = out / t / spec / "seed1"
            kept = sorted(p.name for p in (run / bench.KEPT_DIR).iterdir())
            assert kept == [f"step_{k:08d}" for k in (0, 3, 6)]
            k0 = bench.kept_weights(run, 0)
            assert all(torch.equal(k0[k], init[k]) for k in init)
            k6 = bench.kept_weights(run, 6)
            _, sd = load_latest_checkpoint(run / "checkpoints")
            assert all(torch.equal(k6[k], v) for k, v in sd["model"].items())
            k3 = bench.kept_weights(run, 3)
            assert not all(torch.equal(k3[k], k0[k]) for k in k0) and not all(torch.equal(k3[k], k6[k]) for k in k0)


def test_quick_bench_success_is_the_exact_value_of_the_trained_policy(quick):
    """The logged success of an oracle run's last step is V(h_0) of its final weights, which
    equals the brute-force sum."""
    from tokencredit.train.checkpoint import load_latest_checkpoint
    from tokencredit.analysis.compare import read_metrics

    out, _ = quick
    run = out / "keytok" / "oracle" / "seed1"
    rows = read_metrics(run / "metrics.jsonl")
    logged = rows[-1]["bench/success"]
    model, tok = bench_policy("keytok", 1, warm=False)
    _, sd = load_latest_checkpoint(run / "checkpoints")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, v in sd["model"].items():
            params[n].copy_(v)
    _, ev = build("keytok", 1, 100, 64)
    ids = alphabet_ids(tok, CONTROLLED["keytok"].space)
    brute = sum(_brute_value(model, tok, e, [], ids, 8, REWARDS["keytok"], 1.0) for e in ev) / len(ev)
    assert logged == pytest.approx(brute, abs=1e-6)
    assert rows[0]["bench/success"] != pytest.approx(logged, abs=1e-4)  # the oracle's run changed the policy


@pytest.mark.parametrize("kw, msg", [
    (dict(tasks="keytok,mul1"), r"^--tasks: expected tasks among \['keytok', 'carry', 'fork'\] .* got 'mul1'$"),
    (dict(specs="grpo,oracle,nosuch"), r"^--credit: bad credit spec 'nosuch': unknown credit method 'nosuch'"),
    (dict(specs="grpo,rloo"), r"^--credit: expected grpo and oracle among the specs"),
    (dict(steps=3), r"^--steps: expected a budget of at least 2 evals \(10 steps on keytok\), got 3$"),
    (dict(specs="grpo,oracle,grpo+arca"), r"^--credit: grpo\+arca cannot run on keytok: credit 'grpo\+arca': arca reads "
                                          r"the LoRA adapter's effect; expected a model with a LoRA adapter"),
])
def test_bad_input_is_refused_in_one_line_before_any_run(tmp_path, kw, msg):
    args = dict(tasks="keytok", specs="grpo,oracle", seeds="0", output_dir=tmp_path / "b", workers=1, progress=False)
    args.update(kw)
    with pytest.raises(bench.BenchError, match=msg):
        bench.run_bench(**args)
    assert not (tmp_path / "b" / "keytok").exists()


def test_cli_refusal_is_one_line_with_exit_2(tmp_path, capsys):
    from tokencredit.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--tasks", "nosuch", "--output-dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tokencredit bench: --tasks: expected tasks among ['keytok', 'carry', 'fork'] (enumerable, controlled), got 'nosuch'"]


def test_a_resumed_bench_equals_an_uninterrupted_one(tmp_path):
    from tokencredit.analysis.compare import read_metrics

    kw = dict(tasks="keytok", specs="grpo,oracle", seeds="0", quick=True, progress=False, workers=1)
    whole = bench.run_bench(output_dir=tmp_path / "whole", **kw)
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(output_dir=tmp_path / "cut", trainer_factory=InterruptingBench(str(tmp_path / "cut" / "init"), "oracle", once=True), **kw)
    cut_rows = read_metrics(tmp_path / "cut" / "keytok" / "oracle" / "seed0" / "metrics.jsonl")
    assert 0 < max(r["step"] for r in cut_rows) < bench.QUICK_STEPS
    resumed = bench.run_bench(output_dir=tmp_path / "cut", **kw)
    assert resumed["runs"][("keytok", "grpo", 0)] == "skipped" and resumed["runs"][("keytok", "oracle", 0)] == "resumed"
    keys = ("bench/success", "reward", "eval/greedy_acc")
    for spec in ("grpo", "oracle"):
        a = read_metrics(tmp_path / "whole" / "keytok" / spec / "seed0" / "metrics.jsonl")
        b = read_metrics(tmp_path / "cut" / "keytok" / spec / "seed0" / "metrics.jsonl")
        assert [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]
    assert json.loads((tmp_path / "whole" / "summary.json").read_text()) == json.loads((tmp_path / "cut" / "summary.json").read_text())
    for spec in ("grpo", "oracle"):  # the kept weights along the run too
        a, b = (sorted((tmp_path / d / "keytok" / spec / "seed0" / bench.KEPT_DIR).glob("step_*")) for d in ("whole", "cut"))
        assert [p.name for p in a] == [p.name for p in b] == ["step_00000000", "step_00000003", "step_00000006"]
        for k in (0, 3, 6):
            sx, sy = (bench.kept_weights(tmp_path / d / "keytok" / spec / "seed0", k) for d in ("whole", "cut"))
            assert sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sx)
    assert whole["summary"]["keytok"]["specs"]["oracle"]["auc"][0] == resumed["summary"]["keytok"]["specs"]["oracle"]["auc"][0]


def test_summary_measures_on_known_curves():
    """AUC is the trapezoid mean, headroom (spec - grpo) / (oracle - grpo) per the paired seeds,
    steps to threshold the first eval at or above it (the budget when never)."""
    def rows(vals):
        return [{"step": s, "bench/success": v, "eval/greedy_acc": v} for s, v in zip((0, 5, 10), vals)]

    res = {
        "grpo": {0: rows([0.1, 0.1, 0.1]), 1: rows([0.1, 0.1, 0.3])},
        "oracle": {0: rows([0.1, 0.5, 0.9]), 1: rows([0.1, 0.7, 0.9])},
        "rloo": {0: rows([0.1, 0.3, 0.5]), 1: rows([0.1, 0.4, 0.6])},
    }
    s = bench.summarize_task(res, threshold=0.5, budget=10)
    auc = {k: s["specs"][k]["per_seed_auc"] for k in res}
    assert auc["grpo"] == pytest.approx([0.1, 0.15]) and auc["oracle"] == pytest.approx([0.5, 0.6])
    assert auc["rloo"] == pytest.approx([0.3, 0.375])
    assert s["specs"]["rloo"]["headroom"][0] == pytest.approx((0.3375 - 0.125) / (0.55 - 0.125))
    assert s["specs"]["oracle"]["steps_to"][0] == pytest.approx(5.0) and s["specs"]["oracle"]["reached"] == 2
    assert s["specs"]["grpo"]["steps_to"][0] == pytest.approx(10.0) and s["specs"]["grpo"]["reached"] == 0
    lo, hi = s["specs"]["rloo"]["auc_vs_grpo"][1:]
    assert lo <= 0.2125 <= hi


def test_headroom_is_not_reported_where_oracle_does_not_separate_from_grpo():
    def rows(vals):
        return [{"step": s, "bench/success": v} for s, v in zip((0, 5, 10), vals)]

    same = {k: {0: rows([0.1, 0.2, 0.3]), 1: rows([0.1, 0.3, 0.2]), 2: rows([0.1, 0.2, 0.2])} for k in ("grpo", "oracle", "rloo")}
    same["oracle"][1] = rows([0.1, 0.2, 0.2])
    s = bench.summarize_task(same, threshold=0.5, budget=10)
    text = bench.render_bench_report({"keytok": s}, {}, {})
    assert "n/a (oracle ~ grpo)" in text and "the interval includes 0" in text


def test_a_zero_width_interval_at_zero_is_not_called_a_separation():
    """Oracle and GRPO equal to 1e-5 on every seed (what `--quick`'s 6 steps can give): the
    interval is [0.000, 0.000] when printed and must read "no difference on any seed", with the
    headroom n/a; a clear difference still reads as a separation."""
    def rows(vals):
        return [{"step": s, "bench/success": v} for s, v in zip((0, 3, 6), vals)]

    res = {"grpo": {k: rows([0.1, 0.1 + 0.01 * k, 0.1]) for k in range(3)},
           "oracle": {k: rows([0.1, 0.1 + 0.01 * k + 1e-5 * (k + 1), 0.1]) for k in range(3)}}
    s = bench.summarize_task(res, threshold=0.5, budget=6)
    assert s["specs"]["oracle"]["auc_vs_grpo"][1] > 0  # the raw interval excludes 0 ...
    assert bench.oracle_separation(s) == "no difference"  # ... but by nothing a seed can show
    text = bench.render_bench_report({"keytok": s}, {}, {})
    assert "0.000 [0.000, 0.000]" in text and "no difference on any seed" in text
    assert "excludes 0" not in text and "n/a (oracle ~ grpo)" in text
    res["oracle"] = {k: rows([0.1, 0.3 + 0.01 * k, 0.5]) for k in range(3)}
    s = bench.summarize_task(res, threshold=0.5, budget=6)
    assert bench.oracle_separation(s) == "separates"
    assert "the interval excludes 0: the task measures credit." in bench.render_bench_report({"keytok": s}, {}, {})
