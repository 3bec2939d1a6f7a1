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
# verify_cost_curve: untimed one-token calls that begin each round, at least this many and this long
SETTLE, SETTLE_S = 8, 0.08


def drafting(engine: Engine) -> dict[str, float]:
    """`time_call`'s `fill` that times an adaptive engine's call with its drafter running (empty
    for an engine without the adaptive gate)."""
    return {name: value for name, value in DRAFTING.items() if name in engine.manifest["graph"]["state"]}


class PreparedCall:
    """One engine call made ready to be timed again and again, as a decode loop makes it: `batch`
    rows verifying `n_tokens` tokens each at context `cache_len`, on random tokens, with the
    method's state at zero except the inputs `fill` names (every entry set to its value); greedy
    unless `params` ask to sample (they need a seed then). A warm-up call binds the state; each
    timed call binds only its own inputs. Calls may share one `state` (the same batch and
    sampling): the timed calls write the same cache positions."""

    def __init__(self, engine: Engine, n_tokens: int, cache_len: int, params: SamplingParams | None = None,
                 batch: int = 1, fill: dict[str, float] | None = None,
                 state: dict[str, Any] | None = None) -> None:  # fmt: skip
        if cache_len + n_tokens > engine.max_context:
            raise InputError(f"cannot time {n_tokens} tokens at context {cache_len}: "
                             f"max context is {engine.max_context}")  # fmt: skip
        self.engine = engine
        self.state = state if state is not None else engine.new_state(batch, engine.check_sampling(params))
        self.io = engine.session.io_binding()
        vocab = int(engine.manifest["vocab_size"])
        tokens = np.random.default_rng(0).integers(0, vocab, (batch, n_tokens), dtype=np.int64)
        self.feeds = engine.first_feeds(tokens, 1, cache_len)
        for name, value in (fill or {}).items():
            self.feeds[name] = np.full_like(self.feeds[name], value)
        # a warm-up call, which binds the state as a decode loop's first call does
        engine.call(self.io, self.feeds, self.state)

    def seconds(self) -> float:
        """Seconds of one more call."""
        start = time.perf_counter()
        self.engine.call(self.io, self.feeds, self.state, state_bound=True)
        return time.perf_counter() - start


def time_call(engine: Engine, n_tokens: int, cache_len: int, repeats: int = 10, params: SamplingParams | None = None,
              batch: int = 1, fill: dict[str, float] | None = None) -> float:  # fmt: skip
    """Median seconds of one engine call that verifies `n_tokens` tokens in each of `batch` rows
    at context `cache_len` (c(N) is this over N): a `PreparedCall`'s warm-up, then `repeats` timed
    calls."""
    call = PreparedCall(engine, n_tokens, cache_len, params, batch, fill)
    return float(np.median([call.seconds() for _ in range(repeats)]))


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
    always timed (the ratios need it). A wide call slows the calls after it: after one 64-token
    call the next six to eight one-token steps of an int8 engine ran 0.8-2.6 ms slower than their
    4 ms (in a slower hour, 0.4-3.0 ms over eight), after one 8-token call the next four 0.2-0.6
    ms. So each round first makes untimed one-token calls, at least SETTLE of them and SETTLE_S
    seconds' worth, then times a second call of each N after an untimed first, narrowest first: a
    call is never timed right after a wider one, and the penalty a narrower one leaves is small
    beside its own cost. (The first call after a change of width pays ONNX Runtime's change of
    shapes: on a tiny test model, whose call takes 0.2 ms, that alone read as c(2)/c(1) = 1.6-10
    and kept lookup from sending any draft.) c(N) is the median over `repeats` rounds; every
    call's state stays bound, as a decode loop's does.

    break_even_tau[N] is the mean accepted length (tokens per step) at which a step verifying N
    tokens just pays against plain decoding: tau / c(N) = 1 / c(1), so tau = c(N)/c(1) (drafting
    taken as free). A chain of N verified tokens accepts at most N a step, so where the ratio
    reaches N that size never pays."""
    fits = [n for n in sorted(set(ns) | {1}) if cache_len + n <= engine.max_context]
    state = engine.new_state(batch)
    calls = {n: PreparedCall(engine, n, cache_len, batch=batch, state=state) for n in fits}
    times: dict[int, list[float]] = {n: [] for n in fits}
    for _ in range(max(repeats, 1)):
        settling, spent = 0, 0.0
        while settling < SETTLE or spent < SETTLE_S:
            spent += calls[1].seconds()
            settling += 1
        for n in fits:
            calls[n].seconds()  # the first call of another width pays ONNX Runtime's change of shapes
            times[n].append(calls[n].seconds())
    by_n = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    base = by_n.get(1)
    ratio = {n: t / base for n, t in by_n.items()} if base else {}
    return {"cache_len": cache_len, "ms": by_n, "ratio": ratio, "break_even_tau": dict(ratio),
            "skipped": [n for n in ns if n not in fits]}  # fmt: skip


def interleaved_ms(
    engine: Engine, points: list[tuple[int, int]], repeats: int, batch: int = 1
) -> dict[tuple[int, int], float]:
    """Median ms of one engine call at each (tokens, context) point. The repeats go round the
    points in turn, so a burst of load elsewhere on the machine lands on every point alike
    instead of skewing one ratio. Each point is a `PreparedCall`, all on one state, made once:
    a fresh state for every timed call (the caches zeroed, the binding new) added 0.3-1.5 ms to
    an int8 engine's 4 ms call, which a decode loop never pays."""
    state = engine.new_state(batch)
    calls = {p: PreparedCall(engine, p[0], p[1], batch=batch, state=state) for p in points}
    times: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for _ in range(max(repeats, 1)):
        for p in points:
            times[p].append(calls[p].seconds() * 1e3)
    return {p: statistics.median(t) for p, t in times.items()}
