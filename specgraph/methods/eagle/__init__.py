"""`eagle`: an EAGLE drafter (one decoder layer on [token embedding; target feature], see
`drafter.py`) proposes K tokens; the target verifies them in the same engine call.

One call = one round, all inside one ONNX graph:
  1. the target verifies `tokens` = [bonus, d_1..d_K] (the shared chain rule) and hands on its
     feature (the LM head's input, an output the pass `add_feature_output` adds) at every position;
  2. catch-up: the drafter runs one entry per position of this call, (f_j, the token after j),
     the token after the last committed position being the new bonus; this rewrites its cache
     for everything committed, and the entry at the last committed position predicts the
     feature after the bonus, whose readout is d'_1;
  3. K - 1 one-entry steps, each feeding back the predicted feature with the token just drafted.
The drafter's cache is per-row state like the draft model's (`methods/draft.py` `ModelDrafts`,
which also gives the greedy drafts and, with sampling, the drafts' q for the general rule);
rollback is not advancing: every slot past the committed tokens is rewritten before it is read.

The readout is rows of the target's own LM head: the reduced draft vocabulary where the model has
a ranking (`specgraph/draft_vocab.py`), so the drafter ships no head of its own.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from specgraph import draft_vocab
from specgraph.errors import InputError
from specgraph.loaders import model_fingerprint
from specgraph.methods.base import Built, Finished, Measure, Method
from specgraph.methods.draft import (
    DrafterOptions,
    ModelDrafts,
    add_drafting_flags,
    finish_drafts,
    per_round,
    quantise_drafter,
    shipped_file,
)
from specgraph.methods.eagle.drafter import EagleDrafter, load_drafter
from specgraph.passes import add_feature_output
from specgraph.step import attn_span, chain_masks

_I64 = torch.int64
DRAFT_VOCAB = draft_vocab.MEDUSA_DEFAULT  # tokens the readout scores where the model has a ranking
# The drafters that ship with the package, by the fingerprint of the model they were trained for
SHIPPED = {"0ebad5bc77922ab0d3f1f04924907dee": "smollm2-135m-eagle.safetensors"}  # SmolLM2-135M-Instruct
DRAFTER_WEIGHTS = {"int8": 8, "int4": 4, "fp32": None}  # --eagle-weights: bits of the drafter's blocks
DRAFTER_BLOCK = 32  # weights per block of the drafter's matrices


@dataclass(frozen=True)
class EagleOptions(DrafterOptions):
    method: ClassVar[str] = "eagle"
    eagle: str | None = None  # a drafter file from `specgraph train --method eagle`; default: the shipped one
    num_draft: int | str = 1  # K (1 measured best for the shipped drafter, docs/benchmarks.md), or "auto"
    draft_vocab: int | None = None  # tokens the readout scores; None: DRAFT_VOCAB with a ranking; 0: all
    draft_vocab_file: str | None = None  # a token ranking (scripts/draft_vocab.py); default: the shipped one
    eagle_weights: str = "int8"  # the drafter's matrices: int8 or int4 blocks (int8 activations), or fp32

    def check(self) -> None:
        super().check()
        if self.eagle_weights not in DRAFTER_WEIGHTS:
            raise InputError(f"--eagle-weights must be one of {', '.join(DRAFTER_WEIGHTS)}, got {self.eagle_weights!r}")
        draft_vocab.check_option(self.draft_vocab)

    def files(self) -> list[str | Path | None]:
        return [*super().files(), self.eagle, self.draft_vocab_file]


class EagleStepEngine(ModelDrafts):
    """The chain engine with an EAGLE layer as the drafter."""

    def __init__(self, target: torch.fx.GraphModule, num_layers: int, max_context: int, *args: Any,
                 drafter: EagleDrafter, embed_weight: str, lm_head_weight: str, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(target, num_layers, max_context, *args, cache_shapes=drafter.cache_shapes(max_context),
                         vocab=drafter.vocab, **kwargs)  # fmt: skip
        self.draft_gm = drafter  # its weights are draft_gm.* (exporters/gemm.py: the drafter's own products)
        drafter.pack()
        shape = drafter.shape  # lets the export fuse the drafter's cached attention, as a draft model's
        self.draft_heads = [(shape.heads, shape.kv_heads, shape.head_dim**-0.5)]
        self.embed_weight = embed_weight
        if self.vocab_ids is not None:  # the readout: those rows of the LM head, as the drafter's own weight
            rows = self.target.get_parameter(lm_head_weight).detach()[self.vocab_ids].clone()
        else:
            rows = self.target.get_parameter(lm_head_weight).detach().clone()
        drafter.register_parameter("readout", torch.nn.Parameter(rows, requires_grad=False))  # [V_d, H]

    def draft(self, state, tokens, cache_len, bonus, cache_len_out, params, feature):  # type: ignore[no-untyped-def]
        b, t = tokens.shape
        h = feature.shape[-1]
        committed = cache_len_out - cache_len  # [B]
        idx = torch.arange(t, dtype=_I64)[None, :]  # [1, T]
        after = torch.cat([tokens[:, 1:], bonus], dim=1)  # [B, T] the token after each position...
        after = torch.where(idx == committed[:, None] - 1, bonus, after)  # ...the bonus after the last committed
        kv = list(state[:2])
        pred, kv = self._run(after, feature, cache_len[:, None] + idx, cache_len, kv)  # [B, T, H]
        last = pred.gather(1, (committed - 1)[:, None, None].expand(b, 1, h))  # [B, 1, H] the feature after the bonus
        first = self._propose(self._readout(last), cache_len_out[:, None] + 1, params)

        def step(i, d, carry, params):  # type: ignore[no-untyped-def]
            pos = cache_len_out[:, None] + (i - 1)  # [B, 1] the entry (predicted feature, d'_i)
            feature, kv = self._run(d, carry[1], pos, pos[:, 0], carry[0])
            return self._propose(self._readout(feature), pos + 2, params), (kv, feature)

        drafts, qs, logps, kv = self._chain(first, (kv, last), step, params)
        return self._outputs(state, tokens, cache_len, cache_len_out, bonus, drafts, kv, qs, logps)

    def _readout(self, feature: torch.Tensor) -> torch.Tensor:
        """Logits [B, 1, V_d] of a feature [B, 1, H] (one 2-D product over the drafter's rows)."""
        b, h = feature.shape[0], feature.shape[-1]
        readout = self.draft_gm.get_parameter("readout")  # [V_d, H]
        return torch.nn.functional.linear(feature.reshape(b, h), readout)[:, None, :]

    def _run(self, tokens, feature, positions, write_at, kv):  # type: ignore[no-untyped-def]
        """Entries (feature [B, W, H], embedding of tokens [B, W]) at `positions` [B, W]."""
        s = kv[1].shape[-2]
        emb = torch.nn.functional.embedding(tokens, self.target.get_parameter(self.embed_weight))
        masks = chain_masks(positions, s, None)
        span = attn_span(positions.max() + 1, s)
        pred, k, v = self.draft_gm.step(emb, feature, positions, masks[0], write_at, span, *kv)
        return pred, [k, v]


class EagleMethod(Method):
    name = "eagle"
    summary = "an EAGLE drafter (one decoder layer on the target's features) proposes K tokens"
    options_type = EagleOptions
    trains = True

    def add_flags(self, group: Any) -> None:
        group.add_argument(
            "--eagle", help="eagle: drafter file from `specgraph train --method eagle` (default: the shipped one)"
        )
        group.add_argument("--eagle-weights", choices=list(DRAFTER_WEIGHTS),
                           help="eagle: the drafter's matrices as int8 (the default) or int4 blocks with int8 "
                                "activations, or fp32; it only proposes, so this costs acceptance, never exactness")  # fmt: skip
        add_drafting_flags(group)

    def add_train_flags(self, group: argparse._ArgumentGroup) -> None:
        from specgraph.methods.eagle.train import MAX_DEPTH, TOKEN_LOSSES
        from specgraph.methods.teacher import add_corpus_flags

        add_corpus_flags(group)
        group.add_argument("--token-loss", choices=TOKEN_LOSSES, default=TOKEN_LOSSES[0],
                           help="eagle: the token term's target: the target's argmax (the default), or its whole "
                                "distribution over the draft vocabulary (EAGLE's own loss)")  # fmt: skip
        group.add_argument("--train-depth", type=int, default=1,
                           help="eagle: also train on drafting from its own predicted features, this many steps deep "
                                f"(1 to {MAX_DEPTH}; default 1: from the target's only). Each step costs one more pass a batch")  # fmt: skip

    def train(self, args: argparse.Namespace, progress: bool, command: str) -> dict[str, Any]:
        from specgraph.methods.eagle.train import LR, train_eagle
        from specgraph.methods.teacher import text_of

        text = text_of(args)
        return train_eagle(model=args.model, output=args.output, prompts=text.prompts, corpus_mb=text.corpus_mb,
                           max_new_tokens=text.max_new_tokens, epochs=args.epochs or 2, lr=args.lr or LR, seq_len=text.seq_len,
                           curve=args.curve, threads=args.threads, progress=progress, command=command,
                           force=args.force, samples=text.samples, functions=text.functions,
                           token_loss=args.token_loss, depth=args.train_depth)  # fmt: skip

    def prepare(self, loaded: Any, anatomy: Any, cfg: Any) -> EagleDrafter:
        opts: EagleOptions = cfg.opts
        fingerprint = model_fingerprint(loaded)
        path = shipped_file(opts.eagle, SHIPPED, fingerprint, f"--method eagle needs --eagle for {loaded.name}: "
                            "train a drafter with `specgraph train --method eagle`")  # fmt: skip
        drafter = load_drafter(path, anatomy.hidden_size, anatomy.vocab_size)
        if fingerprint and drafter.meta.get("fingerprint") not in (None, fingerprint):
            raise InputError(f"{Path(path).name} was trained for another model ({drafter.meta.get('model', '?')}), "
                             f"not {loaded.name}: its fingerprint differs; train one with `specgraph train --method eagle`")  # fmt: skip
        drafter.vocab = draft_vocab.choose(opts.draft_vocab, opts.draft_vocab_file, DRAFT_VOCAB, fingerprint,
                                           anatomy.vocab_size, loaded.name)  # fmt: skip
        drafter.requires_grad_(False)
        return drafter

    def passes(self, options: Any) -> list[Any]:
        return [add_feature_output]

    def build(self, gm: torch.fx.GraphModule, anatomy: Any, cfg: Any, drafter: Any, window: int | None) -> Built:
        head, embed = anatomy.lm_head.args[1], anatomy.embedding.args[0]
        assert isinstance(head, torch.fx.Node) and isinstance(embed, torch.fx.Node)
        engine = EagleStepEngine(gm, anatomy.num_layers, cfg.max_context, window, cfg.emit_logits,
                                 cfg.engine_samples, drafter=drafter, embed_weight=str(embed.target),
                                 lm_head_weight=str(head.target), num_draft=cfg.opts.draft_count,
                                 vocab_size=anatomy.vocab_size, adaptive=cfg.opts.gated,
                                 confidence=cfg.opts.draft_confidence)  # fmt: skip
        # the target's weights follow --weights; the drafter's follow --eagle-weights (in `finish`)
        return Built(engine, {"weights_skip": "draft_gm."})

    def finish(self, staging: Path, cfg: Any, built: Built, measure: Measure) -> Finished:
        engine = built.engine
        assert isinstance(engine, EagleStepEngine)
        meta = engine.draft_gm.meta
        section: dict[str, Any] = {"num_draft": engine.num_draft, "drafter": cfg.opts.eagle or "shipped",
                                   "weights": "float32"}  # fmt: skip
        bits = DRAFTER_WEIGHTS[cfg.opts.eagle_weights]
        if bits is not None:
            native = built.meta.get("kernels") == "native"  # the bundle loads specgraph's kernels anyway
            section["weights"] = quantise_drafter(staging, bits, DRAFTER_BLOCK, native)
        section["trained"] = {k: meta[k] for k in ("model", "acceptance", "expected_tokens", "train_tokens",
                                                   "command") if k in meta}  # fmt: skip
        summary = f"EAGLE drafter, {per_round(engine.num_draft)}"
        return finish_drafts(staging, engine, section, summary, cfg.opts, measure)


EAGLE = EagleMethod()
