"""The saliency pass: OAR-G's input-gradient sensitivity of the outcome to each response token.

For one response (reasoning tokens r_1..r_R, then its last ``answer_tokens`` outcome tokens),
after the prompt, with input embeddings e_t and Gaussian noise xi_t ~ N(0, sigma^2) on the
reasoning tokens only::

    p_0     = softmax(mean_{a in outcome} z_a(e))           (no grad: the clean outcome distribution)
    J       = sum_v p_0(v) (log(p_0(v) + eps) - log softmax(mean_a z_a(e + xi))(v))
    s_t     = | < dJ/de_t , e_t > |      t a reasoning token;   s_t = 0 on the outcome tokens

z_a are the logits at the position that predicts outcome token a (the authors'
``pfinal_mode="answer_mean"``, the default of their ``calculate_token_importance_gradient``).
The gradient is taken to the input embeddings only (``torch.autograd.grad``): no parameter
gradient is accumulated, so the step's optimizer never sees it. The policy runs in eval mode.
What the outcome is here (the response's own last tokens, not a reference answer appended after
a concluding template) is tokencredit's reconstruction: docs/methods.md, section OAR.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..credit.registry import SaliencyPass
from .forward import positions

__all__ = ["outcome_saliency"]


def _mean_outcome_logits(logits: Tensor, outcome: Tensor) -> Tensor:
    w = outcome.to(logits.dtype)[..., None]
    return (logits * w).sum(1) / w.sum(1).clamp_min(1.0)


def _rows(spec: SaliencyPass, model, ids: Tensor, att: Tensor, P: int, rmask: Tensor) -> Tensor:
    N, T = rmask.shape
    reasoning, outcome = spec.split(rmask)
    out = torch.zeros(N, T, dtype=torch.float32, device=ids.device)
    has = outcome.any(-1) & reasoning.any(-1)
    if not bool(has.any()):
        return out
    pos = positions(att)
    emb = model.get_input_embeddings()
    with torch.no_grad():
        e0 = emb(ids).detach()
        z0 = model(inputs_embeds=e0, attention_mask=att, position_ids=pos).logits[:, P - 1 : P - 1 + T].float()
        p0 = F.softmax(_mean_outcome_logits(z0, outcome), dim=-1)
    with torch.enable_grad():
        x = e0.clone().requires_grad_(True)
        noise = torch.zeros_like(x)
        r_full = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        r_full[:, P : P + T] = reasoning
        noise[r_full] = torch.randn(int(r_full.sum()), x.shape[-1], device=x.device, dtype=x.dtype) * spec.noise_std
        z = model(inputs_embeds=x + noise, attention_mask=att, position_ids=pos).logits[:, P - 1 : P - 1 + T].float()
        logq = F.log_softmax(_mean_outcome_logits(z, outcome), dim=-1)
        J = (p0 * (torch.log(p0 + spec.kl_eps) - logq)).sum(-1)
        (g,) = torch.autograd.grad(J[has].sum(), x)
    s = (g[:, P : P + T].float() * e0[:, P : P + T].float()).sum(-1).abs()
    return torch.where(reasoning & has[:, None], s, torch.zeros_like(s))


@torch.no_grad()
def outcome_saliency(spec: SaliencyPass, model, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                     response_mask: Tensor, *, micro_batch_size: int) -> Tensor:
    """``outcome_saliency`` [N, T] of left-padded prompts (``prompt_len`` P) + right-padded
    responses, in chunks of ``micro_batch_size`` rows (each row's J is its own: the rows'
    gradients do not mix). 0 on padding, on the outcome tokens and on responses without a
    reasoning token."""
    was = model.training
    model.eval()
    try:
        parts = [
            _rows(spec, model, input_ids[s : s + micro_batch_size], attention_mask[s : s + micro_batch_size], prompt_len,
                  response_mask[s : s + micro_batch_size])
            for s in range(0, input_ids.shape[0], micro_batch_size)
        ]
    finally:
        model.train(was)
    return torch.cat(parts) if parts else torch.zeros(response_mask.shape, device=input_ids.device)
