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
from specgraph.exporters.rotary import fuse_rotary
from specgraph.ops import ONNX_TRANSLATIONS
from specgraph.sampling import ONNX_TRANSLATIONS as SAMPLING_TRANSLATIONS
from specgraph.step import StepEngine
from specgraph.step_tree import TreeStepEngine

Engine = StepEngine | TreeStepEngine

logger = logging.getLogger("specgraph.exporters")
OPSET = 24  # TensorScatter, the in-place KV write, is opset 24


def export_onnx(engine: Engine, kv_shapes: list[tuple[int, ...]], path: Path) -> onnx.ModelProto:
    """Trace `engine` and write `path` plus `path.name + '.data'` (the weights)."""
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
                optimize=True,
            )
    except Exception as exc:  # the exporter raises many types; ours names the stage
        raise ExportError(f"ONNX export failed: {str(exc).splitlines()[0]}") from exc
    if program is None:
        raise ExportError("ONNX export returned no program")
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=True)
    matmul_to_gemm(path, drafter=getattr(engine, "drafter_weights", None))
    fuse_rotary(path)
    logger.debug("exported %s with %d inputs, %d outputs", path.name, len(inputs), len(outputs))
    return onnx.load(str(path), load_external_data=False)
