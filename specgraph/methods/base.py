"""The interface every speculative method implements (see `specgraph.methods`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from specgraph.errors import InputError

if TYPE_CHECKING:
    import torch

    from specgraph.anatomy import Anatomy
    from specgraph.compiler import CompileConfig
    from specgraph.loaders import LoadedModel
    from specgraph.passes import PassContext, PassResult
    from specgraph.runtime import Engine

    Pass = Callable[[torch.fx.GraphModule, PassContext], PassResult]


@dataclass(frozen=True)
class Options:
    """A method's own settings. Each method subclasses this with its fields (their names are its
    `specgraph compile` flags' destinations) and checks them in `check`."""

    def check(self) -> None:
        """Raise InputError naming the flag at fault."""

    def files(self) -> list[str | Path | None]:
        """Files these options make the compile read (its output must never touch them)."""
        return []

    @property
    def samples(self) -> bool:
        """Whether the engine can take sampling inputs (a lossy rule of its own cannot)."""
        return True


NUM_DRAFT_HELP = (
    "draft tokens per round (lookup: default 7; draft: 4; eagle: 1; early-exit: 3; medusa's chain: 1, at most one a "
    "head), or auto (draft, eagle, early-exit, medusa's chain): build with 4, generate --auto-prompts and time the "
    "engine, then build again with the K predicted fastest (about twice the compile time)"
)  # --num-draft: every method that takes it registers it with this text (the first registration serves all)


def count_or_auto(text: str) -> int | str:
    """`--num-draft`'s type: a whole number, or `auto` (the methods that measure K themselves)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


@dataclass
class Built:
    """What `Method.build` returns: the step engine to export, and anything `finish` needs."""

    engine: Any  # a torch.nn.Module with io_names, example_inputs and dynamic_shapes (StepEngine, TreeStepEngine)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Finished:
    """What `Method.finish` returns for the manifest.

    section: the manifest's `<method name>` entry (None when the method has no settings);
    constants: engine inputs every host binds unchanged on every call (`graph.constants`);
    draft_depth: the most draft tokens one round verifies (0 = plain decoding);
    report: what `specgraph compile` prints about the method;
    rebuild: options to build the engine again with (e.g. a K the staged engine measured best);
    the compiler then discards this engine and builds, exports and finishes another.
    """

    section: dict[str, Any] | None = None
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    draft_depth: int = 0
    report: dict[str, Any] | None = None
    rebuild: Options | None = None


class Method:
    """One speculative method. Subclasses set the class attributes and override what they need;
    a method with nothing to load or write keeps the defaults (no-ops)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for `specgraph compile --help`
    lossless: ClassVar[bool] = True  # with default options; a manifest section may say otherwise
    speculative: ClassVar[bool] = True  # verifies drafts (False only for plain decoding)
    options_type: ClassVar[type[Options]] = Options
    trains: ClassVar[bool] = False  # `specgraph train --method NAME` trains its drafter
    # `specgraph advise MODEL` compiles it with these options unless --methods says otherwise;
    # None: not by default (it needs more than the target, or is the baseline)
    advised: ClassVar[dict[str, Any] | None] = None
    needs: ClassVar[str | None] = None  # a flag without which it cannot be compiled from the target alone

    def add_flags(self, group: Any) -> None:
        """Add this method's `specgraph compile` flags (destinations = `options_type` fields)."""

    def add_train_flags(self, group: argparse._ArgumentGroup) -> None:
        """Add this method's `specgraph train` flags (only for a method that `trains`)."""

    def train(self, args: argparse.Namespace, progress: bool, command: str) -> dict[str, Any]:
        """Train the drafter as `specgraph train` asks (args: the parsed flags); return the report."""
        raise NotImplementedError(f"--method {self.name} has nothing to train")

    def options(self, values: dict[str, Any]) -> Options:
        """The options from keyword values (the Python API's `**options`), refusing unknown keys."""
        known = {f.name for f in dataclasses.fields(self.options_type)}
        unknown = sorted(set(values) - known)
        if unknown:
            allowed = ", ".join(sorted(known)) or "none"
            raise InputError(f"--method {self.name} has no option {unknown[0]!r} (its options: {allowed})")
        return self.options_type(**values)

    def stages(self, options: Any) -> list[str]:
        """Progress stages this method adds after the export (e.g. measuring a tree)."""
        return []

    def prepare(self, loaded: LoadedModel, anatomy: Anatomy, cfg: CompileConfig) -> Any:
        """Load what the method drafts with (heads, a draft model); passes see it as `ctx.drafter`."""
        return None

    def passes(self, options: Any) -> list[Pass]:
        """Graph passes this method needs, run after `add_kv_cache_io` and before the fusions."""
        return []

    def build(self, gm: torch.fx.GraphModule, anatomy: Anatomy, cfg: CompileConfig, drafter: Any,
              window: int | None) -> Built:  # fmt: skip
        """The step engine around the rewritten target graph `gm`."""
        raise NotImplementedError

    def finish(self, staging: Path, cfg: CompileConfig, built: Built, measure: Measure) -> Finished:
        """Write the method's files into the staged bundle and describe them for the manifest.
        `measure(finished)` writes a manifest from `finished` and loads the staged bundle, for a
        method that chooses its settings by timing this very engine."""
        return Finished()


Measure = Callable[[Finished], "Engine"]
