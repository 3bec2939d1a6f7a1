"""Train an EAGLE drafter on the frozen target's teacher-forced features.

1. Text (reproducible on a fresh machine: nothing is downloaded):
   - code: `--corpus-mb` MB of the Python standard library's sources (`specgraph.corpus`), cut
     into windows of `--seq-len` tokens;
   - chat: the target's own greedy replies to the training prompts (self-distillation, made in
     batches by a compiled `none` engine and cached in `<output>.gen.json`, shared with Medusa's).
   Whole sequences of each kind are held out.
2. One no-grad pass of the HF model per batch of sequences: the LM head's input (the feature,
   after the final norm) at every position, and the target's argmax token there.
3. Only the drafter learns. Entry j = (feature f_j + noise, embedding of x_{j+1}) predicts f_{j+1}:
   loss = SmoothL1(f', f_{j+1}) + CE_WEIGHT * CE(readout(f'), token target at j+1), the readout
   being the rows of the target's LM head for the reduced draft vocabulary. The token target is
   the target's argmax (`token_loss="argmax"`; a token outside the draft vocabulary is ignored by
   the loss and counted as a miss) or its whole distribution over the draft vocabulary
   (`"distribution"`, EAGLE's own classification loss: the readout of f_{j+1}). With `depth` 2 or
   more the drafter also trains on what it meets when drafting further (EAGLE-3's "training-time
   test"): pass d reads the features pass d - 1 predicted, shifted by one entry, and its loss is
   added. Noise on the input features (EAGLE's remedy for drafting from its own, imperfect
   features) and AdamW with cosine decay.
4. Held-out acceptance by depth: depth 1 drafts from the target's true features, depth 2 from the
   drafter's own predicted ones (as every later draft step does); the chain's expected tokens per
   round follow from them. Measured `--curve` times during training: acceptance against training
   tokens, with the seconds each point took.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specgraph import corpus, draft_vocab
from specgraph.bench import encode_prompt
from specgraph.errors import InputError
from specgraph.loaders import load_model, load_tokenizer
from specgraph.methods.eagle.drafter import EagleDrafter, Shape, save_drafter
from specgraph.methods.medusa.heads import model_fingerprint
from specgraph.methods.medusa.train import SAMPLE_PARAMS, _cache_path, _generate, _inputs, _split
from specgraph.outputs import FEATURE_CACHE, GEN_CACHE, HEADS, check_output, write_file

CE_WEIGHT = 0.3  # the token loss beside the feature regression
NOISE = 0.1  # std of the Gaussian noise on input features, relative to their RMS
IGNORE = -100
TOKEN_LOSSES = ("argmax", "distribution")
FEATURES = "specgraph-features-1"  # the feature cache's format (`_cached_features`)
MAX_DEPTH = 4  # training passes (`Schedule.depth`): the engine drafts at most a few tokens deep


def train_eagle(
    model: str,
    output: str | Path,
    prompts: str = "train",
    corpus_mb: float = 1.0,
    max_new_tokens: int = 128,
    epochs: int = 2,
    lr: float = 1e-3,
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
    if schedule.token_loss not in TOKEN_LOSSES:
        raise InputError(f"--token-loss must be one of {', '.join(TOKEN_LOSSES)}, got {schedule.token_loss!r}")
    if not 1 <= schedule.depth <= MAX_DEPTH:
        raise InputError(f"--train-depth must be 1 to {MAX_DEPTH}, got {schedule.depth}")
    inputs = _inputs(model, text.prompts, engine_bundle)
    path = check_output(output, HEADS, inputs, force)
    check_output(_cache_path(path), GEN_CACHE, inputs, force)
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
    """The teacher-forced training set and the held-out sets by kind (chat, code) of `_features`
    (with the hidden state after `layer` too, when given), and what was read: the numbers of
    training replies and windows, the code files, whether the replies came from the cache, the
    seconds each stage took."""
    hf = loaded.hf_model
    lm_head = hf.get_output_embeddings()
    t0 = time.perf_counter()
    requests = function_requests(loaded, text)
    replies, cached = _generate(model, loaded, text.prompts, output, text.max_new_tokens, threads, engine_bundle,
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
            held_prompts, train_prompts = _split(part, text.holdout, text.seed)
            held_text[name] = [window(c.prompt, c.greedy) for c in held_prompts]
            train_text += [window(c.prompt, r) for c in train_prompts for r in (c.greedy, *c.sampled)]
    held_code, train_code = _split(code_seqs, text.holdout, text.seed) if len(code_seqs) >= 2 else ([], code_seqs)
    if held_code:
        held_text["code"] = held_code

    t0 = time.perf_counter()
    sets = {"train": train_text + train_code, **{f"held.{name}": seqs for name, seqs in held_text.items()}}
    computed = lambda: {name: _features(hf, lm_head, seqs, batch_size, progress,  # noqa: E731
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
    """`_features` of every set, from `path` when it holds them for exactly these token sequences
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
    """`_features` entries of one set as flat tensors (tokens, features, argmax, [hidden]) with lengths."""
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
def _features(hf: Any, lm_head: Any, seqs: list[tuple[list[int], int]], batch_size: int, progress: bool,
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


def fit(module: torch.nn.Module, loss_of: Callable[[list[Any]], tuple[torch.Tensor, int]],
        evaluate: Callable[[], dict[str, Any]], train: list[Any], schedule: Schedule, rng: random.Random,
        progress: bool) -> tuple[list[float], list[dict[str, Any]]]:  # fmt: skip
    """AdamW with cosine decay over `module`'s trainable parameters, `schedule.epochs` shuffled
    passes over `train` in batches; `loss_of(batch)` gives (loss, entries it counted). Returns the
    mean loss per epoch and `schedule.curve` points of `evaluate()` against the entries seen."""
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
