"""`draft`: a separate draft model proposes K tokens autoregressively; the target verifies them
in the same engine call.

`--draft MODEL` is any model specgraph loads whose tokenizer matches the target's (same
vocabulary, same id for every string); `--draft self:int4` / `self:int8` is the target's own
copy with weight-only quantised matrices and int8 activations (`exporters/nbits.py`): it only
proposes, so the output is still exactly the target's.

One call = one round, all inside one ONNX graph:
  1. the target verifies `tokens` = [bonus, d_1..d_K] (`StepEngine`, the shared chain rule);
  2. the draft catches up: it runs [the committed tokens, then the bonus] at their positions (the
     same T + 1 slots as the target, so one shape serves prefill and steps), which rewrites its
     cache for everything committed and gives d'_1 from the bonus;
  3. K - 1 one-token draft steps give d'_2..d'_K.
The draft's cache (`draft_past_*`) is one more in-place buffer; rollback is not advancing, as for
the target: everything past the committed tokens is rewritten before it is read. The target's
own copy (`self:*`) has no cache: it reads the target's, where the verify has just written every
committed token, so its catch-up is the bonus alone, and its writes (the bonus's slot and the
steps') lie past the committed tokens, where the next call's verify writes before anything reads.

Greedy (temperature 0, and every call of a bundle compiled without sampling): the drafts are
the draft's argmax and the verifier keeps those equal to the target's argmax.

Sampling: d'_i is drawn from the draft's own q_i (its logits through the same temperature,
top-k and top-p as the target, `sampling.filtered`) by inverse CDF with draw 2 of its position's
uniforms, and the next call verifies it with the general rule (accept with min(1, p/q), else draw
from max(0, p - q); `sampling.speculative_draw`), which needs q_i(d_i) and the whole q_i. The
call hands q_1..q_K on as drafter state `draft_q` [B, K, V] float32 (`draft_q_out` feeds it):
the cheapest exact form. Recomputing q_i in the verifying call would rerun the draft on the K
drafts (the draft's cache holds keys and values, not logits); the raw logits are the same size
and would be filtered twice; a top-k sparse form is not exact when top-k is off. A row at
temperature 0 drafts the argmax and carries q_i = 0 (`sampling.propose`), and the rule gives it
the target's argmax whatever q says, so the same graph drafts and verifies greedily, token for
token as a bundle compiled without sampling, which carries no `draft_q` at all; a call whose
rows are all greedy computes no q and no p~ (the operators' ONNX forms skip them).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from specgraph import draft_vocab, sampling
from specgraph.errors import InputError
from specgraph.kernels import code_path
from specgraph.methods.base import NUM_DRAFT_HELP, Built, Finished, Measure, Method, Options, count_or_auto
from specgraph.step import StepEngine, attn_span, chain_masks, kv_names, leading_run
from specgraph.weights import check_blocks_fit, streamed_bytes

_I64 = torch.int64
SELF = {"self:int4": 4, "self:int8": 8}  # the target's own weight-quantised copy
_PREFIX = "draft_"  # the draft's module attribute, its cache names and its initializers start so
# `--adaptive`: per-row acceptance score, rounds without drafting, and rounds to wait before a probe
ADAPT_STATE = ("draft_score", "draft_idle", "draft_wait")
ADAPT_DECAY = 0.9  # weight of a row's past rounds in its score
PROBE_EVERY = 8  # rounds without drafting after which a row drafts one round again (a probe) ...
PROBE_MAX_WAIT = 64  # ... doubled after each probe that does not pay, up to this ...
# ... where the probe's loss (threshold - accepted, in plain steps) is more than this share of the
# rounds it waited: probes then cost at most about 2% of the time, however dear a round is
PROBE_BUDGET = 0.02
# self:int4 / self:int8 whose blocks are at least this share of the bytes a target step streams
# (a target already stored in blocks): compile says the drafting will seldom pay. At the default
# model's stored Q4_1 weights the int4 copy is 0.77 of them, and with one draft a round it ran
# 0.61-0.73x `none` drafting every round (docs/benchmarks.md)
DEAR_COPY = 0.5
AUTO_MAX_DRAFT = 4  # --num-draft auto: the longest round it considers (the first build's K); a method may say more
AUTO_PROMPTS = "chat"  # --num-draft auto: the prompt sets acceptance is measured on by default
AUTO_LIMIT, AUTO_TOKENS = 6, 96  # --num-draft auto: prompts per set, and new tokens per prompt
GATE_ROUNDS = 7  # interleaved rounds timing a drafting call against an idle one (the gate's threshold, auto)


@dataclass(frozen=True)
class DrafterOptions(Options):
    """The options of every method whose drafter is a network run K times (draft, eagle,
    early-exit): K or `auto`, and the run-time adaptation. Subclasses set `method` and may
    redeclare `num_draft` with their own default."""

    method: ClassVar[str] = ""
    auto_longest: ClassVar[int] = AUTO_MAX_DRAFT  # --num-draft auto: the longest round it considers
    # K: draft tokens per round, or "auto" (measured at compile time, `auto_draft`). One by default
    # for a learned drafter (eagle redeclares it; early-exit 3); `draft` four (DraftOptions); a
    # drafter far cheaper than the target may pay longer rounds, which `auto` measures
    num_draft: int | str = 1
    # draft only while it pays, per row (`ModelDrafts._adapt`); None: on, unless `draft_confidence`
    # chooses the drafts instead (`adapts`). On by default because a drafter that pays on one
    # machine or weight type loses on another: the shipped EAGLE drafter at the stored weights on a
    # Zen 4, where a second verified row costs 0.29 of a step, ran 0.88-0.92x `none` on three of
    # four prompt sets drafting every round and 0.96-0.99x adaptive (docs/benchmarks.md)
    adaptive: bool | None = None
    adaptive_threshold: float | None = None  # accepted drafts per round it must pay for; None: measured
    auto_prompts: str = AUTO_PROMPTS  # --num-draft auto: the prompt sets its acceptance is measured on
    # send a row's leading drafts while the product of the drafter's probabilities for them stays
    # at least this (`ModelDrafts._confident`); None: send all K
    draft_confidence: float | None = None
    # --num-draft auto, second build: what the first measured (not a flag; the manifest's `auto`)
    auto_report: dict[str, Any] | None = field(default=None, compare=False)

    def check(self) -> None:
        if self.num_draft == "auto":
            check_adaptive(self.adapts, self.adaptive_threshold, self.auto_longest)
        elif isinstance(self.num_draft, int) and not isinstance(self.num_draft, bool):
            check_adaptive(self.adapts, self.adaptive_threshold, self.num_draft)
            if not 1 <= self.num_draft <= 16:
                raise InputError(f"--num-draft must be between 1 and 16 or auto for --method {self.method}, "
                                 f"got {self.num_draft}")  # fmt: skip
        else:
            raise InputError(f"--num-draft must be a number from 1 to 16 or auto, got {self.num_draft!r}")
        if not self.auto_prompts.strip(" ,"):
            raise InputError("--auto-prompts needs at least one prompt set")
        if self.draft_confidence is not None:
            if not 0 < self.draft_confidence < 1:
                raise InputError(f"--draft-confidence must be between 0 and 1 (exclusive), got {self.draft_confidence}")
            if self.adaptive or self.num_draft == "auto":
                raise InputError("--draft-confidence cannot be combined with --adaptive or --num-draft auto: choose "
                                 "K and the confidence, or let the gate decide")  # fmt: skip
        if self.num_draft == "auto":  # before the first build, not after it
            from specgraph.bench import prompt_file

            for name in self.prompt_sets:
                prompt_file(name)

    @property
    def prompt_sets(self) -> list[str]:
        return [name.strip() for name in self.auto_prompts.split(",") if name.strip()]

    @property
    def draft_count(self) -> int:
        """K of the engine to build: `auto` first builds the longest it considers, and measures."""
        return self.auto_longest if self.num_draft == "auto" else int(self.num_draft)

    @property
    def adapts(self) -> bool:
        """Whether rows adapt their drafting at run time: `--adaptive`, or by default unless
        `--draft-confidence` decides how many drafts a row sends."""
        return self.adaptive is True or (self.adaptive is None and self.draft_confidence is None)

    @property
    def gated(self) -> bool:
        """Whether the engine has the adaptive gate (`auto` measures a round without drafts with it)."""
        return self.adapts or self.num_draft == "auto"

    def files(self) -> list[str | Path | None]:
        return [path for path in self.prompt_sets if path.endswith((".jsonl", ".jsonl.gz"))]


@dataclass(frozen=True)
class DraftOptions(DrafterOptions):
    method: ClassVar[str] = "draft"
    # four drafts a round with the adaptive gate: since the target's own copy reads the target's
    # cache (a one-token run a draft), four beat one on code, chat, creative and repeat prompts in
    # both runs that compared them at fp32 (1.21-1.58x against 1.11-1.34x in one), and `auto`
    # measures four best there (docs/benchmarks.md); where a round cannot pay (a copy of a target
    # stored in 4-bit blocks) the gate keeps rows from drafting at any K
    num_draft: int | str = 4
    # `--num-draft auto` tries up to six: the int4 copy on quads pays rounds of four and five (1.78x
    # and 1.83x on HumanEval at fp32); trying up to four on 48 calibration tokens a prompt, auto
    # chose 2 (1.64x), on 96 tokens and up to six it chose 4 (docs/benchmarks.md, draft models)
    auto_longest: ClassVar[int] = 6
    draft: str = "self:int4"  # a model path or alias, or self:int4 / self:int8
    # a mid model that checks the drafts and extends them by one before the target verifies:
    # self:int8 (or self:int4) beside a --draft of the other self copy (`DraftStepEngine._cascade`)
    cascade: str | None = None
    draft_block_size: int = 32  # self:int4 / self:int8: weights per block
    draft_vocab: int | None = None  # tokens the draft's readout scores; None or 0: all of them
    draft_vocab_file: str | None = None  # a token ranking (scripts/draft_vocab.py); default: the shipped one

    def check(self) -> None:
        super().check()
        if self.draft_block_size not in (16, 32, 64, 128, 256):
            raise InputError(f"--draft-block-size must be one of 16, 32, 64, 128, 256, got {self.draft_block_size}")
        if self.draft.startswith("self:") and self.draft not in SELF:
            raise InputError(f"--draft {self.draft!r}: the target's own copy is self:int4 or self:int8")
        from specgraph.default_model import DEFAULT_MODEL

        if self.draft not in SELF and self.draft != DEFAULT_MODEL and not Path(self.draft).expanduser().exists():
            raise InputError(f"--draft {self.draft}: no such file or folder (a draft is a model path, "
                             f"{DEFAULT_MODEL}, self:int4 or self:int8)")  # fmt: skip
        if self.cascade is not None:
            if self.cascade not in SELF or self.draft not in SELF or self.cascade == self.draft:
                raise InputError(f"--cascade {self.cascade} with --draft {self.draft}: a cascade is two of the "
                                 "target's own copies, e.g. --draft self:int4 --cascade self:int8")  # fmt: skip
            if self.num_draft == "auto" or self.draft_confidence is not None:
                raise InputError("--cascade takes a fixed --num-draft and the adaptive gate (not --num-draft auto "
                                 "or --draft-confidence)")  # fmt: skip
            if self.num_draft == 1:
                raise InputError("--cascade needs --num-draft 2 or more: the drafter makes K - 1 drafts, the mid "
                                 "model checks them and adds one")  # fmt: skip

    def files(self) -> list[str | Path | None]:
        files: list[str | Path | None] = [*super().files(), self.draft_vocab_file]
        return files + ([] if self.draft in SELF else [self.draft])


@dataclass
class Drafter:
    """The draft model, rewritten with its own cache I/O, and what the engine needs to know of it."""

    gm: torch.fx.GraphModule
    num_layers: int
    kv_shapes: list[tuple[int, ...]]
    window: int | None
    name: str
    vocab: tuple[torch.Tensor, dict[str, Any]] | None = None  # a reduced draft vocabulary: its ids, its report
    trained: dict[str, Any] | None = None  # what a trained drafter's file says of it (early-exit's adapter)
    heads: list[tuple[int, int, float]] = field(default_factory=list)  # (num_heads, kv_heads, scale) a layer
    # leading layers that are the target's own (early exit's first E): in a call that skips the
    # drafter, the target's keys and values of them fill its cache (exporters/gate.py)
    target_layers: int = 0
    # the target's own copy (self:int4/int8): it keeps no cache, it reads the target's keys and
    # values of the committed tokens and writes its drafts' into the target's slots past them
    reads_target_cache: bool = False
    # --cascade: the mid model (another self copy) that checks this drafter's drafts
    cascade: Drafter | None = None


class ModelDrafts(StepEngine):
    """A chain engine whose drafter is a network run K times inside the call (a draft model, an
    EAGLE layer): its cache is per-row state `draft_past_*` bound in place like the target's,
    each draft is its argmax or, with sampling, a draw from its own q, which rides along as
    `draft_q` for the general accept rule. Subclasses hold the network as `draft_gm`."""

    # the drafter's products run on other token counts than the target's, and its weights are
    # its own (exporters/gemm.py)
    drafter_weights: tuple[tuple[str, str], ...] = (("p_draft_gm_", "draft_gm."),)
    # True: the drafts are the drafter's argmax even when sampling, point masses that the one-hot
    # form of the rule verifies (no q carried, one uniform a position; Medusa's chain)
    point_masses = False
    # leading drafter layers whose cache the target's keys and values may fill (DraftStepEngine)
    target_layers = 0

    def __init__(self, *args: Any, num_draft: int, vocab_size: int, cache_shapes: list[tuple[int, ...]],
                 vocab: tuple[torch.Tensor, dict[str, Any]] | None, adaptive: bool = False,
                 confidence: float | None = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.vocab_size = vocab_size
        self.num_draft = num_draft  # drafts a round sends at most
        self.drafter_steps = num_draft  # drafts the drafter makes (a cascade's mid model adds one)
        self.draft_kv_shapes = cache_shapes
        self.draft_layers = len(cache_shapes) // 2
        # with sampling, q of the drafts rides along (see the module docstring)
        q = ("draft_q",) if self.draws else ()
        # adaptive: each row's acceptance score and rounds since it last drafted (`_adapt`)
        adapt = ADAPT_STATE if adaptive else ()
        self.adaptive = adaptive
        self.state_inputs = (*kv_names("draft_past", self.draft_layers), *q, *adapt)
        self.draft_outputs = (*kv_names("draft_present", self.draft_layers), *(f"{n}_out" for n in (*q, *adapt)))
        if adaptive:
            self.draft_outputs += ("n_draft",)
            self.trims = {"next_tokens": "n_draft"}  # bind next_tokens[:, :1 + max(n_draft)] only
            # accepted drafts per round below which drafting costs more than it returns (`finish` measures it)
            self.register_buffer("draft_threshold", torch.zeros(1))
            # what the prompt's round counts as accepting: K, or the drafter's trained acceptance (`finish`)
            self.register_buffer("draft_prior", torch.full((1,), float(num_draft)))
        # --draft-confidence: each row sends its drafts while their cumulative log-probability under
        # the drafter stays at least this (`_confident`); the drafter still runs all K steps
        self.confidence = confidence
        if confidence is not None:
            assert not adaptive, "the gate's count and the confidence count are one output"
            self.draft_outputs += ("n_draft",)
            self.trims = {"next_tokens": "n_draft"}
            self.register_buffer("draft_log_confidence", torch.tensor([math.log(confidence)]))
        # uniforms per position with sampling: 0 accept, 1 residual (or the plain draw), 2 the draft's draw
        self.uniform_streams = 3 if self.draws else 1
        # a reduced draft vocabulary (specgraph/draft_vocab.py): the drafter's logits index these ids
        self.vocab_ids: torch.Tensor | None
        self.register_buffer("vocab_ids", None if vocab is None else vocab[0].to(_I64).clone())
        self.vocab_info = {} if vocab is None else vocab[1]

    @property
    def extra_slots(self) -> int:  # type: ignore[override]
        """The drafter writes its K - 1 steps past the bonus: keep room for them in the cache."""
        return self.num_draft

    def example_state(self, batch: int) -> list[torch.Tensor]:
        q = [torch.zeros(batch, self.num_draft, self.vocab_size)] if self.draws else []
        adapt = (
            [torch.zeros(batch), torch.zeros(batch, dtype=_I64), torch.zeros(batch, dtype=_I64)]
            if self.adaptive
            else []
        )
        return [*(torch.zeros(batch, *shape) for shape in self.draft_kv_shapes), *q, *adapt]

    @property
    def draws(self) -> bool:
        """Whether the drafts are draws from the drafter's q (sampling engines, unless `point_masses`)."""
        return self.sampling and not self.point_masses

    def proposal(self, state):  # type: ignore[no-untyped-def]
        return state[2 * self.draft_layers] if self.draws else None  # draft_q [B, K, V]

    def _outputs(self, state, tokens, cache_len, cache_len_out, bonus, drafts, kv, qs, logps):  # type: ignore[no-untyped-def]
        """`draft`'s result: next_tokens [B, 1+K] and the drafter's state (its caches, q with
        sampling, and with `adaptive` the acceptance state and each row's draft count, or with
        `confidence` each row's count of confident drafts). logps: each draft's log-probability
        under the drafter ([B, 1] each), or Nones without `confidence`."""
        carried = [torch.cat(qs, dim=1)] if self.draws else []  # draft_q_out [B, K, V]
        adapt = self._adapt(state, tokens, cache_len, cache_len_out) if self.adaptive else []
        if self.confidence is not None:
            adapt = [self._confident(torch.cat(logps, dim=1))]
        return torch.cat([bonus, *drafts], dim=1), [*kv, *carried, *adapt]

    def _chain(self, first, carry, step, params):  # type: ignore[no-untyped-def]
        """Drafts d'_1..d'_K: `first` is d'_1's (d, q, logp) ([B, 1], [B, 1, V] or None, [B, 1] or
        None), and `step(i, d, carry, params)` runs the drafter on d'_i and returns d'_{i+1}'s
        (d, q, logp) and the new carry, whose first item is the drafter's caches. Returns the
        drafts, their q and log-probabilities (lists of [B, n] pieces, as `_outputs` takes them)
        and the caches as `carry` holds them: the catch-up's. What the steps write past the bonus
        is scratch: no later call reads a slot before its own catch-up or steps write it, so the
        drafter's state stays bound in place through the catch-up and the steps never pick it.
        With `confidence`, the steps after draft i are marked (`specgraph::draft_stop`) to run only
        while some row's joint drafter probability of drafts 1..i is still at least the confidence:
        `_confident` sends no draft past that point, so where no row is there, what they would
        compute is never read. The export then skips them (exporters/draft_stop.py: Kangaroo's
        early exit of the draft loop); stopping leaves padding and drafts of probability 0."""
        drafts, qs, logps = self._steps(1, first, carry, step, params, None)
        return drafts, qs, logps, carry[0]

    def _steps(self, i, drafted, carry, step, params, reach):  # type: ignore[no-untyped-def]
        """`_chain`'s drafts i..K from draft i (`drafted`, `carry` as it left the drafter).
        reach: [B, 1] the summed log-probabilities of drafts 1..i-1 (None for i = 1)."""
        d, q, logp = drafted
        if i == self.drafter_steps:
            return [d], [q], [logp]
        nxt, later = step(i, d, carry, params)
        reach = logp if reach is None else (None if logp is None else reach + logp)
        ds, qs, logps = self._steps(i + 1, nxt, later, step, params, reach)
        if self.confidence is None:
            return [d, *ds], [q, *qs], [logp, *logps]
        go = torch.ops.specgraph.draft_stop((reach >= self.get_buffer("draft_log_confidence")).any(), i)
        # what stopping leaves is shaped from draft i's values, so computing it needs no later step
        n = self.drafter_steps - i
        tail = torch.where(go, torch.cat(ds, dim=1), torch.zeros_like(d).expand(-1, n))  # [B, K - i]
        lp = torch.where(go, torch.cat(logps, dim=1), torch.full_like(logp, float("-inf")).expand(-1, n))
        later_q = None if q is None else torch.where(go, torch.cat(qs, dim=1), torch.zeros_like(q).expand(-1, n, -1))
        return [d, tail], [q, later_q], [logp, lp]

    def _confident(self, logps: torch.Tensor) -> torch.Tensor:
        """[B] drafts to send: the leading ones whose joint probability under the drafter,
        exp(cumsum of their log-probabilities [B, K]), is at least the confidence (EAGLE-2 ranks
        a tree's nodes by the same product; Kangaroo stops drafting on it). The drafter's
        probability of its own token is calibrated against acceptance (docs/benchmarks.md), so
        the drafts cut are the ones least likely to be accepted. Lossless either way: the count
        only decides how many drafts the next call verifies."""
        reach = torch.cumsum(logps, dim=1) >= self.get_buffer("draft_log_confidence")  # [B, K], true then false
        return reach.to(_I64).sum(dim=1)

    def _adapt(self, state, tokens, cache_len, cache_len_out):  # type: ignore[no-untyped-def]
        """Run-time draft length: K or 0 per row, from the row's own recent acceptance. A round
        that verified drafts moves the row's score towards (accepted drafts - threshold); a row
        drafts next round while its score is >= 0; a row that stopped tries one round again (a
        probe) after `wait` rounds without drafting: PROBE_EVERY, doubled (up to PROBE_MAX_WAIT)
        after each probe whose loss (the threshold, which is a drafting round's extra cost in
        steps, less the drafts it accepted) is more than PROBE_BUDGET of the `wait` rounds before
        it, and PROBE_EVERY again after one that paid or once the score is back at 0 or above;
        never where the threshold is above K, as no round could pay then.
        So text that never pays spends at most about 2% of its rounds on probes: a probe that
        loses 0.38 steps (Medusa's chain at the stored weights) waits 32 rounds, one that loses
        0.7 (EAGLE there) 64; where a probe is cheap (an fp32 target: 0.11-0.16) rows that only
        dip below 0 come back after 8. The exported engine skips the drafter entirely when no row drafts
        (exporters/gate.py), so an idle round costs about a plain step (within 1% for EAGLE and
        Medusa's chain at the stored weights and for a self-draft, which keeps no cache of its
        own; docs/benchmarks.md). Lossless either way: the count only decides how many drafts the
        next call verifies."""
        score, idle, wait = state[-3], state[-2], state[-1]  # [B] float, [B] int64, [B] int64 (0: PROBE_EVERY)
        wait = torch.clamp(wait, min=PROBE_EVERY)
        # this call verified drafts (a prompt counts as a round that accepted `draft_prior` drafts:
        # K, or what the drafter accepted in training); a tensor, so the export keeps the token count dynamic
        drafted = torch.ones_like(tokens).sum(dim=1) > 1  # [B]
        probe = drafted & (score < 0)  # a round drafted by a row that had stopped
        accepted = torch.clamp(cache_len_out - cache_len - 1, max=self.num_draft).to(score.dtype)  # [B]
        accepted = torch.where(cache_len == 0, self.draft_prior, accepted)
        moved = ADAPT_DECAY * score + (1 - ADAPT_DECAY) * (accepted - self.draft_threshold)
        score = torch.where(drafted, moved, score)
        idle = torch.where(drafted, torch.zeros_like(idle), idle + 1)
        paid = accepted >= self.draft_threshold
        dear = self.draft_threshold - accepted > PROBE_BUDGET * wait.to(score.dtype)
        longer = torch.where(probe & dear, torch.clamp(2 * wait, max=PROBE_MAX_WAIT), wait)
        wait = torch.where((score >= 0) | (probe & paid), torch.full_like(wait, PROBE_EVERY), longer)
        # a round that would not pay even with every draft accepted (a measured threshold above
        # K: a dear drafter on a cheap target) is never worth a probe; compared per row, so the
        # export cannot fold it with the threshold's placeholder value (`finish` sets it later)
        can_pay = torch.full_like(score, float(self.num_draft)) >= self.draft_threshold  # [B]
        wants = (score >= 0) | ((idle >= wait) & can_pay)  # [B]
        n_draft = torch.where(wants, self.num_draft, 0).to(_I64)
        return [score, idle, wait, n_draft]

    def _propose(self, logits, at, params):  # type: ignore[no-untyped-def]
        """The draft token at positions `at` [B, 1] from the drafter's logits [B, 1, V], its q
        and, with `confidence`, its log-probability [B, 1] under the drafter's unfiltered logits
        (else None): the argmax (q unused) without sampling or with `point_masses`, else d ~ q by inverse CDF with draw
        2 of `at`."""
        if not self.draws:
            index = logits.argmax(dim=-1)
            return self._token(index), None, self._log_prob(logits, index)
        u = sampling.position_uniforms(params[3], sampling.stream(at, 2, self.uniform_streams))  # [B, 1]
        index, q = torch.ops.specgraph.propose(logits, *params[:3], u)  # [B, 1], [B, 1, V]; q = 0 if greedy
        d = self._token(index)
        if self.vocab_ids is not None:  # q over the draft vocabulary -> over the target's (0 elsewhere)
            b, v_d = q.shape[0], q.shape[-1]
            q = q.new_zeros(b, 1, self.vocab_size).scatter(2, self.vocab_ids[None, None, :].expand(b, 1, v_d), q)
        return d, q, self._log_prob(logits, index)

    def _log_prob(self, logits, index):  # type: ignore[no-untyped-def]
        """log softmax(logits [B, 1, V]) at index [B, 1] -> [B, 1]; None without `confidence`."""
        if self.confidence is None:
            return None
        return torch.log_softmax(logits, dim=-1).gather(2, index[..., None])[..., 0]

    def _token(self, index):  # type: ignore[no-untyped-def]
        """A draft-vocabulary index as the token id (the identity without a reduced vocabulary)."""
        return index if self.vocab_ids is None else self.vocab_ids[index]


class DraftStepEngine(ModelDrafts):
    """The chain engine whose drafter is a model of its own, run K times inside the call."""

    def __init__(self, *args: Any, drafter: Drafter, **kwargs: Any) -> None:
        shared = drafter.reads_target_cache
        # a cascade's drafts are argmaxes, point masses that the one-hot rule verifies when sampling
        self.point_masses = drafter.cascade is not None
        super().__init__(*args, cache_shapes=[] if shared else drafter.kv_shapes, vocab=drafter.vocab, **kwargs)
        self.draft_gm = drafter.gm  # registered as a submodule: its weights are draft_gm.*
        self.draft_window = drafter.window
        self.draft_heads = drafter.heads  # lets the export fuse the draft's cached attention too
        self.target_layers = drafter.target_layers
        self.reads_target_cache = shared
        self.cascade = drafter.cascade is not None
        if drafter.cascade is not None:  # `_cascade`: the drafter makes K - 1 drafts, the mid model one more
            assert shared and drafter.cascade.reads_target_cache, "a cascade is two of the target's own copies"
            assert self.confidence is None, "a cascade sends its drafts by its own count"
            self.cascade_gm = drafter.cascade.gm  # its weights are cascade_gm.*
            self.drafter_weights = (*self.drafter_weights, ("p_cascade_gm_", "cascade_gm."))
            self.drafter_steps = self.num_draft - 1
            # each row's checked drafts (the gate's n_draft, when there is one, says only whether it drafts)
            self.draft_outputs += ("n_sent",)
            self.trims = {"next_tokens": "n_sent"}

    def draft(self, state, tokens, cache_len, bonus, cache_len_out, params, *target_kv):  # type: ignore[no-untyped-def]
        """See the module docstring; a drafter that `reads_target_cache` (`target_kv`: the target's
        caches after this call's verify) has every committed token's keys and values there, so its
        catch-up is the bonus alone, written at the bonus's slot, where the next call's verify
        writes before anything reads it (as it does the slots the steps write after it)."""
        if self.reads_target_cache:
            at = cache_len_out[:, None]  # [B, 1] the bonus's position
            logits, kv = self._run(bonus, at, cache_len_out, list(target_kv))  # [B, 1, V]
            first = self._propose(logits, at + 1, params)
        else:
            b, t = tokens.shape
            committed = cache_len_out - cache_len  # [B] tokens of this call now in the target's cache
            idx = torch.arange(t + 1, dtype=_I64)[None, :]  # [1, T+1]
            padded = torch.cat([tokens, bonus], dim=1)  # [B, T+1]
            seq = torch.where(idx == committed[:, None], bonus, padded)  # committed tokens, then the bonus
            kv = list(state[: 2 * self.draft_layers])
            # catch-up: every committed token and the bonus; the logits at the bonus propose d'_1
            logits, kv = self._run(seq, cache_len[:, None] + idx, cache_len, kv)  # [B, T+1, V]
            last = logits.gather(1, committed[:, None, None].expand(b, 1, logits.shape[-1]))  # [B, 1, V]
            first = self._propose(last, cache_len_out[:, None] + 1, params)

        last = [kv]  # the caches as the latest run left them (a cascade's mid model runs after it)

        def step(i, d, carry, params):  # type: ignore[no-untyped-def]
            pos = cache_len_out[:, None] + i  # [B, 1] where d'_i goes
            logits, kv = self._run(d, pos, pos[:, 0], carry[0])
            last[0] = kv
            return self._propose(logits, pos + 1, params), (kv,)

        drafts, qs, logps, kv = self._chain(first, (kv,), step, params)
        own = [] if self.reads_target_cache else kv  # the target's caches are its outputs already
        if not self.cascade:
            return self._outputs(state, tokens, cache_len, cache_len_out, bonus, drafts, own, qs, logps)
        # after the drafter's last run: each cache stays one chain of runs (exporters/gqa.py fuses only those)
        checked, sent = self._cascade(bonus, drafts, cache_len_out, last[0])
        next_tokens, extra = self._outputs(state, tokens, cache_len, cache_len_out, bonus, [checked], [], [], [])
        if self.adaptive:  # the gate's count says whether a row drafts, the mid model's how many it sends
            sent = torch.where(extra[-1] > 0, sent, torch.zeros_like(sent))
        return next_tokens, [*extra, sent]

    def _cascade(self, bonus, drafts, at, kv):  # type: ignore[no-untyped-def]
        """`--cascade`: the mid model (`cascade_gm`, another of the target's own copies) runs once
        on [bonus, d_1..d_{K-1}], the drafter's drafts, at their positions from `at` [B] (writing
        its own keys and values over the drafter's in the target's cache slots past the committed
        tokens, scratch as the drafter's were), and its argmax after each, e_1..e_K, are the
        drafts sent: e_1..e_{j+1} where the drafter's first j drafts equal the mid model's, each
        the mid model's greedy token after the one before (the drafter's draft j+1, where it
        differs, is replaced by the mid model's, and where all agree e_K extends the chain). A
        row sends those j + 1 (`n_sent`); the ones after lie on a draft the mid model rejected.
        Every draft is an argmax, a point mass, even when sampling: lossless as any chain of them
        is (the target keeps the prefix equal to its own argmax, or with sampling to its own
        draws, the one-hot form of the rule). Returns the drafts [B, K] and n_sent [B]."""
        seq = torch.cat([bonus, *drafts], dim=1)  # [B, K]
        positions = at[:, None] + torch.arange(seq.shape[1], dtype=_I64)[None, :]
        logits, _ = self._run(seq, positions, at, kv, self.cascade_gm)  # [B, K, V]
        checked = logits.argmax(dim=-1)  # [B, K]
        agree = seq[:, 1:] == checked[:, :-1]  # [B, K - 1]: draft i equals the mid model's token there
        return checked, leading_run(agree) + 1  # [B] j + 1

    def _run(self, tokens, positions, write_at, kv, gm=None):  # type: ignore[no-untyped-def]
        """One draft forward of tokens [B, W] at positions [B, W] (consecutive from write_at [B])
        by the drafter, or by `gm` (a cascade's mid model)."""
        s = kv[1].shape[-2]
        masks = chain_masks(positions, s, self.draft_window)
        span = attn_span(positions.max() + 1, s)
        logits, *present = (self.draft_gm if gm is None else gm)(tokens, positions, *masks, write_at, span, *kv)
        return logits, present


class DraftMethod(Method):
    name = "draft"
    summary = "a draft model (another model with the same tokenizer, or self:int4 / self:int8) proposes K tokens"
    needs: ClassVar[str | None] = "--draft MODEL"
    options_type: ClassVar[type[Options]] = DraftOptions  # annotated as the base's: early-exit subclasses it

    def add_flags(self, group: Any) -> None:
        group.add_argument(
            "--draft",
            help="draft: the draft model (a path or alias whose tokenizer matches the target's), or self:int4 / "
            "self:int8, the target's own weight-quantised copy (default self:int4); a matrix the model file stores "
            "in blocks of at most that width keeps them (a GGUF's Q4_1 in either, its Q8_0 in self:int8: on the "
            "default model self:int8 ran 2.15x an fp32 none, self:int4 1.7-2.0x; docs/benchmarks.md)",
        )
        group.add_argument(
            "--draft-block-size", type=int, help="draft: weights per block for self:int4 / self:int8 (default 32)"
        )
        group.add_argument(
            "--cascade", metavar="self:int8",
            help="draft: a cascade. The --draft copy makes K - 1 drafts, the target's other own copy "
            "(e.g. --draft self:int4 --cascade self:int8) checks them in one run and sends the target the prefix it "
            "agrees with plus its own next token, at most K; the drafts are argmaxes, point masses when sampling. On a "
            "2-core Xeon at fp32 it ran 1.03-1.07x the plain draft on chat and creative text, 0.94-0.97x on code, "
            "where the int4 copy was requantised; 0.88-0.90x everywhere beside the default model's stored blocks "
            "(docs/benchmarks.md)",
        )  # fmt: skip
        add_drafting_flags(group)

    def prepare(self, loaded: Any, anatomy: Any, cfg: Any) -> Drafter:
        from specgraph.loaders import load_model

        opts: DraftOptions = cfg.opts
        if opts.draft in SELF:  # every matrix of the copy in blocks, or none: no silent float32 leftovers
            check_blocks_fit(loaded, f"int{SELF[opts.draft]}", opts.draft_block_size, flag="--draft-block-size")
        source = loaded if opts.draft in SELF else load_model(opts.draft)
        if source is not loaded:
            check_same_tokenizer(loaded, source)
        drafter = model_drafter(source, loaded, anatomy, cfg, opts.draft, default_vocab=0)
        if source is loaded:  # the target's own copy: the target's keys and values stand in for its own
            drafter.reads_target_cache = True
        if opts.cascade is not None:
            check_blocks_fit(loaded, f"int{SELF[opts.cascade]}", opts.draft_block_size, flag="--draft-block-size")
            mid = model_drafter(loaded, loaded, anatomy, cfg, opts.cascade, default_vocab=0, reduce=False)
            mid.reads_target_cache = True
            drafter.cascade = mid
        return drafter

    def build(self, gm: torch.fx.GraphModule, anatomy: Any, cfg: Any, drafter: Any, window: int | None) -> Built:
        return build_draft_engine(gm, anatomy, cfg, drafter, window)

    def finish(self, staging: Path, cfg: Any, built: Built, measure: Measure) -> Finished:
        opts: DraftOptions = cfg.opts
        engine = built.engine
        assert isinstance(engine, DraftStepEngine)
        section: dict[str, Any] = {"draft": opts.draft, "num_draft": engine.num_draft, "weights": "float32"}
        bits = SELF.get(opts.draft)
        summary = f"draft {opts.draft}, {per_round(engine.num_draft)}"
        index = stored_index(cfg.model) if bits is not None else None  # one index for the copy and a cascade's
        if bits is not None:
            section["weights"], section["bytes_share"] = _quantise_copy(staging, index, built, opts, bits, "draft_gm.")
            if section["bytes_share"] >= DEAR_COPY:
                summary += (f"; the copy reads {section['bytes_share']:.2f} of the bytes a step reads, so a draft costs "
                            "most of a plain step and drafting seldom pays (the copy is for a float32 target: "
                            "--weights fp32)")  # fmt: skip
        if opts.cascade is not None:
            weights, share = _quantise_copy(staging, index, built, opts, SELF[opts.cascade], "cascade_gm.", mid=True)
            section["cascade"] = {"draft": opts.cascade, "drafter_steps": engine.drafter_steps, "weights": weights,
                                  "bytes_share": share}  # fmt: skip
            summary += (f" ({engine.drafter_steps} by {opts.draft}, checked and extended by {opts.cascade} in one "
                        "run)")  # fmt: skip
        return finish_drafts(staging, engine, section, summary, opts, measure)


def _quantise_copy(staging: Path, index: Any, built: Built, opts: DraftOptions, bits: int, prefix: str,
                   mid: bool = False) -> tuple[dict[str, Any], float]:  # fmt: skip
    """Quantise the staged engine's copy of the target whose weights start with `prefix` (the
    drafter's, or with `mid` a cascade's mid model's) to `bits`, on the quads where the library
    runs them; returns the manifest's description and the share of a target step's bytes a run of
    it reads. A matrix `index` (`stored_index`) holds in blocks of at most `bits` bits keeps those
    blocks (`stored_blocks`)."""
    native = built.meta.get("kernels") == "native"
    # at int8 activations on the library: one-digit codes (int4, or a stored Q4_1 in the int8 copy) in
    # quads, two-digit ones in pairs
    quads = opts.draft_block_size == 32 and native and code_path() == "avx512-vnni"
    # a cascade's mid model runs K tokens at once: on the library's products at int8 activations
    # a K = 5 round cost 2.97 plain fp32 steps on a Xeon, 3.08 at float32 activations (wide lanes)
    # and 3.47 on ONNX Runtime's 8-bit product (docs/benchmarks.md, cascade)
    rows = native and mid
    copy = quantise_drafter(staging, bits, opts.draft_block_size, native=rows, quads=quads, prefix=prefix, int8=rows,
                            stored=stored_blocks(index, bits, opts.draft_block_size))  # fmt: skip
    streamed = copy["block_bytes"] - copy.get("quads_gather_bytes", 0)
    share = streamed / step_bytes(built.meta.get("weights", {}), copy["float32_bytes"])
    return copy, round(share, 3)


def stored_index(model: str) -> Any:
    """The blocks the model file stores (`blocks.RowIndex` of a GGUF's quantised matrices), or
    None for a model with none (a float file, an HF folder)."""
    from specgraph import blocks
    from specgraph.weights import gguf_file

    gguf = gguf_file(model)
    return blocks.gguf_index(str(gguf)) if gguf is not None else None


def stored_blocks(index: Any, bits: int, block_size: int) -> Callable[[np.ndarray], list[Any] | None]:
    """`W`'s own blocks where `index` (`stored_index`) holds it in blocks of `block_size` and at
    most `bits` bits (the target's float32 weights are then those blocks dequantised), else None.
    A copy of the target that requantised such a weight would round already rounded values onto
    another grid: on the default Q4_1 model that cost the int4 copy τ 4.86 -> 4.15 at K = 5 on
    HumanEval, and the int4 copy's requantised Q8_0 table still costs it most of what it gets
    wrong, which the int8 copy keeps (docs/benchmarks.md, draft models)."""

    def own(w: np.ndarray) -> list[Any] | None:
        runs = index.match(w) if index is not None else None
        return runs if runs and all(r.bits <= bits and r.block == block_size for r in runs) else None

    return own


def step_bytes(weights: dict[str, Any], float32_bytes: int) -> int:
    """The weight bytes a one-token step of the target streams, from its manifest `weights`
    section: what a call reads of its stored blocks, or `float32_bytes`, its matrices in float32
    (a float32 target's section records no size)."""
    stored = weights.get("block_bytes")
    return max(streamed_bytes(stored, weights) if stored else int(float32_bytes), 1)


def model_drafter(source: Any, loaded: Any, anatomy: Any, cfg: Any, name: str, default_vocab: int,
                  reduce: bool = True) -> Drafter:  # fmt: skip
    """The draft model `source` (a LoadedModel) captured and rewritten with its own cache I/O
    for a DraftStepEngine of the target `loaded`; with `reduce`, its readout reduced to the draft
    vocabulary that `cfg.opts` (`draft_vocab`, `draft_vocab_file`) and `default_vocab` choose."""
    from specgraph.anatomy import analyze
    from specgraph.capture import capture
    from specgraph.compiler import passes_for
    from specgraph.loaders import model_fingerprint
    from specgraph.methods.none import NONE
    from specgraph.passes import PassContext

    # a copy: the target's capture shares the HF model's tensors, and the draft's are its own
    gm = copy.deepcopy(capture(source, cfg.max_context))
    draft_anatomy = analyze(gm, source.hf_config)
    if draft_anatomy.vocab_size != anatomy.vocab_size:
        raise InputError(f"draft {name} scores {draft_anatomy.vocab_size} tokens, the target "
                         f"{anatomy.vocab_size}: a draft must share the target's vocabulary")  # fmt: skip
    ctx = PassContext(draft_anatomy, cfg.max_context)
    for pass_fn in passes_for(NONE, NONE.options_type()):
        pass_fn(gm, ctx)
    shapes: list[tuple[int, ...]] = []
    for site in draft_anatomy.sites:
        shapes += [(site.num_kv_heads, site.head_dim, cfg.max_context),
                   (site.num_kv_heads, cfg.max_context, site.head_dim)]  # fmt: skip
    windows = {site.sliding_window for site in draft_anatomy.sites if site.sliding_window}
    vocab = None
    if reduce:
        vocab = draft_vocab.choose(cfg.opts.draft_vocab, cfg.opts.draft_vocab_file, default_vocab,
                                   model_fingerprint(loaded), anatomy.vocab_size, loaded.name)  # fmt: skip
    if vocab is not None:
        _reduce_readout(gm, draft_anatomy.lm_head, vocab[0])
    heads = [(site.num_heads, site.num_kv_heads, site.scale) for site in draft_anatomy.sites]
    return Drafter(gm, draft_anatomy.num_layers, shapes, windows.pop() if windows else None, name, vocab, heads=heads)


def build_draft_engine(gm: torch.fx.GraphModule, anatomy: Any, cfg: Any, drafter: Drafter, window: int | None) -> Built:
    """The DraftStepEngine around the target graph `gm`, with `cfg.opts`' `num_draft` and `adaptive`."""
    engine = DraftStepEngine(gm, anatomy.num_layers, cfg.max_context, window, cfg.emit_logits,
                             cfg.engine_samples, drafter=drafter, num_draft=cfg.opts.draft_count,
                             vocab_size=anatomy.vocab_size, adaptive=cfg.opts.gated,
                             confidence=cfg.opts.draft_confidence)  # fmt: skip
    # the target's weights follow --weights; a draft model's are its own (quantised in `finish`),
    # but a drafter with the target's own layers (early exit's 1..E) follows --weights too: the
    # blocks a GGUF stores match those layers and the readout's rows by value, so the bundle holds
    # them as blocks (a copy of the target's), never as floats; the adapter's match nothing
    skip = None if drafter.target_layers else ("draft_gm.", "cascade_gm.")
    return Built(engine, {"weights_skip": skip, "trained": drafter.trained})


def shipped_file(given: str | None, shipped: dict[str, str], fingerprint: str | None, missing: str) -> str:
    """The drafter file to load: `given`, else the one shipped for the model with this
    fingerprint (`specgraph/data/heads/`), else InputError(`missing`)."""
    if given is not None:
        return given
    name = shipped.get(fingerprint or "")
    if name is None:
        raise InputError(missing)
    return str(Path(__file__).resolve().parents[1] / "data" / "heads" / name)


def per_round(k: int) -> str:
    return f"{k} draft{'s' if k > 1 else ''} per round"


def finish_drafts(staging: Path, engine: ModelDrafts, section: dict[str, Any], summary: str,
                  opts: DrafterOptions, measure: Measure) -> Finished:  # fmt: skip
    """The end of a ModelDrafts method's `finish`: the reduced vocabulary's id map; with
    `--num-draft auto` the measured choice of K (the first build only measures: `auto_draft`);
    with `--adaptive`, the gated drafter and its threshold; all added to the manifest section
    and the summary."""
    if engine.vocab_ids is not None:
        section["draft_vocab"] = {**engine.vocab_info, "ids": [int(i) for i in engine.vocab_ids]}
        summary += f", draft vocabulary {engine.vocab_info['size']} of {engine.vocab_info['of']} tokens"
    if opts.num_draft == "auto":
        return auto_draft(staging, engine, section, opts, measure)
    if opts.auto_report is not None:
        section["auto"] = opts.auto_report
        summary += f" (--num-draft auto: {opts.auto_report['predicted_speedup']:.2f}x `none` predicted)"
        if opts.auto_report["predicted_speedup"] < 1:
            summary += "; drafting does not pay at any K on these prompts here"
    if engine.confidence is not None:
        from specgraph.exporters.draft_stop import stop_drafting_early

        section["confidence"] = engine.confidence
        # the steps after each draft run only while some row may still send their drafts
        section["stop_nodes"] = stop_drafting_early(staging / "model.onnx")
        summary += (f", sending the drafts whose joint drafter probability is {engine.confidence:g}+ and "
                    "drafting no further once no row's is")  # fmt: skip
    if engine.adaptive:
        placeholder = Finished(section, draft_depth=engine.num_draft)
        prior = trained_accepted(section.get("trained", {}).get("acceptance"), engine.num_draft)
        section["adaptive"] = finish_adaptive(staging, engine, placeholder, measure, opts.adaptive_threshold, prior)
        adaptive = section["adaptive"]
        summary += f", adaptive (drafts while a round accepts {adaptive['threshold']:.2f}+ drafts)"
        if adaptive["threshold"] > engine.num_draft:
            summary += (f"; a drafting round costs {1 + adaptive['threshold']:.2f} plain steps and returns at most "
                        f"{engine.num_draft + 1} tokens, so drafting cannot pay here: rows never draft after the "
                        "prompt (--method none decodes the same text without the gate's cost)")  # fmt: skip
        elif adaptive["prior"] < adaptive["threshold"]:
            why = (f"the drafter accepted {adaptive['prior']:.2f} drafts a round in training" if prior is not None
                   else f"a drafting round costs {1 + adaptive['threshold']:.2f} plain steps and returns at most "
                   f"{engine.num_draft + 1} tokens")  # fmt: skip
            summary += f"; {why}, so drafting is not expected to pay here: rows start stopped and probe"
    return Finished(section, draft_depth=engine.num_draft, report={**section, "summary": summary})


def auto_draft(staging: Path, engine: ModelDrafts, section: dict[str, Any], opts: DrafterOptions,
               measure: Measure) -> Finished:  # fmt: skip
    """`--num-draft auto`, the first build (K = the method's `auto_longest`, gated, its threshold 0 so every
    row drafts every round): generate `opts.auto_prompts` greedily for the acceptance by depth,
    time a call verifying n = 1..K+1 tokens with the drafter and one without it, and ask the
    compiler to build again with the K that `choose_draft_count` predicts fastest."""
    from specgraph.bench import acceptance_by_depth, prompt_ids

    placeholder = Finished(section, draft_depth=engine.num_draft)
    _gate(staging, engine)  # the measuring build: its threshold 0 keeps every row drafting
    live = measure(placeholder)
    counts: list[int] = []
    for name in opts.prompt_sets:
        for ids in prompt_ids(name, AUTO_LIMIT, live, chat=True):
            counts += live.generate(ids, AUTO_TOKENS).accepted_per_step
    k = engine.num_draft
    rounds, idle = _time_gated(live, engine, range(1, k + 2))
    report = choose_draft_count(acceptance_by_depth(counts, k), rounds, idle, k)
    report.update(prompts=opts.auto_prompts, rounds=len(counts))
    rebuild = dataclasses.replace(opts, num_draft=report["chosen"], auto_report=report)
    rebuild.check()  # e.g. an --adaptive-threshold above the K chosen, refused before the second build
    return Finished(section, draft_depth=engine.num_draft, rebuild=rebuild)


def choose_draft_count(acceptance: list[float], rounds: dict[int, float], idle: float, longest: int) -> dict[str, Any]:
    """The K in 1..longest with the highest predicted speed-up over plain decoding.

    acceptance: the rate at each depth given the one before (measured at K = longest);
    rounds: seconds of a call verifying n tokens (n = 1..longest+1) with all `longest` draft
    runs; idle: seconds of a call without the drafter (a plain step). A draft run costs
    (rounds[1] - idle) / longest, so a K-draft round costs rounds[K+1] less the longest - K runs
    it would not make, and returns tau(K) = 1 + a_1 + a_1 a_2 + ... + a_1..a_K tokens:
    speed-up(K) = tau(K) * idle / round(K)."""
    per_run = max(rounds[1] - idle, 0.0) / longest
    table = []
    for k in range(1, longest + 1):
        reach, tau = 1.0, 1.0
        for rate in acceptance[:k]:
            reach *= rate
            tau += reach
        cost = rounds[k + 1] - (longest - k) * per_run
        table.append({"k": k, "tau": round(tau, 4), "round_ms": round(cost * 1e3, 3),
                      "speedup": round(tau * idle / cost, 4)})  # fmt: skip
    best = max(table, key=lambda row: row["speedup"])
    return {"chosen": best["k"], "predicted_speedup": best["speedup"], "acceptance_by_depth": acceptance,
            "idle_ms": round(idle * 1e3, 3), "draft_run_ms": round(per_run * 1e3, 3), "table": table}  # fmt: skip


def add_drafting_flags(group: Any) -> None:
    """The flags of every method whose drafter is a network run K times (draft, eagle,
    early-exit): --num-draft, --adaptive and the reduced draft vocabulary's."""
    group.add_argument("--num-draft", type=count_or_auto, help=NUM_DRAFT_HELP)
    group.add_argument(
        "--auto-prompts",
        help=f"draft, eagle, early-exit, medusa's chain with --num-draft auto: the prompt sets (names or .jsonl files, comma-separated) "
        f"whose acceptance chooses K, {AUTO_LIMIT} prompts of each, {AUTO_TOKENS} new tokens (default {AUTO_PROMPTS})",
    )
    add_adaptive_flag(group)
    group.add_argument(
        "--draft-confidence", type=float, metavar="P",
        help="draft, eagle, early-exit, medusa's chain: each row sends only its leading drafts whose joint probability under the "
        "drafter (the product of its probabilities for them) is at least P, so K drafts go to the target where the "
        "drafter is sure and fewer where it is not; a call stops drafting (skips the draft steps left: draft, eagle, "
        "early-exit) once no row's drafts are that sure. Replaces the adaptive gate, which is on by default (not with --adaptive or --num-draft auto). Lossless either way",
    )  # fmt: skip
    draft_vocab.add_flags(group)


def add_adaptive_flag(group: Any) -> None:
    group.add_argument(
        "--adaptive", action=argparse.BooleanOptionalAction, default=None,
        help="draft, eagle, early-exit, medusa's chain (on by default unless --draft-confidence is given): each row drafts only while its "
        "recent rounds accept enough drafts to pay for drafting (the threshold is measured at compile time); a call in "
        "which no row drafts skips the drafter and costs a plain step; --no-adaptive drafts every round. lookup (on by default): each row sends the number of drafts "
        "(0..K) that its recent acceptance and the engine's verify cost, measured at compile time, say pays best. "
        "Lossless either way",
    )  # fmt: skip
    group.add_argument(
        "--adaptive-threshold", type=float,
        help="draft, eagle, early-exit, medusa's chain, adaptive: the accepted drafts per round below which a row stops drafting, "
        "instead of the one measured at compile time (e.g. when the engine will run on another machine)",
    )  # fmt: skip


def check_adaptive(adaptive: bool, threshold: float | None, num_draft: int) -> None:
    if threshold is not None and not adaptive:
        raise InputError("--adaptive-threshold needs the adaptive gate (on by default): drop --no-adaptive "
                         "and --draft-confidence")  # fmt: skip
    if threshold is not None and not 0 <= threshold <= num_draft:
        raise InputError(f"--adaptive-threshold must be between 0 and --num-draft ({num_draft}), got {threshold}")


def trained_accepted(acceptance: dict[str, Any] | None, k: int) -> float | None:
    """Accepted drafts a K-draft round is expected to keep, from a drafter's held-out acceptance
    per set by depth, each depth's rate where the drafts before it were right: [depth 1, depth 2]
    (eagle/train.py), one per head (medusa/train.py) or one rate for every depth
    (early_exit/train.py), the last rate kept further down. The best set's a1 + a1 a2 + ...;
    None without it (a draft model)."""
    if not acceptance:
        return None
    rates = [a if isinstance(a, list) else [a] for a in acceptance.values()]

    def expected(a: list[float]) -> float:
        reach, total = 1.0, 0.0
        for d in range(k):
            reach *= a[min(d, len(a) - 1)]
            total += reach
        return total

    return max(expected(a) for a in rates if a)


def finish_adaptive(staging: Path, engine: ModelDrafts, placeholder: Finished, measure: Measure,
                    threshold: float | None = None, prior: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Gate the staged engine's drafter (exporters/gate.py), then measure one round with drafts
    and one without at context 128, and set the threshold (unless given): the accepted drafts per
    round at which drafting pays for itself (round time / idle time - 1). `prior`: what the
    prompt's round counts as accepting (default K), so that where the drafter's trained
    acceptance is below the threshold rows start stopped. Returns the manifest's description."""
    from specgraph.exporters.onnx import set_initializer

    path = staging / "model.onnx"
    moved, filled = _gate(staging, engine)
    live = measure(placeholder)
    k = engine.num_draft
    rounds, idle_s = _time_gated(live, engine, [k + 1])
    round_s = rounds[k + 1]
    measured = round_s / idle_s - 1
    threshold = measured if threshold is None else threshold
    set_initializer(path, "draft_threshold", np.array([threshold], np.float32))
    prior = float(k) if prior is None else prior
    set_initializer(path, "draft_prior", np.array([prior], np.float32))
    return {"threshold": round(threshold, 4), "measured_threshold": round(measured, 4), "prior": round(prior, 4),
            "round_ms": round(round_s * 1e3, 2), "idle_ms": round(idle_s * 1e3, 2), "decay": ADAPT_DECAY,
            "probe_every": PROBE_EVERY, "probe_max_wait": PROBE_MAX_WAIT, "probe_budget": PROBE_BUDGET,
            "gated_nodes": moved, "filled_caches": filled}  # fmt: skip


def _time_gated(live: Any, engine: ModelDrafts, widths: Any) -> tuple[dict[int, float], float]:
    """Median seconds of a gated engine's call verifying each of `widths` tokens with the drafter,
    and of a one-token call without it (every row's score far below the threshold), at context
    128: GATE_ROUNDS interleaved rounds of 5 calls each. A width's time is the median over rounds
    of its ratio to the same round's idle call, times the idle call's median: a slow spell of this
    machine that hits some rounds moves both sides of their ratio, not the threshold."""
    from specgraph.timing import time_call

    at = min(128, engine.max_context - engine.num_draft - 2)
    drafting: dict[int, list[float]] = {n: [] for n in widths}
    idle = []
    for _ in range(GATE_ROUNDS):  # interleaved
        for n in drafting:
            drafting[n].append(time_call(live, n, at, repeats=5))
        idle.append(time_call(live, 1, at, repeats=5, fill={"draft_score": -1e9}))
    idle_s = float(np.median(idle))
    return {n: float(np.median(np.divide(t, idle))) * idle_s for n, t in drafting.items()}, idle_s


def _gate(staging: Path, engine: ModelDrafts) -> tuple[int, int]:
    """Put the staged engine's drafter in the `If` that skips it (exporters/gate.py), the caches
    of its layers that are the target's own filled from the target's when it is skipped; returns
    how many nodes moved and how many caches are filled."""
    from specgraph.exporters.gate import gate_drafter

    state = [o for o in engine.draft_outputs if not o.startswith(ADAPT_STATE) and o != "n_draft"]
    passthrough = {o: o.replace("present", "past").removesuffix("_out") for o in state}
    if "n_sent" in passthrough:  # a cascade's count: 0 in a call that skips the drafters, as n_draft is there
        passthrough["n_sent"] = "n_draft"
    shared = kv_names("draft_present", engine.target_layers)
    fill = dict(zip(shared, kv_names("present", engine.target_layers), strict=True))
    return gate_drafter(staging / "model.onnx", ["next_tokens", *state], passthrough, count="n_draft",
                        tokens="next_tokens", fill=fill)  # fmt: skip


def quantise_drafter(staging: Path, bits: int, block_size: int, native: bool = False, quads: bool = False,
                     prefix: str = "draft_gm.", int8: bool = False,
                     stored: Callable[[np.ndarray], list[Any] | None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run the staged engine's drafter matrices (`draft_gm.*`) as `bits`-bit blocks with int8
    activations (`exporters/nbits.py`, accuracy level 4): a drafter only proposes, so its
    arithmetic costs acceptance, never exactness. With `native` (a bundle that runs specgraph's
    kernels already) they are `specgraph.BlockMatMul` nodes in float32 instead, 8-bit codes in
    wide lanes, with the norms, SwiGLU and residual adds around them folded in as the target's
    are: one node a product where ONNX Runtime's path takes four or five (docs/benchmarks.md,
    EAGLE). With `quads` (where the library runs VNNI's loop) they are native products at int8
    activations, one-digit codes in quads and two-digit ones in pairs, with float16 scales
    (block_matmul.h): an int4 draft run 1.5-1.7x cheaper than ONNX Runtime's on a Xeon
    (docs/benchmarks.md, draft models).
    With `native` and `int8` (8-bit codes) they are native products at int8 activations with their
    codes in pairs of 4-bit digits, the loop the stored Q8_0 LM head runs. `prefix`: the copy's
    weights (`draft_gm.`, or a cascade's mid model's `cascade_gm.`). `stored(W)`: W's own blocks
    where the model file has them (`stored_blocks`), taken instead of quantising W. Returns the
    manifest's description."""
    from specgraph import blocks
    from specgraph.exporters.native_fusion import fuse_into_block_matmuls
    from specgraph.exporters.nbits import run_weights_as_blocks

    native = native or quads
    kept = 0  # matrices that keep their stored blocks

    def own(name: str, w: np.ndarray) -> list[Any] | None:
        nonlocal kept
        if not name.startswith(prefix) or w.shape[1] % block_size:
            return None
        runs = stored(w) if stored is not None else None
        kept += runs is not None
        return runs or [blocks.quantize(w, bits, block_size, half_scales=quads)]

    path = staging / "model.onnx"
    level = 1 if native and not quads and not int8 else 4
    report = run_weights_as_blocks(path, own, accuracy_level=level, tables=prefix, native=native,
                                   wide=native and not int8, quads=quads)  # fmt: skip
    section = {"weights": f"int{bits}", "activations": "float32" if level == 1 else "int8", "block_size": block_size,
               "kernels": "native" if native else "ort", "matmuls": report.matmuls,
               "float32_bytes": report.float_bytes, "block_bytes": report.stored_bytes,
               "stored_blocks": kept}  # fmt: skip
    if quads:  # the tied LM head keeps its pairs for the embedding's Gather: a run streams one of the two
        section.update(quads=report.quads, quads_gather_bytes=report.quads_gather_bytes)
    if native:
        section["native_fused"] = fuse_into_block_matmuls(path)  # the target's were folded before: these are its own
    return section


def _reduce_readout(gm: torch.fx.GraphModule, lm_head: torch.fx.Node, ids: torch.Tensor) -> None:
    """Make the draft's LM head score only `ids`: its logits become [.., V_d], read out by those
    rows of its LM head, a weight of their own (the embedding keeps the whole table)."""
    weight = lm_head.args[1]
    assert isinstance(weight, torch.fx.Node) and weight.op == "get_attr", "the draft's LM head reads a weight"
    rows = gm.get_parameter(str(weight.target)).detach()[ids].clone()
    gm.register_parameter("vocab_head", torch.nn.Parameter(rows, requires_grad=False))  # [V_d, H]
    with gm.graph.inserting_before(lm_head):
        reduced = gm.graph.get_attr("vocab_head")
    lm_head.args = (lm_head.args[0], reduced, *lm_head.args[2:])
    gm.graph.eliminate_dead_code()
    gm.recompile()


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """One line naming the first difference unless both tokenizers map the same strings to the
    same ids (the draft's proposals are ids the target must read as the same text)."""
    from specgraph.loaders import load_tokenizer

    if target.tokenizer_dir is None and draft.tokenizer_dir is None:
        return  # models of token ids only: their vocabulary sizes are checked after capture
    if target.tokenizer_dir is None or draft.tokenizer_dir is None:
        missing = target.name if target.tokenizer_dir is None else draft.name
        raise InputError(
            f"{missing} has no tokenizer, so the draft's vocabulary cannot be checked against the target's"
        )
    a = load_tokenizer(target.tokenizer_dir).get_vocab()
    b = load_tokenizer(draft.tokenizer_dir).get_vocab()
    if a == b:
        return
    for text in sorted(set(a) | set(b), key=lambda k: (min(a.get(k, 1 << 60), b.get(k, 1 << 60)), k)):
        if a.get(text) != b.get(text):
            raise InputError(
                f"draft {draft.name}'s tokenizer differs from {target.name}'s: {text!r} is id {b.get(text)} in the "
                f"draft and {a.get(text)} in the target; a draft must share the target's vocabulary"
            )


DRAFT = DraftMethod()
