"""Speed-up of lookup bundles predicted from their own decisions, free of timing noise.

    python scripts/modelled_speedup.py out/i8-lookup-a out/i8-lookup-b --prompts humaneval,chat --limit 8

Each bundle generates greedily on every prompt (one run; greedy decisions do not depend on
timing); every decode call that verifies N tokens is charged c(N) / c(1) from a verify-cost
curve (the first bundle's `lookup.adaptive.cost`, or `--curve BUNDLE`'s), and the figure is the
tokens emitted per unit of charged cost, i.e. the speed-up over `none` if calls cost exactly the
curve. It compares draft-count rules on the same curve, where an interleaved timing run swings
more than the rules differ (docs/benchmarks.md); it ignores the host's time and context growth.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specgraph.bench import prompt_ids
from specgraph.runtime import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+", help="lookup bundles compiled with --adaptive (the default)")
    ap.add_argument("--curve", help="bundle whose lookup.adaptive.cost charges the calls (default: the first)")
    ap.add_argument("--prompts", default="humaneval,chat,creative,repeat", help="prompt sets, comma-separated")
    ap.add_argument("--limit", type=int, default=8, help="prompts per set (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    manifest = json.loads((Path(args.curve or args.bundles[0]) / "manifest.json").read_text())
    cost: list[float] = manifest["lookup"]["adaptive"]["cost"]
    table: dict[str, dict[str, float]] = {}
    for bundle in args.bundles:
        engine = Engine(bundle, threads=2)
        widths: list[int] = []
        call = engine.call

        def counted(io: Any, feeds: dict[str, Any], state: Any, call: Any = call, widths: list[int] = widths) -> Any:
            tokens = feeds["tokens"]  # an array, or an OrtValue bound from the last call's output
            widths.append(tokens.shape()[1] if callable(tokens.shape) else tokens.shape[1])
            return call(io, feeds, state)

        engine.call = counted  # type: ignore[method-assign]
        table[bundle] = {}
        for name in args.prompts.split(","):
            emitted, charged = 0, 0.0
            for ids in prompt_ids(name, args.limit, engine, chat=True):
                widths.clear()
                run = engine.generate(ids, max_new_tokens=args.max_new_tokens, stop_at_eos=False)
                emitted += len(run.output_ids) - 1  # the prefill's token is not a decode call's
                charged += sum(cost[w - 1] for w in widths[1:])  # widths[0]: the prefill
            table[bundle][name] = round(emitted / charged, 3)
        print(bundle, "  ".join(f"{k} {v:.3f}x" for k, v in table[bundle].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cost": cost, "modelled_speedup": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
