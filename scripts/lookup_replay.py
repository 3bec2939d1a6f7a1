"""Price adaptive lookup offline: replay its rounds (`methods/lookup.py`'s own `_round`) over a
`none` bundle's greedy outputs and predict its speed-up over `none` from a cost curve c(1 + k) / c(1).

Greedy text does not depend on timing, so a round's drafts and acceptance are what the engine
would see; a round that verifies 1 + k tokens costs cost[k] plain steps. `--scale F` shrinks the
curve's increments (c' = 1 + F (c - 1): a verify row F times as dear), the question being what
c(N) a target needs; `--oracle` sends, each round, the count that pays best in hindsight (a
bound on any rule choosing how many of the same drafts to send). docs/benchmarks.md has the figures.

    python scripts/lookup_replay.py out/x12/none out/x12/lookup --prompts humaneval --scale 1,0.5
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specgraph.bench import prompt_ids
from specgraph.methods.lookup import _round
from specgraph.runtime import Engine


def replay(prompt: list[int], out: list[int], cost: list[float], k: int, ngram: int, oracle: bool) -> float:
    """Predicted tokens per plain-step time of adaptive lookup generating `out` after `prompt`."""
    curve = torch.tensor(cost, dtype=torch.float32)
    state = [torch.zeros(1, len(prompt) + len(out) + k + 2, dtype=torch.int64), torch.zeros(1, ngram, 2),
             torch.zeros(1, 3, dtype=torch.int64)]  # fmt: skip
    # the prompt's call: its tokens at slot 0, the bonus out[0] after them
    tokens, start, at, end, spent = torch.tensor([prompt]), 0, 0, len(prompt), 0.0
    while at < len(out) - 1:  # out[at] is the bonus, at slot `end`
        nxt, (history, stats, last, sent_t) = _round(state, tokens, torch.tensor([start]), torch.tensor([[out[at]]]),
                                                     torch.tensor([end]), k, ngram, curve)  # fmt: skip
        state, drafts, truth = [history, stats, last], nxt[0, 1:].tolist(), out[at + 1 :]
        matching = next((a for a, (d, t) in enumerate(zip(drafts, truth, strict=False)) if d != t), min(k, len(truth)))
        sent = int(sent_t[0])
        if oracle:
            sent = max(range(k + 1), key=lambda n: (1 + min(n, matching)) / cost[n])
        spent += cost[sent]
        committed = 1 + min(sent, matching)
        tokens, start = torch.tensor([[out[at], *drafts[:sent]]]), end
        at, end = at + committed, end + committed
    return (len(out) - 1) / spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("none", help="a none bundle (its greedy outputs are replayed)")
    parser.add_argument("lookup", help="an adaptive lookup bundle (its K, max n-gram and cost curve)")
    parser.add_argument("--prompts", default="humaneval", help="prompt sets, comma-separated (as for bench)")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--scale", default="1", help="comma-separated F: c' = 1 + F (c - 1)")
    parser.add_argument("--oracle", action="store_true", help="also the best count in hindsight each round")
    args = parser.parse_args()
    plain = Engine(args.none, threads=2)
    section = Engine(args.lookup, threads=1, verify=False).manifest["lookup"]
    k, ngram, curve = section["num_draft"], section["max_ngram"], section["adaptive"]["cost"]
    for name in args.prompts.split(","):
        runs = [(p, plain.generate(p, max_new_tokens=args.max_new_tokens).output_ids)
                for p in prompt_ids(name, args.limit, plain, chat=True)]  # fmt: skip
        for scale in (float(s) for s in args.scale.split(",")):
            cost = [1 + scale * (c - 1) for c in curve]
            rule = statistics.median(replay(p, o, cost, k, ngram, False) for p, o in runs)
            line = f"{name:10s} F={scale:<5g} c(2)={cost[1]:.2f} c(4)={cost[3]:.2f} c(8)={cost[7]:.2f}  predicted {rule:.2f}x"
            if args.oracle:
                line += f"  (hindsight count: {statistics.median(replay(p, o, cost, k, ngram, True) for p, o in runs):.2f}x)"
            print(line)


if __name__ == "__main__":
    main()
