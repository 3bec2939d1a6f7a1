"""Calibration and power of the sampling test (tests/test_sampling.py), for docs/benchmarks.md.

Compiles the 8-token tiny model with each method (and with the two deliberately broken rules
the tests use), then reports for each engine and setting:
  - p-values of the chi-square test on many independent seeds (under a correct engine they
    should be uniform: about 5% below 0.05, 1% below 0.01; the test rejects below 1e-4),
  - for the broken rules, the p-value at several sample sizes (the test's power).

    python scripts/sampling_stats.py --seeds 20 --json docs/bench/sampling_stats.json
    python scripts/sampling_stats.py --power-only --json docs/bench/sampling_stats.json  (keeps calibration)
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import specgraph.sampling  # noqa: E402
import specgraph.step  # noqa: E402
import specgraph.step_tree  # noqa: E402
import tests.stats  # noqa: E402
from specgraph.compiler import compile_model  # noqa: E402
from specgraph.runtime import Engine  # noqa: E402
from tests.models.tiny import build, save  # noqa: E402
from tests.stats import PROMPT, chi_square, engine_counts, exact_joint, v8_config  # noqa: E402
from tests.test_sampling import (  # noqa: E402
    SETTINGS,
    _residual_forgotten,
    _residual_is_p,
    _siblings_as_if_alone,
    _uniform_reused,
)

BROKEN = {  # engine name -> (module, attribute, the broken stand-in the tests use)
    "lookup-broken": (specgraph.step, "_chain_targets", _residual_forgotten),
    "medusa-broken": (specgraph.step_tree, "_node_draw", _siblings_as_if_alone),
    "none-broken": (specgraph.sampling, "position_uniforms", _uniform_reused),
    "draft-broken": (specgraph.sampling, "residual", _residual_is_p),
}


def _compile(root: Path, folder: Path, name: str) -> Engine:
    cfg = v8_config(folder, root, name)
    module, attribute, stand_in = BROKEN.get(name, (None, "", None))
    original = getattr(module, attribute) if module else None
    if module:
        setattr(module, attribute, stand_in)
    try:
        compile_model(cfg)
    finally:
        if module:
            setattr(module, attribute, original)
    return Engine(root / name, threads=2)


def _test(counts: np.ndarray, law: np.ndarray) -> dict:
    """The suite's test; drawing a probability-0 sequence (which the suite fails at once) is p = 0."""
    try:
        p_value, tv = chi_square(counts, law)
    except AssertionError:
        return {"p": 0.0, "tv": None, "impossible_sequence_drawn": True}
    return {"p": p_value, "tv": tv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20, help="independent seeds per engine and setting")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--power-only", action="store_true", help="skip the calibration (keep it from --json)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sampling-stats-"))
    folder = save("llama-v8", root / "hf")
    model = build("llama-v8")
    laws = {s: exact_joint(model, PROMPT, s) for s in SETTINGS}
    report: dict = {"draws_per_check": tests.stats.ROWS * tests.stats.BATCHES, "settings": SETTINGS, "calibration": {},
                    "power": {}}  # fmt: skip
    if args.power_only and args.json and args.json.exists():
        report["calibration"] = json.loads(args.json.read_text())["calibration"]
    for name in () if args.power_only else ("none", "lookup", "medusa", "draft"):
        engine = _compile(root, folder, name)
        t0 = time.time()
        pvals = [chi_square(engine_counts(engine, s, seed=1000 + i, v=8), laws[s])[0]
                 for s in SETTINGS for i in range(args.seeds)]  # fmt: skip
        p = np.asarray(pvals)
        report["calibration"][name] = {"checks": len(p), "below_0.05": float((p < 0.05).mean()),
                                       "below_0.01": float((p < 0.01).mean()), "below_1e-4": int((p < 1e-4).sum()),
                                       "min_p": float(p.min()), "median_p": float(np.median(p))}  # fmt: skip
        print(name, report["calibration"][name], f"{time.time() - t0:.0f} s", flush=True)
    for name in BROKEN:
        engine = _compile(root, folder, name)
        rows = {}
        for s in SETTINGS:
            full = _test(engine_counts(engine, s, seed=3, v=8), laws[s])
            tests.stats.BATCHES, saved = 16, tests.stats.BATCHES  # power at 1,024 draws
            small = _test(engine_counts(engine, s, seed=3, v=8), laws[s])
            tests.stats.BATCHES = saved
            rows[str(s)] = {**full, "p_at_1024_draws": small["p"]}
        report["power"][name] = rows
        print(name, rows, flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
