"""Weights as integer blocks: `w[n, k] = scale[n, k // block] * codes[n, k] + offset[n, k // block]`.

Every stored format the engines run is first put in this one form: a GGUF's quantised tensors
(decoded from their own bit layouts, never dequantised on the way) and our own weight-only
`int4` / `int8` quantisation of a float weight. `exporters/nbits.py` then turns a BlockWeight into
ONNX Runtime's 4-bit `MatMulNBits` products, so the engine multiplies by the stored codes.

Block layouts (ggml's, per block of `block` weights along the input dimension):
- Q4_0 (32): fp16 d, 16 bytes of nibbles (low nibbles are weights 0-15, high 16-31); w = d*(q-8)
- Q4_1 (32): fp16 d, fp16 m, nibbles as Q4_0; w = d*q + m
- Q8_0 (32): fp16 d, 32 int8 q; w = d*q
- Q4_K (256 = 8 sub-blocks of 32): fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs,
  128 bytes of nibbles (byte run j holds sub-block 2j low, 2j+1 high); w = d*sc*q - dmin*mn
- Q5_K (256): as Q4_K plus 32 bytes qh whose bit i of byte l is bit 4 of sub-block i's weight l
- Q6_K (256 = 16 sub-blocks of 16): 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales,
  fp16 d; w = d*sc*(q-32)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specgraph.errors import InputError

QK = 256  # weights per K-quant super-block


@dataclass
class BlockWeight:
    """A weight [N, K] as integer codes with a scale and an offset per block of `block` inputs."""

    codes: np.ndarray  # uint8 [N, K], each < 2**bits
    scale: np.ndarray  # float32 [N, K // block]
    offset: np.ndarray  # float32 [N, K // block]
    bits: int
    block: int
    format: str  # "Q4_1", "Q8_0", "int4", ...

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: the weight these blocks stand for (float64 arithmetic, rounded once)."""
        n, k = self.shape
        codes = self.codes.reshape(n, k // self.block, self.block).astype(np.float64)
        w = codes * self.scale[..., None].astype(np.float64) + self.offset[..., None].astype(np.float64)
        return w.reshape(n, k).astype(np.float32)

    def rows(self, index: np.ndarray) -> BlockWeight:
        return BlockWeight(self.codes[index], self.scale[index], self.offset[index], self.bits, self.block, self.format)


# --- GGUF block formats ----------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n] float32."""
    return np.ascontiguousarray(raw).view(np.float16).reshape(-1).astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[n, m] uint8 -> [n, 2, m] (low nibbles first, then high)."""
    return np.stack([raw & 0x0F, raw >> 4], axis=1)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18]).reshape(-1, 32)  # [n, 32]
    return q, d[:, None], (-8.0 * d)[:, None]


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:20]).reshape(-1, 32)
    return q, d[:, None], m[:, None]


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, 0:2])
    q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [n, 32] in 0..255
    return q, d[:, None], (-128.0 * d)[:, None]


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> eight 6-bit scales and eight 6-bit mins (Q4_K / Q5_K)."""
    lo, hi, mix = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k_low(b: np.ndarray, start: int) -> np.ndarray:
    """128 bytes of nibbles -> [n, 8, 32] (run j: sub-block 2j from low nibbles, 2j+1 from high)."""
    return _nibbles(b[:, start : start + 128].reshape(-1, 32)).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    q = _q4_k_low(b, 16)
    return q.reshape(-1, 32), (d[:, None] * sc).reshape(-1, 1), -(dmin[:, None] * mn).reshape(-1, 1)


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]  # [n, 32]: bit i of byte l belongs to sub-block i, weight l
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    q = _q4_k_low(b, 48) | (high << 4)
    return q.reshape(-1, 32), (d[:, None] * sc).reshape(-1, 1), -(dmin[:, None] * mn).reshape(-1, 1)


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = b.shape[0]
    low = _nibbles(b[:, 0:128].reshape(n * 2, 64)).reshape(n, 2, 128)  # per half: weights 0-63 low, 64-127 high
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    high = (qh & 0x03).reshape(n, 2, 128)  # per half: shift 2s gives weights 32s..32s+31
    q = (low | (high << 4)).reshape(-1, 16)  # 16 sub-blocks of 16
    scale = (_f16(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(-1, 1)
    return q, scale, -32.0 * scale


# name -> (bits, block, weights per stored block, bytes per stored block, decoder)
GGUF_FORMATS = {
    "Q4_0": (4, 32, 32, 18, _q4_0),
    "Q4_1": (4, 32, 32, 20, _q4_1),
    "Q8_0": (8, 32, 32, 34, _q8_0),
    "Q4_K": (4, 32, QK, 144, _q4_k),
    "Q5_K": (5, 32, QK, 176, _q5_k),
    "Q6_K": (6, 16, QK, 210, _q6_k),
}
FLOAT_FORMATS = ("F32", "F16", "BF16")


def from_gguf(format_name: str, raw: np.ndarray, rows: int, cols: int) -> BlockWeight:
    """Decode a GGUF tensor's raw bytes (uint8, [rows, bytes per row]) into blocks."""
    if format_name not in GGUF_FORMATS:
        raise InputError(
            f"GGUF quantisation {format_name} is not supported for --weights source; supported: "
            f"{', '.join([*GGUF_FORMATS, *FLOAT_FORMATS])} (or pass --weights fp32)"
        )
    bits, block, per, nbytes, decode = GGUF_FORMATS[format_name]
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // per, nbytes)
    q, scale, offset = decode(raw)
    return BlockWeight(
        q.reshape(rows, cols).astype(np.uint8),
        scale.reshape(rows, cols // block).astype(np.float32),
        offset.reshape(rows, cols // block).astype(np.float32),
        bits,
        block,
        format_name,
    )


# --- weight-only quantisation of a float weight ----------------------------------------------


def quantize(weight: np.ndarray, bits: int, block: int, half_scales: bool = False) -> BlockWeight:
    """Symmetric round-to-nearest blocks: int4 codes -8..7 (scale = max-magnitude / -8, as Q4_0),
    int8 codes -127..127 (scale = max|w| / 127, as Q8_0); stored unsigned with the offset. With
    `half_scales` each scale is rounded to float16 first and the codes are taken against it (as
    Q4_0 and Q8_0 store theirs), so a native product reads half the scale bytes."""
    n, k = weight.shape
    if k % block:
        raise InputError(f"--block-size {block} does not divide a weight's input dimension {k} (shape {n}x{k})")
    w = weight.astype(np.float32).reshape(n, k // block, block)
    if bits == 4:
        peak = np.take_along_axis(w, np.abs(w).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        scale, zero, top = peak / -8.0, 8, 15
    else:
        scale, zero, top = np.abs(w).max(axis=-1) / 127.0, 128, 255
    if half_scales:
        scale = scale.astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    q = np.clip(np.rint(w * inv[..., None]) + zero, 0, top).astype(np.uint8)
    scale = scale.astype(np.float32)
    return BlockWeight(q.reshape(n, k), scale, -zero * scale, bits, block, f"int{bits}")


# --- finding a graph's weights among a file's stored tensors ----------------------------------


def row_key(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()


class RowIndex:
    """Every row of a set of BlockWeights, found by the exact float32 values it dequantises to.

    A graph weight is matched row by row, so renamed, permuted (HF's rotary q/k reordering of a
    GGUF) and fused (Q/K/V as one matrix) weights all find their stored blocks without a name map.
    """

    def __init__(self, reference: Iterable[tuple[BlockWeight, np.ndarray]]) -> None:
        """`reference`: each BlockWeight with the float32 [N, K] values the model was loaded with."""
        self.weights: list[BlockWeight] = []
        self.where: dict[bytes, tuple[int, int]] = {}
        for bw, values in reference:
            idx = len(self.weights)
            self.weights.append(bw)
            for r in range(values.shape[0]):
                self.where.setdefault(row_key(values[r]), (idx, r))

    def match(self, weight: np.ndarray) -> list[BlockWeight] | None:
        """Blocks for `weight` [N, K], split into runs of rows of one format; None if any row is
        not stored (or no row is)."""
        found = [self.where.get(row_key(weight[r])) for r in range(weight.shape[0])]
        if not found or any(f is None for f in found):
            return None
        runs: list[BlockWeight] = []
        start = 0
        for r in range(1, len(found) + 1):
            if r == len(found) or self._kind(found[r]) != self._kind(found[start]):
                runs.append(self._gather(found[start:r]))
                start = r
        return runs

    def _kind(self, loc: tuple[int, int] | None) -> tuple[int, int]:
        assert loc is not None
        bw = self.weights[loc[0]]
        return (1 if bw.bits <= 4 else 2, bw.block)

    def _gather(self, locs: list[tuple[int, int] | None]) -> BlockWeight:
        pairs = np.asarray(locs, dtype=np.int64)  # [R, 2]: (weight, row)
        cuts = np.flatnonzero(np.diff(pairs[:, 0])) + 1
        parts = [self.weights[int(run[0, 0])].rows(run[:, 1]) for run in np.split(pairs, cuts)]
        return BlockWeight(
            np.concatenate([p.codes for p in parts]),
            np.concatenate([p.scale for p in parts]),
            np.concatenate([p.offset for p in parts]),
            max(p.bits for p in parts),
            parts[0].block,
            "+".join(sorted({p.format for p in parts})),
        )


def gguf_index(path: str) -> RowIndex:
    """The stored blocks of every quantised matrix in a GGUF file, found by the float32 values
    that transformers' loader (gguf's own dequantiser) gives its rows."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specgraph.gguf_table import tensor_table

    def stored() -> Iterator[tuple[BlockWeight, np.ndarray]]:  # one matrix in memory at a time
        for t in tensor_table(Path(path)):
            if len(t.shape) != 2 or t.type_name in FLOAT_FORMATS:
                continue
            cols, rows = t.shape  # GGUF lists the fastest-varying dimension first
            values = dequantize(t.data, GGMLQuantizationType[t.type_name]).reshape(rows, cols)
            yield from_gguf(t.type_name, t.data, rows, cols), values

    return RowIndex(stored())


def gguf_formats(path: str) -> set[str]:
    """Formats of the file's matrices (read from its header; no tensor data is touched)."""
    from specgraph.gguf_table import tensor_table

    return {t.type_name for t in tensor_table(Path(path)) if len(t.shape) == 2}
