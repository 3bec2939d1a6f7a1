"""Stage 2: normalise every loaded model to one ATen-level graph `input_ids -> logits`.

Hugging Face models are traced with `torch.export` (SDPA attention, no cache); a user's
`torch.export` program is taken as it is. Both end as a plain `torch.fx.GraphModule` whose
only input is `input_ids [B, T]` and whose only output is `logits [B, T, V]`, which is what
the passes rewrite.

A program traced with a static batch (the usual `torch.export.export(m, (ids,),
dynamic_shapes=({1: Dim("seq")},))` on a batch-1 example) has that batch written into its
view/reshape/expand shapes. The engine's batch is dynamic, so capture writes `input_ids.size(0)`
where those literals stand for the batch, then checks in eager that a batch of two gives each
row's batch-1 logits; a graph that still does not is refused with what to re-export.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from specgraph.errors import AnatomyError

if TYPE_CHECKING:
    from specgraph.loaders import LoadedModel

logger = logging.getLogger("specgraph.capture")
aten = torch.ops.aten

# Example sizes for tracing: neither may be 1, or torch.export specialises the dimension.
_EXAMPLE_BATCH = 2
_EXAMPLE_TOKENS = 8
_TO_THE_END = 2**62  # a slice end at or past this keeps the rest of the dimension
_SHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_NEW_OPS = {aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default}
_REEXPORT = "re-export with a dynamic batch dimension: dynamic_shapes=({0: Dim('batch'), 1: Dim('seq')},)"


class _LogitsOnly(torch.nn.Module):
    """Wrap a causal LM so the traced forward is exactly `input_ids -> logits`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def export_hf(model: torch.nn.Module, max_tokens: int) -> torch.export.ExportedProgram:
    """Trace a Hugging Face causal LM with dynamic batch and sequence dimensions."""
    batch = torch.export.Dim("batch", min=1, max=64)
    tokens = torch.export.Dim("tokens", min=1, max=max(max_tokens, _EXAMPLE_TOKENS + 1))
    example = torch.zeros(_EXAMPLE_BATCH, _EXAMPLE_TOKENS, dtype=torch.long)
    with torch.no_grad():
        return torch.export.export(
            _LogitsOnly(model).eval(), (example,), dynamic_shapes={"input_ids": {0: batch, 1: tokens}}
        )


def capture(loaded: LoadedModel, max_tokens: int) -> torch.fx.GraphModule:
    """Return the model as a plain GraphModule `input_ids -> (logits,)`."""
    if loaded.program is not None:
        program = loaded.program
    elif loaded.hf_model is not None:
        program = export_hf(loaded.hf_model, max_tokens)
    else:
        raise AnatomyError(f"{loaded.name}: nothing to capture (neither a program nor a model)")
    return to_plain_graph_module(program)


def to_plain_graph_module(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """Unlift parameters into attributes and drop pytree plumbing and guards."""
    gm = program.module()
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm._forward_pre_hooks.clear()  # input-spec checks for the old signature
    gm._forward_hooks.clear()
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise AnatomyError(f"expected one graph input (input_ids), found {len(inputs)}: {[n.name for n in inputs]}")
    inputs[0].name = "input_ids"
    inputs[0].target = "input_ids"
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0]
    vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    if len(vals) != 1:
        raise AnatomyError(f"expected one graph output (logits), found {len(vals)}")
    out.args = (tuple(vals),)
    dropped = _drop_no_ops(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    if dropped:
        logger.debug("dropped %d no-op slices and empty concatenations", dropped)
    _generalise_batch(gm, inputs[0])
    return gm


def _shape(node: Any) -> tuple[Any, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _drop_no_ops(gm: torch.fx.GraphModule) -> int:
    """Bypass slices that keep a whole dimension and concatenations with legacy empty `[0]`
    tensors (an empty HF cache, when traced with `use_cache=True`): both hide the parts anatomy
    looks for (the repeat of grouped KV heads, the final norm) in a batch-1 program."""
    count = 0
    for node in list(gm.graph.nodes):
        keep = None
        if node.op == "call_function" and node.target == aten.slice.Tensor and _keeps_all(node):
            keep = node.args[0]
        elif node.op == "call_function" and node.target == aten.cat.default:
            parts = [p for p in node.args[0] if _shape(p) != (0,)]  # type: ignore[union-attr]
            if len(parts) == 1 and len(parts) < len(node.args[0]):  # type: ignore[arg-type]
                keep = parts[0]
        if isinstance(keep, torch.fx.Node):
            node.replace_all_uses_with(keep)
            count += 1
    return count


def _keeps_all(node: torch.fx.Node) -> bool:
    """Is `aten.slice(x, dim, start, end, step)` `x[..., 0:]`? An end equal to a static size is
    not enough: that size may be the traced batch, and the slice must then still cut."""
    args = node.args  # x, dim, start = 0, end = None, step = 1
    start, end, step = (args[2] if len(args) > 2 else 0), (args[3] if len(args) > 3 else None), args[4:] or (1,)
    if start not in (0, None) or step != (1,):
        return False
    return end is None or (isinstance(end, int) and end >= _TO_THE_END)


def _generalise_batch(gm: torch.fx.GraphModule, ids: torch.fx.Node) -> None:
    """Make a program traced at a static batch run at any batch, or refuse it in one line."""
    shape = _shape(ids)
    if shape is None or len(shape) != 2:
        return
    batch, tokens = shape
    if isinstance(tokens, int):  # every shape downstream holds the traced length
        raise AnatomyError(f"input_ids was traced with a static sequence length ({tokens}): {_REEXPORT}")
    if not isinstance(batch, int):
        return  # a dynamic batch: the graph is batch-general already
    with gm.graph.inserting_after(ids):
        size = gm.graph.call_function(aten.sym_size.int, (ids, 0))  # B, at run time
    size.meta["val"] = batch
    rewritten = 0
    major = _batch_major(gm, ids, batch)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SHAPE_OPS | _NEW_OPS or node.args[0] not in major:
            continue
        dims = list(node.args[1])  # type: ignore[arg-type]
        if dims and isinstance(dims[0], int) and dims[0] == batch:
            node.args = (node.args[0], [size, *dims[1:]], *node.args[2:])
            rewritten += 1
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    logger.debug("traced batch %d: %d shapes now read the batch from input_ids", batch, rewritten)
    _check_batch_general(gm, batch)


def _batch_major(gm: torch.fx.GraphModule, ids: torch.fx.Node, batch: int) -> set[torch.fx.Node]:
    """Tensors whose dim 0 is input_ids' batch: computed from one that is, with dim 0 still of the
    traced batch size and not moved by a transpose or permute."""
    major = {ids}
    for node in gm.graph.nodes:
        shape = _shape(node)
        if node.op != "call_function" or not shape or not isinstance(shape[0], int) or shape[0] != batch:
            continue
        if not any(a in major for a in node.all_input_nodes):
            continue
        if node.target == aten.transpose.int and 0 in [d % len(shape) for d in node.args[1:3]]:  # type: ignore[operator]
            continue
        if node.target == aten.permute.default and node.args[1][0] % len(shape) != 0:  # type: ignore[index]
            continue
        major.add(node)
    return major


def _check_batch_general(gm: torch.fx.GraphModule, batch: int) -> None:
    """Twice the traced batch at once must give each half's logits at the traced batch; if not,
    a shape or a constant still holds the traced batch, and the program is refused."""
    vocab = int(_shape(next(n for n in gm.graph.nodes if n.op == "output").args[0][0])[-1])  # type: ignore[index]
    ids = torch.randint(0, vocab, (2 * batch, 4), generator=torch.Generator().manual_seed(0))  # [2b, T]
    refusal = f"this program was traced at batch {batch} and does not run at batch {2 * batch}: {_REEXPORT}"
    try:
        with torch.no_grad():
            both = gm(ids)[0]  # [2b, T, V]
            halves = torch.cat([gm(ids[:batch])[0], gm(ids[batch:])[0]])  # [2b, T, V]
    except Exception as exc:  # whatever a leftover shape raises
        raise AnatomyError(refusal) from exc
    scale = float(halves.abs().max()) or 1.0
    if both.shape != halves.shape or float((both - halves).abs().max()) > 1e-4 * scale:
        raise AnatomyError(refusal)
