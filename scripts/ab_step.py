"""Interleaved A/B of one engine call: median ms of a 1-token and an 8-token step for each bundle,
three rounds, bundles alternating so a slow moment hits all of them.

    python scripts/ab_step.py out/smollm2-none out/smollm2-medusa
"""

from __future__ import annotations

import sys

from specgraph.runtime import Engine


def main() -> None:
    engines = [Engine(path, threads=2, verify=False) for path in sys.argv[1:]]
    for _ in range(3):
        one = [round(e.time_call(1, 64, 15) * 1000, 1) for e in engines]
        eight = [round(e.time_call(8, 64, 15) * 1000, 1) for e in engines]
        print(f"c(1) ms {one}   c(8) ms {eight}")


if __name__ == "__main__":
    main()
