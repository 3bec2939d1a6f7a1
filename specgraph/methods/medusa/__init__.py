"""`medusa`: heads on the target's last hidden state propose the tokens after the next one.

Two engines, by `--tree`:
- `chain` (the default): heads 1..K's top tokens are one chain of K drafts, verified by the chain
  engine (`specgraph.step`, the rule every chain method shares) with the fused cached attention
  and, by default, the adaptive gate: a row drafts only while its rounds pay, and a call in which
  no row drafts skips the heads. The heads read the feature (the LM head's input) at the last
  committed position, so they need no cache of their own.
- a tree (a preset, a Medusa-format file, or `auto`): the heads' top candidates form a tree that
  the shared tree verifier (`specgraph.step_tree`) walks. The tree is engine *input*: the
  manifest's `graph.constants` carry it, so one ONNX graph runs any tree and `--tree auto` can
  time this very engine before choosing one.
`heads.py` holds the heads and their file format, `tree.py` the trees and the auto-tree search,
`train.py` the training.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import torch

from specgraph import draft_vocab
from specgraph.errors import InputError
from specgraph.loaders import model_fingerprint
from specgraph.methods.base import Built, Finished, Measure, Method
from specgraph.methods.draft import (
    AUTO_PROMPTS,
    DrafterOptions,
    ModelDrafts,
    add_drafting_flags,
    finish_drafts,
    per_round,
    quantise_drafter,
)
from specgraph.methods.medusa.heads import MedusaHeads, load_heads
from specgraph.methods.medusa.tree import Tree, build_tree, load_tree, named_tree
from specgraph.passes import add_feature_output, add_kv_compaction, add_medusa_heads
from specgraph.step_tree import TreeStepEngine
from specgraph.timing import time_call

TYPICAL = (0.09, 0.3, 0.7)  # Medusa's defaults: posterior threshold, alpha, temperature
TOPK = 10  # candidates kept per head; tree ranks must be below this
DRAFT_VOCAB = draft_vocab.MEDUSA_DEFAULT  # the reduced draft vocabulary where the model has a ranking
# The heads that ship with the package, by the fingerprint of the model they were trained for
# (`loaders.model_fingerprint`): any path to that model finds them, whatever its file is called.
SHIPPED_HEADS = {"0ebad5bc77922ab0d3f1f04924907dee": "smollm2-135m-medusa4.safetensors"}  # SmolLM2-135M-Instruct
_HEADS_DIR = Path(__file__).resolve().parents[2] / "data" / "heads"
CHAIN = "chain"  # --tree chain: the chain engine (see the module docstring)
HEAD_WEIGHTS_BITS, HEAD_BLOCK = 8, 32  # the chain engine's head products: int8 blocks, int8 activations


@dataclass(frozen=True)
class MedusaOptions(DrafterOptions):
    method: ClassVar[str] = "medusa"
    heads: str | None = None  # trained heads (safetensors); default: the shipped ones
    tree: str = CHAIN  # "chain", a tree preset name, a Medusa-format JSON file, or "auto"
    acceptance: str = "greedy"  # "greedy" (lossless) or "typical" (Medusa's, LOSSY; trees only)
    num_draft: int | str = 1  # chain: K heads' drafts a round, or "auto"
    draft_vocab: int | None = None  # tokens the heads score; None: DRAFT_VOCAB with a ranking; 0: all
    draft_vocab_file: str | None = None  # a token ranking (scripts/draft_vocab.py); default: the shipped one

    @property
    def chained(self) -> bool:
        return self.tree == CHAIN

    @property
    def adapts(self) -> bool:
        return self.chained and super().adapts

    def check(self) -> None:
        if self.acceptance not in ("greedy", "typical"):
            raise InputError(f"--acceptance {self.acceptance!r}: choose greedy or typical")
        draft_vocab.check_option(self.draft_vocab)
        if self.chained:
            if self.acceptance == "typical":
                raise InputError("--acceptance typical verifies a tree: add --tree default (or another tree)")
            super().check()
            return
        if self.tree != "auto":
            named_or_file(self.tree)  # a bad tree file fails now, not after the export
        chain_only = {"--num-draft": self.num_draft != 1, "--adaptive": self.adaptive is not None,
                      "--adaptive-threshold": self.adaptive_threshold is not None,
                      "--draft-confidence": self.draft_confidence is not None,
                      "--auto-prompts": self.auto_prompts != AUTO_PROMPTS}  # fmt: skip
        for flag, given in chain_only.items():
            if given:
                raise InputError(f"{flag} is for medusa's chain engine (--tree chain), not --tree {self.tree}")

    def files(self) -> list[str | Path | None]:
        tree = None if self.tree in ("auto", CHAIN) else self.tree
        return [*(super().files() if self.chained else []), self.heads, tree, self.draft_vocab_file]

    @property
    def samples(self) -> bool:
        return self.acceptance == "greedy"  # typical acceptance is its own (lossy, greedy-only) rule


class MedusaStepEngine(TreeStepEngine):
    """The tree engine with Medusa's heads as the drafter."""

    def __init__(self, *args: Any, lm_head_weight: str, heads_meta: dict[str, Any],
                 vocab: tuple[torch.Tensor, dict[str, Any]] | None = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.lm_head_weight = lm_head_weight
        self.heads_meta = heads_meta  # the heads file's header (training figures, measured acceptance)
        self.vocab_ids: torch.Tensor | None
        self.register_buffer("vocab_ids", None)
        self.vocab_info: dict[str, Any] = {}  # what the manifest says of the draft vocabulary
        if vocab is not None:
            vocab_ids, self.vocab_info = vocab
            # The reduced draft vocabulary (specgraph/draft_vocab.py): the heads score only these
            # ids, read out by those rows of the LM head, copied here as a weight of their own. A
            # GGUF's rows stay its stored blocks (exporters/nbits.py matches rows by content).
            medusa = cast(MedusaHeads, self.target.medusa_heads)
            with torch.no_grad():
                rows = self.target.get_parameter(lm_head_weight)[vocab_ids].clone()
                self.vocab_head = torch.nn.Parameter(rows, requires_grad=False)  # [V_d, H]
                if medusa.lm_heads is not None:
                    own = medusa.lm_heads[:, vocab_ids].clone()
                    self.vocab_heads = torch.nn.Parameter(own, requires_grad=False)  # [K, V_d, H]
            self.vocab_ids = vocab_ids.to(torch.int64).clone()  # a buffer: exported as a constant

    @property
    def candidates_per_head(self) -> int:
        """The top tokens kept per head (TOPK, or the whole draft vocabulary when it is smaller)."""
        scored = (
            self.target.get_parameter(self.lm_head_weight).shape[0] if self.vocab_ids is None else len(self.vocab_ids)
        )
        return min(TOPK, int(scored))

    def propose(self, h: torch.Tensor, tree_head: torch.Tensor, tree_rank: torch.Tensor) -> torch.Tensor:
        b = h.shape[0]
        medusa = cast(MedusaHeads, self.target.medusa_heads)  # attached by add_medusa_heads
        states = medusa(h)  # [B, K, H]
        reduced = self.vocab_ids is not None
        weight = self.vocab_head if reduced else self.target.get_parameter(self.lm_head_weight)
        if medusa.lm_heads is None:  # shared LM head: one 2-D product, exported as Gemm on the stored weight
            head_logits = torch.nn.functional.linear(states.reshape(b * self.num_heads, -1), weight)
            head_logits = head_logits.reshape(b, self.num_heads, -1)  # [B, K, V or V_d]
        elif reduced:
            head_logits = torch.einsum("bkh,kvh->bkv", states, self.vocab_heads)
        else:
            head_logits = medusa.readout(states, weight)  # [B, K, V], one LM head per Medusa head
        keep = self.candidates_per_head
        candidates = torch.topk(head_logits, keep, dim=-1).indices.reshape(b, self.num_heads * keep)  # [B, K*10]
        if self.vocab_ids is not None:
            candidates = self.vocab_ids[candidates]  # draft-vocabulary index -> token id
        pick = (tree_head.clamp(min=0) * keep + tree_rank)[None, :].expand(b, tree_head.shape[0])  # [B, N]
        return candidates.gather(1, pick)  # [B, N]


class MedusaChainEngine(ModelDrafts):
    """The chain engine with Medusa's heads as the drafter: heads 1..K on the target's feature at
    the last committed position propose the K tokens after the bonus, each read out by its own
    rows of the LM head (the reduced draft vocabulary where there is one). No cache: a head reads
    one feature, so rollback needs nothing. The drafts are each head's argmax, sampling or not:
    point masses, as in the tree engine, so seeded text is token for token plain sampling's."""

    point_masses = True

    def __init__(self, target: torch.fx.GraphModule, num_layers: int, max_context: int, *args: Any,
                 heads: MedusaHeads, lm_head_weight: str, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(target, num_layers, max_context, *args, cache_shapes=[], vocab=heads.vocab, **kwargs)
        k, ids = self.num_draft, self.vocab_ids
        shared = self.target.get_parameter(lm_head_weight).detach()  # [V, H]
        own = heads.lm_heads.detach() if heads.lm_heads is not None else None  # [K_heads, V, H]
        drafter = torch.nn.Module()  # its weights are draft_gm.* (exporters/gemm.py: the drafter's own products)
        drafter.proj = torch.nn.ModuleList()
        for i in range(k):
            linear = torch.nn.Linear(heads.hidden_size, heads.hidden_size)
            with torch.no_grad():
                linear.weight.copy_(heads.weight[i])
                linear.bias.copy_(heads.bias[i])
            drafter.proj.append(linear.requires_grad_(False))
        rows = [shared if own is None else own[i] for i in range(k if own is not None else 1)]
        rows = [r if ids is None else r[ids] for r in rows]  # [V_d, H] each: one readout, or one per head
        drafter.readout = torch.nn.ParameterList([torch.nn.Parameter(r.clone(), requires_grad=False) for r in rows])
        self.draft_gm = drafter

    def draft(self, state, tokens, cache_len, bonus, cache_len_out, params, feature):  # type: ignore[no-untyped-def]
        b, h = feature.shape[0], feature.shape[-1]
        committed = cache_len_out - cache_len  # [B]
        last = feature.gather(1, (committed - 1)[:, None, None].expand(b, 1, h))[:, 0]  # [B, H] gives the bonus
        readout = self.draft_gm.readout
        drafts, qs, logps = [], [], []
        for i, proj in enumerate(self.draft_gm.proj):
            state_i = last + torch.nn.functional.silu(proj(last))  # head i's state: token i + 2 after `last`
            logits = torch.nn.functional.linear(state_i, readout[min(i, len(readout) - 1)])[:, None, :]
            d, q, logp = self._propose(logits, cache_len_out[:, None] + 1 + i, params)
            drafts.append(d)
            qs.append(q)
            logps.append(logp)
        return self._outputs(state, tokens, cache_len, cache_len_out, bonus, drafts, [], qs, logps)


class MedusaMethod(Method):
    name = "medusa"
    summary = "Medusa heads propose a candidate tree, verified in one call"
    advised = {}
    options_type = MedusaOptions
    trains = True

    def add_flags(self, group: Any) -> None:
        group.add_argument(
            "--heads",
            default=None,
            help="medusa: heads file from `specgraph train` (default: the shipped heads for smollm2-135m)",
        )
        group.add_argument(
            "--acceptance",
            default="greedy",
            choices=["greedy", "typical"],
            help="medusa: greedy verification (lossless, the default) or Medusa's typical acceptance, which is "
            "LOSSY: it also accepts candidates the target finds merely probable, so the text can differ from "
            "greedy decoding",
        )
        group.add_argument(
            "--tree",
            help="medusa: 'chain' (the default): heads 1..K's top tokens as one chain of --num-draft drafts on the "
            "chain engine, adaptive unless --no-adaptive; or a candidate tree on the tree engine: a preset (default, "
            "chain-4, mc_sim_7b_63), a Medusa-format JSON file (list of paths), or 'auto' (best expected tokens/s "
            "from the heads' measured acceptance and this engine's measured verify cost). On CPUs the chain pays "
            "best: a tree engine's every call costs more (docs/benchmarks.md)",
        )
        add_drafting_flags(group)

    def add_train_flags(self, group: argparse._ArgumentGroup) -> None:
        from specgraph.methods.teacher import add_corpus_flags

        group.add_argument("--heads", type=int, default=4, help="medusa: number of heads (default 4)")
        group.add_argument(
            "--separate-lm-heads",
            action="store_true",
            help="medusa: give each head its own trainable copy of the LM head (Medusa-1; 28M parameters per head "
            "on the default model, and every step reads them)",
        )
        add_corpus_flags(group)

    def train(self, args: argparse.Namespace, progress: bool, command: str) -> dict[str, Any]:
        from specgraph.methods.medusa.train import EPOCHS, LR, train_medusa
        from specgraph.methods.teacher import Schedule, text_of

        schedule = Schedule(epochs=args.epochs or EPOCHS, lr=args.lr or LR, curve=args.curve)
        return train_medusa(args.model, args.output, args.heads, text_of(args), schedule,
                            separate_lm_heads=args.separate_lm_heads, threads=args.threads, progress=progress,
                            command=command, force=args.force)  # fmt: skip

    def stages(self, options: Any) -> list[str]:
        return ["measure tree"] if options.tree == "auto" else []

    def prepare(self, loaded: Any, anatomy: Any, cfg: Any) -> MedusaHeads:
        options: MedusaOptions = cfg.opts
        path = options.heads
        fingerprint = model_fingerprint(loaded)
        if path is None:
            shipped = SHIPPED_HEADS.get(fingerprint or "")
            if shipped is None:
                raise InputError(f"--method medusa needs --heads for {loaded.name}: train them with `specgraph train`")
            path = str(_HEADS_DIR / shipped)
        heads, meta = load_heads(path, anatomy.hidden_size, anatomy.vocab_size)
        if fingerprint and meta.get("fingerprint") not in (None, fingerprint):
            raise InputError(f"{Path(path).name} was trained for another model ({meta.get('model', '?')}), not "
                             f"{loaded.name}: its fingerprint differs; train heads for this model with `specgraph train`")  # fmt: skip
        if options.tree == "auto" and "acceptance" not in meta:
            raise InputError("--tree auto needs heads trained by `specgraph train` (they carry measured acceptance)")
        heads.vocab = draft_vocab.choose(options.draft_vocab, options.draft_vocab_file, DRAFT_VOCAB, fingerprint,
                                         anatomy.vocab_size, loaded.name)  # fmt: skip
        if options.chained and options.draft_count > heads.num_heads:
            auto = options.num_draft == "auto"
            asked = f"auto, which tries up to {options.auto_longest}" if auto else options.num_draft
            raise InputError(f"--num-draft {asked} drafts a round, but {Path(path).name} has {heads.num_heads} heads: "
                             "one draft per head")  # fmt: skip
        return heads

    def passes(self, options: Any) -> list[Any]:
        if options.chained:
            return [add_feature_output]  # the heads read the LM head's input at the last committed position
        # add_kv_compaction rewrites the cache writes that add_kv_cache_io inserted; add_medusa_heads
        # runs before fuse_projections so the heads' input is still the LM head's input.
        return [add_kv_compaction, add_medusa_heads]

    def build(self, gm: torch.fx.GraphModule, anatomy: Any, cfg: Any, drafter: Any, window: int | None) -> Built:
        heads: MedusaHeads = drafter
        weight = anatomy.lm_head.args[1]
        assert isinstance(weight, torch.fx.Node)
        if cfg.opts.chained:
            chain = MedusaChainEngine(gm, anatomy.num_layers, cfg.max_context, window, cfg.emit_logits,
                                      cfg.engine_samples, heads=heads, lm_head_weight=str(weight.target),
                                      num_draft=cfg.opts.draft_count, vocab_size=anatomy.vocab_size,
                                      adaptive=cfg.opts.gated, confidence=cfg.opts.draft_confidence)  # fmt: skip
            # the target's weights follow --weights; the heads' products are int8 blocks (in `finish`)
            return Built(chain, {"weights_skip": "draft_gm.", "heads_meta": heads.meta})
        typical = TYPICAL if cfg.opts.acceptance == "typical" else None
        engine = MedusaStepEngine(gm, anatomy.num_layers, cfg.max_context, heads.num_heads, window, cfg.emit_logits,
                                  typical, cfg.engine_samples, lm_head_weight=str(weight.target),
                                  heads_meta=heads.meta, vocab=heads.vocab)  # fmt: skip
        return Built(engine)

    def finish(self, staging: Path, cfg: Any, built: Built, measure: Measure) -> Finished:
        if cfg.opts.chained:
            return _finish_chain(staging, cfg, built, measure)
        engine = built.engine
        assert isinstance(engine, MedusaStepEngine)
        if cfg.opts.tree != "auto":
            return _write_tree(staging, cfg, engine, named_or_file(cfg.opts.tree))
        # auto: a one-node placeholder (it fits any number of heads) until the engine is measured
        placeholder = _write_tree(staging, cfg, engine, Tree.from_paths([(0,)]))
        timed = measure(placeholder)
        sizes = [n for n in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) if 128 + n <= cfg.max_context]
        ms = {n: time_call(timed, n, 128, repeats=5) for n in sizes}
        cost = {n: ms[n] / ms[1] for n in sizes}
        tree, report = build_tree(np.asarray(engine.heads_meta["acceptance"]), cost, max_nodes=max(sizes))
        report = {k: v for k, v in report.items() if k != "table"} | {"verify_cost": cost}
        return _write_tree(staging, cfg, engine, tree, report)


def _finish_chain(staging: Path, cfg: Any, built: Built, measure: Measure) -> Finished:
    """The chain engine's manifest section: heads 1..K, their products as int8 blocks (they only
    propose: this costs acceptance, never exactness), then `finish_drafts` (K auto, the gate)."""
    engine = built.engine
    assert isinstance(engine, MedusaChainEngine)
    meta = built.meta["heads_meta"]
    section: dict[str, Any] = {"tree": CHAIN, "num_draft": engine.num_draft, "accept_rule": "greedy",
                               "lossless": True, "heads": _heads_section(meta),
                               "weights": quantise_drafter(staging, HEAD_WEIGHTS_BITS, HEAD_BLOCK)}  # fmt: skip
    # what a round is expected to accept, for the gate's prior and --num-draft auto: each depth's
    # held-out rate where the drafts before it were right, per set (`train.py`); heads trained before
    # it carry only each head's unconditional top-1 rate, which stands in for it
    top1 = meta.get("top1")
    chain = meta.get("chain") or ({"held-out": [float(top1[0]), float(top1[min(1, len(top1) - 1)])]} if top1 else None)
    section["trained"] = {"acceptance": chain} if chain else {}
    summary = f"Medusa heads as a chain, {per_round(engine.num_draft)}"
    return finish_drafts(staging, engine, section, summary, cfg.opts, measure)


def _heads_section(meta: dict[str, Any]) -> dict[str, Any]:
    """What the manifest keeps of the heads file's header (either engine)."""
    keys = ("model", "top1", "top5", "acceptance", "chain", "expected_tokens", "train_tokens", "command")
    return {k: meta[k] for k in keys if k in meta}


def named_or_file(name: str) -> Tree:
    return load_tree(name) if Path(name).suffix == ".json" or Path(name).is_file() else named_tree(name)


def _write_tree(bundle: Path, cfg: Any, engine: MedusaStepEngine, tree: Tree,
                report: dict[str, Any] | None = None) -> Finished:  # fmt: skip
    """Write tree.json (Medusa's list-of-paths format, for people and `--tree FILE`), and return
    the manifest's medusa section with the tree as the engine's constant inputs."""
    meta = engine.heads_meta
    tree.validate_for(engine.num_heads, cfg.max_context)
    keep = engine.candidates_per_head
    if tree.max_topk > keep:
        raise InputError(f"tree uses rank {tree.max_topk - 1}, but the engine keeps the top {keep} tokens per head")
    (bundle / "tree.json").write_text(json.dumps({"paths": [list(p) for p in tree.paths]}) + "\n")
    section: dict[str, Any] = {"num_heads": engine.num_heads, "tree": "tree.json", "tree_size": tree.size,
                               "tree_depth": tree.depth, "tree_source": cfg.opts.tree,
                               "accept_rule": cfg.opts.acceptance,
                               "lossless": cfg.opts.acceptance == "greedy"}  # fmt: skip
    section["heads"] = _heads_section(meta)
    summary = f"{engine.num_heads} heads, tree {cfg.opts.tree} ({tree.size} nodes, depth {tree.depth})"
    if engine.vocab_ids is not None:
        section["draft_vocab"] = {**engine.vocab_info, "ids": [int(i) for i in engine.vocab_ids]}
        summary += f"; draft vocabulary {engine.vocab_info['size']} of {engine.vocab_info['of']} tokens"
    if report is not None:
        section["auto_tree"] = report
        summary += (
            f"; auto tree: expected {report['expected_tokens']:.2f} tokens/step at c(N)/c(1) {report['cost']:.2f}: "
            f"predicted {report['speedup']:.2f}x over this engine's 1-token step (the heads' readout adds to every "
            "step: `specgraph bench --reference` gives the speed-up over plain decoding)"
        )
    return Finished(section, tree_inputs(tree, engine.num_heads), tree.depth, {**section, "summary": summary})


def tree_inputs(tree: Tree, path_width: int) -> dict[str, np.ndarray]:
    """The candidate tree as the engine's constant inputs (tree_retrieve padded to the path width)."""
    retrieve = np.full((tree.retrieve.shape[0], path_width + 1), -1, np.int64)
    retrieve[:, : tree.retrieve.shape[1]] = tree.retrieve
    return {
        "tree_mask": np.ascontiguousarray(tree.ancestor_mask, dtype=bool),
        "tree_depths": tree.depths.astype(np.int64),
        "tree_parent": tree.parent.astype(np.int64),
        "tree_head": tree.head.astype(np.int64),
        "tree_rank": tree.rank.astype(np.int64),
        "tree_retrieve": retrieve,
    }


MEDUSA = MedusaMethod()
