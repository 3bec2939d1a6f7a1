"""`lookup`: prompt-lookup drafting. The drafts are the tokens that followed the latest earlier
occurrence of the last n tokens; nothing to load or train.

The engine carries the token history as per-row state (`history [B, S+1]`, fed by `history_out`)
and says how many of its K drafts are real (`n_draft`): the manifest's `graph.trims` tells the host
to send only `next_tokens[:, :1 + max(n_draft)]`, so a round without a match verifies one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specgraph.errors import InputError
from specgraph.methods.base import Built, Finished, Measure, Method, Options
from specgraph.step import StepEngine

_I64 = torch.int64


@dataclass(frozen=True)
class LookupOptions(Options):
    num_draft: int = 7  # draft tokens per round (a call verifies 1 + K tokens)
    max_ngram: int = 3  # longest n-gram matched in the context

    def check(self) -> None:
        if not 1 <= self.num_draft <= 64:
            raise InputError(f"--num-draft must be between 1 and 64, got {self.num_draft}")
        if not 1 <= self.max_ngram <= 8:
            raise InputError(f"--max-ngram must be between 1 and 8, got {self.max_ngram}")


class LookupStepEngine(StepEngine):
    state_inputs = ("history",)
    draft_outputs = ("history_out", "n_draft")
    trims = {"next_tokens": "n_draft"}  # bind next_tokens[:, :1 + max(n_draft)] only

    def __init__(self, *args: Any, num_draft: int, max_ngram: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_draft = num_draft
        self.max_ngram = max_ngram

    def example_state(self, batch: int) -> list[torch.Tensor]:
        return [torch.zeros(batch, self.max_context + 1, dtype=_I64)]

    def draft(self, state, tokens, cache_len, bonus, cache_len_out, params):  # type: ignore[no-untyped-def]
        history_out = _record(state[0], tokens, cache_len, bonus, cache_len_out)
        drafts, n_draft = _lookup_drafts(history_out, cache_len_out, self.num_draft, self.max_ngram)
        return torch.cat([bonus, drafts], dim=1), [history_out, n_draft]  # next_tokens [B, 1+K]


class LookupMethod(Method):
    name = "lookup"
    summary = "prompt-lookup drafting: copies what followed the last n-gram earlier in the text"
    advised = {}
    options_type = LookupOptions

    def add_flags(self, group: Any) -> None:
        group.add_argument(
            "--num-draft",
            type=int,
            default=7,
            help="draft tokens verified per step (lookup: default 7; draft: default 4; eagle: default 2; early-exit: default 3)",
        )
        group.add_argument(
            "--max-ngram", type=int, default=3, help="lookup: longest n-gram matched in the context (default 3)"
        )

    def build(self, gm: torch.fx.GraphModule, anatomy: Any, cfg: Any, drafter: Any, window: int | None) -> Built:
        opts: LookupOptions = cfg.opts
        engine = LookupStepEngine(gm, anatomy.num_layers, cfg.max_context, window, cfg.emit_logits,
                                  cfg.engine_samples, num_draft=opts.num_draft, max_ngram=opts.max_ngram)  # fmt: skip
        return Built(engine)

    def finish(self, staging: Any, cfg: Any, built: Built, measure: Measure) -> Finished:
        opts: LookupOptions = cfg.opts
        return Finished({"num_draft": opts.num_draft, "max_ngram": opts.max_ngram}, draft_depth=opts.num_draft)


LOOKUP = LookupMethod()


def _record(history, tokens, cache_len, bonus, cache_len_out):  # type: ignore[no-untyped-def]
    """Write this call's tokens, then the bonus, into the token history ([B, S+1])."""
    hist = torch.ops.specgraph.kv_write(history, tokens, cache_len, -1)
    return torch.ops.specgraph.kv_write(hist, bonus, cache_len_out, -1)


def _lookup_drafts(seq: torch.Tensor, last: torch.Tensor, k: int, max_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafting: find the latest earlier occurrence of the longest n-gram
    (n = max_ngram..1) ending at position `last` and propose the k tokens that followed it.

    seq [B, L] holds valid tokens at 0..last[b]; positions past `last` are ignored. Returns the
    drafts [B, K] and how many are real [B]: a row with no match proposes the bonus token
    repeated (0 real), and a match near the end repeats the last token past what followed it.
    """
    b, length = seq.shape
    start = torch.full_like(last, -1)  # [B] first draft's index in seq, -1 = none yet
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
        start = torch.where(start < 0, found, start)
    idx = start[:, None] + torch.arange(k, dtype=_I64)[None, :]  # [B, K]
    idx = torch.where(start[:, None] < 0, last[:, None], torch.minimum(idx, last[:, None]))
    real = torch.where(start < 0, torch.zeros_like(start), torch.clamp(last - start + 1, max=k))  # [B]
    return seq.gather(1, idx), real
