"""Split one decode step's time into the attention term and everything else, at two context
lengths, with ONNX Runtime's profiler: a node is counted as attention when one of its inputs or outputs has
the attended span (cache slots in use, rounded up to 64) as a dimension.
The profiler's own overhead inflates every node; compare the two contexts, not absolute times.

    python scripts/profile_context.py out/smollm2-none --contexts 128 1024 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict

import numpy as np
import onnxruntime as ort

from specgraph.kernels import register, uses_native
from specgraph.runtime import Engine
from specgraph.timing import time_call


def profile(engine: Engine, context: int, threads: int, calls: int = 20) -> dict[str, float]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    options.log_severity_level = 3
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "p")
    if uses_native(engine.manifest):
        register(options, engine.bundle)
    engine.session = ort.InferenceSession(str(engine.bundle / "model.onnx"), options)
    time_call(engine, 1, context, repeats=calls)  # one warm-up call, then `calls` timed ones
    events = json.load(open(engine.session.end_profiling()))
    span = (context + 1 + 63) // 64 * 64
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        args = event["args"].get("input_type_shape", []) + event["args"].get("output_type_shape", [])
        shapes = [d for arg in args for dims in arg.values() for d in dims]
        key = "attention" if span in shapes else "other"
        totals[key] += event["dur"] / 1000 / (calls + 1)
    runs = [e["dur"] / 1000 for e in events if e.get("name") == "model_run"]
    totals["step (median model_run)"] = float(np.median(runs))
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = Engine(args.bundle, threads=args.threads, verify=False)
    for context in args.contexts:
        parts = profile(engine, context, args.threads)
        print(f"context {context:5d}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items()))


if __name__ == "__main__":
    main()
