"""Timing one engine call: the verify-cost curve c(N) that bench reports and `--tree auto` uses."""

from __future__ import annotations

import time

import numpy as np

from specgraph.errors import InputError
from specgraph.runtime import Engine
from specgraph.sampling import SamplingParams


def time_call(engine: Engine, n_tokens: int, cache_len: int, repeats: int = 10, params: SamplingParams | None = None,
              batch: int = 1, fill: dict[str, float] | None = None) -> float:  # fmt: skip
    """Median seconds of one engine call that verifies `n_tokens` tokens in each of `batch` rows
    at context `cache_len` (c(N) is this over N). Uses a zeroed cache and method state, except
    the state inputs `fill` names (every entry set to its value); greedy unless `params` ask to
    sample (they need a seed then). One untimed call warms the session up first."""
    if cache_len + n_tokens > engine.max_context:
        raise InputError(f"cannot time {n_tokens} tokens at context {cache_len}: max context is {engine.max_context}")
    state = engine.new_state(batch, engine.check_sampling(params))
    io = engine.session.io_binding()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, int(engine.manifest["vocab_size"]), (batch, n_tokens), dtype=np.int64)
    feeds = engine.first_feeds(tokens, 1, cache_len)
    for name, value in (fill or {}).items():
        feeds[name] = np.full_like(feeds[name], value)
    engine.call(io, feeds, state)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.call(io, feeds, state)
        times.append(time.perf_counter() - start)
    return float(np.median(times))
