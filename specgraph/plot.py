"""PNG plots for `specgraph bench --plot`: acceptance by tree depth, and speed-up by prompt set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specgraph.errors import OutputError
from specgraph.outputs import PLOT, PLOT_SOFTWARE, Inputs, check_output, write_file


def check_plot_path(path: str | Path, inputs: Inputs = (), force: bool = False) -> Path:
    """Where the plot goes: exactly `path` (no suffix is added), which must end in .png or have no
    suffix and be writable under `specgraph.outputs`' rule."""
    suffix = Path(path).suffix.lower()
    if suffix not in ("", ".png"):
        raise OutputError(f"--plot writes a PNG, so {path} must end in .png (or have no suffix), not {suffix}")
    return check_output(path, PLOT, inputs, force)


def plot_bench(results: dict[str, dict[str, Any]], path: str | Path, inputs: Inputs = (), force: bool = False) -> Path:
    """Write the plot to exactly `path` and return it. `results` maps a prompt-set name to
    `run_bench`'s result for it; `inputs` and `force` are as in `specgraph.outputs.check_output`."""
    out = check_plot_path(path, inputs, force)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in results.items():
        rates = result["aggregate"].get("acceptance_by_depth") or []
        left.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    left.set(xlabel="draft depth", ylabel="acceptance rate (given the parent accepted)", ylim=(0, 1.05),
             title="acceptance by depth")  # fmt: skip
    left.legend()
    names = list(results)
    speedups = [(results[n].get("reference") or {}).get("speedup_ratio_of_medians") or 0.0 for n in names]
    accepted = [results[n]["aggregate"].get("mean_accepted") or 0.0 for n in names]
    bars = right.bar(names, speedups, color="tab:blue")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    for bar, tau in zip(bars, accepted, strict=True):
        right.annotate(f"τ={tau:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    method = next(iter(results.values()))["method"] if results else ""
    right.set(ylabel="speed-up over the none engine (tokens/s)", title=f"{method}: speed-up by prompt set")
    return save_figure(fig, out, PLOT_SOFTWARE, inputs, force)


def save_figure(fig: Any, out: Path, software: str, inputs: Inputs = (), force: bool = False) -> Path:
    """Write a matplotlib figure as a PNG to exactly `out`, marked with `software`, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        # format given: matplotlib then writes exactly the name it is handed (no ".png" added);
        # the Software text marks the file as ours, so a later --plot may replace it
        write_file(out, lambda tmp: fig.savefig(tmp, dpi=120, format="png", metadata={"Software": software}),
                   PLOT, inputs, force)  # fmt: skip
    finally:
        plt.close(fig)
    return out
