"""The bundles `specgraph advise` compares: the ones given, or compiled from a model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from specgraph import methods
from specgraph.errors import InputError
from specgraph.loaders import source_path

DEFAULT_METHODS = ("lookup", "medusa")  # compiled from a model when --methods is not given
_NEEDS_INPUT = {"draft": "--draft MODEL"}  # methods that cannot be compiled from the target alone


def parse_methods(text: str | None) -> list[str] | None:
    """`--methods a,b` as checked method names (InputError naming an unknown one); None if not given."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise InputError("--methods needs at least one method")
    for name in names:
        methods.get(name)  # InputError listing the methods there are
    if names == ["none"]:
        raise InputError("--methods lists only none: name the speculative methods to compare with it")
    return [n for n in dict.fromkeys(names) if n != "none"]


def _manifest(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def resolve(targets: list[str], wanted: list[str] | None, folder: Path,
            compile_one: Callable[[str, str, Path], None]) -> list[Path]:  # fmt: skip
    """The bundles to compare. Each target is a bundle folder or a model. Bundles are used as
    they are (only the methods in `wanted`, and `none`, when it is given). A model gets a bundle
    per method (`none` and `wanted`, by default lookup and medusa) in `folder/METHOD`: one already
    there, compiled from the same model for that method, is reused; otherwise `compile_one(model,
    method, path)` makes it."""
    bundles = [Path(t) for t in targets if _manifest(Path(t)) is not None]
    models = [t for t in targets if _manifest(Path(t)) is None]
    if len(models) > 1:
        raise InputError(f"give one model to compile (or bundles), not {len(models)}: {', '.join(models)}")
    if wanted is not None:
        keep = {"none", *wanted}
        bundles = [b for b in bundles if (_manifest(b) or {}).get("method") in keep]
    if not models:
        have = {(_manifest(b) or {}).get("method") for b in bundles}
        missing = [m for m in (wanted or []) if m not in have]
        if missing:
            raise InputError(f"no bundle for method {missing[0]}: give one, or a model to compile it from")
        return bundles
    model = models[0]
    have = {(_manifest(b) or {}).get("method") for b in bundles}
    out = list(bundles)
    for method in ["none", *(wanted if wanted is not None else DEFAULT_METHODS)]:
        if method in have:
            continue
        if method in _NEEDS_INPUT:
            raise InputError(f"--method {method} needs {_NEEDS_INPUT[method]}: compile its bundle yourself and give it")
        path = folder / method
        found = _manifest(path)
        source = (found or {}).get("source")
        if not (
            found
            and found.get("method") == method
            and isinstance(source, dict)
            and source.get("path") == source_path(model)
        ):
            compile_one(model, method, path)
        out.append(path)
    return out
