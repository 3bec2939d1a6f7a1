"""Rewrite weight MatMuls as `Gemm(transB=1)` over the weight in its stored [out, in] layout.

torch's exporter writes `x @ W.T` as MatMul against a pre-transposed copy of W (or, for a
tied LM head, against a Transpose of the embedding that ONNX Runtime folds into a second
copy of the table in memory). Gemm with transB=1 reads W as stored: the tied table stays one
buffer, and on this CPU the matrix-vector product streams about 1.3x faster (measured in
docs/benchmarks.md). Gemm is plain ONNX, so TensorRT's parser takes it too.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

logger = logging.getLogger("specgraph.exporters")


def matmul_to_gemm(path: Path, leading_input: str = "tokens",
                   drafters: tuple[tuple[str, str], ...] = ()) -> int:  # fmt: skip
    """Rewrite `path` (and its external data file) in place; return how many MatMuls changed.

    `drafters`: (parameter prefix, name prefix) of each drafter network: a product traced from a
    parameter whose name starts with the first (a drafter run on other token counts than
    `leading_input`'s, e.g. "p_draft_gm_") restores its leading dimensions from its own input,
    and its weight is renamed to start with the second ("draft_gm."), so later rewrites can tell
    each drafter's weights from the target's and from another drafter's (the exporter names
    folded weights val_N; a cascade's two copies of the target hold the same bytes)."""
    model = onnx.load(str(path))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    uses: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    ranks = _ranks(graph)
    shapes: dict[int, str] = {}
    new_nodes: list[onnx.NodeProto] = []
    changed = 0
    seen: dict[tuple, str] = {}  # type: ignore[type-arg]  # a module run several times: one weight, not one per run
    for node in graph.node:
        weight = _weight_out_in(node, inits, producers, uses) if node.op_type == "MatMul" else None
        owner = _owner(node, drafters) if weight is not None else ""
        if weight is not None and owner and not weight.startswith(owner):
            weight = _rename(graph, inits, weight, owner + weight)
        if weight is not None:
            weight = _shared(inits, weight, owner, seen)  # never another owner's weight
        own = bool(owner)
        rank = ranks.get(node.input[0]) if weight is not None else None
        if weight is None or rank not in (2, 3):
            new_nodes.append(node)
            continue
        out_features = _dims(inits[weight])[0]
        in_features = _dims(inits[weight])[1]
        new_nodes += _gemm_nodes(node, weight, rank, out_features, in_features, shapes, graph, own)
        changed += 1
    for n_out, shape_name in shapes.items():
        new_nodes[:0] = _output_shape_nodes(n_out, shape_name, leading_input)
    del graph.node[:]
    graph.node.extend(new_nodes)
    drop_dead(graph)
    data = path.name + ".data"
    (path.parent / data).unlink(missing_ok=True)
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data, size_threshold=1024
    )
    logger.debug("rewrote %d MatMuls as Gemm(transB=1)", changed)
    return changed


def _shared(inits: dict, name: str, owner: str, seen: dict) -> str:  # type: ignore[type-arg]
    """The first initializer of the same owner with the same dims and bytes as `name` (the
    exporter folds a separate transposed copy of a weight for every call of the module that reads it)."""
    t = inits[name]
    key = (owner, hashlib.blake2b(numpy_helper.to_array(t).tobytes(), digest_size=16).digest(), tuple(t.dims))
    return seen.setdefault(key, name)


def _owner(node: onnx.NodeProto, drafters: tuple[tuple[str, str], ...]) -> str:
    """The name prefix of the drafter whose parameter `node` was traced from; "" for the target."""
    traced = _traced_from(node)
    return next((name for param, name in drafters if param in traced), "")


def _traced_from(node: onnx.NodeProto) -> str:
    """The FX node the exporter recorded for `node` (its arguments name the parameters it read)."""
    return next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")


def _rename(graph: onnx.GraphProto, inits: dict, old: str, new: str) -> str:  # type: ignore[type-arg]
    """Rename initializer `old` to `new` everywhere it is read."""
    inits[old].name = new
    inits[new] = inits.pop(old)
    for n in graph.node:
        for i, name in enumerate(n.input):
            if name == old:
                n.input[i] = new
    return new


def _dims(t: onnx.TensorProto) -> list[int]:
    return list(t.dims)


def _ranks(graph: onnx.GraphProto) -> dict[str, int]:
    ranks = {}
    for v in list(graph.value_info) + list(graph.input) + list(graph.output):
        if v.type.tensor_type.HasField("shape"):
            ranks[v.name] = len(v.type.tensor_type.shape.dim)
    return ranks


def _weight_out_in(node, inits, producers, uses) -> str | None:  # type: ignore[no-untyped-def]
    """Name of an initializer holding this MatMul's weight as [out, in], creating it if needed."""
    b = node.input[1]
    if b in inits and len(inits[b].dims) == 2:
        if uses.get(b, 0) != 1:
            return None
        arr = numpy_helper.to_array(inits[b])  # [in, out]: the exporter's pre-transposed copy
        inits[b].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(arr.T), b))
        return b
    src = producers.get(b)
    if src is not None and src.op_type == "Transpose" and src.input[0] in inits:
        perm = next((list(a.ints) for a in src.attribute if a.name == "perm"), [1, 0])
        if perm == [1, 0] and len(inits[src.input[0]].dims) == 2:
            return src.input[0]  # already [out, in] (e.g. a tied embedding table)
    return None


def _gemm_nodes(node, weight, rank, n_out, in_features, shapes, graph, own=False) -> list[onnx.NodeProto]:  # type: ignore[no-untyped-def]
    a, y = node.input[0], node.output[0]
    if rank == 2:
        return [helper.make_node("Gemm", [a, weight], [y], name=node.name, transB=1)]
    flat_shape = f"{node.name}_flat_shape"
    graph.initializer.append(numpy_helper.from_array(np.asarray([-1, in_features], np.int64), flat_shape))
    if own:
        out_shape = f"{node.name}_out_shape"
        n = helper.make_node(
            "Constant", [], [f"{out_shape}_n"], value=numpy_helper.from_array(np.asarray([n_out], np.int64))
        )
        return [
            n,
            helper.make_node("Shape", [a], [f"{out_shape}_lead"], end=-1),
            helper.make_node("Concat", [f"{out_shape}_lead", f"{out_shape}_n"], [out_shape], axis=0),
            helper.make_node("Reshape", [a, flat_shape], [f"{a}_{node.name}_2d"], name=f"{node.name}_flatten"),
            helper.make_node("Gemm", [f"{a}_{node.name}_2d", weight], [f"{y}_2d"], name=node.name, transB=1),
            helper.make_node("Reshape", [f"{y}_2d", out_shape], [y], name=f"{node.name}_unflatten"),
        ]
    shapes.setdefault(n_out, f"_gemm_out_shape_{n_out}")
    return [
        helper.make_node("Reshape", [a, flat_shape], [f"{a}_{node.name}_2d"], name=f"{node.name}_flatten"),
        helper.make_node("Gemm", [f"{a}_{node.name}_2d", weight], [f"{y}_2d"], name=node.name, transB=1),
        helper.make_node("Reshape", [f"{y}_2d", shapes[n_out]], [y], name=f"{node.name}_unflatten"),
    ]


def _output_shape_nodes(n_out: int, name: str, leading_input: str) -> list[onnx.NodeProto]:
    """[B, T, n_out] from the shape of the engine's token input (every hidden state is [B, T, ...])."""
    const = helper.make_node(
        "Constant", [], [f"{name}_n"], value=numpy_helper.from_array(np.asarray([n_out], np.int64))
    )
    lead = helper.make_node("Shape", [leading_input], [f"{name}_bt"], end=2)
    cat = helper.make_node("Concat", [f"{name}_bt", f"{name}_n"], [name], axis=0)
    return [const, lead, cat]


def drop_dead(graph: onnx.GraphProto) -> None:
    """Remove nodes and initializers nothing reads any more (an `If` branch's reads count)."""
    live = {o.name for o in graph.output}
    keep = []
    for node in reversed(list(graph.node)):
        if any(o in live for o in node.output):
            keep.append(node)
            live.update([*node.input, *outer_reads(node)])
    del graph.node[:]
    graph.node.extend(reversed(keep))
    inits = [t for t in graph.initializer if t.name in live]
    del graph.initializer[:]
    graph.initializer.extend(inits)


def outer_reads(node: onnx.NodeProto) -> list[str]:
    """Names a node's subgraphs (If, Loop, Scan) read from the enclosing scope."""
    names: list[str] = []
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            made = {o for n in sub.node for o in n.output} | {i.name for i in sub.input}
            made |= {t.name for t in sub.initializer}
            for n in sub.node:
                names += [i for i in [*n.input, *outer_reads(n)] if i and i not in made]
    return names
