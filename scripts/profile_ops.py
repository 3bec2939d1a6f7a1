"""Where one engine call's time goes, by ONNX operator type (ONNX Runtime's profiler; it inflates
every node, so compare shares, not absolute times), and one step's time with 1 and 2 threads.

    python scripts/profile_ops.py out/src-none --tokens 1
    python scripts/profile_ops.py out/draft --tokens 5 --fill draft_score=1e9   # a gated drafter's round

Nodes inside an `If` (a gated drafter, the sampling gates) are profiled with the rest; `--fill`
sets a state input (every entry) so that a gate opens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict

import numpy as np
import onnxruntime as ort

from specgraph.kernels import register, uses_native
from specgraph.runtime import Engine
from specgraph.timing import time_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--tokens", type=int, default=1, help="tokens verified per call")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=0, help="also list this many of the dearest single nodes")
    parser.add_argument("--fill", default="", help="NAME=VALUE,...: state inputs set to VALUE (e.g. draft_score=1e9)")
    args = parser.parse_args()
    engine = Engine(args.bundle, threads=2, verify=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.enable_profiling = True
    options.log_severity_level = 3
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "p")
    if uses_native(engine.manifest):
        register(options, engine.bundle)
    engine.session = ort.InferenceSession(str(engine.bundle / "model.onnx"), options)
    fill = {k: float(v) for k, v in (item.split("=") for item in args.fill.split(",") if item)} or None
    time_call(engine, args.tokens, 128, repeats=args.calls, fill=fill)  # one warm-up call, then the timed ones
    events = json.load(open(engine.session.end_profiling()))
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    per_node: dict[tuple[str, str], float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            total[e["args"]["op_name"]] += e["dur"] / 1000 / (args.calls + 1)
            count[e["args"]["op_name"]] += 1
            per_node[e["args"]["op_name"], e["name"].removesuffix("_kernel_time")] += e["dur"] / 1000 / (args.calls + 1)
    runs = [e["dur"] / 1000 for e in events if e.get("name") == "model_run"]
    print(f"profiled call: median {np.median(runs):.2f} ms; node time {sum(total.values()):.2f} ms")
    for op, ms in sorted(total.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {op:24s} {ms:7.2f} ms  {count[op] / (args.calls + 1):5.0f} nodes")
    for (op, name), ms in sorted(per_node.items(), key=lambda kv: -kv[1])[: args.nodes]:
        print(f"  {ms:7.3f} ms  {op:20s} {name}")
    arms = {t: Engine(args.bundle, threads=t, verify=False) for t in (1, 2)}
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(4):  # interleaved
        for t, e in arms.items():
            times[t].append(time_call(e, args.tokens, 64, 15, fill=fill) * 1000)
    print(
        "unprofiled step, ms (median of 4 interleaved rounds):",
        {f"{t} threads": round(statistics.median(v), 2) for t, v in times.items()},
    )


if __name__ == "__main__":
    main()
