"""specgraph's own ONNX Runtime operators (`host/src/kernels/`, `--kernels native`).

`libspecgraph_kernels.so` holds `specgraph.BlockMatMul`: a product with integer weight blocks in
float32 (exporters/nbits.py). `sh scripts/install.sh` builds it with the C++ host where CMake and a
C++ compiler exist. `--kernels auto` (the default) takes it for exact activations wherever it is
built. A bundle compiled with native kernels says so in its manifest, and every session that runs
it loads the library first; ONNX Runtime alone cannot run such a bundle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specgraph.errors import BundleError, InputError

ENV = "SPECGRAPH_KERNELS_LIB"
KERNELS = ("auto", "ort", "native")
_BUILT = Path(__file__).resolve().parent.parent / "host" / "build" / "libspecgraph_kernels.so"


def library_path() -> Path | None:
    """$SPECGRAPH_KERNELS_LIB if set, else the library that scripts/install.sh built; None if absent."""
    path = Path(os.environ[ENV]).expanduser() if os.environ.get(ENV) else _BUILT
    return path if path.is_file() else None


def _missing() -> str:
    where = os.environ.get(ENV) or str(_BUILT)
    return (f"specgraph's kernel library is not at {where}: build it with `sh scripts/install.sh` (it needs "
            f"cmake and a C++ compiler) or set {ENV}")  # fmt: skip


def check_available() -> None:
    """For `--kernels native` at compile time: the library must exist to run what is built."""
    if library_path() is None:
        raise InputError(f"--kernels native: {_missing()}; or compile with --kernels ort")


def resolve(kernels: str) -> str:
    """`auto`: native when the library is built (the products of quantised weights and the fused
    attention layers; float32 products stay ONNX Runtime's), else ort."""
    if kernels != "auto":
        return kernels
    return "native" if library_path() is not None else "ort"


def code_path() -> str | None:
    """Which loops the library runs on this CPU ("avx512-vnni", "avx512", "avx2", "portable"), or
    None without the library. A compile stores int8 products' one-digit codes as quads only where
    they run VNNI's loop (block_matmul.h); a bundle still runs, to the same bits, on any CPU."""
    import ctypes

    path = library_path()
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    library.specgraph_kernels_path.restype = ctypes.c_char_p
    return str(library.specgraph_kernels_path().decode())


def exact_digits() -> bool:
    """Whether this CPU runs exact one-digit products as four int8 digits on AMX (block_matmul.h,
    digits): a compile then stores them so (quads, `activation_bits=24`). False without the library.
    $SPECGRAPH_KERNELS_NO_AMX set and not empty: False (the lanes layout); $SPECGRAPH_KERNELS_DIGITS:
    True wherever the library is (its VNNI or portable loops run them, to the same bits; tests)."""
    import ctypes

    path = library_path()
    if path is None or os.environ.get("SPECGRAPH_KERNELS_NO_AMX"):
        return False
    if os.environ.get("SPECGRAPH_KERNELS_DIGITS"):
        return True
    return bool(ctypes.CDLL(str(path)).specgraph_kernels_exact_digits())


def uses_native(manifest: dict[str, Any]) -> bool:
    weights = manifest.get("weights")
    return isinstance(weights, dict) and weights.get("kernels") == "native"


def register(options: Any, bundle: Path) -> None:
    """Load the library into ONNX Runtime session options (a native-kernel bundle needs it)."""
    path = library_path()
    if path is None:
        raise BundleError(f"{bundle}: this bundle runs specgraph's native kernels; {_missing()}")
    try:
        options.register_custom_ops_library(str(path))
    except Exception as exc:  # ORT's Fail: not a library, or not one for this ONNX Runtime
        raise BundleError(f"{bundle}: cannot load specgraph's kernel library {path}: {exc}") from exc
