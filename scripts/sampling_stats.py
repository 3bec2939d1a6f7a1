"""Calibration and power of the sampling test (tests/test_sampling.py), for docs/benchmarks.md.

Compiles the 8-token tiny model with each method (and with the two deliberately broken rules
the tests use), then reports for each engine and setting:
  - p-values of the chi-square test on many independent seeds (under a correct engine they
    should be uniform: about 5% below 0.05, 1% below 0.01; the test rejects below 1e-4),
  - for the broken rules, the p-value at several sample sizes (the test's power).

    python scripts/sampling_stats.py --seeds 20 --json docs/bench/sampling_stats.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import specgraph.step  # noqa: E402
import specgraph.step_tree  # noqa: E402
import tests.stats  # noqa: E402
from specgraph.compiler import CompileConfig, compile_model  # noqa: E402
from specgraph.medusa import MedusaHeads, save_heads  # noqa: E402
from specgraph.runtime import Engine  # noqa: E402
from tests.models.tiny import build, save  # noqa: E402
from tests.stats import PROMPT, chi_square, engine_counts, exact_joint  # noqa: E402
from tests.test_sampling import SETTINGS, TREE, _residual_forgotten, _siblings_as_if_alone  # noqa: E402


def _compile(root: Path, folder: Path, name: str) -> Engine:
    method = name.split("-")[0]
    cfg = CompileConfig(model=str(folder), output=root / name, method=method, max_context=64, num_draft=3,
                        heads=str(root / "heads.safetensors"), tree=str(root / "tree.json"))  # fmt: skip
    if name == "lookup-broken":
        original, specgraph.step._chain_targets = specgraph.step._chain_targets, _residual_forgotten
    elif name == "medusa-broken":
        original, specgraph.step_tree._node_draw = specgraph.step_tree._node_draw, _siblings_as_if_alone
    try:
        compile_model(cfg)
    finally:
        if name == "lookup-broken":
            specgraph.step._chain_targets = original
        elif name == "medusa-broken":
            specgraph.step_tree._node_draw = original
    return Engine(root / name, threads=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20, help="independent seeds per engine and setting")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sampling-stats-"))
    folder = save("llama-v8", root / "hf")
    torch.manual_seed(1)
    heads = MedusaHeads(64, 4)
    with torch.no_grad():
        heads.weight.normal_(0, 0.05)
        heads.bias.normal_(0, 0.05)
    save_heads(root / "heads.safetensors", heads, {"vocab_size": 8, "model": "tiny"})
    (root / "tree.json").write_text(json.dumps({"paths": TREE}))
    model = build("llama-v8")
    laws = {s: exact_joint(model, PROMPT, s) for s in SETTINGS}
    report: dict = {"draws_per_check": tests.stats.ROWS * tests.stats.BATCHES, "settings": SETTINGS, "calibration": {},
                    "power": {}}  # fmt: skip
    for name in ("none", "lookup", "medusa"):
        engine = _compile(root, folder, name)
        t0 = time.time()
        pvals = [chi_square(engine_counts(engine, s, seed=1000 + i, v=8), laws[s])[0]
                 for s in SETTINGS for i in range(args.seeds)]  # fmt: skip
        p = np.asarray(pvals)
        report["calibration"][name] = {"checks": len(p), "below_0.05": float((p < 0.05).mean()),
                                       "below_0.01": float((p < 0.01).mean()), "below_1e-4": int((p < 1e-4).sum()),
                                       "min_p": float(p.min()), "median_p": float(np.median(p))}  # fmt: skip
        print(name, report["calibration"][name], f"{time.time() - t0:.0f} s", flush=True)
    for name in ("lookup-broken", "medusa-broken"):
        engine = _compile(root, folder, name)
        rows = {}
        for s in SETTINGS:
            counts = engine_counts(engine, s, seed=3, v=8)
            full = {"p": chi_square(counts, laws[s])[0], "tv": chi_square(counts, laws[s])[1]}
            # power at fewer draws: the first n draws of the same run
            tests.stats.BATCHES, saved = 16, tests.stats.BATCHES
            small = chi_square(engine_counts(engine, s, seed=3, v=8), laws[s])[0]
            tests.stats.BATCHES = saved
            rows[str(s)] = {**full, "p_at_1024_draws": small}
        report["power"][name] = rows
        print(name, rows, flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
