"""specgraph: compile a traced language model into a lossless speculative-decoding engine.

import specgraph
report = specgraph.compile("smollm2-135m", "out/", method="lookup")
engine = specgraph.load("out/")
result = engine.generate(engine.tokenizer.encode("def fib(n):"), max_new_tokens=64)
"""

from __future__ import annotations

import os
from pathlib import Path

# specgraph never downloads: every model, tokenizer and bundle is a local file. huggingface_hub
# reads these once, when it is first imported, so they are set here, before anything imports
# transformers; every from_pretrained call also passes local_files_only=True, which covers a host
# that imported transformers before specgraph.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from specgraph.compiler import CompileReport
    from specgraph.runtime import Engine


def compile(model: str | Path, output: str | Path, method: str = "none", **options: Any) -> CompileReport:
    """Compile `model` (a torch.export file, HF folder, GGUF file or "smollm2-135m") into a
    bundle at `output`. Options mirror `specgraph compile`'s flags: the shared ones (max_context,
    weights, sampling...) and the method's own (lookup: num_draft, max_ngram, adaptive; medusa:
    heads, tree, acceptance; `specgraph compile --help` lists every method's)."""
    from specgraph.compiler import CompileConfig, compile_model

    return compile_model(CompileConfig.of(model, output, method, **options))


def load(bundle: str | Path, threads: int | None = None, verify: bool = True) -> Engine:
    """Load a compiled bundle into ONNX Runtime (`threads` = intra-op threads)."""
    from specgraph.runtime import Engine

    return Engine(bundle, threads=threads, verify=verify)


__all__ = ["__version__", "compile", "load"]
