"""Put a drafter's nodes inside an ONNX `If`, so a call in which no row drafts skips them.

The engine is exported with the drafter always running; this last rewrite moves every node that
only the drafter's outputs need (its runs, its readouts, its draws, the concatenation of the next
round's tokens) into the `then` branch of one `If` whose condition is `max(count) > 0`, `count`
being the per-row draft count the host trims `next_tokens` by. The `else` branch passes the
drafter's state through unchanged and makes `next_tokens` the bonus repeated: with every count 0
the host sends only its first column. Nothing the target computes moves, so verification and the
emitted tokens are the same whichever branch runs.

A drafter that runs only in some calls would keep a hole in its cache for every token committed in
the others: its catch-up covers the call it runs in, not the ones it skipped. Where the drafter's
layers are the target's own (`--draft self:int4`, early exit's first E layers), `fill` names, for
each such drafter cache, the target cache whose layout it shares: the `else` branch then writes the
slots this call's tokens took in the target's cache (its keys and values of the committed tokens,
from `cache_len` on) into the drafter's, so the drafter reads the target's keys and values for
the tokens of a round it skipped instead of stale slots (docs/benchmarks.md, the draft-model
section: without it a self-draft's acceptance after idle rounds fell by up to half). ONNX's form
of the fill takes a GatherElements and a TensorScatter a cache (120 nodes for the default model's
int4 copy); a bundle that already loads specgraph's kernel library takes one `specgraph.CopySlots`
node for all of them (host/src/kernels/ort_op.cpp), writing the same slots in place.

It runs after every other rewrite (Gemm, weight blocks, the drafter's quantisation): those see
the main graph only, and the branch reads their initializers from the outer scope.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from specgraph.exporters.gemm import outer_reads
from specgraph.exporters.nbits import NATIVE_DOMAIN


def gate_drafter(path: Path, drafter_outputs: list[str], passthrough: dict[str, str], count: str, tokens: str,
                 fill: dict[str, str] | None = None) -> tuple[int, int]:  # fmt: skip
    """Rewrite `path` in place (its external data is untouched); return how many nodes moved and
    how many drafter caches the idle branch fills.

    drafter_outputs: the graph outputs only the drafter computes (its state and `tokens`);
    passthrough: each drafter state output -> the input the `else` branch passes on instead;
    count: the [B] output whose maximum decides; tokens: the next-round tokens output, a Concat
    whose first input is the bonus; fill: drafter cache output -> the target cache output whose
    slots from `cache_len` the `else` branch writes into it (where both are [B, Hkv, S, D] alike,
    `_same_cache`; any other cache is passed through)."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    others = [o.name for o in graph.output if o.name not in drafter_outputs]
    shared = upstream(producer, others)
    mine = upstream(producer, drafter_outputs)
    moved = [n for n in graph.node if id(n) in mine and id(n) not in shared]
    moved_ids = {id(n) for n in moved}
    concat = producer[tokens]
    if concat.op_type != "Concat" or id(concat) not in moved_ids:
        raise ValueError(f"{tokens} is not a Concat of the drafter's tokens")
    declared = {v.name: v for v in [*graph.input, *graph.output]}
    then_outputs, else_nodes, else_outputs = [], [], []
    fillable = {
        name: target for name, target in (fill or {}).items() if _same_cache(declared, passthrough[name], target)
    }
    # a bundle that runs specgraph's kernels fills every cache in one `specgraph.CopySlots` node;
    # ONNX's form takes a GatherElements and a TensorScatter a cache, about 2 us a node here
    native = any(o.domain == NATIVE_DOMAIN for o in model.opset_import)
    if fillable and native:
        pairs = [name for drafter, target in fillable.items() for name in (target, passthrough[drafter])]
        outs = [f"{name}__else" for name in fillable]
        else_nodes.append(helper.make_node("CopySlots", [_CACHE_LEN, _TOKENS, *pairs], outs, domain=NATIVE_DOMAIN))
    elif fillable:
        else_nodes += _slot_index(declared[next(iter(fillable.values()))])
    rename = {name: f"{name}__then" for name in drafter_outputs}
    for node in moved:  # inside the branch the outputs have names of their own (readers included)
        node.output[:] = [rename.get(o, o) for o in node.output]
        _rename_reads(node, rename)
    for name in drafter_outputs:
        then_outputs.append(_like(declared[name], rename[name]))
        out = f"{name}__else"
        if name == tokens:
            width = len(concat.input)
            else_nodes.append(helper.make_node("Concat", [concat.input[0]] * width, [out], axis=1))
        elif name in fillable:
            if not native:  # (natively the CopySlots node above writes it)
                taken = f"{name}__slots"  # the target's keys or values of this call's tokens [B, Hkv, T, D]
                else_nodes.append(helper.make_node("GatherElements", [fillable[name], _SLOTS], [taken], axis=2))
                else_nodes.append(helper.make_node("TensorScatter", [passthrough[name], taken, _CACHE_LEN], [out],
                                                   axis=2))  # fmt: skip
        else:
            else_nodes.append(helper.make_node("Identity", [passthrough[name]], [out]))
        else_outputs.append(_like(declared[name], out))
    then_graph = helper.make_graph(moved, "drafting", [], then_outputs)
    else_graph = helper.make_graph(else_nodes, "idle", [], else_outputs)
    kept = [n for n in graph.node if id(n) in shared]
    _move_own_initializers(graph, then_graph, [*kept, *else_nodes])
    most = helper.make_node("ReduceMax", [count], [f"{count}__max"], keepdims=0)
    zero = helper.make_node(
        "Constant", [], [f"{count}__zero"], value=helper.make_tensor("z", onnx.TensorProto.INT64, [], [0])
    )
    cond = helper.make_node("Greater", [f"{count}__max", f"{count}__zero"], [f"{count}__any"])
    gate = helper.make_node("If", [f"{count}__any"], list(drafter_outputs), name="draft_gate",
                            then_branch=then_graph, else_branch=else_graph)  # fmt: skip
    # what neither side needs goes: the exporter can leave dead nodes (a Gemma-3 early-exit
    # engine's unused Unsqueeze of a drafter value), and one left outside would read a value that
    # now exists only inside the branch
    del graph.node[:]
    graph.node.extend([*kept, most, zero, cond, gate])
    onnx.save_model(model, str(path))
    return len(moved), len(fillable)


_TOKENS, _CACHE_LEN = "tokens", "cache_len"  # the step engine's inputs (specgraph/step.py)
_SLOTS = "gate_fill_slots"  # [B, Hkv, T, D] int64: cache_len[b] + t, the slots this call wrote


def _rename_reads(node: onnx.NodeProto, rename: dict[str, str]) -> None:
    """Rename what `node` reads, its subgraphs' reads of the enclosing scope included (a fused
    attention's `If` reads the cache a drafter's catch-up wrote, which is also an output)."""
    node.input[:] = [rename.get(i, i) for i in node.input]
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            made = {o for n in sub.node for o in n.output} | {t.name for t in sub.initializer}
            inner = {k: v for k, v in rename.items() if k not in made}
            for n in sub.node:
                _rename_reads(n, inner)
            for out in sub.output:
                out.name = inner.get(out.name, out.name)


def _move_own_initializers(graph: onnx.GraphProto, branch: onnx.GraphProto, others: list[onnx.NodeProto]) -> None:
    """Make the initializers that only `branch` reads its own. ONNX Runtime hands an `If` every
    outer value its branches read as a feed on every call, taken branch or not: EAGLE's weights
    cost about 4% of an idle step at the stored weights here (docs/benchmarks.md); a branch's
    own initializers are loaded once with it."""
    elsewhere = {i for n in others for i in [*n.input, *outer_reads(n)]}
    elsewhere |= {v.name for v in [*graph.input, *graph.output]}
    mine = {i for n in branch.node for i in [*n.input, *outer_reads(n)]} - elsewhere
    own = [t for t in graph.initializer if t.name in mine]
    if not own:
        return
    branch.initializer.extend(own)
    names = {t.name for t in own}
    kept = [t for t in graph.initializer if t.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _same_cache(values: dict[str, onnx.ValueInfoProto], drafter: str, target: str) -> bool:
    """Whether the drafter's cache input `drafter` and the target's cache output `target` have the
    same sizes with the sequence on axis 2: a value cache is [B, Hkv, S, D]; a key cache only
    counts where it is laid out as its layer's values are (a fused attention's), not transposed
    ([B, Hkv, D, S], the generic layers'), which S == D would make ambiguous."""
    if target not in values or drafter not in values:
        return False
    a, b = (_dims(values[n]) for n in (drafter, target))
    if len(a) != 4 or a[1:] != b[1:] or not all(isinstance(d, int) for d in a[1:]):
        return False
    if "_key_" not in drafter:
        return True
    layer_values = drafter.replace("_key_", "_value_")
    return layer_values in values and _dims(values[layer_values])[1:] == a[1:] and a[2] != a[3]


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _slot_index(cache: onnx.ValueInfoProto) -> list[onnx.NodeProto]:
    """Nodes computing `_SLOTS` for caches shaped like `cache`: [B, Hkv, T, D] of cache_len[b] + t."""
    shape = _dims(cache)  # [B, Hkv, S, D], `_same_cache` checked that all but B are numbers
    heads, dim = int(shape[1]), int(shape[3])
    mk, i64 = helper.make_node, onnx.TensorProto.INT64
    const = lambda name, values, dims=None: mk("Constant", [], [name], value=helper.make_tensor(  # noqa: E731
        name, i64, [len(values)] if dims is None else dims, values))  # fmt: skip
    return [
        const("gate_fill_zero", [0], []),
        const("gate_fill_one", [1], []),
        const("gate_fill_axes", [1], [1]),
        const("gate_fill_axes13", [1, 3]),
        mk("Shape", [_TOKENS], ["gate_fill_tshape"], start=1, end=2),
        mk("Squeeze", ["gate_fill_tshape"], ["gate_fill_t"]),
        mk("Range", ["gate_fill_zero", "gate_fill_t", "gate_fill_one"], ["gate_fill_steps"]),  # [T]
        mk("Unsqueeze", [_CACHE_LEN, "gate_fill_axes"], ["gate_fill_start"]),  # [B, 1]
        mk("Add", ["gate_fill_start", "gate_fill_steps"], ["gate_fill_at"]),  # [B, T]
        mk("Unsqueeze", ["gate_fill_at", "gate_fill_axes13"], ["gate_fill_at4"]),  # [B, 1, T, 1]
        mk("Shape", ["gate_fill_at4"], ["gate_fill_bt"]),
        const("gate_fill_keep", [1, 0, 1, 0]),
        const("gate_fill_hd", [0, heads, 0, dim]),
        mk("Mul", ["gate_fill_bt", "gate_fill_keep"], ["gate_fill_bt0"]),
        mk("Add", ["gate_fill_bt0", "gate_fill_hd"], ["gate_fill_shape"]),  # [B, Hkv, T, D]
        mk("Expand", ["gate_fill_at4", "gate_fill_shape"], [_SLOTS]),
    ]


def upstream(producer: dict, names: list[str], reads: dict[int, list[str]] | None = None) -> set[int]:  # type: ignore[type-arg]
    """ids of the nodes the values `names` depend on (subgraph reads of outer values included);
    `reads` maps a node's id to the inputs it is taken to read instead (exporters/draft_stop.py:
    a `Where` that picks a later step's value counts only its condition and its other value)."""
    reads = reads or {}
    seen: set[int] = set()
    stack = [producer[n] for n in names if n in producer]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for name in reads.get(id(node), [*node.input, *outer_reads(node)]):
            if name in producer:
                stack.append(producer[name])
    return seen


def _like(value: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    copy.name = name
    return copy
