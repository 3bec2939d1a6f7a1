"""Thirty layers of cached attention at batch 1, ours against ONNX's `Attention` (opset 24), in
one ONNX Runtime session each, interleaved; median microseconds per call (issue 9's notes).

  ours:        Slice K/V to the attended span, grouped-query MatMul, scale, mask, Softmax, MatMul
               (specgraph.ops.cache_attention's ONNX form: 10 nodes a layer)
  att_slice:   Slice K/V to the span, then one Attention node (3 nodes a layer)
  att_full:    one Attention node over the whole cache, masked (1 node a layer)

    python scripts/attention_op.py --tokens 1 --context 100 --threads 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

B, H, HKV, S, D, LAYERS = 1, 9, 3, 512, 64, 30  # SmolLM2-135M's attention, a 512-slot cache


def build(kind: str) -> bytes:
    consts = {
        "zero": [0],
        "ax2": [2],
        "ax3": [3],
        "qg": [0, HKV, -1, D],
        "qs": [0, H, -1, D],
        "rep": [1, 1, H // HKV, 1],
    }
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()]
    inits += [numpy_helper.from_array(np.array(0.125, np.float32), "sc"),
              numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf")]  # fmt: skip
    ins = [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["B", H, "T", D]),
           helper.make_tensor_value_info("m", TensorProto.BOOL, ["B", 1, "T", S]),
           helper.make_tensor_value_info("span", TensorProto.INT64, [1])]  # fmt: skip
    nodes = [helper.make_node("Slice", ["m", "zero", "span", "ax3"], ["mw"])]
    x = "q"
    for i in range(LAYERS):
        k_shape = ["B", HKV, D, S] if kind == "ours" else ["B", HKV, S, D]
        ins += [helper.make_tensor_value_info(f"k{i}", TensorProto.FLOAT, k_shape),
                helper.make_tensor_value_info(f"v{i}", TensorProto.FLOAT, ["B", HKV, S, D])]  # fmt: skip
        if kind == "ours":
            nodes += [
                helper.make_node("Slice", [f"k{i}", "zero", "span", "ax3"], [f"kw{i}"]),
                helper.make_node("Slice", [f"v{i}", "zero", "span", "ax2"], [f"vw{i}"]),
                helper.make_node("Reshape", [x, "qg"], [f"qg{i}"]),
                helper.make_node("MatMul", [f"qg{i}", f"kw{i}"], [f"s0{i}"]),
                helper.make_node("Mul", [f"s0{i}", "sc"], [f"s1{i}"]),
                helper.make_node("Tile", ["mw", "rep"], [f"vis{i}"]),
                helper.make_node("Where", [f"vis{i}", f"s1{i}", "ninf"], [f"s2{i}"]),
                helper.make_node("Softmax", [f"s2{i}"], [f"p{i}"], axis=-1),
                helper.make_node("MatMul", [f"p{i}", f"vw{i}"], [f"o{i}"]),
                helper.make_node("Reshape", [f"o{i}", "qs"], [f"y{i}"]),
            ]
        elif kind == "att_slice":
            nodes += [
                helper.make_node("Slice", [f"k{i}", "zero", "span", "ax2"], [f"kw{i}"]),
                helper.make_node("Slice", [f"v{i}", "zero", "span", "ax2"], [f"vw{i}"]),
                helper.make_node(
                    "Attention", [x, f"kw{i}", f"vw{i}", "mw"], [f"y{i}"], q_num_heads=H, kv_num_heads=HKV, scale=0.125
                ),  # fmt: skip
            ]
        else:
            nodes.append(helper.make_node("Attention", [x, f"k{i}", f"v{i}", "m"], [f"y{i}"], q_num_heads=H,
                                          kv_num_heads=HKV, scale=0.125))  # fmt: skip
        x = f"y{i}"
    out = [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["B", H, "T", D])]
    graph = helper.make_graph(nodes, kind, ins, out, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]).SerializeToString()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--context", type=int, default=100, help="tokens already cached")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    t, ctx = args.tokens, args.context
    span = min(S, (ctx + t + 63) // 64 * 64)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.log_severity_level = 3
    kinds = ["ours", "att_slice", "att_full"]
    sessions = {k: ort.InferenceSession(build(k), options, providers=["CPUExecutionProvider"]) for k in kinds}
    rng = np.random.default_rng(0)
    mask = np.zeros((B, 1, t, S), bool)
    for j in range(t):
        mask[0, 0, j, : ctx + j + 1] = True
    base = {"q": rng.standard_normal((B, H, t, D), dtype=np.float32) * 0.1, "m": mask, "span": np.array([span])}
    keys = [rng.standard_normal((B, HKV, S, D), dtype=np.float32) for _ in range(LAYERS)]
    values = {f"v{i}": rng.standard_normal((B, HKV, S, D), dtype=np.float32) for i in range(LAYERS)}
    feeds = {k: {**base, **values, **{f"k{i}": keys[i] for i in range(LAYERS)}} for k in kinds}
    feeds["ours"].update({f"k{i}": np.ascontiguousarray(keys[i].transpose(0, 1, 3, 2)) for i in range(LAYERS)})
    outs = {k: s.run(None, feeds[k])[0] for k, s in sessions.items()}
    print("max |difference| from ours:", {k: float(np.abs(o - outs["ours"]).max()) for k, o in outs.items()})
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(7):
        for k, s in sessions.items():
            start = time.perf_counter()
            for _ in range(50):
                s.run(None, feeds[k])
            times[k].append((time.perf_counter() - start) / 50 * 1e6)
    print(f"tokens {t}, context {ctx}, {args.threads} threads, us per call of {LAYERS} layers:",
          {k: round(float(np.median(v))) for k, v in times.items()})  # fmt: skip


if __name__ == "__main__":
    main()
