"""Skip the sampling operators' work in a call whose rows are all greedy: each one inside an ONNX `If`.

The ONNX forms of `specgraph::sample`, `specgraph::speculative` and `specgraph::propose`
(`sampling.py`) already compute nothing over the vocabulary when no row samples (their row count
R is 0), but they are still some 200 nodes each that ONNX Runtime dispatches on every call, on
empty tensors: a fifth of a plain SmolLM2 step's nodes and 6-9% of its time, and one more such
block for each draft an EAGLE or draft-model engine makes per round. In an all-greedy call each
of them returns the argmax of its logits (and `propose` a q of zeros), exactly, so this rewrite
moves each operator's nodes into the `then` branch of an `If` on "some row samples" whose `else`
branch is that argmax (one or three nodes).

Which nodes belong to an operator is read from the exporter's metadata (`pkg.torch.onnx.fx_node`
names the call each node came from). A node whose value is also read outside its operator (the
exporter's common-subexpression pass shares a few, such as the greedy-row test) stays in the
main graph; so does everything it needs. It runs right after the export's other rewrites; the
later ones (weight blocks, the drafter's gate) read `If` branches' outer-scope values.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from specgraph.exporters.gemm import outer_reads

logger = logging.getLogger("specgraph.exporters")
_OPS = ("sample", "speculative", "propose")
_CALL = re.compile(r"%(\w+) : .*target=torch\.ops\.specgraph\.(" + "|".join(_OPS) + r")\.default")
_ANY = "sampling.any_row"  # the If condition: bool scalar, some row's temperature is above 0


def skip_draws_when_greedy(path: Path) -> int:
    """Rewrite `path` in place (weights untouched); return how many nodes moved into branches."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    if "temperature" not in {i.name for i in graph.input}:
        return 0  # a greedy-only engine: no sampling operators
    calls: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        match = _CALL.match(props.get("pkg.torch.onnx.fx_node", ""))
        if match:
            calls[match.group(1)].append(node)
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in {*node.input, *outer_reads(node)}:
            readers[name].append(node)
    graph_outputs = {o.name for o in graph.output}
    gates: dict[int, onnx.NodeProto] = {}  # id of the call's last node -> its If
    moved_ids: set[int] = set()
    for call, nodes in calls.items():
        gate = _gate(call, nodes, readers, graph_outputs)
        if gate is not None:
            branch, node = gate
            moved_ids |= branch
            gates[id(nodes[-1])] = node
    if not gates:
        return 0
    cond = [
        helper.make_node("Constant", [], [f"{_ANY}.zero"], value=helper.make_tensor("z", TensorProto.FLOAT, [], [0.0])),
        helper.make_node("CastLike", [f"{_ANY}.zero", "temperature"], [f"{_ANY}.zero_t"]),
        helper.make_node("Greater", ["temperature", f"{_ANY}.zero_t"], [f"{_ANY}.rows"]),
        helper.make_node("Cast", [f"{_ANY}.rows"], [f"{_ANY}.int"], to=TensorProto.INT64),
        helper.make_node("ReduceMax", [f"{_ANY}.int"], [f"{_ANY}.max"], keepdims=0),
        helper.make_node("Cast", [f"{_ANY}.max"], [_ANY], to=TensorProto.BOOL),
    ]
    kept: list[onnx.NodeProto] = [*cond]
    for node in graph.node:
        if id(node) in gates:
            kept.append(gates[id(node)])
        if id(node) not in moved_ids:
            kept.append(node)
    kept, pulled = _pull_into_branches(kept, list(gates.values()), graph_outputs)
    del graph.node[:]
    graph.node.extend(_topological(kept, {i.name for i in graph.input} | {t.name for t in graph.initializer}))
    onnx.save_model(model, str(path))
    logger.debug("sampling operators skipped in greedy calls: %d, %d nodes moved, %d more pulled in", len(gates),
                 len(moved_ids), pulled)  # fmt: skip
    return len(moved_ids) + pulled


def _pull_into_branches(nodes: list[onnx.NodeProto], gates: list[onnx.NodeProto],
                        graph_outputs: set[str]) -> tuple[list[onnx.NodeProto], int]:  # fmt: skip
    """Move into a gate's drawing (`then`) branch every main-graph node whose values only that
    branch reads, transitively: the index work the step engine does around an operator (the
    general rule's window of drafts and proposals, `step._chain_targets`) then runs only in a
    call that samples. `nodes` are in topological order; returns the main graph's nodes left and
    how many moved."""
    then_of = {id(g): next(a.g for a in g.attribute if a.name == "then_branch") for g in gates}
    readers: dict[str, set[tuple[str, int]]] = defaultdict(set)  # name -> ("node", id) or ("then", gate id)
    for node in nodes:
        if id(node) in then_of:
            for name in _branch_reads(then_of[id(node)]):
                readers[name].add(("then", id(node)))
            else_branch = next(a.g for a in node.attribute if a.name == "else_branch")
            reads = [*node.input, *_branch_reads(else_branch)]
        else:
            reads = [*node.input, *outer_reads(node)]
        for name in reads:
            readers[name].add(("node", id(node)))
    moved: set[int] = set()
    for node in reversed(nodes):  # readers before what they read
        outs = [o for o in node.output if o]
        if id(node) in then_of or not outs or any(o in graph_outputs for o in outs):
            continue
        seen = set().union(*(readers[o] for o in outs))
        if len(seen) != 1 or next(iter(seen))[0] != "then":
            continue
        gate = next(iter(seen))[1]
        then_of[gate].node.insert(0, node)  # before its readers, which are in the branch already
        moved.add(id(node))
        for name in [*node.input, *outer_reads(node)]:
            readers[name].discard(("node", id(node)))
            readers[name].add(("then", gate))
    return [n for n in nodes if id(n) not in moved], len(moved)


def _branch_reads(branch: onnx.GraphProto) -> set[str]:
    """Names a branch reads from the enclosing scope."""
    made = {o for n in branch.node for o in n.output} | {i.name for i in branch.input}
    return {i for n in branch.node for i in [*n.input, *outer_reads(n)] if i and i not in made}


def _gate(call: str, nodes: list[onnx.NodeProto], readers: dict[str, list[onnx.NodeProto]],
          graph_outputs: set[str]) -> tuple[set[int], onnx.NodeProto] | None:  # fmt: skip
    """The If that replaces one operator's nodes, and the ids of the nodes it takes; None when
    the operator's nodes cannot be told apart (then it stays as exported)."""
    ends = {n.name: n for n in nodes if n.name == f"node_{call}" or n.name.startswith(f"node_{call}__")}
    outputs = [ends[name].output[0] for name in sorted(ends)]  # the operator's results, in order
    argmax = [n for n in nodes if n.op_type == "ArgMax"]
    if not outputs or len(outputs) > 2 or len(argmax) != 1:
        return None
    # nodes whose values only this operator reads (its results excepted) move; the rest stay
    branch = {id(n) for n in nodes}
    changed = True
    while changed:
        changed = False
        for node in nodes:
            if id(node) in branch and any(
                out not in outputs and (out in graph_outputs or any(id(r) not in branch for r in readers[out]))
                for out in node.output
            ):
                branch.discard(id(node))
                changed = True
    if not all(id(ends[name]) in branch for name in ends):
        return None
    moved = [n for n in nodes if id(n) in branch]
    rename = {o: f"{o}__then" for o in outputs}
    for node in moved:
        node.output[:] = [rename.get(o, o) for o in node.output]
        node.input[:] = [rename.get(i, i) for i in node.input]
    kinds = [TensorProto.INT64, TensorProto.FLOAT]  # a token id, then (propose) its q
    then_graph = helper.make_graph(moved, f"{call}.drawn", [],
                                   [helper.make_tensor_value_info(rename[o], kinds[i], None)
                                    for i, o in enumerate(outputs)])  # fmt: skip
    logits, axis = argmax[0].input[0], {a.name: helper.get_attribute_value(a) for a in argmax[0].attribute}
    greedy = [helper.make_node("ArgMax", [logits], [f"{outputs[0]}__else"], axis=axis.get("axis", 0),
                               keepdims=axis.get("keepdims", 1))]  # fmt: skip
    if len(outputs) == 2:  # propose: a greedy row carries q = 0 (logits' shape, float32)
        greedy += [
            helper.make_node("Shape", [logits], [f"{outputs[1]}__shape"]),
            helper.make_node("ConstantOfShape", [f"{outputs[1]}__shape"], [f"{outputs[1]}__else"],
                             value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])),
        ]  # fmt: skip
    else_graph = helper.make_graph(greedy, f"{call}.greedy", [],
                                   [helper.make_tensor_value_info(f"{o}__else", kinds[i], None)
                                    for i, o in enumerate(outputs)])  # fmt: skip
    node = helper.make_node("If", [_ANY], outputs, name=f"{call}.gate", then_branch=then_graph, else_branch=else_graph)
    return branch, node


def _topological(nodes: list[onnx.NodeProto], given: set[str]) -> list[onnx.NodeProto]:
    """`nodes` in an order where each comes after the producers of what it reads (its branches'
    outer-scope reads included), otherwise as listed."""
    producer = {o: n for n in nodes for o in n.output if o}
    done: set[int] = set()
    order: list[onnx.NodeProto] = []
    for start in nodes:
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in done:
                continue
            if expanded:
                done.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            for name in reversed([*node.input, *outer_reads(node)]):
                dep = producer.get(name)
                if dep is not None and id(dep) not in done and name not in given:
                    stack.append((dep, False))
    return order
