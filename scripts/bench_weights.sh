#!/bin/sh
# The figures of docs/benchmarks.md's "Quantised engines" section (issue 9), in one go.
# Needs llama-cpp-python for the side-by-side rows (sh scripts/install_llamacpp.sh).
#   sh scripts/bench_weights.sh            # bundles in out/, reports in docs/bench/
set -eu
cd "$(dirname "$0")/.."
T=2
compile() { name=$1; shift; [ -f "out/$name/manifest.json" ] || specgraph compile smollm2-135m -o "out/$name" "$@"; }
compile fp32-none --method none --weights fp32
compile src-none --method none                   # --kernels auto: native where host/build has the library
compile src-ort-none --method none --kernels ort  # ONNX Runtime's MatMulNBits
compile src-i8-none --method none --activations int8
compile src-lookup --method lookup
# plain decoding per weight type: HF generate, llama.cpp (same GGUF, same prompt ids), floor, c(N)
for b in src-none src-ort-none src-i8-none fp32-none; do
    specgraph bench "out/$b" --prompts humaneval --limit 8 --max-new-tokens 96 --threads $T \
        --json "docs/bench/weights-$b.json" --force
done
# one step, interleaved across weight types (rotated order)
python scripts/ab_step.py out/fp32-none out/src-ort-none out/src-none out/src-i8-none
specgraph bench out/src-none --reference out/src-ort-none --prompts humaneval --limit 8 --max-new-tokens 96 \
    --threads $T --json docs/bench/native-src-none.json --force
# prompt lookup on top of the exact source-weights none engine, same run (int8 activations are none-only)
specgraph bench out/src-lookup --prompts humaneval --limit 8 --max-new-tokens 96 --threads $T \
    --reference out/src-none --json docs/bench/weights-src-lookup.json --force
# how far int8 activations are from exact ones (perplexity, greedy agreement)
[ -f out/fp32-logits/manifest.json ] || specgraph compile smollm2-135m -o out/fp32-logits --weights fp32 --emit-logits
python scripts/activation_error.py out/fp32-logits --texts 30 --prompts 6 --json docs/bench/activation-error.json
