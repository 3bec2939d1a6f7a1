"""The compiler driver: load -> capture -> anatomy -> passes -> step engine -> export.

`passes_for` gives the graph passes in the order they run: the shared ones here, the method's
own (from `specgraph.methods`) in the middle. The driver never tests a method's name.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specgraph import methods, sampling
from specgraph.anatomy import Anatomy, analyze
from specgraph.capture import capture
from specgraph.errors import InputError
from specgraph.exporters.manifest import describe_values, write_manifest
from specgraph.exporters.nbits import NATIVE_DOMAIN
from specgraph.exporters.onnx import export_onnx
from specgraph.kernels import resolve as resolve_kernels
from specgraph.loaders import LoadedModel, load_model, save_tokenizer, source_path
from specgraph.methods import Built, Finished, Method, Options
from specgraph.outputs import BUNDLE, check_output, replace_dir, staging_dir
from specgraph.passes import (
    PassContext,
    PassResult,
    add_kv_cache_io,
    fuse_projections,
    fuse_rms_norm,
    insert_tree_attention,
)
from specgraph.weights import check_blocks_fit, check_source_weights, check_weights, store_weights

logger = logging.getLogger("specgraph.compiler")
Pass = Callable[[torch.fx.GraphModule, PassContext], PassResult]


def passes_for(method: Method, options: Options) -> list[Pass]:
    """Every method's pipeline: the shared rewrites around the method's own passes."""
    # insert_tree_attention first: add_kv_cache_io reads the attn_mask input it creates and widens
    # the attended keys from this call's T tokens to the S cache slots. The method's passes come
    # next (they may rewrite the cache writes, or read the LM head's input). The fusions come last:
    # they only merge linears and norms and leave the nodes the others use alone.
    return [insert_tree_attention, add_kv_cache_io, *method.passes(options), fuse_projections, fuse_rms_norm]


@dataclass(frozen=True)
class CompileConfig:
    """Everything `specgraph compile` decides; flows unchanged through the compiler. The method's
    own settings are `options` (its `Options` dataclass); `CompileConfig.of` builds both from
    flat keyword arguments, as the Python API and the CLI give them."""

    model: str
    output: Path
    method: str = "none"
    max_context: int = 1024
    emit_logits: bool = False  # also output logits [B, T, V] (tests compare them with eager)
    sampling: bool = True  # temperature/top-k/top-p inputs with lossless speculative sampling
    weights: str = "source"  # source | fp32 | int8 | int4 (see specgraph/weights.py)
    activations: str = "fp32"  # fp32 (exact against the weights) | int8 (MatMulNBits accuracy level 4)
    block_size: int = 32  # int8 / int4: weights per quantisation block
    kernels: str = "auto"  # auto | ort (MatMulNBits: any ONNX Runtime) | native (specgraph.BlockMatMul, kernels.py)
    attention: str = "fused"  # fused (ONNX Runtime's GroupQueryAttention where it fits) | portable (standard ONNX only)
    force: bool = False  # replace an existing output specgraph did not make (see specgraph/outputs.py)
    options: Options | None = None  # the method's settings; None = its defaults

    @classmethod
    def of(cls, model: str | Path, output: str | Path, method: str = "none", **kwargs: Any) -> CompileConfig:
        """A config from flat keywords: the shared fields, and the method's options by name."""
        shared = {f.name for f in dataclasses.fields(cls)} - {"model", "output", "method", "options"}
        own = {k: v for k, v in kwargs.items() if k not in shared}
        common = {k: v for k, v in kwargs.items() if k in shared}
        options = methods.get(method).options(own)
        return cls(model=str(model), output=Path(output), method=method, options=options, **common)

    @property
    def spec(self) -> Method:
        return methods.get(self.method)

    @property
    def opts(self) -> Any:
        """The method's options (its defaults when none were given)."""
        return self.options if self.options is not None else self.spec.options_type()

    @property
    def engine_samples(self) -> bool:
        """Whether the engine takes sampling inputs (a method's lossy rule is greedy-only)."""
        return self.sampling and self.opts.samples

    def check(self) -> None:
        method = self.spec
        if not isinstance(self.opts, method.options_type):
            raise InputError(f"--method {self.method} takes {method.options_type.__name__}, "
                             f"got {type(self.opts).__name__}")  # fmt: skip
        if self.attention not in ("fused", "portable"):
            raise InputError(f"--attention must be fused or portable, got {self.attention!r}")
        if not 16 <= self.max_context <= 131072:
            raise InputError(f"--max-context must be between 16 and 131072, got {self.max_context}")
        self.opts.check()
        check_weights(self.weights, self.activations, self.block_size, self.kernels)

    @property
    def inputs(self) -> list[str | Path | None]:
        """The files and folders this compile reads, which its output must never touch."""
        from specgraph.default_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME, cache_root

        model = cache_root() / DEFAULT_MODEL_NAME if self.model == DEFAULT_MODEL else self.model
        return [model, *self.opts.files()]


@dataclass
class CompileReport:
    """What `specgraph compile` prints: where the bundle is, what changed, how long it took."""

    bundle: Path
    method: str
    anatomy: dict[str, Any]
    pass_counts: dict[str, dict[str, int]]
    seconds: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] | None = None  # the method's own report (e.g. Medusa's tree)
    weights: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bundle"] = str(self.bundle)
        return d


def build_step_engine(
    loaded: LoadedModel, cfg: CompileConfig, progress: Callable[[str], None] | None = None
) -> tuple[Built, Anatomy, dict[str, dict[str, int]], list[tuple[int, ...]]]:
    """Run capture, anatomy and the method's passes; return the step engine to export."""
    say = progress or (lambda _msg: None)
    say("capture")
    gm = capture(loaded, cfg.max_context)
    say("anatomy")
    anatomy = analyze(gm, loaded.hf_config)
    _check_position_table(gm, anatomy, cfg)
    method = cfg.spec
    drafter = method.prepare(loaded, anatomy, cfg)
    ctx = PassContext(anatomy, cfg.max_context, drafter)
    counts: dict[str, dict[str, int]] = {}
    for pass_fn in passes_for(method, cfg.opts):
        say(pass_fn.__name__)
        counts[pass_fn.__name__] = pass_fn(gm, ctx).counts
    windows = {s.sliding_window for s in anatomy.sites if s.sliding_window}
    window = windows.pop() if windows else None
    return method.build(gm, anatomy, cfg, drafter, window), anatomy, counts, _kv_shapes(anatomy, cfg)


def _kv_shapes(anatomy: Anatomy, cfg: CompileConfig) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    for s in anatomy.sites:
        shapes += [(s.num_kv_heads, s.head_dim, cfg.max_context), (s.num_kv_heads, cfg.max_context, s.head_dim)]
    return shapes


def compile_model(cfg: CompileConfig, progress: Callable[[str], None] | None = None) -> CompileReport:
    """Compile `cfg.model` into a bundle at `cfg.output`. The output is checked before anything
    else and replaced atomically, and only as `specgraph.outputs` allows (OutputError if not)."""
    cfg.check()
    out = check_output(cfg.output, BUNDLE, cfg.inputs, cfg.force)
    say = progress or (lambda _msg: None)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    check_source_weights(cfg.model, cfg.weights)
    say("load")
    loaded = load_model(cfg.model)
    check_blocks_fit(loaded, cfg.weights, cfg.block_size)
    _check_position_limit(loaded, cfg)
    times["load"] = time.perf_counter() - t0
    staging = staging_dir(out)
    try:
        for builds in range(1, 4):
            stage = _stage(loaded, cfg, staging, say, times)
            if stage.finished.rebuild is None:
                break
            if builds == 3:
                raise RuntimeError(f"--method {cfg.method} asked for a fourth build: a method's finish must settle")
            # the method measured this engine and asks for another (e.g. --num-draft auto's K)
            cfg = dataclasses.replace(cfg, options=stage.finished.rebuild)
            shutil.rmtree(staging)
            staging = staging_dir(out)
            say("rebuild")
        finished, weights, fused = stage.finished, stage.weights, stage.fused
        t0 = time.perf_counter()
        if cfg.activations == "int8" and cfg.spec.speculative:
            say("check rows")
            weights["rows_agree"] = _check_rows_agree(stage.measure(finished), cfg.method)
            # the plain engine whose text this one reproduces: at int8 the two attention forms round differently
            weights["rows_agree"]["same_text_as"] = "none" if fused else "none --attention portable"
        stage.write(finished)
        if time.perf_counter() - t0 > 0.5:
            times["method"] = times.get("method", 0.0) + time.perf_counter() - t0
        replace_dir(staging, out, cfg.inputs, cfg.force)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    seconds = {k: round(v, 2) for k, v in times.items()}
    return CompileReport(Path(cfg.output), cfg.method, stage.anatomy.summary(), stage.counts, seconds, finished.report,
                         weights)  # fmt: skip


@dataclass
class _Staged:
    """One engine built, exported, stored and finished in the staging folder."""

    anatomy: Anatomy
    counts: dict[str, dict[str, int]]
    weights: dict[str, Any]
    fused: bool
    finished: Finished
    write: Callable[[Finished], dict[str, Any]]  # the manifest for a Finished
    measure: Callable[[Finished], Any]  # the staged bundle loaded, after writing its manifest


def _stage(loaded: LoadedModel, cfg: CompileConfig, staging: Path, say: Callable[[str], None],
           times: dict[str, float]) -> _Staged:  # fmt: skip
    """Build the step engine for `cfg`, export it to `staging`, store its weights and run the
    method's `finish`; `times` accumulates each stage's seconds."""
    t0 = time.perf_counter()
    built, anatomy, counts, kv_shapes = build_step_engine(loaded, cfg, say)
    engine = built.engine
    times["passes"] = times.get("passes", 0.0) + time.perf_counter() - t0
    t0 = time.perf_counter()
    say("export onnx")
    fuse = cfg.attention == "fused"
    heads = [(s.num_heads, s.num_kv_heads, s.scale) for s in anatomy.sites] if fuse else None
    # int8 activations on ONNX Runtime's kernels: a step must round as a verify call does
    # (`fuse_cached_attention`'s pad); the native ones round a row alike in any call
    kernels = resolve_kernels(cfg.kernels)
    pad_steps = fuse and cfg.activations == "int8" and kernels == "ort"
    model_proto = export_onnx(engine, kv_shapes, staging / "model.onnx", heads, pad_steps)
    fused, draft_runs = _fused_runs(model_proto)
    counts["fuse_cached_attention"] = {"fused_layers": fused, "generic_layers": len(anatomy.sites) - fused,
                                       "fused_draft_runs": draft_runs}  # fmt: skip
    times["export"] = times.get("export", 0.0) + time.perf_counter() - t0
    t0 = time.perf_counter()
    weights = store_weights(staging / "model.onnx", cfg.model, cfg.weights, cfg.activations, cfg.block_size, say,
                            skip=built.meta.get("weights_skip"), one_token=not cfg.spec.speculative,
                            kernels=kernels)  # fmt: skip
    times["weights"] = times.get("weights", 0.0) + time.perf_counter() - t0
    if any(node.domain == NATIVE_DOMAIN for node in model_proto.graph.node):  # a method's own native operator
        weights["kernels"] = "native"
    built.meta["kernels"] = weights.get("kernels", "ort")  # native: the bundle loads specgraph's kernel library
    built.meta["weights"] = weights  # the target's, as the manifest gives them (a method's finish may weigh them)
    tokenizer = _copy_tokenizer(loaded, staging)
    inputs, outputs = engine.io_names()
    body: dict[str, Any] = {
        "method": cfg.method,
        "source": {"name": loaded.name, "kind": loaded.kind, "path": source_path(cfg.model)},
        "max_context": cfg.max_context,
        "vocab_size": anatomy.vocab_size,
        "eos_token_ids": loaded.eos_token_ids,
        "tokenizer": tokenizer,
        "sampling": _sampling_section(cfg, engine),
        "weights": weights,
        "anatomy": anatomy.summary(),
        "passes": counts,
    }

    def write(finished: Finished) -> dict[str, Any]:
        body.update({cfg.method: finished.section, "draft_depth": finished.draft_depth,
                     "graph": _graph_section(model_proto, engine, inputs, outputs, finished.constants,
                                             pad_steps)})  # fmt: skip
        return write_manifest(staging, body)

    def measure(finished: Finished) -> Any:
        from specgraph.runtime import Engine

        write(finished)
        return Engine(staging, verify=False)

    t0 = time.perf_counter()
    finished = cfg.spec.finish(staging, cfg, built, measure)
    if time.perf_counter() - t0 > 0.5:
        times["method"] = times.get("method", 0.0) + time.perf_counter() - t0
    return _Staged(anatomy, counts, weights, fuse and fused > 0, finished, write, measure)


def _check_rows_agree(engine: Any, method: str) -> dict[str, Any]:
    """Refuse (InputError) an int8-activation speculative engine (`engine`, the staged bundle
    loaded) whose verify calls do not
    compute, bit for bit, what one-token calls compute on this machine: int8 rounding turns any
    last-bit difference into another model, and speculation would change the text. The check:
    a 4-token call after a 12-token prefill must leave the target's KV cache exactly as four
    1-token calls leave it (every layer's keys and values, so every layer's input), and a second
    run must repeat the first. Returns the manifest's record; it holds for this machine's
    ONNX Runtime kernels, and `specgraph bench` checks the text against `none` wherever it runs."""
    import platform

    import onnxruntime as ort

    ids = np.random.default_rng(0).integers(0, int(engine.manifest["vocab_size"]), (1, 16), dtype=np.int64)

    def caches(chunks: list[int]) -> dict[str, np.ndarray]:
        state, io, at = engine.new_state(1), engine.session.io_binding(), 0
        for n in chunks:
            engine.call(io, engine.first_feeds(ids[:, at : at + n], n, at), state)
            at += n
        # copies: an OrtValue's numpy() shares its memory, which the next state may reuse
        return {k: v.numpy().copy() for k, v in state.items() if k.startswith("past_")}

    together, apart, again = caches([12, 4]), caches([12, 1, 1, 1, 1]), caches([12, 4])
    if any(not (np.array_equal(together[k], apart[k]) and np.array_equal(together[k], again[k])) for k in together):
        raise InputError(f"--method {method} with --activations int8: on this machine ONNX Runtime computes a "
                         "several-token call differently from one-token calls, so speculation would change the text; "
                         "use --activations fp32 or --method none")  # fmt: skip
    return {"checked": True, "tokens": 4, "onnxruntime": ort.__version__, "machine": platform.machine()}


def _graph_section(model_proto: Any, engine: Any, inputs: list[str], outputs: list[str],
                   constants: dict[str, np.ndarray], pad_steps: bool = False) -> dict[str, Any]:  # fmt: skip
    """How a host runs the graph, whatever the method: what it zero-fills at the start, what it
    binds once, which output feeds which input (and which are written in place), what it trims.
    `pad_steps`: a one-token call writes one cache slot past its token (`export_onnx`)."""
    kv = [name for name in inputs if name.startswith("past_")]
    return {
        "file": "model.onnx",
        "weights": "model.onnx.data",
        "opset": 24,
        "inputs": describe_values(model_proto.graph.input),
        "outputs": describe_values(model_proto.graph.output),
        "bindings": _bindings(inputs, outputs),
        # the caches are the same buffers in and out: ONNX Runtime's TensorScatter writes them in place
        "in_place": [name for name in outputs if "present_" in name],
        "state": [*engine.state_inputs, *kv],  # zero-filled for a new generation, then fed by bindings
        "constants": {name: _constant(value) for name, value in constants.items()},
        # bind output[:, :1 + max(count)] only: columns past every row's count are padding
        "trims": dict(engine.trims),
        "extra_slots": max(int(engine.extra_slots), int(pad_steps)),  # cache slots a call writes beyond its tokens
        "fused_attention": sum(_fused_runs(model_proto)),  # attention runs fused into one node (exporters/gqa.py)
    }


def _fused_runs(model_proto: Any) -> tuple[int, int]:
    """(the target's layers whose cached attention is fused, the drafter's fused runs) of an
    exported engine: `exporters/gqa.py` names each `gqa.<key cache>.<run>`; the target's verify is
    run 0 of `past_key_<i>`, and a drafter's runs are its own caches' (`draft_past_key_<i>`, every
    run of an unrolled drafter) or the later runs of the target's (a drafter that reads them)."""
    names = [n.name for n in model_proto.graph.node if n.op_type == "If" and n.name.startswith("gqa.")]
    target = sum(name.startswith("gqa.past_key_") and name.endswith(".0") for name in names)
    return target, len(names) - target


def _constant(value: np.ndarray) -> dict[str, Any]:
    return {"dtype": str(value.dtype), "shape": list(value.shape), "data": value.reshape(-1).tolist()}


def _check_position_limit(loaded: LoadedModel, cfg: CompileConfig) -> None:
    """Refuse a cache longer than the positions the model's config allows (`max_position_embeddings`,
    which transformers also answers for GPT-2's `n_positions`): past it a learned position table
    has no row, and a rotary model was never trained there."""
    limit = loaded.max_positions
    if limit is not None and cfg.max_context > limit:
        raise InputError(
            f"--max-context {cfg.max_context} exceeds the {limit} positions {loaded.name} supports "
            f"(max_position_embeddings in its config); use --max-context {limit} or less"
        )


def _check_position_table(gm: torch.fx.GraphModule, anatomy: Anatomy, cfg: CompileConfig) -> None:
    """Learned positions: the table's rows are the limit, whatever a config says (torch.export
    programs have none)."""
    if anatomy.position_kind != "learned":
        return
    frontier, seen = [anatomy.position_source], set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.target == torch.ops.aten.embedding.default and user.args[1] is node:
                rows = _rows(gm, user.args[0])
                if rows is not None and cfg.max_context > rows:
                    raise InputError(
                        f"--max-context {cfg.max_context} exceeds the model's {rows} learned positions; "
                        f"use --max-context {rows} or less"
                    )
                return
            frontier.append(user)


def _rows(gm: torch.fx.GraphModule, weight: Any) -> int | None:
    """Rows of an embedding table node (its recorded value, else the module attribute)."""
    if not isinstance(weight, torch.fx.Node):
        return None
    val = weight.meta.get("val")
    if val is None and weight.op == "get_attr":
        val = gm
        for part in str(weight.target).split("."):
            val = getattr(val, part, None)
    return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() == 2 else None


def _sampling_section(cfg: CompileConfig, engine: Any) -> dict[str, Any] | None:
    """How a host feeds the sampling inputs (None: a greedy-only engine)."""
    if not cfg.engine_samples:
        return None
    return {
        "inputs": list(sampling.INPUTS),
        "uniforms": "uniforms[b, R*i + r] is draw r of the token at absolute position i of row b, "
        "R = uniforms' width / (max_context + 1); specgraph draws "
        "numpy.random.Generator(PCG64(seed)).random((batch, R * (max_context + 1)), float32)",
        "streams": int(getattr(engine, "uniform_streams", 1)),  # R
        "order": "temperature, then top-k (ties kept), then top-p, as Hugging Face's warpers",
        "lossless": True,
    }


def _bindings(inputs: list[str], outputs: list[str]) -> dict[str, str]:
    """Which output feeds which input on the next call (the host does nothing else)."""
    pairs = {"next_tokens": "tokens"}  # the next round's tokens
    pairs.update({o: o.removesuffix("_out") for o in outputs if o.endswith("_out")})  # cache_len, drafter state
    pairs.update({o: o.replace("present_", "past_", 1) for o in outputs if "present_" in o})  # caches, drafts' too
    return {o: i for o, i in pairs.items() if o in outputs and i in inputs}


def _copy_tokenizer(loaded: LoadedModel, bundle: Path) -> str | None:
    if loaded.tokenizer_dir is None:
        return None
    save_tokenizer(loaded.tokenizer_dir, bundle / "tokenizer")  # data files only, never code
    return "tokenizer"
