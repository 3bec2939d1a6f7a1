"""Export a StepEngine to one ONNX graph (opset 24) with its weights in one external file.

One graph serves prefill and every step (the token count T is dynamic), so the weights are
stored once on disk and loaded once in memory.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import torch

from specgraph.errors import ExportError
from specgraph.exporters.gemm import matmul_to_gemm
from specgraph.ops import ONNX_TRANSLATIONS
from specgraph.step import StepEngine

logger = logging.getLogger("specgraph.exporters")
OPSET = 24  # TensorScatter, the in-place KV write, is opset 24


def io_names(engine: StepEngine) -> tuple[list[str], list[str]]:
    """Graph input and output names, in the order StepEngine.forward takes and returns them."""
    kv_in = [f"past_{kind}_{i}" for i in range(engine.num_layers) for kind in ("key", "value")]
    kv_out = [f"present_{kind}_{i}" for i in range(engine.num_layers) for kind in ("key", "value")]
    inputs = ["tokens", "n_fixed", "cache_len"]
    outputs = ["accepted", "n_accepted", "next_tokens", "cache_len_out"]
    if engine.method == "lookup":
        inputs.append("history")
        outputs.append("history_out")
    outputs += kv_out
    if engine.emit_logits:
        outputs.append("logits")
    return inputs + kv_in, outputs


def example_inputs(engine: StepEngine, kv_shapes: list[tuple[int, ...]], batch: int = 2, tokens: int = 4):
    """Inputs for tracing; batch and token counts must not be 1 (torch.export would specialise)."""
    args = [
        torch.zeros(batch, tokens, dtype=torch.long),
        torch.ones(batch, dtype=torch.long),
        torch.zeros(batch, dtype=torch.long),
    ]
    if engine.method == "lookup":
        args.append(torch.zeros(batch, engine.max_context + 1, dtype=torch.long))
    args += [torch.zeros(batch, *shape) for shape in kv_shapes]
    return tuple(args)


def export_onnx(engine: StepEngine, kv_shapes: list[tuple[int, ...]], path: Path) -> onnx.ModelProto:
    """Trace `engine` and write `path` plus `path.name + '.data'` (the weights)."""
    inputs, outputs = io_names(engine)
    args = example_inputs(engine, kv_shapes)
    batch = torch.export.Dim("batch", min=1, max=64)
    tokens = torch.export.Dim("tokens", min=1, max=engine.max_context)
    # forward(tokens, n_fixed, cache_len, *state): the varargs form one nested entry
    dyn = ({0: batch, 1: tokens}, {0: batch}, {0: batch}, tuple({0: batch} for _ in args[3:]))
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
                custom_translation_table=ONNX_TRANSLATIONS,
                verbose=False,
                optimize=True,
            )
    except Exception as exc:  # the exporter raises many types; ours names the stage
        raise ExportError(f"ONNX export failed: {str(exc).splitlines()[0]}") from exc
    if program is None:
        raise ExportError("ONNX export returned no program")
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=True)
    matmul_to_gemm(path)
    logger.debug("exported %s with %d inputs, %d outputs", path.name, len(inputs), len(outputs))
    return onnx.load(str(path), load_external_data=False)
