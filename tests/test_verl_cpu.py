"""The pieces of the verl CPU dry run (``tokencredit.integrations.verl_cpu``) that can be checked
without Ray: the transformers rollout server against an independent forward (sampled tokens'
log-probs, greedy decoding, verl's teacher layout of prompt log-probs, which the oracle pass reads),
the process-group backend fix, and the registrations a ``VERL_PLATFORM=cpu`` process gets.
The whole path, through verl's ``main_ppo``, is tests/test_verl_e2e.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl")

from tokencredit.integrations.hf_server import HFRolloutServer  # noqa: E402
from tokencredit.testing import tiny_model_and_tokenizer  # noqa: E402

RESPONSE, PROMPT = 6, 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tok = tiny_model_and_tokenizer(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # a peaked distribution: greedy and sampling differ visibly
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), model, tok


def _prompts(tok):
    texts = ["3*4=", "12+9=", "7="]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
            for t in texts]


def _ids(x):
    return list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x)


def _forward_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return torch.stack([lp[len(prompt) - 1 + j, t] for j, t in enumerate(response)])


async def _generate_all(server, prompts, params):
    return await asyncio.gather(*(server.generate(prompt_ids=p, sampling_params=dict(params)) for p in prompts))


def test_sampled_tokens_and_their_logprobs_match_an_independent_forward(model_dir):
    path, model, tok = model_dir
    server = HFRolloutServer(path, response_length=RESPONSE, prompt_length=PROMPT)
    prompts = [_ids(p) for p in _prompts(tok)]
    torch.manual_seed(0)
    outs = asyncio.run(_generate_all(server, prompts, {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "logprobs": True}))
    for p, o in zip(prompts, outs):
        assert 1 <= len(o.token_ids) <= RESPONSE and len(o.log_probs) == len(o.token_ids)
        torch.testing.assert_close(torch.tensor(o.log_probs), _forward_logprobs(model, p, o.token_ids, 0.7), atol=1e-4, rtol=1e-4)
        assert o.extra_fields["global_steps"] == 0
    # greedy: each token is the argmax of the forward at its position
    greedy = asyncio.run(_generate_all(server, prompts, {"temperature": 0.0}))
    for p, o in zip(prompts, greedy):
        seq = list(p)
        for t in o.token_ids:
            with torch.no_grad():
                assert t == int(model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(t)


def test_prompt_logprobs_follow_verls_teacher_layout(model_dir):
    """verl's distillation teacher asks for ``prompt_logprobs=0``; the oracle pass reads the rows
    with :func:`oracle.response_logprobs`, which checks the ids: the response's log-probs come out
    equal to an independent forward's."""
    from tokencredit.integrations.verl.oracle import response_logprobs

    path, model, tok = model_dir
    server = HFRolloutServer(path, response_length=RESPONSE, prompt_length=PROMPT)
    prompts = [_ids(p) for p in _prompts(tok)]
    responses = [[5, 9, 13], [20, 2], [7, 7, 7, 7]]
    seqs = [p + r for p, r in zip(prompts, responses)]
    outs = asyncio.run(_generate_all(server, seqs, {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}))
    for p, r, o in zip(prompts, responses, outs):
        ids, lps = torch.tensor(o.extra_fields["prompt_ids"]), torch.tensor(o.extra_fields["prompt_logprobs"])
        assert ids.shape == lps.shape == (len(p) + len(r), 1)
        got = response_logprobs(ids, lps, len(p), torch.tensor(r))
        torch.testing.assert_close(got, _forward_logprobs(model, p, r), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="prompt_logprobs: expected 0"):
        asyncio.run(_generate_all(server, seqs[:1], {"max_tokens": 1, "prompt_logprobs": 5}))


def test_weights_arrive_and_change_generation(model_dir):
    path, model, tok = model_dir
    server = HFRolloutServer(path, response_length=RESPONSE, prompt_length=PROMPT)
    prompt = _ids(_prompts(tok)[0])
    before = asyncio.run(_generate_all(server, [prompt], {"temperature": 0.0}))[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = torch.roll(state["lm_head.weight"], shifts=1, dims=0)  # another argmax everywhere
    assert server.load_weights(state, global_steps=3) == len(state)
    after = asyncio.run(_generate_all(server, [prompt], {"temperature": 0.0}))[0]
    assert after.extra_fields["global_steps"] == 3 and after.token_ids != before.token_ids
    with pytest.raises(ValueError, match="does not have"):
        server.load_weights({"no.such.weight": torch.zeros(1)})


def test_process_group_backend_on_cpu_is_deduplicated():
    from tokencredit.integrations.verl_cpu import _dedup_backend

    assert _dedup_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert _dedup_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert _dedup_backend(None) is None


def test_tokencredit_engine_registered_wherever_verls_fsdp_engine_is():
    from verl.workers.engine.base import EngineRegistry

    from tokencredit.integrations.verl.engine import TokenCreditFSDPEngine, verl_engine_devices

    devices = verl_engine_devices()
    assert {"cuda", "npu"} <= set(devices)
    for backend in ("fsdp", "fsdp2"):
        for key in devices:
            assert EngineRegistry._engines["tokencredit_language_model"][backend][key] is TokenCreditFSDPEngine


def test_cpu_platform_process_gets_platform_engines_and_rollout():
    """A process started as a dry run's (``VERL_USE_EXTERNAL_MODULES``, ``VERL_PLATFORM=cpu``)."""
    code = (
        "from verl.utils.device import get_device_name, get_torch_device, get_nccl_backend\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "import tokencredit.integrations.verl\n"
        "print(get_device_name(), get_nccl_backend(), get_torch_device().memory_allocated())\n"
        "print(EngineRegistry.get_engine_cls('tokencredit_language_model', 'fsdp2').__name__)\n"
        "print(EngineRegistry.get_engine_cls('language_model', 'fsdp2').__name__)\n"
        "print(get_rollout_replica_class('tc_hf').__name__, get_rollout_class('tc_hf', 'async').__name__)\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "tokencredit.integrations.verl_cpu", "VERL_PLATFORM": "cpu",
           "PYTHONWARNINGS": "ignore"}
    env.pop("VERL_ENGINE_DEVICE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()[-4:]
    assert lines == ["cpu gloo 0", "TokenCreditFSDPEngine", "FSDPEngineWithLMHead", "HFReplica HFRolloutAdapter"], lines


@pytest.mark.parametrize("given, expected", [(None, "float32"), ("bfloat16", "bfloat16"), ("bf16", "bfloat16"),
                                             ("fp32", "float32"), (32, "float32"), ("fp16", "float16")])
def test_tc_hf_rollout_generates_in_verls_rollout_dtype(given, expected):
    from tokencredit.integrations.verl_cpu import rollout_dtype

    assert rollout_dtype(given) == expected


def test_tc_hf_rollout_refuses_an_unknown_dtype_in_one_line():
    from tokencredit.integrations.verl_cpu import rollout_dtype

    with pytest.raises(ValueError) as err:
        rollout_dtype("int8")
    msg = str(err.value)
    assert "\n" not in msg and "actor_rollout_ref.rollout.dtype" in msg and "'int8'" in msg and "bfloat16" in msg
