"""Fuse the exporter's rotary-embedding arithmetic into ONNX `RotaryEmbedding` (opset 23).

Hugging Face applies rotary positions as `x * cos + rotate_half(x) * sin`, with
`rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])` and `cos`, `sin` [B, T, D] whose two halves
are equal (`cat(freqs, freqs)`). Exported, that is seven nodes per query and per key (two Slices,
Neg, Concat, two Muls, Add): 420 of SmolLM2's ~2,100 nodes, each costing a few microseconds of
dispatch, which dominates a step once the weights are quantised. `RotaryEmbedding` computes the
same (non-interleaved) rotation from half-width caches `cos[..., :D/2]`, `sin[..., :D/2]`
[B, T, D/2], sliced once per call and shared by every layer. TensorRT's ONNX parser takes it too.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

logger = logging.getLogger("specgraph.exporters")


def fuse_rotary(path: Path) -> int:
    """Rewrite `path` in place (weights untouched); return how many rotations became one node."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    producer, users, consts = graph_index(graph)
    replace: dict[str, list[onnx.NodeProto]] = {}  # Add node name -> nodes that replace it
    drop: set[str] = set()
    halves: dict[str, str] = {}
    for neg in (n for n in graph.node if n.op_type == "Neg"):
        match = _match(neg, producer, users, consts)
        if match is None:
            continue
        x, cos, sin, half, add, removed = match
        first: list[onnx.NodeProto] = []  # half caches go before their first use, where cos and sin exist
        for raw in (cos, sin):
            if raw not in halves:
                halves[raw] = f"{raw}.half"
                first += _half_cache(raw, half)
        rotary = helper.make_node(
            "RotaryEmbedding", [x, halves[cos], halves[sin]], [add.output[0]], name=f"{add.name}.rotary"
        )
        replace[add.name] = [*first, rotary]
        drop.update(n.name for n in removed)
    if not replace:
        return 0
    nodes: list[onnx.NodeProto] = []
    for n in graph.node:
        if n.name in replace:
            nodes += replace[n.name]
        elif n.name not in drop:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save_model(model, str(path))
    logger.debug("fused %d rotary embeddings", len(replace))
    return len(replace)


def graph_index(
    graph: onnx.GraphProto,
) -> tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]], dict[str, np.ndarray]]:
    """Each value's producer, each value's readers, and the small constants (initializers and
    `Constant` nodes) by name: what a pattern rewrite of `graph` looks things up in."""
    producer = {o: n for n in graph.node for o in n.output}
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    return producer, users, _constants(graph)


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    out = {
        t.name: numpy_helper.to_array(t)
        for t in graph.initializer
        if len(t.dims) <= 1 and t.data_location != onnx.TensorProto.EXTERNAL  # slice bounds are inline
    }
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return out


def _slice_range(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> tuple[int, int] | None:
    """(start, end) of a Slice over the last axis of a [B, H, T, D] tensor (axis 3 or -1) with
    constant bounds and step 1, else None; an end past D is returned as given (INT64_MAX)."""
    if node.op_type != "Slice" or len(node.input) < 4:
        return None
    vals = [consts.get(i) for i in node.input[1:4]]
    step = consts.get(node.input[4]) if len(node.input) > 4 else np.asarray([1])
    if any(v is None or v.size != 1 for v in vals) or step is None or int(step.reshape(-1)[0]) != 1:
        return None
    start, end, axis = (int(v.reshape(-1)[0]) for v in vals)  # type: ignore[union-attr]
    return (start, end) if axis in (-1, 3) else None


def _match(neg, producer, users, consts):  # type: ignore[no-untyped-def]
    """The nodes of `x*cos + cat(-x[..., h:], x[..., :h]) * sin` around this Neg, or None."""
    hi = producer.get(neg.input[0])
    hi_range = _slice_range(hi, consts) if hi is not None else None
    if hi_range is None or len(users.get(neg.output[0], [])) != 1:
        return None
    x, half = hi.input[0], hi_range[0]
    if hi_range[1] < 2 * half:  # the high half must run to the end of the head dimension
        return None
    cat = users[neg.output[0]][0]
    if cat.op_type != "Concat" or list(cat.input)[0] != neg.output[0] or len(cat.input) != 2:
        return None
    lo = producer.get(cat.input[1])
    if lo is None or lo.input[0] != x or _slice_range(lo, consts) != (0, half):
        return None
    if len(users.get(cat.output[0], [])) != 1 or users[cat.output[0]][0].op_type != "Mul":
        return None
    mul_sin = users[cat.output[0]][0]
    sin_u = producer.get(next(i for i in mul_sin.input if i != cat.output[0]))
    add = users.get(mul_sin.output[0], [None])[0]
    if add is None or add.op_type != "Add" or len(users[mul_sin.output[0]]) != 1:
        return None
    mul_cos = producer.get(next(i for i in add.input if i != mul_sin.output[0]))
    if mul_cos is None or mul_cos.op_type != "Mul" or x not in mul_cos.input or len(users[mul_cos.output[0]]) != 1:
        return None
    cos_u = producer.get(next(i for i in mul_cos.input if i != x))
    raws = [_unsqueezed_at_1(u, consts) for u in (cos_u, sin_u)]
    if raws[0] is None or raws[1] is None:
        return None
    removed = [neg, hi, lo, cat, mul_sin, mul_cos, add]
    if any(len(users.get(n.output[0], [])) != 1 for n in (hi, lo)):
        return None
    return x, raws[0], raws[1], half, add, removed


def _unsqueezed_at_1(node, consts) -> str | None:  # type: ignore[no-untyped-def]
    """The [B, T, D] tensor a `Unsqueeze(t, axes=[1])` node widens to [B, 1, T, D], else None."""
    if node is None or node.op_type != "Unsqueeze" or len(node.input) != 2:
        return None
    axes = consts.get(node.input[1])
    return node.input[0] if axes is not None and axes.reshape(-1).tolist() == [1] else None


def _half_cache(raw: str, half: int) -> list[onnx.NodeProto]:
    """raw[..., :half]: RotaryEmbedding's cache [B, T, D/2] (the two halves of HF's are equal)."""
    names = [f"{raw}.half.{k}" for k in ("start", "end", "axis")]
    return [
        *(helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.asarray([v], np.int64)))
          for n, v in zip(names, (0, half, -1), strict=True)),
        helper.make_node("Slice", [raw, *names], [f"{raw}.half"]),
    ]  # fmt: skip
