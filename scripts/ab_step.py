"""Interleaved A/B of one engine call: median ms of a 1-token and an 8-token step for each bundle,
rounds in rotated order (the first engine of a round runs slower on this machine), so order and
a slow moment hit every arm alike, and each arm's median ratio to the first arm within a round. A bundle may carry sampling
settings after a colon: BUNDLE:TEMPERATURE[:TOP_K[:TOP_P]] (e.g. out/s-none:0.7::0.9).

    python scripts/ab_step.py out/smollm2-none out/smollm2-medusa
    python scripts/ab_step.py out/smollm2-none out/s-none out/s-none:0.7 out/s-none:0.7:0:0.9
    ROUNDS=40 python scripts/ab_step.py out/a out/b     # more rounds (default: twice the arms)
    WIDTHS=1,2,4,8 python scripts/ab_step.py out/a out/b  # the call widths timed (default: 1,8)
    FILL=draft_score=-1e9 python scripts/ab_step.py out/none out/eagle-adaptive  # state inputs set, where an arm has them
                                                  # (here: every row's gate shut, so the drafter is skipped)
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable

from specgraph.runtime import Engine
from specgraph.sampling import SamplingParams
from specgraph.timing import time_call


def _arm(spec: str) -> tuple[Engine, SamplingParams]:
    path, *rest = spec.split(":")
    values = [*rest, "", "", ""][:3]
    params = SamplingParams(float(values[0] or 0), int(values[1] or 0), float(values[2] or 1), seed=0)
    return Engine(path, threads=2, verify=False), params


def run_rotated(
    count: int, rounds: int, time_arm: Callable[[int], dict[int, float]]
) -> dict[tuple[int, int], list[float]]:
    """ms of each arm's calls per width, [(arm, width)] -> one entry a round; the order of the
    `count` arms rotates every round (the first arm of a round runs slower on this machine)."""
    times: dict[tuple[int, int], list[float]] = {}
    for r in range(rounds):
        for i in [(r + j) % count for j in range(count)]:
            for n, ms in time_arm(i).items():
                times.setdefault((n, i), []).append(ms)
    return times


def print_ratios(times: dict[tuple[int, int], list[float]], count: int, widths: list[int], rounds: int) -> None:
    """Each width's median ms per arm and each arm's median ratio to the first arm within a round."""
    for n in widths:
        print(
            f"c({n}) ms, median of {rounds} rotated rounds:",
            [round(statistics.median(times[n, i]), 2) for i in range(count)],
            "; ratio to the first arm, median over rounds:",
            [
                round(statistics.median(a / b for a, b in zip(times[n, i], times[n, 0], strict=True)), 3)
                for i in range(count)
            ],
        )


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    arms = [_arm(spec) for spec in sys.argv[1:]]
    print("arms:", sys.argv[1:])
    rounds = int(os.environ.get("ROUNDS", 2 * len(arms)))
    widths = [int(w) for w in os.environ.get("WIDTHS", "1,8").split(",")]
    fills = dict(item.split("=") for item in os.environ.get("FILL", "").split(",") if item)

    def time_arm(i: int) -> dict[int, float]:
        engine, params = arms[i]
        inputs = {x.name for x in engine.session.get_inputs()}
        fill = {name: float(value) for name, value in fills.items() if name in inputs} or None
        return {n: time_call(engine, n, 64, 15, params, fill=fill) * 1000 for n in widths}

    print_ratios(run_rotated(len(arms), rounds, time_arm), len(arms), widths, rounds)


if __name__ == "__main__":
    main()
