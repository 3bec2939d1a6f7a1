"""The bundles `specgraph advise` compares: the ones given, or compiled from a model."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specgraph import methods
from specgraph.compiler import CompileConfig
from specgraph.errors import InputError
from specgraph.loaders import source_path

Compile = Callable[[str, str, Path, dict[str, Any]], None]  # (model, method, bundle, the method's options)


def default_methods() -> list[str]:
    """What `advise MODEL` compiles when --methods is not given: every method that says it is advised."""
    return [m.name for m in methods.REGISTRY.values() if m.advised is not None]


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


def _manifest(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def resolve(targets: list[str], wanted: list[str] | None, folder: Path, compile_one: Compile,
            shared: dict[str, Any] | None = None, skipped: Callable[[str, str], None] | None = None) -> list[Path]:  # fmt: skip
    """The bundles to compare. Each target is a bundle folder or a model. Bundles are used as
    they are (only the methods in `wanted`, and `none`, when it is given). A model gets a bundle
    per method (`none` and `wanted`, by default `default_methods()`) in `folder/METHOD`: one
    already there, compiled from the same model for that method with the same `shared` settings
    (max_context, weights, activations), is reused; otherwise `compile_one(model, method, path,
    options)` makes it, with the method's `advised` options. A default method that cannot be
    compiled for this model (Medusa without heads for it) is left out, and `skipped(method, why)`
    told; a method asked for by name fails with its own error."""
    bundles = [Path(t) for t in targets if _manifest(Path(t)) is not None]
    models = [t for t in targets if _manifest(Path(t)) is None]
    if len(models) > 1:
        raise InputError(f"give one model to compile (or bundles), not {len(models)}: {', '.join(models)}")
    if wanted is not None:
        keep = {"none", *wanted}
        bundles = [b for b in bundles if (_manifest(b) or {}).get("method") in keep]
    have = {(_manifest(b) or {}).get("method") for b in bundles}
    if not models:
        missing = [m for m in (wanted or []) if m not in have]
        if missing:
            raise InputError(f"no bundle for method {missing[0]}: give one, or a model to compile it from")
        return bundles
    out = list(bundles)
    for method in ["none", *(wanted if wanted is not None else default_methods())]:
        if method in have:
            continue
        spec = methods.get(method)
        if spec.needs:
            raise InputError(f"--method {method} needs {spec.needs}: compile its bundle yourself and give it")
        path = folder / method
        if not _reusable(_manifest(path), models[0], method, shared or {}):
            try:
                compile_one(models[0], method, path, {**(shared or {}), **(spec.advised or {})})
            except InputError as exc:
                if wanted is not None or method == "none":
                    raise
                if skipped is not None:
                    skipped(method, str(exc))
                continue
        out.append(path)
    return out


def _reusable(found: dict[str, Any] | None, model: str, method: str, shared: dict[str, Any]) -> bool:
    """Whether a bundle already in the folder is this model, method and settings."""
    if not found or found.get("method") != method:
        return False
    source, weights = found.get("source"), found.get("weights")
    if not isinstance(source, dict) or source.get("path") != source_path(model) or not isinstance(weights, dict):
        return False
    wanted = {f.name: f.default for f in dataclasses.fields(CompileConfig)} | shared
    have = {"max_context": found.get("max_context"), "weights": weights.get("weights"),
            "activations": weights.get("activations")}  # fmt: skip
    return all(have[k] == wanted[k] for k in have)
