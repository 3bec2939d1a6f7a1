"""Editing a compiled bundle in tests: a copy with one initializer changed, its manifest resealed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from specgraph.exporters.manifest import MANIFEST, sha256
from specgraph.exporters.onnx import set_initializer


def with_initializer(bundle: Path, out: Path, name: str, value: np.ndarray) -> Path:
    """A copy of `bundle` at `out` whose initializer `name` (a buffer the engine registered, e.g.
    a threshold) holds `value`, with the manifest's record of model.onnx updated to match."""
    shutil.copytree(bundle, out)
    graph = out / "model.onnx"
    set_initializer(graph, name, value)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"]["model.onnx"] = {"size": graph.stat().st_size, "sha256": sha256(graph)}
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out
