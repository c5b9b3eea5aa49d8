"""forward_response: the shared-prompt pass equals the plain pass (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from tokencredit.engine.forward import distinct_rows, forward_response
from tokencredit.testing import tiny_model_and_tokenizer

P, T = 6, 5


def _batch(pad_id: int):
    """Six rows: two prompts x three responses; prompt 0 left-padded, one response ends early."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 20, (6, P + T), generator=g)
    att = torch.ones_like(ids)
    ids[1:3, :P] = ids[0, :P]
    ids[4:6, :P] = ids[3, :P]
    ids[0:3, :2] = pad_id
    att[0:3, :2] = 0
    att[1, P + 3 :] = 0  # an EOS at response token 2: the rest is padding
    return ids, att


def _run(model, ids, att, *, share, hidden):
    model.zero_grad(set_to_none=True)
    h, logits = forward_response(model, ids, att, P, hidden=hidden, share_prompts=share)
    m = att[:, P:].float()
    loss = (logits.log_softmax(-1)[..., 5] * m).sum()
    if hidden:
        loss = loss + (h[:, :-1].pow(2).sum(-1) * m).sum() + h[:, 0].sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return (None if h is None else h.detach()), logits.detach(), grads


@pytest.mark.parametrize("hidden", [False, True])
def test_shared_prompt_pass_equals_plain_pass(hidden):
    model, tok = tiny_model_and_tokenizer(seed=0)
    ids, att = _batch(tok.pad_token_id)
    h1, l1, g1 = _run(model, ids, att, share=False, hidden=hidden)
    h2, l2, g2 = _run(model, ids, att, share=True, hidden=hidden)
    assert l2.shape == (6, T, model.config.vocab_size)
    m = att[:, P:].bool()
    torch.testing.assert_close(l2[m], l1[m], atol=1e-5, rtol=0)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    if hidden:
        assert h2.shape == (6, T + 1, model.config.hidden_size)
        hm = torch.cat([torch.ones(6, 1, dtype=torch.bool), m], 1)
        torch.testing.assert_close(h2[hm], h1[hm], atol=1e-5, rtol=0)


def test_logits_are_the_models_own_at_response_positions():
    model, tok = tiny_model_and_tokenizer(seed=1)
    ids, att = _batch(tok.pad_token_id)
    pos = (att.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, P - 1 : P - 1 + T]
        last = model.model(input_ids=ids, attention_mask=att, position_ids=pos).last_hidden_state[:, P - 1 :]
        m = att[:, P:].bool()
        hm = torch.cat([torch.ones(6, 1, dtype=torch.bool), m], 1)
        for share in (False, True):
            h, logits = forward_response(model, ids, att, P, hidden=True, share_prompts=share)
            torch.testing.assert_close(logits[m], ref[m], atol=1e-5, rtol=0)
            # the states the value head reads are the final (normed) ones
            torch.testing.assert_close(h[hm], last[hm], atol=1e-5, rtol=0)


def test_post_head_transforms_are_kept():
    """Gemma-2 soft-caps its logits after the head: a decoder+head shortcut would lose that."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, final_logit_softcapping=0.1, pad_token_id=0,
    )
    model = Gemma2ForCausalLM(cfg).eval()
    ids, att = _batch(0)
    with torch.no_grad():
        for share in (False, True):
            _, logits = forward_response(model, ids, att, P, share_prompts=share)
            m = att[:, P:].bool()
            assert logits[m].abs().max() <= 0.1 + 1e-6  # capped at final_logit_softcapping
            pos = (att.cumsum(-1) - 1).clamp_min(0)
            ref = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, P - 1 : P - 1 + T]
            torch.testing.assert_close(logits[m], ref[m], atol=1e-5, rtol=0)


def test_one_token_responses_and_distinct_prompts():
    model, tok = tiny_model_and_tokenizer(seed=2)
    ids, att = _batch(tok.pad_token_id)
    short, short_att = ids[:, : P + 1], att[:, : P + 1]
    with torch.no_grad():
        h, l1 = forward_response(model, short, short_att, P, hidden=True)
        _, l0 = forward_response(model, short, short_att, P, share_prompts=False)
    assert l1.shape == (6, 1, model.config.vocab_size) and h.shape == (6, 2, model.config.hidden_size)
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=0)
    assert distinct_rows(ids[[0, 3], :P], att[[0, 3], :P]) is None  # nothing repeats: no sharing


def test_distinct_rows_maps_every_row_to_its_first_copy():
    ids = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4], [1, 2]])
    mask = torch.ones_like(ids)
    mask[4, 0] = 0  # same ids, other mask: a different prompt
    first, inverse = distinct_rows(ids, mask)
    assert len(first) == 3
    torch.testing.assert_close(ids[first][inverse], ids)
    torch.testing.assert_close(mask[first][inverse], mask)
    assert sorted(first.tolist()) == [0, 1, 4]


def test_bad_prompt_len_is_named():
    model, tok = tiny_model_and_tokenizer(seed=0)
    ids, att = _batch(tok.pad_token_id)
    with pytest.raises(ValueError, match="prompt_len: expected 1 <= prompt_len < 11"):
        forward_response(model, ids, att, P + T)


def test_prompt_pass_feeds_the_lm_head_a_contiguous_input_for_a_frozen_model():
    # transformers' logits_to_keep=1 slices hidden[:, -1:, :], a strided view; for weights that
    # do not require grad (a frozen reference or teacher, the rollout's bf16 copy) torch.matmul
    # then runs the head as a bmm over the weight expanded to every row (a rows x vocab x hidden
    # copy, most of a 128-row rollout's time). prompt_cache must hand the head a contiguous input.
    from tokencredit.engine.forward import prompt_cache

    model, tok = tiny_model_and_tokenizer(seed=0)
    model.requires_grad_(False)
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda mod, args: seen.append(args[0].is_contiguous()))
    try:
        ids = torch.randint(3, 60, (3, 7))
        att = torch.ones_like(ids)
        att[0, :2] = 0  # left padding on one row
        with torch.no_grad():
            out, cache = prompt_cache(model, ids, att, torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1, 2]))
    finally:
        hook.remove()
    assert seen == [True]
    assert out.logits.shape[:2] == (3, 1)
    # the logits are the last position's, as before
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp_min(0)).logits[:, -1:]
    torch.testing.assert_close(out.logits, full, atol=1e-5, rtol=1e-5)


# -- length buckets: the responses' pass cut to each group's own length ------------------------

LENS = [10, 3, 2, 1, 5, 4, 10, 9, 0, 2, 3, 1]  # the README job's spread: a few at the budget, most short


def _uneven_batch(pad_id: int, T: int = 10):
    """Twelve rows: three prompts (two left-padded) x four responses of lengths ``LENS``."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 60, (3, P), generator=g)
    pm = torch.ones(3, P, dtype=torch.long)
    pm[0, :2] = 0
    pm[2, :1] = 0
    prompts[pm == 0] = pad_id
    lens = torch.tensor(LENS)
    rm = (torch.arange(T) < lens[:, None]).long()
    resp = torch.randint(3, 60, (12, T), generator=g)
    resp[rm == 0] = pad_id
    return torch.cat([prompts.repeat_interleave(4, 0), resp], 1), torch.cat([pm.repeat_interleave(4, 0), rm], 1)


def _positions_run(model):
    """A list that records how many token positions each model call embeds."""
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda mod, args, out: seen.append(args[0].numel()))
    return seen


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("hidden", [False, True])
def test_length_buckets_equal_the_padded_pass_where_rows_attend(share, hidden):
    # float64: the two passes agree to ~1e-15 (fp32's ~1e-7 relative rounding, summed over a
    # gradient, would need a tolerance that a small slip could hide in)
    model, tok = tiny_model_and_tokenizer(seed=3)
    model.train().double()
    ids, att = _uneven_batch(tok.pad_token_id)
    T = ids.shape[1] - P
    runs = {}
    for buckets in (False, True):
        model.zero_grad(set_to_none=True)
        seen = _positions_run(model)
        h, logits = forward_response(model, ids, att, P, hidden=hidden, share_prompts=share, buckets=buckets)
        m = att[:, P:].double()
        loss = (logits.log_softmax(-1)[..., 5] * m).sum()
        if hidden:  # every state a value head reads: before each response token and after the last one
            hm = torch.cat([torch.ones(12, 1, dtype=torch.double), m], 1)
            loss = loss + (h.pow(2).sum(-1) * hm).sum()
        loss.backward()
        runs[buckets] = (h, logits, [p.grad.clone() for p in model.parameters()], sum(seen))
        model.get_input_embeddings()._forward_hooks.clear()
    (h0, l0, g0, n0), (h1, l1, g1, n1) = runs[False], runs[True]
    assert l1.shape == l0.shape == (12, T, model.config.vocab_size)
    m = att[:, P:].bool()
    torch.testing.assert_close(l1[m], l0[m], atol=1e-12, rtol=0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-12 * float(a.abs().max()), rtol=0)
    if hidden:
        hm = torch.cat([torch.ones(12, 1, dtype=torch.bool), m], 1)
        assert h1.shape == h0.shape
        torch.testing.assert_close(h1[hm], h0[hm], atol=1e-12, rtol=0)
    # the padding is not computed: fewer positions run through the model
    padded = (3 if share else 12) * P + 12 * T
    assert n0 == padded and n1 < 0.75 * n0, (n0, n1)
    # past a row's group's length the logits are 0, never another row's
    assert (l1[~m].abs().sum(-1) == 0).any()


def test_a_batch_without_padding_gives_the_padded_pass_bit_for_bit():
    model, tok = tiny_model_and_tokenizer(seed=0)
    ids, att = _batch(tok.pad_token_id)
    att[1, P + 3 :] = 1  # every response full length: nothing to cut
    with torch.no_grad():
        _, a = forward_response(model, ids, att, P, buckets=True)
        _, b = forward_response(model, ids, att, P, buckets=False)
    assert torch.equal(a, b)  # bit for bit: the same single pass


@pytest.mark.parametrize("share", [True, False])
def test_rows_of_one_length_run_as_one_group_cut_to_it(share):
    """Every response ends at token 3 of 5: one group, cut to 3, on the prompts' own cache."""
    model, tok = tiny_model_and_tokenizer(seed=0)
    model.double()
    ids, att = _batch(tok.pad_token_id)
    att[:, P + 3 :] = 0
    with torch.no_grad():
        seen = _positions_run(model)
        h1, a = forward_response(model, ids, att, P, hidden=True, share_prompts=share, buckets=True)
        model.get_input_embeddings()._forward_hooks.clear()
        h0, b = forward_response(model, ids, att, P, hidden=True, share_prompts=share, buckets=False)
    m = att[:, P:].bool()
    torch.testing.assert_close(a[m], b[m], atol=1e-12, rtol=0)
    torch.testing.assert_close(h1[:, :4], h0[:, :4], atol=1e-12, rtol=0)
    assert sum(seen) == (2 if share else 6) * P + 6 * 3  # the 2 padded positions of every row not run
    assert (a[:, 3:] == 0).all()


def _split_cost(groups, lengths, per_row, overhead):
    return sum(len(g) * (per_row + max(lengths[i] for i in g)) + overhead for g in groups)


def test_length_buckets_is_the_cheapest_split():
    from itertools import combinations

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tokencredit.engine.forward import length_buckets

    def partitions(items):
        if not items:
            yield []
            return
        head, rest = items[0], items[1:]
        for k in range(len(rest) + 1):
            for others in combinations(rest, k):
                left = [x for x in rest if x not in others]
                for p in partitions(left):
                    yield [[head, *others], *p]

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(0, 20), st.integers(0, 30))
    def check(lengths, per_row, overhead):
        groups = length_buckets(lengths, per_row=per_row, overhead=overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row once
        best = min(_split_cost(p, lengths, per_row, overhead) for p in partitions(list(range(len(lengths)))))
        assert _split_cost(groups, lengths, per_row, overhead) == best

    check()
