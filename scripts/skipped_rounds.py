"""What the holes that skipped rounds leave in a drafter's cache cost: one bundle built without
`--adaptive`, its drafter's cache restored after every call that `--adaptive` would run without the
drafter ('hole': the gate's `else` branch passing the cache through) or kept ('kept': the drafter's
own catch-up, as if it had run for free). Greedy; the output is the same either way.

    python scripts/skipped_rounds.py out/fp32-draft-k1 --threshold 0.48 --round-ms 33.7 --idle-ms 22.8
    python scripts/skipped_rounds.py out/fp32-draft-k4 --every 8     # one drafting round, then 8 skipped

With `--every N` a row drafts one round, then skips N. Otherwise the calls follow the adaptive rule
itself (`ModelDrafts._adapt`, with the threshold and the prompt's prior given), and the modelled
speed-up charges each drafting call `--round-ms` and each skipped one `--idle-ms` (a `none` step:
that is what the gate makes it). Prints, per prompt set and arm: drafting and skipped calls, drafts
accepted per drafting call, and the modelled speed-up over `none`.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import torch

from specgraph.bench import prompt_ids
from specgraph.methods.draft import ModelDrafts
from specgraph.runtime import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", help="a draft, eagle or early-exit bundle compiled without --adaptive")
    ap.add_argument("--prompts", default="humaneval,chat,creative,repeat")
    ap.add_argument("--limit", type=int, default=8, help="prompts per set (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--every", type=int, default=0, help="draft one call, then skip this many (0: the rule)")
    ap.add_argument("--threshold", type=float, default=0.5, help="the rule's threshold (drafts a round must accept)")
    ap.add_argument("--prior", type=float, default=None, help="what the prompt's round counts as accepting (default K)")
    ap.add_argument("--round-ms", type=float, default=1.5, help="a drafting call's cost (default 1.5)")
    ap.add_argument("--idle-ms", type=float, default=1.0, help="a skipped call's cost, a none step (default 1)")
    args = ap.parse_args()
    engine = Engine(args.bundle, threads=2)
    k = int(engine.manifest[engine.manifest["method"]]["num_draft"])
    rule = SimpleNamespace(num_draft=k, draft_threshold=torch.tensor([args.threshold]),
                           draft_prior=torch.tensor([float(k if args.prior is None else args.prior)]))  # fmt: skip
    for name in args.prompts.split(","):
        totals, texts = {}, {}
        for ids in prompt_ids(name, args.limit, engine, chat=True):
            for arm in ("hole", "kept"):
                emitted, counts = _generate(engine, ids, arm, rule, args)
                t = totals.setdefault(arm, np.zeros(4))
                t += [*counts, len(emitted)]
                texts.setdefault(arm, []).append(emitted)
        same = sum(a == b for a, b in zip(texts["hole"], texts["kept"], strict=True))
        cells = []
        for arm, (drafting, idle, accepted, tokens) in totals.items():
            cost = drafting * args.round_ms + idle * args.idle_ms
            cells.append(f"{arm}: drafting {drafting:.0f}, skipped {idle:.0f}, accepted {accepted / max(drafting, 1):.3f} "
                         f"a drafting call, modelled {tokens * args.idle_ms / cost:.3f}x")  # fmt: skip
        print(f"{name:10s} " + " | ".join(cells) + f" | identical {same}/{len(texts['hole'])}", flush=True)


def _generate(engine, ids, arm, rule, args):  # type: ignore[no-untyped-def]
    """One greedy reply; returns its tokens and (drafting calls, skipped calls, drafts accepted)."""
    state, io = engine.new_state(1), engine.session.io_binding()
    caches = [n for n in state if n.startswith("draft_past_")]
    adapt = [torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]
    feeds = engine.first_feeds(np.asarray([ids], np.int64), [len(ids)], 0)
    emitted, counts, width, call, at = [], [0, 0, 0], len(ids), 0, 0
    while len(emitted) < args.max_new_tokens:
        saved = {n: state[n].numpy().copy() for n in caches}
        out = engine.call(io, feeds, state)
        n = int(out["n_accepted"].numpy()[0])
        emitted += [int(t) for t in out["accepted"].numpy()[0, :n]]
        done = int(out["cache_len_out"].numpy()[0])
        if call > 0:
            counts[0 if width > 1 else 1] += 1
            counts[2] += done - at - 1 if width > 1 else 0
        if args.every:
            drafts = call % (args.every + 1) == 0
        else:
            *adapt, n_draft = ModelDrafts._adapt(rule, adapt, torch.zeros(1, width, dtype=torch.int64),
                                                 torch.tensor([at]), torch.tensor([done]))  # fmt: skip
            drafts = bool(n_draft[0] > 0)
        if not drafts and arm == "hole":  # the gate would have skipped the drafter in this call
            for name in caches:
                state[name].update_inplace(saved[name])
        width = int(out["next_tokens"].shape()[1]) if drafts else 1
        feeds = engine.next_feeds(out)  # a bundle without --adaptive trims nothing: cut next_tokens here
        feeds["tokens"] = np.ascontiguousarray(out["next_tokens"].numpy()[:, :width])
        call, at = call + 1, done
    return emitted[: args.max_new_tokens], counts


if __name__ == "__main__":
    main()
