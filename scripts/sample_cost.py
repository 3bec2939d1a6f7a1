"""Cost of the engine's draw alone (`specgraph::sample` exported to ONNX), over SmolLM2's 49,152-token
vocabulary, 2 threads: median ms for 1 and 8 drawn positions at several settings. Random logits
(std 3) are flat, so top-p there always needs the full sort: the worst case.

    python scripts/sample_cost.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from specgraph.sampling import ONNX_TRANSLATIONS

VOCAB = 49_152
SETTINGS = [(0.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 50, 1.0), (0.7, 0, 0.9)]  # temperature, top_k, top_p


class _SampleOp(torch.nn.Module):
    def forward(self, logits, first, temperature, top_k, top_p, u):  # type: ignore[no-untyped-def]
        return torch.ops.specgraph.sample(logits, first, temperature, top_k, top_p, u)


def main() -> None:
    path = Path(tempfile.mkdtemp()) / "sample.onnx"
    batch, tokens = torch.export.Dim("b", min=1, max=64), torch.export.Dim("t", min=1, max=64)
    args = (torch.randn(2, 5, VOCAB), torch.tensor([1, 2]), torch.ones(2), torch.zeros(2, dtype=torch.int64),
            torch.ones(2), torch.rand(2, 5))  # fmt: skip
    dyn = ({0: batch, 1: tokens}, {0: batch}, {0: batch}, {0: batch}, {0: batch}, {0: batch, 1: tokens})
    names = ["logits", "first", "temperature", "top_k", "top_p", "u"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(_SampleOp(), args, dynamo=True, opset_version=24, input_names=names,
                                    output_names=["x"], dynamic_shapes=dyn, custom_translation_table=ONNX_TRANSLATIONS)  # fmt: skip
    program.save(str(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for positions in (1, 8):
        logits = (rng.standard_normal((1, positions, VOCAB)) * 3).astype(np.float32)
        for temperature, top_k, top_p in SETTINGS:
            feeds = dict(zip(names, [logits, np.zeros(1, np.int64), np.full(1, temperature, np.float32),
                                     np.full(1, top_k, np.int64), np.full(1, top_p, np.float32),
                                     rng.random((1, positions), dtype=np.float32)], strict=True))  # fmt: skip
            session.run(None, feeds)
            times = []
            for _ in range(30):
                start = time.perf_counter()
                session.run(None, feeds)
                times.append(time.perf_counter() - start)
            print(f"{positions} positions, T {temperature} top-k {top_k} top-p {top_p}: "
                  f"{statistics.median(times) * 1000:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
