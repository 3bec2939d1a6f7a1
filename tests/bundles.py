"""Reading, running and editing compiled bundles in tests: what a gated engine's idle branch runs;
its calls one by one; a copy with one initializer changed, its manifest resealed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from specgraph.exporters.manifest import reseal
from specgraph.exporters.onnx import set_initializer


def with_initializer(bundle: Path, out: Path, name: str, value: np.ndarray) -> Path:
    """A copy of `bundle` at `out` whose initializer `name` (a buffer the engine registered, e.g.
    a threshold) holds `value`, with the manifest's record of model.onnx updated to match."""
    shutil.copytree(bundle, out)
    set_initializer(out / "model.onnx", name, value)
    reseal(out)
    return out


def idle_ops(bundle: Path) -> list[str]:
    """The op types of the `else` branch of a gated engine's `draft_gate` (exporters/gate.py):
    what a call in which no row drafts runs of the drafter's part."""
    import onnx

    graph = onnx.load(str(Path(bundle) / "model.onnx"), load_external_data=False).graph
    gate = next(n for n in graph.node if n.name == "draft_gate")
    return [n.op_type for n in next(a.g for a in gate.attribute if a.name == "else_branch").node]


def calls(engine: Any, prompt: list[int], count: int) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """`count` calls of `engine` (a runtime.Engine) on one row, from the prompt on, as generate's
    loop makes them (the next call's tokens cut to 1 + max(n_draft)); yields each call's outputs
    and the state it left."""
    state, io = engine.new_state(1), engine.session.io_binding()
    feeds = engine.first_feeds(np.asarray([prompt], np.int64), [len(prompt)], 0)
    for _ in range(count):
        result = engine.call(io, feeds, state)
        yield result, state
        feeds = engine.next_feeds(result)
