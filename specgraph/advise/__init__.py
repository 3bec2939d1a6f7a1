"""`specgraph advise`: measured on the user's own prompts and machine, whether speculation pays.

For each prompt set the prompts are split in two, alternately: calibration (even positions) and
held-out (odd positions). On the calibration prompts, at batch 1, every bundle generates (the
`none` bundle and each method's): that gives each method's per-call trace (tokens per call, and
so acceptance by depth), its time per call and its prefill time. Each engine's call is then timed
at every batch size of a sweep, at the engine's own width. From these alone (`predict`) the
advisor predicts each method's speed-up over `none`: at the asked batch sizes, over the sweep
(where speculation stops paying: the batch crossover), and end to end, prefill included, over
reply lengths (the length below which it cannot pay). Then it measures the same speed-ups on the
held-out prompts, which the predictions never saw, and reports the error of each.

The recommendation for a prompt set and batch size is the method with the highest predicted
speed-up, or `none` when no method is predicted to beat plain decoding.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specgraph.advise import measure, predict
from specgraph.advise.predict import Calibration
from specgraph.bench import acceptance_by_depth, environment, prompt_ids, verify_cost_curve
from specgraph.errors import InputError
from specgraph.runtime import Engine
from specgraph.sampling import SamplingParams

FORMAT = 1  # the report's "advice" marker: what `specgraph.outputs` recognises as ours
SWEEP = (1, 2, 4, 8, 16, 32)  # batch sizes of the predicted crossover curve
VERIFY_NS = (1, 2, 4, 8, 16)  # c(N)/c(1) of the none engine, at each asked batch size
REPLIES = (2, 4, 8, 16, 32, 64)  # reply lengths of the end-to-end curve (those <= --max-new-tokens)
WITHIN = 0.15  # a prediction is good when within 15% of the measurement
NEAR_BEST = 0.05  # a recommendation is right when within 5% of the measured fastest


@dataclass(frozen=True)
class Settings:
    """What `specgraph advise` was asked: prompt sets, batch sizes, lengths, threads, sampling."""

    prompt_sets: list[str]
    batches: list[int] = field(default_factory=lambda: [1, 4])
    max_new_tokens: int = 64
    limit: int | None = None
    threads: int = 2
    chat: bool = True
    repeats: int = 3  # timed calls per (engine, batch) point
    memory_mb: float | None = None  # the memory to plan for; None = what the system has available now
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def check(self) -> Settings:
        if not self.prompt_sets:
            raise InputError("--prompts needs at least one prompt set")
        if self.max_new_tokens < 2:
            raise InputError(f"--max-new-tokens must be at least 2, got {self.max_new_tokens}")
        if self.memory_mb is not None and self.memory_mb <= 0:
            raise InputError(f"--memory-mb must be positive, got {self.memory_mb}")
        params = self.sampling.check()
        return Settings(self.prompt_sets, measure.check_batches(self.batches), self.max_new_tokens, self.limit,
                        self.threads, self.chat, self.repeats, self.memory_mb,
                        params if params.greedy else params.with_seed(default=0))  # fmt: skip


def run_advise(bundles: list[Path], settings: Settings, progress: bool = True) -> dict[str, Any]:
    """Calibrate, predict and validate every method of `bundles` (one must be `none`) on each
    prompt set; return the JSON-ready report (see the module docstring)."""
    s = settings.check()
    available = s.memory_mb if s.memory_mb is not None else measure.available_mb()
    engines, loaded = measure.load_engines(bundles, s.threads)
    for engine in engines.values():
        engine.check_sampling(s.sampling)
    base = engines["none"]
    sets_ids = {name: _split(name, prompt_ids(name, s.limit, base, s.chat), base, s) for name in s.prompt_sets}
    sizes = sorted(set(SWEEP) | set(s.batches))
    replies = [r for r in REPLIES if r < s.max_new_tokens] + [s.max_new_tokens]
    total = sum(
        _work(len(engines), len(c), len(h), s.batches, sizes, s.repeats, len(replies)) for c, h in sets_ids.values()
    )
    bar = tqdm(total=total, desc="advise", unit="run", file=sys.stderr, disable=not progress)
    try:
        _warm_up(engines, next(iter(sets_ids.values()))[0][0], s)
        sets = {name: _advise_set(engines, cal, held, s, sizes, replies, bar) for name, (cal, held) in sets_ids.items()}
    finally:
        bar.close()
    memory = _memory(engines, loaded, max(s.batches), available)
    report: dict[str, Any] = {
        "advice": FORMAT,
        "bundles": {name: str(e.bundle) for name, e in engines.items()},
        "model": base.manifest["source"].get("name"),
        "settings": {
            "prompt_sets": s.prompt_sets,
            "batches": s.batches,
            "max_new_tokens": s.max_new_tokens,
            "limit": s.limit,
            "threads": s.threads,
            "chat": s.chat,
            "repeats": s.repeats,
            "sampling": s.sampling.as_dict(),
            "sweep": sizes,
            "replies": replies,
        },
        "environment": environment(),
        "memory": memory,
        "sets": sets,
    }
    report["recommendations"] = _recommendations(sets, s.batches)
    report["warnings"] = _warnings(sets, memory, s.batches)
    report["accuracy"] = _accuracy(sets, report["recommendations"])
    return report


def _split(name: str, ids: list[list[int]], engine: Engine, s: Settings) -> tuple[list[list[int]], list[list[int]]]:
    """Calibration (even positions) and held-out (odd positions) prompts that fit with their reply."""
    room = engine.max_context - s.max_new_tokens - 64  # and room for a round's drafts (a tree) past the reply
    fit = [p for p in ids if 0 < len(p) < room]
    if len(fit) < 2:
        raise InputError(f"{name}: the advisor needs at least 2 prompts that fit in the engine's context "
                         f"({len(fit)} of {len(ids)} do): half calibrate, half validate")  # fmt: skip
    return fit[0::2], fit[1::2]


def _work(engines: int, cal: int, held: int, batches: list[int], sizes: list[int], repeats: int, replies: int) -> int:
    """Progress-bar units of one prompt set: one per generate call or timed call."""
    held_runs = sum(-(-held // b) for b in batches) * engines
    cal_runs = (cal + sum(-(-cal // b) for b in batches if b > 1)) * engines
    return cal_runs + repeats * engines * len(sizes) + len(batches) + held_runs + replies * held * 2


def _warm_up(engines: dict[str, Engine], prompt: list[int], s: Settings) -> None:
    """A short generate per engine at every asked batch size before anything is timed: ONNX
    Runtime allocates on the first call of each shape. Without it (docs/benchmarks.md, the
    advisor section), Medusa's batch-4 cost over none's read 3.2 on the calibration runs, the
    first at that size, and about 3.9 on the held-out runs after them."""
    for engine in engines.values():
        for b in s.batches:
            engine.generate_batch([prompt] * b, 16, False, s.sampling)


def _advise_set(engines: dict[str, Engine], cal: list[list[int]], held: list[list[int]], s: Settings,
                sizes: list[int], replies: list[int], bar: Any) -> dict[str, Any]:  # fmt: skip
    """Calibration, predictions and held-out measurements for one prompt set."""
    tick = lambda n=1: bar.update(n)  # noqa: E731
    methods = [name for name in engines if name != "none"]
    cals = {m: Calibration(measure.traces(r)) for m, r in measure.run_batches(engines, cal, 1, s.max_new_tokens,
                                                                             s.sampling, tick).items()}  # fmt: skip
    widths = {m: measure.verify_width(e, cal[0]) for m, e in engines.items()}
    context = int(statistics.median(len(p) for p in cal)) + s.max_new_tokens // 2
    timed = measure.call_times(engines, widths, context, sizes, s.repeats, tick)
    verify = {b: verify_cost_curve(engines["none"], VERIFY_NS, context, s.repeats, b)["ratio"] for b in s.batches}
    tick(len(s.batches))
    measured_step = {m: {1: cals[m].step_s} for m in engines}
    for b in s.batches:
        if b > 1:  # the mean call at this batch size, generating the calibration prompts
            for m, batches in measure.run_batches(engines, cal, b, s.max_new_tokens, s.sampling, tick).items():
                measured_step[m][b] = measure.step_s(batches)
    step = {m: {b: predict.scaled_step_s(measured_step[m], timed[m], b) for b in sizes} for m in engines}
    predicted = {b: {m: predict.speedup(cals["none"], cals[m], step["none"][b], step[m][b], b) for m in methods}
                 for b in sizes}  # fmt: skip
    end_to_end = {m: {r: predict.speedup(cals["none"], cals[m], step["none"][1], step[m][1], 1, r, prefill=True)
                      for r in replies} for m in methods}  # fmt: skip
    cells = []
    for b in s.batches:
        runs = measure.run_batches(engines, held, b, s.max_new_tokens, s.sampling, tick)
        base = measure.decode_s(runs["none"])
        for m in methods:
            measured = base / measure.decode_s(runs[m])
            same = measure.first_difference(runs[m], runs["none"]) if s.sampling.greedy else None
            cells.append({
                "method": m, "batch": b, "tau": round(cals[m].tau, 4),
                "break_even_tau": round(predict.break_even_tau(step["none"][b], step[m][b]), 4),
                "measured_tau": round(measure.tau(runs[m]), 4),
                "predicted": round(predicted[b][m], 4), "measured": round(measured, 4),
                "error": round(predict.relative_error(predicted[b][m], measured), 4),
                "first_difference": same,
            })  # fmt: skip
    best = predict.recommend(predicted[1] if 1 in predicted else predicted[s.batches[0]])
    probe = best if best != "none" else max(methods, key=lambda m: predicted[sizes[0]][m])
    measured_replies = _measure_replies(engines, probe, held, replies, s, tick)
    return {
        "calibration_prompts": len(cal),
        "held_out_prompts": len(held),
        "methods": {
            m: {
                "tau": round(cals[m].tau, 4),
                "step_ms": round(cals[m].step_s * 1e3, 3),
                "prefill_ms": round(statistics.median(t.prefill_s for t in cals[m].traces) * 1e3, 3),
                "width": widths[m],
                "acceptance_by_depth": acceptance_by_depth(
                    [c for t in cals[m].traces for c in t.counts], engines[m].draft_depth
                ),
            }
            for m in engines
        },
        "timed_call_ms": {m: {b: round(t * 1e3, 3) for b, t in timed[m].items()} for m in engines},
        "context": context,
        "verify_cost": {b: {n: round(r, 4) for n, r in curve.items()} for b, curve in verify.items()},
        "cells": cells,
        "batch_curve": {m: {b: round(predicted[b][m], 4) for b in sizes} for m in methods},
        "batch_crossover": {m: predict.first_below({b: predicted[b][m] for b in sizes}) for m in methods},
        "reply_curve": {m: {r: round(v, 4) for r, v in end_to_end[m].items()} for m in methods},
        "reply_measured": {"method": probe, "speedup": {r: round(v, 4) for r, v in measured_replies.items()}},
        "reply_crossover": {m: predict.first_at_least(end_to_end[m]) for m in methods},
        "reply_crossover_measured": predict.first_at_least(measured_replies),
    }


def _measure_replies(engines: dict[str, Engine], method: str, held: list[list[int]], replies: list[int],
                     s: Settings, tick: Any) -> dict[int, float]:  # fmt: skip
    """End-to-end speed-up (prefill and decoding) of `method` over `none` on the held-out
    prompts at batch 1, for each reply length."""
    pair = {"none": engines["none"], method: engines[method]}
    out = {}
    for r in replies:
        runs = measure.run_batches(pair, held, 1, r, s.sampling, tick)
        out[r] = measure.total_s(runs["none"]) / measure.total_s(runs[method])
    return out


def _memory(engines: dict[str, Engine], loaded: dict[str, float | None], batch: int,
            available: float | None) -> dict[str, Any]:  # fmt: skip
    """Each engine's weights, cache per row and loaded resident memory; what it needs at the
    largest batch asked, and whether that fits in the memory available."""
    out: dict[str, Any] = {"available_mb": round(available, 1) if available is not None else None, "batch": batch}
    for name, e in engines.items():
        weights = e.weight_bytes / 1e6
        state = e.state_bytes_per_row / 1e6
        need = weights + state * batch
        rss = loaded[name]
        out[name] = {"weights_mb": round(weights, 1), "state_mb_per_row": round(state, 2),
                     "loaded_rss_mb": round(rss, 1) if rss is not None else None,
                     "need_mb": round(need, 1), "fits": None if available is None else need <= available}  # fmt: skip
    base = out["none"]["need_mb"]
    for name in engines:
        out[name]["extra_mb"] = round(out[name]["need_mb"] - base, 1)
    return out


def _recommendations(sets: dict[str, Any], batches: list[int]) -> list[dict[str, Any]]:
    """One recommendation per prompt set and batch size, with its reason and how it measured."""
    out = []
    for name, result in sets.items():
        for b in batches:
            cells = [c for c in result["cells"] if c["batch"] == b]
            predicted = {c["method"]: c["predicted"] for c in cells}
            measured = {"none": 1.0, **{c["method"]: c["measured"] for c in cells}}
            pick = predict.recommend(predicted)
            fastest = max(measured, key=lambda m: measured[m])
            out.append({
                "prompts": name, "batch": b, "method": pick, "reason": _reason(pick, cells),
                "predicted": 1.0 if pick == "none" else predicted[pick], "measured": measured[pick],
                "measured_fastest": fastest,
                "near_fastest": measured[pick] >= (1 - NEAR_BEST) * measured[fastest],
            })  # fmt: skip
    return out


def _reason(pick: str, cells: list[dict[str, Any]]) -> str:
    """One sentence: why this method (its tokens per call against what a call costs), or why none."""
    if pick != "none":
        c = next(c for c in cells if c["method"] == pick)
        return (f"{pick} emits {c['tau']:.2f} tokens per call where a call costs {c['break_even_tau']:.2f} plain "
                f"steps, so it is predicted {c['predicted']:.2f}x plain decoding")  # fmt: skip
    best = max(cells, key=lambda c: c["predicted"])
    return (f"no method pays: the best, {best['method']}, emits {best['tau']:.2f} tokens per call but a call costs "
            f"{best['break_even_tau']:.2f} plain steps (predicted {best['predicted']:.2f}x)")  # fmt: skip


def _warnings(sets: dict[str, Any], memory: dict[str, Any], batches: list[int]) -> list[str]:
    """The article's warnings, each from a measurement: batch crossover, short replies, prompt
    sets with too little acceptance, memory."""
    out = []
    for name, r in sets.items():
        for m, b in r["batch_crossover"].items():
            if b is not None and b > 1:
                out.append(
                    f"{name}: {m} stops paying from batch {b} on (predicted {r['batch_curve'][m][b]:.2f}x there)"
                )
        probe = r["reply_measured"]["method"]
        cross = r["reply_crossover"].get(probe)
        if cross is not None and cross > min(r["reply_curve"][probe]):
            seen = r["reply_crossover_measured"]
            seen_text = f"from {seen}" if seen is not None else f"at no length up to {max(r['reply_curve'][probe])}"
            out.append(f"{name}: replies shorter than {cross} tokens do not pay with {probe} (prefill and the "
                       f"first calls dominate; measured: pays {seen_text})")  # fmt: skip
        at_one = [c for c in r["cells"] if c["batch"] == min(batches)]
        if at_one and all(c["predicted"] < 1.0 for c in at_one):
            best = max(at_one, key=lambda c: c["predicted"])
            out.append(f"{name}: acceptance too low for any method to pay (best {best['method']}: tau {best['tau']:.2f} "
                       f"against a break-even of {best['break_even_tau']:.2f})")  # fmt: skip
    for name, m in memory.items():
        if isinstance(m, dict) and m.get("fits") is False:
            out.append(f"{name} needs {m['need_mb']:.0f} MB at batch {memory['batch']} (weights and caches), more "
                       f"than the {memory['available_mb']:.0f} MB available")  # fmt: skip
    return out


def _accuracy(sets: dict[str, Any], recommendations: list[dict[str, Any]]) -> dict[str, Any]:
    """How good the predictions were: cells within 15% of the measurement, and recommendations
    within 5% of the measured fastest."""
    cells = [c for r in sets.values() for c in r["cells"]]
    within = sum(abs(c["error"]) <= WITHIN for c in cells)
    return {
        "cells": len(cells),
        "within_15_percent": within,
        "median_abs_error": round(statistics.median(abs(c["error"]) for c in cells), 4) if cells else None,
        "recommendations": len(recommendations),
        "recommendations_near_fastest": sum(r["near_fastest"] for r in recommendations),
    }
