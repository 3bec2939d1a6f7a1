"""An engine's verify-cost curve c(N) as `timing.verify_cost_curve` measures it (bench, lookup's
adaptive rule), and optionally how a wide call slows the one-token calls after it.

    python scripts/cost_curve.py out/x7/i8q-none                 # c(N) ms and c(N)/c(1), N = 1..64
    python scripts/cost_curve.py out/x7/i8q-none --after 64,8,1  # eight one-token calls after one N-token call
"""

from __future__ import annotations

import argparse
import json

from specgraph.runtime import Engine
from specgraph.timing import PreparedCall, verify_cost_curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--after", default="", help="N,N,...: time eight one-token calls after one call of N tokens")
    args = parser.parse_args()
    engine = Engine(args.bundle, threads=2, verify=False)
    if not args.after:
        curve = verify_cost_curve(engine, (1, 2, 3, 4, 5, 8, 16, 32, 64), 128)
        print(json.dumps({"ms": {n: round(v, 2) for n, v in curve["ms"].items()},
                          "ratio": {n: round(v, 2) for n, v in curve["ratio"].items()}}))  # fmt: skip
        return
    widths = [int(n) for n in args.after.split(",")]
    state = engine.new_state(1)
    calls = {n: PreparedCall(engine, n, 128, state=state) for n in {1, *widths}}
    for n in widths * 2:  # each width twice
        for _ in range(8):
            calls[1].seconds()
        calls[n].seconds()
        print(f"after one {n}-token call:", [round(calls[1].seconds() * 1e3, 2) for _ in range(8)])


if __name__ == "__main__":
    main()
