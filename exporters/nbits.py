"""Run weights as integer blocks: `Gemm(x, W, transB=1)` becomes ONNX Runtime's 4-bit `MatMulNBits`.

A BlockWeight (`specgraph/blocks.py`) says `w = scale * codes + offset` per block of inputs. Codes
of up to 4 bits are one 4-bit digit; wider codes (Q5_K, Q6_K, Q8_0, int8) are two, `codes = 16*hi
+ lo`. `MatMulNBits` computes `x @ (s_d * (digit - 8))^T` per digit (its default zero point is 8),
so the offsets collect in one per-block term, added as a small product with the block sums of x:

    y = sum_d MatMulNBits(x, digit_d, s_d)  +  blocksum(x) @ c'^T,   s_hi = 16 s,  s_lo = s,
    c' = offset + 8 s (one digit)  or  offset + 136 s (two digits; 136 = 8*16 + 8)

`accuracy_level=1` multiplies in float32, so the product equals the dequantised weight's to float
rounding (this is `--activations fp32`); `accuracy_level=4` quantises x to int8 per block first
(`--activations int8`: faster, a different model). With `native` kernels (`--kernels native`)
each product is instead one `specgraph.BlockMatMul` node over the same digit buffers, scales and
c' (`host/src/kernels/`, specgraph's own ONNX Runtime operator library): the same sum in float32,
the offset term included, in one node. At int8 activations a native product of 32-weight blocks
quantises x per block of 32 (`activation_bits=8`); one of other blocks (Q6_K's 16) multiplies in
float32, so a native engine's every product stays row-consistent. An embedding table whose rows are the same
blocks (a tied LM head) is gathered from the same digit buffers and dequantised in the graph:
the engine holds no float copy of a quantised weight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specgraph.blocks import BlockWeight
from specgraph.exporters.gemm import drop_dead

logger = logging.getLogger("specgraph.exporters")
Lookup = Callable[[str, np.ndarray], list[BlockWeight] | None]


@dataclass
class NBitsReport:
    """What the rewrite changed, for the compile report and the manifest."""

    matmuls: int = 0
    native: int = 0  # of the matmuls, those run by specgraph.BlockMatMul
    native_int8: int = 0  # of those, the ones that quantise their input to int8 (activation_bits=8)
    lanes: int = 0  # of their runs, those whose codes take the kernel's lanes layout
    one_row: int = 0  # of their runs, those in pairs that also hold lanes for one-row calls
    one_row_bytes: int = 0  # bytes of those lanes (stored beside the pairs; a call streams one of the two)
    quads: int = 0  # of the int8 runs, those whose codes take the quads layout
    digits: int = 0  # of the float32 runs, those multiplied as four int8 digits (quads, activation_bits 24)
    quads_gather_bytes: int = 0  # of those, the pairs a Gather of the same table reads (a call streams one)
    gathers: int = 0
    formats: dict[str, int] = field(default_factory=dict)  # weights per stored format
    float_bytes: int = 0  # fp32 bytes of the weights replaced
    stored_bytes: int = 0  # bytes of their digits, scales and offsets


@dataclass
class _Digits:
    """The initializer names of one run of rows: packed digits with their scales, and c'."""

    rows: int
    cols: int
    block: int
    digits: list[tuple[str, str]]  # (packed uint8 [N, K/block, block/2], scales float32 [N, K/block])
    offset: str | None  # float32 c'^T [K/block, N], None when every c' is zero
    native: tuple[np.ndarray, np.ndarray]  # the stored scale d and offset m, [N, K/block] each (for _native_nodes)


NATIVE_DOMAIN = "specgraph"  # the operator domain of host/src/kernels/ort_op.cpp


def run_weights_as_blocks(
    path: Path,
    lookup: Lookup,
    accuracy_level: int,
    tables: str | None = None,
    native: bool = False,
    lanes: bool = False,
    wide: bool = False,
    one_row: bool = False,
    quads: bool = False,
    digits: bool = False,
) -> NBitsReport:
    """Rewrite `path` (and its external data) in place; `lookup(name, W)` gives W's blocks or None.
    `native`: products whose blocks the native kernel takes become `specgraph.BlockMatMul` nodes;
    `lanes`: those of one digit, but for a table a Gather also reads, take the lanes layout;
    `wide`: those of two digits take wide lanes (a table the tokens' Gather reads too: it reads them);
    `one_row`: those of one digit left in pairs also get lanes, which calls of one row read;
    `quads`: those of one digit at int8 activations take quads (a table a Gather also reads keeps its
    pairs for the Gather: a call streams one of the two);
    `digits`: those in blocks of 32 at float32 activations take quads too (byte quads for two
    digits), their input written as four int8 digits (`activation_bits=24`, float32's precision in
    integers: AMX's).
    An embedding Gather is rewritten when its ids are a graph input [B, T] (the tokens), when its
    table is one the tokens gather or a product multiplies (EAGLE's drafter embeds its drafts
    through the target's table), or when its table's name starts with `tables` (a drafter's own,
    whose ids are computed in the graph); so a stored table never keeps a float copy."""
    model = onnx.load(str(path))
    graph = model.graph
    arrays = {t.name: t for t in graph.initializer}
    report = NBitsReport()
    done: dict[str, list[_Digits] | None] = {}

    def digits_for(name: str) -> list[_Digits] | None:
        if name not in done:
            init = arrays.get(name)
            runs = None
            if init is not None and len(init.dims) == 2 and init.data_type == TensorProto.FLOAT:
                weight = numpy_helper.to_array(init)
                runs = lookup(name, weight)
                if runs is not None:
                    report.float_bytes += weight.nbytes
                    for run in runs:
                        report.formats[run.format] = report.formats.get(run.format, 0) + 1
            done[name] = None if runs is None else [_add_digits(graph, f"{name}.r{i}", r) for i, r in enumerate(runs)]
        return done[name]

    blocksums: dict[tuple[str, int], str] = {}
    new_nodes: list[onnx.NodeProto] = []
    wrapped = _reshape_wrappers(graph)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in graph.input}  # embedding ids: tokens [B, T]
    dropped: set[str] = set()
    gathered = {node.input[0] for node in graph.node if node.op_type == "Gather"}  # tied tables keep one layout
    # a table the tokens gather, or a product's, is stored as blocks once: every Gather of it reads
    # the blocks (a drafter embedding the target's tokens through computed ids), never a float copy
    stored = {n.input[0] for n in graph.node if n.op_type == "Gather" and ranks.get(n.input[1]) == 2} | {
        n.input[1] for n in graph.node if n.op_type == "Gemm" and _plain_transb(n) and len(n.input) == 2
    }

    def rewritten(node: onnx.NodeProto) -> bool:
        table = node.input[0]
        return _axis(node) == 0 and (
            ranks.get(node.input[1]) == 2 or table in stored or (tables is not None and table.startswith(tables))
        )

    # ... and a two-digit table whose every Gather is rewritten may take wide lanes: the Gathers read them
    wide_gathers = gathered - {n.input[0] for n in graph.node if n.op_type == "Gather" and not rewritten(n)}
    int8 = accuracy_level == 4
    quads_gathered: set[str] = set()
    for node in graph.node:
        if node.op_type == "Gemm" and _plain_transb(node) and len(node.input) == 2:
            runs = digits_for(node.input[1])
            if runs is not None:
                x, y = node.input[0], node.output[0]
                if node.name in wrapped:  # MatMulNBits takes [..., K]: drop gemm.py's flatten/unflatten
                    flatten, unflatten = wrapped[node.name]
                    x, y = flatten.input[0], unflatten.output[0]
                    dropped.update((flatten.name, unflatten.name))
                if native and all(_native_fits(r) for r in runs):
                    quantised = int8 and all(r.block == NATIVE_INT8_BLOCK for r in runs)
                    table = node.input[1]
                    wide_table = len(runs) == 1 and len(runs[0].digits) == 2 and table in wide_gathers
                    exact = [digits and not int8 and r.block == NATIVE_INT8_BLOCK for r in runs]
                    laned = [
                        not quantised and not exact[i]
                        and (lanes and table not in gathered if len(r.digits) == 1 else wide and (table not in gathered or wide_table))
                        for i, r in enumerate(runs)
                    ]  # fmt: skip
                    also = [
                        one_row and not quantised and not laned[i] and not exact[i] and len(r.digits) == 1
                        for i, r in enumerate(runs)
                    ]
                    quad = [quads and quantised and len(r.digits) == 1 for r in runs]  # a Gather reads the pairs
                    new_nodes += _native_nodes(node.name, x, y, runs, graph, laned, quantised, also, quad, exact)
                    report.quads += sum(quad)
                    report.digits += sum(exact)
                    if table in gathered:  # the Gather reads the pairs (a two-digit table's Gathers: the byte quads)
                        for r, on in zip(runs, [a or b for a, b in zip(quad, exact, strict=True)], strict=True):
                            if on and not (len(r.digits) == 2 and table in wide_gathers):
                                quads_gathered.update(q for q, _s in r.digits)
                    report.native += 1
                    report.native_int8 += quantised
                    report.lanes += sum(laned)
                    report.one_row += sum(also)
                else:
                    new_nodes += _matmul_nodes(node.name, x, y, runs, accuracy_level, blocksums, graph)
                report.matmuls += 1
                continue
        if node.op_type == "Gather" and rewritten(node):
            runs = digits_for(node.input[0])
            if runs is not None and len(runs) == 1:
                run = runs[0]
                quantised = int8 and run.block == NATIVE_INT8_BLOCK  # its product reads the digits
                laned_table = (
                    wide and native and not quantised and len(run.digits) == 2 and node.input[0] in wide_gathers
                )
                byte_table = laned_table and digits and run.block == NATIVE_INT8_BLOCK  # its product reads byte quads
                new_nodes += _gather_nodes(
                    node,
                    run,
                    _native_lanes(graph, run) if laned_table and not byte_table and _native_fits(run) else None,
                    flat=ranks.get(node.input[1]) != 2,
                    byte_quads=_native_quads(graph, run) if byte_table else None,
                )
                report.gathers += 1
                continue
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(n for n in new_nodes if n.name not in dropped or not n.name)
    drop_dead(graph)
    report.stored_bytes = _stored_bytes(graph, [d for runs in done.values() for d in runs or []])
    report.quads_gather_bytes = sum(int(np.prod(t.dims)) for t in graph.initializer if t.name in quads_gathered)
    one_row_lanes = {n.input[7] for n in graph.node if n.op_type == "BlockMatMul" and len(n.input) > 7 and n.input[7]}
    report.one_row_bytes = sum(int(np.prod(t.dims)) for t in graph.initializer if t.name in one_row_lanes)  # uint8
    for domain in ("com.microsoft", NATIVE_DOMAIN) if report.native else ("com.microsoft",):
        if domain not in {o.domain for o in model.opset_import}:
            model.opset_import.append(helper.make_opsetid(domain, 1))
    data = path.name + ".data"
    (path.parent / data).unlink(missing_ok=True)
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data, size_threshold=1024
    )
    logger.debug("ran %d matmuls and %d gathers on stored blocks", report.matmuls, report.gathers)
    return report


def _plain_transb(node: onnx.NodeProto) -> bool:
    attrs = {a.name: a for a in node.attribute}
    return (
        attrs.get("transB") is not None
        and attrs["transB"].i == 1
        and ("transA" not in attrs or attrs["transA"].i == 0)
        and all(attrs[k].f == 1.0 for k in ("alpha", "beta") if k in attrs)
    )


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _pack(digit: np.ndarray, block: int) -> np.ndarray:
    """uint8 [N, K] values < 16 -> [N, K/block, block/2]: weight 2j in the low nibble, 2j+1 high."""
    n, k = digit.shape
    pairs = digit.reshape(n, k // block, block // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def _add_digits(graph: onnx.GraphProto, name: str, bw: BlockWeight) -> _Digits:
    n, k = bw.shape
    scale = bw.scale.astype(np.float64)
    if bw.bits <= 4:
        parts = [(bw.codes, scale)]
        centre = 8.0 * scale
    else:  # codes = 16*hi + lo
        parts = [(bw.codes >> 4, 16.0 * scale), (bw.codes & 0x0F, scale)]
        centre = 136.0 * scale
    names = []
    for i, (digit, s) in enumerate(parts):
        q, sc = f"{name}.q{i}", f"{name}.s{i}"
        graph.initializer.append(numpy_helper.from_array(_pack(digit, bw.block), q))
        graph.initializer.append(numpy_helper.from_array(s.astype(np.float32), sc))
        names.append((q, sc))
    offset = np.ascontiguousarray((bw.offset.astype(np.float64) + centre).astype(np.float32).T)  # c'^T [K/block, N]
    off_name = None
    if offset.any():
        off_name = f"{name}.c"
        graph.initializer.append(numpy_helper.from_array(offset, off_name))
    return _Digits(n, k, bw.block, names, off_name, (bw.scale, bw.offset))


def _stored_bytes(graph: onnx.GraphProto, runs: list[_Digits]) -> int:
    """Bytes of the runs' digits, scales and offsets that the rewritten graph still uses (a native
    product needs one scale of a two-digit weight, so the other is dropped unless a Gather reads it)."""
    names = {n for run in runs for pair in run.digits for n in pair} | {run.offset for run in runs if run.offset}
    names |= {f"{run.digits[0][0].rsplit('.', 1)[0]}.{p}" for run in runs for p in ("d", "m", "lanes", "quads")}
    itemsize = helper.tensor_dtype_to_np_dtype
    return sum(int(np.prod(t.dims)) * itemsize(t.data_type).itemsize for t in graph.initializer if t.name in names)


def _reshape_wrappers(graph: onnx.GraphProto) -> dict[str, tuple[onnx.NodeProto, onnx.NodeProto]]:
    """Gemm name -> (flatten, unflatten) Reshapes that gemm.py put around it (each used only there)."""
    by_name = {n.name: n for n in graph.node}
    out = {}
    for node in graph.node:
        if node.op_type != "Gemm":
            continue
        flatten, unflatten = by_name.get(f"{node.name}_flatten"), by_name.get(f"{node.name}_unflatten")
        if flatten is not None and unflatten is not None and flatten.output[0] == node.input[0]:
            if unflatten.input[0] == node.output[0]:
                out[node.name] = (flatten, unflatten)
    return out


def _matmul_nodes(name: str, x: str, y: str, runs: list[_Digits], level: int, blocksums: dict,  # type: ignore[type-arg]
                  graph: onnx.GraphProto) -> list[onnx.NodeProto]:  # fmt: skip
    """y [..., N] = x [..., K] @ W^T from the runs' digits (row runs concatenated along N)."""
    nodes: list[onnx.NodeProto] = []
    outs = []
    for i, run in enumerate(runs):
        terms = []
        for j, (q, s) in enumerate(run.digits):
            t = f"{y}.r{i}.d{j}"
            nodes.append(
                helper.make_node("MatMulNBits", [x, q, s], [t], name=f"{name}.r{i}.d{j}", domain="com.microsoft",
                                 K=run.cols, N=run.rows, bits=4, block_size=run.block, accuracy_level=level)
            )  # fmt: skip
            terms.append(t)
        if run.offset is not None:
            bsum = _blocksum(x, run.cols, run.block, blocksums, nodes, graph)
            t = f"{y}.r{i}.c"
            nodes.append(helper.make_node("MatMul", [bsum, run.offset], [t], name=f"{name}.r{i}.c"))
            terms.append(t)
        outs.append(_sum(terms, f"{y}.r{i}" if len(runs) > 1 else y, nodes))
    if len(runs) > 1:
        nodes.append(helper.make_node("Concat", outs, [y], name=f"{name}.concat", axis=-1))
    return nodes


def _native_fits(run: _Digits) -> bool:
    """The native kernel takes one or two 4-bit digits in blocks of a multiple of 16 inputs."""
    return len(run.digits) in (1, 2) and run.block % 16 == 0


def _native_nodes(
    name: str,
    x: str,
    y: str,
    runs: list[_Digits],
    graph: onnx.GraphProto,
    lanes: list[bool],
    int8: bool = False,
    one_row: list[bool] | None = None,
    quads: list[bool] | None = None,
    digits: list[bool] | None = None,
) -> list[onnx.NodeProto]:
    """y [..., N] = x [..., K] @ W^T as one BlockMatMul per run: (x, high digit, d, m or "", low
    digit or ""), d and m the format's own scale and offset (the low digit's for two digits). With
    `lanes[i]`, run i's codes go in the kernel's lanes layout (`native_lanes`; wide lanes for two
    digits); `int8`: x is quantised to int8 per block of 32 first (`activation_bits=8`);
    `one_row[i]`: run i keeps pairs and takes its lanes as well (input 7), for calls of one row;
    `quads[i]`: run i's one digit goes in quads (`native_quads`), for int8 activations;
    `digits[i]`: so does run i's, its float32 input taken as four int8 digits (`activation_bits=24`)."""
    nodes: list[onnx.NodeProto] = []
    outs = []
    for i, run in enumerate(runs):
        out = f"{y}.r{i}" if len(runs) > 1 else y
        high, low = run.digits[0][0], run.digits[1][0] if len(run.digits) == 2 else ""
        d, m = _native_scales(graph, high.rsplit(".", 1)[0], run)
        wide = lanes[i] and bool(low)
        if lanes[i]:  # one digit: lanes of 8 outputs; two: wide lanes of 4 (8-bit codes)
            high, low = _native_lanes(graph, run), ""
        elif digits and digits[i]:
            high, low = _native_quads(graph, run), ""
        elif quads and quads[i]:
            high = _native_quads(graph, run)
        inputs = [x, high, d, m, low, "", "", _native_lanes(graph, run) if one_row and one_row[i] else ""]
        while inputs[-1] == "":
            inputs.pop()
        node = helper.make_node("BlockMatMul", inputs, [out], name=f"{name}.r{i}", domain=NATIVE_DOMAIN,
                                K=run.cols, N=run.rows, block_size=run.block)  # fmt: skip
        if int8:
            node.attribute.append(helper.make_attribute("activation_bits", 8))
        elif digits and digits[i]:
            node.attribute.append(helper.make_attribute("activation_bits", 24))
        if wide:
            node.attribute.append(helper.make_attribute("lane_bits", 8))
        nodes.append(node)
        outs.append(out)
    if len(runs) > 1:
        nodes.append(helper.make_node("Concat", outs, [y], name=f"{name}.concat", axis=-1))
    return nodes


NATIVE_SCALE_TILE = 16  # host/src/kernels/block_matmul.h, kScaleTile
NATIVE_INT8_BLOCK = 32  # block_matmul.h, kInt8Block: the weight block int8 activations take
NATIVE_LANE_OUTPUTS = 8  # block_matmul.h, kLaneOutputs: outputs whose 4-bit codes share a 32-bit lane


def native_lanes(packed: np.ndarray, low: np.ndarray | None = None) -> np.ndarray:
    """Packed one-digit codes uint8 [N, K/block, block/2] -> the kernel's lanes, uint8 [ceil(N/8),
    K, 4]: lane [t, p] holds output 8t + o's code in bits [4o, 4o + 4) (zero past N), p the input's
    position in the kernel's paired order (each block's even inputs, then its odd ones). With the
    low digit too (codes 16 * high + low): wide lanes, uint8 [ceil(N/4), K, 4], output 4t + o's
    8-bit code in byte o."""
    n = packed.shape[0]

    def paired(p: np.ndarray) -> np.ndarray:  # [N, K]: a block's evens, then its odds
        return np.stack([p & 0x0F, p >> 4], axis=2).reshape(n, -1).astype(np.uint32)

    codes = paired(packed) if low is None else 16 * paired(packed) + paired(low)
    per, bits = (NATIVE_LANE_OUTPUTS, 4) if low is None else (NATIVE_LANE_OUTPUTS // 2, 8)
    tiles = -(-n // per)
    padded = np.zeros((tiles * per, codes.shape[1]), np.uint32)
    padded[:n] = codes
    grouped = padded.reshape(tiles, per, -1)
    lanes = np.zeros((tiles, codes.shape[1]), np.uint32)
    for o in range(per):
        lanes |= grouped[:, o] << np.uint32(bits * o)
    return lanes.astype("<u4").view(np.uint8).reshape(tiles, -1, 4)


def _native_lanes(graph: onnx.GraphProto, run: _Digits) -> str:
    """The lanes initializer of a run's digits (wide lanes for two), added once."""
    high = run.digits[0][0]
    name = f"{high.rsplit('.', 1)[0]}.lanes"
    if name not in {t.name for t in graph.initializer}:
        arrays = {t.name: t for t in graph.initializer}
        packed = [numpy_helper.to_array(arrays[q]) for q, _s in run.digits]
        graph.initializer.append(numpy_helper.from_array(native_lanes(*packed), name))
    return name


def native_quads(packed: np.ndarray) -> np.ndarray:
    """Packed one-digit codes uint8 [N, K/32, 16] -> quads uint8 [ceil(N/16), K/32, 256]
    (block_matmul.h): per tile of 16 outputs and block, group g's byte 4o + i is output o's packed
    byte 4g + i (zero past N)."""
    n, nb, half = packed.shape
    tiles = -(-n // NATIVE_SCALE_TILE)
    padded = np.zeros((tiles * NATIVE_SCALE_TILE, nb, half), np.uint8)
    padded[:n] = packed
    grouped = padded.reshape(tiles, NATIVE_SCALE_TILE, nb, half // 4, 4)  # [t, o, b, g, i]
    return np.ascontiguousarray(grouped.transpose(0, 2, 3, 1, 4)).reshape(tiles, nb, half * NATIVE_SCALE_TILE)


def native_byte_quads(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Packed two-digit codes (high and low, uint8 [N, K/32, 16] each) -> byte quads uint8
    [ceil(N/16), K/32, 512] (block_matmul.h): per tile of 16 outputs and block, row j = 2g + h of
    64 bytes holds byte 4o + i = output o's 8-bit code of input 8g + 2i + h (zero past N)."""
    n, nb, half = high.shape

    def unpacked(p: np.ndarray) -> np.ndarray:  # [N, K/32, 32]: inputs in order
        return np.stack([p & 0x0F, p >> 4], axis=3).reshape(n, nb, 2 * half)

    codes = 16 * unpacked(high) + unpacked(low)
    tiles = -(-n // NATIVE_SCALE_TILE)
    padded = np.zeros((tiles * NATIVE_SCALE_TILE, nb, 2 * half), np.uint8)
    padded[:n] = codes
    # input 8g + 2i + h -> [g, i, h]; wanted [t, b, g, h, o, i]
    grouped = padded.reshape(tiles, NATIVE_SCALE_TILE, nb, 4, 4, 2)  # [t, o, b, g, i, h]
    return np.ascontiguousarray(grouped.transpose(0, 2, 3, 5, 1, 4)).reshape(tiles, nb, 16 * 2 * half)


def _native_quads(graph: onnx.GraphProto, run: _Digits) -> str:
    """The quads initializer of a run's one digit (byte quads for two), added once."""
    high = run.digits[0][0]
    name = f"{high.rsplit('.', 1)[0]}.quads"
    if name not in {t.name for t in graph.initializer}:
        arrays = {t.name: t for t in graph.initializer}
        packed = [numpy_helper.to_array(arrays[q]) for q, _s in run.digits]
        quads = native_quads(packed[0]) if len(packed) == 1 else native_byte_quads(*packed)
        graph.initializer.append(numpy_helper.from_array(quads, name))
    return name


def native_scale_tiles(a: np.ndarray) -> np.ndarray:
    """[N, K/block] -> float32 [ceil(N/16), K/block, 16]: each tile of 16 outputs' values, block by
    block (zero past N), the native kernel's layout."""
    n, nb = a.shape
    tiles = -(-n // NATIVE_SCALE_TILE)
    padded = np.zeros((tiles * NATIVE_SCALE_TILE, nb), np.float32)
    padded[:n] = a
    return np.ascontiguousarray(padded.reshape(tiles, NATIVE_SCALE_TILE, nb).transpose(0, 2, 1))


def _native_scales(graph: onnx.GraphProto, name: str, run: _Digits) -> tuple[str, str]:
    """The initializers of a run's d and m ("" when every m is zero), added once: float16 when that
    holds every value exactly (GGUF's block scales are float16), else float32."""
    d_name, m_name = f"{name}.d", f"{name}.m"
    d, m = (native_scale_tiles(a) for a in run.native)
    if d_name not in {t.name for t in graph.initializer}:
        exact = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (d, m))
        dtype = np.float16 if exact else np.float32
        graph.initializer.append(numpy_helper.from_array(d.astype(dtype), d_name))
        if m.any():
            graph.initializer.append(numpy_helper.from_array(m.astype(dtype), m_name))
    return d_name, m_name if m.any() else ""


def _blocksum(x: str, k: int, block: int, cache: dict, nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> str:  # type: ignore[type-arg]
    """[..., K] -> [..., K/block] sums of each block of x, as x @ E with E a 0/1 matrix (one per
    input and block size; E is K*K/block floats, 41 KB for K = 576)."""
    if (x, block) not in cache:
        ones = f"blocksum.{k}.{block}"
        if ones not in {t.name for t in graph.initializer}:
            e = (np.arange(k)[:, None] // block == np.arange(k // block)[None, :]).astype(np.float32)  # [K, K/block]
            graph.initializer.append(numpy_helper.from_array(e, ones))
        nodes.append(helper.make_node("MatMul", [x, ones], [f"{x}.bs{block}"]))
        cache[(x, block)] = f"{x}.bs{block}"
    return cache[(x, block)]  # type: ignore[no-any-return]


def _sum(terms: list[str], out: str, nodes: list[onnx.NodeProto]) -> str:
    if len(terms) == 1:
        nodes.append(helper.make_node("Identity", terms, [out]))
    else:
        acc = terms[0]
        for j, t in enumerate(terms[1:]):
            nxt = out if j == len(terms) - 2 else f"{out}.sum{j}"
            nodes.append(helper.make_node("Add", [acc, t], [nxt]))
            acc = nxt
    return out


def _gather_nodes(node: onnx.NodeProto, run: _Digits, lanes: str | None = None,
                  flat: bool = False, byte_quads: str | None = None) -> list[onnx.NodeProto]:  # fmt: skip
    """Embedding rows from the digit buffers: gather packed rows, unpack nibbles, scale, offset.
    `lanes`: a two-digit table's wide lanes instead, each row's bytes gathered and split into the
    same two digits, so the rows equal the digit buffers' to the bit; `byte_quads`: its byte quads
    instead, alike. The ids are [B, T]; `flat`:
    ids of a rank not known here (computed in the graph), gathered as [1, n] and the rows
    reshaped back to the ids' shape."""
    ids, y, p = node.input[1], node.output[0], node.output[0] + ".q"
    nb = run.cols // run.block
    nodes: list[onnx.NodeProto] = []

    def const(name: str, value: np.ndarray) -> str:
        nodes.append(helper.make_node("Constant", [], [f"{p}.{name}"], value=numpy_helper.from_array(value)))
        return f"{p}.{name}"

    lead = f"{p}.lead"
    nodes.append(helper.make_node("Shape", [ids], [f"{p}.ids_shape" if flat else lead]))
    if flat:
        nodes.append(helper.make_node("Reshape", [ids, const("one_row", np.asarray([1, -1], np.int64))], [f"{p}.ids"]))
        nodes.append(helper.make_node("Shape", [f"{p}.ids"], [lead]))
        ids = f"{p}.ids"
    blocks_shape, row_shape = f"{p}.blocks_shape", f"{p}.row_shape"
    nodes.append(
        helper.make_node(
            "Concat", [lead, const("nb_bs", np.asarray([nb, run.block], np.int64))], [blocks_shape], axis=0
        )
    )
    row_lead = f"{p}.ids_shape" if flat else lead
    nodes.append(
        helper.make_node("Concat", [row_lead, const("k", np.asarray([run.cols], np.int64))], [row_shape], axis=0)
    )
    last = const("last", np.asarray([-1], np.int64))
    fifteen, four, eight = (
        const("f", np.asarray(15, np.uint8)),
        const("four", np.asarray(4, np.uint8)),
        const("eight", np.asarray(8.0, np.float32)),
    )
    if lanes is not None:
        nodes += _wide_lane_codes(ids, lanes, run, f"{p}.wide", lead, blocks_shape, const)
    elif byte_quads is not None:
        nodes += _byte_quad_codes(ids, byte_quads, run, f"{p}.wide", lead, blocks_shape, const)
    terms = []
    for j, (q, s) in enumerate(run.digits):
        d = f"{p}.d{j}"
        if lanes is not None or byte_quads is not None:  # digit 0 is the code's high nibble, digit 1 its low one
            split = helper.make_node("BitShift", [f"{p}.wide", four], [f"{d}.codes"], direction="RIGHT") if j == 0 else \
                helper.make_node("BitwiseAnd", [f"{p}.wide", fifteen], [f"{d}.codes"])  # fmt: skip
            nodes.append(split)
        else:
            nodes += [
                helper.make_node("Gather", [q, ids], [f"{d}.packed"], axis=0),  # [*ids, nb, block/2]
                helper.make_node("BitwiseAnd", [f"{d}.packed", fifteen], [f"{d}.lo"]),
                helper.make_node("BitShift", [f"{d}.packed", four], [f"{d}.hi"], direction="RIGHT"),
                helper.make_node("Unsqueeze", [f"{d}.lo", last], [f"{d}.lo1"]),
                helper.make_node("Unsqueeze", [f"{d}.hi", last], [f"{d}.hi1"]),
                helper.make_node("Concat", [f"{d}.lo1", f"{d}.hi1"], [f"{d}.pairs"], axis=-1),  # [*ids, nb, block/2, 2]
                helper.make_node("Reshape", [f"{d}.pairs", blocks_shape], [f"{d}.codes"]),  # [*ids, nb, block]
            ]
        nodes += [
            helper.make_node("Cast", [f"{d}.codes"], [f"{d}.float"], to=TensorProto.FLOAT),
            helper.make_node("Sub", [f"{d}.float", eight], [f"{d}.centred"]),
            helper.make_node("Gather", [s, ids], [f"{d}.scale"], axis=0),  # [*ids, nb]
            helper.make_node("Unsqueeze", [f"{d}.scale", last], [f"{d}.scale1"]),
            helper.make_node("Mul", [f"{d}.centred", f"{d}.scale1"], [f"{d}.w"]),
        ]  # fmt: skip
        terms.append(f"{d}.w")
    if run.offset is not None:
        nodes += [
            helper.make_node("Gather", [run.offset, ids], [f"{p}.cT"], axis=1),  # [nb, B, T]
            helper.make_node("Transpose", [f"{p}.cT"], [f"{p}.c"], perm=[1, 2, 0]),  # [B, T, nb]
            helper.make_node("Unsqueeze", [f"{p}.c", last], [f"{p}.c1"]),
        ]
        terms.append(f"{p}.c1")
    _sum(terms, f"{p}.blocks", nodes)
    nodes.append(helper.make_node("Reshape", [f"{p}.blocks", row_shape], [y], name=node.name))
    return nodes


def _wide_lane_codes(ids: str, lanes: str, run: _Digits, out: str, lead: str, blocks_shape: str,
                     const: Callable[[str, np.ndarray], str]) -> list[onnx.NodeProto]:  # fmt: skip
    """`out` [B, T, nb, block] uint8: the 8-bit codes of rows `ids` [B, T] of a wide-lanes table
    (row n's code of paired input p is byte n % 4 of lane [n / 4, p]), in the inputs' own order."""
    k, nb, half = run.cols, run.cols // run.block, run.block // 2
    four = const("wide.four", np.asarray(4, np.int64))
    axes = const("wide.axes", np.asarray([2, 3], np.int64))
    return [
        helper.make_node("Div", [ids, four], [f"{out}.tile"]),
        helper.make_node("Mod", [ids, four], [f"{out}.byte"]),
        helper.make_node("Concat", [lead, const("wide.k1", np.asarray([k, 1], np.int64))], [f"{out}.shape"], axis=0),
        helper.make_node("Unsqueeze", [f"{out}.tile", axes], [f"{out}.tile1"]),
        helper.make_node("Unsqueeze", [f"{out}.byte", axes], [f"{out}.byte1"]),
        helper.make_node("Expand", [f"{out}.tile1", f"{out}.shape"], [f"{out}.tiles"]),  # [B, T, K, 1]
        helper.make_node("Expand", [f"{out}.byte1", f"{out}.shape"], [f"{out}.bytes"]),
        helper.make_node(
            "Expand", [const("wide.at", np.arange(k, dtype=np.int64)[:, None]), f"{out}.shape"], [f"{out}.inputs"]
        ),  # fmt: skip
        helper.make_node("Concat", [f"{out}.tiles", f"{out}.inputs", f"{out}.bytes"], [f"{out}.index"], axis=-1),
        helper.make_node("GatherND", [lanes, f"{out}.index"], [f"{out}.paired"]),  # [B, T, K]: evens, then odds
        helper.make_node(
            "Concat", [lead, const("wide.split", np.asarray([nb, 2, half], np.int64))], [f"{out}.split_shape"], axis=0
        ),  # fmt: skip
        helper.make_node("Reshape", [f"{out}.paired", f"{out}.split_shape"], [f"{out}.halves"]),
        helper.make_node("Transpose", [f"{out}.halves"], [f"{out}.pairs"], perm=[0, 1, 2, 4, 3]),
        helper.make_node("Reshape", [f"{out}.pairs", blocks_shape], [out]),
    ]


def _byte_quad_codes(ids: str, quads: str, run: _Digits, out: str, lead: str, blocks_shape: str,
                     const: Callable[[str, np.ndarray], str]) -> list[onnx.NodeProto]:  # fmt: skip
    """`out` [B, T, nb, 32] uint8: the 8-bit codes of rows `ids` [B, T] of a byte-quads table (row
    n's code of input 32b + 8g + 2i + h is byte 64 (2g + h) + 4 (n % 16) + i of [n / 16, b]), in the
    inputs' own order."""
    k = run.cols
    inputs = np.arange(k)
    within = inputs % NATIVE_INT8_BLOCK
    byte = 64 * (2 * (within // 8) + within % 2) + (within % 8) // 2
    sixteen, four = const("bq.sixteen", np.asarray(16, np.int64)), const("bq.four", np.asarray(4, np.int64))
    axes = const("bq.axes", np.asarray([2, 3], np.int64))
    return [
        helper.make_node("Div", [ids, sixteen], [f"{out}.tile"]),
        helper.make_node("Mod", [ids, sixteen], [f"{out}.output"]),
        helper.make_node("Mul", [f"{out}.output", four], [f"{out}.at"]),
        helper.make_node("Concat", [lead, const("bq.k1", np.asarray([k, 1], np.int64))], [f"{out}.shape"], axis=0),
        helper.make_node("Unsqueeze", [f"{out}.tile", axes], [f"{out}.tile1"]),
        helper.make_node("Unsqueeze", [f"{out}.at", axes], [f"{out}.at1"]),
        helper.make_node("Expand", [f"{out}.tile1", f"{out}.shape"], [f"{out}.tiles"]),  # [B, T, K, 1]
        helper.make_node(
            "Expand",
            [const("bq.block", (inputs // NATIVE_INT8_BLOCK)[:, None].astype(np.int64)), f"{out}.shape"],
            [f"{out}.blocks"],
        ),  # fmt: skip
        helper.make_node("Add", [const("bq.byte", byte[:, None].astype(np.int64)), f"{out}.at1"], [f"{out}.byte1"]),
        helper.make_node("Expand", [f"{out}.byte1", f"{out}.shape"], [f"{out}.bytes"]),
        helper.make_node("Concat", [f"{out}.tiles", f"{out}.blocks", f"{out}.bytes"], [f"{out}.index"], axis=-1),
        helper.make_node("GatherND", [quads, f"{out}.index"], [f"{out}.codes"]),  # [B, T, K]
        helper.make_node("Reshape", [f"{out}.codes", blocks_shape], [out]),
    ]
