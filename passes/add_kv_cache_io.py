"""Add a preallocated KV cache, written in place, to every attention site.

Requires: `insert_tree_attention` has run (each SDPA site reads `attn_mask [B, 1, T, S]`), and
the anatomy names each site's un-repeated key and value sources `[B, Hkv, T, D]`.
Ensures: inputs `cache_len [B]` (int64, where this call's tokens are written), `attn_span [1]`
(int64, how many leading cache slots can be visible to any query) and, per site i,
`past_key_i [B, Hkv, D, S]` (keys stored transposed) and `past_value_i [B, Hkv, S, D]`; outputs
`present_key_i`, `present_value_i` of the same shapes, produced by `specgraph::kv_write`
(ONNX TensorScatter: in place when the host binds output to input); every SDPA site becomes
`specgraph::cache_attention` over the first `attn_span` slots, with no repeat of the cache for
grouped-query heads.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

import specgraph.ops  # noqa: F401  (registers specgraph::kv_write and specgraph::cache_attention)
from specgraph.passes._infra import PassContext, PassResult, add_placeholder, cleanup, output_values, set_outputs

logger = logging.getLogger("specgraph.passes")
_kv_write = torch.ops.specgraph.kv_write.default
_attention = torch.ops.specgraph.cache_attention.default


def add_kv_cache_io(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    cache_len = add_placeholder(gm, "cache_len")
    span = add_placeholder(gm, "attn_span")
    presents: list[torch.fx.Node] = []
    for i, site in enumerate(ctx.anatomy.sites):
        past_k = add_placeholder(gm, f"past_key_{i}")
        past_v = add_placeholder(gm, f"past_value_{i}")
        mask = site.node.kwargs["attn_mask"]
        with gm.graph.inserting_before(site.node):
            k_t = gm.graph.call_function(torch.ops.aten.transpose.int, (site.key_source, -1, -2))  # [B, Hkv, D, T]
            present_k = gm.graph.call_function(_kv_write, (past_k, k_t, cache_len, -1))  # [B, Hkv, D, S]
            present_v = gm.graph.call_function(_kv_write, (past_v, site.value_source, cache_len, -2))  # [B, Hkv, S, D]
            attn = gm.graph.call_function(_attention, (site.query, present_k, present_v, mask, span, site.scale))
        site.node.replace_all_uses_with(attn)
        gm.graph.erase_node(site.node)
        site.node = attn
        presents += [present_k, present_v]
    set_outputs(gm, output_values(gm) + presents)
    cleanup(gm)
    logger.debug("kv cache: added %d cache inputs and outputs", len(presents))
    return PassResult(gm, True, {"kv_inputs": len(presents), "kv_outputs": len(presents)})
