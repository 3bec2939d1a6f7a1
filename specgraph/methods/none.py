"""`none`: plain decoding, one token per call. The baseline every speed-up is measured against."""

from __future__ import annotations

from typing import Any

import torch

from specgraph.methods.base import Built, Method
from specgraph.step import StepEngine


class NoneMethod(Method):
    name = "none"
    summary = "plain decoding (the baseline)"
    speculative = False

    def build(self, gm: torch.fx.GraphModule, anatomy: Any, cfg: Any, drafter: Any, window: int | None) -> Built:
        engine = StepEngine(gm, anatomy.num_layers, cfg.max_context, window, cfg.emit_logits, cfg.engine_samples)
        return Built(engine)


NONE = NoneMethod()
