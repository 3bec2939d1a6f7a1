"""Hand the target's feature (the LM head's input) out as one more graph output, for drafters
that read it: EAGLE's layer and Medusa's chain of heads."""

from __future__ import annotations

import torch

from specgraph.passes._infra import PassContext, PassResult, cleanup, output_values, set_outputs


def add_feature_output(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Requires an anatomy whose LM head reads the final norm's output [B, T, H]; ensures one more
    graph output after the caches: that feature (the target's logits and caches are unchanged)."""
    feature = ctx.anatomy.lm_head.args[0]
    assert isinstance(feature, torch.fx.Node)
    set_outputs(gm, [*output_values(gm), feature])
    cleanup(gm)
    return PassResult(gm, True, {"outputs_added": 1})
