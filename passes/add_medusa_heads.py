"""Attach Medusa heads to the target and expose the hidden state they read.

Requires: an anatomy whose `lm_head` is a linear on the final-norm output `[B, T, H]`.
Ensures: the graph gains one output, `hidden [B, T, H]` (the LM head's input), appended after
the existing ones; `gm.medusa_heads` holds the K heads (a `MedusaHeads` module) whose outputs
the step engine reads out through the target's own LM head weight. The target's logits and
caches are unchanged.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from specgraph.passes._infra import PassContext, PassResult, cleanup, output_values, set_outputs

logger = logging.getLogger("specgraph.passes")


def add_medusa_heads(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    heads = ctx.drafter
    if heads is None:
        raise ValueError("add_medusa_heads needs heads in the pass context")
    hidden = ctx.anatomy.lm_head.args[0]
    assert isinstance(hidden, torch.fx.Node)
    set_outputs(gm, [*output_values(gm), hidden])
    gm.add_module("medusa_heads", heads)
    cleanup(gm)
    logger.debug("medusa: %d heads on %s", heads.num_heads, hidden.name)
    return PassResult(gm, True, {"heads": heads.num_heads, "outputs_added": 1})
