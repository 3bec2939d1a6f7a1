"""The compiler driver: load -> capture -> anatomy -> passes -> step engine -> export.

`PIPELINES` lists, per method, the graph passes in the order they run. It is the one place
that says which rewrites a method needs.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specgraph import sampling
from specgraph.anatomy import Anatomy, analyze
from specgraph.capture import capture
from specgraph.errors import InputError
from specgraph.exporters.manifest import describe_values, write_manifest
from specgraph.exporters.onnx import export_onnx
from specgraph.loaders import LoadedModel, load_model, save_tokenizer, source_path
from specgraph.medusa import MedusaHeads, load_heads
from specgraph.outputs import BUNDLE, check_output, replace_dir, staging_dir
from specgraph.passes import (
    PassContext,
    PassResult,
    add_kv_cache_io,
    add_kv_compaction,
    add_medusa_heads,
    fuse_projections,
    fuse_rms_norm,
    insert_tree_attention,
)
from specgraph.step import StepEngine
from specgraph.step_tree import TreeStepEngine
from specgraph.tree import Tree, build_tree, load_tree, named_tree
from specgraph.weights import check_blocks_fit, check_source_weights, check_weights, store_weights

logger = logging.getLogger("specgraph.compiler")
METHODS = ("none", "lookup", "medusa")
TYPICAL = (0.09, 0.3, 0.7)  # Medusa's defaults: posterior threshold, alpha, temperature
SHIPPED_HEADS = {"SmolLM2-135M-Instruct": "smollm2-135m-medusa4.safetensors"}
Pass = Callable[[torch.fx.GraphModule, PassContext], PassResult]

PIPELINES: dict[str, list[Pass]] = {
    # insert_tree_attention first: add_kv_cache_io reads the attn_mask input it creates and
    # widens the attended keys from this call's T tokens to the S cache slots.
    # fuse_projections last: it only merges linears and leaves the nodes the others use alone.
    "none": [insert_tree_attention, add_kv_cache_io, fuse_projections, fuse_rms_norm],
    "lookup": [insert_tree_attention, add_kv_cache_io, fuse_projections, fuse_rms_norm],
    # add_kv_compaction after add_kv_cache_io: it rewrites the cache writes that pass inserts.
    # add_medusa_heads before fuse_projections so the heads' input is still the LM head's input.
    "medusa": [
        insert_tree_attention,
        add_kv_cache_io,
        add_kv_compaction,
        add_medusa_heads,
        fuse_projections,
        fuse_rms_norm,
    ],  # fmt: skip
}


@dataclass(frozen=True)
class CompileConfig:
    """Everything `specgraph compile` decides; flows unchanged through the compiler."""

    model: str
    output: Path
    method: str = "none"
    max_context: int = 1024
    num_draft: int = 7  # lookup: draft tokens per round (verify 1 + K tokens per call)
    max_ngram: int = 3  # lookup: longest n-gram matched in the context
    emit_logits: bool = False  # also output logits [B, T, V] (tests compare them with eager)
    heads: str | None = None  # medusa: trained heads (safetensors); default: the shipped ones
    tree: str = "default"  # medusa: a preset name, a Medusa-format JSON file, or "auto"
    acceptance: str = "greedy"  # medusa: "greedy" (lossless) or "typical" (Medusa's, LOSSY)
    sampling: bool = True  # temperature/top-k/top-p inputs with lossless speculative sampling
    weights: str = "source"  # source | fp32 | int8 | int4 (see specgraph/weights.py)
    activations: str = "fp32"  # fp32 (exact against the weights) | int8 (MatMulNBits accuracy level 4)
    block_size: int = 32  # int8 / int4: weights per quantisation block
    force: bool = False  # replace an existing output specgraph did not make (see specgraph/outputs.py)

    @property
    def engine_samples(self) -> bool:
        """Typical acceptance is its own (lossy) rule, so those engines are greedy-only."""
        return self.sampling and self.acceptance == "greedy"

    def check(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose one of: {', '.join(METHODS)}")
        if not 16 <= self.max_context <= 131072:
            raise InputError(f"--max-context must be between 16 and 131072, got {self.max_context}")
        if self.method == "lookup" and not 1 <= self.num_draft <= 64:
            raise InputError(f"--num-draft must be between 1 and 64, got {self.num_draft}")
        if self.acceptance not in ("greedy", "typical") or (self.acceptance == "typical" and self.method != "medusa"):
            raise InputError(f"--acceptance {self.acceptance!r}: choose greedy, or typical with --method medusa")
        if not 1 <= self.max_ngram <= 8:
            raise InputError(f"--max-ngram must be between 1 and 8, got {self.max_ngram}")
        check_weights(self.weights, self.activations, self.block_size, self.method)

    @property
    def inputs(self) -> list[str | Path | None]:
        """The files and folders this compile reads, which its output must never touch."""
        from specgraph.default_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME, cache_root

        model = cache_root() / DEFAULT_MODEL_NAME if self.model == DEFAULT_MODEL else self.model
        tree = self.tree if self.method == "medusa" and self.tree != "auto" else None
        return [model, self.heads, tree]


@dataclass
class CompileReport:
    """What `specgraph compile` prints: where the bundle is, what changed, how long it took."""

    bundle: Path
    method: str
    anatomy: dict[str, Any]
    pass_counts: dict[str, dict[str, int]]
    seconds: dict[str, float] = field(default_factory=dict)
    medusa: dict[str, Any] | None = None
    weights: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bundle"] = str(self.bundle)
        return d


def build_step_engine(
    loaded: LoadedModel, cfg: CompileConfig, progress: Callable[[str], None] | None = None
) -> tuple[StepEngine | TreeStepEngine, Anatomy, dict[str, dict[str, int]], list[tuple[int, ...]]]:
    """Run capture, anatomy and the method's passes; return the step engine to export."""
    say = progress or (lambda _msg: None)
    say("capture")
    gm = capture(loaded, cfg.max_context)
    say("anatomy")
    anatomy = analyze(gm, loaded.hf_config)
    _check_position_table(gm, anatomy, cfg)
    heads, meta = _medusa_heads(loaded, cfg, anatomy) if cfg.method == "medusa" else (None, {})
    if cfg.tree == "auto" and cfg.method == "medusa" and "acceptance" not in meta:
        raise InputError("--tree auto needs heads trained by `specgraph train` (they carry measured acceptance)")
    ctx = PassContext(anatomy, cfg.max_context, heads)
    counts: dict[str, dict[str, int]] = {}
    for pass_fn in PIPELINES[cfg.method]:
        say(pass_fn.__name__)
        counts[pass_fn.__name__] = pass_fn(gm, ctx).counts
    windows = {s.sliding_window for s in anatomy.sites if s.sliding_window}
    window = windows.pop() if windows else None
    engine: StepEngine | TreeStepEngine
    if cfg.method == "medusa":
        assert heads is not None
        weight = anatomy.lm_head.args[1]
        assert isinstance(weight, torch.fx.Node)
        typical = TYPICAL if cfg.acceptance == "typical" else None
        engine = TreeStepEngine(gm, anatomy.num_layers, cfg.max_context, heads.num_heads, str(weight.target),
                                window, cfg.emit_logits, typical, cfg.engine_samples)  # fmt: skip
        engine.heads_meta = meta  # read once here; the tree writer uses it too
        return engine, anatomy, counts, _kv_shapes(anatomy, cfg)
    engine = StepEngine(
        gm,
        anatomy.num_layers,
        cfg.max_context,
        cfg.method,
        cfg.num_draft,
        cfg.max_ngram,
        sliding_window=window,
        emit_logits=cfg.emit_logits,
        sampling=cfg.engine_samples,
    )
    return engine, anatomy, counts, _kv_shapes(anatomy, cfg)


def _kv_shapes(anatomy: Anatomy, cfg: CompileConfig) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    for s in anatomy.sites:
        shapes += [(s.num_kv_heads, s.head_dim, cfg.max_context), (s.num_kv_heads, cfg.max_context, s.head_dim)]
    return shapes


def _medusa_heads(loaded: LoadedModel, cfg: CompileConfig, anatomy: Anatomy) -> tuple[MedusaHeads, dict[str, Any]]:
    path = cfg.heads
    if path is None:
        shipped = SHIPPED_HEADS.get(loaded.name)
        if shipped is None:
            raise InputError(f"--method medusa needs --heads for {loaded.name}: train them with `specgraph train`")
        path = str(Path(__file__).parent / "data" / "heads" / shipped)
    return load_heads(path, anatomy.hidden_size, anatomy.vocab_size)


def compile_model(cfg: CompileConfig, progress: Callable[[str], None] | None = None) -> CompileReport:
    """Compile `cfg.model` into a bundle at `cfg.output`. The output is checked before anything
    else and replaced atomically, and only as `specgraph.outputs` allows (OutputError if not)."""
    cfg.check()
    out = check_output(cfg.output, BUNDLE, cfg.inputs, cfg.force)
    if cfg.method == "medusa" and cfg.tree != "auto":
        _named_or_file(cfg.tree)  # a bad tree file fails now, not after the export
    say = progress or (lambda _msg: None)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    check_source_weights(cfg.model, cfg.weights)
    say("load")
    loaded = load_model(cfg.model)
    check_blocks_fit(loaded, cfg.weights, cfg.block_size)
    _check_position_limit(loaded, cfg)
    times["load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine, anatomy, counts, kv_shapes = build_step_engine(loaded, cfg, say)
    times["passes"] = time.perf_counter() - t0
    staging = staging_dir(out)
    try:
        t0 = time.perf_counter()
        say("export onnx")
        model_proto = export_onnx(engine, kv_shapes, staging / "model.onnx")
        times["export"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        weights = store_weights(staging / "model.onnx", cfg.model, cfg.weights, cfg.activations, cfg.block_size, say)
        times["weights"] = time.perf_counter() - t0
        tokenizer = _copy_tokenizer(loaded, staging)
        inputs, outputs = engine.io_names()
        body: dict[str, Any] = {
            "method": cfg.method,
            "source": {"name": loaded.name, "kind": loaded.kind, "path": source_path(cfg.model)},
            "max_context": cfg.max_context,
            "vocab_size": anatomy.vocab_size,
            "eos_token_ids": loaded.eos_token_ids,
            "tokenizer": tokenizer,
            "lookup": {"num_draft": cfg.num_draft, "max_ngram": cfg.max_ngram} if cfg.method == "lookup" else None,
            "sampling": _sampling_section(cfg),
            "weights": weights,
            "anatomy": anatomy.summary(),
            "passes": counts,
            "graph": {
                "file": "model.onnx",
                "weights": "model.onnx.data",
                "opset": 24,
                "inputs": describe_values(model_proto.graph.input),
                "outputs": describe_values(model_proto.graph.output),
                "bindings": _bindings(inputs, outputs),
                # bind output[:, :1 + max(count)] only: columns past every row's count are padding
                "trims": {"next_tokens": "n_draft"} if "n_draft" in outputs else {},
            },
        }
        if cfg.method == "medusa":
            body["medusa"] = _write_tree(staging, cfg, engine)
        write_manifest(staging, body)
        if cfg.method == "medusa" and cfg.tree == "auto":
            say("measure tree")
            body["medusa"] = _auto_tree(staging, cfg, engine)
            write_manifest(staging, body)
        replace_dir(staging, out, cfg.inputs, cfg.force)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    seconds = {k: round(v, 2) for k, v in times.items()}
    return CompileReport(Path(cfg.output), cfg.method, anatomy.summary(), counts, seconds, body.get("medusa"), weights)


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


def _write_tree(bundle: Path, cfg: CompileConfig, engine: StepEngine | TreeStepEngine, tree: Tree | None = None,
                report: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Write tree.json (Medusa's list-of-paths format) and return the manifest's medusa section."""
    assert isinstance(engine, TreeStepEngine)
    meta = engine.heads_meta
    if tree is None:
        # auto: a one-node placeholder until the engine is measured (it fits any number of heads)
        tree = Tree.from_paths([(0,)]) if cfg.tree == "auto" else _named_or_file(cfg.tree)
    tree.validate_for(engine.num_heads, cfg.max_context)
    keep = engine.candidates_per_head
    if tree.max_topk > keep:
        raise InputError(f"tree uses rank {tree.max_topk - 1}, but the engine keeps the top {keep} tokens per head")
    (bundle / "tree.json").write_text(json.dumps({"paths": [list(p) for p in tree.paths]}) + "\n")
    section: dict[str, Any] = {"num_heads": engine.num_heads, "tree": "tree.json", "tree_size": tree.size,
                               "tree_depth": tree.depth, "tree_source": cfg.tree, "accept_rule": cfg.acceptance,
                               "lossless": cfg.acceptance == "greedy"}  # fmt: skip
    section["heads"] = {k: meta[k] for k in ("model", "top1", "top5", "acceptance", "command") if k in meta}
    if report is not None:
        section["auto_tree"] = report
    return section


def _named_or_file(name: str) -> Tree:
    return load_tree(name) if Path(name).suffix == ".json" or Path(name).is_file() else named_tree(name)


def _auto_tree(bundle: Path, cfg: CompileConfig, step: StepEngine | TreeStepEngine) -> dict[str, Any]:
    """Pick the tree that maximises expected tokens per second: the heads' measured acceptance
    (from their calibration text) against this engine's measured verify cost c(N)/c(1)."""
    from specgraph.runtime import Engine

    assert isinstance(step, TreeStepEngine)
    engine = Engine(bundle, verify=False)
    sizes = [n for n in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) if 128 + n <= cfg.max_context]
    ms = {n: engine.time_call(n, 128, repeats=5) for n in sizes}
    cost = {n: ms[n] / ms[1] for n in sizes}
    tree, report = build_tree(np.asarray(step.heads_meta["acceptance"]), cost, max_nodes=max(sizes))
    report = {k: v for k, v in report.items() if k != "table"} | {"verify_cost": cost}
    return _write_tree(bundle, cfg, step, tree, report)


def _sampling_section(cfg: CompileConfig) -> dict[str, Any] | None:
    """How a host feeds the sampling inputs (None: a greedy-only engine)."""
    if not cfg.engine_samples:
        return None
    return {
        "inputs": list(sampling.INPUTS),
        "uniforms": "uniforms[b, i] draws the token at absolute position i of row b; "
        "specgraph draws numpy.random.Generator(PCG64(seed)).random((batch, max_context + 1), float32)",
        "order": "temperature, then top-k (ties kept), then top-p, as Hugging Face's warpers",
        "lossless": True,
    }


def _bindings(inputs: list[str], outputs: list[str]) -> dict[str, str]:
    """Which output feeds which input on the next call (the host does nothing else)."""
    pairs = {"next_tokens": "tokens", "cache_len_out": "cache_len", "history_out": "history",
             "path_src_out": "path_src", "n_path_out": "n_path"}  # fmt: skip
    pairs.update({o: o.replace("present_", "past_", 1) for o in outputs if o.startswith("present_")})
    return {o: i for o, i in pairs.items() if o in outputs and i in inputs}


def _copy_tokenizer(loaded: LoadedModel, bundle: Path) -> str | None:
    if loaded.tokenizer_dir is None:
        return None
    save_tokenizer(loaded.tokenizer_dir, bundle / "tokenizer")  # data files only, never code
    return "tokenizer"
