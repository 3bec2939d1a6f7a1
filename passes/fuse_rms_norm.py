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
    """Step over dtype casts that do not change the dtype."""
    while isinstance(node, torch.fx.Node) and node.target in _CASTS and len(node.users) == 1:
        src = node.args[0]
        if not isinstance(src, torch.fx.Node) or node.meta.get("val") is None or src.meta.get("val") is None:
            break
        if node.meta["val"].dtype != src.meta["val"].dtype:
            break
        node = src
    return node


def _call(value: object, target: object) -> torch.fx.Node | None:
    """`value` if it is a node calling `target`, else None."""
    return value if isinstance(value, torch.fx.Node) and value.target == target else None


def _match(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, float] | None:
    """weight * cast(x * rsqrt(mean(x**2) + eps)) -> (x, weight, eps)."""
    if node.target != aten.mul.Tensor or len(node.args) != 2:
        return None
    for weight, normed in (node.args, node.args[::-1]):
        if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"):
            continue
        scaled = _call(_skip_casts(normed), aten.mul.Tensor)
        rsqrt = _call(scaled.args[1], aten.rsqrt.default) if scaled is not None else None
        add = _call(rsqrt.args[0], aten.add.Tensor) if rsqrt is not None else None
        mean = _call(add.args[0], aten.mean.dim) if add is not None else None
        square = _call(mean.args[0], aten.pow.Tensor_Scalar) if mean is not None else None
        if scaled is None or add is None or mean is None or square is None:
            continue
        x, eps = scaled.args[0], add.args[1]
        if not isinstance(x, torch.fx.Node) or not isinstance(eps, float) or list(mean.args[1]) != [-1]:  # type: ignore[arg-type]
            continue
        if square.args[0] is not x or square.args[1] != 2:
            continue
        val = x.meta.get("val")
        if val is None or val.dtype != torch.float32:
            return None
        return x, weight, eps
    return None
