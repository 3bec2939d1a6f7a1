"""The advisor's arithmetic: from measured traces and step times, the speed-up a method will give.

A run of one prompt is a `Trace`: the tokens each engine call emitted after prefill (an accepted
draft prefix plus the target's own token), the prefill time and the decode time. A method pays
where its tokens per call (tau) outgrow what a call costs against a plain one; everything here
follows from that one identity, applied to the traces themselves rather than to their means:

- decode time of a prompt capped at L new tokens = (calls needed to emit L - 1 tokens after the
  first, read off the trace) x step time;
- a batch of B rows runs in lockstep until its slowest row is done (`Engine.generate_batch`), so
  a batch costs the most calls any of its rows needs, at the step time of a B-row call;
- batches are drawn from the calibration prompts (every prompt alone for B = 1; otherwise
  `draws` seeded random groups), the same groups for `none` and the method, and the predicted
  speed-up is the ratio of the summed times.

Step times come from measurements: the method's own mean time per call while generating the
calibration prompts at each asked batch size, and between and beyond those, scaled by the ratio
of timed calls of the same engine at its full width (`scaled_step_s`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

DRAWS = 400  # random batches per prediction at B > 1
SEED = 0


@dataclass(frozen=True)
class Trace:
    """One prompt's run: `counts[i]` tokens emitted by call i after prefill; `new_tokens` in all
    (the first comes from prefill)."""

    new_tokens: int
    counts: tuple[int, ...]
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class Calibration:
    """A method's traces on the calibration prompts (index i = the same prompt for every method)."""

    traces: list[Trace] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(len(t.counts) for t in self.traces)

    @property
    def tau(self) -> float:
        """Tokens per engine call after prefill, pooled over the prompts."""
        return sum(max(t.new_tokens - 1, 0) for t in self.traces) / self.steps if self.steps else 1.0

    @property
    def step_s(self) -> float:
        """Mean seconds per engine call after prefill, pooled over the prompts."""
        return sum(t.decode_s for t in self.traces) / self.steps if self.steps else 0.0


def calls_for(counts: Sequence[int], tokens: int) -> int:
    """Engine calls after prefill that emit `tokens` tokens, read off a trace. A trace that ends
    first (the row stopped at EOS) needs all its calls."""
    if tokens <= 0:
        return 0
    emitted = 0
    for calls, count in enumerate(counts, 1):
        emitted += count
        if emitted >= tokens:
            return calls
    return len(counts)


def groups(n_prompts: int, batch: int, draws: int = DRAWS, seed: int = SEED) -> list[list[int]]:
    """The batches a prediction averages over: each prompt alone at batch 1, else `draws` seeded
    random groups of `batch` prompts (with replacement)."""
    if n_prompts < 1:
        raise ValueError("no calibration prompts")
    if batch == 1:
        return [[i] for i in range(n_prompts)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_prompts, batch).tolist() for _ in range(draws)]


def predicted_s(cal: Calibration, step_s: float, batches: list[list[int]], reply: int | None = None,
                prefill: bool = False) -> float:  # fmt: skip
    """Predicted seconds over `batches`: each costs the most calls any of its rows needs to emit
    its reply (capped at `reply` new tokens) times `step_s`, plus with `prefill` its rows'
    measured prefill (batch 1 only: a batched prefill is not measured)."""
    total = 0.0
    for rows in batches:
        calls = 0
        for i in rows:
            trace = cal.traces[i]
            length = trace.new_tokens if reply is None else min(reply, trace.new_tokens)
            calls = max(calls, calls_for(trace.counts, length - 1))
        total += calls * step_s
        if prefill:
            total += max(cal.traces[i].prefill_s for i in rows)
    return total


def scaled_step_s(measured: dict[int, float], timed: dict[int, float], batch: int) -> float:
    """A B-row call's seconds: the mean measured while generating at the largest batch size A <= B
    that was measured (1 always is), times timed(B) / timed(A) for the engine. Measured means
    carry what a timed call at the engine's full width does not: a chain trimmed to its real
    drafts (lookup) is narrow at batch 1 and nearly always full at batch 4."""
    anchor = max(a for a in measured if a <= batch)
    return measured[anchor] * timed[batch] / timed[anchor]


def speedup(none: Calibration, method: Calibration, none_step_s: float, method_step_s: float, batch: int = 1,
            reply: int | None = None, prefill: bool = False) -> float:  # fmt: skip
    """Predicted speed-up of `method` over `none` (ratio of times for the same tokens)."""
    if len(none.traces) != len(method.traces):
        raise ValueError("none and the method must be calibrated on the same prompts")
    batches = groups(len(none.traces), batch)
    mine = predicted_s(method, method_step_s, batches, reply, prefill)
    base = predicted_s(none, none_step_s, batches, reply, prefill)
    return base / mine if mine > 0 else float("inf")


def break_even_tau(none_step_s: float, method_step_s: float) -> float:
    """Tokens per call at which the method's call cost is just repaid: its step time over none's."""
    return method_step_s / none_step_s if none_step_s > 0 else float("inf")


def first_below(curve: dict[int, float], level: float = 1.0) -> int | None:
    """The smallest key (batch size, reply length) from which the curve stays below `level`;
    None if its last point is not below it."""
    keys = sorted(curve)
    if not keys or curve[keys[-1]] >= level:
        return None
    first = keys[-1]
    for key in reversed(keys):
        if curve[key] >= level:
            break
        first = key
    return first


def first_at_least(curve: dict[int, float], level: float = 1.0) -> int | None:
    """The smallest key from which the curve stays at or above `level`; None if its last point
    is below it."""
    keys = sorted(curve)
    if not keys or curve[keys[-1]] < level:
        return None
    first = keys[-1]
    for key in reversed(keys):
        if curve[key] < level:
            break
        first = key
    return first


def recommend(predicted: dict[str, float]) -> str:
    """The method with the highest predicted speed-up over `none`, or `none` if none beats 1.0."""
    best = max(predicted, key=lambda m: predicted[m], default="none")
    return best if predicted.get(best, 0.0) > 1.0 else "none"


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured if measured > 0 else float("inf")
