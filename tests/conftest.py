"""Shared fixtures: tiny models as HF folders and compiled bundles, cached per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.models.tiny import save  # noqa: E402


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory):
    """family -> HF folder of a seeded tiny random model (built once per session)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = save(family, tmp_path_factory.mktemp(f"hf_{family}"))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_folder):
    """(family, method) -> compiled bundle of the tiny model (with logits output)."""
    from specgraph.compiler import CompileConfig, compile_model

    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, method: str) -> Path:
        key = (family, method)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"bundle_{family}_{method}") / "bundle"
            own = {"num_draft": 5} if method == "lookup" else {}  # the method's own options
            cfg = CompileConfig.of(tiny_folder(family), out, method, max_context=160, emit_logits=True, **own)
            compile_model(cfg)
            cache[key] = out
        return cache[key]

    return get
