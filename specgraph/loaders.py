"""Stage 1: turn what the user names (alias, HF folder, GGUF file, torch.export file) into a model.

Nothing here unpickles a file the user hands us: HF folders load with `use_safetensors=True`,
and a torch.export archive is inspected as a zip before `torch.export.load` sees it.

What `torch.export.load` does with an archive (torch 2.13, read from
`torch/export/pt2_archive/_package.py` and `torch/_export/serde/serialize.py`):
- tensors saved as raw bytes (`use_pickle: false` in `data/*/<m>_*_config.json`) are read as
  raw storage, with no pickle involved; that is what `torch.export.save` writes for plain tensors;
- tensors saved with `use_pickle: true` (tensor subclasses) are read with
  `torch.load(weights_only=False)`, and `opaque_obj_*` / `custom_obj_*` constants with
  `pickle.loads` / the TorchScript unpickler: arbitrary code;
- `data/sample_inputs/<m>.pt` is read with `torch.load(weights_only=True)`, falling back to
  `weights_only=False` when that fails, and legacy `data/weights/<m>.pt` files the same way;
- `data/aotinductor/` makes it load a compiled shared library;
- every symbolic shape in `models/<m>.json` (`expr_str`) goes through `sympy.sympify`, which
  calls `eval`: a crafted expression runs arbitrary code (verified here with a hand-edited
  archive that ran `os.system`).
So `torch.export.load` is NOT safe on untrusted files by itself; `_check_pt2_archive` refuses
every one of those routes before it is called, and bounds what the archive may inflate to.

Nothing here runs a model folder's code or reaches a model hub: every `from_pretrained` passes
`trust_remote_code=False` and `local_files_only=True`. An HF folder's config is checked against
its safetensors headers before any weight is allocated (`check_config_fits_weights`), and every
weight the model uses must come from the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from specgraph.default_model import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_NAME,
    LOCAL_ONLY,
    build_folder_atomically,
    cache_root,
    check_config_fits_weights,
    ensure_default_model,
    read_gguf,
)
from specgraph.errors import ModelLoadError, SpecgraphError, UnsafeModelError
from specgraph.exporters.manifest import DATA_SUFFIXES

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("specgraph.loaders")

_ACCEPTED = (
    f"a model is one of: the alias {DEFAULT_MODEL!r}, a Hugging Face folder with config.json and "
    "*.safetensors, a .gguf file, or a torch.export archive (.pt2/.pt written by torch.export.save)"
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Pickle protocols 2-5 start with PROTO (0x80) and the protocol number; legacy torch.save too.
_PICKLE_HEADS = tuple(bytes([0x80, proto]) for proto in (2, 3, 4, 5))
# Protocols 0 and 1 have no header; a pickle of them starts with an opcode that pushes a value
# (MARK, an empty container, a global, a number, a string or None).
_PICKLE_01_STARTS = frozenset(bytes([c]) for c in b"(}])cILFSVNJKMGTUX")
# Names a symbolic shape may use: sympy's srepr vocabulary and torch.utils._sympy.functions.
_SYM_NAMES = frozenset(
    "Symbol Dummy Integer Rational Float Add Mul Pow Mod Max Min Abs floor ceiling sqrt "
    "Eq Ne Lt Le Gt Ge Equality Unequality StrictLessThan StrictGreaterThan LessThan GreaterThan "
    "And Or Not Piecewise ExprCondPair Tuple true false True False BooleanTrue BooleanFalse "
    "oo zoo nan Infinity NegativeInfinity IntInfinity NegativeIntInfinity int_oo One Zero NegativeOne Half "
    "positive negative nonnegative nonpositive integer real finite nonzero zero even odd commutative "
    "precision evaluate "
    "FloorDiv ModularIndexing Where PythonMod CleanDiv CeilToInt FloorToInt CeilDiv IntTrueDiv "
    "FloatTrueDiv LShift RShift IsNonOverlappingAndDenseIndicator TruncToFloat TruncToInt RoundToInt "
    "RoundDecimal ToFloat FloatPow PowByNatural Identity".split()
)
_SYM_TOKEN = re.compile(
    r"\s*(?:(?P<name>[A-Za-z_]\w*)|'[\w.+\-]*'|\d+(?:\.\d+)?(?:e[+-]?\d+)?|\*\*|[-+*/%(),=<>!~&|^])"
)
_SYMBOL_NAME = re.compile(r"[a-z]+\d+")  # torch's own symbols: s27, u0, ...
# What we read of a PT2 archive ourselves, at most (torch.export.save stores members uncompressed).
_ARCHIVE_FORMAT_BYTES = 64
_JSON_MEMBER_BYTES = 256 << 20
_SAMPLE_INPUT_BYTES = 64 << 20
# Members may declare this many bytes in all: what torch.export.load will allocate.
_INFLATION = 4  # times the archive's size, plus:
_INFLATION_SLACK = 64 << 20


@dataclass
class LoadedModel:
    """A model ready for capture: an HF module or an exported program, plus what we know of it."""

    kind: str  # "torch.export" | "hf" | "gguf"
    name: str  # human name (folder / file stem / "SmolLM2-135M-Instruct")
    hf_model: PreTrainedModel | None  # eval(), float32, attn_implementation="sdpa"; None for torch.export
    program: torch.export.ExportedProgram | None  # only for torch.export files
    tokenizer_dir: Path | None  # loadable by AutoTokenizer.from_pretrained; None if the source has none
    eos_token_ids: list[int]  # from generation_config / config / tokenizer; [] if unknown
    vocab_size: int
    max_positions: int | None  # config.max_position_embeddings if known
    hf_config: dict[str, Any] | None  # config.to_dict() for HF/GGUF sources


def load_model(source: str | Path) -> LoadedModel:
    """Load the model `source` names; raise ModelLoadError (UnsafeModelError for pickles) if we cannot."""
    if isinstance(source, str) and source == DEFAULT_MODEL:
        return _load_hf_folder(ensure_default_model(), name=DEFAULT_MODEL_NAME)
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"no such model: {source}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_hf_folder(path)
        raise ModelLoadError(f"{source} is a folder without config.json; {_ACCEPTED}")
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return _load_gguf(path)
    if suffix in (".pt", ".pt2"):
        return _load_exported(path)
    raise ModelLoadError(f"{source}: unrecognised model file; {_ACCEPTED}")


# --- Hugging Face folders and GGUF files -------------------------------------------------------


def source_path(model: str) -> str:
    """`model` as a bundle's manifest records it: the alias, or an absolute path (so bench finds
    the same model from any working directory)."""
    if model == DEFAULT_MODEL:
        return model
    return str(Path(model).expanduser().resolve())


def model_fingerprint(loaded: LoadedModel) -> str | None:
    """Who a drafter belongs to, by content: a hash of the model's vocabulary and hidden sizes and
    of every 1/256th row of its token embedding (float32). The same model from any path (the
    GGUF, its safetensors conversion, a renamed copy) gives the same fingerprint. None for a
    source without a Hugging Face model (a torch.export program)."""
    model = getattr(loaded, "hf_model", None)
    if model is None:
        return None
    w = model.get_input_embeddings().weight.detach().to(torch.float32)  # [V, H]
    v, h = w.shape
    rows = w[:: max(1, v // 256)].contiguous().numpy()
    return hashlib.blake2b(f"{v}x{h}".encode() + rows.tobytes(), digest_size=16).hexdigest()


def load_tokenizer(folder: Path, error: type[SpecgraphError] = ModelLoadError) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `folder`, never running code the folder names (`auto_map`) and
    never reaching a hub; `error` (ModelLoadError, BundleError...) if it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), **LOCAL_ONLY)
    except Exception as exc:  # tokenizers raise many kinds of error on broken files
        raise error(f"cannot load the tokenizer in {folder}: {_first_line(exc)}") from exc


def save_tokenizer(source: Path, out: Path) -> None:
    """Save the tokenizer of `source` into `out` as data only: files with a data suffix, and no
    `auto_map` naming code (a bundle never carries code)."""
    load_tokenizer(source).save_pretrained(str(out))
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.suffix not in DATA_SUFFIXES:
            logger.warning("%s: not copying %s into the bundle: a bundle holds data, not code", source, path.name)
            path.unlink()
    config = out / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        if isinstance(data, dict) and data.pop("auto_map", None) is not None:
            config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _load_hf_folder(folder: Path, name: str | None = None) -> LoadedModel:
    """Load a Hugging Face folder from its safetensors weights, never from a pickle.

    The config is checked against the safetensors headers before anything is allocated, and
    every weight the model uses must come from the files (a missing one is an error, an unused
    one a warning).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    shapes = _safetensors_shapes(folder)
    try:  # transformers raises OSError, ValueError, KeyError... on bad configs
        config = AutoConfig.from_pretrained(folder, **LOCAL_ONLY)
    except Exception as exc:
        raise ModelLoadError(f"cannot load {folder}: {_first_line(exc)}") from exc
    _check_shapes(config, shapes, folder)
    try:  # transformers raises OSError, ValueError, KeyError, SafetensorError... on bad folders
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            folder,
            config=config,
            dtype=torch.float32,
            attn_implementation="sdpa",
            use_safetensors=True,
            output_loading_info=True,
            **LOCAL_ONLY,
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot load {folder}: {_first_line(exc)}") from exc
    model, info = loaded  # output_loading_info=True: (model, {missing_keys, unexpected_keys, ...})
    _check_loading_info(info, folder)
    has_tokenizer = any((folder / file).is_file() for file in _TOKENIZER_FILES)
    tokenizer_dir = folder if has_tokenizer else None
    tokenizer = load_tokenizer(folder) if has_tokenizer else None  # a bad tokenizer fails now, not after export
    return _from_hf(model.eval(), "hf", name or folder.resolve().name, tokenizer_dir, tokenizer)


def _safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the folder's safetensors files, from their headers."""
    from safetensors import safe_open

    _check_safetensors_weights(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:  # the reader checks the header against the file's size
            with safe_open(str(path), framework="pt") as file:
                for key in file.keys():
                    shapes[key] = tuple(file.get_slice(key).get_shape())
        except Exception as exc:  # SafetensorError, OSError...
            raise ModelLoadError(f"{path.name} is truncated or corrupt: {_first_line(exc)}") from exc
    return shapes


def _check_shapes(config: PretrainedConfig, shapes: dict[str, tuple[int, ...]], folder: Path) -> None:
    """The config fits the weights: as many layers, not more parameters, same shapes by name."""
    numels = {name: math.prod(shape) for name, shape in shapes.items()}
    skeleton = check_config_fits_weights(config, numels, folder.name)
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    wrong = [name for name, shape in shapes.items() if name in expected and expected[name] != shape]
    if wrong:
        first = wrong[0]
        raise ModelLoadError(
            f"{folder.name}: {len(wrong)} weights have shapes config.json does not give them "
            f"({first} is {list(shapes[first])} in the file, {list(expected[first])} by the config)"
        )


def _check_loading_info(info: dict[str, Any], folder: Path) -> None:
    """Refuse weights the model needs but the files lack (transformers would leave them random)."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelLoadError(
            f"{folder.name}: the weights lack {len(missing)} tensors the model needs ({_names(missing)}); "
            "the files do not match config.json"
        )
    mismatched = sorted(str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get("mismatched_keys") or ())
    if mismatched:
        raise ModelLoadError(f"{folder.name}: {len(mismatched)} weights have the wrong shape ({_names(mismatched)})")
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        logger.warning("%s: ignoring %d tensors the model does not use (%s)", folder.name, len(unexpected),
                       _names(unexpected))  # fmt: skip


def _names(names: list[str], shown: int = 3) -> str:
    """The first few names of a list, and how many more there are."""
    text = ", ".join(names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _check_safetensors_weights(folder: Path) -> None:
    """Refuse folders whose only weights are pickles (pytorch_model.bin and friends)."""
    if any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
    if pickles:
        raise UnsafeModelError(
            f"{folder} has only pickled weights ({pickles[0]}), which can run code when loaded; "
            "save them as safetensors (model.save_pretrained writes model.safetensors)"
        )
    raise ModelLoadError(f"{folder} has config.json but no *.safetensors weights")


def _load_gguf(path: Path) -> LoadedModel:
    """Load a GGUF file dequantised to float32; its tokenizer is cached as a real folder."""
    model, tokenizer = read_gguf(path, progress=True)
    tokenizer_dir = _cached_tokenizer(path, tokenizer)
    return _from_hf(model, "gguf", path.stem, tokenizer_dir, tokenizer)


def _cached_tokenizer(path: Path, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Save a GGUF's tokenizer once per file version under the cache root and return the folder."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "tokenizers" / f"{path.stem}-{key}"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    return build_folder_atomically(folder, tokenizer.save_pretrained)


def _from_hf(
    model: PreTrainedModel,
    kind: str,
    name: str,
    tokenizer_dir: Path | None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> LoadedModel:
    """Fill a LoadedModel from a loaded HF model and its config."""
    text_config = model.config.get_text_config()
    head = model.get_output_embeddings()
    vocab = int(head.weight.shape[0]) if head is not None else int(text_config.vocab_size)
    return LoadedModel(
        kind=kind,
        name=name,
        hf_model=model,
        program=None,
        tokenizer_dir=tokenizer_dir,
        eos_token_ids=_eos_token_ids(model, tokenizer_dir, tokenizer),
        vocab_size=vocab,
        max_positions=getattr(text_config, "max_position_embeddings", None),
        hf_config=model.config.to_dict(),
    )


def _eos_token_ids(
    model: PreTrainedModel, tokenizer_dir: Path | None, tokenizer: PreTrainedTokenizerBase | None
) -> list[int]:
    """End-of-sequence ids from the generation config, else the config, else the tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config):
        ids = _id_list(getattr(source, "eos_token_id", None))
        if ids:
            return ids
    if tokenizer is None and tokenizer_dir is not None:
        tokenizer = load_tokenizer(tokenizer_dir)
    return _id_list(getattr(tokenizer, "eos_token_id", None))


def _id_list(value: int | list[int] | None) -> list[int]:
    """An eos_token_id field (int, list or None) as a list without duplicates."""
    if value is None:
        return []
    values = [value] if isinstance(value, int) else list(value)
    return list(dict.fromkeys(int(v) for v in values))


# --- torch.export archives ------------------------------------------------------------------------


def _load_exported(path: Path) -> LoadedModel:
    """Load a torch.export archive after checking that loading it cannot run code."""
    with path.open("rb") as file:
        _check_pt2_archive(file, path.name)
        file.seek(0)
        try:  # a file object, not a path: torch warns about names not ending in .pt2
            program = torch.export.load(file)
        except Exception as exc:  # the deserializer raises many kinds of error on bad archives
            raise ModelLoadError(f"cannot load {path.name}: {_first_line(exc)}") from exc
    logits = _check_program_signature(program, path.name)
    return LoadedModel(
        kind="torch.export",
        name=path.stem,
        hf_model=None,
        program=program,
        tokenizer_dir=None,
        eos_token_ids=[],
        vocab_size=int(logits.shape[-1]),
        max_positions=None,
        hf_config=None,
    )


def _is_pickle(head: bytes) -> bool:
    """Does a file starting with `head` hold a pickle? Protocols 2-5 begin with PROTO; 0 and 1
    have no header, so their opcodes are parsed (never run): a pushing opcode first, then valid
    opcodes up to STOP or for 32 opcodes. A zip ("PK") is never one."""
    if head[:2] in _PICKLE_HEADS:
        return True
    if not head or head[:1] not in _PICKLE_01_STARTS:
        return False
    import pickletools

    try:
        for count, (opcode, _arg, _pos) in enumerate(pickletools.genops(io.BytesIO(head)), 1):
            if opcode.name == "STOP" or count >= 32:
                return True
    except Exception:  # genops raises ValueError and others on bytes that are not opcodes
        return False
    return False


def _check_pt2_archive(file: BinaryIO, label: str) -> None:
    """Refuse pickles, every part of a PT2 archive that torch.export.load would unpickle or eval,
    and archives whose members would inflate far beyond the file."""
    if _is_pickle(file.read(1 << 16)):
        raise UnsafeModelError(_pickle_message(label))
    size = file.seek(0, io.SEEK_END)
    file.seek(0)
    try:
        archive = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise ModelLoadError(f"{label} is truncated or corrupt: {_first_line(exc)}") from exc
    with archive:
        _check_inflated_size(archive, size, label)
        entries = _relative_entries(archive)
        if "archive_format" not in entries:
            _refuse_non_pt2(entries, label)
        if _read(archive, entries["archive_format"], label, _ARCHIVE_FORMAT_BYTES).strip() != b"pt2":
            raise ModelLoadError(f"{label} is a zip but not a torch.export archive")
        _check_pt2_entries(archive, entries, label)


def _check_inflated_size(archive: zipfile.ZipFile, size: int, label: str) -> None:
    """torch.export.load allocates each member's declared size: bound their sum by the file's."""
    declared = sum(info.file_size for info in archive.infolist())
    limit = size * _INFLATION + _INFLATION_SLACK
    if declared > limit:
        raise ModelLoadError(
            f"{label}: its members would inflate to {declared:,} bytes from a {size:,}-byte file "
            f"(at most {limit:,}); torch.export.save does not compress, so this archive was crafted or damaged"
        )


def _refuse_non_pt2(entries: dict[str, zipfile.ZipInfo], label: str) -> None:
    """Explain why a zip without `archive_format` is refused."""
    if "data.pkl" in entries:
        raise UnsafeModelError(_pickle_message(label))
    if "serialized_exported_program.json" in entries:
        raise UnsafeModelError(
            f"{label} uses the torch.export format of torch 2.7 or older, whose loader unpickles "
            "its weights; re-save it with torch.export.save from torch 2.13"
        )
    raise ModelLoadError(f"{label} is a zip but not a torch.export archive")


def _check_pt2_entries(archive: zipfile.ZipFile, entries: dict[str, zipfile.ZipInfo], label: str) -> None:
    """Check every exported program in the archive: payloads, sample inputs and shape expressions."""
    native = [name for name in entries if name.startswith("data/aotinductor/")]
    if native:
        raise UnsafeModelError(f"{label} contains AOTInductor native code ({native[0]}), which runs when loaded")
    models = [name[len("models/") : -len(".json")] for name in entries if re.fullmatch(r"models/[^/]+\.json", name)]
    if "model" not in models:
        raise ModelLoadError(f"{label} is a PT2 archive without an exported program (models/model.json)")
    for model in models:
        for legacy in (f"data/weights/{model}.pt", f"data/constants/{model}.pt"):
            if legacy in entries:
                raise UnsafeModelError(f"{label} stores {legacy} as a pickle, which can run code when loaded")
        for config in (f"data/weights/{model}_weights_config.json", f"data/constants/{model}_constants_config.json"):
            if config in entries:
                _check_payload_config(_read_json(archive, entries[config], label), label)
        sample = f"data/sample_inputs/{model}.pt"
        if sample in entries:
            _check_sample_inputs(_read(archive, entries[sample], label, _SAMPLE_INPUT_BYTES), label)
        for expr in _expr_strings(_read_json(archive, entries[f"models/{model}.json"], label)):
            _check_sym_expr(expr, label)


def _check_payload_config(config: Any, label: str) -> None:
    """Refuse weights or constants stored as pickles rather than raw tensor bytes."""
    entries = config.get("config", {}) if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise ModelLoadError(f"{label} has a malformed payload config (not a JSON object of tensors)")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict):
            raise ModelLoadError(f"{label} has a malformed payload config entry for {fqn!r}")
        path_name = str(meta.get("path_name", ""))
        if meta.get("use_pickle") or path_name.startswith(("custom_obj_", "opaque_obj_")):
            raise UnsafeModelError(f"{label} stores {fqn} as a pickled object, which can run code when loaded")


def _check_sample_inputs(data: bytes, label: str) -> None:
    """Sample inputs must load with the restricted unpickler, so torch never falls back to a full one."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # weights_only raises UnpicklingError, RuntimeError...
        raise UnsafeModelError(
            f"{label} has sample inputs that are not plain tensors ({_first_line(exc)}); "
            "torch.export.load would unpickle them"
        ) from exc


def _expr_strings(root: Any) -> Iterator[str]:
    """Every `expr_str` value in a serialized exported program (the strings sympify evaluates)."""
    stack = [root]  # no recursion: the JSON may nest as deeply as its parser allowed
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr_str" and isinstance(value, str):
                    yield value
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _check_sym_expr(expr: str, label: str) -> None:
    """Allow only sympy constructors, literals and operators: no attribute access, no other names."""
    pos = 0
    while pos < len(expr.rstrip()):
        match = _SYM_TOKEN.match(expr, pos)
        name = match.group("name") if match else None
        if match is None or (name is not None and name not in _SYM_NAMES and not _SYMBOL_NAME.fullmatch(name)):
            raise UnsafeModelError(
                f"{label} has a symbolic shape that is not a plain expression ({expr[:60]!r}); "
                "torch.export.load would evaluate it as Python"
            )
        pos = match.end()


def _relative_entries(archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """Entries by name below the archive's single root folder (torch writes `<root>/...`)."""
    infos = archive.infolist()
    roots = {info.filename.split("/", 1)[0] for info in infos}
    if len(roots) != 1:
        return {info.filename: info for info in infos}
    return {info.filename.split("/", 1)[1]: info for info in infos if "/" in info.filename}


def _read(archive: zipfile.ZipFile, info: zipfile.ZipInfo, label: str, limit: int) -> bytes:
    """Read one zip entry of at most `limit` bytes, whatever its header declares; damaged or
    oversized entries become ModelLoadError."""
    if info.file_size > limit:
        raise ModelLoadError(f"{label}: {info.filename} declares {info.file_size:,} bytes; at most {limit:,} expected")
    try:
        with archive.open(info) as member:
            data = member.read(limit + 1)
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError, RuntimeError) as exc:
        raise ModelLoadError(f"{label} is truncated or corrupt: {_first_line(exc)}") from exc
    if len(data) > limit:
        raise ModelLoadError(f"{label}: {info.filename} inflates past {limit:,} bytes")
    return data


def _read_json(archive: zipfile.ZipFile, info: zipfile.ZipInfo, label: str) -> Any:
    """A JSON member, read with a cap; malformed or absurdly nested JSON becomes ModelLoadError."""
    try:
        return json.loads(_read(archive, info, label, _JSON_MEMBER_BYTES))
    except (ValueError, RecursionError) as exc:  # ValueError covers JSON and UTF-8 errors
        raise ModelLoadError(f"{label}: {info.filename} is not valid JSON: {_first_line(exc)}") from exc


def _check_program_signature(program: torch.export.ExportedProgram, label: str) -> torch.Tensor:
    """Require forward(input_ids [B, T] int) -> logits [B, T, V] float; return the logits' fake tensor."""
    from torch.export.graph_signature import InputKind, OutputKind

    nodes = {node.name: node for node in program.graph.nodes}
    signature = program.graph_signature
    inputs = [_spec_value(nodes, s) for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    outputs = [_spec_value(nodes, s) for s in signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    ids = inputs[0] if len(inputs) == 1 else None
    logits = outputs[0] if len(outputs) == 1 else None
    ids_ok = isinstance(ids, torch.Tensor) and ids.ndim == 2 and not ids.dtype.is_floating_point
    if not (
        ids_ok
        and isinstance(logits, torch.Tensor)
        and logits.ndim == 3
        and logits.dtype.is_floating_point
        and isinstance(logits.shape[-1], int)  # a static vocabulary
    ):
        raise ModelLoadError(
            f"{label}: expected forward(input_ids [B, T] int) -> logits [B, T, V] float, found "
            f"inputs ({_describe(inputs)}) -> outputs ({_describe(outputs)})"
        )
    return logits


def _spec_value(nodes: dict[str, torch.fx.Node], spec: Any) -> Any:
    """The example value (FakeTensor, int...) behind an input or output spec."""
    name = getattr(spec.arg, "name", None)
    if name in nodes:
        return nodes[name].meta.get("val")
    return getattr(spec.arg, "value", None)


def _describe(values: list[Any]) -> str:
    """Short text for example values: `int64[1, s27]` for tensors, the type name otherwise."""
    parts = []
    for value in values:
        if isinstance(value, torch.Tensor):
            dims = ", ".join(str(d) for d in value.shape)
            parts.append(f"{str(value.dtype).removeprefix('torch.')}[{dims}]")
        else:
            parts.append(type(value).__name__)
    return ", ".join(parts) or "none"


def _pickle_message(label: str) -> str:
    return (
        f"{label} is a pickled Python object (torch.save), which can run code when loaded; "
        "export it with torch.export.save instead"
    )


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library messages can run to many lines)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
