"""Interleaved A/B of one engine call at several context lengths: median ms of a 1-token step
for each bundle at each `cache_len`, rounds in rotated order (see ab_step.py). Attention is the
part of a step that grows with the context, so this is where an attention change shows.

    python scripts/context_ab.py out/p-src-i8 out/f-src-i8 --contexts 64,256,448
"""

from __future__ import annotations

import argparse
import statistics

from specgraph.runtime import Engine
from specgraph.timing import time_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--contexts", default="64,256,448", help="comma-separated cache lengths")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per call")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    engines = [Engine(b, threads=2, verify=False) for b in args.bundles]
    contexts = [int(c) for c in args.contexts.split(",")]
    times: dict[tuple[int, int], list[float]] = {}
    for r in range(args.rounds):
        for k in range(len(engines)):
            i = (k + r) % len(engines)  # rotate: each engine runs first in some rounds
            for ctx in contexts:
                ms = time_call(engines[i], args.tokens, ctx, repeats=5) * 1000
                times.setdefault((i, ctx), []).append(ms)
    print(f"c({args.tokens}) ms, median of {args.rounds} rotated rounds")
    for ctx in contexts:
        row = [round(statistics.median(times[(i, ctx)]), 2) for i in range(len(engines))]
        print(f"  context {ctx}: " + ", ".join(f"{b} {t}" for b, t in zip(args.bundles, row, strict=True)))


if __name__ == "__main__":
    main()
