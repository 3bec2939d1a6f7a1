"""What a bundle stores: the float32 copies of weights it also holds as blocks (there must be none)."""

from __future__ import annotations

from pathlib import Path

import onnx


def float_copies(bundle: Path) -> list[str]:
    """The float32 initializers of `bundle`'s model whose blocks are stored too (`NAME.r0.*`,
    exporters/nbits.py): a table a Gather read as floats while its product read the blocks."""
    model = onnx.load(str(Path(bundle) / "model.onnx"), load_external_data=False)
    names = {t.name for t in model.graph.initializer}
    blocks = {name.split(".r0.")[0] for name in names if ".r0." in name}
    return sorted(t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.name in blocks)
