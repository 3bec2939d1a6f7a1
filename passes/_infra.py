"""Shared pass infrastructure: the result type and the clean-up every mutating pass ends with."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

logger = logging.getLogger("specgraph.passes")

_CHECK_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


@dataclass
class PassResult:
    """What a pass returns: the (same, mutated) module, whether it changed, and counts."""

    graph_module: torch.fx.GraphModule
    modified: bool
    counts: dict[str, int] = field(default_factory=dict)


def cleanup(gm: torch.fx.GraphModule) -> None:
    """Drop pure checks, remove dead code, lint and recompile."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _CHECK_OPS:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def add_placeholder(gm: torch.fx.GraphModule, name: str, example: torch.Tensor | None = None) -> torch.fx.Node:
    """Append a graph input after the existing ones."""
    last = placeholders(gm)[-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(name)
    if example is not None:
        node.meta["val"] = example
    return node


def output_values(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0]
    return list(vals) if isinstance(vals, (tuple, list)) else [vals]


def set_outputs(gm: torch.fx.GraphModule, values: list[torch.fx.Node]) -> None:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (tuple(values),)


@dataclass(frozen=True)
class PassContext:
    """What every pass may read: the recognised anatomy and the cache length."""

    anatomy: Anatomy
    max_context: int
    drafter: Any = None  # what the method's `prepare` loaded (add_medusa_heads attaches Medusa heads)


from specgraph.anatomy import Anatomy  # noqa: E402  (types used in the annotations above)
