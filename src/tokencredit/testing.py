"""A tiny random chat model for tests: a 2-layer Llama with a character-level tokenizer.

Built in code (no download, no file), in well under a second, so every trainer test can run
the real loop -- chat template, left-padded generation, EOS handling, LoRA -- on a CPU.

    model, tok = tiny_model_and_tokenizer(seed=0)
    HFRollout(model, tok).generate([[{"role": "user", "content": "2+3="}]], num_samples=4, ...)

The tokenizer mirrors SmolLM2-135M-Instruct's special tokens: bos ``<|im_start|>`` (id 1),
eos = pad ``<|im_end|>`` (id 2), and a ChatML chat template, so code written against the tiny
model meets the same token layout as with the embedded default model.
"""

from __future__ import annotations

import string
from typing import Tuple

import torch

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "tiny_model_and_tokenizer", "tiny_tokenizer"]

# <unk> takes id 0 (SmolLM2 has <|endoftext|> there) so that bos/eos keep SmolLM2's ids 1 and 2.
SPECIAL_TOKENS = ("<unk>", "<|im_start|>", "<|im_end|>")
# Every printable ASCII character: digits, letters, space, newline and all punctuation, which
# covers the arithmetic / word-problem prompts and the role names of the template.
_CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + string.punctuation

# ChatML, as in SmolLM2-Instruct (without its default system message).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer(vocab: str = "chars"):
    """A character-level ``PreTrainedTokenizerFast`` (99 tokens) with a ChatML template.

    Each character is one token (a BPE model without merges); characters outside the vocabulary
    map to ``<unk>``. Padding is on the left, for generation.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    if vocab != "chars":
        raise ValueError(f"vocab: expected 'chars', got {vocab!r}")
    table = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(_CHARS))}
    backend = Tokenizer(models.BPE(vocab=table, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()  # concatenate characters back (the default joins with spaces)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=2048,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model_and_tokenizer(seed: int = 0, vocab: str = "chars", *, eos_bias: float = 0.0) -> Tuple[torch.nn.Module, object]:
    """A randomly initialised ``LlamaForCausalLM`` (hidden 32, 2 layers, 4 heads, 2 kv heads,
    intermediate 64) and its character tokenizer.

    The same ``seed`` gives the same weights; the global torch RNG is left untouched.
    ``eos_bias > 0`` adds that constant to the EOS logit (the LM head gets a bias), so that
    samples end at varying lengths: a random model otherwise almost never emits EOS (1/99 per
    token) and every response would be truncated. The model is returned in eval mode, as
    ``from_pretrained`` leaves a model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer(vocab)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        if eos_bias:
            old = model.lm_head
            head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
            with torch.no_grad():
                head.weight.copy_(old.weight)
                head.bias.zero_()
                head.bias[tok.eos_token_id] = float(eos_bias)
            model.lm_head = head
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.eval()
    return model, tok
