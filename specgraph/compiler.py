"""The compiler driver: load -> capture -> anatomy -> passes -> step engine -> export.

`PIPELINES` lists, per method, the graph passes in the order they run. It is the one place
that says which rewrites a method needs.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specgraph.anatomy import Anatomy, analyze
from specgraph.capture import capture
from specgraph.errors import InputError
from specgraph.exporters.manifest import describe_values, write_manifest
from specgraph.exporters.onnx import export_onnx, io_names
from specgraph.loaders import LoadedModel, load_model
from specgraph.passes import PassContext, PassResult, add_kv_cache_io, fuse_projections, insert_tree_attention
from specgraph.step import StepEngine

logger = logging.getLogger("specgraph.compiler")
METHODS = ("none", "lookup")
Pass = Callable[[torch.fx.GraphModule, PassContext], PassResult]

PIPELINES: dict[str, list[Pass]] = {
    # insert_tree_attention first: add_kv_cache_io reads the attn_mask input it creates and
    # widens the attended keys from this call's T tokens to the S cache slots.
    # fuse_projections last: it only merges linears and leaves the nodes the others use alone.
    "none": [insert_tree_attention, add_kv_cache_io, fuse_projections],
    "lookup": [insert_tree_attention, add_kv_cache_io, fuse_projections],
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

    def check(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose one of: {', '.join(METHODS)}")
        if not 16 <= self.max_context <= 131072:
            raise InputError(f"--max-context must be between 16 and 131072, got {self.max_context}")
        if self.method == "lookup" and not 1 <= self.num_draft <= 64:
            raise InputError(f"--num-draft must be between 1 and 64, got {self.num_draft}")
        if not 1 <= self.max_ngram <= 8:
            raise InputError(f"--max-ngram must be between 1 and 8, got {self.max_ngram}")


@dataclass
class CompileReport:
    """What `specgraph compile` prints: where the bundle is, what changed, how long it took."""

    bundle: Path
    method: str
    anatomy: dict[str, Any]
    pass_counts: dict[str, dict[str, int]]
    seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bundle"] = str(self.bundle)
        return d


def build_step_engine(
    loaded: LoadedModel, cfg: CompileConfig, progress: Callable[[str], None] | None = None
) -> tuple[StepEngine, Anatomy, dict[str, dict[str, int]], list[tuple[int, ...]]]:
    """Run capture, anatomy and the method's passes; return the step engine to export."""
    say = progress or (lambda _msg: None)
    say("capture")
    gm = capture(loaded, cfg.max_context)
    say("anatomy")
    anatomy = analyze(gm, loaded.hf_config)
    ctx = PassContext(anatomy, cfg.max_context)
    counts: dict[str, dict[str, int]] = {}
    for pass_fn in PIPELINES[cfg.method]:
        say(pass_fn.__name__)
        counts[pass_fn.__name__] = pass_fn(gm, ctx).counts
    windows = {s.sliding_window for s in anatomy.sites if s.sliding_window}
    engine = StepEngine(
        gm,
        anatomy.num_layers,
        cfg.max_context,
        cfg.method,
        cfg.num_draft,
        cfg.max_ngram,
        sliding_window=windows.pop() if windows else None,
        emit_logits=cfg.emit_logits,
    )
    kv_shapes: list[tuple[int, ...]] = []
    for s in anatomy.sites:
        kv_shapes += [(s.num_kv_heads, s.head_dim, cfg.max_context), (s.num_kv_heads, cfg.max_context, s.head_dim)]
    return engine, anatomy, counts, kv_shapes


def compile_model(cfg: CompileConfig, progress: Callable[[str], None] | None = None) -> CompileReport:
    """Compile `cfg.model` into a bundle at `cfg.output` (written atomically)."""
    cfg.check()
    say = progress or (lambda _msg: None)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    say("load")
    loaded = load_model(cfg.model)
    times["load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine, anatomy, counts, kv_shapes = build_step_engine(loaded, cfg, say)
    times["passes"] = time.perf_counter() - t0
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".specgraph-", dir=out.parent))
    try:
        t0 = time.perf_counter()
        say("export onnx")
        model_proto = export_onnx(engine, kv_shapes, staging / "model.onnx")
        times["export"] = time.perf_counter() - t0
        tokenizer = _copy_tokenizer(loaded, staging)
        inputs, outputs = io_names(engine)
        body = {
            "method": cfg.method,
            "source": {"name": loaded.name, "kind": loaded.kind, "path": str(cfg.model)},
            "max_context": cfg.max_context,
            "vocab_size": anatomy.vocab_size,
            "eos_token_ids": loaded.eos_token_ids,
            "tokenizer": tokenizer,
            "lookup": {"num_draft": cfg.num_draft, "max_ngram": cfg.max_ngram} if cfg.method == "lookup" else None,
            "anatomy": anatomy.summary(),
            "passes": counts,
            "graph": {
                "file": "model.onnx",
                "weights": "model.onnx.data",
                "opset": 24,
                "inputs": describe_values(model_proto.graph.input),
                "outputs": describe_values(model_proto.graph.output),
                "bindings": _bindings(inputs, outputs),
            },
        }
        write_manifest(staging, body)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return CompileReport(out, cfg.method, anatomy.summary(), counts, {k: round(v, 2) for k, v in times.items()})


def _bindings(inputs: list[str], outputs: list[str]) -> dict[str, str]:
    """Which output feeds which input on the next call (the host does nothing else)."""
    pairs = {"next_tokens": "tokens", "cache_len_out": "cache_len", "history_out": "history"}
    pairs.update({o: o.replace("present_", "past_", 1) for o in outputs if o.startswith("present_")})
    return {o: i for o, i in pairs.items() if o in outputs and i in inputs}


def _copy_tokenizer(loaded: LoadedModel, bundle: Path) -> str | None:
    if loaded.tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(loaded.tokenizer_dir)).save_pretrained(str(bundle / "tokenizer"))
    return "tokenizer"
