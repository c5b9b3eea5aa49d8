"""Decode attention for a rollout copy on the CPU: one query token against the KV cache, per key/value head.

    use_grouped_decode(model)   # the model's attention: this function for one query token, sdpa otherwise

A decode step attends one new token of each row to its cache. With grouped-query attention (H query heads
sharing H / G key/value heads; SmolLM2-135M: 9 and 3) the G query heads of a key/value head are stacked
into one [G, d] block, so the step is two batched matrix products over the cache as it is stored (no
``repeat_kv`` copy) and a float32 softmax between them:

    w = (q_g @ K^T) * scaling + mask        [B, H/G, G, L]   (float32, or the inputs' dtype if wider)
    out = softmax(w) @ V                    [B, H/G, G, d]   (probabilities cast to V's dtype, as eager does)

which is transformers' eager attention (``softmax(..., dtype=float32).to(query.dtype)``) without the
repeated keys. torch 2.13's CPU kernel for scaled-dot-product attention (the flash kernel) runs the same
step at a fixed cost per row and head that dominates at one query token in bf16: on an AMD EPYC (Zen 4,
2 threads) ``HFRollout(dtype=torch.bfloat16).generate`` of the embedded model took 0.65x the time at 128
rows, 0.79x at 32 greedy rows and 0.86x at 16 (fp32: 0.97-0.98x, within noise; ``benchmarks/
decode_attention.py``, docs/performance.md). Every other call (prompt passes, more than one query token,
dropout, soft-capping, a position bias) goes to transformers' ``sdpa_attention_forward`` unchanged.

Registered with transformers' ``AttentionInterface`` (and ``sdpa_mask`` as its mask function, so the
masks are the boolean ones sdpa gets) under :data:`GROUPED`; :func:`use_grouped_decode` switches only a
model that runs ``sdpa`` through that interface (``_supports_attention_backend``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["GROUPED", "grouped_decode_attention", "use_grouped_decode"]

#: the name under which the function is registered with transformers
GROUPED = "tokencredit_grouped_decode"


def grouped_decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                             scaling: Optional[float] = None, **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` [B, H, q, d], ``key`` / ``value`` [B, H/G, L, d]
    (the cache), ``attention_mask`` sdpa's (bool, True = attend, or additive float; None = every position)
    -> ([B, q, H, d], None). One query token is computed here; anything else by ``sdpa_attention_forward``."""
    B, H, q, d = query.shape
    if q != 1 or dropout != 0.0 or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    kv_heads, L = key.shape[1], key.shape[2]
    groups = H // kv_heads  # query head h reads key/value head h // groups (transformers' repeat_kv)
    w = torch.matmul(query.reshape(B, kv_heads, groups, d), key.transpose(-1, -2))  # [B, H/G, G, L]
    w = w.to(torch.promote_types(w.dtype, torch.float32))  # the softmax in float32 at least
    w = w * (d**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        mask = attention_mask[..., -1:, :L]  # [B, 1, 1, L]: the query's row of the mask
        w = w.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else w + mask.to(w.dtype)
    p = torch.softmax(w, dim=-1).to(value.dtype)
    out = torch.matmul(p, value)  # [B, H/G, G, d]
    return out.reshape(B, H, 1, d).transpose(1, 2), None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(GROUPED, grouped_decode_attention)
        AttentionMaskInterface.register(GROUPED, sdpa_mask)
        _registered = True


def use_grouped_decode(model) -> bool:
    """Set ``model`` (a transformers model; a peft model's base) to decode with
    :func:`grouped_decode_attention`; False, and nothing changed, unless the model runs transformers'
    ``sdpa`` attention now through its attention interface: the function equals sdpa and hands it every
    other call, so it replaces nothing else (an ``eager``-only model's extras, e.g. attention sinks, stay)."""
    if not getattr(model, "_supports_attention_backend", False) or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    model.set_attn_implementation(GROUPED)
    return True
