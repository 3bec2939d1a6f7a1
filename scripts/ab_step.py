"""Interleaved A/B of one engine call: median ms of a 1-token and an 8-token step for each bundle,
rounds in rotated order (the first engine of a round runs slower on this machine), so order and
a slow moment hit every arm alike, and each arm's median ratio to the first arm within a round. A bundle may carry sampling
settings after a colon: BUNDLE:TEMPERATURE[:TOP_K[:TOP_P]] (e.g. out/s-none:0.7::0.9).

    python scripts/ab_step.py out/smollm2-none out/smollm2-medusa
    python scripts/ab_step.py out/smollm2-none out/s-none out/s-none:0.7 out/s-none:0.7:0:0.9
    ROUNDS=40 python scripts/ab_step.py out/a out/b     # more rounds (default: twice the arms)
    WIDTHS=1,2,4,8 python scripts/ab_step.py out/a out/b  # the call widths timed (default: 1,8)
"""

from __future__ import annotations

import os
import statistics
import sys

from specgraph.runtime import Engine
from specgraph.sampling import SamplingParams
from specgraph.timing import time_call


def _arm(spec: str) -> tuple[Engine, SamplingParams]:
    path, *rest = spec.split(":")
    values = [*rest, "", "", ""][:3]
    params = SamplingParams(float(values[0] or 0), int(values[1] or 0), float(values[2] or 1), seed=0)
    return Engine(path, threads=2, verify=False), params


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    arms = [_arm(spec) for spec in sys.argv[1:]]
    print("arms:", sys.argv[1:])
    times: dict[tuple[int, int], list[float]] = {}
    rounds = int(os.environ.get("ROUNDS", 2 * len(arms)))
    widths = [int(w) for w in os.environ.get("WIDTHS", "1,8").split(",")]
    for r in range(rounds):  # the order rotates every round: the first arm of a round runs slower here
        for i in [(r + j) % len(arms) for j in range(len(arms))]:
            engine, params = arms[i]
            for n in widths:
                times.setdefault((i, n), []).append(time_call(engine, n, 64, 15, params) * 1000)
    for n in widths:
        print(
            f"c({n}) ms, median of {rounds} rotated rounds:",
            [round(statistics.median(times[i, n]), 2) for i in range(len(arms))],
            "; ratio to the first arm, median over rounds:",
            [
                round(statistics.median(a / b for a, b in zip(times[i, n], times[0, n], strict=True)), 3)
                for i in range(len(arms))
            ],
        )


if __name__ == "__main__":
    main()
