"""The advisor's report as text, and its plot (predicted against measured, and the two crossovers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specgraph.outputs import ADVICE_PLOT_SOFTWARE, Inputs
from specgraph.plot import check_plot_path, save_figure


def format_report(report: dict[str, Any]) -> str:
    """The recommendations first, then the warnings, then predicted against measured, cell by cell."""
    lines = [f"model {report['model']}: {', '.join(report['bundles'])} on {', '.join(report['sets'])}", ""]
    for r in report["recommendations"]:
        mark = "" if r["near_fastest"] else f" (measured fastest: {r['measured_fastest']})"
        lines.append(f"recommendation for {r['prompts']} at batch {r['batch']}: {r['method']}{mark}: {r['reason']}; "
                     f"measured {r['measured']:.2f}x")  # fmt: skip
    if report["warnings"]:
        lines += ["", "warnings:"] + [f"- {w}" for w in report["warnings"]]
    lines += ["", f"{'prompts':<12}{'method':<9}{'batch':>6}{'tau':>7}{'held-out':>9}{'break-even':>12}"
                  f"{'predicted':>11}{'measured':>10}{'error':>8}"]  # fmt: skip
    for name, result in report["sets"].items():
        for c in result["cells"]:
            same = "" if c["first_difference"] is None else f"  OUTPUT DIFFERS (row {c['first_difference']})"
            lines.append(f"{name:<12}{c['method']:<9}{c['batch']:>6}{c['tau']:>7.2f}{c['measured_tau']:>9.2f}"
                         f"{c['break_even_tau']:>12.2f}"
                         f"{c['predicted']:>10.2f}x{c['measured']:>9.2f}x{c['error'] * 100:>+7.1f}%{same}")  # fmt: skip
    a = report["accuracy"]
    lines += ["", f"predictions within 15% of the measurement: {a['within_15_percent']} of {a['cells']} "
                  f"(median error {a['median_abs_error'] * 100:.1f}%); recommendations within 5% of the measured "
                  f"fastest: {a['recommendations_near_fastest']} of {a['recommendations']}"]  # fmt: skip
    m = report["memory"]
    avail = f"{m['available_mb']:.0f} MB available" if m["available_mb"] is not None else "available memory unknown"
    parts = [f"{n} {v['need_mb']:.0f} MB ({v['state_mb_per_row']:.1f} MB cache per row)"
             for n, v in m.items() if isinstance(v, dict)]  # fmt: skip
    lines.append(f"memory at batch {m['batch']}: " + ", ".join(parts) + f"; {avail}")
    return "\n".join(lines)


def plot_advice(report: dict[str, Any], path: str | Path, inputs: Inputs = (), force: bool = False) -> Path:
    """Three panels: predicted against measured speed-up (every cell), the predicted speed-up
    against batch size (the crossover), and end to end against reply length (predicted curves,
    measured points). Written to exactly `path` under `specgraph.outputs`' rule."""
    out = check_plot_path(path, inputs, force)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cells, batch, reply) = plt.subplots(1, 3, figsize=(15, 4.2))
    top = 1.0
    for name, result in report["sets"].items():
        xs = [c["predicted"] for c in result["cells"]]
        ys = [c["measured"] for c in result["cells"]]
        top = max([top, *xs, *ys])
        cells.scatter(xs, ys, label=name)
        for m, curve in result["batch_curve"].items():
            line = batch.plot(list(map(int, curve)), list(curve.values()), marker="o", label=f"{name} {m}")[0]
            points = [(c["batch"], c["measured"]) for c in result["cells"] if c["method"] == m]
            batch.scatter(*zip(*points, strict=True), color=line.get_color(), marker="x", s=60)
        probe = result["reply_measured"]["method"]
        curve = result["reply_curve"][probe]
        line = reply.plot(list(map(int, curve)), list(curve.values()), label=f"{name} {probe} predicted")[0]
        measured = result["reply_measured"]["speedup"]
        reply.scatter(list(map(int, measured)), list(measured.values()), color=line.get_color(), marker="x")
    span = [0, top * 1.1]
    cells.plot(span, span, color="grey", linewidth=1)
    cells.fill_between(span, [v * 0.85 for v in span], [v * 1.15 for v in span], color="grey", alpha=0.15)
    cells.set(xlabel="predicted speed-up", ylabel="measured speed-up (held-out prompts)",
              title="predicted against measured (band: 15%)")  # fmt: skip
    cells.legend(fontsize=7)
    for ax, xlabel, title in ((batch, "batch size", "speed-up by batch (x: measured)"),
                              (reply, "reply length (tokens)", "end to end by reply length (x: measured)")):  # fmt: skip
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set(xlabel=xlabel, ylabel="speed-up over none", title=title)
        ax.legend(fontsize=7)
    return save_figure(fig, out, ADVICE_PLOT_SOFTWARE, inputs, force)
