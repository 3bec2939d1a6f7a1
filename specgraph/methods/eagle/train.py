"""Train an EAGLE drafter on the frozen target's teacher-forced features.

1. Text and features (`methods/teacher.py`, shared with Medusa and early exit): `--corpus-mb` MB
   of the Python standard library's sources in `--seq-len` windows and the target's own replies
   to the training prompts; at every position the LM head's input (the feature, after the final
   norm) and the target's argmax token there. Whole sequences of each kind are held out.
2. Only the drafter learns. Entry j = (feature f_j + noise, embedding of x_{j+1}) predicts f_{j+1}:
   loss = SmoothL1(f', f_{j+1}) + CE_WEIGHT * CE(readout(f'), token target at j+1), the readout
   being the rows of the target's LM head for the reduced draft vocabulary. The token target is
   the target's argmax (`token_loss="argmax"`; a token outside the draft vocabulary is ignored by
   the loss and counted as a miss) or its whole distribution over the draft vocabulary
   (`"distribution"`, EAGLE's own classification loss: the readout of f_{j+1}). With `depth` 2 or
   more the drafter also trains on what it meets when drafting further (EAGLE-3's "training-time
   test"): pass d reads the features pass d - 1 predicted, shifted by one entry, and its loss is
   added. Noise on the input features (EAGLE's remedy for drafting from its own, imperfect
   features) and AdamW with cosine decay.
3. Held-out acceptance by depth: depth 1 drafts from the target's true features, depth 2 from the
   drafter's own predicted ones (as every later draft step does); the chain's expected tokens per
   round follow from them. Measured `--curve` times during training: acceptance against training
   tokens, with the seconds each point took.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specgraph.errors import InputError
from specgraph.methods.eagle.drafter import EagleDrafter, Shape, save_drafter
from specgraph.methods.teacher import (
    IGNORE,
    Schedule,
    Text,
    check_run,
    corpus_meta,
    fit,
    load_teacher,
    save_and_report,
    teacher_sets,
)

CE_WEIGHT = 0.3  # the token loss beside the feature regression
LR = 1e-3  # the peak learning rate (`--lr`)
NOISE = 0.1  # std of the Gaussian noise on input features, relative to their RMS
TOKEN_LOSSES = ("argmax", "distribution")
MAX_DEPTH = 4  # training passes (`Schedule.depth`): the engine drafts at most a few tokens deep


def train_eagle(
    model: str,
    output: str | Path,
    prompts: str = "train",
    corpus_mb: float = 1.0,
    max_new_tokens: int = 128,
    epochs: int = 2,
    lr: float = LR,
    seq_len: int = 256,
    batch_size: int = 8,
    holdout: float = 0.05,
    draft_vocab_size: int | None = None,
    curve: int = 4,
    threads: int = 2,
    seed: int = 0,
    engine_bundle: str | None = None,
    progress: bool = True,
    command: str | None = None,
    force: bool = False,
    samples: int = 0,
    functions: int = 0,
    token_loss: str = "argmax",
    depth: int = 1,
) -> dict[str, Any]:
    """Train an EAGLE drafter for `model` and save it to `output` (safetensors). Returns its meta
    plus the losses and timings. `draft_vocab_size`: tokens the readout scores (None: the
    default reduced vocabulary where the model has a ranking, else all; 0: all). `engine_bundle`:
    a compiled `none` bundle of the model to generate the replies with (default: one is compiled).
    `samples`: sampled replies per training prompt beside the greedy one; `functions`: code requests
    made from the standard library's documented functions, answered by the target (`Text`).
    `token_loss`, `depth`: what the drafter learns from (`Schedule`)."""
    text = Text(prompts, corpus_mb, max_new_tokens, seq_len, holdout, seed, samples, functions)
    schedule = Schedule(epochs, lr, batch_size, curve, token_loss, depth)
    if schedule.token_loss not in TOKEN_LOSSES:
        raise InputError(f"--token-loss must be one of {', '.join(TOKEN_LOSSES)}, got {schedule.token_loss!r}")
    if not 1 <= schedule.depth <= MAX_DEPTH:
        raise InputError(f"--train-depth must be 1 to {MAX_DEPTH}, got {schedule.depth}")
    inputs, output = check_run(model, output, text, schedule, threads, engine_bundle, force)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    timings: dict[str, float] = {}
    rng = random.Random(seed)
    torch.manual_seed(seed)
    try:
        t0 = time.perf_counter()
        from specgraph.methods.eagle import DRAFT_VOCAB

        teacher = load_teacher(model, draft_vocab_size, DRAFT_VOCAB, "an EAGLE drafter")
        loaded, hf, index, readout = teacher.loaded, teacher.hf, teacher.index, teacher.readout
        embed = hf.get_input_embeddings().get_parameter("weight").detach()  # [V, H], frozen
        vocab, hidden = teacher.lm_weight.shape
        timings["load_s"] = time.perf_counter() - t0

        train, held, info = teacher_sets(model, loaded, text, output, batch_size, threads, engine_bundle, progress,
                                         (inputs, force))  # fmt: skip
        timings.update(info.pop("timings"))

        drafter = EagleDrafter(Shape.for_model(hf.config, hidden, vocab))
        t0 = time.perf_counter()
        losses, points = _train(drafter, embed, readout, index, train, held, schedule, rng, progress)
        timings["train_s"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(old_threads)
    final = points[-1]
    train_tokens = sum(len(s[0]) - 1 - s[3] for s in train)  # the entries the loss counts
    meta: dict[str, Any] = {
        "model": loaded.name,
        "fingerprint": teacher.fingerprint,
        "shape": asdict(drafter.shape),
        "acceptance": final["acceptance"],  # per held-out set: [depth 1, depth 2]
        "expected_tokens": final["expected_tokens"],
        "train_tokens": train_tokens,
        "corpus": corpus_meta(text, info),
        "draft_vocab": teacher.vocab_meta(),
        "training": {"token_loss": token_loss, "depth": depth, "epochs": epochs},
        "curve": points,
        "command": command or f"specgraph train --method eagle {model} -o {output}",
    }
    save = lambda tmp: save_drafter(tmp, drafter, meta)  # noqa: E731
    return save_and_report(
        output, save, meta, losses, info, timings, (inputs, force), format_curve if progress else None
    )


def _batch(embed, index, seqs, noise):  # type: ignore[no-untyped-def]
    """Padded entries of sequences: inputs (embedding of x_{j+1}, feature f_j + noise), targets
    (f_{j+1}, draft index of the target's argmax at j+1), and which entries count."""
    width = max(len(s[0]) for s in seqs) - 1
    b, h = len(seqs), embed.shape[1]
    emb, feat, goal = torch.zeros(b, width, h), torch.zeros(b, width, h), torch.zeros(b, width, h)
    label = torch.full((b, width), IGNORE, dtype=torch.int64)
    real = torch.zeros(b, width, dtype=torch.bool)
    for i, (tokens, f, top, first) in enumerate(s[:4] for s in seqs):
        n = len(tokens) - 1
        emb[i, :n] = embed[tokens[1:]]
        f = f.to(torch.float32)
        feat[i, :n], goal[i, :n] = f[:-1], f[1:]
        label[i, :n] = index[top[1:]]
        real[i, first:n] = True  # entries before `first` (a reply's prompt) are context only
    if noise:
        rms = feat.pow(2).mean(-1, keepdim=True).sqrt()
        feat = feat + torch.randn_like(feat) * noise * rms
    return emb, feat, goal, label, real


def _train(drafter, embed, readout, index, train, held, schedule, rng, progress):  # type: ignore[no-untyped-def]
    soft = schedule.token_loss == "distribution"

    def loss_of(batch):  # type: ignore[no-untyped-def]
        emb, feat, goal, label, real = _batch(embed, index, batch, NOISE)
        wanted = torch.softmax(goal @ readout.T, dim=-1) if soft else label  # [b, W, V_d] or [b, W]
        total, inputs = 0.0, feat
        for d in range(schedule.depth):  # pass d drafts d + 1 deep: entry j reads pass d - 1's f'_j
            pred = drafter.sequence(emb, inputs)
            counted = real.clone()
            counted[:, :d] = False
            reg = torch.nn.functional.smooth_l1_loss(pred[counted], goal[counted])
            logits = (pred @ readout.T)[counted]
            if soft:
                ce = -(wanted[counted] * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
            else:
                ce = torch.nn.functional.cross_entropy(logits, label[counted], ignore_index=IGNORE)
            total = total + reg + CE_WEIGHT * ce
            inputs = torch.cat([feat[:, :1], pred[:, :-1]], dim=1)
        return total / schedule.depth, int(real.sum())

    evaluate = lambda: _evaluate(drafter, embed, readout, index, held, schedule.batch_size)  # noqa: E731
    return fit(drafter, loss_of, evaluate, train, schedule, rng, progress)


@torch.no_grad()
def _evaluate(drafter, embed, readout, index, held, batch_size):  # type: ignore[no-untyped-def]
    """Held-out acceptance per set: depth 1 (from the target's features) and depth 2 (from the
    drafter's own), and the expected tokens per round of a 4-token chain that keeps depth 2's
    rate further down: 1 + a1 (1 + a2 + a2^2 + a2^3)."""
    acceptance, expected = {}, {}
    drafter.eval()
    for name, seqs in held.items():
        hits, total = [0, 0], 0
        for start in range(0, len(seqs), batch_size):
            emb, feat, goal, label, real = _batch(embed, index, seqs[start : start + batch_size], 0.0)
            pred = drafter.sequence(emb, feat)  # entry j: f'_{j+1}
            hits[0] += int(((pred @ readout.T).argmax(-1) == label)[real].sum())
            # depth 2: entry j+1 reads the predicted f'_{j+1} with x_{j+2}
            own = torch.cat([feat[:, :1], pred[:, :-1]], dim=1)
            pred2 = drafter.sequence(emb, own)
            ok2 = ((pred2 @ readout.T).argmax(-1) == label) & real
            hits[1] += int(ok2[:, 1:].sum())
            total += int(real.sum())
        a1, a2 = hits[0] / max(total, 1), hits[1] / max(total, 1)
        acceptance[name] = [round(a1, 4), round(a2, 4)]
        expected[name] = round(1 + a1 * (1 + a2 + a2**2 + a2**3), 3)
    drafter.train()
    return {"acceptance": acceptance, "expected_tokens": expected}


def format_curve(result: dict[str, Any]) -> str:
    """Held-out acceptance against training tokens, one line per measured point."""
    sets = list(result["curve"][-1]["acceptance"])
    head = "train tokens  seconds  " + "  ".join(f"{s}: depth1 depth2 tau(4)" for s in sets)
    lines = [f"held-out acceptance ({result['train_tokens']} training tokens)", head]
    for p in result["curve"]:
        cells = "  ".join(f"{s}:  {p['acceptance'][s][0]:.3f}  {p['acceptance'][s][1]:.3f}  "
                          f"{p['expected_tokens'][s]:.2f}" for s in sets)  # fmt: skip
        lines.append(f"{p['train_tokens']:>12}  {p['seconds']:>7}  {cells}")
    return "\n".join(lines)
