"""Make the attention mask and the position ids engine inputs (tree attention).

Requires: an anatomy whose `position_source` is an integer [1|B, T] tensor derived from an
arange, and SDPA attention sites masked causally (a mask tensor or `is_causal=True`).
Ensures: new inputs `position_ids [B, T]` (int64), `attn_mask [B, 1, T, S]` (bool) and, when
some layers use a sliding window, `attn_mask_local` of the same shape; every SDPA site reads
its mask from those inputs with `is_causal=False`; the model's own causal-mask construction
is gone. The same graph can then verify a chain or any tree of candidates: the caller places
each candidate at its depth and lets it see only its ancestors.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from specgraph.passes._infra import PassContext, PassResult, add_placeholder, cleanup

logger = logging.getLogger("specgraph.passes")


def insert_tree_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    anatomy = ctx.anatomy
    positions = add_placeholder(gm, "position_ids")
    mask = add_placeholder(gm, "attn_mask")
    local_mask = None
    if any(site.sliding_window for site in anatomy.sites):
        local_mask = add_placeholder(gm, "attn_mask_local")
    anatomy.position_source.replace_all_uses_with(positions)
    for site in anatomy.sites:
        args = list(site.node.args[:3])
        kwargs = {"attn_mask": local_mask if site.sliding_window else mask, "scale": site.scale}
        site.node.args = tuple(args)
        site.node.kwargs = kwargs
    anatomy.position_source = positions
    cleanup(gm)
    logger.debug("tree attention: %d sites now read attn_mask; positions are an input", len(anatomy.sites))
    return PassResult(gm, True, {"masked_sites": len(anatomy.sites), "inputs_added": 3 if local_mask else 2})
