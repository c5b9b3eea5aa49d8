"""Inspect a saved rollout batch: one self-contained HTML page of token credit per method.

    tokencredit inspect runs/x/eval/rollouts_step_00000030.pt -o page.html
    tokencredit inspect runs/x --methods grpo,taco,oppo+stare

The trainer saves its last training batch at each evaluation (``eval/rollouts_step_*.pt``:
the :class:`~tokencredit.credit.batch.CreditBatch` fields as ``signals``, the run's advantages and
token weights, the decoded tokens, texts and questions; the format and its replay are :mod:`tokencredit.train.records`; this
module is the page). :func:`replay` recomputes credit on
exactly that batch with every requested spec whose required signals the batch has, so
methods are compared on identical rollouts; the others are reported with the signals they
lack. :func:`render_html` writes one page with inline CSS and JS (no network): each response's
tokens coloured by advantage (red negative, blue positive), one button per method, a tooltip
with the token's text, log-prob, entropy, weight and advantage, and per-method weight Gini and
effective-token ratio (:func:`~tokencredit.credit.diagnostics.credit_diagnostics`).

Replays use the run's own method configs and state (STARE's controller where the run left it),
as saved with the rollouts, for every method the run used; other methods start from their
defaults and a fresh state. ``credit_args`` override either. The run's own saved credit is shown
too, as "(as trained)". Given a credit-fidelity estimates file (``tokencredit fidelity build``),
the page shows the Monte Carlo true credit ``c_t = V(h_{t+1}) - V(h_t)`` as one more row
(``true credit (MC, M=..)``; docs/fidelity.md).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..train.records import (
    COMPOSITIONS,
    Inspection,
    MethodView,
    Skipped,
    available_signals,
    check_rollouts,
    default_specs,
    find_rollouts,
    load_rollouts,
    parse_methods,
    replay,
    saved_batch,
)

__all__ = [
    "COMPOSITIONS",
    "MethodView",
    "Skipped",
    "Inspection",
    "load_rollouts",
    "saved_batch",
    "default_specs",
    "replay",
    "render_html",
    "write_page",
    "find_rollouts",
    "page_data",
    "available_signals",
    "check_rollouts",
    "parse_methods",
]

# diverging scale: negative -> red, positive -> blue (ColorBrewer RdBu ends)
_NEG = (178, 24, 43)
_POS = (33, 102, 172)


# ---------------------------------------------------------------------------------------
# rendering


def _num(x: float) -> Optional[float]:
    """A float32 value written with 9 significant digits: reading it back as float32 gives
    exactly the value (so the page's numbers equal the tensors')."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.9g}")


def _rows(t: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[List[List[Optional[float]]]]:
    if t is None:
        return None
    t = torch.as_tensor(t).detach().float().cpu()
    return [[_num(v) for v in t[i][mask[i]].tolist()] for i in range(mask.shape[0])]


def color(a: float, scale: float) -> str:
    """``rgb(...)`` of advantage ``a`` on a diverging scale of half-width ``scale`` (the
    same formula as the page's JavaScript)."""
    t = 0.0 if not scale > 0 else max(-1.0, min(1.0, a / scale))
    end = _POS if t >= 0 else _NEG
    k = abs(t)
    c = [int(255 + (e - 255) * k + 0.5) for e in end]  # all terms >= 0: int(x + .5) rounds as Math.floor(x + .5)
    return f"rgb({c[0]}, {c[1]}, {c[2]})"


_WS = {" ": "·", "\t": "→", "\r": "␍", "\n": "↵"}


def visible_token(text: str) -> str:
    """HTML for a token's text: escaped, whitespace made visible (``·`` space, ``→`` tab,
    ``↵`` newline followed by a line break), other control characters as ``\\xNN``, and
    ``∅`` for an empty token."""
    if text == "":
        return '<span class="ws">∅</span>'
    out = []
    for ch in text:
        if ch in _WS:
            out.append(f'<span class="ws">{_WS[ch]}</span>' + ("<br>" if ch == "\n" else ""))
        elif ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0 or ch in "\u2028\u2029":
            out.append(f'<span class="ws">\\x{ord(ch):02x}</span>' if ord(ch) < 256 else f'<span class="ws">\\u{ord(ch):04x}</span>')
        else:
            out.append(html.escape(ch, quote=True))
    return "".join(out)


def _json_for_script(obj: Any) -> str:
    # safe inside <script type="application/json">: no "</script>", no "<!--"
    return (json.dumps(obj, ensure_ascii=False, allow_nan=False)
            .replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e"))


def _scale(adv: List[List[Optional[float]]]) -> float:
    m = max((abs(v) for row in adv for v in row if v is not None), default=0.0)
    return m if m > 0 else 1.0


def page_data(saved: Dict[str, Any], insp: Inspection, title: str = "") -> Dict[str, Any]:
    """Everything the page shows, as JSON-able data (also embedded in the page)."""
    sig = saved["signals"]
    mask = torch.as_tensor(sig["response_mask"]).bool().cpu()
    B = mask.shape[0]
    lp = sig.get("logprobs") if sig.get("logprobs") is not None else sig.get("old_logprobs")
    lp_rows, ent_rows = _rows(lp, mask), _rows(sig.get("entropy"), mask)
    texts = list(saved.get("texts") or [""] * B)
    questions = list(saved.get("questions") or [""] * B)
    rewards = torch.as_tensor(sig["rewards"]).float().tolist()
    groups = torch.as_tensor(sig["group_ids"]).tolist()
    rows = []
    for i in range(B):
        rows.append({
            "question": str(questions[i]) if i < len(questions) else "",
            "text": str(texts[i]) if i < len(texts) else "",
            "reward": _num(rewards[i]),
            "group": int(groups[i]),
            "tokens": [str(t) for t in saved["tokens"][i]],
            "lp": lp_rows[i] if lp_rows else None,
            "ent": ent_rows[i] if ent_rows else None,
        })
    methods = []
    for v in insp.views:
        adv = _rows(v.advantages, mask)
        methods.append({
            "label": v.label,
            "spec": v.spec,
            "source": v.source,
            "adv": adv,
            "w": _rows(v.token_weights, mask),
            "scale": _scale(adv),
            "gini": _num(v.diagnostics.get("diag/weight_gini", float("nan"))),
            "etr": _num(v.diagnostics.get("diag/weight_etr", float("nan"))),
            "weights_from": "token weights" if v.diagnostics.get("diag/weights_from_token_weights") else "|advantage|",
            "pos": _num(v.diagnostics.get("diag/credit_pos", float("nan"))),
            "neg": _num(v.diagnostics.get("diag/credit_neg", float("nan"))),
        })
    return {
        "title": title,
        "credit": saved.get("credit"),
        "step": saved.get("step"),
        "available": insp.available,
        "lp_name": "logprobs" if sig.get("logprobs") is not None else ("old_logprobs" if sig.get("old_logprobs") is not None else None),
        "rows": rows,
        "methods": methods,
        "skipped": [{"spec": s.spec, "missing": s.missing, "error": s.error} for s in insp.skipped],
    }


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.2em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:.2em 0}
.meta{color:#555;font-size:.9em}
#controls{position:sticky;top:0;background:#fafafa;padding:.5em 0;border-bottom:1px solid #ddd;z-index:5}
.method-btn{margin:.15em;padding:.25em .6em;border:1px solid #888;border-radius:4px;background:#fff;cursor:pointer;font-family:monospace}
.method-btn.active{background:#333;color:#fff;border-color:#333}
.legend{display:inline-flex;align-items:center;gap:.4em;font-size:.85em;margin-left:1em}
.legend .bar{width:160px;height:12px;background:linear-gradient(to right,rgb(178,24,43),#fff,rgb(33,102,172));border:1px solid #aaa}
table.stats{border-collapse:collapse;font-size:.85em;margin:.6em 0}
table.stats td,table.stats th{border:1px solid #ddd;padding:.2em .5em;text-align:right}
table.stats td:first-child,table.stats th:first-child{text-align:left;font-family:monospace}
table.stats tr.active{background:#eef}
.resp{background:#fff;border:1px solid #ddd;border-radius:6px;margin:.6em 0;padding:.5em .7em}
.resp .head{font-size:.85em;color:#555;margin-bottom:.3em}
.resp .q{font-size:.85em;color:#333;margin-bottom:.3em;white-space:pre-wrap}
.toks{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:14px;line-height:1.9;word-break:break-all}
.tok{padding:1px 1px;border-radius:2px;cursor:default;box-shadow:inset 0 0 0 .5px #ccc}
.tok:hover{outline:2px solid #000}
.ws{opacity:.6}
#tip{position:fixed;display:none;pointer-events:none;background:#222;color:#fff;font:12px/1.4 ui-monospace,monospace;padding:.4em .6em;border-radius:4px;white-space:pre;z-index:10;max-width:40em}
.skipped li{font-family:monospace;font-size:.85em}
"""

_JS = r"""
(function(){
  var data = JSON.parse(document.getElementById('tc-data').textContent);
  var NEG=[178,24,43], POS=[33,102,172];
  var cur = 0;
  var shared = false;
  function color(a, scale){
    var t = scale > 0 ? Math.max(-1, Math.min(1, a / scale)) : 0;
    var e = t >= 0 ? POS : NEG, k = Math.abs(t);
    var c = e.map(function(x){ return Math.floor(255 + (x - 255) * k + 0.5); });
    return 'rgb(' + c[0] + ', ' + c[1] + ', ' + c[2] + ')';
  }
  function sharedScale(){
    return Math.max.apply(null, data.methods.map(function(m){ return m.scale; }).concat([0])) || 1;
  }
  function fmt(x){ return (x === null || x === undefined) ? 'n/a' : Number(x).toPrecision(5); }
  function show(i){
    cur = i;
    var m = data.methods[i];
    var scale = shared ? sharedScale() : m.scale;
    var toks = document.querySelectorAll('.tok');
    for (var k = 0; k < toks.length; k++){
      var el = toks[k], r = +el.dataset.r, t = +el.dataset.t, a = m.adv[r][t];
      el.style.backgroundColor = color(a, scale);
      el.style.color = Math.abs(a / scale) > 0.6 ? '#fff' : '#111';
      el.dataset.adv = a;
    }
    document.querySelectorAll('.method-btn').forEach(function(b){ b.classList.toggle('active', +b.dataset.m === i); });
    document.querySelectorAll('table.stats tr[data-m]').forEach(function(tr){ tr.classList.toggle('active', +tr.dataset.m === i); });
    document.getElementById('cur-method').textContent = m.label;
    document.getElementById('scale-lo').textContent = (-scale).toPrecision(3);
    document.getElementById('scale-hi').textContent = '+' + scale.toPrecision(3);
    var sel = document.getElementById('method-select'); if (sel) sel.value = String(i);
  }
  document.querySelectorAll('.method-btn').forEach(function(b){ b.addEventListener('click', function(){ show(+b.dataset.m); }); });
  var sel = document.getElementById('method-select');
  if (sel) sel.addEventListener('change', function(){ show(+sel.value); });
  var sh = document.getElementById('shared-scale');
  if (sh) sh.addEventListener('change', function(){ shared = sh.checked; show(cur); });
  document.addEventListener('keydown', function(ev){
    if (!data.methods.length) return;
    if (ev.key === 'ArrowRight' || ev.key === 'j') show((cur + 1) % data.methods.length);
    if (ev.key === 'ArrowLeft' || ev.key === 'k') show((cur + data.methods.length - 1) % data.methods.length);
  });
  var tip = document.getElementById('tip');
  document.addEventListener('mouseover', function(ev){
    var el = ev.target.closest ? ev.target.closest('.tok') : null;
    if (!el || !data.methods.length){ tip.style.display = 'none'; return; }
    var r = +el.dataset.r, t = +el.dataset.t, row = data.rows[r], m = data.methods[cur];
    var w = m.w ? fmt(m.w[r][t]) : 'n/a (no token weights)';
    tip.textContent =
      'token      ' + JSON.stringify(row.tokens[t]) + '  (#' + t + ')\n' +
      'log-prob   ' + fmt(row.lp ? row.lp[t] : null) + '\n' +
      'entropy    ' + fmt(row.ent ? row.ent[t] : null) + '\n' +
      'weight     ' + w + '\n' +
      'advantage  ' + fmt(m.adv[r][t]) + '\n' +
      'method     ' + m.label;
    tip.style.display = 'block';
  });
  document.addEventListener('mousemove', function(ev){
    if (tip.style.display !== 'block') return;
    var x = ev.clientX + 14, y = ev.clientY + 14;
    var w = tip.offsetWidth, h = tip.offsetHeight;
    if (x + w > window.innerWidth) x = Math.max(0, ev.clientX - w - 14);
    if (y + h > window.innerHeight) y = Math.max(0, ev.clientY - h - 14);
    tip.style.left = x + 'px'; tip.style.top = y + 'px';
  });
  document.addEventListener('mouseout', function(ev){
    if (ev.target.closest && ev.target.closest('.tok') && !(ev.relatedTarget && ev.relatedTarget.closest && ev.relatedTarget.closest('.tok'))) tip.style.display = 'none';
  });
  if (data.methods.length) show(0);
})();
"""


def _replay_wording(saved: Dict[str, Any]) -> str:
    """What the replays were computed with: the run's own method configs and state when the file
    carries them (the trainer's), else the methods' defaults."""
    configs = "the run's own method configs" if saved.get("credit_configs") else "default method configs"
    state = "the run's method state" if saved.get("credit_state") else "a fresh method state"
    return f"{configs} and {state}"


def render_html(saved: Dict[str, Any], insp: Inspection, *, title: Optional[str] = None) -> str:
    """The page as a string: inline CSS and JS, data embedded as JSON, no external resource.
    Tokens are rendered in HTML coloured by the first method; the script recolours them when
    another method is chosen."""
    esc = lambda s: html.escape(str(s), quote=True)  # noqa: E731
    title = title or f"tokencredit inspect: {saved.get('credit', '?')} step {saved.get('step', '?')}"
    data = page_data(saved, insp, title)
    first = data["methods"][0] if data["methods"] else None
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'; script-src \'unsafe-inline\'; img-src data:">',
        f"<title>{esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<div class="meta">{len(data["rows"])} responses · trained with <code>{esc(saved.get("credit", "?"))}</code> · '
        f'signals in the batch: <code>{esc(", ".join(data["available"]) or "none")}</code> · '
        f"replays use {_replay_wording(saved)}</div>",
        '<div id="controls">',
    ]
    if data["methods"]:
        parts.append('<label>method <select id="method-select">')
        for i, m in enumerate(data["methods"]):
            parts.append(f'<option value="{i}">{esc(m["label"])}</option>')
        parts.append("</select></label> ")
        for i, m in enumerate(data["methods"]):
            parts.append(f'<button class="method-btn{" active" if i == 0 else ""}" data-m="{i}" data-spec="{esc(m["spec"])}" data-source="{esc(m["source"])}">{esc(m["label"])}</button>')
        parts.append(
            f'<span class="legend"><span id="scale-lo">{-first["scale"]:.3g}</span><span class="bar"></span>'
            f'<span id="scale-hi">+{first["scale"]:.3g}</span> advantage of <b id="cur-method">{esc(first["label"])}</b></span>'
            ' <label class="legend"><input type="checkbox" id="shared-scale"> one scale for all methods</label>'
            ' <span class="meta">(← → to switch)</span>'
        )
    else:
        parts.append("<b>no method could be replayed on this batch</b>")
    parts.append("</div>")

    parts.append('<table class="stats"><tr><th>method</th><th>source</th><th>weight Gini</th><th>effective-token ratio</th>'
                 "<th>measured on</th><th>credit +</th><th>credit −</th></tr>")
    fmt = lambda x: "–" if x is None else f"{x:.4f}"  # noqa: E731
    for i, m in enumerate(data["methods"]):
        parts.append(
            f'<tr data-m="{i}" class="{"active" if i == 0 else ""}"><td>{esc(m["label"])}</td><td>{esc(m["source"])}</td>'
            f'<td class="gini">{fmt(m["gini"])}</td><td class="etr">{fmt(m["etr"])}</td><td>{esc(m["weights_from"])}</td>'
            f'<td>{fmt(m["pos"])}</td><td>{fmt(m["neg"])}</td></tr>'
        )
    parts.append("</table>")
    if data["skipped"]:
        parts.append('<details class="skipped" open><summary>not replayed on this batch</summary><ul>')
        for s in data["skipped"]:
            why = ("missing signals: " + ", ".join(s["missing"])) if s["missing"] else f"error: {s['error']}"
            parts.append(f'<li data-spec="{esc(s["spec"])}" data-missing="{esc(",".join(s["missing"]))}">{esc(s["spec"])} — {esc(why)}</li>')
        parts.append("</ul></details>")

    for r, row in enumerate(data["rows"]):
        parts.append(f'<div class="resp" data-r="{r}"><div class="head">#{r} · group {row["group"]} · reward {row["reward"]} · {len(row["tokens"])} tokens</div>')
        if row["question"]:
            parts.append(f'<div class="q">{esc(row["question"])}</div>')
        spans = []  # adjacent, no whitespace between tokens: the response reads as generated
        for t, tok in enumerate(row["tokens"]):
            style = ""
            if first is not None:
                a = first["adv"][r][t]
                style = f' style="background-color: {color(a, first["scale"])}; color: {"#fff" if abs(a / first["scale"]) > 0.6 else "#111"}"'
            spans.append(f'<span class="tok" data-r="{r}" data-t="{t}"{style}>{visible_token(tok)}</span>')
        parts.append('<div class="toks">' + "".join(spans) + "</div></div>")
    parts.append('<div id="tip"></div>')
    parts.append(f'<script type="application/json" id="tc-data">{_json_for_script(data)}</script>')
    parts.append(f"<script>{_JS}</script>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_page(rollouts: str | Path, output: Optional[str | Path] = None, *, methods: Optional[Sequence[str] | str] = None,
               credit_args: Sequence[str] = (), saved: Optional[Dict[str, Any]] = None) -> Path:
    """Load ``rollouts`` (a file or a run directory), replay, write the page; returns its path
    (default: the rollouts file with ``.html``). ``saved``: the batch already loaded from that
    file (e.g. with reference rows attached), instead of loading it."""
    src = find_rollouts(rollouts)
    specs = parse_methods(methods) if methods is not None else None
    if saved is None:
        saved = load_rollouts(src)
    insp = replay(saved, specs, credit_args=credit_args)
    out = Path(output) if output is not None else src.with_suffix(".html")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(saved, insp), encoding="utf-8")
    return out
