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
import statistics
import subprocess
import sys

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
    runs: dict[str, list[dict[str, float]]] = {lib: [] for lib in libraries}
    for round_ in range(int(os.environ.get("ROUNDS", "6"))):
        shift = round_ % len(libraries)
        for lib in libraries[shift:] + libraries[:shift]:
            env = {**os.environ, "SPECGRAPH_KERNELS_LIB": lib}
            done = subprocess.run([sys.executable, "-c", _CHILD, bundle, widths], env=env, capture_output=True,
                                  text=True, check=True)  # fmt: skip
            runs[lib].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for w in widths.split(","):
        first = [r[w] for r in runs[libraries[0]]]
        parts = [f"c({w}) ms, median of {len(first)} rounds (ratio to the first library):"]
        for lib in libraries:
            ms = [r[w] for r in runs[lib]]
            ratio = statistics.median(m / f for m, f in zip(ms, first, strict=True))
            parts.append(f"{lib} {statistics.median(ms):.2f} ({ratio:.3f})")
        print("  ".join(parts))


if __name__ == "__main__":
    main()
