"""How well an EAGLE drafter's confidence (its probability of its own top token) predicts
acceptance: teacher-forced on an engine's greedy replies to the bench prompts, by confidence bin,
at depth 1 (from the target's features) and depth 2 (from the drafter's own, after an accepted
depth 1). Prices Kangaroo's confidence stop without building it.

With --siblings, also prices the cheapest EAGLE-2 tree: more of the drafter's candidates at depth
1, verified beside its top one. It prints how often the target's token is among the drafter's
top W, and for each cut on the drafter's probability (send every other candidate at or above it)
the rows and accepted tokens a round gains and the speed-up over the chain's K = 1 round, from
--round (that round's cost in plain steps) and --row (what one more verified row costs).

    python scripts/draft_confidence.py out/fp32-none-now specgraph/data/heads/smollm2-135m-eagle.safetensors
    python scripts/draft_confidence.py out/s35-fp32-none specgraph/data/heads/smollm2-135m-eagle.safetensors \
        --limit 8 --siblings --round 1.185 --row 0.087
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from specgraph.bench import prompt_ids
from specgraph.default_model import DEFAULT_MODEL
from specgraph.methods.eagle import DRAFT_VOCAB
from specgraph.methods.eagle.drafter import load_drafter
from specgraph.methods.eagle.train import _batch
from specgraph.methods.teacher import load_teacher, target_features
from specgraph.runtime import Engine

WIDTHS = (1, 2, 3, 4, 6, 8)  # --siblings: top-W coverage
CUTS = (0.05, 0.08, 0.11, 0.15, 0.2, 0.3)  # --siblings: the drafter probabilities a sibling is sent from
BINS = [(0.0, 0.1), (0.1, 0.2), (0.2, 0.3), (0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (0.6, 0.8), (0.8, 1.01)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", help="a `none` bundle of the default model (writes the replies)")
    ap.add_argument("drafter", help="an EAGLE drafter file for the default model")
    ap.add_argument("--prompts", default="humaneval,chat,creative")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--siblings", action="store_true", help="also price siblings at depth 1 (see above)")
    ap.add_argument("--round", type=float, default=1.185, help="a K = 1 round's cost in plain steps")
    ap.add_argument("--row", type=float, default=0.087, help="one more verified row's cost in plain steps")
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = Engine(args.bundle, threads=2)
    teacher = load_teacher(DEFAULT_MODEL, None, DRAFT_VOCAB, "a confidence check")
    embed = teacher.hf.get_input_embeddings().weight.detach()
    lm_head = teacher.hf.get_output_embeddings()
    drafter = load_drafter(args.drafter, embed.shape[1], embed.shape[0]).eval()
    for name in args.prompts.split(","):
        seqs = [(p + list(engine.generate(p, args.max_new_tokens).output_ids), len(p) - 1)
                for p in prompt_ids(name, args.limit, engine, chat=True)]  # fmt: skip
        feats = target_features(teacher.hf, lm_head, seqs, 8, False, "features")
        conf: list[list[float]] = [[], []]
        hit: list[list[bool]] = [[], []]
        tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # depth 1: the top 8 probabilities, and hits
        with torch.no_grad():
            for i in range(0, len(feats), 8):
                emb, feat, _, label, real = _batch(embed, teacher.index, feats[i : i + 8], 0.0)
                pred = drafter.sequence(emb, feat)
                p1, top = torch.softmax(pred @ teacher.readout.T, -1).topk(max(WIDTHS), dim=-1)
                tops.append((p1[real], (top == label[..., None])[real]))
                c1, a1 = p1[..., 0], top[..., 0]
                own = torch.cat([feat[:, :1], pred[:, :-1]], dim=1)
                c2, a2 = torch.softmax(drafter.sequence(emb, own) @ teacher.readout.T, -1).max(-1)
                h1, h2 = a1 == label, a2 == label
                after = real[:, 1:] & h1[:, :-1]  # depth 2 at entry j + 1 follows an accepted depth 1 at j
                conf[0] += c1[real].tolist()
                hit[0] += h1[real].tolist()
                conf[1] += c2[:, 1:][after].tolist()
                hit[1] += h2[:, 1:][after].tolist()
        c, h = [np.array(x) for x in conf], [np.array(x, dtype=bool) for x in hit]
        print(f"{name}: {len(c[0])} drafts, depth 1 accepted {h[0].mean():.3f}; depth 2 after an accepted "
              f"depth 1: {h[1].mean() if len(h[1]) else 0:.3f} of {len(h[1])}")  # fmt: skip
        for lo, hi in BINS:
            cells = []
            for d in range(2):
                m = (c[d] >= lo) & (c[d] < hi)
                acc = f"{h[d][m].mean():.2f}" if m.any() else "  - "
                cells.append(f"depth {d + 1} share {m.mean() if len(m) else 0:.2f} accepted {acc}")
            print(f"  confidence [{lo:.1f}, {min(hi, 1):.1f}): " + " | ".join(cells))
        if args.siblings:
            _price_siblings(torch.cat([p for p, _ in tops]).numpy(), torch.cat([h for _, h in tops]).numpy(),
                            args.round, args.row)  # fmt: skip


def _price_siblings(probs: np.ndarray, hits: np.ndarray, round_cost: float, row_cost: float) -> None:
    """probs, hits [drafts, 8]: the drafter's top 8 at depth 1, and which is the target's token."""
    print("  top-W coverage at depth 1: " + "  ".join(f"W={w} {hits[:, :w].any(1).mean():.3f}" for w in WIDTHS))
    tau = 1 + hits[:, 0].mean()
    for cut in CUTS:
        sent = probs[:, 1:] >= cut
        rows, gained = sent.sum(1).mean(), (sent & hits[:, 1:]).sum(1).mean()
        speedup = (tau + gained) / (round_cost + row_cost * rows) * round_cost / tau
        print(
            f"  siblings from p >= {cut:.2f}: +{rows:.2f} rows, +{gained:.3f} tokens a round: {speedup:.3f}x the chain"
        )


if __name__ == "__main__":
    main()
