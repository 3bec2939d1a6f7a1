"""One ONNX Runtime `MatMulNBits` product, one row, 2 threads, blocks of 32: 4-bit against 8-bit
codes at accuracy level 4 (int8 activations) and 1 (float32), on SmolLM2's LM head (49,152 x 576)
and an up projection (1,536 x 576). Median ms of 50 calls after 5 warm-ups; random codes.

    python scripts/nbits8_bench.py
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

CASES = {  # name: (bits, N, K, accuracy level)
    "lm4-l4": (4, 49152, 576, 4), "lm8-l4": (8, 49152, 576, 4), "lm4-l1": (4, 49152, 576, 1),
    "lm8-l1": (8, 49152, 576, 1), "up4-l4": (4, 1536, 576, 4), "up8-l4": (8, 1536, 576, 4),
}  # fmt: skip


def session(bits: int, n: int, k: int, level: int, block: int = 32) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (n, k // block, block * bits // 8), dtype=np.uint8)
    scales = (rng.random(n * (k // block), dtype=np.float32) * 0.01).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "q", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=level)  # fmt: skip
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              initializer=[numpy_helper.from_array(codes, "q"), numpy_helper.from_array(scales, "s")])  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options)


def main() -> None:
    x = np.random.default_rng(1).standard_normal((1, 576)).astype(np.float32)
    for name, (bits, n, k, level) in CASES.items():
        run = session(bits, n, k, level)
        for _ in range(5):
            run.run(None, {"x": x})
        times = []
        for _ in range(50):
            start = time.perf_counter()
            run.run(None, {"x": x})
            times.append(time.perf_counter() - start)
        print(f"{name}: {np.median(times) * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
