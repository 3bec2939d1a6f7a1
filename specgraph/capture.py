"""Stage 2: normalise every loaded model to one ATen-level graph `input_ids -> logits`.

Hugging Face models are traced with `torch.export` (SDPA attention, no cache); a user's
`torch.export` program is taken as it is. Both end as a plain `torch.fx.GraphModule` whose
only input is `input_ids [B, T]` and whose only output is `logits [B, T, V]`, which is what
the passes rewrite.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.fx

from specgraph.errors import AnatomyError

if TYPE_CHECKING:
    from specgraph.loaders import LoadedModel

logger = logging.getLogger("specgraph.capture")

# Example sizes for tracing: neither may be 1, or torch.export specialises the dimension.
_EXAMPLE_BATCH = 2
_EXAMPLE_TOKENS = 8


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
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
