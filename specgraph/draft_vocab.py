"""Reduced draft vocabularies (FR-Spec): a learned drafter scores only the V_d tokens the target
emits most often, so its readout reads V_d rows of the LM head instead of all of them.

Drafts outside the set are never proposed; the target's full LM head still verifies every token,
so the output is unchanged (lossless) and only acceptance can drop, by at most the share of
target tokens outside the set (1 - coverage).

A ranking is every token id ordered by its count on a corpus, most frequent first. Rankings for
the shipped models live in `specgraph/data/vocab/<model fingerprint>.json`, made by
`scripts/draft_vocab.py` (the command and the corpus are recorded in the file).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specgraph.errors import InputError, ModelLoadError

FORMAT = "specgraph-draft-vocab-1"
_DIR = Path(__file__).resolve().parent / "data" / "vocab"


def rank_tokens(counts: np.ndarray) -> np.ndarray:
    """Token ids by count, most frequent first; ties (e.g. unseen tokens) by id, so it is stable."""
    return np.lexsort((np.arange(len(counts)), -counts.astype(np.int64))).astype(np.int64)


def coverage(ranked: np.ndarray, size: int, tokens: Iterable[int]) -> float:
    """The share of `tokens` that the top `size` ids of `ranked` contain."""
    ids = np.fromiter(tokens, dtype=np.int64)
    if ids.size == 0:
        return 1.0
    return float(np.isin(ids, ranked[:size]).mean())


def save_ranking(path: Path, ranked: np.ndarray, meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, **meta, "ranked": [int(i) for i in ranked]}) + "\n")


def load_ranking(path: Path, vocab_size: int) -> tuple[np.ndarray, dict[str, Any]]:
    """A ranking file's ids (checked: a permutation of range(vocab_size)) and its other fields."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a draft-vocabulary file: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ModelLoadError(f"{path} is not a specgraph draft-vocabulary file ({FORMAT})")
    ranked = np.asarray(data.pop("ranked"), dtype=np.int64)
    if ranked.shape != (vocab_size,) or not np.array_equal(np.sort(ranked), np.arange(vocab_size)):
        raise InputError(f"{path.name} ranks a vocabulary of {ranked.size} tokens, this model has {vocab_size}")
    return ranked, data


def shipped_ranking(fingerprint: str | None, vocab_size: int) -> tuple[np.ndarray, dict[str, Any]] | None:
    """The packaged ranking for the model with this fingerprint, if there is one."""
    path = _DIR / f"{fingerprint}.json"
    if fingerprint is None or not path.is_file():
        return None
    return load_ranking(path, vocab_size)


def check_size(size: int, vocab_size: int) -> int:
    """`--draft-vocab` as the number of ids kept: 0 means the whole vocabulary."""
    if size < 0 or size > vocab_size:
        raise InputError(f"--draft-vocab must be 0 (the whole vocabulary) or 1..{vocab_size}, got {size}")
    return vocab_size if size == 0 else size


def check_option(size: int | None) -> None:
    """A method's `draft_vocab` option before the model is known: None, 0 or a positive size."""
    if size is not None and (int(size) != size or size < 0):
        raise InputError(f"--draft-vocab must be 0 (the whole vocabulary) or a positive size, got {size}")


MEDUSA_DEFAULT = 8192  # Medusa's heads where the model has a ranking (docs/benchmarks.md); draft: all tokens
DEFAULTS = (
    f"Default: medusa, eagle, early-exit {MEDUSA_DEFAULT} where a token ranking ships for the model (smollm2-135m), "
    "else 0; draft 0"
)


def add_flags(group: Any) -> None:
    """`--draft-vocab` and `--draft-vocab-file`, shared by the methods with a learned readout."""
    group.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="medusa, draft, eagle, early-exit: the drafter scores only the N most frequent tokens (a reduced "
        "draft vocabulary: a cheaper readout; drafts outside it are never proposed and the output is unchanged). "
        f"0 = the whole vocabulary. {DEFAULTS}",
    )
    group.add_argument(
        "--draft-vocab-file",
        default=None,
        help="medusa, draft, eagle, early-exit: the token ranking to take --draft-vocab tokens from (made by "
        "scripts/draft_vocab.py); default: the one shipped for the model",
    )


def choose(size: int | None, file: str | None, default: int, fingerprint: str | None, vocab: int,
           model: str) -> tuple[torch.Tensor, dict[str, Any]] | None:  # fmt: skip
    """The ids a drafter scores (sorted, so ties break by token id as over the whole vocabulary)
    and what the manifest says of them, or None for the whole vocabulary. `size` None means
    `default` where a ranking exists, else the whole vocabulary."""
    found = load_ranking(Path(file), vocab) if file is not None else shipped_ranking(fingerprint, vocab)
    if size is None:
        size = min(default, vocab) if found and default else vocab
    size = check_size(size, vocab)
    if size == vocab:
        return None
    if found is None:
        raise InputError(f"--draft-vocab {size} needs a token ranking for {model} and none ships for it: "
                         "make one with scripts/draft_vocab.py and pass --draft-vocab-file")  # fmt: skip
    ranked, meta = found
    ids = torch.from_numpy(np.sort(ranked[:size]))
    measured = {name: table[str(size)] for name, table in meta.get("coverage", {}).items()
                if isinstance(table, dict) and str(size) in table}  # fmt: skip
    source = Path(file).name if file is not None else "shipped"
    return ids, {"size": size, "of": vocab, "ranking": source, "coverage": measured}
