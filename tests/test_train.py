"""Medusa training end to end on the tiny random Llama (no tokenizer, so prompts are token ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specgraph.errors import InputError
from specgraph.medusa import load_heads
from specgraph.train import train_medusa

HEADS = 3
HIDDEN = 64  # tests/models/tiny.py
VOCAB = 256


def _prompt_file(folder: Path, n: int = 5) -> Path:
    gen = torch.Generator().manual_seed(1)
    path = folder / "prompts.jsonl"
    lines = [{"prompt_ids": torch.randint(2, VOCAB - 1, (6 + i,), generator=gen).tolist()} for i in range(n)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def trained(tiny_folder, tiny_bundle, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("train")
    kwargs = dict(
        model=str(tiny_folder("llama")),
        prompts=str(_prompt_file(folder)),
        output=folder / "heads.safetensors",
        num_heads=HEADS,
        epochs=2,
        max_new_tokens=24,
        lr=1e-2,
        holdout=0.2,
        threads=1,
        progress=False,
        engine_bundle=str(tiny_bundle("llama", "none")),
        batch_size=32,
    )
    return train_medusa(**kwargs), kwargs


def test_heads_file_loads_with_its_meta(trained) -> None:
    result, kwargs = trained
    heads, meta = load_heads(kwargs["output"], HIDDEN, VOCAB)
    assert heads.num_heads == HEADS
    assert meta["num_heads"] == HEADS and meta["vocab_size"] == VOCAB and meta["hidden_size"] == HIDDEN
    assert meta["train_tokens"] > 0 and meta["heldout_tokens"] > 0
    assert "train_medusa(" in meta["command"]
    assert {k: result[k] for k in meta} == meta


def test_acceptance_table_shape(trained) -> None:
    _, kwargs = trained
    _, meta = load_heads(kwargs["output"], HIDDEN, VOCAB)
    table = meta["acceptance"]
    assert len(table) == HEADS and all(len(row) == 10 for row in table)
    assert all(0 <= a <= 1 for row in table for a in row)
    assert all(sum(row) <= 1 + 1e-6 for row in table)
    assert meta["top1"] == [row[0] for row in table]


def test_loss_decreases_and_heads_moved(trained) -> None:
    result, kwargs = trained
    assert result["epoch_loss"][-1] < result["epoch_loss"][0]
    heads, _ = load_heads(kwargs["output"], HIDDEN, VOCAB)
    x = torch.randn(8, HIDDEN)
    zero_init = x[:, None, :].expand(8, HEADS, HIDDEN)  # zero weights: every head returns its input
    assert not torch.allclose(heads(x), zero_init)


def test_generated_text_matches_hf_and_is_cached(trained) -> None:
    result, kwargs = trained
    assert result["target_agreement"] > 0.95  # HF argmax reproduces the engine's greedy tokens
    assert not result["generation_cached"]
    assert Path(kwargs["output"]).with_name("heads.gen.json").is_file()
    again = train_medusa(**{**kwargs, "epochs": 1, "output": kwargs["output"].with_name("heads.again.safetensors")})
    assert again["generation_cached"]


def test_compiles_its_own_engine(tiny_folder, tmp_path: Path) -> None:
    result = train_medusa(
        model=str(tiny_folder("llama")),
        prompts=str(_prompt_file(tmp_path, n=2)),
        output=tmp_path / "h.safetensors",
        num_heads=1,
        epochs=1,
        max_new_tokens=4,
        threads=1,
        progress=False,
    )
    assert result["heldout_sequences"] == 1


def test_text_prompts_need_a_tokenizer(tiny_folder, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    with pytest.raises(InputError, match="prompt_ids"):
        train_medusa(
            model=str(tiny_folder("llama")), prompts=str(prompts), output=tmp_path / "h.safetensors", progress=False
        )


def test_bad_arguments_are_input_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="holdout"):
        train_medusa(model="unused", prompts="unused", output=tmp_path / "h.safetensors", holdout=1.0)
