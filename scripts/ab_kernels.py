"""Interleaved A/B of kernel libraries under one bundle: median ms of engine calls of the given
widths, each library in its own process every round (two ONNX Runtime sessions in one process
share the two cores with each other's spinning pool threads), rounds in rotated order, and each
library's median ratio to the first one within a round.

    python scripts/ab_kernels.py out/s34-none /tmp/old/libspecgraph_kernels.so host/build/libspecgraph_kernels.so
    WIDTHS=1,2,4 ROUNDS=8 python scripts/ab_kernels.py out/s34-lookup OLD.so NEW.so

Build the library under test at another commit with the CMake flags (`-O3 -DNDEBUG -fPIC
-fvisibility=hidden -std=c++17 -shared` over host/src/kernels/*.cpp, ort_table.h beside them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ab_step import print_ratios, run_rotated  # scripts/ is this script's own directory on sys.path

_CHILD = """
import json, sys
from specgraph.runtime import Engine
from specgraph.timing import time_call
engine = Engine(sys.argv[1], threads=2, verify=False)
print(json.dumps({w: time_call(engine, int(w), 128, repeats=12) * 1e3 for w in sys.argv[2].split(",")}))
"""


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    bundle, libraries = sys.argv[1], sys.argv[2:]
    widths = os.environ.get("WIDTHS", "1")
    rounds = int(os.environ.get("ROUNDS", "6"))

    def time_arm(i: int) -> dict[int, float]:  # the library's own process: see the docstring
        env = {**os.environ, "SPECGRAPH_KERNELS_LIB": libraries[i]}
        done = subprocess.run([sys.executable, "-c", _CHILD, bundle, widths], env=env, capture_output=True,
                              text=True, check=True)  # fmt: skip
        return {int(w): ms for w, ms in json.loads(done.stdout.strip().splitlines()[-1]).items()}

    print("arms:", libraries)
    times = run_rotated(len(libraries), rounds, time_arm)
    print_ratios(times, len(libraries), [int(w) for w in widths.split(",")], rounds)


if __name__ == "__main__":
    main()
