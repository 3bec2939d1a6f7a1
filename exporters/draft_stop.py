"""Stop a drafter's loop early: each `DraftStop` mark becomes an ONNX `If` around the later steps.

With `--draft-confidence`, an engine's draft loop marks, after each draft i < K, whether any row
may still send draft i + 1 (`specgraph::draft_stop` in specgraph/ops.py; `ModelDrafts._chain`),
and picks every value the later steps produce with a `Where` on that mark: the step's value, or
what stopping leaves. Exported as written, every step runs in every call. This rewrite turns
each mark and its `Where`s into one `If` whose `then` branch holds every node only those values
need (the later steps, their readouts and draws, and the next mark's `If`) and whose `else`
branch passes on the stopping values, so a call in which no row is confident enough stops
drafting there (Kangaroo's second exit). The innermost mark goes first, so each `If` sits inside
the `then` branch of the one before it.

It runs after every other rewrite (weights, fusions, a drafter's quantisation), as
exporters/gate.py does: they see the main graph only.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from specgraph.exporters.gate import upstream
from specgraph.ops import STOP_DOMAIN


def stop_drafting_early(path: Path) -> list[int]:
    """Rewrite `path` in place (its external data untouched); return, for each mark from the
    first, how many nodes its `If` holds (those of later marks included)."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    marks = [n for n in graph.node if n.domain == STOP_DOMAIN]
    steps = {_step(n) for n in marks}
    if len(steps) != len(marks):
        raise ValueError("two DraftStop marks for one step")
    held = []
    for step in sorted(steps, reverse=True):  # the graph's node objects change with each rewrite
        held.append(_branch(graph, next(n for n in graph.node if n.domain == STOP_DOMAIN and _step(n) == step)))
    kept = [o for o in model.opset_import if o.domain != STOP_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    onnx.save_model(model, str(path))
    return held[::-1]


def _step(mark: onnx.NodeProto) -> int:
    return next(a.i for a in mark.attribute if a.name == "step")


def _branch(graph: onnx.GraphProto, mark: onnx.NodeProto) -> int:
    """Replace `mark` and the `Where`s on it by an `If`; return how many nodes its branch holds."""
    marked = mark.output[0]
    picks = [n for n in graph.node if marked in n.input]
    if not picks or any(n.op_type != "Where" or list(n.input).index(marked) != 0 for n in picks):
        raise ValueError(f"DraftStop {_step(mark)}: its mark must be read only as a Where's condition")
    pick_ids = {id(n) for n in picks}
    producer = {o: n for n in graph.node for o in n.output}
    # what the graph needs besides the later steps: a pick reads only its condition and its
    # stopping value there
    rest = upstream(producer, [o.name for o in graph.output], reads={id(n): [n.input[0], n.input[2]] for n in picks})
    later = upstream(producer, [n.input[1] for n in picks])
    moved = [n for n in graph.node if id(n) in later and id(n) not in rest]
    types = {v.name: v for v in [*graph.value_info, *graph.input, *graph.output]}
    step = _step(mark)
    then_nodes, then_outputs, else_nodes, else_outputs = list(moved), [], [], []
    for pick in picks:
        out = pick.output[0]
        went, stopped = f"{out}__went", f"{out}__stopped"
        then_nodes.append(helper.make_node("Identity", [pick.input[1]], [went]))
        else_nodes.append(helper.make_node("Identity", [pick.input[2]], [stopped]))
        then_outputs.append(_typed(types, out, pick.input[1], went))
        else_outputs.append(_typed(types, out, pick.input[2], stopped))
    then_graph = helper.make_graph(then_nodes, f"draft_after_{step}", [], then_outputs)
    _own_packed_weights(graph, then_graph, step)
    else_graph = helper.make_graph(else_nodes, f"draft_stop_{step}", [], else_outputs)
    branch = helper.make_node("If", [mark.input[0]], [p.output[0] for p in picks], name=f"draft_stop_{step}",
                              then_branch=then_graph, else_branch=else_graph)  # fmt: skip
    stale = {p.output[0] for p in picks}  # a key cache's declared layout may be the unfused one
    kept_info = [v for v in graph.value_info if v.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    # what neither side needs goes (a dead node left outside could read a value now inside)
    nodes, last = [], max(i for i, n in enumerate(graph.node) if id(n) in pick_ids)
    for i, node in enumerate(graph.node):
        if i == last:
            nodes.append(branch)
        elif id(node) in rest and id(node) not in pick_ids and id(node) != id(mark):
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return sum(_count(n) for n in moved)


def _own_packed_weights(graph: onnx.GraphProto, branch: onnx.GraphProto, step: int) -> None:
    """Give `branch` its own copy (same external data) of each initializer that its products read.
    ONNX Runtime packs a product's constant weight once, at load, only where the weight is an
    initializer of the product's own graph: read from the enclosing scope, `MatMulNBits` unpacks
    its blocks on every call, about 8x slower (measured on a self:int4 draft, docs/benchmarks.md).
    The copies cost memory (each is packed on its own), not bundle bytes."""
    inits = {t.name: t for t in graph.initializer}
    made: set[str] = set()
    for node in branch.node:
        if node.op_type not in _PACKED:
            continue
        for k, name in enumerate(node.input):
            if name not in inits:
                continue
            own = f"{name}__stop{step}"
            if own not in made:
                copy = onnx.TensorProto()
                copy.CopyFrom(inits[name])
                copy.name = own
                branch.initializer.append(copy)
                made.add(own)
            node.input[k] = own


_PACKED = {"MatMulNBits", "Gemm", "MatMul"}  # ONNX Runtime's CPU kernels that pack a constant weight at load


def _typed(types: dict[str, onnx.ValueInfoProto], *names: str) -> onnx.ValueInfoProto:
    """A value info named `names[-1]` with the element type of the first of `names` whose type
    is known (no shape: a key cache's fused layout is not the one the export declared)."""
    known = next((types[n] for n in names[:-1] if n in types), None)
    if known is None:
        raise ValueError(f"no type for {names[0]}")
    return helper.make_tensor_value_info(names[-1], known.type.tensor_type.elem_type, None)


def _count(node: onnx.NodeProto) -> int:
    """1, plus the nodes of its subgraphs."""
    subs = [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]
    return 1 + sum(_count(n) for g in subs for n in g.node)
