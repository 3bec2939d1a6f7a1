"""Medusa heads by distillation from the frozen target, on the same text as EAGLE's drafter.

1. Text and features (`methods/teacher.py`): `--corpus-mb` MB of the Python standard library's
   sources in `--seq-len` windows and the target's own replies to the training prompts (with
   `--samples`, `--function-prompts`); at every position the LM head's input (the feature, after
   the final norm) and the target's argmax there. Whole sequences of each kind are held out.
2. Labels (`_labels`): head k (0-based) at position j proposes the token at j + k + 2, which the
   chain engine verifies only after the bonus token (the target's argmax at j) and heads 0..k-1's
   drafts were right. So its label is the target's argmax at j + k + 1, and it counts only where
   the text up to there is what the target itself would have written: tokens j+1 .. j+k+1 equal
   the target's argmax at j .. j+k. The target's greedy replies count everywhere; code from the
   corpus counts where the target would have written it.
3. Only the heads learn, read out by the rows of the target's LM head for the reduced draft
   vocabulary the engine uses (a label outside it is skipped by the loss and counted as a miss).
   Loss = sum_k 0.8^k * CE_k, the Medusa-1 weighting: deeper heads guess further ahead, are right
   less often and give noisier gradients, so they count less. AdamW, cosine decay (`fit`).
4. Held out, per set (chat, functions, code): each chain depth's acceptance, the rate at which
   head d is right where heads 0..d-1 were (the chain engine's acceptance by depth), measured
   `--curve` times while training; and at the end, on the chat replies, acceptance[k][r]: the
   fraction of positions where the target's token is exactly head k's rank-r guess (the tree
   engine's `--tree auto` reads it).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from specgraph.errors import InputError
from specgraph.methods.medusa.heads import MedusaHeads, save_heads
from specgraph.methods.teacher import (
    IGNORE,
    Schedule,
    Teacher,
    Text,
    check_run,
    corpus_meta,
    fit,
    load_teacher,
    save_and_report,
    teacher_sets,
)

HEAD_DECAY = 0.8  # loss weight of head k is HEAD_DECAY**k (Medusa-1)
RANKS = 10  # acceptance[k][r] for r < RANKS
NO_LABEL = -1  # `_labels`: no label at this position for this head
# the shipped heads' schedule: on their 190k labelled positions, 8 epochs at 3e-3 beat 2 at 1e-3 by
# 0.05-0.09 held-out depth-1 acceptance, and 4 at 2e-3 by 0.02 (docs/benchmarks.md)
EPOCHS = 8
LR = 3e-3


def train_medusa(
    model: str,
    output: str | Path,
    num_heads: int = 4,
    text: Text | None = None,
    schedule: Schedule | None = None,
    separate_lm_heads: bool = False,
    draft_vocab_size: int | None = None,
    threads: int = 2,
    engine_bundle: str | None = None,
    progress: bool = True,
    command: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Train `num_heads` Medusa heads for `model` on `text` (default: `Text()`, 1 MB of code and
    the target's replies to the shipped prompts) with `schedule` (default: EPOCHS at LR) and save
    them to `output` (safetensors). Returns
    the heads file's meta plus the losses and timings. `separate_lm_heads`: each head gets its own
    trainable copy of the LM head (Medusa-1). `draft_vocab_size`: tokens the heads score while
    training (None: the default reduced vocabulary where the model has a ranking, else all; 0:
    all). `engine_bundle`: a compiled `none` bundle of the model to generate the replies with
    (default: one is compiled).

    `output` and its caches (`<name>.gen.json`, `<name>.features.safetensors`) are checked before
    any work and written atomically under `specgraph.outputs`' rule; `force` lets them replace
    files specgraph did not write."""
    text = text or Text()
    schedule = schedule or Schedule(epochs=EPOCHS, lr=LR)
    if num_heads < 1:
        raise InputError(f"--heads must be at least 1, got {num_heads}")
    if not 0 < text.holdout < 1:
        raise InputError(f"holdout must be between 0 and 1 (a fraction of the prompts), got {text.holdout}")
    if text.max_new_tokens < 2:
        raise InputError(f"--max-new-tokens must be at least 2 (head 0 reads two tokens ahead), got "
                         f"{text.max_new_tokens}")  # fmt: skip
    inputs, output = check_run(model, output, text, schedule, threads, engine_bundle, force)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    timings: dict[str, float] = {}
    torch.manual_seed(text.seed)
    try:
        t0 = time.perf_counter()
        from specgraph.methods.medusa import DRAFT_VOCAB

        teacher = load_teacher(model, draft_vocab_size, DRAFT_VOCAB, "Medusa heads")
        vocab, hidden = teacher.lm_weight.shape
        timings["load_s"] = time.perf_counter() - t0
        train, held, info = teacher_sets(model, teacher.loaded, text, output, schedule.batch_size, threads,
                                         engine_bundle, progress, (inputs, force))  # fmt: skip
        timings.update(info.pop("timings"))
        # separate_lm_heads: each head's own trainable copy of the LM head (Medusa-1)
        own = teacher.lm_weight[None].repeat(num_heads, 1, 1) if separate_lm_heads else None  # [K, V, H]
        heads = MedusaHeads(hidden, num_heads, own)
        t0 = time.perf_counter()
        losses, points = _train(heads, teacher, train, held, schedule, random.Random(text.seed), progress)
        timings["train_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ranked = "chat" if "chat" in held else next(iter(held))
        acceptance, counted = _rank_table(heads, teacher, held[ranked], schedule.batch_size)
        timings["eval_s"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(old_threads)
    meta: dict[str, Any] = {
        "model": teacher.loaded.name,
        "fingerprint": teacher.fingerprint,  # compile finds and checks heads by this
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "num_heads": num_heads,
        # the tree engine's input (--tree auto): rank r of head k, unconditional, held-out `ranked` set
        "acceptance": [[round(a, 5) for a in row] for row in acceptance],
        "top1": [round(row[0], 5) for row in acceptance],
        "top5": [round(sum(row[:5]), 5) for row in acceptance],
        "ranked_on": ranked,
        "heldout_tokens": counted,
        # the chain engine's: per held-out set, head d's rate where heads 0..d-1 were right
        "chain": points[-1]["acceptance"],
        "expected_tokens": points[-1]["expected_tokens"],
        "train_tokens": sum(int((_labels(s, 1)[:, 0] != NO_LABEL).sum()) for s in train),  # head 0's labels
        "target_agreement": points[-1]["agreement"],
        "corpus": corpus_meta(text, info),
        "draft_vocab": teacher.vocab_meta(),
        "loss_weights": [round(HEAD_DECAY**k, 4) for k in range(num_heads)],
        "curve": points,
        "command": command or f"specgraph train --method medusa {model} --heads {num_heads} -o {output}",
    }
    save = lambda tmp: save_heads(tmp, heads, meta)  # noqa: E731
    return save_and_report(
        output, save, meta, losses, info, timings, (inputs, force), format_curve if progress else None
    )


def _labels(entry: tuple[Any, ...], num_heads: int) -> torch.Tensor:
    """[L, K] each head's label at each position of one `teacher_sets` entry (tokens [L], features,
    the target's argmax [L], the first counted position): the target's argmax at j + k + 1 where
    tokens j+1 .. j+k+1 are the target's argmax at j .. j+k and j is counted, else NO_LABEL."""
    tokens, top, first = entry[0], entry[2], entry[3]
    n = len(tokens)
    labels = torch.full((n, num_heads), NO_LABEL, dtype=torch.int64)
    on_path = tokens[1:] == top[:-1]  # [L-1] token j+1 is the target's argmax after j
    good = torch.arange(n) >= first  # [L]
    for k in range(num_heads):
        m = n - k - 1  # positions with a token j + k + 1 to read the label at
        if m <= 0:
            break
        good = good[:m] & on_path[k : k + m]  # the text is the target's own through j + k + 1
        labels[:m, k] = torch.where(good, top[k + 1 : k + 1 + m], NO_LABEL)
    return labels


def _batch(seqs: list[tuple[Any, ...]], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded features [b, W, H] and labels [b, W, K] (token ids, NO_LABEL where none)."""
    width = max(len(s[0]) for s in seqs)
    b, h = len(seqs), seqs[0][1].shape[-1]
    x = torch.zeros(b, width, h)
    y = torch.full((b, width, num_heads), NO_LABEL, dtype=torch.int64)
    for i, entry in enumerate(seqs):
        n = len(entry[0])
        x[i, :n] = entry[1].to(torch.float32)
        y[i, :n] = _labels(entry, num_heads)
    return x, y


def _states(heads: MedusaHeads, x: torch.Tensor) -> torch.Tensor:
    """`heads(x)` [..., K, H] as one product with the K matrices side by side: the module's
    broadcast form runs one tiny product a position and head, 190x slower to train here."""
    k, h = heads.num_heads, heads.hidden_size
    proj = torch.nn.functional.linear(x, heads.weight.flatten(0, 1)).unflatten(-1, (k, h))  # [..., K, H]
    return x[..., None, :] + torch.nn.functional.silu(proj + heads.bias)


def _logits(heads: MedusaHeads, teacher: Teacher, x: torch.Tensor) -> torch.Tensor:
    """Features [..., H] -> each head's logits over the draft vocabulary [..., K, V_d]."""
    return heads.readout(_states(heads, x), teacher.readout, teacher.ids)


def _train(heads, teacher, train, held, schedule, rng, progress):  # type: ignore[no-untyped-def]
    decay = [HEAD_DECAY**k for k in range(heads.num_heads)]

    def loss_of(batch):  # type: ignore[no-untyped-def]
        x, y = _batch(batch, heads.num_heads)
        label = torch.where(y == NO_LABEL, IGNORE, teacher.index[y.clamp(min=0)])  # [b, W, K] draft index
        states = _states(heads, x)  # [b, W, K, H]
        total = states.new_zeros(())
        for k in range(heads.num_heads):  # each head read out only where it has a label
            sel = label[..., k] != IGNORE  # [b, W]
            if bool(sel.any()):
                weight = teacher.readout if heads.lm_heads is None else heads.lm_heads[k, teacher.ids]  # [V_d, H]
                logits = states[..., k, :][sel] @ weight.T  # [N, V_d]
                total = total + decay[k] * torch.nn.functional.cross_entropy(logits, label[..., k][sel])
        return total, int((y[..., 0] != NO_LABEL).sum())

    evaluate = lambda: _evaluate(heads, teacher, held, schedule.batch_size)  # noqa: E731
    return fit(heads, loss_of, evaluate, train, schedule, rng, progress)


@torch.no_grad()
def _evaluate(heads, teacher, held, batch_size):  # type: ignore[no-untyped-def]
    """Per held-out set: the chain's acceptance by depth (head d right where heads 0..d-1 were,
    among positions with a label for head d) and its expected tokens per round with all K heads,
    1 + sum_d P(heads 0..d right); and over the chat replies (the target's greedy text) how often
    the target's argmax is the next token there (the HF model reproducing the engine's text)."""
    acceptance, expected, agree = {}, {}, [0, 0]
    for name, seqs in held.items():
        k = heads.num_heads
        reached, right, total = torch.zeros(k), torch.zeros(k), torch.zeros(k)
        for start in range(0, len(seqs), batch_size):
            group = seqs[start : start + batch_size]
            x, y = _batch(group, k)
            guess = teacher.ids[_logits(heads, teacher, x).argmax(-1)]  # [b, W, K] token ids
            valid = y != NO_LABEL
            hit = (guess == y) & valid
            before = torch.cumprod(torch.cat([torch.ones_like(hit[..., :1]), hit[..., :-1]], -1).int(), -1).bool()
            total += valid.sum((0, 1))
            reached += (valid & before).sum((0, 1))  # heads 0..d-1 right
            right += (hit & before).sum((0, 1))  # and head d too
            if name == "chat":
                for entry in group:
                    tokens, top, first = entry[0], entry[2], entry[3]
                    agree[0] += int((tokens[first + 1 :] == top[first:-1]).sum())
                    agree[1] += max(len(tokens) - 1 - first, 0)
        rates = (right / reached.clamp(min=1)).tolist()
        acceptance[name] = [round(a, 4) for a in rates]
        expected[name] = round(1 + float((right / total.clamp(min=1)).sum()), 3)
    return {"acceptance": acceptance, "expected_tokens": expected,
            "agreement": round(agree[0] / agree[1], 5) if agree[1] else None}  # fmt: skip


@torch.no_grad()
def _rank_table(
    heads: MedusaHeads, teacher: Teacher, seqs: list[Any], batch_size: int
) -> tuple[list[list[float]], int]:
    """acceptance[k][r]: the fraction of head k's labelled held-out positions where its label is
    exactly its rank-r guess (ties broken in the head's favour; a label outside the draft
    vocabulary is a miss); and how many positions head 0 had."""
    k = heads.num_heads
    counts, totals = torch.zeros(k, RANKS), torch.zeros(k)  # [K, R], [K]
    for start in range(0, len(seqs), batch_size):
        x, y = _batch(seqs[start : start + batch_size], k)
        logits = _logits(heads, teacher, x)  # [b, W, K, V_d]
        valid = y != NO_LABEL
        label = teacher.index[y.clamp(min=0)]  # [b, W, K] draft index, IGNORE outside the vocabulary
        true = logits.gather(-1, label.clamp(min=0)[..., None])  # [b, W, K, 1]
        rank = torch.where(label == IGNORE, RANKS, (logits > true).sum(-1))  # [b, W, K]
        for r in range(RANKS):
            counts[:, r] += ((rank == r) & valid).sum((0, 1))
        totals += valid.sum((0, 1))
    return (counts / totals.clamp(min=1)[:, None]).tolist(), int(totals[0])


def format_curve(result: dict[str, Any]) -> str:
    """Held-out chain acceptance against training tokens, one line per measured point."""
    sets = list(result["curve"][-1]["acceptance"])
    k = result["num_heads"]
    lines = [f"held-out acceptance by chain depth, {k} heads ({result['train_tokens']} training positions)",
             "train tokens  seconds  " + "  ".join(f"{s}: depth 1..{k} tau({k})" for s in sets)]  # fmt: skip
    for p in result["curve"]:
        cells = "  ".join(" ".join(f"{a:.3f}" for a in p["acceptance"][s]) + f"  {p['expected_tokens'][s]:.2f}"
                          for s in sets)  # fmt: skip
        lines.append(f"{p['train_tokens']:>12}  {p['seconds']:>7}  {cells}")
    top = "  ".join(f"{a:.3f}" for a in result["top1"])
    lines.append(f"top-1 by head on held-out {result['ranked_on']} (unconditional): {top}")
    return "\n".join(lines)
