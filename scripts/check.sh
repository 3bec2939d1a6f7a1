#!/bin/sh
# Lint, type-check and run the whole test suite (slow tests included: they use the 135M model).
# The checks are the pre-commit hooks (.pre-commit-config.yaml: large files, ruff, ruff format,
# mypy), run on every tracked file; pre-commit comes with the test extra.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pre_commit run --all-files
# On every core (pytest-xdist): one test file per worker at a time, so a file's fixtures are built
# once; the shared fixtures in tests/conftest.py are built once for all workers. The slowest tests
# are listed at the end.
$PY -m pytest -q -n auto --dist loadfile --durations=15 "$@"
