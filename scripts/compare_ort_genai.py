"""Side-by-side: ONNX Runtime GenAI against a specgraph `none` bundle, same prompts, same machine.

Not part of the package or the tests (ORT GenAI is an optional, separate install). Run it with a
Python that has `onnxruntime-genai` (its model builder converts a local HF folder offline):

    python -m venv --system-site-packages /tmp/og && /tmp/og/bin/pip install onnxruntime-genai
    /tmp/og/bin/python -m onnxruntime_genai.models.builder -i ~/.cache/specgraph/SmolLM2-135M-Instruct \\
        -o /tmp/og_fp32 -p fp32 -e cpu
    /tmp/og/bin/python scripts/compare_ort_genai.py /tmp/og_fp32 out/smollm2-none --prompts humaneval --limit 6
    /tmp/og/bin/python scripts/compare_ort_genai.py /tmp/og_fp32 out/fp-none out/fp-draft --prompts humaneval,chat --limit 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import onnxruntime_genai as og

from specgraph.bench import encode_prompt, read_prompts
from specgraph.runtime import Engine


def genai_tokens_per_s(model: og.Model, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Greedy decode; decode rate excludes the first token (prefill), like specgraph's figure."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + new_tokens, min_length=len(ids) + new_tokens)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    out: list[int] = []
    first = None
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
        if first is None:
            first = time.perf_counter()
    assert first is not None
    return (len(out) - 1) / (time.perf_counter() - first), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("genai_dir")
    parser.add_argument("bundles", nargs="+", help="specgraph bundles, each run beside ORT GenAI prompt by prompt")
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engines = [Engine(b, threads=args.threads) for b in args.bundles]
    config = og.Config(args.genai_dir)
    config.clear_providers()
    model = og.Model(config)
    prompts = [encode_prompt(engines[0].tokenizer, p) for p in read_prompts(args.prompts, args.limit)]
    theirs: list[float] = []
    ours: list[list[float]] = [[] for _ in engines]
    same = [0 for _ in engines]
    genai_tokens_per_s(model, prompts[0], 8)  # warm-up
    for engine in engines:
        engine.generate(prompts[0], max_new_tokens=8, stop_at_eos=False)
    for ids in prompts:  # interleaved, so every engine sees the same machine state
        rate, out = genai_tokens_per_s(model, ids, args.max_new_tokens)
        theirs.append(rate)
        for i, engine in enumerate(engines):
            result = engine.generate(ids, max_new_tokens=args.max_new_tokens, stop_at_eos=False)
            ours[i].append(result.tokens_per_s)
            same[i] += out == result.output_ids
    base = statistics.median(theirs)
    print(f"ORT GenAI: median {base:.1f} tok/s")
    for bundle, rates, n in zip(args.bundles, ours, same, strict=True):
        print(
            f"specgraph {bundle}: median {statistics.median(rates):.1f} tok/s (ratio {statistics.median(rates) / base:.2f}), "
            f"identical greedy output on {n}/{len(prompts)} prompts"
        )


if __name__ == "__main__":
    main()
