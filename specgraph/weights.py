"""Which weights an engine multiplies by: `--weights source|fp32|int8|int4`, `--activations fp32|int8`.

- `source` (default): a GGUF's quantised matrices run as stored (`specgraph/blocks.py` decodes
  them, `exporters/nbits.py` runs them); its F32 tensors stay float32. F16/BF16 matrices and
  every other source (an HF folder, a torch.export file) run in float32, which is what the loader
  gives them. The reference for "lossless" is the same weights: HF loads a GGUF by dequantising
  it, so with `--activations fp32` the engine and HF compute the same function to float rounding.
- `fp32`: everything float32 (a GGUF is dequantised, as before this option existed).
- `int8` / `int4`: weight-only symmetric round-to-nearest blocks of `--block-size` inputs, made
  here from a float source. A GGUF is already quantised: requantising it is refused (it would
  quantise twice and change the model for no gain), use `source`.
- `--kernels native`: the block products run as specgraph's own operator (`specgraph/kernels.py`)
  instead of MatMulNBits plus an offset term; the same float32 sum at `--activations fp32`.
- `--activations int8`: each row of activations is quantised to int8 per block of 32 before
  integer dot products: Q8_0's rule in the native kernel (a product of other blocks, Q6_K's 16,
  stays float32 there; the manifest's `native_int8` counts those that quantise), MatMulNBits'
  accuracy level 4 with `--kernels ort`. A different, faster model: its speculative engines still
  equal its own `none` engine token for token.
bf16 is not offered: ONNX Runtime's CPU provider has no bf16 matrix kernels, so a bf16 weight
would be widened to a float32 copy at load, the opposite of the point.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from specgraph.errors import InputError
from specgraph.kernels import KERNELS, check_available, code_path, exact_digits

WEIGHTS = ("source", "fp32", "int8", "int4")
ACTIVATIONS = ("fp32", "int8")
BLOCK_SIZES = (16, 32, 64, 128, 256)
_ACCURACY = {"fp32": 1, "int8": 4}  # MatMulNBits accuracy_level


def streamed_bytes(stored: int, section: dict[str, Any]) -> int:
    """Of `stored` weight bytes, those one call streams, given the manifest's `weights` section: a
    speculative engine keeps its one-digit codes twice (pairs for verify calls, lanes for one-token
    calls, `native_one_row_bytes`), and an int8 table that a Gather reads keeps its pairs beside its
    quads (`native_quads_gather_bytes`): a call reads one of the two."""
    return int(stored) - int(section.get("native_one_row_bytes", 0)) - int(section.get("native_quads_gather_bytes", 0))


def check_weights(weights: str, activations: str, block_size: int, kernels: str = "auto") -> None:
    if weights not in WEIGHTS:
        raise InputError(f"unknown --weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
    if activations not in ACTIVATIONS:
        raise InputError(f"unknown --activations {activations!r}; choose one of: {', '.join(ACTIVATIONS)}")
    if block_size not in BLOCK_SIZES:
        raise InputError(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size}")
    if activations == "int8" and weights == "fp32":
        raise InputError("--activations int8 needs quantised weights: --weights source (a GGUF), int8 or int4")
    if kernels not in KERNELS:
        raise InputError(f"unknown --kernels {kernels!r}; choose one of: {', '.join(KERNELS)}")
    if kernels == "native":
        check_available()


def gguf_file(model: str | Path) -> Path | None:
    """The GGUF a model name stands for (the default alias is one), else None."""
    from specgraph.default_model import DEFAULT_MODEL, gguf_path

    if isinstance(model, str) and model == DEFAULT_MODEL:
        return gguf_path()
    path = Path(model).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def check_source_weights(model: str | Path, weights: str) -> None:
    """Refuse, before anything is loaded, what cannot be built from this model's weights."""
    from specgraph.blocks import FLOAT_FORMATS, GGUF_FORMATS, gguf_formats

    gguf = gguf_file(model)
    if gguf is None:
        return
    try:
        formats = gguf_formats(str(gguf))
    except Exception:  # a file the reader cannot parse: the loader names the problem next
        return
    quantised = sorted(formats - set(FLOAT_FORMATS))
    if weights == "source":
        bad = [f for f in quantised if f not in GGUF_FORMATS]
        if bad:
            raise InputError(
                f"{gguf.name} stores matrices as {', '.join(bad)}, which --weights source cannot run; supported: "
                f"{', '.join([*GGUF_FORMATS, *FLOAT_FORMATS])} (or pass --weights fp32)"
            )
    elif weights in ("int8", "int4") and quantised:
        raise InputError(
            f"{gguf.name} is already quantised ({', '.join(quantised)}); --weights {weights} would quantise it "
            "twice: use --weights source to run its stored blocks, or fp32"
        )


def store_weights(
    onnx_path: Path,
    model: str | Path,
    weights: str,
    activations: str,
    block_size: int,
    progress: Callable[[str], None] | None = None,
    skip: str | tuple[str, ...] | None = None,
    kernels: str = "ort",
    one_token: bool = False,
) -> dict[str, Any]:
    """Rewrite the exported engine's matrices for `weights`; return the manifest's `weights` section.
    Initializers whose names start with `skip` (a prefix or a tuple of them: the drafters' own
    weights) are left as they are. With native kernels the fused attention layers run specgraph's
    own `CachedAttention` too, the products take in the norms, SwiGLUs and residual adds around
    them (`exporters/native_fusion.py`), and
    `one_token` (an engine whose decode calls take one token: `none`) stores one-digit codes in the
    kernel's lanes layout, faster for one row and slower for several (docs/benchmarks.md), and every
    other engine keeps them in pairs for its verify calls and stores them in lanes too for its
    one-token calls (the same arithmetic to the bit, twice the one-digit bytes on disk and in
    memory, each call reading one copy); two-digit codes take wide lanes in every native engine
    (faster at 1 and 4 rows alike). Where the CPU has AMX (`kernels.exact_digits()`), every product
    of 32-weight blocks at float32 activations instead takes quads (byte quads for two digits) at
    `activation_bits=24`, its input in four int8 digits, one layout for every call width."""
    from specgraph import blocks
    from specgraph.exporters.attention import run_attention_natively
    from specgraph.exporters.native_fusion import fuse_into_block_matmuls
    from specgraph.exporters.nbits import run_weights_as_blocks

    say = progress or (lambda _msg: None)
    section: dict[str, Any] = {"weights": weights, "activations": activations}
    lookup: Callable[..., Any] | None = None
    gguf = gguf_file(model)
    if weights == "source" and gguf is not None:
        say("index stored blocks")
        index = blocks.gguf_index(str(gguf))
        lookup = lambda _name, w: index.match(w)  # noqa: E731
    elif weights in ("int8", "int4"):
        bits = 8 if weights == "int8" else 4
        section["block_size"] = block_size
        lookup = lambda _name, w: [blocks.quantize(w, bits, block_size)]  # noqa: E731
    if lookup is not None and skip:
        inner = lookup
        lookup = lambda name, w: None if name.startswith(skip) else inner(name, w)  # noqa: E731
    if lookup is None:
        if activations != "fp32":
            raise InputError(f"--activations {activations} needs quantised weights; {model} has none stored")
        section["stored"] = "float32"
        attention = run_attention_natively(onnx_path) if kernels == "native" else 0
        if attention:  # float32 products stay ONNX Runtime's; the fused attention layers run natively
            section.update(kernels="native", native_attention=attention)
        return section
    say("store weights as blocks")
    native = kernels == "native"
    quads = native and activations == "int8" and code_path() == "avx512-vnni"
    digits = native and activations == "fp32" and exact_digits()
    report = run_weights_as_blocks(onnx_path, lookup, _ACCURACY[activations], native=native, lanes=native and one_token,
                                   wide=native, one_row=native and not one_token, quads=quads, digits=digits)  # fmt: skip
    if native and activations == "int8":
        section["native_int8"] = report.native_int8  # the others (blocks other than 32) multiply in float32
        section["quads"] = report.quads
        section["native_quads_gather_bytes"] = report.quads_gather_bytes
    if digits:
        section["native_digits"] = report.digits  # exact one-digit products on AMX's integer tiles
        section["native_quads_gather_bytes"] = report.quads_gather_bytes
    attention = run_attention_natively(onnx_path) if kernels == "native" else 0  # the library is loaded anyway
    fused = fuse_into_block_matmuls(onnx_path) if kernels == "native" else {}
    section.update(
        stored="blocks",
        matmuls=report.matmuls,
        gathers=report.gathers,
        formats=report.formats,
        float32_bytes=report.float_bytes,
        block_bytes=report.stored_bytes,
        exact=activations == "fp32",
        kernels=kernels,
        native_matmuls=report.native,
        native_lanes=report.lanes,
        native_one_row_lanes=report.one_row,
        native_one_row_bytes=report.one_row_bytes,
        native_attention=attention,
    )
    if fused:
        section["native_fused"] = fused  # norms, SwiGLUs and residual adds the products compute
    return section


def check_blocks_fit(loaded: Any, weights: str, block_size: int, flag: str = "--block-size") -> None:
    """int8 / int4: every matrix's input dimension must be a whole number of blocks (checked on the
    loaded model, before the export; `flag` is the option the error names)."""
    if weights not in ("int8", "int4"):
        return
    if loaded.hf_model is not None:
        tensors = dict(loaded.hf_model.named_parameters())
    else:
        tensors = dict(loaded.program.state_dict)
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and tensor.shape[1] % block_size:
            raise InputError(
                f"{flag} {block_size} does not divide the input dimension {tensor.shape[1]} of {name} "
                f"(shape {tuple(tensor.shape)}); choose a block size that divides it"
            )
