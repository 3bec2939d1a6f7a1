"""A GGUF file's tensor table, read fast: the header's metadata is skipped, not parsed.

`gguf.GGUFReader` builds a numpy view for every part of every metadata field, and a tokenizer's
vocabulary and merges are about 100,000 strings: 2.9 s for SmolLM2's GGUF, twice per compile.
A compile needs only the tensors (their formats, and for `--weights source` their blocks), so
this reads each field's length and steps over it, then the tensor table, and maps each tensor's
bytes as the reader does (a quantised tensor as uint8 [rows, bytes a row], a float one as its
dtype [rows, cols]). Every length is checked against the file, so a truncated or corrupt file
raises ModelLoadError in one line, as the reader's wrapper does (`default_model.gguf_reader`).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specgraph.errors import ModelLoadError

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_FLOATS = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str  # gguf's GGMLQuantizationType name: Q4_1, F32, ...
    shape: tuple[int, ...]  # as the file lists it: the fastest-varying dimension first
    data: np.ndarray  # read-only map of its bytes (uint8 [rows, row bytes] when quantised)


def tensor_table(path: Path) -> list[Tensor]:
    """The tensors of the GGUF at `path`, parsed once per file version."""
    stat = path.stat()
    return _cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached(path: str, size: int, _mtime_ns: int) -> list[Tensor]:
    try:
        return _read(path, size)
    except (ValueError, struct.error, KeyError, OverflowError, RecursionError) as exc:
        raise ModelLoadError(f"{Path(path).name} is truncated or corrupt: {exc}") from exc


def _read(path: str, size: int) -> list[Tensor]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)  # type: ignore[arg-type]
    at = 0

    def take(fmt: str) -> int:
        nonlocal at
        (value,) = struct.unpack_from(fmt, buf, at)
        at += struct.calcsize(fmt)
        return int(value)

    def skip(count: int) -> None:
        nonlocal at
        if count < 0 or at + count > size:
            raise ValueError(f"a field runs past the end of the file (byte {at} + {count} of {size})")
        at += count

    def text() -> str:
        nonlocal at
        length = take("<Q")
        skip(length)
        return bytes(buf[at - length : at]).decode("utf-8")

    def value(kind: int) -> int | None:
        """Step over a value of `kind`; return it when it is an unsigned 32-bit integer."""
        if kind in _SCALARS:
            if kind == _UINT32:
                return take("<I")
            skip(_SCALARS[kind])
        elif kind == _STRING:
            skip(take("<Q"))
        elif kind == _ARRAY:
            inner, count = take("<I"), take("<Q")
            if inner in _SCALARS:
                skip(_SCALARS[inner] * count)
            else:
                for _ in range(count):
                    value(inner)
        else:
            raise ValueError(f"unknown metadata value type {kind}")
        return None

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    at = 4
    version, tensors, fields = take("<I"), take("<Q"), take("<Q")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    alignment = 32
    for _ in range(fields):
        key, kind = text(), take("<I")
        found = value(kind)
        if key == "general.alignment" and found is not None:
            alignment = found
    infos = []
    for _ in range(tensors):
        name = text()
        dims = tuple(take("<Q") for _ in range(take("<I")))
        infos.append((name, GGMLQuantizationType(take("<I")), dims, take("<Q")))
    start = -(-at // alignment) * alignment
    table = []
    for name, kind, dims, offset in infos:
        block, nbytes = GGML_QUANT_SIZES[kind]
        count = int(np.prod(dims, dtype=np.int64))
        rows = count // dims[0] if dims else 1
        length = count // block * nbytes
        first = start + offset
        if count % block or first + length > size:
            raise ValueError(f"tensor {name} lies outside the file or is not whole blocks")
        data = raw[first : first + length]
        if kind.name in _FLOATS:
            data = data.view(_FLOATS[kind.name]).reshape(*reversed(dims))
        else:
            data = data.reshape(rows, length // rows)
        table.append(Tensor(name, kind.name, dims, data))
    return table
