"""`lookup`: prompt-lookup drafting. The drafts are the tokens that followed the latest earlier
occurrence of the last n tokens; nothing to load or train.

The engine carries the token history as per-row state (`history [B, S+1]`, fed by `history_out`)
and says how many of its K drafts are real (`n_draft`): the manifest's `graph.trims` tells the host
to send only `next_tokens[:, :1 + max(n_draft)]`, so a round without a match verifies one token.

With `adaptive` (the default; `--no-adaptive` turns it off) a row sends fewer of them where
they do not pay (`_draft_count`): each row keeps decayed counts of drafts accepted and rejected
for each length n of the n-gram its drafts were copied after (`lookup_stats`: a 3-token match is
a better guide than a 1-token one), reads the acceptance rate a of this round's match length
from them, and sends the k in 0..K that maximises (1 + a + ... + a^k) / c(1 + k), where c is
this engine's own verify cost measured at compile time (`lookup_cost`, relative to c(1)). A row
that sent no draft still learns: the next call checks the first draft it withheld against the
token that was committed there (`lookup_last`). Lossless either way: the count only decides how
many drafts the next call verifies.

With native kernels (`--kernels native`, or `auto` where the library is built) the adaptive round
is one `specgraph.LookupRound` node (host/src/kernels/lookup.h: the same integers and float32
steps in the same order) instead of the ~200 nodes its graph takes, whose overhead cost 8% of a
one-token call at the default model's stored weights; `--kernels ort` keeps the graph, which any
ONNX Runtime runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxscript
import torch
from onnx import defs

from specgraph.errors import InputError
from specgraph.exporters.nbits import NATIVE_DOMAIN
from specgraph.methods.base import NUM_DRAFT_HELP, Built, Finished, Measure, Method, Options, count_or_auto
from specgraph.methods.draft import add_adaptive_flag
from specgraph.ops import ONNX_TRANSLATIONS
from specgraph.step import StepEngine

_I64 = torch.int64
# `--adaptive`: [B, max_ngram, 2] decayed accepted/rejected counts per match length; [B, 3] what the last
# call proposed: drafts sent, its withheld first draft + 1, the length of the n-gram they followed
ADAPT_STATE = ("lookup_stats", "lookup_last")
ADAPT_DECAY = 0.8  # weight of a row's past observations of a match length in its acceptance rate
PRIOR_WEIGHT = 2.0  # observations' worth of the row's rate over all match lengths in one length's rate
# the rate a row starts from, worth 2 observations: below a dear verify's break-even (a second row
# at 0.46 of a step at the stored weights here), above a cheap one's (0.09 at fp32). A row learns
# for free while it withholds drafts (`_observe`), so it need not start by paying for them
FIRST_RATE = 0.25


@dataclass(frozen=True)
class LookupOptions(Options):
    num_draft: int = 7  # draft tokens per round (a call verifies 1 + K tokens)
    max_ngram: int = 3  # longest n-gram matched in the context
    adaptive: bool = True  # per row, send only as many drafts as pay for their verification (`_draft_count`)

    def check(self) -> None:
        if not isinstance(self.num_draft, int):  # `--num-draft auto`
            raise InputError("--num-draft auto is for draft, eagle and early-exit: lookup already chooses how many "
                             "drafts to send each round from its measured verify cost (--adaptive, its default)")  # fmt: skip
        if not 1 <= self.num_draft <= 64:
            raise InputError(f"--num-draft must be between 1 and 64, got {self.num_draft}")
        if not 1 <= self.max_ngram <= 8:
            raise InputError(f"--max-ngram must be between 1 and 8, got {self.max_ngram}")


class LookupStepEngine(StepEngine):
    trims = {"next_tokens": "n_draft"}  # bind next_tokens[:, :1 + max(n_draft)] only

    def __init__(self, *args: Any, num_draft: int, max_ngram: int, adaptive: bool = False, native: bool = False,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.num_draft = num_draft
        self.max_ngram = max_ngram
        self.adaptive = adaptive
        self.native = native and adaptive  # the round as one `specgraph.LookupRound` node
        adapt = ADAPT_STATE if adaptive else ()
        self.state_inputs = ("history", *adapt)
        self.draft_outputs = ("history_out", *(f"{n}_out" for n in adapt), "n_draft")
        if adaptive:  # c(1 + k) / c(1) for k = 0..K; `finish` writes the measured curve
            self.register_buffer("lookup_cost", torch.arange(1, num_draft + 2, dtype=torch.float32))

    def example_state(self, batch: int) -> list[torch.Tensor]:
        adapt = [torch.zeros(batch, self.max_ngram, 2), torch.zeros(batch, 3, dtype=_I64)] if self.adaptive else []
        return [torch.zeros(batch, self.max_context + 1, dtype=_I64), *adapt]

    def draft(self, state, tokens, cache_len, bonus, cache_len_out, params):  # type: ignore[no-untyped-def]
        if self.native:  # next_tokens, then history_out, lookup_stats_out, lookup_last_out, n_draft
            next_tokens, *outs = torch.ops.specgraph.lookup_round(state[0], tokens, cache_len, bonus, cache_len_out,
                                                                  state[1], state[2], self.lookup_cost, self.num_draft,
                                                                  self.max_ngram)  # fmt: skip
            return next_tokens, outs
        return _round(state, tokens, cache_len, bonus, cache_len_out, self.num_draft, self.max_ngram,
                      self.lookup_cost if self.adaptive else None)  # fmt: skip


class LookupMethod(Method):
    name = "lookup"
    summary = "prompt-lookup drafting: copies what followed the last n-gram earlier in the text"
    advised = {}
    options_type = LookupOptions

    def add_flags(self, group: Any) -> None:
        group.add_argument(
            "--num-draft",
            type=count_or_auto,
            default=7,
            help=NUM_DRAFT_HELP,
        )
        group.add_argument(
            "--max-ngram", type=int, default=3, help="lookup: longest n-gram matched in the context (default 3)"
        )
        add_adaptive_flag(group)

    def build(self, gm: torch.fx.GraphModule, anatomy: Any, cfg: Any, drafter: Any, window: int | None) -> Built:
        from specgraph.kernels import resolve

        opts: LookupOptions = cfg.opts
        engine = LookupStepEngine(gm, anatomy.num_layers, cfg.max_context, window, cfg.emit_logits,
                                  cfg.engine_samples, num_draft=opts.num_draft, max_ngram=opts.max_ngram,
                                  adaptive=opts.adaptive, native=resolve(cfg.kernels) == "native")  # fmt: skip
        return Built(engine)

    def stages(self, options: Any) -> list[str]:
        return ["measure verify cost"] if options.adaptive else []

    def finish(self, staging: Any, cfg: Any, built: Built, measure: Measure) -> Finished:
        opts: LookupOptions = cfg.opts
        section: dict[str, Any] = {"num_draft": opts.num_draft, "max_ngram": opts.max_ngram}
        summary = f"up to {opts.num_draft} drafts a round, copied from the latest earlier match of the last {opts.max_ngram}..1 tokens"
        if opts.adaptive:
            placeholder = Finished(section, draft_depth=opts.num_draft)
            section["adaptive"] = _measure_cost(staging, measure(placeholder), opts.num_draft)
            curve = " ".join(f"{c:g}" for c in section["adaptive"]["cost"])
            summary += f"; each row sends only those that pay (adaptive; c(1+k)/c(1) for k = 0..: {curve})"
            if built.engine.native:
                section["native_round"] = True  # the round is one specgraph.LookupRound node
                summary += "; the round runs as one native node (specgraph.LookupRound)"
        return Finished(section, draft_depth=opts.num_draft, report={**section, "summary": summary})


LOOKUP = LookupMethod()


def _measure_cost(staging: Path, engine: Any, num_draft: int) -> dict[str, Any]:
    """Measure c(1 + k) / c(1) for k = 0..K at context 128 (`timing.verify_cost_curve`), write
    it into the staged graph's `lookup_cost` (non-decreasing: a longer call never costs less) and
    return the manifest's description."""
    from specgraph.exporters.onnx import set_initializer
    from specgraph.timing import verify_cost_curve

    at = min(128, engine.max_context - num_draft - 2)
    curve = verify_cost_curve(engine, tuple(range(1, num_draft + 2)), at)
    ratios = [curve["ratio"][n] for n in range(1, num_draft + 2)]
    cost = np.maximum.accumulate(ratios).astype(np.float32)
    set_initializer(staging / "model.onnx", "lookup_cost", cost)
    return {"cost": [round(float(c), 3) for c in cost], "c1_ms": round(curve["ms"][1], 2), "context": at,
            "decay": ADAPT_DECAY, "prior_weight": PRIOR_WEIGHT, "first_rate": FIRST_RATE, "per_match_length": True}  # fmt: skip


@torch.library.custom_op("specgraph::lookup_round", mutates_args=())
def lookup_round(
    history: torch.Tensor, tokens: torch.Tensor, cache_len: torch.Tensor, bonus: torch.Tensor,
    cache_len_out: torch.Tensor, stats: torch.Tensor, last: torch.Tensor, cost: torch.Tensor, num_draft: int,
    max_ngram: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The adaptive round (`_round`) as one operator: next_tokens [B, 1+K], history_out,
    lookup_stats_out, lookup_last_out, n_draft [B]. Exported as `specgraph.LookupRound`."""
    next_tokens, outs = _round([history, stats, last], tokens, cache_len, bonus, cache_len_out, num_draft, max_ngram,
                               cost)  # fmt: skip
    return next_tokens, *outs  # type: ignore[return-value]  # new tensors, none an input


@lookup_round.register_fake
def _lookup_round_fake(history, tokens, cache_len, bonus, cache_len_out, stats, last, cost, num_draft, max_ngram):  # type: ignore[no-untyped-def]
    state = [torch.empty_like(t) for t in (history, stats, last, cache_len)]  # the last: n_draft [B]
    return history.new_empty(history.shape[0], num_draft + 1), *state


_INT64, _FLOAT = "tensor(int64)", "tensor(float)"
_LOOKUP_ROUND = onnxscript.values.Op(
    onnxscript.values.Opset(NATIVE_DOMAIN, 1),
    "LookupRound",
    defs.OpSchema(
        "LookupRound", NATIVE_DOMAIN, 1,
        inputs=[defs.OpSchema.FormalParameter(name, kind) for name, kind in (
            ("history", _INT64), ("tokens", _INT64), ("cache_len", _INT64), ("bonus", _INT64),
            ("cache_len_out", _INT64), ("stats", _FLOAT), ("last", _INT64), ("cost", _FLOAT))],
        outputs=[defs.OpSchema.FormalParameter(name, kind) for name, kind in (
            ("next_tokens", _INT64), ("history_out", _INT64), ("stats_out", _FLOAT), ("last_out", _INT64),
            ("n_draft", _INT64))],
        attributes=[defs.OpSchema.Attribute("num_draft", defs.OpSchema.AttrType.INT, "K: drafts a round at most"),
                    defs.OpSchema.Attribute("max_ngram", defs.OpSchema.AttrType.INT, "N: longest n-gram matched"),
                    *(defs.OpSchema.Attribute(name, defs.OpSchema.AttrType.FLOAT, "the adaptive rule's")
                      for name in ("decay", "prior_weight", "first_rate"))],
    ),
)  # fmt: skip


def _lookup_round_onnx(history, tokens, cache_len, bonus, cache_len_out, stats, last, cost, num_draft: int,
                       max_ngram: int):  # type: ignore[no-untyped-def]  # fmt: skip
    return _LOOKUP_ROUND(history, tokens, cache_len, bonus, cache_len_out, stats, last, cost, num_draft=num_draft,
                         max_ngram=max_ngram, decay=ADAPT_DECAY, prior_weight=PRIOR_WEIGHT, first_rate=FIRST_RATE)  # fmt: skip


# the exporter's table (specgraph/ops.py) takes lookup's operator from here, where it is defined
ONNX_TRANSLATIONS[torch.ops.specgraph.lookup_round.default] = _lookup_round_onnx


def _round(state, tokens, cache_len, bonus, cache_len_out, num_draft, max_ngram, cost):  # type: ignore[no-untyped-def]
    """Next round's tokens [B, 1+K] and the draft outputs [history_out, (lookup_stats_out,
    lookup_last_out,) n_draft]: adaptive where `cost` (c(1 + k) / c(1)) is given."""
    history_out = _record(state[0], tokens, cache_len, bonus, cache_len_out)
    drafts, n_draft, matched = _lookup_drafts(history_out, cache_len_out, num_draft, max_ngram)
    adapt = []
    if cost is not None:
        stats = _observe(state[1], state[2], tokens, bonus, cache_len_out - cache_len)
        sent = torch.minimum(n_draft, _draft_count(stats, cost, matched))
        # the first draft when a match was found but none is sent: the next call checks it
        withheld = torch.where((sent == 0) & (n_draft > 0), drafts[:, 0] + 1, torch.zeros_like(sent))
        adapt, n_draft = [stats, torch.stack([sent, withheld, matched], dim=1)], sent
    return torch.cat([bonus, drafts], dim=1), [history_out, *adapt, n_draft]  # next_tokens [B, 1+K]


def _record(history, tokens, cache_len, bonus, cache_len_out):  # type: ignore[no-untyped-def]
    """Write this call's tokens, then the bonus, into the token history ([B, S+1])."""
    hist = torch.ops.specgraph.kv_write(history, tokens, cache_len, -1)
    return torch.ops.specgraph.kv_write(hist, bonus, cache_len_out, -1)


def _observe(stats, last, tokens, bonus, committed):  # type: ignore[no-untyped-def]
    """The row's decayed [accepted, rejected] draft counts per match length [B, N, 2] after this
    call. `last` [B, 3] says what the previous call proposed: how many drafts it sent, (+ 1) the
    first draft it withheld when it sent none, and the length n of the n-gram they followed,
    whose counts (row n - 1) this call updates. Sent drafts count as accepted up to the first
    rejection; a withheld one counts as accepted if it equals the token committed after this
    call's first (one observation at no cost: lookup's drafts are free to make). A prompt call
    observes nothing: the state is zero then."""
    sent, withheld, length = last[:, 0], last[:, 1], last[:, 2]  # [B]
    accepted = committed - 1  # [B] this call's drafts accepted (its first token is the last bonus)
    # the token committed right after this call's first: its second token if accepted, else the bonus
    after = torch.where(accepted > 0, torch.cat([tokens, bonus], dim=1)[:, 1], bonus[:, 0])  # [B]
    hit = (withheld == after + 1).to(stats.dtype)
    good = torch.where(sent > 0, torch.minimum(accepted, sent).to(stats.dtype), hit)
    bad = torch.where(sent > 0, (accepted < sent).to(stats.dtype), 1 - hit)
    lengths = torch.arange(1, stats.shape[1] + 1, dtype=_I64)[None, :]  # [1, N]
    seen = (((sent > 0) | (withheld > 0))[:, None] & (lengths == length[:, None]))[:, :, None]  # [B, N, 1]
    return torch.where(seen, ADAPT_DECAY * stats + torch.stack([good, bad], dim=1)[:, None, :], stats)


def _draft_count(stats, cost, matched):  # type: ignore[no-untyped-def]
    """The k in 0..K [B] that maximises the expected tokens of a round per unit of its cost,
    (1 + a + a^2 + ... + a^k) / cost[k], for each row's acceptance rate a after matches of this
    round's length `matched` [B] (0: no match, read as length 1; no draft is sent then anyway):
    (accepted + w p) / (accepted + rejected + w), a prior of weight w = PRIOR_WEIGHT centred on
    the row's rate over all lengths, p = (all accepted + 2 FIRST_RATE) / (all observed + 2), so
    that one lucky round after a rare length does not send K drafts, and a row that has seen
    nothing yet withholds its drafts where a second verified token is dear (their first is still
    checked, at no cost). Geometric acceptance: a draft is accepted with probability a given the
    one before it was."""
    row = (matched.clamp(min=1) - 1)[:, None, None].expand(-1, 1, 2)  # [B, 1, 2]
    counts, pooled = stats.gather(1, row)[:, 0], stats.sum(dim=1)  # [B, 2] this length's, all lengths'
    prior = (pooled[:, :1] + 2 * FIRST_RATE) / (pooled.sum(dim=1, keepdim=True) + 2)  # [B, 1]
    rate = (counts[:, :1] + PRIOR_WEIGHT * prior) / (counts.sum(dim=1, keepdim=True) + PRIOR_WEIGHT)  # [B, 1]
    depth = torch.arange(1, cost.shape[0], dtype=stats.dtype)[None, :]  # [1, K]
    expected = torch.cat([torch.ones_like(rate), 1 + torch.cumsum(rate**depth, dim=1)], dim=1)  # [B, 1+K]
    return (expected / cost).argmax(dim=1)  # [B]


def _lookup_drafts(
    seq: torch.Tensor, last: torch.Tensor, k: int, max_ngram: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafting: find the latest earlier occurrence of the longest n-gram
    (n = max_ngram..1) ending at position `last` and propose the k tokens that followed it.

    seq [B, L] holds valid tokens at 0..last[b]; positions past `last` are ignored. Returns the
    drafts [B, K], how many are real [B] and the length n of the n-gram matched [B] (0: none): a
    row with no match proposes the bonus token repeated (0 real), and a match near the end
    repeats the last token past what followed it.
    """
    b, length = seq.shape
    start = torch.full_like(last, -1)  # [B] first draft's index in seq, -1 = none yet
    matched = torch.zeros_like(last)  # [B] the n of the longest n-gram found
    for n in range(max_ngram, 0, -1):
        windows = length - n + 1
        tail_idx = torch.clamp(last[:, None] - (n - 1) + torch.arange(n, dtype=_I64)[None, :], min=0)  # [B, n]
        tail = seq.gather(1, tail_idx)  # [B, n]
        hit = torch.ones(b, windows, dtype=torch.bool)
        for i in range(n):
            hit = hit & (seq[:, i : i + windows] == tail[:, i : i + 1])  # [B, W]
        j = torch.arange(windows, dtype=_I64)[None, :]
        valid = (j <= (last[:, None] - n)) & (last[:, None] >= n - 1)  # strictly earlier than the tail
        best = torch.where(hit & valid, j, torch.full_like(j, -1)).max(dim=-1).values  # [B] latest match
        found = torch.where(best >= 0, best + n, torch.full_like(best, -1))
        matched = torch.where((start < 0) & (found >= 0), torch.full_like(matched, n), matched)
        start = torch.where(start < 0, found, start)
    idx = start[:, None] + torch.arange(k, dtype=_I64)[None, :]  # [B, K]
    idx = torch.where(start[:, None] < 0, last[:, None], torch.minimum(idx, last[:, None]))
    real = torch.where(start < 0, torch.zeros_like(start), torch.clamp(last - start + 1, max=k))  # [B]
    return seq.gather(1, idx), real, matched
