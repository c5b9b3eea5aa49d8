"""The figure of ``tokencredit fidelity --figure``: a few responses' true credit ``c_t`` against
each method's ``A_t`` (:func:`plot_responses`, matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Sequence

import torch

from .base import response_lengths
from .claims import FIGURE_SPECS
from .estimates import complete_rows, credit_spans, span_values, token_credit
from .metrics import with_own_critics

__all__ = ["plot_responses"]


def plot_responses(est: Dict[str, Any], path: str | Path, specs: Sequence[str] = FIGURE_SPECS,
                   n: int = 3, credit_args: Sequence[str] = ()) -> Path:
    """A PNG of ``n`` responses (one panel each): the true credit ``c_t`` (per token; per span
    spread evenly) against each method's ``A_t`` scaled to the same max |.|, tokens on the x-axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ...train.records import replay

    saved = est["rollouts"]
    lengths = response_lengths(saved)
    done = complete_rows(est)
    R = torch.as_tensor(saved["signals"]["rewards"]).float()
    # the complete rows with the largest true-credit range: one success and one failure first
    cands = sorted([b for b in range(len(lengths)) if done[b]], key=lambda b: -float(credit_spans(span_values(est)[b]).abs().max()))
    pick = [next((b for b in cands if R[b] >= 1), None), next((b for b in cands if R[b] < 1), None)]
    pick = [b for b in pick if b is not None]
    pick += [b for b in cands if b not in pick][: max(0, n - len(pick))]
    c = token_credit(est)
    views = [v for v, _ in with_own_critics(est, replay(saved, list(specs), credit_args=credit_args).views, credit_args)
             if v.source == "replayed"]
    fig, axes = plt.subplots(len(pick), 1, figsize=(14, 3.2 * len(pick)), squeeze=False)
    for ax, b in zip(axes[:, 0], pick):
        L = lengths[b]
        x = torch.arange(L)
        scale = float(c[b, :L].abs().max()) or 1.0
        ax.bar(x, c[b, :L], color="0.75", label="true credit c_t (MC)")
        for v in views:
            a = v.advantages[b, :L].float()
            m = float(a.abs().max()) or 1.0
            ax.plot(x, a / m * scale, marker=".", lw=1, label=f"{v.label} (scaled)")
        ax.axhline(0, color="k", lw=0.5)
        toks = [t.replace("\n", "\\n") for t in saved["tokens"][b]]
        ax.set_xticks(x.tolist())
        ax.set_xticklabels(toks, rotation=90, fontsize=7, family="monospace")
        ax.set_title(f"response {b}: reward {float(R[b]):.0f}, {L} tokens", fontsize=9)
    axes[0, 0].legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
