"""Run each layer's cached attention (the target's, a draft model's) as one ONNX Runtime
`GroupQueryAttention` node.

A chain engine's attention around the cache exports as about 23 nodes a layer: head reshapes
and transposes, two rotary nodes, two `TensorScatter` writes, the span slices, two grouped
MatMuls, the scale, the mask and the softmax. With quantised weights a step is bound by ONNX
Runtime's per-node dispatch (docs/benchmarks.md, issue 9), so this rewrite replaces them with
two 3-D `RotaryEmbedding` nodes (same rotation, [B, T, H*D] in and out) and one
`com.microsoft.GroupQueryAttention`, which writes the new keys and values into the cache at each
row's write position (`cache_len` for the target; in place when the host binds `present_*` onto
`past_*`, as it does) and attends causally over slots [0, position + i], exactly the chain mask
`step.chain_masks` builds. A draft model's cache is written by each of its unrolled runs in turn;
each run is fused, reading the cache the run before wrote.

ONNX Runtime's kernel refuses one case: more than one row, more than one token and a non-empty
cache (a batched verify). Each layer is therefore an `If`: the `then` branch is the fused node,
the `else` branch the original nodes, so every call gets the same function. The key cache
changes layout for both: `[B, Hkv, S, D]` like the values (the fused op's), where the generic
path stored keys transposed; the `else` branch transposes the attended span instead.

With int8 activations the target's one-token calls run through the fused node as two tokens
(`pad`): its kernel rounds a one-token query differently from a many-token call's, and int8
rounding would turn that into text a verify call cannot reproduce (`_lengths` says more).

Only for chain engines (no tree mask) and caches without a sliding window: `export_onnx`
decides. A layer whose nodes do not have the expected shape is left as it
is and counted as unmatched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specgraph.exporters.rotary import graph_index

logger = logging.getLogger("specgraph.exporters")
_HEADS = [0, 2, 1, 3]  # [B, T, H, D] <-> [B, H, T, D]
_KEYS_T = [0, 1, 3, 2]  # [B, Hkv, T, D] -> [B, Hkv, D, T]


@dataclass
class _Layer:
    q_flat: str  # [B, T, H*D] before rotary
    k_flat: str  # [B, T, Hkv*D]
    v_flat: str
    rotary: onnx.NodeProto  # the key's RotaryEmbedding (its cos, sin and attributes serve both)
    key_write: onnx.NodeProto
    value_write: onnx.NodeProto
    key_slice: onnx.NodeProto
    mask: str  # the run's attention mask: layers that share it and the write position share lengths
    out: str  # [B, T, H*D], what the output projection reads
    inside: list[onnx.NodeProto]  # every node from the flats to `out` and the cache writes


def fuse_cached_attention(path: Path, heads: dict[str, list[tuple[int, int, float]]],
                          pad: frozenset[str] = frozenset()) -> dict[str, int]:  # fmt: skip
    """Rewrite `path` in place. `heads` maps a key-cache input prefix (`past_key_`, a drafter's
    `draft_past_key_`) to (num_heads, kv_num_heads, scale) for each layer i of that model; the
    cache `{prefix}{i}` may be written by several runs (a drafter's unrolled steps), each reading
    the previous run's output. A cache is fused in every run or in none, since its layout changes.
    The caches whose prefix is in `pad` run a one-token call as two tokens (see `_lengths`): the
    kernel then rounds a step's row bit for bit as it rounds that row in a many-token call, and
    writes one slot past the call (the engine's `extra_slots`). Return {prefix: attention nodes fused}."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    producer, users, consts = graph_index(graph)
    order = {id(n): k for k, n in enumerate(graph.node)}
    plans: list[tuple[str, _Layer, tuple[int, int, float], bool]] = []
    counts: dict[str, int] = {}
    free = _layout_free(users)
    for prefix, per_layer in heads.items():
        counts[prefix] = 0
        for i, spec in enumerate(per_layer):
            runs = _cache_runs(f"{prefix}{i}", f"{prefix.replace('key', 'value')}{i}", spec, graph, producer,
                               users, free, consts, order)  # fmt: skip
            if runs is None:
                continue
            # the cache output: the last run's write, or a drafter's catch-up (its steps write
            # scratch copies: `ModelDrafts._chain`)
            present = f"{prefix.replace('past', 'present')}{i}"
            _relayout_keys(graph, f"{prefix}{i}", runs[-1].key_write.output[0], present)
            plans += [(f"gqa.{prefix}{i}.{r}", layer, spec, prefix in pad) for r, layer in enumerate(runs)]
            counts[prefix] += len(runs)
    if not plans:
        return counts
    groups: dict[tuple[str, str], str] = {}  # (mask, write position) -> the lengths' name prefix
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    for name, layer, spec, padded in sorted(plans, key=lambda p: order[id(p[1].inside[-1])]):
        key = (layer.mask, layer.key_write.input[2])
        first = key not in groups
        lengths = groups.setdefault(key, f"gqa.run{len(groups)}")
        node = _layer_if(name, layer, lengths, *spec, _elem_type(graph, producer, layer), padded)
        shared = _lengths(lengths, layer.q_flat, layer.key_write.input[2], padded) if first else []
        replace[id(layer.inside[-1])] = [*shared, node]
        drop.update(id(x) for x in layer.inside)
    moved = {o for _, layer, _, _ in plans for x in layer.inside for o in x.output}
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
    logger.debug("fused cached attention: %s", counts)
    return counts


def _cache_runs(key, value, spec, graph, producer, users, free, consts, order):  # type: ignore[no-untyped-def]
    """The `_Layer` of every run that writes the caches `key` / `value` (graph inputs), in order,
    or None (reason logged) unless every run matches and the value writes follow the same chain.
    `free`: `users` less the readers the key layout does not concern (`_layout_free`)."""
    runs: list[_Layer] = []
    cache, value_cache = key, value
    while True:
        writes = [n for n in free.get(cache, []) if n.op_type == "TensorScatter"]
        if not writes:
            break
        layer = _match(writes[0], spec, graph, producer, users, consts, order) if len(writes) == 1 else None
        if layer is None or layer.value_write.input[0] != value_cache:
            logger.debug("%s: cached attention not fused (run %d does not match)", key, len(runs))
            return None
        runs.append(layer)
        cache, value_cache = layer.key_write.output[0], layer.value_write.output[0]
    if not runs:
        logger.debug("%s: cached attention not fused: no TensorScatter writes it", key)
        return None
    return runs


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


def _match(kw, spec, graph, producer, users, consts, order):  # type: ignore[no-untyped-def]
    """The `_Layer` around the key write `kw`, or None (reason logged) when its nodes are not the
    expected chain: rotated keys written along the slots, read back by the grouped MatMuls."""

    def no(why):  # type: ignore[no-untyped-def]
        logger.debug("%s: cached attention not fused: %s", kw.output[0], why)

    num_heads, _, scale = spec
    head_dim = _cache_dims(graph, producer, kw)[-1]

    def reader(name, op):  # type: ignore[no-untyped-def]  # the one `op` reader, besides the next run's write
        return _only({name: [n for n in users.get(name, []) if n.op_type != "TensorScatter"]}, name, op)

    k_t = producer.get(kw.input[1])
    rot_k = producer.get(k_t.input[0]) if _perm(k_t, _KEYS_T) else None  # type: ignore[union-attr]
    if rot_k is None or rot_k.op_type != "RotaryEmbedding" or len(rot_k.input) != 3:
        return no("the key is not Transpose(RotaryEmbedding(heads))")
    k_flat = _heads_input(rot_k.input[0], producer)
    ks = reader(kw.output[0], "Slice")
    if k_flat is None or ks is None:
        return no("the key or its cache read is not the expected shape")
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
    vs = producer.get(pv.input[1]) if pv is not None else None
    vw = producer.get(vs.input[0]) if vs is not None and vs.op_type == "Slice" else None
    if vw is None or vw.op_type != "TensorScatter" or list(pv.input)[0] != softmax.output[0]:
        return no("the scores do not go Where -> Softmax -> MatMul with the written value span")
    v_flat = _heads_input(vw.input[1], producer)
    if v_flat is None or reader(vw.output[0], "Slice") is not vs or vw.input[2] != kw.input[2]:
        return no("the value is not written where the key is, or is read elsewhere")
    back = _only(users, pv.output[0], "Reshape")
    while back is not None and _only(users, back.output[0], "Reshape") is not None:
        back = _only(users, back.output[0], "Reshape")  # a no-op view to [B, H, T, D] (a draft model's export)
        if not _heads_view(back, producer, consts, num_heads, head_dim):
            return no("the attention output is reshaped to something other than [B, H, T, D]")
    t = _only(users, back.output[0], "Transpose") if back is not None else None
    out = _only(users, t.output[0], "Reshape") if _perm(t, _HEADS) else None
    if out is None:
        return no("the attention output is not merged back into [B, T, H*D]")
    inside = _between(graph, producer, users, {q_flat, k_flat, v_flat}, [out.output[0], kw.output[0], vw.output[0]])
    if inside is None:
        return no("a value inside it is read elsewhere")
    inside.sort(key=lambda n: order[id(n)])
    return _Layer(q_flat, k_flat, v_flat, rot_k, kw, vw, ks, where.input[0], out.output[0], inside)


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


def _lengths(name: str, q_flat: str, write_pos: str, pad: bool = False) -> list[onnx.NodeProto]:
    """The fused op's lengths for one run, computed once for its layers: `{name}.seqlens` [B] int32
    = write_pos + T - 1, `{name}.total` int32 = max(write_pos) + T, and `{name}.fused` (one row,
    one token or an empty cache: the cases ONNX Runtime's kernel takes). With `pad`, a one-token
    call runs as two (`{name}.pads` pads the second, `{name}.t_in` is the call's own T): ONNX
    Runtime's kernel rounds a one-token query differently from any query of a many-token call
    (its products take another path; rows of 2, 3 or 4 tokens agree bit for bit), which int8
    activations would turn into text that speculation cannot reproduce."""

    def const(tag: str, value: Any) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [f"{name}.{tag}"], value=numpy_helper.from_array(np.asarray(value, np.int64))
        )

    def node(op: str, inputs: list[str], tag: str, **attrs: Any) -> onnx.NodeProto:
        return helper.make_node(
            op, [i if i in (q_flat, write_pos) else f"{name}.{i}" for i in inputs], [f"{name}.{tag}"], **attrs
        )

    counted = [node("Shape", [q_flat], "t", start=1, end=2)]
    if pad:  # t = T + (T == 1); pads = [0, 0, 0, 0, T == 1, 0] for a [B, T, X] input
        counted = [
            node("Shape", [q_flat], "t_in", start=1, end=2),
            node("Equal", ["t_in", "one"], "single"),
            node("Cast", ["single"], "extra", to=onnx.TensorProto.INT64),
            node("Add", ["t_in", "extra"], "t"),
            const("pads_head", [0, 0, 0, 0]),
            const("pads_tail", [0]),
            node("Concat", ["pads_head", "extra", "pads_tail"], "pads", axis=0),
            const("zero_1d", [0]),  # the output's Slice back to t_in rows along axis 1
            const("one_1d", [1]),
        ]
    return [
        const("one", 1),
        const("zero", 0),
        node("Shape", [q_flat], "b", start=0, end=1),
        *counted,
        node("Add", [write_pos, "t"], "end"),  # [B]
        node("Sub", ["end", "one"], "last"),
        node("Cast", ["last"], "seqlens", to=onnx.TensorProto.INT32),
        node("ReduceMax", ["end"], "end_max", keepdims=0),
        node("Cast", ["end_max"], "total", to=onnx.TensorProto.INT32),
        node("ReduceMax", [write_pos], "len_max", keepdims=0),
        node("Equal", ["b", "one"], "one_row"),
        node("Equal", ["t", "one"], "one_token"),
        node("Equal", ["len_max", "zero"], "empty"),
        node("Or", ["one_row", "one_token"], "either"),
        node("Or", ["either", "empty"], "fused"),
    ]


def _layer_if(name: str, layer: _Layer, lengths: str, num_heads: int, kv_heads: int, scale: float,
              elem: int, pad: bool = False) -> onnx.NodeProto:  # fmt: skip
    """The layer as an `If` on `{lengths}.fused`: ONNX Runtime's fused node, or the layer's own
    nodes. With `pad` the fused branch pads the query, key and value to `{lengths}.t` tokens and
    keeps the first `{lengths}.t_in` rows of the output (see `_lengths`)."""
    kw, vw = layer.key_write, layer.value_write
    sinks = [layer.out, kw.output[0], vw.output[0]]
    cos, sin = layer.rotary.input[1:]
    attrs = {a.name: helper.get_attribute_value(a) for a in layer.rotary.attribute}
    q, k, v, out = f"{name}.q", f"{name}.k", layer.v_flat, f"{sinks[0]}.then"
    fused = [
        helper.make_node("RotaryEmbedding", [layer.q_flat, cos, sin], [q], **attrs, num_heads=num_heads),
        helper.make_node("RotaryEmbedding", [layer.k_flat, cos, sin], [k], **attrs, num_heads=kv_heads),
    ]
    if pad:
        fused += [helper.make_node("Pad", [x, f"{lengths}.pads"], [f"{name}.{tag}_pad"])
                  for x, tag in ((q, "q"), (k, "k"), (v, "v"))]  # fmt: skip
        q, k, v, out = f"{name}.q_pad", f"{name}.k_pad", f"{name}.v_pad", f"{name}.out_pad"
    fused.append(
        helper.make_node(
            "GroupQueryAttention",
            [q, k, v, kw.input[0], vw.input[0], f"{lengths}.seqlens", f"{lengths}.total"],
            [out, *(f"{s}.then" for s in sinks[1:])],
            domain="com.microsoft",
            name=name,
            num_heads=num_heads,
            kv_num_heads=kv_heads,
            scale=scale,
        )
    )
    if pad:
        starts, axes = f"{lengths}.zero_1d", f"{lengths}.one_1d"
        fused.append(helper.make_node("Slice", [out, starts, f"{lengths}.t_in", axes], [f"{sinks[0]}.then"]))
    then = helper.make_graph(fused, f"{name}.fused", [], [_value(f"{s}.then", elem) for s in sinks])
    otherwise = helper.make_graph(
        _generic(name, layer), f"{name}.generic", [], [_value(f"{s}.else", elem) for s in sinks]
    )
    return helper.make_node("If", [f"{lengths}.fused"], sinks, name=name, then_branch=then, else_branch=otherwise)


def _generic(name: str, layer: _Layer) -> list[onnx.NodeProto]:
    """The layer's own nodes, renamed for the branch, reading and writing keys as [B, Hkv, S, D]."""
    made = {o for n in layer.inside for o in n.output}
    rename = {o: f"{o}.else" for o in made}
    axis2 = f"{name}.axis2"
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


def _relayout_keys(graph: onnx.GraphProto, *names: str) -> None:
    """These key caches (graph inputs or outputs): [B, Hkv, D, S] -> [B, Hkv, S, D]."""
    for v in [*graph.input, *graph.output]:
        if v.name in names:
            dims = v.type.tensor_type.shape.dim
            d, s = onnx.TensorShapeProto.Dimension(), onnx.TensorShapeProto.Dimension()
            d.CopyFrom(dims[2])
            s.CopyFrom(dims[3])
            dims[2].CopyFrom(s)
            dims[3].CopyFrom(d)


def _cache_input(
    graph: onnx.GraphProto, producer: dict[str, onnx.NodeProto], write: onnx.NodeProto
) -> onnx.ValueInfoProto:
    """The graph input a cache write's chain starts from."""
    name = write.input[0]
    while name in producer:
        name = producer[name].input[0]
    return next(v for v in graph.input if v.name == name)


def _cache_dims(graph: onnx.GraphProto, producer: dict[str, onnx.NodeProto], write: onnx.NodeProto) -> list[int]:
    """The static dimensions of a key cache as stored: [B, Hkv, D, S] (B symbolic: 0)."""
    return [d.dim_value for d in _cache_input(graph, producer, write).type.tensor_type.shape.dim][:3]


def _heads_view(node, producer, consts, num_heads: int, head_dim: int) -> bool:  # type: ignore[no-untyped-def]
    """Whether this Reshape of a [B, H, T, D] tensor keeps it as it is: its shape is
    Concat(b, H, t, D), or Concat(b, -1, 1, D) in a one-token run (-1 is then H)."""
    cat = producer.get(node.input[1])
    if cat is None or cat.op_type != "Concat" or len(cat.input) != 4:
        return False
    heads, tokens, dim = (consts.get(cat.input[k]) for k in (1, 2, 3))
    if heads is None or dim is None or dim.reshape(-1).tolist() != [head_dim]:
        return False
    one_token = tokens is not None and tokens.reshape(-1).tolist() == [1]
    return heads.reshape(-1).tolist() == [num_heads] or (heads.reshape(-1).tolist() == [-1] and one_token)


def _elem_type(graph: onnx.GraphProto, producer: dict[str, onnx.NodeProto], layer: _Layer) -> int:
    """The cache's element type: that of the graph input its chain starts from."""
    return _cache_input(graph, producer, layer.value_write).type.tensor_type.elem_type


def _value(name: str, elem: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None)
