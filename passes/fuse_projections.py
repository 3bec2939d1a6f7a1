"""Merge linear layers that read the same tensor into one wider linear (Q/K/V, gate/up).

Requires: `aten.linear` nodes whose weights (and biases, if any) are graph attributes.
Ensures: each group of two or more such linears on one input becomes a single linear over
the concatenated weight, followed by a split; every consumer reads the same values as before
(each output column is the same dot product; only float summation order may differ). At batch 1 a step reads every
weight once, so fewer, wider matrix-vector products run closer to memory bandwidth.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from specgraph.passes._infra import PassContext, PassResult, cleanup

logger = logging.getLogger("specgraph.passes")
_LINEAR = torch.ops.aten.linear.default


def fuse_projections(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    fused = 0
    for node in list(gm.graph.nodes):
        group = [u for u in node.users if u.target == _LINEAR and u.args[0] is node and _fusable(gm, u)]
        if len(group) < 2 or len({_has_bias(u) for u in group}) != 1:
            continue
        _fuse(gm, node, sorted(group, key=_order(gm)), fused)
        fused += 1
    if fused:
        cleanup(gm)
    logger.debug("fused %d groups of projections", fused)
    return PassResult(gm, fused > 0, {"fused_groups": fused})


def _order(gm: torch.fx.GraphModule):  # type: ignore[no-untyped-def]
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: index[n]


def _has_bias(node: torch.fx.Node) -> bool:
    return len(node.args) > 2 and node.args[2] is not None


def _fusable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    params = node.args[1:3] if _has_bias(node) else node.args[1:2]
    return all(isinstance(p, torch.fx.Node) and p.op == "get_attr" for p in params)


def _fuse(gm: torch.fx.GraphModule, source: torch.fx.Node, group: list[torch.fx.Node], index: int) -> None:
    weights = [_attr(gm, u.args[1]) for u in group]
    sizes = [int(w.shape[0]) for w in weights]
    name = f"_fused_projection_{index}"
    gm.register_parameter(f"{name}_weight", torch.nn.Parameter(torch.cat(weights, 0).detach(), requires_grad=False))
    bias_name = None
    if _has_bias(group[0]):
        bias = torch.cat([_attr(gm, u.args[2]) for u in group], 0).detach()
        bias_name = f"{name}_bias"
        gm.register_parameter(bias_name, torch.nn.Parameter(bias, requires_grad=False))
    first = group[0]
    with gm.graph.inserting_before(first):
        w = gm.graph.get_attr(f"{name}_weight")
        args = (source, w, gm.graph.get_attr(bias_name)) if bias_name else (source, w)
        wide = gm.graph.call_function(_LINEAR, args)  # [..., sum(sizes)]
        wide.meta = dict(first.meta)
        parts = gm.graph.call_function(torch.ops.aten.split_with_sizes.default, (wide, sizes, -1))
        for i, user in enumerate(group):
            piece = gm.graph.call_function(operator.getitem, (parts, i))
            piece.meta = dict(user.meta)
            user.replace_all_uses_with(piece)
    for user in group:
        gm.graph.erase_node(user)


def _attr(gm: torch.fx.GraphModule, node: object) -> torch.Tensor:
    assert isinstance(node, torch.fx.Node)
    obj: object = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    assert isinstance(obj, torch.Tensor)
    return obj
