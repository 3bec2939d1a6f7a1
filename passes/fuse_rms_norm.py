"""Replace decomposed RMSNorm (pow, mean, add eps, rsqrt, mul, mul by weight) with `aten.rms_norm`.

Requires: nothing beyond an ATen graph; a norm is matched only in the exact Hugging Face form
`weight * (x * rsqrt(mean(x**2, -1, keepdim) + eps))` with a parameter `weight` of the last
dimension's size (dtype casts between the steps are allowed when they do not change dtype).
Ensures: each match is one `aten.rms_norm(x, [H], weight, eps)`, which exports as ONNX
`RMSNormalization` (opset 23): one kernel instead of about seven per norm. Values are the same
up to float rounding order. Norms of other forms (Gemma's `1 + weight`) are left alone.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from specgraph.passes._infra import PassContext, PassResult, cleanup

logger = logging.getLogger("specgraph.passes")
aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default)


def fuse_rms_norm(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    fused = 0
    for node in list(gm.graph.nodes):
        match = _match(gm, node)
        if match is None:
            continue
        x, weight, eps = match
        with gm.graph.inserting_before(node):
            size = [int(weight.meta["val"].shape[0])]
            norm = gm.graph.call_function(aten.rms_norm.default, (x, size, weight, eps))
        norm.meta = dict(node.meta)
        node.replace_all_uses_with(norm)
        fused += 1
    if fused:
        cleanup(gm)
    logger.debug("fused %d RMSNorms", fused)
    return PassResult(gm, fused > 0, {"fused_norms": fused})


def _skip_casts(node: object) -> object:
    while isinstance(node, torch.fx.Node) and node.target in _CASTS and len(node.users) == 1:
        if node.meta.get("val") is None or node.args[0].meta.get("val") is None:
            break
        if node.meta["val"].dtype != node.args[0].meta["val"].dtype:
            break
        node = node.args[0]
    return node


def _match(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, float] | None:
    """weight * cast(x * rsqrt(mean(x**2) + eps)) -> (x, weight, eps)."""
    if node.target != aten.mul.Tensor or len(node.args) != 2:
        return None
    for weight, normed in (node.args, node.args[::-1]):
        if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"):
            continue
        scaled = _skip_casts(normed)
        if not (isinstance(scaled, torch.fx.Node) and scaled.target == aten.mul.Tensor):
            continue
        x, rsqrt = scaled.args
        if not (isinstance(rsqrt, torch.fx.Node) and rsqrt.target == aten.rsqrt.default):
            continue
        add = rsqrt.args[0]
        if not (isinstance(add, torch.fx.Node) and add.target == aten.add.Tensor and isinstance(add.args[1], float)):
            continue
        mean = add.args[0]
        if not (isinstance(mean, torch.fx.Node) and mean.target == aten.mean.dim and list(mean.args[1]) == [-1]):
            continue
        square = mean.args[0]
        if not (isinstance(square, torch.fx.Node) and square.target == aten.pow.Tensor_Scalar):
            continue
        if square.args[0] is not x or square.args[1] != 2:
            continue
        if x.meta.get("val") is None or x.meta["val"].dtype != torch.float32:
            return None
        return x, weight, float(add.args[1])
    return None
