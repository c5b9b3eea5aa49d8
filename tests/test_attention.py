"""engine.attention: the rollout copy's decode attention equals transformers' sdpa attention."""

import types

import pytest
import torch

from tokencredit.engine.attention import GROUPED, grouped_decode_attention, use_grouped_decode
from tokencredit.engine.rollout import HFRollout
from tokencredit.testing import tiny_model_and_tokenizer

sdpa_attention_forward = pytest.importorskip("transformers.integrations.sdpa_attention").sdpa_attention_forward


def _inputs(B, H, kv_heads, q, L, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, H, q, d, generator=g, dtype=torch.float64)
    key = torch.randn(B, kv_heads, L, d, generator=g, dtype=torch.float64)
    value = torch.randn(B, kv_heads, L, d, generator=g, dtype=torch.float64)
    module = types.SimpleNamespace(num_key_value_groups=H // kv_heads, is_causal=True, training=False)
    return module, query, key, value


def _bool_mask(B, q, L):
    mask = torch.ones(B, 1, q, L, dtype=torch.bool)
    mask[0, ..., :3] = False  # a left-padded row
    mask[1, ..., 1] = False
    return mask


@pytest.mark.parametrize("kv_heads", [1, 2, 6])  # 6 query heads in groups of 6, 3 and 1
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_one_query_token_equals_sdpa(kv_heads, mask_kind):
    B, H, L = 3, 6, 11
    module, query, key, value = _inputs(B, H, kv_heads, 1, L)
    mask = {"bool": _bool_mask(B, 1, L), "none": None}.get(mask_kind)
    if mask_kind == "float":
        mask = torch.where(_bool_mask(B, 1, L), 0.0, -0.7 * torch.arange(L, dtype=torch.float64))
    for scaling in (None, 0.3):
        want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)
        got, weights = grouped_decode_attention(module, query, key, value, mask, scaling=scaling)
        assert weights is None and got.shape == (B, 1, H, 8)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_more_than_one_query_token_is_sdpas():
    B, H, q, L = 2, 6, 4, 9
    module, query, key, value = _inputs(B, H, 2, q, L)
    mask = _bool_mask(B, q, L)
    want, _ = sdpa_attention_forward(module, query, key, value, mask)
    got, _ = grouped_decode_attention(module, query, key, value, mask)
    assert torch.equal(got, want)


def test_only_a_model_running_sdpa_through_transformers_dispatch_is_switched():
    class Plain(torch.nn.Module):
        pass

    assert use_grouped_decode(Plain()) is False
    model, _ = tiny_model_and_tokenizer()
    model.set_attn_implementation("eager")  # e.g. a model whose extras only eager computes
    assert use_grouped_decode(model) is False and model.config._attn_implementation == "eager"
    model.set_attn_implementation("sdpa")
    assert use_grouped_decode(model) is True and model.config._attn_implementation == GROUPED


def test_the_cpu_copy_decodes_with_it_and_samples_what_the_model_does():
    """A float64 rollout copy (grouped decode) against the float64 model itself (sdpa): the same tokens
    and log-probs, greedy and sampled with one seed, on left-padded prompts of different lengths."""
    model, tok = tiny_model_and_tokenizer(seed=3)
    model = model.double()
    prompts = [[{"role": "user", "content": "12+3"}], [{"role": "user", "content": "what is 7 times 8?"}]]
    ref, copy = HFRollout(model, tok), HFRollout(model, tok, dtype=torch.float64)
    gen = copy.generation_model()
    assert gen is not model and gen.config._attn_implementation == GROUPED
    assert model.config._attn_implementation != GROUPED  # the trainer's model keeps its attention
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, "num_samples": 3, "seed": 5}):
        a = ref.generate(prompts, max_new_tokens=12, **kwargs)
        b = copy.generate(prompts, max_new_tokens=12, **kwargs)
        assert torch.equal(a.response_ids, b.response_ids)
        assert a.response_mask.sum() > 2 * len(a.response_mask)  # more than a token or two per row
        torch.testing.assert_close(b.behaviour_logprobs, a.behaviour_logprobs, rtol=0, atol=1e-10)
