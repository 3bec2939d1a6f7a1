"""Median ms of one engine call at context 128, bundles interleaved: c(1) and c(N) of a `none`
bundle against c(N) of a speculative one (docs/benchmarks.md, the draft-model section).

    python scripts/call_cost.py out/fp32-none3 out/fp32-draft4 --tokens 5
"""

from __future__ import annotations

import argparse
import statistics

from specgraph.runtime import Engine
from specgraph.timing import time_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("none", help="a none bundle")
    parser.add_argument("other", help="the bundle to compare")
    parser.add_argument("--tokens", type=int, default=5, help="tokens per verify call N (default 5)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    plain, other = Engine(args.none, threads=2), Engine(args.other, threads=2)
    n = args.tokens
    res: dict[str, list[float]] = {"none c(1)": [], f"none c({n})": [], f"other c({n})": []}
    for _ in range(args.rounds):
        res["none c(1)"].append(time_call(plain, 1, 128, repeats=5) * 1e3)
        res[f"none c({n})"].append(time_call(plain, n, 128, repeats=5) * 1e3)
        res[f"other c({n})"].append(time_call(other, n, 128, repeats=5) * 1e3)
    print({k: round(statistics.median(v), 1) for k, v in res.items()})


if __name__ == "__main__":
    main()
