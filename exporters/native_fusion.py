"""Fold the small nodes around native block products into the products themselves.

A decoder layer on native kernels (`nbits._native_nodes`) is about 13 ONNX nodes, and at 2 threads
each small node costs a few microseconds of dispatch whatever it computes (docs/benchmarks.md).
`specgraph.BlockMatMul` can take three of their jobs (host/src/kernels/ort_op.cpp):

- an `RMSNormalization` whose only reader is the product: the product normalises its input
  itself (`norm` input, `norm_epsilon`);
- a SwiGLU, `Split` into gate and up, `Sigmoid(gate)`, `Mul(gate, sigmoid)`, `Mul(silu, up)`,
  read only by the product: the product takes the unsplit [..., 2K] input (`glu=1`);
- the residual `Add(h, product)` that is the product's only reader: the product adds `h` to its
  output (`addend` input), the same float addition, to the bit.

The norm and the SiLU are then computed by the library, not by ONNX Runtime's kernels: the same
formulas, rounded a little differently (within 1e-6 relative here), and alike for every row
count, so speculative engines still equal their `none` engine bit for bit.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specgraph.exporters.gemm import drop_dead
from specgraph.exporters.nbits import NATIVE_DOMAIN


def fuse_into_block_matmuls(path: Path) -> dict[str, int]:
    """Rewrite `path` in place (its external data untouched); returns how many of each it fused."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    counts = {"norms": 0, "glus": 0, "residuals": 0}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    producer = {out: node for node in graph.node for out in node.output}
    outputs = {o.name for o in graph.output}
    constants = {t.name: t for t in graph.initializer}
    gone: set[int] = set()
    moved: dict[int, onnx.NodeProto] = {}  # an Add's place -> the product that now ends there

    def only_reader(name: str) -> onnx.NodeProto | None:
        found = readers.get(name, [])
        return found[0] if len(found) == 1 and name not in outputs else None

    for node in graph.node:
        if node.op_type != "BlockMatMul" or node.domain != NATIVE_DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        source = producer.get(node.input[0])
        alone = id(only_reader(node.input[0])) == id(node)  # the product is its input's only reader
        if source is not None and alone:
            if _is_norm(source, constants, attrs["K"]):
                _set_input(node, 0, source.input[0])
                _set_input(node, 5, source.input[1])
                eps = next((helper.get_attribute_value(a) for a in source.attribute if a.name == "epsilon"), 1e-5)
                node.attribute.append(helper.make_attribute("norm_epsilon", float(eps)))
                gone.add(id(source))
                counts["norms"] += 1
            elif (glu := _swiglu(source, producer, readers, outputs, constants, attrs["K"])) is not None:
                split_input, nodes = glu
                _set_input(node, 0, split_input)
                node.attribute.append(helper.make_attribute("glu", 1))
                gone.update(id(n) for n in nodes)
                counts["glus"] += 1
        add = only_reader(node.output[0])
        if add is not None and add.op_type == "Add" and add.domain == "" and len(add.input) == 2:
            other = add.input[0] if add.input[1] == node.output[0] else add.input[1]
            if other != node.output[0] and other not in constants:  # the residual stream, y's shape
                _set_input(node, 6, other)
                node.output[0] = add.output[0]
                moved[id(add)] = node  # where `other` is surely computed: the nodes stay in order
                gone.add(id(node))
                counts["residuals"] += 1
    kept = [moved.get(id(n), n) for n in graph.node if id(n) in moved or id(n) not in gone]
    del graph.node[:]
    graph.node.extend(kept)
    drop_dead(graph)
    onnx.save_model(model, str(path))
    return counts


def _set_input(node: onnx.NodeProto, index: int, name: str) -> None:
    while len(node.input) <= index:
        node.input.append("")
    node.input[index] = name


def _is_norm(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], k: int) -> bool:
    """An RMS norm over the last axis of K values with a constant [K] scale, in float32."""
    if node.op_type != "RMSNormalization" or len(node.input) != 2 or node.input[1] not in constants:
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    scale = constants[node.input[1]]
    return (
        attrs.get("axis", -1) == -1
        and attrs.get("stash_type", 1) == 1
        and list(scale.dims) == [k]
        and scale.data_type == onnx.TensorProto.FLOAT
    )


def _swiglu(
    mul: onnx.NodeProto,
    producer: dict[str, onnx.NodeProto],
    readers: dict[str, list[onnx.NodeProto]],
    outputs: set[str],
    constants: dict[str, onnx.TensorProto],
    k: int,
) -> tuple[str, list[onnx.NodeProto]] | None:
    """`Mul(Mul(g, Sigmoid(g)), u)` with `g, u = Split(x)` into halves of K on the last axis of the
    [B, T, 2K] hidden state, every intermediate read only there: (x, the four nodes), or None."""

    def read_only_by(name: str, *nodes: onnx.NodeProto) -> bool:
        return name not in outputs and sorted(map(id, readers.get(name, []))) == sorted(map(id, nodes))

    if mul.op_type != "Mul" or len(mul.input) != 2:
        return None
    silu, up = producer.get(mul.input[0]), mul.input[1]
    if silu is None or silu.op_type != "Mul" or len(silu.input) != 2 or not read_only_by(silu.output[0], mul):
        return None
    gate, sigmoid = silu.input[0], producer.get(silu.input[1])
    if sigmoid is None or sigmoid.op_type != "Sigmoid" or sigmoid.input[0] != gate:
        return None
    split = producer.get(gate)
    if split is None or split.op_type != "Split" or list(split.output) != [gate, up] or len(split.input) != 2:
        return None
    if not (read_only_by(sigmoid.output[0], silu) and read_only_by(gate, sigmoid, silu) and read_only_by(up, mul)):
        return None
    sizes = constants.get(split.input[1])
    axis = next((helper.get_attribute_value(a) for a in split.attribute if a.name == "axis"), 0)
    if sizes is None or not np.array_equal(numpy_helper.to_array(sizes), [k, k]) or axis not in (-1, 2):
        return None  # axis 2 is the last of the [B, T, H] hidden states every decoder layer passes
    return split.input[0], [split, sigmoid, silu, mul]
