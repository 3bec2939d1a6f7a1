"""Train an early-exit adapter (Kangaroo) on the frozen target's teacher-forced hidden states.

1. Text: the same as EAGLE's and Medusa's (`methods/teacher.py` `teacher_sets`): `--corpus-mb` MB of the
   Python standard library's sources in `--seq-len` windows, and the target's own greedy replies
   to the training prompts; whole sequences of each kind held out.
2. One no-grad pass of the HF model per batch: the hidden state after layer E (the adapter's
   input), and the final-norm feature, whose LM-head reading is the target's distribution p.
3. Only the adapter learns (initialised as the target's layer E + 1 without its MLP and the
   target's final norm, `adapter.py`). Loss: distillation, the cross-entropy of the adapter's
   distribution q against p (KL(p || q) plus p's entropy) at every counted position, both read
   out by the rows of the target's LM head for the reduced draft vocabulary the engine uses.
4. Held-out top-1 acceptance per set: how often q's argmax is the target's argmax (a target
   token outside the draft vocabulary is a miss). Later draft steps read the target's own first E
   layers on the drafted tokens, so the same rate holds at every depth while the drafts are right;
   the expected tokens per round of a K-token chain are then 1 + a + ... + a^K.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from specgraph.methods.early_exit.adapter import (
    adapter_init,
    adapter_model,
    adapter_state,
    check_exit_layer,
    parts,
    save_adapter,
)
from specgraph.methods.teacher import (
    Schedule,
    Text,
    check_run,
    corpus_meta,
    fit,
    load_teacher,
    save_and_report,
    teacher_sets,
)

LR = 5e-4  # the adapter starts as the target's layer E + 1: a gentler rate than EAGLE's from scratch
CHAIN = 3  # the expected tokens per round are reported for this many drafts (the default --num-draft)


def train_early_exit(
    model: str,
    output: str | Path,
    exit_layer: int,
    text: Text | None = None,
    schedule: Schedule | None = None,
    draft_vocab_size: int | None = None,
    threads: int = 2,
    engine_bundle: str | None = None,
    progress: bool = True,
    command: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Train an adapter that drafts from the hidden state after `exit_layer` of `model` and save
    it to `output` (safetensors). Returns its meta plus the losses and timings. `text`: what it
    trains on; `draft_vocab_size`: tokens the readout scores (None: the default reduced vocabulary
    where the model has a ranking, else all; 0: all). `engine_bundle`: a compiled `none` bundle of
    the model to generate the replies with (default: one is compiled)."""
    text = text or Text()
    schedule = schedule or Schedule(lr=LR)
    inputs, output = check_run(model, output, text, schedule, threads, engine_bundle, force)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    timings: dict[str, float] = {}
    torch.manual_seed(text.seed)
    try:
        t0 = time.perf_counter()
        from specgraph.methods.early_exit import DRAFT_VOCAB

        teacher = load_teacher(model, draft_vocab_size, DRAFT_VOCAB, "an early-exit adapter")
        hf, (vocab, hidden) = teacher.hf, teacher.lm_weight.shape
        num_layers = len(parts(hf, teacher.loaded.name)[1])
        check_exit_layer(exit_layer, num_layers)
        timings["load_s"] = time.perf_counter() - t0

        train, held, info = teacher_sets(model, teacher.loaded, text, output, schedule.batch_size, threads,
                                         engine_bundle, progress, (inputs, force), layer=exit_layer)  # fmt: skip
        timings.update(info.pop("timings"))

        adapter = adapter_model(hf, exit_layer, adapter_init(hf, exit_layer))
        adapter.requires_grad_(False)
        _, layers, norm = parts(adapter, "the adapter")
        for module in (layers[0], getattr(adapter.model, norm)):
            module.requires_grad_(True)
        t0 = time.perf_counter()
        losses, points = _train(adapter, teacher, train, held, schedule, random.Random(text.seed), progress)
        timings["train_s"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(old_threads)
    meta: dict[str, Any] = {
        "model": teacher.loaded.name,
        "fingerprint": teacher.fingerprint,
        "exit_layer": exit_layer,
        "hidden_size": int(hidden),
        "vocab_size": int(vocab),
        "num_layers": num_layers,
        "acceptance": points[-1]["acceptance"],  # per held-out set: top-1 agreement with the target
        "expected_tokens": points[-1]["expected_tokens"],
        "train_tokens": sum(len(s[0]) - s[3] for s in train),  # the positions the loss counts
        "corpus": corpus_meta(text, info),
        "draft_vocab": teacher.vocab_meta(),
        "curve": points,
        "command": command or f"specgraph train --method early-exit {model} --exit-layer {exit_layer} "
        f"--prompts {text.prompts} -o {output}",
    }  # fmt: skip
    state = adapter_state(adapter)
    save = lambda tmp: save_adapter(tmp, state, meta)  # noqa: E731
    return save_and_report(
        output, save, meta, losses, info, timings, (inputs, force), format_curve if progress else None
    )


def _batch(seqs: list[tuple[Any, ...]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded hidden states after layer E [b, W, H], the target's features [b, W, H], its
    argmax [b, W] and which positions count [b, W] (padding is causal, so it is never read)."""
    width = max(len(s[0]) for s in seqs)
    b, h = len(seqs), seqs[0][1].shape[-1]
    x, feat = torch.zeros(b, width, h), torch.zeros(b, width, h)
    top = torch.zeros(b, width, dtype=torch.int64)
    real = torch.zeros(b, width, dtype=torch.bool)
    for i, (tokens, f, target, first, hidden) in enumerate(seqs):
        n = len(tokens)
        x[i, :n], feat[i, :n], top[i, :n] = hidden.to(torch.float32), f.to(torch.float32), target
        real[i, first:n] = True  # positions before `first` (a reply's prompt) are context only
    return x, feat, top, real


def _student(adapter: Any, x: torch.Tensor, readout: torch.Tensor) -> torch.Tensor:
    """The adapter's logits over the draft vocabulary [b, W, V_d] from hidden states after layer E."""
    return adapter.model(inputs_embeds=x).last_hidden_state @ readout.T


def _train(adapter, teacher, train, held, schedule, rng, progress):  # type: ignore[no-untyped-def]
    readout, index = teacher.readout, teacher.index

    def loss_of(batch):  # type: ignore[no-untyped-def]
        x, feat, _, real = _batch(batch)
        with torch.no_grad():
            p = torch.softmax((feat @ readout.T)[real], dim=-1)  # [N, V_d] the target's, on the draft vocabulary
        log_q = torch.log_softmax(_student(adapter, x, readout)[real], dim=-1)  # [N, V_d]
        return -(p * log_q).sum(-1).mean(), int(real.sum())  # cross-entropy to p = KL(p || q) + H(p)

    adapter.train()
    result = fit(adapter, loss_of, lambda: _evaluate(adapter, readout, index, held, schedule.batch_size), train,
                 schedule, rng, progress)  # fmt: skip
    adapter.eval()
    return result


@torch.no_grad()
def _evaluate(adapter, readout, index, held, batch_size):  # type: ignore[no-untyped-def]
    """Held-out top-1 acceptance per set and the expected tokens per round of a CHAIN-token chain."""
    acceptance, expected = {}, {}
    adapter.eval()
    for name, seqs in held.items():
        hits, total = 0, 0
        for start in range(0, len(seqs), batch_size):
            x, _, top, real = _batch(seqs[start : start + batch_size])
            hits += int(((_student(adapter, x, readout).argmax(-1) == index[top]) & real).sum())
            total += int(real.sum())
        a = hits / max(total, 1)
        acceptance[name] = round(a, 4)
        expected[name] = round(sum(a**i for i in range(CHAIN + 1)), 3)
    adapter.train()
    return {"acceptance": acceptance, "expected_tokens": expected}


def format_curve(result: dict[str, Any]) -> str:
    """Held-out acceptance against training tokens, one line per measured point."""
    sets = list(result["curve"][-1]["acceptance"])
    lines = [f"held-out top-1 acceptance, exit layer {result['exit_layer']} ({result['train_tokens']} training "
             f"positions)", "train tokens  seconds  " + "  ".join(f"{s}: top1 tau({CHAIN})" for s in sets)]  # fmt: skip
    for p in result["curve"]:
        cells = "  ".join(f"{s}:  {p['acceptance'][s]:.3f}  {p['expected_tokens'][s]:.2f}" for s in sets)
        lines.append(f"{p['train_tokens']:>12}  {p['seconds']:>7}  {cells}")
    return "\n".join(lines)
