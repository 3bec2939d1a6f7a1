"""Speculative methods: one module per method behind one small interface, found by name here.

A method says what it is (`name`, `summary`, `lossless`, `speculative`), which flags it adds to
`specgraph compile` (`add_flags`, whose destinations are the fields of its `Options`), which
graph passes it needs between the shared ones (`passes`), how it builds its step engine
(`build`), and what it writes into the bundle (`finish`: its files, its manifest section, and
the engine's constant inputs). The compiler, the runtime, bench and the CLI read this registry
and the manifest; they never test a method's name.

Every engine is verified by the shared code: chains by `specgraph.step.accept_chain`, trees by
`specgraph.step_tree` (the greedy tree rule and `walk_tree`).
"""

from __future__ import annotations

from specgraph.errors import InputError
from specgraph.methods.base import Built, Finished, Method, Options
from specgraph.methods.draft import DRAFT
from specgraph.methods.eagle import EAGLE
from specgraph.methods.early_exit import EARLY_EXIT
from specgraph.methods.lookup import LOOKUP
from specgraph.methods.medusa import MEDUSA
from specgraph.methods.none import NONE

REGISTRY: dict[str, Method] = {m.name: m for m in (NONE, LOOKUP, MEDUSA, DRAFT, EAGLE, EARLY_EXIT)}


def names() -> list[str]:
    """Every method's name, in the order `--help` lists them."""
    return list(REGISTRY)


def get(name: str) -> Method:
    """The method called `name`, or InputError listing the ones there are."""
    method = REGISTRY.get(name)
    if method is None:
        raise InputError(f"unknown method {name!r}; choose one of: {', '.join(REGISTRY)}")
    return method


__all__ = ["REGISTRY", "Built", "Finished", "Method", "Options", "get", "names"]
