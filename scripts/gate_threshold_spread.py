"""How much the adaptive gate's threshold (a drafting round's cost in plain steps, less one) moves
from one timing to the next on this machine, by three estimators over the same calls: the median
of each round's drafting/idle ratio (`methods/draft.py` `_time_gated`, what compile uses), the
ratio of the medians (what compile used before), and the ratio of the fastest calls; and the
first 3 rounds alone. The drafting call opens the gate (`draft_score` 1e9, as ab_step's FILL).

    python scripts/gate_threshold_spread.py out/s49/fp-d4-b32 out/s49/fp-d4-b64n --repeats 4
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from specgraph.methods.draft import GATE_ROUNDS
from specgraph.runtime import Engine
from specgraph.timing import time_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--repeats", type=int, default=4, help="timings of each bundle, interleaved")
    args = parser.parse_args()
    engines = {b: Engine(b, threads=2, verify=False) for b in args.bundles}
    for rep in range(args.repeats):
        for bundle, live in engines.items():
            k = int(json.loads((live.bundle / "manifest.json").read_text())["draft"]["num_draft"])
            drafting, idle = [], []
            for _ in range(GATE_ROUNDS):
                drafting.append(time_call(live, k + 1, 128, repeats=5, fill={"draft_score": 1e9}))
                idle.append(time_call(live, 1, 128, repeats=5, fill={"draft_score": -1e9}))
            d, i = np.array(drafting), np.array(idle)
            print(f"{bundle} repeat {rep}: median ratio {np.median(d / i) - 1:.3f}  ratio of medians "
                  f"{np.median(d) / np.median(i) - 1:.3f}  ratio of minima {d.min() / i.min() - 1:.3f}  "
                  f"first 3 rounds {np.median(d[:3]) / np.median(i[:3]) - 1:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
