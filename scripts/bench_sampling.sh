#!/bin/sh
# The sampling figures of docs/benchmarks.md (issue 4): every speculative engine against the
# `none` engine sampling with the same settings and seeds, in the same run.
#   sh scripts/bench_sampling.sh            (bundles in out/, about 10 minutes on 2 cores)
set -e
[ -d out/s-none ] || specgraph compile smollm2-135m -o out/s-none --method none --max-context 2048
[ -d out/s-lookup ] || specgraph compile smollm2-135m -o out/s-lookup --method lookup --max-context 2048
[ -d out/s-medusa ] || specgraph compile smollm2-135m -o out/s-medusa --method medusa --tree auto --max-context 2048
mkdir -p docs/bench
for t in 0.7 1.0; do
  specgraph bench out/s-lookup --prompts repeat --limit 8 --max-new-tokens 96 --reference out/s-none --threads 2 \
    --temperature $t --seed 0 --json docs/bench/sampled-lookup-repeat-t$t.json
  specgraph bench out/s-lookup --prompts humaneval --limit 6 --max-new-tokens 64 --reference out/s-none --threads 2 \
    --temperature $t --seed 0 --json docs/bench/sampled-lookup-humaneval-t$t.json
  specgraph bench out/s-medusa --prompts humaneval,chat,creative --limit 6 --max-new-tokens 64 --reference out/s-none \
    --threads 2 --temperature $t --seed 0 --json docs/bench/sampled-medusa-t$t.json
done
# the cost of top-p (a sorted prefix, or a full sort when the nucleus is wider than 256 tokens)
specgraph bench out/s-lookup --prompts humaneval --limit 6 --max-new-tokens 64 --reference out/s-none --threads 2 \
  --temperature 0.7 --top-p 0.9 --seed 0 --json docs/bench/sampled-lookup-humaneval-t0.7-p0.9.json
