"""Rank a model's vocabulary by frequency for reduced draft vocabularies (specgraph/draft_vocab.py)
and measure the coverage of each size on the target's own replies.

Corpus (reproducible on a fresh machine: nothing but what the install puts there):
  1. the Python standard library's sources (`sysconfig`'s stdlib path, its `test` folders
     excluded), in sorted path order, up to --max-mb MB (PSF licence);
  2. the target's own greedy replies to the shipped training prompts (specgraph/data/train.jsonl,
     chat-style questions; self-distillation as EAGLE and Medusa train on).
HumanEval and the chat/creative/repeat sets are not in the corpus: coverage is measured on the
target's greedy replies to them (held out).

    python scripts/draft_vocab.py smollm2-135m            # writes specgraph/data/vocab/<fingerprint>.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specgraph.bench import encode_prompt, read_prompts
from specgraph.corpus import stdlib_text
from specgraph.draft_vocab import _DIR, coverage, rank_tokens, save_ranking
from specgraph.loaders import load_model, load_tokenizer, model_fingerprint
from specgraph.runtime import Engine

SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def replies(engine: Engine | None, model, tokenizer, prompts: list[str], new_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The target's greedy replies: with a compiled `none` bundle of the model (the same tokens,
    several times faster), else Hugging Face `generate`."""
    out = []
    for prompt in tqdm(prompts, desc="greedy replies", file=sys.stderr):
        ids = encode_prompt(tokenizer, prompt)
        if engine is not None:
            out.append(list(engine.generate(ids, max_new_tokens=new_tokens).output_ids))
            continue
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        out.append(seq[0, len(ids) :].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--max-mb", type=float, default=24.0, help="standard-library text to read (default 24 MB)")
    parser.add_argument("--train-prompts", type=int, default=32, help="training prompts to reply to (default 32)")
    parser.add_argument("--held-out", type=int, default=8, help="prompts per held-out set (default 8)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--engine", default=None, help="a compiled `none` bundle of the model to generate with")
    parser.add_argument("-o", "--output", default=None, help="default: specgraph/data/vocab/<fingerprint>.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    engine = Engine(args.engine, threads=2) if args.engine else None
    loaded = load_model(args.model)
    assert loaded.hf_model is not None and loaded.tokenizer_dir is not None, "needs a model with a tokenizer"
    tokenizer = load_tokenizer(loaded.tokenizer_dir)
    counts = np.zeros(loaded.vocab_size, dtype=np.int64)  # the standard library's
    start = time.time()
    texts, files = stdlib_text(args.max_mb)
    code_tokens = 0
    for i in range(0, len(texts), 64):
        for ids in tokenizer(texts[i : i + 64], add_special_tokens=False)["input_ids"]:
            np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
            code_tokens += len(ids)
    print(f"stdlib: {files} files, {code_tokens:,} tokens ({time.time() - start:.0f} s)", file=sys.stderr)
    start = time.time()
    train = replies(
        engine,
        loaded.hf_model,
        tokenizer,
        read_prompts(str(_DIR.parent / "train.jsonl"), args.train_prompts),
        args.new_tokens,
    )
    chat_tokens = sum(len(r) for r in train)
    chat = np.zeros(loaded.vocab_size, dtype=np.int64)
    for reply in train:
        np.add.at(chat, np.asarray(reply, dtype=np.int64), 1)
    # the two parts weigh the same (each as token shares), or the code's millions of tokens would
    # drown the replies' thousands; in integer units of 1e-9 so the ranking is exact
    counts = (counts * 10**9 // max(code_tokens, 1)) + (chat * 10**9 // max(chat_tokens, 1))
    print(f"replies to {len(train)} training prompts: {chat_tokens:,} tokens ({time.time() - start:.0f} s)",
          file=sys.stderr)  # fmt: skip
    ranked = rank_tokens(counts)
    held = {name: replies(engine, loaded.hf_model, tokenizer, read_prompts(name, args.held_out), args.new_tokens)
            for name in ("humaneval", "chat", "creative")}  # fmt: skip
    table = {
        name: {size: round(coverage(ranked, size, (t for r in rs for t in r)), 4) for size in SIZES}
        for name, rs in held.items()
    }
    print("size   " + "  ".join(f"{n:>9s}" for n in table))
    for size in SIZES:
        print(f"{size:<6d} " + "  ".join(f"{table[n][size]:9.4f}" for n in table))
    fingerprint = model_fingerprint(loaded)
    out = Path(args.output) if args.output else _DIR / f"{fingerprint}.json"
    meta = {
        "model": loaded.name,
        "fingerprint": fingerprint,
        "corpus": {
            "stdlib": f"Python {sys.version.split()[0]} standard library sources, {files} files (PSF licence)",
            "stdlib_tokens": code_tokens,
            "replies": f"the target's greedy replies ({args.new_tokens} tokens) to the first {len(train)} prompts "
            "of specgraph/data/train.jsonl",
            "reply_tokens": chat_tokens,
            "weights": "each part's token shares, summed (the two parts weigh the same)",
        },
        "coverage": {"measured_on": f"greedy replies ({args.new_tokens} tokens) to the first {args.held_out} "
                     "prompts of each held-out set", **{n: {str(s): c for s, c in t.items()} for n, t in table.items()}},
        "command": "python " + " ".join(sys.argv),
    }  # fmt: skip
    save_ranking(out, ranked, meta)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
