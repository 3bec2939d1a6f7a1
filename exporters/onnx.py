"""Export a StepEngine to one ONNX graph (opset 24) with its weights in one external file.

One graph serves prefill and every step (the token count T is dynamic), so the weights are
stored once on disk and loaded once in memory.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import onnx
import torch

from specgraph.errors import ExportError
from specgraph.exporters.gemm import matmul_to_gemm
from specgraph.exporters.gqa import fuse_cached_attention
from specgraph.exporters.greedy_skip import skip_draws_when_greedy
from specgraph.exporters.rotary import fuse_rotary
from specgraph.ops import ONNX_TRANSLATIONS
from specgraph.sampling import ONNX_TRANSLATIONS as SAMPLING_TRANSLATIONS
from specgraph.step import StepEngine
from specgraph.step_tree import TreeStepEngine

Engine = StepEngine | TreeStepEngine

logger = logging.getLogger("specgraph.exporters")
OPSET = 24  # TensorScatter, the in-place KV write, is opset 24


def _root_cause(exc: BaseException) -> str:
    """The first line of the innermost cause, without terminal colour codes: torch.onnx wraps the
    real error ("Cannot view a tensor with shape ...") in its own multi-line, coloured report."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip() or type(exc).__name__
    return text.splitlines()[0]


def _optimize_without_rewrites(model: Any) -> None:
    """onnxscript's `optimize_ir` without its pattern-rewrite pass, in place on an onnx_ir model.

    The rewriter took over a quarter of SmolLM2's compile (191 s with it, 139 s without, quiet)
    and over 20 minutes on an engine that holds K + 1 copies of a draft model (its matching grows
    faster than the graph). Without it the graph keeps 23 more small nodes (CastLike, Shape, ...)
    that ONNX Runtime's own optimiser removes: decoding was no slower (0.95x the time, same run).
    Our own rewrites (Gemm, rotary, weight blocks) run after this.
    """
    import onnx_ir as ir
    from onnx_ir.passes import common
    from onnxscript.optimizer import fold_constants_ir

    fold_constants_ir(model)
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
    )(model)


def export_onnx(
    engine: Engine,
    kv_shapes: list[tuple[int, ...]],
    path: Path,
    heads: list[tuple[int, int, float]] | None = None,
    pad_steps: bool = False,
) -> onnx.ModelProto:
    """Trace `engine` and write `path` plus `path.name + '.data'` (the weights). `heads` (num_heads,
    kv_num_heads, scale per target layer) lets a chain engine run each layer's cached attention,
    its draft model's too, as one fused node where no sliding window applies (`exporters/gqa.py`);
    `pad_steps` runs the target's one-token calls through it as two tokens, so that a step rounds
    as a verify call does (for int8 activations; the engine then writes one slot past a step)."""
    inputs, outputs = engine.io_names()
    args = engine.example_inputs(kv_shapes)
    dyn = engine.dynamic_shapes(args)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                engine,
                args,
                dynamo=True,
                opset_version=OPSET,
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=dyn,
                custom_translation_table={**ONNX_TRANSLATIONS, **SAMPLING_TRANSLATIONS},
                verbose=False,
                optimize=False,  # _optimize_without_rewrites below
            )
            if program is not None:
                _optimize_without_rewrites(program.model)
    except Exception as exc:  # the exporter raises many types; ours names the stage
        raise ExportError(f"ONNX export failed: {_root_cause(exc)}") from exc
    if program is None:
        raise ExportError("ONNX export returned no program")
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=True)
    matmul_to_gemm(path, drafters=getattr(engine, "drafter_weights", ()))
    fuse_rotary(path)
    if heads and isinstance(engine, StepEngine):  # chains: each run's mask is causal from its write position
        caches = {"past_key_": heads} if engine.sliding_window is None else {}
        draft_heads: list[tuple[int, int, float]] = getattr(engine, "draft_heads", [])  # a DraftStepEngine's
        # a drafter that reads the target's caches runs on theirs: its runs follow the verify's
        if draft_heads and getattr(engine, "draft_window", None) is None and not engine.reads_target_cache:
            caches["draft_past_key_"] = draft_heads
        fuse_cached_attention(path, caches, pad=frozenset({"past_key_"} if pad_steps else ()))
    skip_draws_when_greedy(path)
    logger.debug("exported %s with %d inputs, %d outputs", path.name, len(inputs), len(outputs))
    return onnx.load(str(path), load_external_data=False)


def set_initializer(path: Path, contains: str, value: Any) -> None:
    """Replace the one initializer of the graph at `path` whose name contains `contains` (a
    buffer the engine registered, e.g. a threshold a method measures after the export) with
    `value` (a numpy array), leaving its external data as it is."""
    model = onnx.load(str(path), load_external_data=False)
    (init,) = [t for t in model.graph.initializer if contains in t.name]
    init.CopyFrom(onnx.numpy_helper.from_array(value, init.name))
    onnx.save_model(model, str(path))
