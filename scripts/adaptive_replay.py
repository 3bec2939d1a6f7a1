"""Price the adaptive rule offline: replay the draft outcomes an every-round (`--no-adaptive`)
K = 1 bundle records through `ModelDrafts._adapt` and predict the speed-up over `none`.

A drafting round costs 1 + THRESHOLD plain steps (the threshold an adaptive build of the same
engine measured, its manifest's `<method>.adaptive.threshold`), an idle round 1; the outcome of
a draft made at text position t is the one the every-round engine recorded there. `--from-prior`
also prices a variant whose score starts at the drafter's prior less the threshold instead of 0.
Greedy text does not depend on timing, so this runs on a busy machine too. docs/benchmarks.md
(the adaptive gate's section) has the figures.

    python scripts/adaptive_replay.py out/y-i8-eagle 0.3732 --prior 0.4915 --from-prior
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

import torch

from specgraph.bench import prompt_ids
from specgraph.methods.draft import PROBE_EVERY, ModelDrafts
from specgraph.runtime import Engine


def outcomes(steps: list[int]) -> list[int]:
    """Per text position, whether the draft made there was accepted (the prompt's call dropped)."""
    out: list[int] = []
    for tokens in steps[1:]:
        out += [tokens - 1] * tokens
    return out


def replay(accepted: list[int], threshold: float, prior: float, from_prior: bool, new_tokens: int) -> float:
    """Tokens per plain-step time of one row deciding by the rule, over `new_tokens` tokens."""
    row = SimpleNamespace(num_draft=1, draft_threshold=torch.tensor([threshold]), draft_prior=torch.tensor([prior]))
    state = [torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]
    at, width, cost = 0, 2, 0.0
    while at < new_tokens:
        got = 1 if at == 0 else accepted[min(at, len(accepted) - 1)] if width > 1 else 0  # the prompt's call drafts
        cost += 1 + threshold if width > 1 else 1
        score, idle, wait, n_draft = ModelDrafts._adapt(row, state, torch.zeros(1, width, dtype=torch.int64),
                                                        torch.tensor([at]), torch.tensor([at + 1 + got]))  # fmt: skip
        if from_prior and at == 0:
            score = row.draft_prior - row.draft_threshold
            n_draft = torch.where((score >= 0) | (idle >= torch.clamp(wait, min=PROBE_EVERY)), 1, 0)
        state, width, at = [score, idle, wait], 1 + int(n_draft[0]), at + 1 + got
    return at / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", help="a K = 1 bundle that drafts every round (--no-adaptive)")
    ap.add_argument("threshold", type=float, help="a drafting round's extra cost in plain steps")
    ap.add_argument("--prior", type=float, default=1.0, help="what the prompt's round counts as accepting")
    ap.add_argument("--from-prior", action="store_true", help="also price the score started at prior - threshold")
    ap.add_argument("--prompts", default="humaneval,chat,creative,repeat")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    engine = Engine(args.bundle, threads=2)
    for name in args.prompts.split(","):
        runs = [list(engine.generate(p, args.max_new_tokens).accepted_per_step)
                for p in prompt_ids(name, args.limit, engine, chat=True)]  # fmt: skip
        every = statistics.median(sum(s) / (len(s) * (1 + args.threshold)) for s in runs)
        rule = statistics.median(
            replay(outcomes(s), args.threshold, args.prior, False, args.max_new_tokens) for s in runs
        )
        line = f"{name:10s} every round {every:.3f}x  adaptive {rule:.3f}x"
        if args.from_prior:
            started = statistics.median(
                replay(outcomes(s), args.threshold, args.prior, True, args.max_new_tokens) for s in runs
            )
            line += f"  adaptive from the prior {started:.3f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
