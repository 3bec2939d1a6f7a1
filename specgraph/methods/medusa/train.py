"""Medusa heads by self-distillation: the frozen target writes the text, the heads learn to read ahead.

1. `_generate`: the target's greedy continuation of every prompt (through the chat template when
   the model has a tokenizer), made by a compiled `none` engine and cached in `<output>.gen.json`,
   so a rerun with the same prompts, model and budget skips it.
2. `_hidden_states`: one no-grad pass of the HF model over prompt + response; the LM head's input
   (`hidden_states[-1]`, after the final norm, checked against the logits) at each response position.
3. `_train`: only the heads learn. Head k at position t predicts token t + k + 2 through the frozen,
   shared LM head. Loss = sum_k 0.8^k * CE_k, the Medusa-1 weighting: deeper heads guess further
   ahead, are right less often and give noisier gradients, so they count less. AdamW, cosine decay.
4. `_evaluate`: on whole held-out sequences, the rank of the true token under each head;
   acceptance[k][r] = fraction of positions where it is exactly rank r (r < 10), unconditional.
"""

from __future__ import annotations

import json
import math
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from specgraph.bench import _read_records, checked_ids, encode_prompt, prompt_file
from specgraph.errors import InputError, OutputError
from specgraph.loaders import LoadedModel, load_model, load_tokenizer
from specgraph.methods.medusa.heads import MedusaHeads, model_fingerprint, save_heads
from specgraph.outputs import GEN_CACHE, HEADS, check_output, write_file
from specgraph.sampling import SamplingParams

HEAD_DECAY = 0.8  # loss weight of head k is HEAD_DECAY**k (Medusa-1)
RANKS = 10  # acceptance[k][r] for r < RANKS
IGNORE = -100  # target id where t + k + 2 runs past the end of the sequence
GENERATE_BATCH = 16  # prompts per engine call when generating the training text
TRAIN_SET = Path(__file__).resolve().parents[2] / "data" / "train.jsonl"  # what prompts="train" names
# sampled replies to the training prompts (`samples`): the target's own text, more varied than greedy
SAMPLE_PARAMS = SamplingParams(temperature=0.8, top_p=0.95)


class Replies(NamedTuple):
    """The target's text for one training prompt: its greedy reply and any sampled ones."""

    prompt: list[int]
    greedy: list[int]
    sampled: list[list[int]]


def train_medusa(
    model: str,
    prompts: str,
    output: str | Path,
    num_heads: int = 4,
    epochs: int = 5,
    max_new_tokens: int = 32,
    lr: float = 1e-3,
    holdout: float = 0.1,
    threads: int = 2,
    progress: bool = True,
    engine_bundle: str | None = None,
    seed: int = 0,
    batch_size: int = 32,
    command: str | None = None,
    separate_lm_heads: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Train `num_heads` Medusa heads for `model` on its own greedy answers to `prompts` and save
    them to `output`. `prompts` is a JSONL file of "prompt" strings ("prompt_ids" lists for a
    model without a tokenizer) or "train", the shipped set. Returns the heads file's meta plus the
    epoch losses, timings and a check that the HF model reproduces the generated text.

    The defaults are the shipped SmolLM2-135M heads' recipe, sized for a 2-core CPU (~15 min,
    ~10 of them generating): held-out accuracy there is limited by data (7k tokens), not steps;
    more epochs overfit, and lr 1e-3..1e-2 and batch 16..256 all land within a few points.

    `output` and its cache `<name>.gen.json` are checked before any work and written atomically
    under `specgraph.outputs`' rule; `force` lets them replace files specgraph did not write."""
    _check_args(num_heads, epochs, max_new_tokens, lr, holdout, threads, batch_size)
    inputs = _inputs(model, prompts, engine_bundle)
    if _cache_path(Path(output)) == Path(output):
        raise OutputError(f"{output} would also be its own generation cache; give a name not ending in .gen.json")
    output = check_output(output, HEADS, inputs, force)
    check_output(_cache_path(output), GEN_CACHE, inputs, force)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    timings: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        loaded = load_model(model)
        hf, lm_head = loaded.hf_model, loaded.hf_model.get_output_embeddings() if loaded.hf_model else None
        if hf is None or lm_head is None:
            raise InputError(f"{model}: training Medusa heads needs a Hugging Face model with an LM head")
        timings["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        replies, cached = _generate(model, loaded, prompts, output, max_new_tokens, threads, engine_bundle, progress,
                                    (inputs, force))  # fmt: skip
        seqs = [(r.prompt, r.greedy) for r in replies]
        timings["generate_s"] = time.perf_counter() - t0
        held, kept = _split(seqs, holdout, seed)
        t0 = time.perf_counter()
        x_train, y_train, agree = _hidden_states(hf, lm_head, kept, num_heads, progress, "hidden states (train)")
        x_held, y_held, agree_held = _hidden_states(hf, lm_head, held, num_heads, progress, "hidden states (held out)")
        timings["hidden_s"] = time.perf_counter() - t0
        lm_weight = lm_head.weight.detach()  # [V, H], frozen and shared by every head
        # separate_lm_heads: each head gets its own trainable copy of the LM head (Medusa-1)
        own = lm_head.weight.detach()[None].repeat(num_heads, 1, 1) if separate_lm_heads else None  # [K, V, H]
        heads = MedusaHeads(x_train.shape[1], num_heads, own)
        t0 = time.perf_counter()
        losses = _train(heads, lm_weight, x_train, y_train, epochs, lr, batch_size, seed, progress)
        timings["train_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        acceptance = _evaluate(heads, lm_weight, x_held, y_held, batch_size)
        timings["eval_s"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(old_threads)
    meta: dict[str, Any] = {
        "model": loaded.name,
        "fingerprint": model_fingerprint(loaded),  # compile finds and checks heads by this
        "vocab_size": int(lm_weight.shape[0]),
        "hidden_size": int(lm_weight.shape[1]),
        "num_heads": num_heads,
        "acceptance": [[round(a, 5) for a in row] for row in acceptance],
        "top1": [round(row[0], 5) for row in acceptance],
        "top5": [round(sum(row[:5]), 5) for row in acceptance],
        "train_tokens": int(x_train.shape[0]),
        "heldout_tokens": int(x_held.shape[0]),
        "train_sequences": len(kept),
        "heldout_sequences": len(held),
        "loss_weights": [round(HEAD_DECAY**k, 4) for k in range(num_heads)],
        "command": command or _python_command(model, prompts, output, num_heads, epochs, max_new_tokens, lr, threads),
    }
    write_file(output, lambda tmp: save_heads(tmp, heads, meta), HEADS, inputs, force)
    result = {
        **meta,
        "epoch_loss": [round(v, 5) for v in losses],
        # fraction of response positions where the HF model's argmax is the engine's greedy token
        "target_agreement": round((agree[0] + agree_held[0]) / max(agree[1] + agree_held[1], 1), 5),
        "generation_cached": cached,
        "timings": {k: round(v, 2) for k, v in timings.items()},
    }
    if progress:
        print(format_accuracy(result), file=sys.stderr)
    return result


def _inputs(model: str, prompts: str, engine_bundle: str | None) -> list[str | Path | None]:
    """What a training run reads, which its outputs must never touch."""
    from specgraph.default_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME, cache_root

    source = cache_root() / DEFAULT_MODEL_NAME if model == DEFAULT_MODEL else model
    return [source, TRAIN_SET if prompts == "train" else prompt_file(prompts), engine_bundle]


def _cache_path(output: Path) -> Path:
    """`heads.safetensors` -> `heads.gen.json`: the target's generated text, reused by a rerun."""
    return output.with_name(output.name.split(".")[0] + ".gen.json")


def _check_args(
    num_heads: int, epochs: int, max_new_tokens: int, lr: float, holdout: float, threads: int, batch_size: int
) -> None:
    if num_heads < 1:
        raise InputError(f"num_heads must be at least 1, got {num_heads}")
    if epochs < 1:
        raise InputError(f"epochs must be at least 1, got {epochs}")
    if max_new_tokens < 2:
        raise InputError(f"max_new_tokens must be at least 2 (head 0 predicts two tokens ahead), got {max_new_tokens}")
    if not lr > 0:
        raise InputError(f"lr must be positive, got {lr}")
    if not 0 < holdout < 1:
        raise InputError(f"holdout must be between 0 and 1 (a fraction of the prompts), got {holdout}")
    if threads < 1 or batch_size < 1:
        raise InputError(f"threads and batch_size must be at least 1, got {threads} and {batch_size}")


# --- 1. the target's own answers -----------------------------------------------------------------


def _prompt_ids(prompts: str, loaded: LoadedModel) -> list[list[int]]:
    """Each line's "prompt_ids" as given, else its "prompt" through the chat template (as
    `specgraph bench` encodes them)."""
    tokenizer = None
    if loaded.tokenizer_dir is not None:
        tokenizer = load_tokenizer(loaded.tokenizer_dir)
    ids: list[list[int]] = []
    for record, (file, line) in _read_records(str(TRAIN_SET) if prompts == "train" else prompts, None):
        given = record.get("prompt_ids")
        if isinstance(given, list) and given:
            ids.append(checked_ids(given, loaded.vocab_size, f"{file}:{line}"))
        elif isinstance(record.get("prompt"), str) and tokenizer is not None:
            ids.append(encode_prompt(tokenizer, record["prompt"], chat=True))
        elif tokenizer is None:
            raise InputError(
                f'{file}:{line}: {loaded.name} has no tokenizer, so lines must give "prompt_ids": [1, 2, 3]'
            )
        else:
            raise InputError(f'{file}:{line}: no "prompt" string (or "prompt_ids" list) field in this line')
    return ids


def _generate(
    model: str,
    loaded: LoadedModel,
    prompts: str,
    output: Path,
    max_new_tokens: int,
    threads: int,
    engine_bundle: str | None,
    progress: bool,
    writing: tuple[list[str | Path | None], bool],
    samples: int = 0,
    extra: list[list[int]] | None = None,
) -> tuple[list[Replies], bool]:
    """(prompt ids, greedy response ids, `samples` sampled response ids) for each prompt of
    `prompts` and then of `extra` (prompt ids), in that order, leaving out those too long for the
    engine; from the cache where it has them. `writing` is the run's (inputs, force), for writing
    the cache. Sampled replies (SAMPLE_PARAMS, seed i for the i-th sample of every prompt) widen
    the target's own text beyond its greedy answers: more contexts of the kind a drafter meets.

    The cache keeps every prompt's replies it was ever given (for this model, budget and sampling),
    so a run that adds prompts generates only theirs."""
    all_ids = _prompt_ids(prompts, loaded) + (extra or [])
    key: dict[str, Any] = {"model": loaded.name, "max_new_tokens": max_new_tokens}
    if samples:  # a greedy-only cache's key names no sampling
        key["samples"] = {"count": samples, **SAMPLE_PARAMS.as_dict()}
    cache = _cache_path(output)
    saved = _read_cache(cache, key)
    from specgraph.runtime import Engine

    engine = Engine(Path(engine_bundle), threads=threads) if engine_bundle else None
    fitting = _fitting(all_ids, engine.max_context if engine else _none_context(loaded), prompts)
    missing = list({tuple(ids): ids for ids in fitting if tuple(ids) not in saved}.values())
    if missing:
        with tempfile.TemporaryDirectory(prefix="specgraph-train-") as tmp:
            if engine is None:
                engine = Engine(_compile_none(model, loaded, Path(tmp), progress), threads=threads)
            if int(engine.manifest["vocab_size"]) != loaded.vocab_size:
                raise InputError(f"engine bundle {engine_bundle} has a different vocabulary than {model}: "
                                 "not the same model")  # fmt: skip
            saved.update(_reply_all(engine, missing, max_new_tokens, samples, progress))
        body = {"key": key, "sequences": [{"prompt_ids": r.prompt, "output_ids": r.greedy, "sampled": r.sampled}
                                          for r in saved.values()]}  # fmt: skip
        write_file(cache, lambda tmp: tmp.write_text(json.dumps(body)), GEN_CACHE, *writing)
    return [saved[tuple(ids)] for ids in fitting], not missing


def _reply_all(engine: Any, prompts: list[list[int]], max_new_tokens: int, samples: int,
               progress: bool) -> dict[tuple[int, ...], Replies]:  # fmt: skip
    """The engine's greedy reply and `samples` sampled ones to each prompt, in batches."""
    replies: list[list[list[int]]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts) * (1 + samples), desc="generate", unit="reply", file=sys.stderr,
               disable=not progress)  # fmt: skip
    # rows of a batch emit exactly what each would alone (Engine.generate_batch), several times faster
    for sample in range(1 + samples):  # 0: greedy
        params = replace(SAMPLE_PARAMS, seed=sample) if sample else None
        for start in range(0, len(prompts), GENERATE_BATCH):
            group = prompts[start : start + GENERATE_BATCH]
            results = engine.generate_batch(group, max_new_tokens, params=params)
            for i, result in enumerate(results, start):
                replies[i].append(list(result.output_ids))
            bar.update(len(group))
            bar.set_postfix(tokens=sum(len(out) for outs in replies for out in outs))
    bar.close()
    return {tuple(ids): Replies(ids, outs[0], outs[1:]) for ids, outs in zip(prompts, replies, strict=True)}


def _fitting(all_ids: list[list[int]], max_context: int, prompts: str) -> list[list[int]]:
    """The prompts short enough to leave the response room for two tokens (head 0's target)."""
    room = max_context - 2
    fitting = [ids for ids in all_ids if len(ids) < room]
    if len(fitting) < 2:
        raise InputError(
            f"{len(all_ids) - len(fitting)} of the {len(all_ids)} prompts in {prompts} are too long: training needs "
            f"at least 2 prompts shorter than {room} tokens (the engine's context of {max_context} minus 2)"
        )
    return fitting


def _read_cache(cache: Path, key: dict[str, Any]) -> dict[tuple[int, ...], Replies]:
    """The cached replies by prompt if `cache` holds a well-formed cache for `key`, else none.
    (A cache written before replies were kept by prompt also names its prompts' digest: ignored.)"""
    try:
        saved = json.loads(cache.read_text()) if cache.is_file() else None
        if not isinstance(saved, dict) or not isinstance(saved.get("key"), dict):
            return {}
        if {k: v for k, v in saved["key"].items() if k != "prompts_sha256"} != key:
            return {}
        seqs = [Replies(s["prompt_ids"], s["output_ids"], s.get("sampled", [])) for s in saved["sequences"]]
        parts = [part for seq in seqs for part in (seq.prompt, seq.greedy, *seq.sampled)]
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return {}  # unreadable or malformed: generate afresh (and replace it)
    ok = all(isinstance(part, list) and all(type(t) is int for t in part) for part in parts)
    return {tuple(seq.prompt): seq for seq in seqs} if ok else {}


def _none_context(loaded: LoadedModel) -> int:
    """The context of the `none` engine compiled to generate the training text."""
    return min(1024, loaded.max_positions or 1024)


def _compile_none(model: str, loaded: LoadedModel, tmp: Path, progress: bool) -> Path:
    from specgraph.compiler import CompileConfig, compile_model

    if progress:
        print("compiling a `none` engine to generate the training text (pass engine_bundle to skip)", file=sys.stderr)
    cfg = CompileConfig(model=model, output=tmp / "bundle", method="none", max_context=_none_context(loaded))
    return compile_model(cfg).bundle


def _split(seqs: list[Any], holdout: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Whole sequences out of training: (held out, kept), at least one of each."""
    if len(seqs) < 2:
        raise InputError(f"need at least 2 prompts (one to train on, one to hold out), got {len(seqs)}")
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    n_held = min(max(1, round(holdout * len(seqs))), len(seqs) - 1)
    return [seqs[i] for i in sorted(order[:n_held])], [seqs[i] for i in sorted(order[n_held:])]


# --- 2. hidden states, once ----------------------------------------------------------------------


@torch.no_grad()
def _hidden_states(
    model: torch.nn.Module,
    lm_head: torch.nn.Module,
    seqs: list[tuple[list[int], list[int]]],
    num_heads: int,
    progress: bool,
    desc: str,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """x [N, H]: the LM head's input at positions t = P-1 .. L-3 of each sequence (prompt P
    tokens, L in all); y [N, K]: token t + k + 2, IGNORE past the end. Also how many of the
    model's argmax tokens at those positions equal the generated token t + 1."""
    xs, ys, agree, total = [], [], 0, 0
    for i, (prompt, response) in enumerate(tqdm(seqs, desc=desc, unit="seq", file=sys.stderr, disable=not progress)):
        ids = torch.tensor(prompt + response)  # [L]
        first, last = len(prompt) - 1, len(ids) - 3  # positions whose head 0 target exists
        if last < first:
            continue
        out = model(ids[None], output_hidden_states=True)
        hidden = out.hidden_states[-1][0]  # [L, H]
        if i == 0:
            _check_post_norm(lm_head(hidden), out.logits[0])
        agree += int((out.logits[0, first : last + 1].argmax(-1) == ids[first + 1 : last + 2]).sum())
        total += last + 1 - first
        xs.append(hidden[first : last + 1].clone())  # [n, H]
        pos = torch.arange(first, last + 1)[:, None] + torch.arange(num_heads)[None, :] + 2  # [n, K]
        ys.append(torch.where(pos < len(ids), ids[pos.clamp(max=len(ids) - 1)], IGNORE))  # [n, K]
    if not xs:
        raise InputError(f"{desc}: no response has the two tokens head 0 needs")
    return torch.cat(xs), torch.cat(ys), (agree, total)


def _check_post_norm(from_hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """hidden_states[-1] must be what the LM head reads (after the final norm), or the heads
    would learn on a different input than they get at inference."""
    scale = float(logits.abs().max()) + 1e-6
    if float((from_hidden - logits).abs().max()) > 1e-4 * scale:
        raise RuntimeError("hidden_states[-1] is not the LM head's input: lm_head(hidden) != logits")


# --- 3. training ---------------------------------------------------------------------------------


def _head_losses(heads: MedusaHeads, lm_weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each head over its valid targets: [K]."""
    logits = heads.readout(heads(x), lm_weight)  # [B, K, V]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten().clamp(min=0), reduction="none")  # [B*K]
    valid = (y != IGNORE).float()  # [B, K]
    return (ce.view_as(valid) * valid).sum(0) / valid.sum(0).clamp(min=1)  # [K]


def _train(
    heads: MedusaHeads,
    lm_weight: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    progress: bool,
) -> list[float]:
    """AdamW on the heads alone; returns the mean weighted loss of each epoch."""
    weights = torch.tensor([HEAD_DECAY**k for k in range(heads.num_heads)])  # [K]
    steps_per_epoch = math.ceil(len(x) / batch_size)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed)
    bar = tqdm(total=epochs * steps_per_epoch, desc="train", unit="step", file=sys.stderr, disable=not progress)
    losses, running = [], None
    for epoch in range(epochs):
        order, total = torch.randperm(len(x), generator=gen), 0.0
        for start in range(0, len(x), batch_size):
            idx = order[start : start + batch_size]
            loss = (weights * _head_losses(heads, lm_weight, x[idx], y[idx])).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            value = float(loss.detach())
            total += value * len(idx)
            running = value if running is None else 0.9 * running + 0.1 * value
            bar.set_postfix(epoch=epoch + 1, loss=f"{running:.3f}")
            bar.update()
        losses.append(total / len(x))
    bar.close()
    return losses


# --- 4. held-out evaluation ----------------------------------------------------------------------


@torch.no_grad()
def _evaluate(
    heads: MedusaHeads, lm_weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int
) -> list[list[float]]:
    """acceptance[k][r]: fraction of head k's valid held-out positions where the true token is
    exactly its rank-r guess (ties broken in the head's favour)."""
    counts = torch.zeros(heads.num_heads, RANKS)  # [K, R]
    valid_total = torch.zeros(heads.num_heads)  # [K]
    for start in range(0, len(x), batch_size):
        logits = heads.readout(heads(x[start : start + batch_size]), lm_weight)  # [B, K, V]
        yb = y[start : start + batch_size]  # [B, K]
        true = logits.gather(-1, yb.clamp(min=0)[..., None])  # [B, K, 1]
        rank = (logits > true).sum(-1)  # [B, K]
        valid = yb != IGNORE  # [B, K]
        for r in range(RANKS):
            counts[:, r] += ((rank == r) & valid).sum(0)
        valid_total += valid.sum(0)
    return (counts / valid_total.clamp(min=1)[:, None]).tolist()


def format_accuracy(result: dict[str, Any]) -> str:
    """Per-head held-out top-1 / top-5 as a small table."""
    lines = [
        f"held-out accuracy ({result['heldout_tokens']} positions; head k guesses token t+k+2)",
        "head  top-1  top-5",
    ]
    for k, (t1, t5) in enumerate(zip(result["top1"], result["top5"], strict=True)):
        lines.append(f"{k:>4}  {t1:5.3f}  {t5:5.3f}")
    return "\n".join(lines)


def _python_command(
    model: str, prompts: str, output: Path, num_heads: int, epochs: int, max_new_tokens: int, lr: float, threads: int
) -> str:
    """The call that reproduces this run, recorded in the heads file."""
    args = (
        f"model={model!r}, prompts={str(prompts)!r}, output={str(output)!r}, num_heads={num_heads}, "
        f"epochs={epochs}, max_new_tokens={max_new_tokens}, lr={lr}, threads={threads}"
    )
    return f'python -c "from specgraph.methods.medusa.train import train_medusa; train_medusa({args})"'
