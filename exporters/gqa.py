"""Run each target layer's cached attention as one ONNX Runtime `GroupQueryAttention` node.

A chain engine's attention around the cache exports as about 23 nodes a layer: head reshapes
and transposes, two rotary nodes, two `TensorScatter` writes, the span slices, two grouped
MatMuls, the scale, the mask and the softmax. With quantised weights a step is bound by ONNX
Runtime's per-node dispatch (docs/benchmarks.md, issue 9), so this rewrite replaces them with
two 3-D `RotaryEmbedding` nodes (same rotation, [B, T, H*D] in and out) and one
`com.microsoft.GroupQueryAttention`, which writes the new keys and values into the cache at each
row's `cache_len` (in place when the host binds `present_*` onto `past_*`, as it does) and
attends causally over slots [0, cache_len + i], exactly the chain mask `step.chain_masks` builds.

ONNX Runtime's kernel refuses one case: more than one row, more than one token and a non-empty
cache (a batched verify). Each layer is therefore an `If`: the `then` branch is the fused node,
the `else` branch the original nodes, so every call gets the same function. The key cache
changes layout for both: `[B, Hkv, S, D]` like the values (the fused op's), where the generic
path stored keys transposed; the `else` branch transposes the attended span instead.

Only for engines whose target attention is the plain causal chain (no tree mask, no sliding
window): `export_onnx` decides. A layer whose nodes do not have the expected shape is left as it
is and counted as unmatched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specgraph.exporters.rotary import _constants

logger = logging.getLogger("specgraph.exporters")
_HEADS = [0, 2, 1, 3]  # [B, T, H, D] <-> [B, H, T, D]
_KEYS_T = [0, 1, 3, 2]  # [B, Hkv, T, D] -> [B, Hkv, D, T]


@dataclass
class _Layer:
    index: int
    q_flat: str  # [B, T, H*D] before rotary
    k_flat: str  # [B, T, Hkv*D]
    v_flat: str
    rotary: onnx.NodeProto  # the key's RotaryEmbedding (its cos, sin and attributes serve both)
    key_write: onnx.NodeProto
    key_slice: onnx.NodeProto
    out: str  # [B, T, H*D], what the output projection reads
    inside: list[onnx.NodeProto]  # every node from the flats to `out` and the cache writes


def fuse_cached_attention(path: Path, heads: list[tuple[int, int, float]]) -> tuple[int, int]:
    """Rewrite `path` in place; `heads[i]` = (num_heads, kv_num_heads, scale) of target layer i.
    Return (layers fused, layers left as they were)."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    consts = _constants(graph)
    order = {id(n): k for k, n in enumerate(graph.node)}
    layers = [_match(i, scale, graph, producer, users, consts, order) for i, (_, _, scale) in enumerate(heads)]
    found = [layer for layer in layers if layer is not None]
    if not found:
        return 0, len(heads)
    shared = _shared_inputs(found[0].q_flat)
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    for n, layer in enumerate(found):
        num_heads, kv_heads, scale = heads[layer.index]
        node = _layer_if(layer, num_heads, kv_heads, scale, _elem_type(graph, layer.index))
        replace[id(layer.inside[-1])] = ([*shared] if n == 0 else []) + [node]
        drop.update(id(x) for x in layer.inside)
        _relayout_keys(graph, layer.index)
    moved = {o for layer in found for x in layer.inside for o in x.output}
    nodes: list[onnx.NodeProto] = []
    for x in graph.node:
        nodes += replace.get(id(x), [] if id(x) in drop else [x])
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [v for v in graph.value_info if v.name not in moved]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save_model(model, str(path))
    logger.debug("fused the cached attention of %d layers (%d left)", len(found), len(heads) - len(found))
    return len(found), len(heads) - len(found)


def _only(users: dict[str, list[onnx.NodeProto]], name: str, op: str) -> onnx.NodeProto | None:
    """The single reader of `name` if it is an `op` node, else None."""
    readers = users.get(name, [])
    return readers[0] if len(readers) == 1 and readers[0].op_type == op else None


def _layout_free(users: dict[str, list[onnx.NodeProto]]) -> dict[str, list[onnx.NodeProto]]:
    """`users` without the `Shape` nodes that read only a cache's leading dimensions (the exporter
    takes the batch size from any input): the new key layout leaves those as they were."""

    def leading(n: onnx.NodeProto) -> bool:
        a = {x.name: x.i for x in n.attribute}
        return n.op_type == "Shape" and a.get("start", 0) in (0, 1) and a.get("end", 4) in (1, 2)

    return {k: [n for n in v if not leading(n)] for k, v in users.items()}


def _perm(node: onnx.NodeProto | None, perm: list[int]) -> bool:
    return node is not None and node.op_type == "Transpose" and list(node.attribute[0].ints) == perm


def _heads_input(name: str, producer: dict[str, onnx.NodeProto]) -> str | None:
    """The [B, T, H*D] tensor that `Transpose(Reshape(x), [0, 2, 1, 3])` = `name` splits into heads."""
    t = producer.get(name)
    r = producer.get(t.input[0]) if _perm(t, _HEADS) else None  # type: ignore[union-attr]
    return r.input[0] if r is not None and r.op_type == "Reshape" else None


def _match(i, scale, graph, producer, users, consts, order):  # type: ignore[no-untyped-def]
    """Layer i's `_Layer`, or None (with the reason logged) when its nodes are not the expected chain."""

    def no(why):  # type: ignore[no-untyped-def]
        logger.debug("layer %d: cached attention not fused: %s", i, why)

    caches = _layout_free({name: users.get(name, []) for name in (f"past_key_{i}", f"past_value_{i}")})
    kw = _only(caches, f"past_key_{i}", "TensorScatter")
    vw = _only(caches, f"past_value_{i}", "TensorScatter")
    if kw is None or vw is None:
        return no("its caches are not read by one TensorScatter each")
    k_t = producer.get(kw.input[1])
    rot_k = producer.get(k_t.input[0]) if _perm(k_t, _KEYS_T) else None  # type: ignore[union-attr]
    if rot_k is None or rot_k.op_type != "RotaryEmbedding" or len(rot_k.input) != 3:
        return no("the key is not Transpose(RotaryEmbedding(heads))")
    k_flat, v_flat = _heads_input(rot_k.input[0], producer), _heads_input(vw.input[1], producer)
    ks, vs = _only(users, kw.output[0], "Slice"), _only(users, vw.output[0], "Slice")
    if k_flat is None or v_flat is None or ks is None or vs is None:
        return no("the key, the value or their cache reads are not the expected shape")
    qk = _only(users, ks.output[0], "MatMul")
    q_g = producer.get(qk.input[0]) if qk is not None else None
    rot_q = producer.get(q_g.input[0]) if q_g is not None and q_g.op_type == "Reshape" else None
    if rot_q is None or rot_q.op_type != "RotaryEmbedding" or list(rot_q.input[1:]) != list(rot_k.input[1:]):
        return no("the query is not RotaryEmbedding(heads) with the key's cos and sin")
    q_flat = _heads_input(rot_q.input[0], producer)
    mul = _only(users, qk.output[0], "Mul")
    factor = [consts.get(x) for x in mul.input if x != qk.output[0]] if mul is not None else [None]
    if q_flat is None or factor[0] is None or not np.isclose(float(factor[0].reshape(-1)[0]), scale, rtol=1e-6):
        return no("the scores are not scaled by the site's scale")
    where = _only(users, mul.output[0], "Where")
    softmax = _only(users, where.output[0], "Softmax") if where is not None else None
    pv = _only(users, softmax.output[0], "MatMul") if softmax is not None else None
    if pv is None or list(pv.input) != [softmax.output[0], vs.output[0]]:
        return no("the scores do not go Where -> Softmax -> MatMul with the value span")
    back = _only(users, pv.output[0], "Reshape")
    t = _only(users, back.output[0], "Transpose") if back is not None else None
    out = _only(users, t.output[0], "Reshape") if _perm(t, _HEADS) else None
    if out is None:
        return no("the attention output is not merged back into [B, T, H*D]")
    inside = _between(graph, producer, users, {q_flat, k_flat, v_flat}, [out.output[0], kw.output[0], vw.output[0]])
    if inside is None:
        return no("a value inside it is read elsewhere")
    inside.sort(key=lambda n: order[id(n)])
    return _Layer(i, q_flat, k_flat, v_flat, rot_k, kw, ks, out.output[0], inside)


def _between(graph, producer, users, sources: set[str], sinks: list[str]) -> list[onnx.NodeProto] | None:  # type: ignore[no-untyped-def]
    """The nodes on a path from `sources` to `sinks`, or None when a value they make (other than
    the sinks) is read by a node outside them or is a graph output."""
    ancestors: dict[int, onnx.NodeProto] = {}
    todo = [producer[s] for s in sinks]
    while todo:
        n = todo.pop()
        if id(n) in ancestors:
            continue
        ancestors[id(n)] = n
        todo += [producer[x] for x in n.input if x in producer and x not in sources]
    fed = set(sources)
    inside: list[onnx.NodeProto] = []
    for n in graph.node:  # topological order: a node descends from the sources if an input does
        if id(n) in ancestors and any(x in fed for x in n.input):
            fed.update(n.output)
            inside.append(n)
    mine = {id(n) for n in inside}
    outputs = {o.name for o in graph.output}
    for n in inside:
        for o in n.output:
            if o in sinks:
                continue
            if o in outputs or any(id(r) not in mine for r in users.get(o, [])):
                return None
    return inside if all(producer[s] in inside for s in sinks) else None


def _shared_inputs(q_flat: str) -> list[onnx.NodeProto]:
    """The fused op's lengths, computed once per call: `gqa.seqlens` [B] int32 = cache_len + T - 1,
    `gqa.total` int32 = max(cache_len) + T, and `gqa.fused` (one row, one token or an empty cache,
    the cases ONNX Runtime's kernel takes)."""

    def const(name: str, value: int) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.int64)))

    return [
        const("gqa.one", 1),
        const("gqa.zero", 0),
        helper.make_node("Shape", [q_flat], ["gqa.b"], start=0, end=1),
        helper.make_node("Shape", [q_flat], ["gqa.t"], start=1, end=2),
        helper.make_node("Add", ["cache_len", "gqa.t"], ["gqa.end"]),  # [B]
        helper.make_node("Sub", ["gqa.end", "gqa.one"], ["gqa.last"]),
        helper.make_node("Cast", ["gqa.last"], ["gqa.seqlens"], to=onnx.TensorProto.INT32),
        helper.make_node("ReduceMax", ["gqa.end"], ["gqa.end_max"], keepdims=0),
        helper.make_node("Cast", ["gqa.end_max"], ["gqa.total"], to=onnx.TensorProto.INT32),
        helper.make_node("ReduceMax", ["cache_len"], ["gqa.len_max"], keepdims=0),
        helper.make_node("Equal", ["gqa.b", "gqa.one"], ["gqa.one_row"]),
        helper.make_node("Equal", ["gqa.t", "gqa.one"], ["gqa.one_token"]),
        helper.make_node("Equal", ["gqa.len_max", "gqa.zero"], ["gqa.empty"]),
        helper.make_node("Or", ["gqa.one_row", "gqa.one_token"], ["gqa.either"]),
        helper.make_node("Or", ["gqa.either", "gqa.empty"], ["gqa.fused"]),
    ]


def _layer_if(layer: _Layer, num_heads: int, kv_heads: int, scale: float, elem: int) -> onnx.NodeProto:
    i = layer.index
    sinks = [layer.out, f"present_key_{i}", f"present_value_{i}"]
    cos, sin = layer.rotary.input[1:]
    attrs = {a.name: helper.get_attribute_value(a) for a in layer.rotary.attribute}
    fused = [
        helper.make_node("RotaryEmbedding", [layer.q_flat, cos, sin], [f"gqa{i}.q"], **attrs, num_heads=num_heads),
        helper.make_node("RotaryEmbedding", [layer.k_flat, cos, sin], [f"gqa{i}.k"], **attrs, num_heads=kv_heads),
        helper.make_node(
            "GroupQueryAttention",
            [f"gqa{i}.q", f"gqa{i}.k", layer.v_flat, f"past_key_{i}", f"past_value_{i}", "gqa.seqlens", "gqa.total"],
            [f"{s}.then" for s in sinks],
            domain="com.microsoft",
            name=f"gqa{i}",
            num_heads=num_heads,
            kv_num_heads=kv_heads,
            scale=scale,
        ),
    ]
    then = helper.make_graph(fused, f"gqa{i}.fused", [], [_value(f"{s}.then", elem) for s in sinks])
    otherwise = helper.make_graph(_generic(layer), f"gqa{i}.generic", [], [_value(f"{s}.else", elem) for s in sinks])
    return helper.make_node("If", ["gqa.fused"], sinks, name=f"gqa{i}.if", then_branch=then, else_branch=otherwise)


def _generic(layer: _Layer) -> list[onnx.NodeProto]:
    """The layer's own nodes, renamed for the branch, reading and writing keys as [B, Hkv, S, D]."""
    made = {o for n in layer.inside for o in n.output}
    rename = {o: f"{o}.else" for o in made}
    axis2 = f"gqa{layer.index}.axis2"
    nodes = [helper.make_node("Constant", [], [axis2], value=numpy_helper.from_array(np.asarray([2], np.int64)))]
    for n in layer.inside:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.input[:] = [rename.get(x, x) for x in n.input]
        copy.output[:] = [rename[o] for o in n.output]
        if n is layer.key_write:  # write the rotated keys [B, Hkv, T, D] as they are, along the slots
            copy.input[1] = rename[layer.rotary.output[0]]
            del copy.attribute[:]
            copy.attribute.extend([helper.make_attribute("axis", 2), helper.make_attribute("mode", "linear")])
        elif n is layer.key_slice:  # the attended span of [B, Hkv, S, D], then [B, Hkv, D, W] for q @ K
            copy.input[3] = axis2
            copy.output[0] = f"{rename[n.output[0]]}.bnsd"
            nodes += [copy, helper.make_node("Transpose", [copy.output[0]], [rename[n.output[0]]], perm=_KEYS_T)]
            continue
        nodes.append(copy)
    transposed = layer.key_write.input[1]  # the [B, Hkv, D, T] copy of the keys, now unread
    return [n for n in nodes if rename.get(transposed) not in n.output]


def _relayout_keys(graph: onnx.GraphProto, i: int) -> None:
    """past_key_i / present_key_i: [B, Hkv, D, S] -> [B, Hkv, S, D]."""
    for v in [*graph.input, *graph.output]:
        if v.name in (f"past_key_{i}", f"present_key_{i}"):
            dims = v.type.tensor_type.shape.dim
            d, s = onnx.TensorShapeProto.Dimension(), onnx.TensorShapeProto.Dimension()
            d.CopyFrom(dims[2])
            s.CopyFrom(dims[3])
            dims[2].CopyFrom(s)
            dims[3].CopyFrom(d)


def _elem_type(graph: onnx.GraphProto, i: int) -> int:
    return next(v.type.tensor_type.elem_type for v in graph.input if v.name == f"past_value_{i}")


def _value(name: str, elem: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None)
