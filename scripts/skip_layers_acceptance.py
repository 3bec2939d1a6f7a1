"""How often the target's int4 copy with some of its layers skipped proposes the target's next
token, as `--draft self:int4` would run it: each draft reads the target's own keys and values of
the committed tokens, runs only the kept layers on the one new token, and is read out by the
copy's LM head (eager PyTorch, weights rounded to int4 blocks of 32 as the copy's are; the copy's
int8 activations are left out). Prints the depth-1 acceptance of each layer set and how many of
the layers it runs, so a layer-skipping draft can be priced before it is built.

    python scripts/skip_layers_acceptance.py --prompts humaneval,chat --limit 4 --tokens 48 \
        --skip "" "12-15" "10-17" "9,11,13,15,17,19,21,23"
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from specgraph import blocks
from specgraph.bench import encode_prompt, read_prompts
from specgraph.default_model import DEFAULT_MODEL
from specgraph.loaders import load_model, load_tokenizer


def parse_layers(text: str, count: int) -> list[int]:
    """'9,11,13-15' -> [9, 11, 13, 14, 15] (0-based layer indices), checked against `count`."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    if any(not 0 < i < count for i in out):
        raise SystemExit(f"--skip {text!r}: layers are 1..{count - 1} (layer 0 stays)")
    return sorted(set(out))


def int4_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy whose 2-D weights are rounded to int4 blocks of 32 (blocks.quantize)."""
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for _, param in copy_.named_parameters():
            if param.dim() == 2 and param.shape[1] % 32 == 0:
                bw = blocks.quantize(param.detach().numpy(), 4, 32)
                param.copy_(torch.from_numpy(bw.dequantize()))
    return copy_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="humaneval,chat")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens generated per prompt")
    parser.add_argument("--skip", nargs="+", default=[""], help="layer sets to skip, e.g. '12-15' or '9,11,13'")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model(DEFAULT_MODEL)
    target = loaded.hf_model.float().eval()
    tokenizer = load_tokenizer(loaded.tokenizer_dir)
    draft = int4_copy(target)
    layers = draft.model.layers
    count = len(layers)
    results = []
    for name in args.prompts.split(","):
        texts = read_prompts(name, args.limit)
        seqs = []
        for text in texts:
            ids = torch.tensor([encode_prompt(tokenizer, text, chat=True)])
            with torch.no_grad():
                out = target.generate(ids, max_new_tokens=args.tokens, do_sample=False)
                full = target(out, use_cache=True)  # the target's cache, and its next token after each position
            seqs.append((ids.shape[1], out, full.past_key_values, full.logits[0].argmax(-1)))
        for skip_text in args.skip:
            skip = parse_layers(skip_text, count)
            kept = torch.nn.ModuleList([layer for i, layer in enumerate(layers) if i not in skip])
            agree = total = 0
            for start, seq, target_cache, want in seqs:
                for t in range(start, seq.shape[1] - 1):
                    cache = copy.deepcopy(target_cache)
                    cache.crop(t - seq.shape[1])  # keep the first t positions
                    draft.model.layers = kept
                    with torch.no_grad():
                        got = draft(seq[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1].argmax()
                    draft.model.layers = layers
                    agree += int(got == want[t])
                    total += 1
            rate = agree / max(total, 1)
            row = {"set": name, "skip": skip_text or "none", "layers_run": count - len(skip),
                   "acceptance_depth1": round(rate, 4), "positions": total}  # fmt: skip
            results.append(row)
            print(f"{name:10s} skip {row['skip']:28s} layers {row['layers_run']:2d}/{count}  "
                  f"depth-1 acceptance {rate:.3f} ({total} positions)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
