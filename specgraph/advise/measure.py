"""What the advisor measures: runs of prompts (traces and times), call timing by batch, memory.

Engines run in the same process, one after another on the same prompts, in an order that rotates
from one prompt (or batch) to the next, so drift on the machine lands on every method alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from specgraph.advise.predict import Trace
from specgraph.errors import InputError
from specgraph.runtime import Engine, GenerationResult
from specgraph.sampling import SamplingParams
from specgraph.step import MAX_BATCH
from specgraph.timing import drafting, time_call

Tick = Callable[[], None]


def load_engines(bundles: list[Path], threads: int) -> tuple[dict[str, Engine], dict[str, float | None]]:
    """Each bundle's engine by method, and the resident memory (MB) loading it took. Exactly one
    must be `none` (the baseline), no method may come twice, and all must be the same model with
    the same weights and activations: otherwise InputError in one line."""
    engines: dict[str, Engine] = {}
    loaded: dict[str, float | None] = {}
    for path in bundles:
        before = rss_mb()
        engine = Engine(path, threads=threads)
        after = rss_mb()
        if engine.method in engines:
            raise InputError(f"{path} and {engines[engine.method].bundle} are both {engine.method} bundles; give one")
        engines[engine.method] = engine
        loaded[engine.method] = after - before if before is not None and after is not None else None
    if "none" not in engines:
        raise InputError("no `none` bundle among the bundles: the advisor measures every method against plain "
                         "decoding (specgraph compile MODEL -o DIR --method none)")  # fmt: skip
    if len(engines) < 2:
        raise InputError("only a `none` bundle given: add the bundles of the methods to compare")
    base = engines["none"]
    for engine in engines.values():
        difference = _model_difference(base, engine)
        if difference:
            raise InputError(f"{engine.bundle} is a bundle of another model than {base.bundle} ({difference})")
    return engines, loaded


def _model_difference(a: Engine, b: Engine) -> str | None:
    """What makes two bundles different models (source, vocabulary, weights, activations), or None."""
    checks = {
        "source": lambda e: e.manifest["source"].get("name"),
        "vocabulary size": lambda e: e.manifest["vocab_size"],
        "weights": lambda e: (e.manifest.get("weights") or {}).get("weights"),
        "activations": lambda e: (e.manifest.get("weights") or {}).get("activations"),
    }
    for what, read in checks.items():
        if read(a) != read(b):
            return f"{what}: {read(a)} against {read(b)}"
    return None


def check_batches(batches: list[int]) -> list[int]:
    """Sorted distinct batch sizes, each in [1, MAX_BATCH]; InputError otherwise."""
    for b in batches:
        if not 1 <= b <= MAX_BATCH:
            raise InputError(f"batch size {b} is outside what an engine takes (1 to {MAX_BATCH})")
    if not batches:
        raise InputError("--batch needs at least one batch size")
    return sorted(set(batches))


def run_batches(engines: dict[str, Engine], prompts: list[list[int]], batch: int, max_new_tokens: int,
                params: SamplingParams, tick: Tick) -> dict[str, list[list[GenerationResult]]]:  # fmt: skip
    """Every engine on `prompts` in batches of `batch` rows (consecutive prompts, cycling round
    to fill the last batch), the order of the engines rotating from batch to batch. Batch j is
    seeded with `params.seed + j` when sampling. Returns each method's results, batch by batch."""
    count = max(1, -(-len(prompts) // batch))
    names = list(engines)
    results: dict[str, list[list[GenerationResult]]] = {name: [] for name in names}
    for j in range(count):
        rows = [prompts[(j * batch + i) % len(prompts)] for i in range(batch)]
        seeded = params if params.seed is None else replace(params, seed=params.seed + j)
        for k in range(len(names)):
            name = names[(j + k) % len(names)]
            results[name].append(engines[name].generate_batch(rows, max_new_tokens, True, seeded))
            tick()
    return results


def traces(runs: list[list[GenerationResult]]) -> list[Trace]:
    """Batch-1 results as traces."""
    return [Trace(len(r.output_ids), tuple(r.accepted_per_step), r.prefill_s, r.decode_s) for (r,) in runs]


def step_s(runs: list[list[GenerationResult]]) -> float:
    """Mean seconds per engine call after prefill: a batch makes as many calls as its longest row."""
    calls = sum(max(r.steps for r in batch) for batch in runs)
    return decode_s(runs) / calls if calls else 0.0


def tau(runs: list[list[GenerationResult]]) -> float:
    """Tokens per call after prefill, pooled over every row."""
    steps = sum(r.steps for batch in runs for r in batch)
    return sum(max(len(r.output_ids) - 1, 0) for batch in runs for r in batch) / steps if steps else 1.0


def decode_s(runs: list[list[GenerationResult]]) -> float:
    """Seconds of decoding (after prefill) over all batches: a batch's rows share one time."""
    return sum(batch[0].decode_s for batch in runs)


def total_s(runs: list[list[GenerationResult]]) -> float:
    """Seconds of prefill and decoding over all batches."""
    return sum(batch[0].prefill_s + batch[0].decode_s for batch in runs)


def first_difference(runs: list[list[GenerationResult]], base: list[list[GenerationResult]]) -> int | None:
    """Index of the first row (counted over all batches) whose output differs from the baseline's."""
    rows = [r.output_ids for batch in runs for r in batch]
    base_rows = [r.output_ids for batch in base for r in batch]
    return next((i for i, (a, b) in enumerate(zip(rows, base_rows, strict=True)) if a != b), None)


def verify_width(engine: Engine, prompt: list[int]) -> int:
    """Tokens a steady-state call of this engine verifies per row: the width of what prefill
    feeds the next call (1 for plain decoding; drafts + 1 for a chain; the tree for Medusa)."""
    state = engine.new_state(1)
    out = engine.call(engine.session.io_binding(), engine.first_feeds(np.asarray([prompt], np.int64), len(prompt), 0),
                      state)  # fmt: skip
    return int(out["next_tokens"].shape()[1]) + engine.extra_slots


def call_times(engines: dict[str, Engine], widths: dict[str, int], context: int, batches: list[int], repeats: int,
               tick: Tick) -> dict[str, dict[int, float]]:  # fmt: skip
    """Median seconds of one call of each engine at its own width and `context`, for each batch
    size: the repeats go round every (engine, batch) point in turn. An adaptive engine's call is
    timed with its drafter running, the round the width stands for (`timing.drafting`)."""
    points = [(name, b) for name in engines for b in batches]
    times: dict[tuple[str, int], list[float]] = {p: [] for p in points}
    for _ in range(repeats):
        for name, b in points:
            engine = engines[name]
            room = engine.max_context - widths[name] - engine.extra_slots
            at = max(0, min(context, room))
            times[(name, b)].append(time_call(engine, widths[name], at, repeats=1, batch=b, fill=drafting(engine)))
            tick()
    return {name: {b: statistics.median(times[(name, b)]) for b in batches} for name in engines}


def rss_mb() -> float | None:
    """This process's resident memory now, in MB (1e6 bytes); None where /proc is missing."""
    return _proc_mb("/proc/self/status", "VmRSS:")


def available_mb() -> float | None:
    """Memory the system can still give (MemAvailable), in MB; None where /proc is missing."""
    return _proc_mb("/proc/meminfo", "MemAvailable:")


def _proc_mb(file: str, key: str) -> float | None:
    """The kB figure on the line of a /proc file that starts with `key`, in MB."""
    try:
        for line in Path(file).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return None
