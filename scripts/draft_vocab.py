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
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from specgraph.bench import encode_prompt, read_prompts
from specgraph.draft_vocab import _DIR, coverage, rank_tokens, save_ranking
from specgraph.loaders import load_model, load_tokenizer
from specgraph.methods.medusa.heads import model_fingerprint

SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def stdlib_text(max_mb: float) -> tuple[list[str], int]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, size, files = [], 0, 0
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("site-packages", "test", "idlelib") or "tests" in parts or "test" in parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text.encode())
        files += 1
        if size >= max_mb * 1e6:
            break
    return texts, files


def replies(model, tokenizer, prompts: list[str], new_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for prompt in prompts:
        ids = torch.tensor([encode_prompt(tokenizer, prompt)])
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        out.append(seq[0, ids.shape[1] :].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--max-mb", type=float, default=24.0, help="standard-library text to read (default 24 MB)")
    parser.add_argument("--train-prompts", type=int, default=64, help="training prompts to reply to (default 64)")
    parser.add_argument("--held-out", type=int, default=10, help="prompts per held-out set (default 10)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("-o", "--output", default=None, help="default: specgraph/data/vocab/<fingerprint>.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model(args.model)
    assert loaded.hf_model is not None and loaded.tokenizer_dir is not None, "needs a model with a tokenizer"
    tokenizer = load_tokenizer(loaded.tokenizer_dir)
    counts = np.zeros(loaded.vocab_size, dtype=np.int64)
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
        loaded.hf_model, tokenizer, read_prompts(str(_DIR.parent / "train.jsonl"), args.train_prompts), args.new_tokens
    )
    chat_tokens = sum(len(r) for r in train)
    for reply in train:
        np.add.at(counts, np.asarray(reply, dtype=np.int64), 1)
    print(f"replies to {len(train)} training prompts: {chat_tokens:,} tokens ({time.time() - start:.0f} s)",
          file=sys.stderr)  # fmt: skip
    ranked = rank_tokens(counts)
    held = {name: replies(loaded.hf_model, tokenizer, read_prompts(name, args.held_out), args.new_tokens)
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
        },
        "coverage": {"measured_on": f"greedy replies ({args.new_tokens} tokens) to the first {args.held_out} "
                     "prompts of each held-out set", **{n: {str(s): c for s, c in t.items()} for n, t in table.items()}},
        "command": "python " + " ".join(sys.argv),
    }  # fmt: skip
    save_ranking(out, ranked, meta)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
