"""Training text that every install has: the Python standard library's own sources (PSF licence).

Reproducible on a fresh machine (nothing is downloaded), code-heavy, and disjoint from the
benchmark prompts: the `test` folders and `idlelib` are left out, and HumanEval's problems are
not in the standard library.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

LICENCE = "Python standard library sources (PSF License Agreement)"


def stdlib_text(max_mb: float, seed: int | None = None) -> tuple[list[str], int]:
    """Up to `max_mb` MB of the standard library's `.py` files: (their texts, how many), in
    sorted path order, or in an order shuffled with `seed` (a spread of modules, not only the
    alphabet's first)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.rglob("*.py"))
    if seed is not None:
        random.Random(seed).shuffle(paths)
    texts, size, files = [], 0, 0
    for path in paths:
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
