"""Timing one engine call: the verify-cost curve c(N) that bench reports and `--tree auto` uses."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from specgraph.errors import InputError
from specgraph.runtime import Engine
from specgraph.sampling import SamplingParams

# state that keeps an adaptive row drafting (methods/draft.py ModelDrafts._adapt): timed with its
# state at zero, on random tokens, the rule would stop the row and the gate skip the drafter
DRAFTING = {"draft_score": 1e9}


def drafting(engine: Engine) -> dict[str, float]:
    """`time_call`'s `fill` that times an adaptive engine's call with its drafter running (empty
    for an engine without the adaptive gate)."""
    return {name: value for name, value in DRAFTING.items() if name in engine.manifest["graph"]["state"]}


def time_call(engine: Engine, n_tokens: int, cache_len: int, repeats: int = 10, params: SamplingParams | None = None,
              batch: int = 1, fill: dict[str, float] | None = None) -> float:  # fmt: skip
    """Median seconds of one engine call that verifies `n_tokens` tokens in each of `batch` rows
    at context `cache_len` (c(N) is this over N). Uses a zeroed cache and method state, except
    the state inputs `fill` names (every entry set to its value); greedy unless `params` ask to
    sample (they need a seed then). One untimed call warms the session up first and binds the
    state; the timed calls bind only their own inputs, as `generate`'s decode loop does."""
    if cache_len + n_tokens > engine.max_context:
        raise InputError(f"cannot time {n_tokens} tokens at context {cache_len}: max context is {engine.max_context}")
    state = engine.new_state(batch, engine.check_sampling(params))
    io = engine.session.io_binding()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, int(engine.manifest["vocab_size"]), (batch, n_tokens), dtype=np.int64)
    feeds = engine.first_feeds(tokens, 1, cache_len)
    for name, value in (fill or {}).items():
        feeds[name] = np.full_like(feeds[name], value)
    engine.call(io, feeds, state)  # warm-up, which binds the state as a decode loop's first call does
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.call(io, feeds, state, state_bound=True)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def verify_cost_curve(
    engine: Engine,
    ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    cache_len: int = 128,
    repeats: int = 10,
    batch: int = 1,
) -> dict[str, Any]:
    """c(N) of the engine at context `cache_len`, each call verifying N tokens in each of `batch`
    rows: {"cache_len", "ms": {N: ms}, "ratio": {N: c(N)/c(1)}, "break_even_tau": {N: tau},
    "skipped": [N...]}. N that do not fit in the engine's maximum context are skipped; N=1 is
    always timed (the ratios need it). Times are medians over `repeats` interleaved rounds.

    break_even_tau[N] is the mean accepted length (tokens per step) at which a step verifying N
    tokens just pays against plain decoding: tau / c(N) = 1 / c(1), so tau = c(N)/c(1) (drafting
    taken as free). A chain of N verified tokens accepts at most N a step, so where the ratio
    reaches N that size never pays."""
    fits = [n for n in sorted(set(ns) | {1}) if cache_len + n <= engine.max_context]
    ms = interleaved_ms(engine, [(n, cache_len) for n in fits], repeats, batch)
    by_n = {n: ms[(n, cache_len)] for n in fits}
    base = by_n.get(1)
    ratio = {n: t / base for n, t in by_n.items()} if base else {}
    return {"cache_len": cache_len, "ms": by_n, "ratio": ratio, "break_even_tau": dict(ratio),
            "skipped": [n for n in ns if n not in fits]}  # fmt: skip


def interleaved_ms(
    engine: Engine, points: list[tuple[int, int]], repeats: int, batch: int = 1
) -> dict[tuple[int, int], float]:
    """Median ms of one engine call at each (tokens, context) point. The repeats go round the
    points in turn (each a warmed single call), so a burst of load elsewhere on the machine
    lands on every point alike instead of skewing one ratio."""
    times: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for _ in range(max(repeats, 1)):
        for n, context in points:
            times[(n, context)].append(time_call(engine, n, context, repeats=1, batch=batch) * 1e3)
    return {p: statistics.median(t) for p, t in times.items()}
