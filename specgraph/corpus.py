"""Training text that every install has: the Python standard library's own sources (PSF licence).

Reproducible on a fresh machine (nothing is downloaded), code-heavy, and disjoint from the
benchmark prompts: the `test` folders and `idlelib` are left out, and HumanEval's problems are
not in the standard library.
"""

from __future__ import annotations

import ast
import copy
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

LICENCE = "Python standard library sources (PSF License Agreement)"


def stdlib_text(max_mb: float, seed: int | None = None) -> tuple[list[str], int]:
    """Up to `max_mb` MB of the standard library's `.py` files: (their texts, how many), in
    sorted path order, or in an order shuffled with `seed` (a spread of modules, not only the
    alphabet's first)."""
    texts, size = [], 0
    for text in _sources(seed):
        texts.append(text)
        size += len(text.encode())
        if size >= max_mb * 1e6:
            break
    return texts, len(texts)


def function_prompts(count: int, seed: int = 0, per_file: int = 2, max_chars: int = 1000) -> list[str]:
    """Up to `count` code requests in HumanEval's form, a function's signature and docstring
    with its body left to write, from the standard library's documented public functions
    (at most `per_file` a module, so they spread over many; each at most `max_chars` long)."""
    prompts: list[str] = []
    for text in _sources(seed):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        found = 0
        for node in ast.walk(tree):
            if found == per_file or len(prompts) == count:
                break
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            if doc is None or len(doc.strip()) < 40:
                continue
            stub = copy.copy(node)  # the signature and docstring only
            stub.body, stub.decorator_list = [node.body[0]], []
            prompt = ast.unparse(stub) + "\n"
            if len(prompt) <= max_chars:
                prompts.append(prompt)
                found += 1
        if len(prompts) == count:
            break
    return prompts


def _sources(seed: int | None) -> Iterator[str]:
    """The standard library's `.py` files' texts, in sorted path order or shuffled with `seed`,
    without its tests and idlelib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.rglob("*.py"))
    if seed is not None:
        random.Random(seed).shuffle(paths)
    for path in paths:
        parts = path.relative_to(root).parts
        if parts[0] in ("site-packages", "test", "idlelib") or "tests" in parts or "test" in parts:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
