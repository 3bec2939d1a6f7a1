"""The bundle's `manifest.json`: what every graph takes and returns, and checksums of every file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import onnx

from specgraph.errors import BundleError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64", onnx.TensorProto.BOOL: "bool"}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
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
    """Add format version and file checksums to `body` and write it."""
    files = sorted(p for p in bundle.rglob("*") if p.is_file() and p.name != MANIFEST)
    body = {"format_version": FORMAT_VERSION, **body}
    body["files"] = {str(p.relative_to(bundle)): sha256(p) for p in files}
    (bundle / MANIFEST).write_text(json.dumps(body, indent=2) + "\n")
    return body


def read_manifest(bundle: Path, verify: bool = True) -> dict[str, Any]:
    """Read and check a bundle; raise BundleError naming the first problem."""
    path = bundle / MANIFEST
    if not path.is_file():
        raise BundleError(f"{bundle} is not a specgraph bundle (no {MANIFEST}); create one with `specgraph compile`")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path} is not valid JSON: {exc}") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(
            f"{bundle} has bundle format {manifest.get('format_version')!r}; this specgraph reads {FORMAT_VERSION}: recompile it"
        )
    for name, digest in manifest.get("files", {}).items():
        file = bundle / name
        if not file.is_file():
            raise BundleError(f"{bundle}: file {name} listed in the manifest is missing")
        if verify and sha256(file) != digest:
            raise BundleError(f"{bundle}: {name} fails its sha256 checksum (corrupted or edited); recompile the bundle")
    return manifest
