"""specgraph's own ONNX Runtime operators (`--kernels native`, host/src/kernels/): the block product
equals the dequantised weight's in float32, the cached attention equals attention computed here
for every call shape, native engines equal HF on the GGUF and speculation equals its own none
engine, and what cannot run is refused in one line."""

from __future__ import annotations

import itertools
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from specgraph.compiler import CompileConfig, compile_model
from specgraph.default_model import read_gguf
from specgraph.errors import BundleError, InputError
from specgraph.exporters.nbits import NATIVE_DOMAIN, native_byte_quads, native_lanes, native_quads, native_scale_tiles
from specgraph.kernels import ENV, code_path, library_path
from specgraph.runtime import Engine
from tests.greedy import assert_same_greedy, hf_greedy
from tests.models.tiny_gguf import write_llama_gguf
from tests.test_medusa import _heads
from tests.test_weights import PROMPTS, _cli_refuses

pytestmark = pytest.mark.skipif(
    library_path() is None, reason="specgraph's kernel library is not built (sh scripts/install.sh needs cmake)"
)


def _pack(digit: np.ndarray, block: int) -> np.ndarray:
    n, k = digit.shape
    pairs = digit.reshape(n, k // block, block // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def _pairs(codes: np.ndarray, block: int, digits: int, offset: bool) -> tuple[list, list[str]]:  # type: ignore[type-arg]
    """The pairs layout of codes [N, K] (one digit, or two: high and low): initializers, inputs."""
    if digits == 1:
        return [numpy_helper.from_array(_pack(codes, block), "q")], ["x", "q", "d", "m" if offset else ""]
    high, low = _pack(codes >> 4, block), _pack(codes & 15, block)
    inits = [numpy_helper.from_array(high, "q"), numpy_helper.from_array(low, "lo")]
    return inits, ["x", "q", "d", "m" if offset else "", "lo"]


def _with_scales(inits: list, inputs: list[str], d: np.ndarray, m: np.ndarray | None, dtype) -> list[str]:  # type: ignore[no-untyped-def, type-arg]
    """Add d and m [K/block, N] in the kernel's tiles to `inits`; the inputs without trailing blanks."""
    inits.append(numpy_helper.from_array(native_scale_tiles(d.T).astype(dtype), "d"))
    if m is not None:
        inits.append(numpy_helper.from_array(native_scale_tiles(m.T).astype(dtype), "m"))
    while inputs[-1] == "":
        inputs = inputs[:-1]
    return inputs


def _session(node, inits, k: int, n: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    return _native_session(graph)


def _native_session(graph: onnx.GraphProto) -> ort.InferenceSession:
    """A session of a one-node graph of specgraph's operators, on 2 threads."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(NATIVE_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("digits", "lanes"), [(1, False), (1, True), (2, False), (2, True)])
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("offset", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_block_matmul_equals_the_dequantised_product(digits, lanes, block, offset, dtype):
    """One node, every row count a verify call uses (1-9 rows, and a [2, T, K] batch) and a prompt's
    (13 and 20 rows, whose codes the kernel converts once a call), against the float64 product of
    the dequantised weight `d * code + m`: float32 rounding only. One digit in both layouts: packed
    pairs, and lanes of 8 outputs (`native_lanes`)."""
    rng = np.random.default_rng(block + digits)
    n, k = 203, 4 * block  # 203 outputs: whole 16-output tiles and a remainder (one whole lane tile and 3)
    codes = rng.integers(0, 16 if digits == 1 else 256, (n, k))
    d = (rng.random((k // block, n)) * 0.02 + 0.001).astype(dtype)  # [K/block, N]
    m = (-(8 if digits == 1 else 136) * d * rng.uniform(0.8, 1.2, d.shape)).astype(dtype) if offset else None
    weight = np.repeat(d.T.astype(np.float64), block, 1) * codes  # [N, K]
    if m is not None:
        weight += np.repeat(m.T.astype(np.float64), block, 1)
    extra = {}
    if lanes and digits == 2:  # wide lanes: 4 outputs' 8-bit codes a 32-bit lane
        inits = [numpy_helper.from_array(native_lanes(_pack(codes >> 4, block), _pack(codes & 15, block)), "q")]
        inputs, extra = ["x", "q", "d", "m" if offset else ""], {"lane_bits": 8}
    elif lanes:
        inits = [numpy_helper.from_array(native_lanes(_pack(codes, block)), "q")]
        inputs = ["x", "q", "d", "m" if offset else ""]
    else:
        inits, inputs = _pairs(codes, block, digits, offset)
    inputs = _with_scales(inits, inputs, d, m, dtype)
    node = helper.make_node("BlockMatMul", inputs, ["y"], domain=NATIVE_DOMAIN, K=k, N=n, block_size=block, **extra)
    session = _session(node, inits, k, n)
    pairs = None
    if lanes:  # the same weight in the pairs layout: a lanes product rounds as it does, to the bit
        if digits == 1:
            inits = [numpy_helper.from_array(_pack(codes, block), "q"), *inits[1:]]
            plain = helper.make_node("BlockMatMul", inputs, ["y"], domain=NATIVE_DOMAIN, K=k, N=n, block_size=block)
        else:
            inits = [numpy_helper.from_array(_pack(codes >> 4, block), "q"),
                     numpy_helper.from_array(_pack(codes & 15, block), "lo"), *inits[1:]]  # fmt: skip
            plain = helper.make_node("BlockMatMul", [*inputs, *[""] * (4 - len(inputs)), "lo"], ["y"],
                                     domain=NATIVE_DOMAIN, K=k, N=n, block_size=block)  # fmt: skip
        pairs = _session(plain, inits, k, n)
    for shape in [(1, k), (2, k), (3, k), (4, k), (5, k), (9, k), (13, k), (2, 3, k), (2, 10, k), (1, 0, k)]:
        x = rng.standard_normal(shape).astype(np.float32)
        got = session.run(None, {"x": x})[0]
        want = x.astype(np.float64) @ weight.T
        assert got.shape == want.shape
        if want.size:
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        if pairs is not None:
            assert np.array_equal(got, pairs.run(None, {"x": x})[0])
    # a row computed alone equals the same row within a many-row call (one rounding for every call)
    x = rng.standard_normal((17, k)).astype(np.float32)
    alone = np.concatenate([session.run(None, {"x": x[i : i + 1]})[0] for i in range(17)])
    assert np.array_equal(alone[:6], session.run(None, {"x": x[:6]})[0])
    assert np.array_equal(alone, session.run(None, {"x": x})[0])


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_one_row_lanes_round_as_pairs_at_every_row_count(block, dtype):
    """Input 7 (`one_row`): the same one-digit codes again in lanes, which a call of one row reads
    instead of the pairs (every call, with AVX-512): every call, one row or many, equals the
    pairs-only product to the bit.
    With two digits the extra lanes are refused in one line."""
    rng = np.random.default_rng(block)
    n, k = 203, 4 * block
    codes = rng.integers(0, 16, (n, k))
    d = (rng.random((k // block, n)) * 0.02 + 0.001).astype(dtype)
    m = (-8 * d * rng.uniform(0.8, 1.2, d.shape)).astype(dtype)
    inits, inputs = _pairs(codes, block, 1, True)
    inputs = _with_scales(inits, inputs, d, m, dtype)
    plain = _session(helper.make_node("BlockMatMul", inputs, ["y"], domain=NATIVE_DOMAIN, K=k, N=n, block_size=block),
                     inits, k, n)  # fmt: skip
    lanes = [*inits, numpy_helper.from_array(native_lanes(_pack(codes, block)), "ql")]
    both = helper.make_node("BlockMatMul", [*inputs, "", "", "", "ql"], ["y"], domain=NATIVE_DOMAIN, K=k, N=n,
                            block_size=block)  # fmt: skip
    session = _session(both, lanes, k, n)
    for shape in [(1, k), (1, 1, k), (2, k), (3, k), (5, k), (2, 3, k), (1, 0, k)]:
        x = rng.standard_normal(shape).astype(np.float32)
        assert np.array_equal(session.run(None, {"x": x})[0], plain.run(None, {"x": x})[0])
    two, names = _pairs(codes, block, 2, True)
    names = _with_scales(two, names, d, m, dtype)
    bad = helper.make_node("BlockMatMul", [*names, "", "", "ql"], ["y"], domain=NATIVE_DOMAIN, K=k, N=n,
                           block_size=block)  # fmt: skip
    with pytest.raises(Exception, match="one-row lanes go with one digit in pairs"):
        _session(bad, [*two, lanes[-1]], k, n).run(None, {"x": np.ones((1, k), np.float32)})


def _int8_reference(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [rows, K] quantised per block of 32 as the kernel does (q = round(x * 127 / max|x|) in
    float32, step max|x| / 127), times the dequantised weight [N, K], in float64."""
    blocks = x.reshape(x.shape[0], -1, 32)
    most = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.where(most > 0, np.float32(127) / np.where(most > 0, most, 1), 0).astype(np.float32)
    q = np.rint(blocks * inverse)
    return ((q * (most / np.float32(127))).reshape(x.shape).astype(np.float64)) @ weight.T


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("blocks", [1, 2, 5])
@pytest.mark.parametrize("offset", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_int8_activations_equal_the_quantised_input_times_the_dequantised_weight(digits, blocks, offset, dtype):
    """activation_bits=8: x quantised per block of 32 (an odd block count pairs the last with
    zeros), integer products, against float64 of the same quantised x; and every row of a many-row
    call equals that row alone, bit for bit (what lets an int8 verify call agree with its steps)."""
    rng = np.random.default_rng(7 * blocks + digits)
    n, k = 203, 32 * blocks
    codes = rng.integers(0, 16 if digits == 1 else 256, (n, k))
    d = (rng.random((blocks, n)) * 0.02 + 0.001).astype(dtype)
    m = (-(8 if digits == 1 else 136) * d * rng.uniform(0.8, 1.2, d.shape)).astype(dtype) if offset else None
    weight = np.repeat(d.T.astype(np.float64), 32, 1) * codes
    if m is not None:
        weight += np.repeat(m.T.astype(np.float64), 32, 1)
    inits, inputs = _pairs(codes, 32, digits, offset)
    inputs = _with_scales(inits, inputs, d, m, dtype)
    node = helper.make_node("BlockMatMul", inputs, ["y"], domain=NATIVE_DOMAIN, K=k, N=n, block_size=32,
                            activation_bits=8)  # fmt: skip
    session = _session(node, inits, k, n)
    for rows in (1, 2, 3, 4, 5, 9):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block: step 0
        got = session.run(None, {"x": x})[0]
        want = _int8_reference(x, weight)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    x = rng.standard_normal((17, k)).astype(np.float32)
    alone = np.concatenate([session.run(None, {"x": x[i : i + 1]})[0] for i in range(17)])
    assert np.array_equal(alone[:6], session.run(None, {"x": x[:6]})[0])
    assert np.array_equal(alone, session.run(None, {"x": x})[0])
    # and it is not the float32 product: the quantisation is real
    exact = x.astype(np.float64) @ weight.T
    assert np.abs(alone - exact).max() > 1e-4 * np.abs(exact).max()


@pytest.mark.parametrize("bits", [32, 8])
def test_block_matmul_takes_in_a_norm_a_swiglu_and_a_residual(bits):
    """The inputs native_fusion folds in: `norm` (an RMS norm of x first), `glu=1` (silu of x's
    first half times its second), `addend` (added to y, as the Add it replaces: to the bit)."""
    rng = np.random.default_rng(bits)
    n, k = 40, 64
    codes = rng.integers(0, 16, (n, k))
    d = (rng.random((k // 32, n)) * 0.02 + 0.001).astype(np.float32)
    weight = np.repeat(d.T.astype(np.float64), 32, 1) * codes  # no m: w = d * code
    scale = rng.uniform(0.5, 1.5, k).astype(np.float32)
    inits = [numpy_helper.from_array(_pack(codes, 32), "q"), numpy_helper.from_array(native_scale_tiles(d.T), "d"),
             numpy_helper.from_array(scale, "norm")]  # fmt: skip
    extra = {"activation_bits": 8} if bits == 8 else {}
    plain = _session(helper.make_node("BlockMatMul", ["x", "q", "d"], ["y"], domain=NATIVE_DOMAIN, K=k, N=n,
                                      block_size=32, **extra), inits[:2], k, n)  # fmt: skip

    def fused(inputs: list[str], **attrs: float) -> ort.InferenceSession:
        node = helper.make_node("BlockMatMul", inputs, ["y"], domain=NATIVE_DOMAIN, K=k, N=n, block_size=32, **extra)
        node.attribute.extend(helper.make_attribute(key, value) for key, value in attrs.items())
        names = ["x", "addend"] if "addend" in inputs else ["x"]
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in names],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)  # fmt: skip
        return _native_session(graph)

    x = rng.standard_normal((3, k)).astype(np.float32) * 3
    normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * scale
    got = fused(["x", "q", "d", "", "", "norm"], norm_epsilon=1e-5).run(None, {"x": x})[0]
    want = plain.run(None, {"x": normed.astype(np.float32)})[0]
    if bits == 32:
        assert np.abs(got - normed @ weight.T).max() <= 1e-5 * np.abs(want).max()
    else:  # a last-bit difference in x' may move an int8 rounding: compare with the unfused node
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    gate_up = rng.standard_normal((2, 3, 2 * k)).astype(np.float32) * 4
    g, u = gate_up[..., :k].astype(np.float64), gate_up[..., k:]
    swiglu = g / (1 + np.exp(-g)) * u
    got = fused(["x", "q", "d"], glu=1).run(None, {"x": gate_up})[0]
    want = plain.run(None, {"x": swiglu.astype(np.float32)})[0]
    assert got.shape == (2, 3, n)
    if bits == 32:
        assert np.abs(got - swiglu @ weight.T).max() <= 1e-5 * np.abs(want).max()
    else:
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    residual = rng.standard_normal((3, n)).astype(np.float32)
    got = fused(["x", "q", "d", "", "", "", "addend"]).run(None, {"x": x, "addend": residual})[0]
    assert np.array_equal(got, residual + plain.run(None, {"x": x})[0])
    with pytest.raises(Exception, match="addend does not have the output's shape"):
        fused(["x", "q", "d", "", "", "", "addend"]).run(None, {"x": x, "addend": residual[:1]})
    with pytest.raises(Exception, match=r"not 2K \(glu\)"):
        fused(["x", "q", "d"], glu=1).run(None, {"x": x})


def test_native_engines_fold_norms_swiglus_and_residuals_into_their_products(tmp_path):
    """Every decoder layer's two norms, its SwiGLU and its two residual adds (and the final norm)
    go into the products; a norm whose output another node also reads stays a node. (HF equality
    of this engine: test_native_engines_match_hf_generate_on_the_gguf.)"""
    from specgraph.exporters.native_fusion import fuse_into_block_matmuls

    path = write_llama_gguf(tmp_path / "m.gguf", "Q4_1", "Q8_0")
    compile_model(CompileConfig.of(model=str(path), output=tmp_path / "b", max_context=160, kernels="native"))
    engine = Engine(tmp_path / "b")
    layers = engine.manifest["anatomy"]["decoder_blocks"]
    assert engine.manifest["weights"]["native_fused"] == {"norms": 2 * layers + 1, "glus": layers,
                                                         "residuals": 2 * layers}  # fmt: skip
    ops = [n.op_type for n in onnx.load(str(tmp_path / "b" / "model.onnx"), load_external_data=False).graph.node]
    assert "RMSNormalization" not in ops and "Sigmoid" not in ops
    # the tied Q8_0 table: the LM head in wide lanes, the embedding gathered from them (GatherND); the
    # one-digit products in lanes, or as digits where AMX runs them
    weights = engine.manifest["weights"]
    assert weights["native_lanes"] + weights.get("native_digits", 0) == weights["matmuls"] and "GatherND" in ops
    # a norm read twice (here: also a graph output) is left alone
    k, n = 64, 16
    norm = helper.make_node("RMSNormalization", ["x", "s"], ["h"], axis=-1, epsilon=1e-5)
    product = helper.make_node("BlockMatMul", ["h", "q", "d"], ["y"], domain=NATIVE_DOMAIN, K=k, N=n, block_size=32)
    graph = helper.make_graph(
        [norm, product], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in ("y", "h")],
        [numpy_helper.from_array(np.ones(k, np.float32), "s"), numpy_helper.from_array(np.zeros((n, 2, 16), np.uint8), "q"),
         numpy_helper.from_array(np.ones((1, 2, 16), np.float32), "d")],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(NATIVE_DOMAIN, 1)]),
              str(tmp_path / "g.onnx"))  # fmt: skip
    assert fuse_into_block_matmuls(tmp_path / "g.onnx") == {"norms": 0, "glus": 0, "residuals": 0}


_RUN_PORTABLE = """
import sys, numpy as np, onnxruntime as ort
library, folder, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(count):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(library)
    session = ort.InferenceSession(f"{folder}/{i}.onnx", options, providers=["CPUExecutionProvider"])
    outs = session.run(None, dict(np.load(f"{folder}/{i}.npz")))
    np.savez(f"{folder}/{i}.out.npz", *outs)
"""


def _product_model(codes: np.ndarray, block: int, layout: str, rng, **attrs) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    """A one-node BlockMatMul over codes [N, K] in `layout` (pairs, lanes, wide, quads), float16 scales
    and offsets, with `attrs` (activation_bits, glu) and, for `norm`, a norm input."""
    n, k = codes.shape
    d = (rng.random((k // block, n)) * 0.02 + 0.001).astype(np.float16)
    m = (-(8 if codes.max() < 16 else 136) * d * rng.uniform(0.8, 1.2, d.shape)).astype(np.float16)
    norm = attrs.pop("norm", False)
    if layout == "lanes":
        inits, inputs = [numpy_helper.from_array(native_lanes(_pack(codes, block)), "q")], ["x", "q", "d", "m"]
    elif layout == "quads" and codes.max() >= 16:  # 8-bit codes: byte quads
        quads = native_byte_quads(_pack(codes >> 4, block), _pack(codes & 15, block))
        inits, inputs = [numpy_helper.from_array(quads, "q")], ["x", "q", "d", "m"]
    elif layout == "quads":
        inits, inputs = [numpy_helper.from_array(native_quads(_pack(codes, block)), "q")], ["x", "q", "d", "m"]
    elif layout == "wide":
        lanes = native_lanes(_pack(codes >> 4, block), _pack(codes & 15, block))
        inits, inputs, attrs = [numpy_helper.from_array(lanes, "q")], ["x", "q", "d", "m"], {**attrs, "lane_bits": 8}
    else:
        inits, inputs = _pairs(codes, block, 1 if codes.max() < 16 else 2, True)
    inputs = _with_scales(inits, inputs, d, m, np.float16)
    if norm:
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, k).astype(np.float32), "g"))
        inputs = [*inputs, *[""] * (5 - len(inputs)), "g"]
    node = helper.make_node("BlockMatMul", inputs, ["y"], domain=NATIVE_DOMAIN, K=k, N=n, block_size=block,
                            norm_epsilon=1e-5, **attrs)  # fmt: skip
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(NATIVE_DOMAIN, 1)])


def _run_in_process(env: dict[str, str], folder, models: list, feeds: list[dict]) -> list[list[np.ndarray]]:  # type: ignore[no-untyped-def, type-arg]
    """Each model's outputs from a process with `env` (the library picks its loops once, at load)."""
    import subprocess
    import sys

    for i, (model, feed) in enumerate(zip(models, feeds, strict=True)):
        onnx.save(model, str(folder / f"{i}.onnx"))
        np.savez(folder / f"{i}.npz", **feed)
    subprocess.run([sys.executable, "-c", _RUN_PORTABLE, str(library_path()), str(folder), str(len(models))],
                   env={**os.environ, **env}, check=True)  # fmt: skip
    return [list(np.load(folder / f"{i}.out.npz").values()) for i in range(len(models))]


def _run_here(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:  # type: ignore[type-arg]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feed)


def _product_cases(rng, n: int, k: int) -> list[tuple[str, onnx.ModelProto, bool]]:  # type: ignore[no-untyped-def]
    """(name, one-node product, whether its float32 sums may reorder off the AVX2 loops)."""
    four, eight = rng.integers(0, 16, (n, k)), rng.integers(0, 256, (n, k))
    return [
        ("pairs", _product_model(four, 32, "pairs", rng), True),
        ("two digits", _product_model(eight, 16, "pairs", rng), True),
        ("lanes", _product_model(four, 32, "lanes", rng), True),
        ("wide lanes", _product_model(eight, 32, "wide", rng), True),
        ("norm", _product_model(four, 32, "pairs", rng, norm=True), True),
        ("int8", _product_model(four, 32, "pairs", rng, activation_bits=8), False),
        ("int8, two digits", _product_model(eight, 32, "pairs", rng, activation_bits=8), False),
        ("int8, quads", _product_model(four, 32, "quads", rng, activation_bits=8), False),
    ]


def test_quads_give_the_pairs_loops_bits_at_every_row_count():
    """Quads (block_matmul.h) feed each (row, output)'s int8 chain in the pairs loop's lane order:
    the same bits for every row count and output tail, so an engine whose products read quads
    emits what one reading pairs does (the AVX2 and portable quads loops: the tests above)."""
    rng = np.random.default_rng(11)
    for n, k in ((75, 96), (130, 64), (16, 128), (48, 1536)):
        codes = rng.integers(0, 16, (n, k))
        seed = int(rng.integers(1 << 30))
        pairs, quads = (_product_model(codes, 32, layout, np.random.default_rng(seed), activation_bits=8)
                        for layout in ("pairs", "quads"))  # fmt: skip
        for rows in (1, 2, 3, 4, 5, 7):
            feed = {"x": rng.standard_normal((rows, k)).astype(np.float32)}
            assert np.array_equal(_run_here(quads, feed)[0], _run_here(pairs, feed)[0]), (n, k, rows)
    at_float32 = _product_model(rng.integers(0, 16, (16, 64)), 32, "quads", rng)  # quads need int8 activations
    with pytest.raises(Exception, match="quads hold one digit in blocks of 32 at activation_bits 8 or 24"):
        _run_here(at_float32, {"x": np.ones((1, 64), np.float32)})


def _dequantised(model: onnx.ModelProto, codes: np.ndarray) -> np.ndarray:
    """W [N, K] in float64 from a one-digit product's codes and its tiled d and m."""
    arrays = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    n, k = codes.shape
    tiles, nb, _ = arrays["d"].shape
    d, m = (arrays[p].transpose(0, 2, 1).reshape(tiles * 16, nb)[:n] for p in ("d", "m"))
    return (codes.reshape(n, nb, -1) * d[:, :, None] + m[:, :, None]).reshape(n, k)


def test_digits_equal_the_dequantised_product_to_float32_rounding():
    """activation_bits 24 (block_matmul.h, digits): x in four int8 digits a block, the codes' sums
    in integers (4-bit codes in quads, 8-bit ones in byte quads). Against float64, over row counts
    that take one to three AMX groups, output tails and inputs spread over e^8 within a block, the
    error is float32's: no worse than the float32 lanes loops' on the same products (whose d T + c'
    S form cancels alike: all stay under 4e-6 of sum |x w|). A row of a many-row call equals that
    row computed alone, to the bit."""
    rng = np.random.default_rng(7)
    worst = {"digits": 0.0, "lanes": 0.0}
    for (n, k), top in itertools.product(((75, 96), (130, 64), (16, 128), (48, 1536)), (16, 256)):
        codes = rng.integers(0, top, (n, k))
        seed = int(rng.integers(1 << 30))
        floats = "lanes" if top == 16 else "wide"
        models = {layout: _product_model(codes, 32, "quads" if layout == "digits" else floats,
                                         np.random.default_rng(seed), **({"activation_bits": 24} if layout == "digits" else {}))
                  for layout in worst}  # fmt: skip
        weight = _dequantised(models["digits"], codes)
        for rows in (1, 2, 3, 5, 6, 11):
            x = (rng.standard_normal((rows, k)) * np.exp(2 * rng.standard_normal((rows, k)))).astype(np.float32)
            x[0, : k // 3] = 0.0  # whole blocks of zeros (a step of 0)
            want, size = x.astype(np.float64) @ weight.T, np.abs(x.astype(np.float64)) @ np.abs(weight).T
            for layout, model in models.items():
                got = _run_here(model, {"x": x})[0]
                worst[layout] = max(worst[layout], (np.abs(got - want) / size).max())
            got = _run_here(models["digits"], {"x": x})[0]
            alone = np.concatenate([_run_here(models["digits"], {"x": x[r : r + 1]})[0] for r in range(rows)])
            assert np.array_equal(alone, got), (n, k, rows)
    assert worst["digits"] <= worst["lanes"] <= 4e-6, worst


def test_digits_give_the_same_bits_on_every_loop(tmp_path):
    """The digit sums are integers, so AMX's tiles (where this CPU has them), VNNI's loop
    ($SPECGRAPH_KERNELS_NO_AMX), the portable one ($SPECGRAPH_KERNELS_AVX2 on a CPU without VNNI,
    $SPECGRAPH_KERNELS_PORTABLE) give one product, bit for bit: a bundle stored as digits runs on any CPU."""
    rng = np.random.default_rng(9)
    models, feeds = [], []
    for (n, k), top in itertools.product(((75, 96), (130, 64), (48, 1536)), (16, 256)):
        model = _product_model(rng.integers(0, top, (n, k)), 32, "quads", rng, activation_bits=24)
        for rows in (1, 2, 4, 7):
            models.append(model)
            feeds.append({"x": rng.standard_normal((rows, k)).astype(np.float32)})
    here = [_run_here(model, feed)[0] for model, feed in zip(models, feeds, strict=True)]
    for env in (
        {"SPECGRAPH_KERNELS_NO_AMX": "1"},
        {"SPECGRAPH_KERNELS_AVX2": "1"},
        {"SPECGRAPH_KERNELS_PORTABLE": "1"},
    ):
        folder = tmp_path / next(iter(env))
        folder.mkdir()
        for i, outs in enumerate(_run_in_process(env, folder, models, feeds)):
            assert np.array_equal(outs[0], here[i]), (env, i)


def test_digits_refuse_what_they_cannot_read():
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, (16, 64))
    x = {"x": np.ones((1, 64), np.float32)}
    with pytest.raises(Exception, match=r"activation_bits 24 reads quads"):
        _run_here(_product_model(codes, 32, "pairs", rng, activation_bits=24), x)
    with pytest.raises(Exception, match="activation_bits 8 and 24 take block_size 32"):
        _run_here(_product_model(codes, 16, "pairs", rng, activation_bits=24), x)
    with pytest.raises(Exception, match="activation_bits must be 32, 24 or 8"):
        _run_here(_product_model(codes, 32, "quads", rng, activation_bits=16), x)


def test_the_portable_loops_compute_what_the_avx2_ones_do(tmp_path):
    """$SPECGRAPH_KERNELS_PORTABLE makes the library take its portable loops on this machine (what a
    CPU without AVX2 runs). The int8 product follows the AVX2 lane order, so it equals the AVX2
    product to the bit; the float32 products (pairs, lanes, wide lanes, with a fused norm or
    SwiGLU) and the attention sum in another order, so they agree to float rounding."""
    rng = np.random.default_rng(3)
    cases = _product_cases(rng, 75, 96)
    glu = _product_model(rng.integers(0, 16, (75, 96)), 32, "pairs", rng, glu=1)
    feeds = [{"x": rng.standard_normal((rows, 96)).astype(np.float32)} for rows in (1, 5) for _ in cases]
    models = [model for _rows in (1, 5) for _, model, _ in cases]
    names = [f"{name}, {rows} rows" for rows in (1, 5) for name, _, _ in cases]
    close = [c for _rows in (1, 5) for *_, c in cases]
    models.append(glu)
    feeds.append({"x": rng.standard_normal((3, 2 * 96)).astype(np.float32)})
    names.append("glu")
    close.append(True)
    models.append(_attention_model())
    feeds.append(_attention_feeds(rng, 2, 3, [4, 17], 64))
    names.append("attention")
    close.append(True)
    portable = _run_in_process({"SPECGRAPH_KERNELS_PORTABLE": "1"}, tmp_path, models, feeds)
    reordered = 0
    for i, (model, feed) in enumerate(zip(models, feeds, strict=True)):
        for j, (want, got) in enumerate(zip(_run_here(model, feed), portable[i], strict=True)):
            if names[i] == "attention" and j > 0:  # a cache not bound in place: only its written slots are defined
                ends = feed["seqlens"] + 1
                got, want = (np.concatenate([c[b, :, :end] for b, end in enumerate(ends)], 1) for c in (got, want))
            if close[i]:
                assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), names[i]
                reordered += not np.array_equal(got, want)
            else:
                assert np.array_equal(got, want), names[i]
    assert reordered > 0  # the float32 sums' last bits differ somewhere: the portable loops did run


def _kernels_path() -> str:
    import ctypes

    library = ctypes.CDLL(str(library_path()))
    library.specgraph_kernels_path.restype = ctypes.c_char_p
    return library.specgraph_kernels_path().decode()


@pytest.mark.skipif(library_path() is None or not _kernels_path().startswith("avx512"),
                    reason="this CPU has no AVX-512: the library runs its AVX2 loops, which the other tests check")  # fmt: skip
def test_the_avx512_loops_equal_the_avx2_ones_to_the_bit(tmp_path):
    """On a CPU with AVX-512 the products run two outputs a register with each lane doing the AVX2
    loop's arithmetic, so every layout, row count and output tail gives the AVX2 loops' bits
    ($SPECGRAPH_KERNELS_AVX2 makes the library take those): a `none` engine on one path and a
    speculative one on the other would still agree, and so do the products with any other machine's."""
    rng = np.random.default_rng(5)
    models, feeds, names = [], [], []
    for n, k in ((75, 96), (130, 64), (16, 128)):  # output tails of 11, 2 and 0 past a 16-output chunk
        for name, model, _ in _product_cases(rng, n, k):
            for rows in (1, 2, 3, 4, 5, 7):
                models.append(model)
                feeds.append({"x": rng.standard_normal((rows, k)).astype(np.float32)})
                names.append(f"{name}, N {n}, K {k}, {rows} rows")
    avx2 = _run_in_process({"SPECGRAPH_KERNELS_AVX2": "1"}, tmp_path, models, feeds)
    for i, (model, feed) in enumerate(zip(models, feeds, strict=True)):
        for want, got in zip(avx2[i], _run_here(model, feed), strict=True):
            assert np.array_equal(got, want), names[i]


def test_block_matmul_refuses_scales_of_the_wrong_shape_or_type():
    k, n, block = 64, 16, 32
    codes = numpy_helper.from_array(np.zeros((n, k // block, block // 2), np.uint8), "q")
    x = np.ones((1, k), np.float32)
    tiles = (1, k // block, 16)
    for d, m, message in [
        (np.ones((k // block, n), np.float32), None, r"d or m is not \[ceil\(N/16\), K/block, 16\]"),
        (np.ones(tiles, np.float64), None, "float32 or both float16"),
        (np.ones(tiles, np.float32), np.ones(tiles, np.float16), "float32 or both float16"),
    ]:
        inits = [codes, numpy_helper.from_array(d, "d")] + ([numpy_helper.from_array(m, "m")] if m is not None else [])
        node = helper.make_node("BlockMatMul", ["x", "q", "d", "m" if m is not None else ""], ["y"],
                                domain=NATIVE_DOMAIN, K=k, N=n, block_size=block)  # fmt: skip
        with pytest.raises(Exception, match=message):
            _session(node, inits, k, n).run(None, {"x": x})


def _attention_graph() -> onnx.GraphProto:
    names = ["q", "k", "v", "past_key", "past_value", "seqlens", "cos", "sin"]
    types = [TensorProto.INT32 if n == "seqlens" else TensorProto.FLOAT for n in names]
    node = helper.make_node("CachedAttention", names, ["out", "present_key", "present_value"], domain=NATIVE_DOMAIN,
                            num_heads=4, kv_num_heads=2, scale=0.3)  # fmt: skip
    return helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types, strict=True)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.output],
    )  # fmt: skip


def _attention_session() -> ort.InferenceSession:
    return _native_session(_attention_graph())


def _attention_model() -> onnx.ModelProto:
    return helper.make_model(_attention_graph(), opset_imports=[helper.make_opsetid("", 21),
                                                               helper.make_opsetid(NATIVE_DOMAIN, 1)])  # fmt: skip


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [..., D] rotated by cos, sin [..., D/2] (non-interleaved), in float64."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _attention_reference(feeds: dict[str, np.ndarray], heads: int, kv_heads: int, scale: float):  # type: ignore[no-untyped-def]
    """(out, keys, values) in float64: rotate, write at each row's position, attend causally."""
    q, k, v = (feeds[n].astype(np.float64) for n in "qkv")
    keys, values = feeds["past_key"].astype(np.float64), feeds["past_value"].astype(np.float64)
    batch, tokens, _ = q.shape
    d = keys.shape[-1]
    cos, sin = feeds["cos"][:, :, None, :], feeds["sin"][:, :, None, :]
    q = _rotate(q.reshape(batch, tokens, heads, d), cos, sin)
    k = _rotate(k.reshape(batch, tokens, kv_heads, d), cos, sin)
    v = v.reshape(batch, tokens, kv_heads, d)
    out = np.zeros_like(q)
    for b in range(batch):
        start = int(feeds["seqlens"][b]) + 1 - tokens
        keys[b, :, start : start + tokens] = k[b].transpose(1, 0, 2)
        values[b, :, start : start + tokens] = v[b].transpose(1, 0, 2)
        for t in range(tokens):
            for h in range(heads):
                g = h // (heads // kv_heads)
                scores = keys[b, g, : start + t + 1] @ q[b, t, h] * scale
                p = np.exp(scores - scores.max())
                out[b, t, h] = (p / p.sum()) @ values[b, g, : start + t + 1]
    return out.reshape(batch, tokens, heads * d), keys, values


def _attention_feeds(rng, batch: int, tokens: int, positions: list[int], d: int, slots: int = 40):  # type: ignore[no-untyped-def]
    angles = rng.uniform(-3, 3, (batch, tokens, d // 2))
    return {
        "q": rng.standard_normal((batch, tokens, 4 * d)).astype(np.float32),
        "k": rng.standard_normal((batch, tokens, 2 * d)).astype(np.float32),
        "v": rng.standard_normal((batch, tokens, 2 * d)).astype(np.float32),
        "past_key": rng.standard_normal((batch, 2, slots, d)).astype(np.float32),
        "past_value": rng.standard_normal((batch, 2, slots, d)).astype(np.float32),
        "seqlens": np.asarray([p + tokens - 1 for p in positions], np.int32),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
    }


@pytest.mark.parametrize("d", [8, 64, 20])
@pytest.mark.parametrize(("batch", "tokens", "positions"), [(1, 1, [0]), (1, 1, [29]), (1, 5, [0]), (2, 3, [4, 17]),
                                                            (3, 1, [0, 9, 35]), (1, 1, [500]), (2, 4, [100, 130])])  # fmt: skip
def test_cached_attention_equals_attention_computed_here(d, batch, tokens, positions):
    """Every call shape GroupQueryAttention's kernel takes and the batched verify it refuses (2 rows
    of 3 tokens over caches of different lengths); head sizes on the AVX2 path's 64-wide, 8-wide
    and leftover loops; long calls, whose heads the intra-op threads share. The caches come back
    with the new keys (rotated) and values written."""
    slots = max(40, max(positions) + tokens + 3)
    feeds = _attention_feeds(np.random.default_rng(d + tokens), batch, tokens, positions, d, slots)
    out, keys, values = _attention_session().run(None, feeds)
    want = _attention_reference(feeds, 4, 2, 0.3)
    written = [p + tokens for p in positions]  # a copied cache (not bound in place) holds the slots before these
    got_all = [out, *(np.concatenate([c[b, :, :n] for b, n in enumerate(written)], 1) for c in (keys, values))]
    want_all = [want[0], *(np.concatenate([c[b, :, :n] for b, n in enumerate(written)], 1) for c in want[1:])]
    for got, ref in zip(got_all, want_all, strict=True):
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


def test_a_token_of_a_many_token_call_equals_it_computed_alone():
    """What makes native speculation lossless: the 4th token of a 6-token call over a 10-slot cache
    is the one-token call at position 13 on the cache those 3 tokens wrote, bit for bit; and so
    over a 200-slot cache, where the many-token call shares its heads among threads."""
    rng = np.random.default_rng(7)
    session = _attention_session()
    for start in (10, 200):
        feeds = _attention_feeds(rng, 1, 6, [start], 64, start + 10)
        many, keys, values = session.run(None, feeds)
        alone = {n: (a[:, 3:4] if n in ("q", "k", "v", "cos", "sin") else a) for n, a in feeds.items()}
        alone["past_key"], alone["past_value"] = keys, values
        alone["seqlens"] = np.asarray([start + 3], np.int32)
        one, _k, _v = session.run(None, alone)
        assert np.array_equal(one[0, 0], many[0, 3])


def _packed_attention_session() -> ort.InferenceSession:
    graph = _attention_graph()
    graph.node[0].input[1], graph.node[0].input[2] = "", ""  # q holds each token's q, k and v
    del graph.input[1:3]
    return _native_session(graph)


@pytest.mark.parametrize(("batch", "tokens", "positions"), [(1, 1, [29]), (2, 3, [4, 17]), (1, 6, [200])])
def test_cached_attention_reads_a_packed_projection_as_its_three_parts(batch, tokens, positions):
    """k and v left out: q is [B, T, (H + 2 Hkv) D], the fused Q/K/V projection's output read
    without a Split. Outputs and caches equal the three-input call's, bit for bit."""
    feeds = _attention_feeds(np.random.default_rng(tokens), batch, tokens, positions, 64, max(positions) + tokens + 3)
    split = _attention_session().run(None, feeds)
    packed_feeds = {n: a for n, a in feeds.items() if n not in ("k", "v")}
    packed_feeds["q"] = np.concatenate([feeds["q"], feeds["k"], feeds["v"]], axis=-1)
    packed = _packed_attention_session().run(None, packed_feeds)
    written = [p + tokens for p in positions]
    for i, (got, want) in enumerate(zip(packed, split, strict=True)):
        if i:  # a copied cache: only the slots up to the write are defined
            got, want = (np.concatenate([c[b, :, :n] for b, n in enumerate(written)], 1) for c in (got, want))
        assert np.array_equal(got, want)
    with pytest.raises(Exception, match="do not have the shapes"):
        _packed_attention_session().run(None, {**packed_feeds, "q": feeds["q"]})  # q without its k and v


def test_cached_attention_refuses_what_does_not_fit_in_one_line():
    rng = np.random.default_rng(0)
    session = _attention_session()
    for change, message in [
        ({"seqlens": np.asarray([45], np.int32)}, "do not fit the cache"),
        ({"cos": np.zeros((1, 2, 3), np.float32)}, "do not have the shapes"),
        ({"k": np.zeros((1, 2, 3 * 8), np.float32)}, "do not have the shapes"),
    ]:
        feeds = _attention_feeds(rng, 1, 2, [3], 8) | change
        with pytest.raises(Exception, match=message) as caught:
            session.run(None, feeds)
        assert "specgraph.CachedAttention: " in str(caught.value)


def _copy_slots_session(caches: int) -> ort.InferenceSession:
    pairs = [name for i in range(caches) for name in (f"source_{i}", f"cache_{i}")]
    node = helper.make_node("CopySlots", ["cache_len", "tokens", *pairs], [f"out_{i}" for i in range(caches)],
                            domain=NATIVE_DOMAIN)  # fmt: skip
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in ("cache_len", "tokens")]
    floats = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in pairs]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.output]
    return _native_session(helper.make_graph([node], "g", ints + floats, outs))


def test_copy_slots_writes_each_rows_slots_of_the_source_into_its_cache():
    """`specgraph.CopySlots`, the fill of a skipped drafter's caches (exporters/gate.py): each
    cache with the T slots from its row's cache_len taken from its source, every other slot as
    it was; the same whether ONNX Runtime allocates the outputs or they are bound onto the
    caches (in place, as the host binds them)."""
    rng = np.random.default_rng(0)
    session = _copy_slots_session(3)
    at, width = np.asarray([0, 5, 9], np.int64), 3
    feeds = {"cache_len": at, "tokens": np.zeros((3, width), np.int64)}
    for i in range(3):
        feeds[f"source_{i}"] = rng.standard_normal((3, 2, 12, 4)).astype(np.float32)
        feeds[f"cache_{i}"] = rng.standard_normal((3, 2, 12, 4)).astype(np.float32)
    want = []
    for i in range(3):
        cache = feeds[f"cache_{i}"].copy()
        for b, start in enumerate(at):
            cache[b, :, start : start + width] = feeds[f"source_{i}"][b, :, start : start + width]
        want.append(cache)
    for got, expected in zip(session.run(None, feeds), want, strict=True):
        assert np.array_equal(got, expected)
    io = session.io_binding()
    values = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in feeds.items()}
    for name, value in values.items():
        io.bind_ortvalue_input(name, value)
    for i in range(3):
        io.bind_ortvalue_output(f"out_{i}", values[f"cache_{i}"])
    session.run_with_iobinding(io)
    for i, expected in enumerate(want):
        assert np.array_equal(values[f"cache_{i}"].numpy(), expected)
    for change, message in [
        ({"cache_len": np.asarray([0, 5, 10], np.int64)}, "do not fit the cache"),
        ({"cache_1": np.zeros((3, 2, 11, 4), np.float32)}, "alike"),
        ({"tokens": np.zeros((2, width), np.int64)}, "cache_len is not"),
    ]:
        with pytest.raises(Exception, match=message) as caught:
            session.run(None, feeds | change)
        assert "specgraph.CopySlots: " in str(caught.value)


def test_a_native_batched_verify_equals_each_row_verified_alone(tmp_path):
    """The batched verify GroupQueryAttention refuses runs through CachedAttention in one node:
    the same logits as each row verified alone (native kernels, a Q4_1 GGUF)."""
    from tests.test_fused_attention import _logits

    path = write_llama_gguf(tmp_path / "m.gguf", "Q4_1", "Q8_0")
    compile_model(CompileConfig.of(model=str(path), output=tmp_path / "b", method="none", max_context=160,
                                   kernels="native", emit_logits=True))  # fmt: skip
    engine = Engine(tmp_path / "b")
    model = onnx.load(str(tmp_path / "b" / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("CachedAttention") == engine.manifest["weights"]["native_attention"] > 0
    assert not any(n.op_type == "If" and n.name.startswith("gqa.") for n in model.graph.node)
    # each layer reads its fused Q/K/V projection whole: no Split between them
    assert all(n.input[1] == n.input[2] == "" for n in model.graph.node if n.op_type == "CachedAttention")
    assert "Split" not in ops
    prompts, drafts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43]], [[12, 13, 14], [44, 45, 46]]
    alone = []
    for prompt, draft in zip(prompts, drafts, strict=True):
        state = engine.new_state(1)
        _logits(engine, [prompt], [0], state)
        alone.append(_logits(engine, [draft], [len(prompt)], state)[0])
    state = engine.new_state(2)
    width = max(map(len, prompts))
    _logits(engine, [p + [0] * (width - len(p)) for p in prompts], [0, 0], state)
    batched = _logits(engine, drafts, [len(p) for p in prompts], state)
    for got, want in zip(batched, alone, strict=True):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_native_early_exit_runs_its_draft_caches_natively_and_stays_exact(tmp_path):
    """An early-exit engine's K draft runs each write a cache the next run reads (the catch-up's
    output bound in place, the steps' written into it: exporters/attention.py): every run is a
    CachedAttention node, and the text is the none engine's."""
    from tests.methods.test_early_exit import random_adapter

    gguf = write_llama_gguf(tmp_path / "m.gguf", "Q4_1", "Q8_0")
    adapter = random_adapter(gguf, tmp_path / "a.safetensors", std=0)  # drafts well: long accepted runs
    engines = {}
    for method, own in (("none", {}), ("early-exit", {"exit_adapter": str(adapter), "num_draft": 3})):
        compile_model(CompileConfig.of(str(gguf), tmp_path / method, method, max_context=96, **own))
        engines[method] = Engine(tmp_path / method)
    weights = engines["early-exit"].manifest["weights"]
    assert weights["native_attention"] > engines["none"].manifest["weights"]["native_attention"] > 0
    for prompt in PROMPTS:
        want = engines["none"].generate(prompt, max_new_tokens=32, stop_at_eos=False).output_ids
        assert engines["early-exit"].generate(prompt, max_new_tokens=32, stop_at_eos=False).output_ids == want


@pytest.mark.parametrize(
    ("matrices", "embedding", "method"),
    [("Q4_1", "Q8_0", "none"), ("Q4_0", "Q4_0", "lookup"), ("Q8_0", "Q4_1", "medusa")],
)
def test_native_engines_match_hf_generate_on_the_gguf(matrices, embedding, method, tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", matrices, embedding)
    extra = {"heads": str(_heads(tmp_path))} if method == "medusa" else {}
    out = tmp_path / "b"
    compile_model(CompileConfig.of(model=str(path), output=out, method=method, max_context=160, kernels="native",
                                   emit_logits=True, **extra))  # fmt: skip
    engine = Engine(out)
    weights = engine.manifest["weights"]
    assert weights["kernels"] == "native" and weights["native_matmuls"] == weights["matmuls"] > 0
    model, _tok = read_gguf(path)
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=64, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, 64))
    if method != "none":
        return
    prompt = PROMPTS[2]  # the logits of a whole prompt (one many-row call): the dequantised model's, to 1e-4
    feeds = {"tokens": np.asarray([prompt], np.int64), "n_fixed": np.asarray([len(prompt)], np.int64),
             "cache_len": np.zeros(1, np.int64)}  # fmt: skip
    got = engine.call(engine.session.io_binding(), feeds, engine.new_state(1))["logits"].numpy()[0]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_native_speculation_equals_its_own_none_engine(tiny_folder, tmp_path, weights, monkeypatch):
    """int4 and int8 weights made here, native kernels: lookup and Medusa emit what none emits,
    greedy and sampled. At int4 none's codes take the lanes layout and theirs the pairs layout, plus
    lanes that their one-token calls read; at int8 (two digits) every engine's take wide lanes.
    (Where AMX runs them the one-digit products take digits instead: the digits tests below.)"""
    monkeypatch.setenv("SPECGRAPH_KERNELS_NO_AMX", "1")
    folder = tiny_folder("llama")
    engines = {}
    for method in ("none", "lookup", "medusa"):
        extra = {"heads": str(_heads(tmp_path))} if method == "medusa" else {}
        compile_model(CompileConfig.of(model=str(folder), output=tmp_path / method, method=method, max_context=160,
                                       weights=weights, kernels="native", **extra))  # fmt: skip
        engines[method] = Engine(tmp_path / method)
    lanes = {method: engine.manifest["weights"]["native_lanes"] for method, engine in engines.items()}
    matmuls = {method: engine.manifest["weights"]["matmuls"] for method, engine in engines.items()}
    assert lanes["none"] == matmuls["none"] > 0
    one_row = {method: engine.manifest["weights"]["native_one_row_lanes"] for method, engine in engines.items()}
    if weights == "int4":  # speculative engines keep pairs for verify calls, and lanes for one-token calls
        assert lanes["lookup"] == lanes["medusa"] == 0
        assert (
            one_row["lookup"] == matmuls["lookup"] and one_row["medusa"] == matmuls["medusa"] and one_row["none"] == 0
        )
        # the extra lanes hold each product's pairs again (padded to whole lanes of 8 outputs); bench
        # counts one copy as what a call streams
        graph = onnx.load(str(tmp_path / "lookup" / "model.onnx"), load_external_data=False).graph
        sizes = {t.name: int(np.prod(t.dims)) for t in graph.initializer}
        nodes = [n for n in graph.node if n.op_type == "BlockMatMul" and len(n.input) > 7 and n.input[7]]
        pairs = sum(sizes[n.input[1]] for n in nodes)
        extra = engines["lookup"].manifest["weights"]["native_one_row_bytes"]
        assert len(nodes) == matmuls["lookup"] and pairs <= extra <= pairs * 1.1
        from specgraph.bench import _weights

        assert _weights(engines["lookup"], 1.0, None)["bytes_per_token"] == engines["lookup"].weight_bytes - extra
    else:
        assert lanes == matmuls and not any(one_row.values())
    for prompt in PROMPTS:
        want = engines["none"].generate(prompt, max_new_tokens=48, stop_at_eos=False).output_ids
        sampled = engines["none"].generate(prompt, max_new_tokens=32, stop_at_eos=False, temperature=0.8, seed=3)
        for method in ("lookup", "medusa"):
            assert engines[method].generate(prompt, max_new_tokens=48, stop_at_eos=False).output_ids == want
            again = engines[method].generate(prompt, max_new_tokens=32, stop_at_eos=False, temperature=0.8, seed=3)
            assert again.output_ids == sampled.output_ids


def test_digits_engines_match_hf_and_their_speculation_their_none(tmp_path, monkeypatch):
    """Exact one-digit products stored as digits (what a compile does where AMX runs them; forced
    here, so a CPU without AMX tests its own loops): none, lookup and Medusa on a Q4_1 GGUF equal
    HF greedy for 64 tokens, the speculative engines equal none greedy and sampled, the logits of
    a prompt are the dequantised model's to 1e-4."""
    monkeypatch.setenv("SPECGRAPH_KERNELS_DIGITS", "1")
    path = write_llama_gguf(tmp_path / "m.gguf", "Q4_1", "Q8_0")
    model, _tok = read_gguf(path)
    engines = {}
    for method in ("none", "lookup", "medusa"):
        extra = {"heads": str(_heads(tmp_path))} if method == "medusa" else {}
        compile_model(CompileConfig.of(model=str(path), output=tmp_path / method, method=method, max_context=160,
                                       kernels="native", emit_logits=method == "none", **extra))  # fmt: skip
        engines[method] = Engine(tmp_path / method)
        weights = engines[method].manifest["weights"]
        # every product, the tied Q8_0 head's in byte quads, which the embedding Gather reads too
        assert weights["native_digits"] == weights["matmuls"] == sum(weights["formats"].values()) > 0, method
        assert weights["native_one_row_lanes"] == weights["native_lanes"] == weights["native_quads_gather_bytes"] == 0
    for prompt in PROMPTS:
        want = engines["none"].generate(prompt, max_new_tokens=64, stop_at_eos=False).output_ids
        assert_same_greedy(model, prompt, want, hf_greedy(model, prompt, 64))
        sampled = engines["none"].generate(prompt, max_new_tokens=32, stop_at_eos=False, temperature=0.8, seed=3)
        for method in ("lookup", "medusa"):
            assert engines[method].generate(prompt, max_new_tokens=64, stop_at_eos=False).output_ids == want
            again = engines[method].generate(prompt, max_new_tokens=32, stop_at_eos=False, temperature=0.8, seed=3)
            assert again.output_ids == sampled.output_ids
    prompt = PROMPTS[2]
    feeds = {"tokens": np.asarray([prompt], np.int64), "n_fixed": np.asarray([len(prompt)], np.int64),
             "cache_len": np.zeros(1, np.int64)}  # fmt: skip
    engine = engines["none"]
    got = engine.call(engine.session.io_binding(), feeds, engine.new_state(1))["logits"].numpy()[0]
    with torch.no_grad():
        want_logits = model(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(got - want_logits).max() <= 1e-4 * np.abs(want_logits).max()
    monkeypatch.setenv("SPECGRAPH_KERNELS_NO_AMX", "1")  # and where a compile keeps lanes
    compile_model(CompileConfig.of(model=str(path), output=tmp_path / "lanes", max_context=160, kernels="native"))
    assert "native_digits" not in Engine(tmp_path / "lanes").manifest["weights"]


def test_what_native_kernels_cannot_run_is_refused(tmp_path, capsys, monkeypatch):
    path = str(write_llama_gguf(tmp_path / "m.gguf", "Q4_1", "Q8_0"))
    out = tmp_path / "out"
    compile_model(CompileConfig.of(model=path, output=out, max_context=160, kernels="native"))
    monkeypatch.setenv(ENV, str(tmp_path / "absent.so"))
    _cli_refuses(["compile", path, "-o", str(tmp_path / "o2"), "--kernels", "native"], capsys, ENV)
    assert not (tmp_path / "o2").exists()
    with pytest.raises(BundleError, match="native kernels") as caught:
        Engine(out)
    assert len(str(caught.value).splitlines()) == 1
    _cli_refuses(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "2"], capsys, "native kernels")
    with pytest.raises(InputError, match="unknown --kernels"):
        CompileConfig.of(model=path, output=tmp_path / "o3", kernels="fast").check()
    # auto: ort where the library is missing
    compile_model(CompileConfig.of(model=path, output=tmp_path / "o4", max_context=160))
    assert Engine(tmp_path / "o4").manifest["weights"]["kernels"] == "ort"


def test_auto_kernels_are_native_at_either_activations(tmp_path):
    """Where the library is built, auto takes it; at int8 activations every product of 32-weight
    blocks quantises its input natively, and no one-token call is padded (the native kernel rounds
    a row alike in any call)."""
    path = str(write_llama_gguf(tmp_path / "m.gguf", "Q4_1", "Q8_0"))
    for activations in ("fp32", "int8"):
        out = tmp_path / activations
        compile_model(CompileConfig.of(model=path, output=out, max_context=160, activations=activations))
        engine = Engine(out)
        weights = engine.manifest["weights"]
        assert weights["kernels"] == "native" and engine.extra_slots == 0
        if activations == "int8":
            assert weights["native_int8"] == weights["matmuls"] > 0 and weights["native_lanes"] == 0
            # the one-digit (Q4_1) products read quads where the library runs VNNI's loop, pairs elsewhere
            assert weights["quads"] == (weights["matmuls"] - 1 if code_path() == "avx512-vnni" else 0)


def test_float32_weights_run_their_attention_natively(tmp_path):
    """At --weights fp32 native kernels take the fused attention layers (the products stay ONNX
    Runtime's float32 Gemms): the bundle says so and loads the library, and its greedy text is
    the ONNX Runtime bundle's, a draft model's engine (its runs fused too) included."""
    path = str(write_llama_gguf(tmp_path / "m.gguf", "Q4_1", "Q8_0"))
    engines = {}
    for name, kernels, method, own in (("ort", "ort", "none", {}), ("native", "auto", "none", {}),
                                       ("draft", "native", "draft", {"draft": "self:int4", "num_draft": 3})):  # fmt: skip
        compile_model(CompileConfig.of(model=path, output=tmp_path / name, method=method, max_context=160,
                                       weights="fp32", kernels=kernels, **own))  # fmt: skip
        engines[name] = Engine(tmp_path / name)
    layers = engines["ort"].manifest["anatomy"]["decoder_blocks"]
    assert "kernels" not in engines["ort"].manifest["weights"]
    native = engines["native"].manifest["weights"]
    assert native == {"weights": "fp32", "activations": "fp32", "stored": "float32", "kernels": "native",
                      "native_attention": layers}  # fmt: skip
    assert engines["draft"].manifest["weights"]["native_attention"] == 4 * layers  # the target's and 3 draft runs
    for prompt in PROMPTS:
        want = engines["ort"].generate(prompt, max_new_tokens=32, stop_at_eos=False).output_ids
        for name in ("native", "draft"):
            assert engines[name].generate(prompt, max_new_tokens=32, stop_at_eos=False).output_ids == want
