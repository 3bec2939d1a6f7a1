"""Time to the first token against llama.cpp by prompt length: each length's prompt (the first N
tokens of a long text) is prefilled by the bundle and by llama.cpp on the default GGUF, in turn,
`--repeats` times; prints the median prefill of each (as `specgraph bench` times it) and the ratio.
Needs llama-cpp-python (scripts/install_llamacpp.sh).

    python scripts/prefill_vs_llamacpp.py out/s34-none 32 150 500 1000
"""

from __future__ import annotations

import argparse
import inspect
import statistics

import specgraph.runtime
from specgraph.default_model import gguf_path
from specgraph.peers import llama_cpp_decoder
from specgraph.runtime import Engine
from specgraph.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", help="a bundle of the default model")
    ap.add_argument("lengths", type=int, nargs="+", help="prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(args.bundle, threads=args.threads)
    # a long, fixed text that ships with the package: this project's own runtime source
    ids = engine.tokenizer.encode(inspect.getsource(specgraph.runtime))
    llama = llama_cpp_decoder(gguf_path(), args.threads, max(args.lengths) + 8)
    greedy = SamplingParams()
    for n in args.lengths:
        prompt = ids[:n]
        ours, theirs = [], []
        for _ in range(args.repeats):  # in turn, so a slow spell hits both
            ours.append(engine.generate(prompt, 2, stop_at_eos=False).prefill_s)
            theirs.append(llama(prompt, 2, greedy).prefill_s)
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"{len(prompt)} prompt tokens: engine {a * 1e3:.0f} ms ({len(prompt) / a:.0f} tok/s), "
              f"llama.cpp {b * 1e3:.0f} ms ({len(prompt) / b:.0f} tok/s): engine {b / a:.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
