"""Put a drafter's nodes inside an ONNX `If`, so a call in which no row drafts skips them.

The engine is exported with the drafter always running; this last rewrite moves every node that
only the drafter's outputs need (its runs, its readouts, its draws, the concatenation of the next
round's tokens) into the `then` branch of one `If` whose condition is `max(count) > 0`, `count`
being the per-row draft count the host trims `next_tokens` by. The `else` branch passes the
drafter's state through unchanged and makes `next_tokens` the bonus repeated: with every count 0
the host sends only its first column. Nothing the target computes moves, so verification and the
emitted tokens are the same whichever branch runs.

It runs after every other rewrite (Gemm, weight blocks, the drafter's quantisation): those see
the main graph only, and the branch reads their initializers from the outer scope.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from specgraph.exporters.gemm import outer_reads


def gate_drafter(path: Path, drafter_outputs: list[str], passthrough: dict[str, str], count: str, tokens: str) -> int:
    """Rewrite `path` in place (its external data is untouched); return how many nodes moved.

    drafter_outputs: the graph outputs only the drafter computes (its state and `tokens`);
    passthrough: each drafter state output -> the input the `else` branch passes on instead;
    count: the [B] output whose maximum decides; tokens: the next-round tokens output, a Concat
    whose first input is the bonus."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    others = [o.name for o in graph.output if o.name not in drafter_outputs]
    shared = _slice(graph, producer, others)
    mine = _slice(graph, producer, drafter_outputs)
    moved = [n for n in graph.node if id(n) in mine and id(n) not in shared]
    moved_ids = {id(n) for n in moved}
    concat = producer[tokens]
    if concat.op_type != "Concat" or id(concat) not in moved_ids:
        raise ValueError(f"{tokens} is not a Concat of the drafter's tokens")
    declared = {o.name: o for o in graph.output}
    then_outputs, else_nodes, else_outputs = [], [], []
    rename = {name: f"{name}__then" for name in drafter_outputs}
    for node in moved:  # inside the branch the outputs have names of their own (readers included)
        node.output[:] = [rename.get(o, o) for o in node.output]
        node.input[:] = [rename.get(i, i) for i in node.input]
    for name in drafter_outputs:
        then_outputs.append(_like(declared[name], rename[name]))
        out = f"{name}__else"
        if name == tokens:
            width = len(concat.input)
            else_nodes.append(helper.make_node("Concat", [concat.input[0]] * width, [out], axis=1))
        else:
            else_nodes.append(helper.make_node("Identity", [passthrough[name]], [out]))
        else_outputs.append(_like(declared[name], out))
    then_graph = helper.make_graph(moved, "drafting", [], then_outputs)
    else_graph = helper.make_graph(else_nodes, "idle", [], else_outputs)
    most = helper.make_node("ReduceMax", [count], [f"{count}__max"], keepdims=0)
    zero = helper.make_node(
        "Constant", [], [f"{count}__zero"], value=helper.make_tensor("z", onnx.TensorProto.INT64, [], [0])
    )
    cond = helper.make_node("Greater", [f"{count}__max", f"{count}__zero"], [f"{count}__any"])
    gate = helper.make_node("If", [f"{count}__any"], list(drafter_outputs), name="draft_gate",
                            then_branch=then_graph, else_branch=else_graph)  # fmt: skip
    kept = [n for n in graph.node if id(n) not in moved_ids]
    del graph.node[:]
    graph.node.extend([*kept, most, zero, cond, gate])
    onnx.save_model(model, str(path))
    return len(moved)


def _slice(graph: onnx.GraphProto, producer: dict, names: list[str]) -> set[int]:  # type: ignore[type-arg]
    """ids of the nodes the values `names` depend on (subgraph reads of outer values included)."""
    seen: set[int] = set()
    stack = [producer[n] for n in names if n in producer]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for name in [*node.input, *outer_reads(node)]:
            if name in producer:
                stack.append(producer[name])
    return seen


def _like(value: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    copy.name = name
    return copy
