"""Greedy generation on several bundles of one model, interleaved prompt by prompt, in one run.

    python scripts/ab_generate.py out/none out/lookup out/lookup-adaptive --prompts humaneval,chat --limit 8

For every prompt, each bundle generates in turn (`--rounds` times, the order rotated each round),
so a slow spell of the machine hits them alike. Prints, per prompt set and bundle: tokens/s (the
median of the prompts' best-of-rounds rates), the median over prompts of the rate relative to the
first bundle, mean accepted tokens per call, and how many outputs equal the first bundle's.
`--json F` writes the same figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specgraph.bench import prompt_ids
from specgraph.runtime import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="+", help="bundles of the same model; the first is the one compared against")
    ap.add_argument("--prompts", default="humaneval,chat", help="prompt sets, comma-separated (as for bench)")
    ap.add_argument("--limit", type=int, default=8, help="prompts per set (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each prompt on each bundle (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads (default 2)")
    ap.add_argument("--json", type=Path, help="also write the figures here (a new file)")
    args = ap.parse_args()
    engines = [Engine(b, threads=args.threads) for b in args.bundles]
    report: dict[str, dict[str, dict[str, float]]] = {}
    for name in args.prompts.split(","):
        prompts = prompt_ids(name, args.limit, engines[0], chat=True)
        engines[0].generate(prompts[0], max_new_tokens=8)  # warm-up
        rates: list[list[float]] = [[] for _ in engines]
        accepted: list[list[float]] = [[] for _ in engines]
        same = [0 for _ in engines]
        for ids in prompts:
            best = [0.0 for _ in engines]
            outputs: list[list[int]] = [[] for _ in engines]
            for r in range(args.rounds):
                for i in [(j + r) % len(engines) for j in range(len(engines))]:
                    run = engines[i].generate(ids, max_new_tokens=args.max_new_tokens, stop_at_eos=False)
                    best[i] = max(best[i], run.tokens_per_s)
                    outputs[i] = run.output_ids
                    if r == 0:
                        accepted[i].append(run.mean_accepted)
            for i in range(len(engines)):
                rates[i].append(best[i])
                same[i] += outputs[i] == outputs[0]
        report[name] = {}
        for i, bundle in enumerate(args.bundles):
            ratio = statistics.median(r / r0 for r, r0 in zip(rates[i], rates[0], strict=True))
            row = {"tokens_per_s": round(statistics.median(rates[i]), 2), "ratio": round(ratio, 3),
                   "mean_accepted": round(statistics.mean(accepted[i]), 3), "identical": f"{same[i]}/{len(prompts)}"}  # fmt: skip
            report[name][bundle] = row
            print(f"{name:10s} {bundle:28s} {row['tokens_per_s']:7.1f} tok/s  {ratio:5.2f}x  "
                  f"tau {row['mean_accepted']:.2f}  identical {row['identical']}")  # fmt: skip
    if args.json:
        with open(args.json, "x") as f:
            json.dump({"bundles": args.bundles, "max_new_tokens": args.max_new_tokens, "sets": report}, f, indent=2)


if __name__ == "__main__":
    main()
