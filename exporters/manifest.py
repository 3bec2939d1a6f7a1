"""The bundle's `manifest.json`: what every graph takes and returns, and the size and checksum of
every file.

A bundle is read as hostile input. `read_manifest` checks, in this order and before the engine
touches anything: the manifest's schema (every key the runtime reads, with its type and range);
that every path in it is relative and stays inside the bundle; that every file the engine reads
(the graph, its external data, the tokenizer folder) is listed; that no listed
file is a symbolic link, anything but a regular file, or code; that each has its recorded size;
and last, when `verify`, that each has its recorded sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import onnx

from specgraph.errors import BundleError
from specgraph.exporters.manifest_schema import InvalidManifest, check_manifest, check_relative_path

# 2: files map to {size, sha256}; paths are confined to the bundle. 3: the graph section says
# everything a host needs (state, constants, in_place, extra_slots), so no host knows a method.
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
# A bundle holds data only: the ONNX graph and its weights, JSON, and tokenizer vocabularies
# (.txt merges, .model sentencepiece protobufs, .jinja chat templates). Never code.
DATA_SUFFIXES = frozenset({".onnx", ".data", ".json", ".txt", ".model", ".jinja"})
_MAX_MANIFEST_BYTES = 16 << 20
_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64", onnx.TensorProto.BOOL: "bool"}


def sha256(path: Path, size: int | None = None) -> str:
    """Hex sha256 of a file; with `size`, of exactly its first `size` bytes (and no more may follow)."""
    digest = hashlib.sha256()
    left = size
    with open(path, "rb") as f:
        while left is None or left > 0:
            block = f.read(1 << 22 if left is None else min(1 << 22, left))
            if not block:
                break
            digest.update(block)
            left = None if left is None else left - len(block)
        if size is not None and (left or f.read(1)):
            return ""  # the file changed size while it was read: no digest matches
    return digest.hexdigest()


def describe_values(values: Any) -> list[dict[str, Any]]:
    """Name, dtype and shape (ints or symbolic names) of ONNX graph inputs or outputs."""
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
        out.append({"name": v.name, "dtype": _DTYPES.get(t.elem_type, str(t.elem_type)), "shape": dims})
    return out


def write_manifest(bundle: Path, body: dict[str, Any]) -> dict[str, Any]:
    """Add the format version and every file's size and sha256 to `body`, check it as a reader
    would, and write it. Refuses a bundle holding anything but data."""
    files = sorted(p for p in bundle.rglob("*") if p.is_file() and p != bundle / MANIFEST)
    for path in files:
        if path.suffix not in DATA_SUFFIXES:
            raise BundleError(f"{bundle}: refusing to ship {path.relative_to(bundle)}: a bundle holds data, not code")
    body = {"format_version": FORMAT_VERSION, **body}
    body["files"] = {p.relative_to(bundle).as_posix(): {"size": p.stat().st_size, "sha256": sha256(p)} for p in files}
    check_manifest(body, str(bundle))
    (bundle / MANIFEST).write_text(json.dumps(body, indent=2) + "\n")
    return body


def reseal(bundle: Path) -> dict[str, Any]:
    """Write `bundle`'s manifest again after one of its files was edited in place (a test's or a
    script's rewrite of the graph): the same body, every file's size and hash as they are now."""
    body = json.loads((bundle / MANIFEST).read_text())
    return write_manifest(bundle, {k: v for k, v in body.items() if k not in ("format_version", "files")})


def read_manifest(bundle: Path, verify: bool = True) -> dict[str, Any]:
    """Read and check a bundle (see the module docstring); raise BundleError naming the first problem.

    `verify=False` skips only the sha256 checks: paths, listing, file kinds and sizes are
    always checked.
    """
    bundle = Path(bundle)
    manifest = _load(bundle)
    check_manifest(manifest, str(bundle))
    files: dict[str, dict[str, Any]] = manifest["files"]
    for rel, entry in files.items():
        _check_listed_file(bundle, rel, entry["size"])
    for key, rel in _engine_files(bundle, manifest):
        if rel not in files:
            raise BundleError(f"{bundle}: {key} {rel} is not listed in the manifest's files, so it cannot be verified")
    _check_external_data(bundle, manifest["graph"]["file"], files)
    if verify:
        for rel, entry in files.items():
            if sha256(bundle / rel, entry["size"]) != entry["sha256"]:
                raise BundleError(
                    f"{bundle}: {rel} fails its sha256 checksum (corrupted or edited); recompile the bundle"
                )
    return manifest


def _load(bundle: Path) -> dict[str, Any]:
    """The manifest as JSON, read with a size cap; an old format says to recompile."""
    path = bundle / MANIFEST
    try:
        info = os.lstat(path)
    except OSError:
        raise BundleError(
            f"{bundle} is not a specgraph bundle (no {MANIFEST}); create one with `specgraph compile`"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise BundleError(f"{path} is not a regular file (a symbolic link or a folder)")
    if info.st_size > _MAX_MANIFEST_BYTES:
        raise BundleError(f"{path} is {info.st_size:,} bytes; a manifest is at most {_MAX_MANIFEST_BYTES:,}")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError, OSError) as exc:  # ValueError covers JSON and UTF-8 errors
        raise BundleError(f"{path} is not valid JSON: {_first_line(exc)}") from exc
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{bundle} has bundle format {repr(version)[:40]}; this specgraph reads {FORMAT_VERSION}: recompile it"
        )
    return manifest


# --- files --------------------------------------------------------------------------------------


def _check_listed_file(bundle: Path, rel: str, size: int) -> None:
    """A listed file lies inside the bundle through no symbolic link, is a regular data file, and
    has its recorded size (checked before anything reads it)."""
    if PurePosixPath(rel).suffix not in DATA_SUFFIXES:
        raise BundleError(f"{bundle}: the manifest lists {rel}, which is not a data file; a bundle never carries code")
    if rel == MANIFEST:
        raise BundleError(f"{bundle}: the manifest lists itself")
    info = _lstat_inside(bundle, rel)
    if not stat.S_ISREG(info.st_mode):
        raise BundleError(f"{bundle}: {rel} is not a regular file")
    if info.st_size != size:
        raise BundleError(
            f"{bundle}: {rel} has {info.st_size:,} bytes, the manifest says {size:,}; recompile the bundle"
        )


def _lstat_inside(bundle: Path, rel: str) -> os.stat_result:
    """lstat of `bundle/rel`, refusing a symbolic link anywhere below the bundle."""
    path = bundle
    info = None
    for part in rel.split("/"):
        path = path / part
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise BundleError(f"{bundle}: {rel} listed in the manifest is missing") from None
        except OSError as exc:
            raise BundleError(f"{bundle}: cannot read {rel}: {_first_line(exc)}") from None
        if stat.S_ISLNK(info.st_mode):
            raise BundleError(f"{bundle}: {rel} goes through a symbolic link; a bundle's files must lie inside it")
    assert info is not None
    return info


def _engine_files(bundle: Path, manifest: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(manifest key, relative path) of every file the engine reads, external data aside."""
    graph = manifest["graph"]
    yield "graph.file", graph["file"]
    if graph.get("weights"):
        yield "graph.weights", graph["weights"]
    if manifest.get("tokenizer"):
        yield from (("tokenizer file", rel) for rel in _tokenizer_files(bundle, manifest["tokenizer"]))


def _tokenizer_files(bundle: Path, folder: str) -> Iterator[str]:
    """Every file in the tokenizer folder (transformers reads what it finds there)."""
    info = _lstat_inside(bundle, folder)
    if not stat.S_ISDIR(info.st_mode):
        raise BundleError(f"{bundle}: tokenizer {folder} is not a folder")
    for root, dirs, names in os.walk(bundle / folder):
        for name in [*dirs, *names]:
            path = Path(root) / name
            rel = path.relative_to(bundle).as_posix()
            if path.is_symlink():
                raise BundleError(f"{bundle}: {rel} is a symbolic link; a bundle's files must lie inside it")
            if name in names:
                yield rel


def _check_external_data(bundle: Path, graph_file: str, files: dict[str, Any]) -> None:
    """Every external-data location inside the ONNX file (ONNX Runtime opens them) must be a
    relative path inside the bundle and a listed file."""
    try:
        model = onnx.load(str(bundle / graph_file), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError, onnx's own errors, OSError
        raise BundleError(f"{bundle}: {graph_file} is not a readable ONNX model: {_first_line(exc)}") from None
    base = PurePosixPath(graph_file).parent
    for tensor in _all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        try:
            check_relative_path(location, f"{graph_file} external data of {tensor.name!r}")
        except InvalidManifest as exc:
            raise BundleError(f"{bundle}: {exc}") from None
        rel = (base / location).as_posix()
        if rel not in files:
            raise BundleError(
                f"{bundle}: {graph_file} reads external data from {rel}, which the manifest does not list"
            )


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor in the model: initializers and attribute values, in subgraphs and functions too."""
    graphs = [model.graph]
    nodes = [node for function in model.functions for node in function.node]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield from (sparse.values, sparse.indices)
            nodes.extend(graph.node)
            continue
        for attr in nodes.pop().attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
            for sparse in attr.sparse_tensors:
                yield from (sparse.values, sparse.indices)
            if attr.HasField("g"):
                graphs.append(attr.g)
            graphs.extend(attr.graphs)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
