"""The schema of a bundle's `manifest.json`: every key the runtime reads, with its type and
range, and the rules between keys. A rule is a function `(value, key)` that raises
InvalidManifest naming the key; `check_manifest` turns that into one BundleError line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from specgraph.errors import BundleError

_METHOD_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
_MAX_CONSTANT = 1 << 20  # values in one constant input (a Medusa tree of 1,024 nodes is a 1M-entry mask)
MAX_CONTEXT = 131072  # the compiler's --max-context bound
MAX_VOCAB = 1 << 21  # 8x the largest vocabulary in use (Gemma 3: 262,144)
DEFAULT_ALIAS = "smollm2-135m"  # specgraph.default_model.DEFAULT_MODEL (which imports torch)
_MAX_FILES = 4096
_MAX_KV_WIDTH = 1 << 16  # a cache tensor holds at most this many values per slot (heads x head dim)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class InvalidManifest(Exception):
    """A manifest value that breaks the schema: where it is, what was expected, what was found."""

    def __init__(self, key: str, expected: str, value: Any) -> None:
        super().__init__(f"manifest key {key}: expected {expected}, got {_show(value)}")


class _Missing:
    def __repr__(self) -> str:
        return "nothing (the key is missing)"


Rule = Callable[[Any, str], None]


def _int(lo: int, hi: int) -> Rule:
    def check(value: Any, key: str) -> None:
        if type(value) is not int or not lo <= value <= hi:
            raise InvalidManifest(key, f"an integer in [{lo}, {hi}]", value)

    return check


def _str(value: Any, key: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= 4096:
        raise InvalidManifest(key, "a non-empty string", value)


def _digest(value: Any, key: str) -> None:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise InvalidManifest(key, "a sha256 in lowercase hex", value)


def _dict(value: Any, key: str) -> None:
    if not isinstance(value, dict):
        raise InvalidManifest(key, "an object", value)


def _relative_path(value: Any, key: str) -> None:
    """A path inside the bundle: relative, '/'-separated, no '.', '..' or empty parts."""
    parts = value.split("/") if isinstance(value, str) else []
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= 1024
        or any(part in ("", ".", "..") for part in parts)
        or "\\" in value
        or "\0" in value
        or re.match(r"[A-Za-z]:", value)
    ):
        raise InvalidManifest(key, "a relative path inside the bundle", value)


def _source_path(value: Any, key: str) -> None:
    if value is not None and not (isinstance(value, str) and (os.path.isabs(value) or value == DEFAULT_ALIAS)):
        raise InvalidManifest(key, f"an absolute path or {DEFAULT_ALIAS!r}", value)


def _one_of(choices: tuple[str, ...]) -> Rule:
    def check(value: Any, key: str) -> None:
        if value not in choices:
            raise InvalidManifest(key, f"one of {', '.join(choices)}", value)

    return check


def _optional(rule: Rule) -> Rule:
    def check(value: Any, key: str) -> None:
        if value is not None:
            rule(value, key)

    return check


def _list(rule: Rule, max_len: int) -> Rule:
    def check(value: Any, key: str) -> None:
        if not isinstance(value, list) or len(value) > max_len:
            raise InvalidManifest(key, f"a list of at most {max_len} items", value)
        for i, item in enumerate(value):
            rule(item, f"{key}[{i}]")

    return check


def _map(rule: Rule, max_len: int, key_rule: Rule = _str) -> Rule:
    def check(value: Any, key: str) -> None:
        if not isinstance(value, dict) or len(value) > max_len:
            raise InvalidManifest(key, f"an object of at most {max_len} entries", value)
        for name, item in value.items():
            key_rule(name, f"{key} entry {_show(name)}")
            rule(item, f"{key}.{_key(name)}")

    return check


def _obj(required: dict[str, Rule], optional: dict[str, Rule] | None = None) -> Rule:
    """An object with these keys (others are allowed and ignored)."""

    def check(value: Any, key: str) -> None:
        if not isinstance(value, dict):
            raise InvalidManifest(key or "(top level)", "an object", value)
        for name, rule in required.items():
            if name not in value:
                raise InvalidManifest(f"{key}.{name}".lstrip("."), "a value", _Missing())
            rule(value[name], f"{key}.{name}".lstrip("."))
        for name, rule in (optional or {}).items():
            if name in value:
                rule(value[name], f"{key}.{name}".lstrip("."))

    return check


def _dim(value: Any, key: str) -> None:
    if isinstance(value, str):
        _str(value, key)
    else:
        _int(0, 1 << 31)(value, key)


_VALUE = _obj({"name": _str, "dtype": _str, "shape": _list(_dim, 8)})


def _method(value: Any, key: str) -> None:
    """A method's name: the runtime never branches on it (it reads `graph`), so any name will do."""
    if not isinstance(value, str) or not _METHOD_NAME.fullmatch(value):
        raise InvalidManifest(key, "a method name (lowercase letters, digits, '-')", value)


def _constant(value: Any, key: str) -> None:
    """An engine input bound unchanged on every call: {dtype, shape, data (flat, row-major)}."""
    _obj({"dtype": _one_of(("bool", "int64", "float32")), "shape": _list(_int(0, _MAX_CONSTANT), 8),
          "data": _list(_any, _MAX_CONSTANT)})(value, key)  # fmt: skip
    if _product(value["shape"]) != len(value["data"]):
        raise InvalidManifest(f"{key}.data", f"{_product(value['shape'])} values (the shape's size)", value["data"])
    kinds = {"bool": (bool,), "int64": (int,), "float32": (int, float)}[value["dtype"]]
    for i, item in enumerate(value["data"]):
        if not isinstance(item, kinds) or (value["dtype"] != "bool" and isinstance(item, bool)):
            raise InvalidManifest(f"{key}.data[{i}]", f"a {value['dtype']} value", item)


def _any(value: Any, key: str) -> None:
    """Anything; the caller checks the items."""


_SCHEMA = _obj(
    {
        "format_version": _int(0, 1 << 31),  # its value: manifest.read_manifest
        "method": _method,
        "draft_depth": _int(0, 4096),
        "source": _obj({"name": _str, "kind": _str}, {"path": _source_path}),
        "max_context": _int(16, MAX_CONTEXT),
        "vocab_size": _int(1, MAX_VOCAB),
        "eos_token_ids": _list(_int(0, MAX_VOCAB - 1), 64),
        "tokenizer": _optional(_relative_path),
        "graph": _obj(
            {
                "file": _relative_path,
                "inputs": _list(_VALUE, 4096),
                "outputs": _list(_VALUE, 4096),
                "bindings": _map(_str, 4096),
                "trims": _map(_str, 64),
                "in_place": _list(_str, 4096),
                "state": _list(_str, 4096),
                "constants": _map(_constant, 64),
                "extra_slots": _int(0, 4096),
            },
            {"weights": _optional(_relative_path), "opset": _int(1, 1000), "fused_attention": _int(0, 4096)},
        ),
        "files": _map(_obj({"size": _int(0, 1 << 50), "sha256": _digest}), _MAX_FILES, _relative_path),
    },
    {
        "sampling": _optional(_dict),
        "anatomy": _optional(_dict),
        "passes": _optional(_dict),
    },
)


def check_manifest(manifest: Any, label: str) -> None:
    """Raise BundleError (one line, naming the key) unless `manifest` has every key the runtime
    reads, with the right type and range, and consistent references between them."""
    try:
        _SCHEMA(manifest, "")
        _check_references(manifest)
    except InvalidManifest as exc:
        raise BundleError(f"{label}: {exc}") from None


def check_relative_path(value: Any, key: str) -> None:
    """InvalidManifest unless `value` is a path inside the bundle: relative, '/'-separated, with
    no '.', '..' or empty parts (ONNX Runtime and transformers resolve it from the bundle)."""
    _relative_path(value, key)


def _check_references(manifest: dict[str, Any]) -> None:
    """Cross-key rules: a method's section exists, bindings name real values, ids fit the vocabulary."""
    method = manifest["method"]
    if manifest.get(method) is not None and not isinstance(manifest[method], dict):
        raise InvalidManifest(method, f"an object (the {method} bundle's settings) or null", manifest[method])
    if not manifest["files"]:
        raise InvalidManifest("files", "at least one file (the manifest lists what it verifies)", manifest["files"])
    for i, token in enumerate(manifest["eos_token_ids"]):
        if token >= manifest["vocab_size"]:
            raise InvalidManifest(f"eos_token_ids[{i}]", f"an id below vocab_size {manifest['vocab_size']}", token)
    graph = manifest["graph"]
    inputs = {v["name"]: v for v in graph["inputs"]}
    outputs = {v["name"] for v in graph["outputs"]}
    for out, inp in graph["bindings"].items():
        if out not in outputs or inp not in inputs:
            raise InvalidManifest(f"graph.bindings.{_key(out)}", "an output name bound to an input name", inp)
    for out, count in graph["trims"].items():
        if out not in graph["bindings"] or count not in outputs:
            raise InvalidManifest(f"graph.trims.{_key(out)}", "a bound output trimmed by an output count", count)
    for out in graph["in_place"]:
        if out not in graph["bindings"]:
            raise InvalidManifest("graph.in_place", "outputs bound to the input they write into", out)
    for name in [*graph["state"], *graph["constants"]]:
        if name not in inputs:
            raise InvalidManifest("graph.state/constants", "names of graph inputs", name)
    written = {graph["bindings"][out] for out in graph["in_place"]}
    width_limit = manifest["max_context"] * _MAX_KV_WIDTH
    for name in graph["state"]:
        value = inputs[name]
        dims = value["shape"][1:]  # [batch, ...]: the runtime allocates these zeroed
        if (
            not all(type(d) is int and d >= 1 for d in dims)
            or _product(dims) > width_limit
            or (name in written and not dims)
        ):
            raise InvalidManifest(
                f"graph.inputs {name!r} shape", "fixed cache dimensions that fit max_context", value["shape"]
            )


def _product(dims: list[int]) -> int:
    total = 1
    for d in dims:
        total *= d
    return total


def _key(name: Any) -> str:
    return name if isinstance(name, str) and name.isidentifier() else _show(name)


def _show(value: Any) -> str:
    """A short one-line repr of a manifest value."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
