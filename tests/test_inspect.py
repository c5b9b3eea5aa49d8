"""``tokencredit inspect``: replay a saved rollout batch through every method, one HTML page."""

from __future__ import annotations

import json
import os
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from tokencredit import CreditBatch, CreditPipeline
from tokencredit.credit.diagnostics import credit_diagnostics
from tokencredit.analysis.inspector import (
    color,
    default_specs,
    load_rollouts,
    render_html,
    replay,
    saved_batch,
    visible_token,
    write_page,
)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

# tokens that must be escaped or made visible
TRICKY = ["<script>alert(1)</script>", "&amp;", " ", "\n", "\t", "", '"q"', "é", "\x07"]


def crc_reward(completion: str, example) -> float:
    return float(zlib.crc32(completion.encode()) % 2)


def synthetic_rollouts(seed: int = 0):
    """A rollouts dict in the format of Trainer.save_rollouts, with most signals, NaN padding
    (methods never read it, the page must not either) and tricky token texts."""
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 9
    lengths = [9, 6, 7, 4]
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    pad = ~mask.bool()

    def sig(x):
        return x.masked_fill(pad, float("nan"))

    lp = -torch.rand(B, T, generator=g) * 3
    lp[0, 2] = lp[1, 1] = lp[2, 5] = -9.0  # tail tokens for TACO: -l - H + log(0.01) > 0
    ent = torch.rand(B, T, generator=g) * 2 + 0.1
    ent[0, 2] = ent[1, 1] = ent[2, 5] = 0.2
    signals = {
        "response_mask": mask,
        "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "logprobs": sig(lp),
        "old_logprobs": sig(lp + 0.01),
        "ref_logprobs": sig(lp - torch.rand(B, T, generator=g)),
        "entropy": sig(ent),
        "mode_prob": sig(torch.rand(B, T, generator=g)),
        "oracle_logprobs": sig(lp + torch.randn(B, T, generator=g)),
    }
    chars = "abcdefghij"
    tokens = []
    for i, n in enumerate(lengths):
        row = [chars[(i + t) % len(chars)] for t in range(n)]
        if i == 0:
            row = TRICKY[:n]
        tokens.append(row)
    batch = CreditBatch(**signals)
    out = CreditPipeline("grpo+taco")(batch, update_state=False)
    return {
        "credit": "grpo+taco",
        "step": 7,
        "signals": signals,
        "advantages": out.advantages,
        "token_weights": out.token_weights,
        "response_ids": torch.zeros(B, T, dtype=torch.long),
        "tokens": tokens,
        "texts": ["".join(r) for r in tokens],
        "questions": ["What is <1> & 2?", "q1", "q2", "q3"],
    }


class Page(HTMLParser):
    """Collects token spans (text, nested tags), method buttons, stats rows, skipped entries, data."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tokens = {}  # (r, t) -> {"text", "tags", "style"}
        self.buttons = []
        self.skipped = []
        self.stats = {}
        self.scripts = []
        self.data = None
        self._tok = None
        self._depth = 0
        self._script = None
        self._stat_row = None
        self._stat_cell = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = a.get("class", "") or ""
        if self._tok is not None:
            self._depth += tag != "br"
            self._tok["tags"].append((tag, cls))
            return
        if tag == "span" and "tok" in cls.split():
            self._tok = {"key": (int(a["data-r"]), int(a["data-t"])), "text": "", "tags": [], "style": a.get("style", "")}
            self._depth = 1
        elif tag == "button" and "method-btn" in cls:
            self.buttons.append(a)
        elif tag == "li" and "data-spec" in a:
            self.skipped.append(a)
        elif tag == "script":
            self._script = {"attrs": a, "text": ""}
        elif tag == "tr" and "data-m" in a:
            self._stat_row = int(a["data-m"])
            self.stats[self._stat_row] = {}
        elif tag == "td" and self._stat_row is not None and cls in ("gini", "etr"):
            self._stat_cell = cls

    def handle_endtag(self, tag):
        if self._tok is not None:
            if tag == "span":
                self._depth -= 1
                if self._depth == 0:
                    self.tokens[self._tok["key"]] = self._tok
                    self._tok = None
            return
        if tag == "script" and self._script is not None:
            self.scripts.append(self._script)
            if self._script["attrs"].get("id") == "tc-data":
                self.data = json.loads(self._script["text"])
            self._script = None
        elif tag == "tr":
            self._stat_row = None
        elif tag == "td":
            self._stat_cell = None

    def handle_data(self, data):
        if self._tok is not None:
            self._tok["text"] += data
        elif self._script is not None:
            self._script["text"] += data
        elif self._stat_cell is not None:
            self.stats[self._stat_row][self._stat_cell] = data


def parse(page: str) -> Page:
    p = Page()
    p.feed(page)
    p.close()
    return p


def _valid(t, mask, i):
    return t[i][mask[i].bool()]


@pytest.fixture
def saved():
    return synthetic_rollouts()


def test_replay_covers_every_available_spec_and_lists_the_rest(saved):
    insp = replay(saved)
    labels = [v.label for v in insp.views]
    assert labels[0] == "grpo+taco (as trained)"
    skipped = {s.spec: s for s in insp.skipped}
    # no values and no hidden residual in this batch: exactly the methods needing them are skipped
    assert skipped["gae"].missing == ["values"] and skipped["pact"].missing == ["values"]
    assert skipped["grpo+arca"].missing == ["hidden_residual"] and skipped["rloo+arca"].missing == ["hidden_residual"]
    assert all(s.error is None for s in insp.skipped)
    replayed = {v.spec for v in insp.views if v.source == "replayed"}
    assert replayed | set(skipped) == set(default_specs(saved))
    for spec in ("grpo", "rloo", "dr_grpo", "gtpo", "opd", "oppo", "grpo+taco", "grpo+stare", "grpo+acpo",
                 "grpo+divergence", "grpo+entropy", "grpo+surprisal", "oppo+stare", "rloo+taco", "grpo+taco+stare"):
        assert spec in replayed, spec


def test_page_numbers_equal_the_pipeline_output(saved):
    insp = replay(saved)
    page = parse(render_html(saved, insp))
    batch = saved_batch(saved)  # the saved signals, token_ids from the saved response_ids
    mask = batch.mask
    B = mask.shape[0]
    data = page.data
    assert [m["label"] for m in data["methods"]] == [b["data-spec"] + (" (as trained)" if b["data-source"] == "saved" else "")
                                                     for b in page.buttons]
    # every response's tokens are on the page, once, in order
    for i in range(B):
        n = int(mask[i].sum())
        assert [t for (r, t) in page.tokens if r == i] == list(range(n))
        assert len(data["rows"][i]["tokens"]) == n
    replayed = [m for m in data["methods"] if m["source"] == "replayed"]
    assert len(replayed) >= 15
    for k, m in enumerate(data["methods"]):
        if m["source"] == "replayed":
            out = CreditPipeline(m["spec"])(batch, update_state=False)
        else:
            from tokencredit.credit.registry import CreditOutput

            out = CreditOutput(advantages=saved["advantages"], token_weights=saved["token_weights"])
        for i in range(B):
            got = torch.tensor(m["adv"][i], dtype=torch.float32)
            assert torch.equal(got, _valid(out.advantages, mask, i).float()), (m["label"], i)
            if out.token_weights is None:
                assert m["w"] is None
            else:
                assert torch.equal(torch.tensor(m["w"][i], dtype=torch.float32), _valid(out.token_weights, mask, i).float())
        diag = credit_diagnostics(batch, out)
        assert m["gini"] == pytest.approx(diag["diag/weight_gini"], rel=1e-8)
        assert m["etr"] == pytest.approx(diag["diag/weight_etr"], rel=1e-8)
        assert page.stats[k] == {"gini": f"{diag['diag/weight_gini']:.4f}", "etr": f"{diag['diag/weight_etr']:.4f}"}
    # the first method's colours are in the HTML itself (readable without JavaScript)
    first = data["methods"][0]
    for (r, t), tok in page.tokens.items():
        assert f"background-color: {color(first['adv'][r][t], first['scale'])}" in tok["style"]
    # log-probs and entropy for the tooltip are the batch's
    for i in range(B):
        assert torch.equal(torch.tensor(data["rows"][i]["lp"], dtype=torch.float32), _valid(batch.logprobs, mask, i))
        assert torch.equal(torch.tensor(data["rows"][i]["ent"], dtype=torch.float32), _valid(batch.entropy, mask, i))
    # methods that cannot be replayed are listed with the signals they lack
    listed = {li["data-spec"]: li["data-missing"] for li in page.skipped}
    assert listed["gae"] == "values" and listed["grpo+arca"] == "hidden_residual"


def test_colours_diverge_red_negative_blue_positive():
    assert color(0.0, 1.0) == "rgb(255, 255, 255)"
    assert color(1.0, 1.0) == "rgb(33, 102, 172)" and color(5.0, 1.0) == "rgb(33, 102, 172)"
    assert color(-1.0, 1.0) == "rgb(178, 24, 43)"
    r, g, b = (int(x) for x in color(0.5, 1.0)[4:-1].split(","))
    assert b > r and 33 < r < 255


def test_token_text_is_escaped_and_whitespace_visible(saved):
    html = render_html(saved, replay(saved, ["grpo"]))
    page = parse(html)
    row0 = {t: tok for (r, t), tok in page.tokens.items() if r == 0}
    assert row0[0]["text"] == "<script>alert(1)</script>" and row0[0]["tags"] == []  # text, not a tag
    assert row0[1]["text"] == "&amp;"  # the literal characters, shown as written
    assert row0[2]["text"] == "·" and row0[2]["tags"] == [("span", "ws")]
    assert row0[3]["text"] == "↵" and ("br", "") in row0[3]["tags"]
    assert row0[4]["text"] == "→"
    assert row0[5]["text"] == "∅"
    assert row0[6]["text"] == '"q"'
    assert row0[7]["text"] == "é"
    assert row0[8]["text"] == "\\x07"
    # exactly our two scripts; the data block survives the tricky tokens intact
    assert [s["attrs"].get("id") for s in page.scripts] == ["tc-data", None]
    assert page.data["rows"][0]["tokens"] == TRICKY
    assert page.data["rows"][0]["question"] == "What is <1> & 2?"
    # self-contained: nothing fetched from anywhere
    assert "http://" not in html and "https://" not in html and "src=" not in html and "<link" not in html
    assert visible_token("a b") == 'a<span class="ws">·</span>b'


def test_explicit_methods_and_missing_signals(saved):
    saved["signals"] = {k: v for k, v in saved["signals"].items() if k not in ("oracle_logprobs", "mode_prob")}
    insp = replay(saved, ["grpo", "oppo", "acpo", "rloo+taco"], include_saved=False)
    assert [v.label for v in insp.views] == ["grpo", "rloo+taco"]
    assert [(s.spec, s.missing) for s in insp.skipped] == [("oppo", ["oracle_logprobs"]), ("grpo+acpo", ["mode_prob"])]


def test_credit_args_reach_the_replay(saved):
    a = replay(saved, ["taco"], include_saved=False).views[0]
    b = replay(saved, ["taco"], credit_args=("taco.lam=0.5",), include_saved=False).views[0]
    want = CreditPipeline("grpo+taco", taco={"lam": 0.5})(CreditBatch(**saved["signals"]), update_state=False)
    assert torch.equal(b.advantages, want.advantages) and not torch.equal(a.advantages, b.advantages)


def test_a_real_run_and_the_cli(tmp_path, capsys):
    """1 training step on the tiny model writes a rollouts file; the page replays it exactly."""
    from tokencredit.cli import main
    from tokencredit.train.config import (
        LogConfig,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        TaskConfig,
        TrainConfig,
    )
    from tokencredit.testing import tiny_model_and_tokenizer
    from tokencredit.train.trainer import Trainer

    cfg = TrainConfig(
        credit="grpo+taco", steps=1, output_dir=str(tmp_path / "run"),
        model=ModelConfig(name="tiny"),
        task=TaskConfig(name="add1", n_train=8, n_eval=1, reward_fn="test_inspect:crc_reward"),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=6, temperature=1.0),
        optim=OptimConfig(lr=1e-3, micro_batch_size=4),
        log=LogConfig(eval_every=1, eval_samples=1, progress=False),
    )
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=3.0)
    Trainer(cfg, model=model, tokenizer=tok).train()
    [pt] = sorted((tmp_path / "run" / "eval").glob("rollouts_step_*.pt"))
    out = tmp_path / "page.html"
    assert main(["inspect", str(tmp_path / "run"), "--methods", "grpo+taco,rloo,gae", "-o", str(out)]) == 0
    page = parse(out.read_text(encoding="utf-8"))
    saved = load_rollouts(pt)
    mask = saved["signals"]["response_mask"].bool()
    labels = [m["label"] for m in page.data["methods"]]
    assert labels == ["grpo+taco (as trained)", "grpo+taco", "rloo"]
    trained, replayed = page.data["methods"][0], page.data["methods"][1]
    assert trained["adv"] == replayed["adv"]  # TACO is stateless: the replay is the training credit
    for i in range(mask.shape[0]):
        assert torch.equal(torch.tensor(trained["adv"][i], dtype=torch.float32), saved["advantages"][i][mask[i]])
        assert [page.tokens[(i, t)]["text"] for t in range(int(mask[i].sum()))] == [
            visible_text(s) for s in saved["tokens"][i]
        ]
    assert [(li["data-spec"], li["data-missing"]) for li in page.skipped] == [("gae", "values")]
    # default output next to the file
    assert main(["inspect", str(pt)]) == 0 and pt.with_suffix(".html").exists()


def visible_text(s: str) -> str:
    return parse(f'<span class="tok" data-r="0" data-t="0">{visible_token(s)}</span>').tokens[(0, 0)]["text"]


def test_bad_input_is_a_clear_error(tmp_path, saved):
    from tokencredit.cli import main

    with pytest.raises(SystemExit, match="no such file"):
        main(["inspect", str(tmp_path / "nope.pt")])
    with pytest.raises(SystemExit, match="no eval/rollouts_step"):
        main(["inspect", str(tmp_path)])
    p = tmp_path / "r.pt"
    torch.save(saved, p)
    with pytest.raises(SystemExit, match=r"--methods: bad credit spec 'zzz'"):
        main(["inspect", str(p), "--methods", "grpo,zzz"])
    with pytest.raises(SystemExit, match="--methods"):
        main(["inspect", str(p), "--methods", ""])
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(SystemExit, match="expected a dict"):
        main(["inspect", str(tmp_path / "list.pt")])
    bad = dict(saved, tokens=saved["tokens"][:-1])
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(SystemExit, match="tokens has 3 rows"):
        main(["inspect", str(tmp_path / "bad.pt")])


# ---------------------------------------------------------------------------------------
# the page in a real browser


def _playwright():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright not installed (.venv/bin/pip install playwright)")
    return sync_playwright


def test_page_in_headless_chromium(tmp_path, saved):
    sync_playwright = _playwright()
    path = write_page_from(saved, tmp_path)
    data = parse(path.read_text(encoding="utf-8")).data
    labels = [m["label"] for m in data["methods"]]
    i_grpo, i_taco = labels.index("grpo"), labels.index("grpo+taco")
    requests = []
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1200, "height": 900}, timeout=60_000,
        )
        try:
            page = ctx.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(path.as_uri())
            toks = page.locator(".tok")
            assert toks.count() == sum(len(r["tokens"]) for r in data["rows"])

            def colours():
                return page.eval_on_selector_all(".tok", "els => els.map(e => getComputedStyle(e).backgroundColor)")

            def expected(k):
                m = data["methods"][k]
                return [color(m["adv"][r][t], m["scale"]) for r, row in enumerate(data["rows"]) for t in range(len(row["tokens"]))]

            start = colours()
            assert start == expected(0) and len(set(start)) > 1  # coloured, not all one colour
            page.click(f'.method-btn[data-m="{i_grpo}"]')
            c_grpo = colours()
            page.click(f'.method-btn[data-m="{i_taco}"]')
            c_taco = colours()
            assert c_grpo == expected(i_grpo) and c_taco == expected(i_taco)
            assert c_grpo != c_taco  # switching methods changes the colours
            assert page.locator(".method-btn.active").get_attribute("data-m") == str(i_taco)
            assert page.locator("#cur-method").text_content() == "grpo+taco"
            page.select_option("#method-select", str(i_grpo))
            assert colours() == c_grpo

            # hover a token: the tooltip names its text, log-prob, entropy, weight, advantage
            page.click(f'.method-btn[data-m="{i_taco}"]')
            page.hover('.tok[data-r="0"][data-t="2"]')
            tip = page.locator("#tip")
            tip.wait_for(state="visible", timeout=5_000)
            text = tip.text_content()
            m, row = data["methods"][i_taco], data["rows"][0]
            fields = dict(line.split(None, 1) for line in text.splitlines())
            assert fields["token"].startswith('" "')  # the space token, quoted
            assert fields["method"] == "grpo+taco"
            for key, want in [("advantage", m["adv"][0][2]), ("weight", m["w"][0][2]),
                              ("log-prob", row["lp"][2]), ("entropy", row["ent"][2])]:
                assert float(fields[key]) == pytest.approx(want, rel=1e-4, abs=1e-9), key
            shot = tmp_path / "inspect.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert errors == []
        finally:
            ctx.close()
    assert requests and all(u.startswith("file://") for u in requests)  # nothing from the network


def write_page_from(saved, tmp_path: Path) -> Path:
    p = tmp_path / "rollouts_step_00000007.pt"
    torch.save(saved, p)
    return write_page(p, tmp_path / "page.html")


def test_replay_uses_the_runs_configs_and_controller_state(tmp_path):
    """A stateful method with non-default settings: the replay equals the credit the run trained on."""
    from tokencredit.train.config import (
        LogConfig,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        TaskConfig,
        TrainConfig,
    )
    from tokencredit.testing import tiny_model_and_tokenizer
    from tokencredit.train.trainer import Trainer

    cfg = TrainConfig(
        credit="stare", steps=3, output_dir=str(tmp_path / "run"), model=ModelConfig(name="tiny"),
        credit_args=("stare.variant=C2", "stare.adaptive=true", "stare.a=0.2", "stare.P=0.5", "stare.H_target=10.0", "stare.w_max=2.0"),
        task=TaskConfig(name="add1", n_train=8, n_eval=1, reward_fn="test_inspect:crc_reward"),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=6, temperature=1.0),
        optim=OptimConfig(lr=1e-3, micro_batch_size=8),
        log=LogConfig(eval_every=3, eval_samples=1, progress=False),
    )
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=1.0)
    tr = Trainer(cfg, model=model, tokenizer=tok)
    initial = tr.credit.state_dict()
    tr.train()
    [pt] = sorted((tmp_path / "run" / "eval").glob("rollouts_step_*.pt"))
    saved = load_rollouts(pt)
    assert saved["credit_configs"]["stare"]["variant"] == "C2" and saved["credit_configs"]["stare"]["P"] == 0.5
    assert saved["credit_state"] != initial  # the controller moved during the first two steps
    view = replay(saved, ["stare"], include_saved=False).views[0]
    torch.testing.assert_close(view.advantages, saved["advantages"].float(), atol=1e-6, rtol=0)
    fresh = replay({**saved, "credit_state": {}, "credit_configs": {}}, ["stare"], include_saved=False).views[0]
    assert not torch.allclose(fresh.advantages, saved["advantages"].float())  # so the check above can fail
