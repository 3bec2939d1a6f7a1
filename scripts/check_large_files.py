#!/usr/bin/env python3
"""Refuse files over 1 MiB, so a bundle, an ONNX weight file or a profile dump never lands.

pre-commit passes the staged files (every tracked file with `--all-files`); without arguments
the script checks every file git tracks. The only large files allowed are the shipped
drafters (specgraph/data/heads/: the Medusa heads are 5.3 MB, the EAGLE layer 8.4 MB),
up to their own limit.
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

LIMIT = 1 << 20  # 1 MiB
ALLOWED = {"specgraph/data/heads/*.safetensors": 9 << 20}  # pattern -> its own limit


def _limit(path: str) -> int:
    return max([LIMIT, *(size for pattern, size in ALLOWED.items() if fnmatch.fnmatch(path, pattern))])


def main(paths: list[str]) -> int:
    if not paths:
        paths = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout.splitlines()
    too_large = []
    for path in paths:
        file = Path(path)
        if file.is_file() and not file.is_symlink() and file.stat().st_size > _limit(path):
            too_large.append(f"{path} ({file.stat().st_size / 1e6:.1f} MB, limit {_limit(path) / 1e6:.1f} MB)")
    for line in too_large:
        print(f"too large to commit: {line}", file=sys.stderr)
    return 1 if too_large else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
