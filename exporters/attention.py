"""Run each fused attention layer as one `specgraph.CachedAttention` node (native kernels).

`exporters/gqa.py` makes each chain layer's cached attention an `If`: ONNX Runtime's
`GroupQueryAttention` after two `RotaryEmbedding` nodes when its kernel takes the call, the
generic nodes when it does not (several rows of several tokens over non-empty caches). A bundle
that runs specgraph's native kernels already loads `libspecgraph_kernels.so`, whose
`CachedAttention` (host/src/kernels/attention.h) computes the same for every call: the rotation,
the cache writes and the causal attention, in float32, each token by the same code whatever the
call's size. So this pass replaces each such `If` with one node that takes the fused branch's
inputs; the lengths that only the `If`'s condition read are dropped with it.

Only `If`s whose fused branch is exactly the two rotations and the attention node (not the
padded form int8 activations use, which never runs on native kernels) are replaced.

A drafter's later runs then write in place (`_later_runs_in_place`). A cache written by several
runs (the target's verify and a self-draft's runs after it, or a drafter's catch-up and its
steps) is a chain: each run reads the previous run's output. Only the first run's output is
kept (a graph output, bound onto the cache's input); what the later runs write is scratch past
the slots it holds (`ModelDrafts._chain`). Left as a chain, each later run would copy the
cache's used slots into a new buffer, every layer of every draft step; instead each later run
reads the first run's output and writes its keys and values into that buffer itself, with no
outputs of its own. The runs still happen in order: each one's tokens come from the one before.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
from onnx import helper, numpy_helper

from specgraph.exporters.gemm import drop_dead
from specgraph.exporters.nbits import NATIVE_DOMAIN

logger = logging.getLogger("specgraph.exporters")


def run_attention_natively(path: Path) -> int:
    """Rewrite `path` in place (weights untouched); return how many layers now run `CachedAttention`."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    count = 0
    for node in graph.node:
        native = _native(node)
        if native is not None:
            count += 1
        nodes.append(native or node)
    if not count:
        return 0
    del graph.node[:]
    graph.node.extend(nodes)
    in_place = _later_runs_in_place(graph)
    packed = _read_packed_projections(graph)
    drop_dead(graph)
    if NATIVE_DOMAIN not in {o.domain for o in model.opset_import}:
        model.opset_import.append(helper.make_opsetid(NATIVE_DOMAIN, 1))
    onnx.save_model(model, str(path))
    logger.debug("%d attention layers run specgraph.CachedAttention, %d reading a packed projection, %d writing "
                 "in place", count, packed, in_place)  # fmt: skip
    return count


def _later_runs_in_place(graph: onnx.GraphProto) -> int:
    """Let each `CachedAttention` that reads the previous run of its chain, and whose own writes
    only the next run reads, write into the chain's first output (the module docstring); returns
    how many runs now do. Nothing but the chain's runs may read the first output (a graph output
    may: it is bound, and what the later runs write there is scratch)."""
    ran = [n for n in graph.node if n.op_type == "CachedAttention"]
    outputs = {n.name: list(n.output) for n in ran}
    producer = {o: n for n in ran for o in n.output[1:]}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    graph_outputs = {v.name for v in graph.output}

    def only_runs_read(names: list[str]) -> bool:  # (a Shape reads no value)
        return all(r.op_type == "Shape" or (r.op_type == "CachedAttention" and list(r.input[3:5]) == names)
                   for o in names for r in readers.get(o, []))  # fmt: skip

    buffer: dict[str, list[str]] = {}  # a run in place -> the first output of its chain
    count = 0
    for node in ran:  # in graph order: a run comes after the one it reads
        before = producer.get(node.input[3])
        if before is None or outputs[before.name][1:] != list(node.input[3:5]):
            continue
        first = buffer.get(before.name, outputs[before.name][1:])
        mine = outputs[node.name][1:]
        if not only_runs_read(first) or any(o in graph_outputs for o in mine) or not only_runs_read(mine):
            continue
        node.input[3], node.input[4] = first
        del node.output[1:]
        buffer[node.name] = first
        count += 1
    return count


def _read_packed_projections(graph: onnx.GraphProto) -> int:
    """Let each `CachedAttention` whose q, k and v are the three parts of one `Split` (the fused
    Q/K/V projection's, along the last axis) read the unsplit tensor: its k and v inputs are left
    out, and the `Split` goes (a node of dispatch per layer). A `Shape` of q that reads no more than
    its first two dimensions (the token count) reads the unsplit tensor instead, which has the same
    ones; any other reader of a part keeps the `Split`. Returns how many layers now read packed."""
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    small = {t.name: t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    count = 0
    for node in graph.node:
        if node.op_type != "CachedAttention" or len(node.input) < 3:
            continue
        split = producer.get(node.input[0])
        if split is None or split.op_type != "Split" or list(split.output) != list(node.input[:3]):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axis = {a.name: helper.get_attribute_value(a) for a in split.attribute}.get("axis", 0)
        sizes = (
            numpy_helper.to_array(small[split.input[1]]) if len(split.input) > 1 and split.input[1] in small else None
        )
        if axis not in (2, -1) or sizes is None or len(sizes) != 3:
            continue
        heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
        d = int(sizes[0]) // heads
        if [int(x) for x in sizes] != [heads * d, kv_heads * d, kv_heads * d]:
            continue
        shapes = [r for r in readers.get(node.input[0], []) if r is not node]
        if any(r is not node for part in node.input[1:3] for r in readers.get(part, [])):
            continue
        if not all(r.op_type == "Shape" and _leading(r) for r in shapes):
            continue
        for r in shapes:
            r.input[0] = split.input[0]
        node.input[0], node.input[1], node.input[2] = split.input[0], "", ""
        count += 1
    return count


def _leading(shape: onnx.NodeProto) -> bool:
    """A `Shape` node that reads only dimensions 0 and 1."""
    attrs = {a.name: helper.get_attribute_value(a) for a in shape.attribute}
    end = attrs.get("end")
    return end is not None and 0 < end <= 2 and attrs.get("start", 0) >= 0


def _native(node: onnx.NodeProto) -> onnx.NodeProto | None:
    """The `CachedAttention` node for a fused layer's `If`, or None if `node` is not one."""
    if node.op_type != "If" or not node.name.startswith("gqa."):
        return None
    (branch,) = [a.g for a in node.attribute if a.name == "then_branch"]
    ops = [n.op_type for n in branch.node]
    if ops != ["RotaryEmbedding", "RotaryEmbedding", "GroupQueryAttention"]:
        return None
    rot_q, rot_k, gqa = branch.node
    attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
    rotary = {a.name: helper.get_attribute_value(a) for a in rot_q.attribute}
    if rotary.get("interleaved", 0) or rotary.get("rotary_embedding_dim", 0) or len(gqa.input) != 7:
        return None
    if (
        list(rot_q.input[1:]) != list(rot_k.input[1:])
        or gqa.input[0] != rot_q.output[0]
        or gqa.input[1] != rot_k.output[0]
    ):
        return None
    if "scale" not in attrs or any(a in attrs for a in ("do_rotary", "local_window_size", "softcap")):
        return None
    q, k, v, past_k, past_v, seqlens, _total = gqa.input
    return helper.make_node(
        "CachedAttention", [rot_q.input[0], rot_k.input[0], v, past_k, past_v, seqlens, *rot_q.input[1:]],
        list(node.output), name=node.name, domain=NATIVE_DOMAIN,
        num_heads=int(attrs["num_heads"]), kv_num_heads=int(attrs["kv_num_heads"]), scale=float(attrs["scale"]),
    )  # fmt: skip
