"""`early-exit`: Kangaroo-style self-speculation. The target's first E layers, a trained adapter
(one attention layer plus norms) and the target's LM head draft K tokens; the full target
verifies them in the same engine call.

The drafter is built as a draft *model* (`adapter.py`): a model of the target's own class with
E + 1 layers, the first E copied from the target, the last the adapter (a decoder layer whose MLP
is nothing), with the adapter's final norm and the target's embedding and LM head. It is handed
to the draft-model engine (`methods/draft.py`: `model_drafter`, `DraftStepEngine`), so one call
= one round exactly as for `--method draft`: the target verifies, the drafter catches up on the
committed tokens and the bonus, then drafts K - 1 more; its cache is its own per-row state
(`draft_past_*`, E + 1 layers); greedy drafts are its argmax, sampled drafts carry their q for the
general accept rule; `--adaptive` and the reduced draft vocabulary (the drafter's readout reads
only the most frequent rows of the LM head, by default `DRAFT_VOCAB` where a ranking ships) work
as they do there.

Not built (say so before measuring it against LayerSkip):
- Verification does NOT reuse the draft's layer 1..E computation: the drafter keeps its own
  cache for its E + 1 layers and the target recomputes layers 1..E for every verified token
  (LayerSkip's cache reuse is not built). The drafter's E layers are also a copy of the target's
  weights in the bundle (as the target stores them: blocks at a GGUF's stored weights, since
  `--weights` reaches the drafter, `build_draft_engine`).
- `--exit-layer auto` (choosing E from measured cost and acceptance). Kangaroo's second,
  confidence-based early stop of the draft loop is `--draft-confidence P` (`ModelDrafts._chain`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from specgraph import draft_vocab
from specgraph.errors import InputError
from specgraph.methods.base import Built, Finished, Measure
from specgraph.methods.draft import (
    DrafterOptions,
    DraftMethod,
    DraftStepEngine,
    add_drafting_flags,
    finish_drafts,
    model_drafter,
    per_round,
    quantise_drafter,
    shipped_file,
)
from specgraph.methods.early_exit.adapter import check_exit_layer, check_fits, exit_model, load_adapter, parts

DRAFT_VOCAB = draft_vocab.MEDUSA_DEFAULT  # tokens the readout scores where the model has a ranking
# The adapters that ship with the package, by the fingerprint of the model they were trained for
SHIPPED: dict[str, str] = {}
DRAFTER_WEIGHTS = {"fp32": None, "int8": 8, "int4": 4}  # --exit-weights: bits of the drafter's blocks
DRAFTER_BLOCK = 32  # weights per block of the drafter's matrices


@dataclass(frozen=True)
class EarlyExitOptions(DrafterOptions):
    method: ClassVar[str] = "early-exit"
    exit_layer: int | None = None  # E: the drafter runs the target's layers 1..E; None: the adapter file's
    exit_adapter: str | None = None  # an adapter from `specgraph train --method early-exit`; default: the shipped one
    num_draft: int | str = 3  # K: draft tokens per round, or "auto"
    exit_weights: str = "fp32"  # the drafter's matrices: fp32, or int8 / int4 blocks with int8 activations
    draft_vocab: int | None = None  # tokens the readout scores; None: DRAFT_VOCAB with a ranking; 0: all
    draft_vocab_file: str | None = None  # a token ranking (scripts/draft_vocab.py); default: the shipped one

    def check(self) -> None:
        super().check()
        if self.exit_weights not in DRAFTER_WEIGHTS:
            raise InputError(f"--exit-weights must be one of {', '.join(DRAFTER_WEIGHTS)}, got {self.exit_weights!r}")
        if self.exit_layer is not None and self.exit_layer < 1:
            raise InputError(f"--exit-layer must be at least 1 (and below the target's layer count), "
                             f"got {self.exit_layer}")  # fmt: skip
        draft_vocab.check_option(self.draft_vocab)

    def files(self) -> list[str | Path | None]:
        return [*super().files(), self.exit_adapter, self.draft_vocab_file]


class EarlyExitMethod(DraftMethod):
    """The draft-model method with the drafter built from the target (its `build` is DraftMethod's)."""

    name = "early-exit"
    summary = "self-speculation: the target's first E layers plus a trained adapter and its LM head propose K tokens"
    options_type = EarlyExitOptions
    trains = True
    needs = None  # the shipped adapter, where there is one; else --exit-adapter (prepare says so)

    def add_flags(self, group: Any) -> None:
        group.add_argument("--exit-layer", type=int,
                           help="early-exit: the drafter runs the target's layers 1..E (1 <= E < layers); "
                                "default: the layer the adapter was trained for")  # fmt: skip
        group.add_argument("--exit-adapter",
                           help="early-exit: adapter file from `specgraph train --method early-exit` "
                                "(default: the shipped one for the model, if any)")  # fmt: skip
        group.add_argument("--exit-weights", choices=list(DRAFTER_WEIGHTS),
                           help="early-exit: the drafter's matrices as fp32 (the default) or int8 / int4 blocks "
                                "with int8 activations; it only proposes, so this costs acceptance, never exactness")  # fmt: skip
        add_drafting_flags(group)

    def add_train_flags(self, group: argparse._ArgumentGroup) -> None:
        from specgraph.methods.teacher import add_corpus_flags

        group.add_argument("--exit-layer", type=int,
                           help="early-exit (required): train the adapter on the hidden states after this layer")  # fmt: skip
        add_corpus_flags(group)

    def train(self, args: argparse.Namespace, progress: bool, command: str) -> dict[str, Any]:
        from specgraph.methods.early_exit.train import LR, train_early_exit
        from specgraph.methods.teacher import Schedule, text_of

        if args.exit_layer is None:
            raise InputError("specgraph train --method early-exit needs --exit-layer E (1 <= E < the model's layers)")
        text = text_of(args)
        schedule = Schedule(epochs=args.epochs or 2, lr=args.lr or LR, curve=args.curve)
        return train_early_exit(args.model, args.output, args.exit_layer, text, schedule, threads=args.threads,
                                progress=progress, command=command, force=args.force)  # fmt: skip

    def prepare(self, loaded: Any, anatomy: Any, cfg: Any) -> Any:
        from specgraph.loaders import model_fingerprint

        opts: EarlyExitOptions = cfg.opts
        if loaded.hf_model is None:
            raise InputError(f"--method early-exit needs a Hugging Face model (a folder or GGUF), not {loaded.name}")
        num_layers = len(parts(loaded.hf_model, loaded.name)[1])
        if opts.exit_layer is not None:
            check_exit_layer(opts.exit_layer, num_layers)
        fingerprint = model_fingerprint(loaded)
        path = shipped_file(opts.exit_adapter, SHIPPED, fingerprint, f"--method early-exit needs --exit-adapter for "
                            f"{loaded.name}: train one with `specgraph train --method early-exit --exit-layer E`")  # fmt: skip
        tensors, meta = load_adapter(path)
        check_fits(Path(path).name, meta, anatomy.hidden_size, anatomy.vocab_size, num_layers, fingerprint,
                   opts.exit_layer, loaded.name)  # fmt: skip
        exit_layer = meta["exit_layer"]
        check_exit_layer(exit_layer, num_layers)
        draft = exit_model(loaded.hf_model, exit_layer, tensors)
        name = f"{loaded.name} layers 1..{exit_layer} + adapter"
        source = dataclasses.replace(loaded, name=name, hf_model=draft, hf_config=draft.config.to_dict())
        drafter = model_drafter(source, loaded, anatomy, cfg, name, default_vocab=DRAFT_VOCAB)
        kept = ("model", "acceptance", "expected_tokens", "train_tokens", "command")
        drafter.trained = {"exit_layer": exit_layer, "of": num_layers, **{k: meta[k] for k in kept if k in meta}}
        drafter.target_layers = exit_layer  # layers 1..E are the target's: their keys and values are its
        return drafter

    def finish(self, staging: Path, cfg: Any, built: Built, measure: Measure) -> Finished:
        opts: EarlyExitOptions = cfg.opts
        engine = built.engine
        assert isinstance(engine, DraftStepEngine)
        trained = dict(built.meta["trained"])
        exit_layer, of = trained.pop("exit_layer"), trained.pop("of")
        section: dict[str, Any] = {"exit_layer": exit_layer, "num_layers": of, "num_draft": engine.num_draft,
                                   "adapter": opts.exit_adapter or "shipped", "weights": "float32",
                                   "layer_reuse": False, "trained": trained}  # fmt: skip
        bits = DRAFTER_WEIGHTS[opts.exit_weights]
        if bits is not None:
            section["weights"] = quantise_drafter(staging, bits, DRAFTER_BLOCK)
        summary = f"early exit after layer {exit_layer} of {of} + adapter, {per_round(engine.num_draft)}"
        return finish_drafts(staging, engine, section, summary, opts, measure)


EARLY_EXIT = EarlyExitMethod()
