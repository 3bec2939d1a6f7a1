"""`specgraph compile --method auto`: compile the candidates, advise on the user's prompts, keep
the method that measured fastest.

The candidates are `none` and every advised method (`advise.bundles.default_methods`), compiled
with the same settings into a candidates folder (reused when already there). The advisor runs at
batch 1 on the given prompt sets; the pick is the method whose measured speed-up over `none`
on the held-out prompts has the highest geometric mean over the sets (`none` counts 1.0), so a
method that pays on one set and loses more on another is not picked. The picked bundle is
copied to the output, which follows `specgraph.outputs`' rule like any bundle.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from specgraph.advise import Settings, run_advise
from specgraph.advise.bundles import Compile, resolve
from specgraph.errors import InputError
from specgraph.outputs import BUNDLE, check_output, replace_dir, staging_dir


def pick(report: dict[str, Any]) -> str:
    """The method with the highest geometric mean of measured speed-ups at batch 1 (none = 1.0)."""
    scores: dict[str, float] = {"none": 0.0}
    for result in report["sets"].values():
        for cell in result["cells"]:
            if cell["batch"] == 1:
                scores[cell["method"]] = scores.get(cell["method"], 0.0) + math.log(cell["measured"])
    return max(scores, key=lambda m: scores[m])


def compile_auto(model: str, output: Path, folder: Path, settings: Settings, compile_one: Compile,
                 shared: dict[str, Any], force: bool = False, progress: bool = True) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """Compile the candidates into `folder`, advise on `settings`' prompts, and copy the picked
    bundle to `output`. Returns the pick and the advisor's report (with `skipped`: the candidates
    that cannot be compiled for this model, and why)."""
    inputs: list[str | Path | None] = [model, folder]
    out = check_output(output, BUNDLE, inputs, force)
    skipped: dict[str, str] = {}
    bundles = resolve([model], None, folder, compile_one, shared, skipped.__setitem__)
    if len(bundles) < 2:
        raise InputError(f"no speculative method can be compiled for {model}: " + "; ".join(skipped.values()))
    report = run_advise(bundles, settings, progress)
    report["skipped"] = skipped
    method = pick(report)
    chosen = dict(zip([b.name for b in bundles], bundles, strict=True))[method]
    staging = staging_dir(out)
    try:
        shutil.copytree(chosen, staging, dirs_exist_ok=True)
        replace_dir(staging, out, inputs, force)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return method, report
