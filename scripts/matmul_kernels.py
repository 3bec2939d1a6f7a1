"""One weight product on its own, 2 threads, median microseconds per session run (the call
itself, about 20 us, included): ONNX Runtime's 4-bit `MatMulNBits` at accuracy level 1 (float32
activations) and 4 (int8 activations) against a float32 `Gemm(transB=1)`, for 1 and 5 rows.
The weight is hot in cache, so this measures the kernels' arithmetic, not memory bandwidth
(docs/benchmarks.md, the draft-model section).

    python scripts/matmul_kernels.py --n 1536 --k 576
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

BLOCK = 32


def _session(node: onnx.NodeProto, inits: list[onnx.TensorProto], k: int, n: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], inits,
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1536, help="output features (default: SmolLM2's fused gate/up)")
    parser.add_argument("--k", type=int, default=576, help="input features")
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    n, k = args.n, args.k
    rng = np.random.default_rng(0)
    codes = numpy_helper.from_array(rng.integers(0, 255, (n, k // BLOCK, BLOCK // 2), dtype=np.uint8), "w")
    scales = numpy_helper.from_array(rng.random((n, k // BLOCK), dtype=np.float32), "s")
    sessions = {
        f"int4 level {level}": _session(
            helper.make_node(
                "MatMulNBits",
                ["x", "w", "s"],
                ["y"],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=4,
                block_size=BLOCK,
                accuracy_level=level,
            ),
            [codes, scales],
            k,
            n,
        )  # fmt: skip
        for level in (1, 4)
    }
    weight = numpy_helper.from_array(rng.random((n, k), dtype=np.float32), "w")
    sessions["fp32 Gemm"] = _session(helper.make_node("Gemm", ["x", "w"], ["y"], transB=1), [weight], k, n)
    for rows in (1, 5):
        x = rng.random((rows, k), dtype=np.float32)
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(5):  # interleaved
            for name, session in sessions.items():
                start = time.perf_counter()
                for _ in range(args.runs):
                    session.run(None, {"x": x})
                times[name].append((time.perf_counter() - start) / args.runs * 1e6)
        print(f"{rows} row(s):", {name: round(statistics.median(v), 1) for name, v in times.items()}, "us")


if __name__ == "__main__":
    main()
