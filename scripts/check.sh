#!/bin/sh
# Lint, type-check and run the whole test suite (slow tests included: they use the 135M model).
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m ruff check .
$PY -m ruff format --check .
$PY -m mypy
$PY -m pytest -q "$@"
