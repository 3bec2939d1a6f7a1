"""Where a speculative engine's decode time goes inside generation: each bundle generates the
same prompts in turn (greedy, `--rounds` times each), and every engine call after prefill is
recorded: its width (tokens it verifies), its time (`Engine.call`), and ONNX Runtime's
`run_with_iobinding` alone. Prints per bundle: calls by width with their median ms, the median
run time over all calls, the calls that verified drafts, the drafts they sent and how many of
those were accepted (first round only), and the mean decode time per call.

    python scripts/generation_calls.py out/s34-none out/s34-lookup2 --prompts chat
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

from specgraph.bench import prompt_ids
from specgraph.runtime import Engine


class _Timed:
    """An ONNX Runtime session that records how long each `run_with_iobinding` takes."""

    def __init__(self, inner: Any, runs: list[float]) -> None:
        self.inner, self.runs = inner, runs

    def run_with_iobinding(self, io: Any) -> None:
        start = time.perf_counter()
        self.inner.run_with_iobinding(io)
        self.runs.append(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _instrument(engine: Engine, calls: dict[int, list[float]], runs: list[float]) -> None:
    engine.session = _Timed(engine.session, runs)
    call = engine.call

    def timed(io: Any, feeds: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        tokens = feeds["tokens"]
        width = (tokens.shape() if callable(tokens.shape) else tokens.shape)[1]
        start = time.perf_counter()
        out = call(io, feeds, *args, **kwargs)
        calls[width].append(time.perf_counter() - start)
        return out

    engine.call = timed  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--prompts", default="chat")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engines = [Engine(b, threads=args.threads) for b in args.bundles]
    calls: list[dict[int, list[float]]] = [defaultdict(list) for _ in engines]
    runs: list[list[float]] = [[] for _ in engines]
    per_call: list[list[float]] = [[] for _ in engines]
    accepted = [0] * len(engines)
    for engine, c, r in zip(engines, calls, runs, strict=True):
        _instrument(engine, c, r)
    prompts = [ids for name in args.prompts.split(",") for ids in prompt_ids(name, args.limit, engines[0], chat=True)]
    for round_ in range(args.rounds):
        for ids in prompts:
            for i, engine in enumerate(engines):  # in turn, so a slow spell hits every bundle alike
                result = engine.generate(ids, args.max_new_tokens)
                per_call[i].append(result.decode_s / max(result.steps, 1))
                if round_ == 0:
                    accepted[i] += sum(n - 1 for n in result.accepted_per_step)
    longest_prompt = max(len(ids) for ids in prompts)
    for i, bundle in enumerate(args.bundles):
        # prefill calls are as wide as their prompts: a decode call verifies at most K + 1 tokens
        decode = {w: t for w, t in calls[i].items() if w < min(len(ids) for ids in prompts) or w == 1}
        drafting = {w: len(t) // args.rounds for w, t in decode.items() if w > 1}
        widths = "  ".join(f"{w}: {len(t)} x {statistics.median(t) * 1e3:.2f} ms" for w, t in sorted(decode.items()))
        print(f"{bundle}: mean decode call {statistics.median(per_call[i]) * 1e3:.2f} ms (median over replies); "
              f"run_with_iobinding median {statistics.median(runs[i]) * 1e3:.3f} ms; calls by width {widths}")  # fmt: skip
        print(f"  per round of the prompts: {sum(drafting.values())} calls verified drafts, "
              f"{sum((w - 1) * n for w, n in drafting.items())} drafts sent, {accepted[i]} accepted "
              f"(prompts up to {longest_prompt} tokens)")  # fmt: skip


if __name__ == "__main__":
    main()
