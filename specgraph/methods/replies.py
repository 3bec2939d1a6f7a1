"""The target's own text for training a drafter: its replies to the training prompts.

`generate_replies` makes the target's greedy reply (and any sampled ones) to every prompt with a
compiled `none` engine, in batches, and caches them beside the drafter file as `<name>.gen.json`,
so a rerun with the same prompts, model and budget skips the generation. Every method's training
(`teacher.py`) reads its chat text from here.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from tqdm import tqdm

from specgraph.bench import _read_records, checked_ids, encode_prompt, prompt_file
from specgraph.errors import InputError
from specgraph.loaders import LoadedModel, load_tokenizer
from specgraph.outputs import GEN_CACHE, write_file
from specgraph.sampling import SamplingParams

GENERATE_BATCH = 16  # prompts per engine call when generating the training text
TRAIN_SET = Path(__file__).resolve().parents[1] / "data" / "train.jsonl"  # what prompts="train" names
# sampled replies to the training prompts (`samples`): the target's own text, more varied than greedy
SAMPLE_PARAMS = SamplingParams(temperature=0.8, top_p=0.95)


class Replies(NamedTuple):
    """The target's text for one training prompt: its greedy reply and any sampled ones."""

    prompt: list[int]
    greedy: list[int]
    sampled: list[list[int]]


def training_inputs(model: str, prompts: str, engine_bundle: str | None) -> list[str | Path | None]:
    """What a training run reads, which its outputs must never touch."""
    from specgraph.default_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME, cache_root

    source = cache_root() / DEFAULT_MODEL_NAME if model == DEFAULT_MODEL else model
    return [source, TRAIN_SET if prompts == "train" else prompt_file(prompts), engine_bundle]


def gen_cache_path(output: Path) -> Path:
    """`heads.safetensors` -> `heads.gen.json`: the target's generated text, reused by a rerun."""
    return output.with_name(output.name.split(".")[0] + ".gen.json")


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


def generate_replies(
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
    cache = gen_cache_path(output)
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


def split_held(seqs: list[Any], holdout: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Whole sequences out of training: (held out, kept), at least one of each."""
    if len(seqs) < 2:
        raise InputError(f"need at least 2 prompts (one to train on, one to hold out), got {len(seqs)}")
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    n_held = min(max(1, round(holdout * len(seqs))), len(seqs) - 1)
    return [seqs[i] for i in sorted(order[:n_held])], [seqs[i] for i in sorted(order[n_held:])]


# --- 2. hidden states, once ----------------------------------------------------------------------
