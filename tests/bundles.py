"""Editing a compiled bundle in tests: a copy with one initializer changed, its manifest resealed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from specgraph.exporters.manifest import reseal
from specgraph.exporters.onnx import set_initializer


def with_initializer(bundle: Path, out: Path, name: str, value: np.ndarray) -> Path:
    """A copy of `bundle` at `out` whose initializer `name` (a buffer the engine registered, e.g.
    a threshold) holds `value`, with the manifest's record of model.onnx updated to match."""
    shutil.copytree(bundle, out)
    set_initializer(out / "model.onnx", name, value)
    reseal(out)
    return out
