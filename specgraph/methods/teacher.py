"""What every drafter's training shares: the frozen target as a teacher, its text, its features, the fit loop.

1. Text (`Text`; reproducible on a fresh machine: nothing is downloaded):
   - code: `--corpus-mb` MB of the Python standard library's sources (`specgraph.corpus`), cut
     into windows of `--seq-len` tokens;
   - chat: the target's own replies to the training prompts (`replies.py`), and with
     `--function-prompts` to code requests in HumanEval's form.
   Whole sequences of each kind are held out.
2. `teacher_sets`: one no-grad pass of the HF model per batch of sequences gives, at every
   position, the LM head's input (the feature, after the final norm) and the target's argmax
   there (and, for early exit, the hidden state after a layer), cached beside the drafter file
   as `<name>.features.safetensors` for a rerun on the same text.
3. `fit`: AdamW with cosine decay over the drafter's parameters only, with held-out measurements
   `--curve` times while training (acceptance against training tokens, and the seconds each took).

EAGLE (`eagle/train.py`), early exit (`early_exit/train.py`) and Medusa (`medusa/train.py`) each
add their own model, loss and held-out measure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specgraph import corpus, draft_vocab
from specgraph.bench import encode_prompt
from specgraph.errors import InputError, OutputError
from specgraph.loaders import load_model, load_tokenizer, model_fingerprint
from specgraph.methods.replies import SAMPLE_PARAMS, gen_cache_path, generate_replies, split_held, training_inputs
from specgraph.outputs import FEATURE_CACHE, GEN_CACHE, HEADS, check_output, write_file

IGNORE = -100  # a label the loss skips (a token outside the draft vocabulary, or no label there)
FEATURES = "specgraph-features-1"  # the feature cache's format (`_cached_features`)


@dataclass
class Teacher:
    """The frozen target as a training run reads it, with the drafter's reduced readout."""

    loaded: Any  # LoadedModel
    hf: Any  # its Hugging Face model, eval()
    lm_weight: torch.Tensor  # [V, H] the LM head
    fingerprint: str | None
    chosen: tuple[torch.Tensor, dict[str, Any]] | None  # the draft vocabulary (None: all tokens)
    index: torch.Tensor  # [V] token id -> draft-vocabulary index, IGNORE outside it
    readout: torch.Tensor  # [V_d, H] the LM head's rows for the draft vocabulary

    @property
    def ids(self) -> torch.Tensor:
        """[V_d] the draft vocabulary's token ids, in readout order."""
        return torch.arange(len(self.index)) if self.chosen is None else self.chosen[0].to(torch.int64)

    def vocab_meta(self) -> dict[str, Any] | None:
        return None if self.chosen is None else {k: v for k, v in self.chosen[1].items() if k != "ids"}


def load_teacher(model: str, draft_vocab_size: int | None, default_vocab: int, what: str) -> Teacher:
    """Load the target for training `what`; InputError unless it is a Hugging Face model with an LM head."""
    loaded = load_model(model)
    hf = loaded.hf_model
    lm_head = hf.get_output_embeddings() if hf is not None else None
    if hf is None or lm_head is None:
        raise InputError(f"{model}: training {what} needs a Hugging Face model with an LM head")
    hf.eval()
    lm_weight = lm_head.weight.detach()
    fingerprint = model_fingerprint(loaded)
    chosen = draft_vocab.choose(draft_vocab_size, None, default_vocab, fingerprint, lm_weight.shape[0], loaded.name)
    index, readout = reduced_readout(lm_weight, chosen)
    return Teacher(loaded, hf, lm_weight, fingerprint, chosen, index, readout)


def save_and_report(output: Path, save: Callable[[Path], None], meta: dict[str, Any], losses: list[float],
                    info: dict[str, Any], timings: dict[str, float], guard: tuple[Any, bool],
                    curve: Callable[[dict[str, Any]], str] | None) -> dict[str, Any]:  # fmt: skip
    """Write the drafter file and return the run's report (its meta, losses, timings), printing
    the held-out curve with `curve` (None: quietly)."""
    write_file(output, save, HEADS, *guard)
    result = {**meta, "epoch_loss": [round(v, 5) for v in losses], "generation_cached": info["cached"],
              "features_cached": info["features_cached"], "timings": {k: round(v, 2) for k, v in timings.items()}}  # fmt: skip
    if curve is not None:
        print(curve(result), file=sys.stderr)
    return result


@dataclass(frozen=True)
class Text:
    """What a drafter trains on: the target's replies to `prompts` (its greedy one and `samples`
    sampled ones each) and `corpus_mb` MB of code in windows of `seq_len` tokens, `holdout` of each
    kind held out (whole prompts, measured on their greedy replies)."""

    prompts: str = "train"
    corpus_mb: float = 1.0
    max_new_tokens: int = 128
    seq_len: int = 256
    holdout: float = 0.05
    seed: int = 0
    samples: int = 0  # sampled replies per training prompt, beside the greedy one
    functions: int = 0  # code requests from the standard library's documented functions (`corpus`)


@dataclass(frozen=True)
class Schedule:
    epochs: int = 2
    lr: float = 1e-3
    batch_size: int = 8
    curve: int = 4  # held-out evaluations while training
    token_loss: str = "argmax"  # EAGLE: the token term's target, "argmax" or "distribution" (TOKEN_LOSSES)
    depth: int = 1  # EAGLE: passes per batch, each drafting from the previous pass's features


def check_run(model: str, output: str | Path, text: Text, schedule: Schedule, threads: int, engine_bundle: str | None,
              force: bool) -> tuple[list[str | Path | None], Path]:  # fmt: skip
    """Refuse bad settings and outputs before anything runs; (what the run reads, the output path)."""
    if schedule.epochs < 1 or schedule.batch_size < 1 or threads < 1 or text.seq_len < 8 or schedule.curve < 1 \
            or not schedule.lr > 0 or min(text.corpus_mb, text.samples, text.functions) < 0:  # fmt: skip
        raise InputError("epochs, batch size, threads and --curve must be at least 1, --seq-len at least 8, "
                         "lr positive and --corpus-mb, --samples and --function-prompts not negative")  # fmt: skip
    inputs = training_inputs(model, text.prompts, engine_bundle)
    for cache, what in ((gen_cache_path(Path(output)), "generation"), (feature_cache_path(Path(output)), "feature")):
        if cache == Path(output):
            raise OutputError(f"{output} would also be its own {what} cache; give a name not ending in {cache.suffixes[-2]}"
                              f"{cache.suffix}")  # fmt: skip
    path = check_output(output, HEADS, inputs, force)
    check_output(gen_cache_path(path), GEN_CACHE, inputs, force)
    check_output(feature_cache_path(path), FEATURE_CACHE, inputs, force)
    return inputs, path


def reduced_readout(
    lm_weight: torch.Tensor, chosen: tuple[torch.Tensor, Any] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token id -> draft-vocabulary index, IGNORE outside it [V]; the LM head's rows [V_d, H])."""
    vocab = lm_weight.shape[0]
    ids = torch.arange(vocab) if chosen is None else chosen[0].to(torch.int64)
    index = torch.full((vocab,), IGNORE, dtype=torch.int64)
    index[ids] = torch.arange(len(ids))
    return index, lm_weight[ids]


def teacher_sets(model: str, loaded: Any, text: Text, output: Path, batch_size: int, threads: int,
                 engine_bundle: str | None, progress: bool, guard: tuple[Any, bool],
                 layer: int | None = None) -> tuple[list[Any], dict[str, list[Any]], dict[str, Any]]:  # fmt: skip
    """The teacher-forced training set and the held-out sets by kind (chat, code) of `target_features`
    (with the hidden state after `layer` too, when given), and what was read: the numbers of
    training replies and windows, the code files, whether the replies came from the cache, the
    seconds each stage took."""
    hf = loaded.hf_model
    lm_head = hf.get_output_embeddings()
    t0 = time.perf_counter()
    requests = function_requests(loaded, text)
    replies, cached = generate_replies(model, loaded, text.prompts, output, text.max_new_tokens, threads, engine_bundle,
                                progress, guard, text.samples, requests)  # fmt: skip
    asked = {tuple(ids) for ids in requests}
    # a reply's entries count from its prompt's last position on (the first draft of a reply
    # comes from there); the chat template and prompt before it are context only
    seq_len = text.seq_len
    window = lambda p, r: ((p + r)[-seq_len:], max(0, len(p) - 1 - max(0, len(p) + len(r) - seq_len)))  # noqa: E731
    code_seqs, files = _code_windows(loaded, text.corpus_mb, seq_len, text.seed)
    text_s = time.perf_counter() - t0
    # whole prompts are held out, and only their greedy replies measured: what an engine drafts for
    held_text: dict[str, list[Any]] = {}
    train_text: list[Any] = []
    for name, part in (("chat", [r for r in replies if tuple(r.prompt) not in asked]),
                       ("functions", [r for r in replies if tuple(r.prompt) in asked])):  # fmt: skip
        if part:
            held_prompts, train_prompts = split_held(part, text.holdout, text.seed)
            held_text[name] = [window(c.prompt, c.greedy) for c in held_prompts]
            train_text += [window(c.prompt, r) for c in train_prompts for r in (c.greedy, *c.sampled)]
    held_code, train_code = split_held(code_seqs, text.holdout, text.seed) if len(code_seqs) >= 2 else ([], code_seqs)
    if held_code:
        held_text["code"] = held_code

    t0 = time.perf_counter()
    sets = {"train": train_text + train_code, **{f"held.{name}": seqs for name, seqs in held_text.items()}}
    computed = lambda: {name: target_features(hf, lm_head, seqs, batch_size, progress,  # noqa: E731
                                        "features (train)" if name == "train" else f"features (held-out {name[5:]})",
                                        layer) for name, seqs in sets.items()}  # fmt: skip
    features, features_cached = _cached_features(feature_cache_path(output), loaded, sets, layer, computed, guard,
                                                 progress)  # fmt: skip
    train = features.pop("train")
    held = {name[5:]: entries for name, entries in features.items()}
    timings = {"text_s": text_s, "features_s": time.perf_counter() - t0}
    info = {"chats": len(train_text), "windows": len(train_code), "files": files, "cached": cached,
            "features_cached": features_cached, "functions": len(asked), "timings": timings}  # fmt: skip
    return train, held, info


def feature_cache_path(output: Path) -> Path:
    """`drafter.safetensors` -> `drafter.features.safetensors`: the teacher-forced features, reused by a
    rerun on the same text (another loss, depth or schedule) instead of an hour of target passes."""
    return output.with_name(output.name.split(".")[0] + ".features.safetensors")


def _cached_features(path: Path, loaded: Any, sets: dict[str, list[Any]], layer: int | None,
                     computed: Callable[[], dict[str, list[Any]]], guard: tuple[Any, bool],
                     progress: bool) -> tuple[dict[str, list[Any]], bool]:  # fmt: skip
    """`target_features` of every set, from `path` when it holds them for exactly these token sequences
    of this model (and `layer`), else `computed()` and then kept there; (them, whether cached)."""
    key = hashlib.sha256(json.dumps([loaded.name, model_fingerprint(loaded), layer]).encode())
    for name, seqs in sets.items():
        key.update(json.dumps([name, [[list(ids), first] for ids, first in seqs]]).encode())
    digest = key.hexdigest()
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("key") == digest:
                    return {name: _unpack(f, name, len(seqs)) for name, seqs in sets.items()}, True
        except Exception:  # noqa: BLE001 - a damaged or foreign cache is recomputed, and replaced only if ours
            pass
    features = computed()
    tensors = {k: v for name, entries in features.items() for k, v in _pack(name, entries).items()}
    write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FEATURES, "key": digest}),
               FEATURE_CACHE, *guard)  # fmt: skip
    if progress:
        size = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
        print(f"kept the features in {path} ({size:.0f} MB) for a rerun on the same text", file=sys.stderr)
    return features, False


def _pack(name: str, entries: list[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
    """`target_features` entries of one set as flat tensors (tokens, features, argmax, [hidden]) with lengths."""
    packed = {f"{name}.lengths": torch.tensor([len(e[0]) for e in entries], dtype=torch.int64),
              f"{name}.first": torch.tensor([e[3] for e in entries], dtype=torch.int64),
              f"{name}.tokens": torch.cat([e[0] for e in entries]), f"{name}.features": torch.cat([e[1] for e in entries]),
              f"{name}.top": torch.cat([e[2] for e in entries])}  # fmt: skip
    if entries and len(entries[0]) > 4:
        packed[f"{name}.hidden"] = torch.cat([e[4] for e in entries])
    return {k: v.contiguous() for k, v in packed.items()}


def _unpack(f: Any, name: str, count: int) -> list[tuple[Any, ...]]:
    """The entries `_pack` wrote for set `name` (views of the loaded tensors)."""
    lengths = f.get_tensor(f"{name}.lengths").tolist()
    if len(lengths) != count:
        raise ValueError(f"{name}: {len(lengths)} sequences cached, {count} asked for")
    kinds = ("tokens", "features", "top") + (("hidden",) if f"{name}.hidden" in f.keys() else ())
    tokens, feats, top, *hidden = (f.get_tensor(f"{name}.{k}").split(lengths) for k in kinds)
    firsts = f.get_tensor(f"{name}.first").tolist()
    return [(tokens[i], feats[i], top[i], firsts[i], *(h[i] for h in hidden)) for i in range(count)]


def corpus_meta(text: Text, info: dict[str, Any]) -> dict[str, str]:
    """The training text as a drafter file's header names it."""
    return {
        "code": f"{corpus.LICENCE}, {text.corpus_mb} MB ({info['files']} files, {info['windows']} windows of "
        f"{text.seq_len} tokens for training)",
        "chat": f"the target's greedy replies to {text.prompts}"
        + (f" and {text.samples} sampled ones each ({sample_text()})" if text.samples else "")
        + (
            f", and to {info['functions']} requests in HumanEval's form from the standard library's documented "
            "functions"
            if info["functions"]
            else ""
        )
        + f" ({info['chats']} replies for training)",
    }


def function_requests(loaded: Any, text: Text) -> list[list[int]]:
    """`text.functions` code requests (`corpus.function_prompts`) as chat-template prompt ids."""
    if not text.functions:
        return []
    if loaded.tokenizer_dir is None:
        raise InputError(f"--function-prompts needs a model with a tokenizer; {loaded.name} has none")
    tokenizer = load_tokenizer(loaded.tokenizer_dir)
    return [encode_prompt(tokenizer, t, chat=True) for t in corpus.function_prompts(text.functions, text.seed)]


def sample_text() -> str:
    params = SAMPLE_PARAMS
    return f"temperature {params.temperature}, top-p {params.top_p}"


def _code_windows(loaded: Any, mb: float, seq_len: int, seed: int) -> tuple[list[tuple[list[int], int]], int]:
    """The standard library's text as windows of `seq_len` tokens (none without a tokenizer),
    each with its first counted entry (0: all of them)."""
    if loaded.tokenizer_dir is None or mb == 0:
        return [], 0
    tokenizer = load_tokenizer(loaded.tokenizer_dir)
    texts, files = corpus.stdlib_text(mb, seed=seed)
    windows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        windows += [(ids[i : i + seq_len], 0) for i in range(0, len(ids) - 8, seq_len)]
    return windows, files


@torch.no_grad()
def target_features(hf: Any, lm_head: Any, seqs: list[tuple[list[int], int]], batch_size: int, progress: bool,
              desc: str, layer: int | None = None) -> list[tuple[Any, ...]]:  # fmt: skip
    """Per (sequence, first counted entry): (tokens [L], features [L, H] bfloat16, the target's
    argmax [L], the first counted entry) and, with `layer`, the hidden state after that many
    decoder layers [L, H] bfloat16 (early exit's input)."""
    out = []
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))  # similar lengths share a batch
    bar = tqdm(total=sum(len(s) for s, _ in seqs), desc=desc, unit="tok", file=sys.stderr, disable=not progress)
    for start in range(0, len(order), batch_size):
        group = [seqs[i] for i in order[start : start + batch_size]]
        width = max(len(s) for s, _ in group)
        ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s, _ in group])  # right padding: causal, unread
        run = hf.model(ids, output_hidden_states=layer is not None)
        feats = run.last_hidden_state  # [b, W, H] after the final norm: the LM head's input
        top = lm_head(feats).argmax(-1)  # [b, W]
        for row, (s, first) in enumerate(group):
            n = len(s)
            entry: tuple[Any, ...] = (
                ids[row, :n].clone(),
                feats[row, :n].to(torch.bfloat16),
                top[row, :n].clone(),
                first,
            )
            if layer is not None:  # hidden_states[0] is the embedding's output
                entry += (run.hidden_states[layer][row, :n].to(torch.bfloat16),)
            out.append(entry)
        bar.update(sum(len(s) for s, _ in group))
    bar.close()
    return out


def fit(module: torch.nn.Module, loss_of: Callable[[list[Any]], tuple[torch.Tensor, int]],
        evaluate: Callable[[], dict[str, Any]], train: list[Any], schedule: Schedule, rng: random.Random,
        progress: bool) -> tuple[list[float], list[dict[str, Any]]]:  # fmt: skip
    """AdamW with cosine decay over `module`'s trainable parameters, `schedule.epochs` shuffled
    passes over `train` in batches; `loss_of(batch)` gives (loss, entries it counted). Returns the
    mean loss per epoch and `schedule.curve` points of `evaluate()` against the entries seen."""
    # subnormal floats (a softmax's far tail, its gradient) take a slow path on x86 that made a
    # readout's backward 17x slower here; flushed to zero while training, restored after
    flushed = torch.set_flush_denormal(True)
    try:
        return _fit(module, loss_of, evaluate, train, schedule, rng, progress)
    finally:
        if flushed:
            torch.set_flush_denormal(False)


def _fit(module: torch.nn.Module, loss_of: Callable[[list[Any]], tuple[torch.Tensor, int]],
         evaluate: Callable[[], dict[str, Any]], train: list[Any], schedule: Schedule, rng: random.Random,
         progress: bool) -> tuple[list[float], list[dict[str, Any]]]:  # fmt: skip
    steps = schedule.epochs * math.ceil(len(train) / schedule.batch_size)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=schedule.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    marks = {round(steps * (i + 1) / schedule.curve) for i in range(schedule.curve)}
    losses, points, seen, step, t0 = [], [], 0, 0, time.perf_counter()
    bar = tqdm(total=steps, desc="train", unit="step", file=sys.stderr, disable=not progress)
    for _ in range(schedule.epochs):
        order = list(range(len(train)))
        rng.shuffle(order)
        total, count = 0.0, 0
        for start in range(0, len(order), schedule.batch_size):
            loss, counted = loss_of([train[i] for i in order[start : start + schedule.batch_size]])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            value = float(loss.detach())
            total, count, step, seen = total + value, count + 1, step + 1, seen + counted
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}")
            if step in marks:
                points.append({"train_tokens": seen, "seconds": round(time.perf_counter() - t0, 1), **evaluate()})
        losses.append(total / max(count, 1))
    bar.close()
    return losses, points


def add_corpus_flags(group: argparse._ArgumentGroup) -> None:
    """`specgraph train` flags of the teacher-forced text (`Text`), for every method that trains on
    it: the first method to add them serves the others (a group shares its parser's flags)."""
    flags = [("--corpus-mb", float, 1.0, "MB of the Python standard library's sources to train on, beside the "
                                          "target's replies to --prompts (default 1.0)"),
             ("--seq-len", int, 256, "tokens per code window (default 256)"),
             ("--curve", int, 4, "held-out acceptance measured this many times while training (default 4)"),
             ("--samples", int, 0, "sampled replies (temperature 0.8, top-p 0.95) per training prompt beside its "
                                   "greedy one: more of the target's own text from the same prompts (default 0)"),
             ("--function-prompts", int, 0, "code requests in HumanEval's form (a signature and docstring) made from "
                                            "this many of the standard library's documented functions, answered by the "
                                            "target beside --prompts (default 0)")]  # fmt: skip
    for flag, kind, default, text in flags:
        if flag not in group._option_string_actions:
            group.add_argument(
                flag, type=kind, default=default, help=f"training text (eagle, early-exit, medusa): {text}"
            )


def text_of(args: argparse.Namespace) -> Text:
    """The `Text` the corpus flags ask for."""
    return Text(args.prompts, args.corpus_mb, args.max_new_tokens or Text.max_new_tokens, args.seq_len,
                samples=args.samples, functions=args.function_prompts)  # fmt: skip
