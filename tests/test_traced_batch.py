"""Programs traced the usual torch.export way (batch 1, only the sequence dynamic) compile to an
engine with a dynamic batch, or are refused in one line that says how to re-export (issue 10)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specgraph.capture import capture
from specgraph.errors import AnatomyError
from specgraph.loaders import load_model
from specgraph.runtime import Engine
from tests.greedy import assert_same_greedy, hf_greedy
from tests.models.tiny import build
from tests.test_cli import _one_line_error, _run

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [17, 3, 99, 42, 200, 13, 77]]
NEW_TOKENS = 48
REEXPORT = "re-export with a dynamic batch dimension: dynamic_shapes=({0: Dim('batch'), 1: Dim('seq')},)"


class _Logits(torch.nn.Module):
    """What a user writes to export a causal LM: forward(input_ids) -> logits, HF defaults kept."""

    def __init__(self, model: torch.nn.Module, **kwargs: object) -> None:
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, **self.kwargs).logits


def _export_batch1(module: torch.nn.Module, path: Path, dims: dict | None = None) -> Path:
    """torch.export at an example of batch 1 with only the sequence dynamic, saved to `path`."""
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(0))  # [1, T]
    with torch.no_grad():
        program = torch.export.export(
            module.eval(), (ids,), dynamic_shapes=({1: torch.export.Dim("seq")} if dims is None else dims,)
        )
    torch.export.save(program, str(path))
    return path


@pytest.fixture(scope="module")
def gqa_model() -> torch.nn.Module:
    return build("llama-gqa3", seed=1)


@pytest.mark.parametrize("kwargs", [{}, {"use_cache": False}], ids=["hf-defaults", "no-cache"])
def test_traced_batch1_graph_runs_at_any_batch(gqa_model, kwargs, tmp_path):
    """The captured graph of a batch-1 program gives HF's logits for a batch of three rows."""
    gm = capture(load_model(_export_batch1(_Logits(gqa_model, **kwargs), tmp_path / "m.pt2")), 64)
    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.no_grad():
        got, want = gm(ids)[0], gqa_model(ids).logits  # [B, T, V]
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("method", ["none", "lookup"])
def test_traced_batch1_gqa_llama_matches_hf_greedy(gqa_model, method, tmp_path):
    from specgraph.compiler import CompileConfig, compile_model

    path = _export_batch1(_Logits(gqa_model), tmp_path / "model.pt2")
    compile_model(CompileConfig(model=str(path), output=tmp_path / method, method=method, max_context=128))
    engine = Engine(tmp_path / method)
    singles = []
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert_same_greedy(gqa_model, prompt, result.output_ids, hf_greedy(gqa_model, prompt, NEW_TOKENS))
        singles.append(result.output_ids)
    rows = engine.generate_batch([PROMPTS[0], PROMPTS[0][::-1]], max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    assert rows[0].output_ids == singles[0]  # the engine's batch is not the traced batch 1
    reverse = engine.generate(PROMPTS[0][::-1], max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    assert rows[1].output_ids == reverse.output_ids


class _FoldsBatch(torch.nn.Module):
    """Flattens [B, T, H] to rows and back with the traced batch written in: not batch-general."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed(input_ids).reshape(-1, 8)  # [B*T, H]
        return self.head(self.norm(rows.reshape(1, input_ids.shape[1], 8)))  # [1, T, V]


class _MixesRows(_FoldsBatch):
    """Runs at any batch but mixes the rows (a mean over the batch): wrong for batch > 1."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)  # [B, T, H]
        return self.head(self.norm(h - h.mean(0, keepdim=True) + h[:1]))  # [B, T, V]


@pytest.mark.parametrize("module", [_FoldsBatch, _MixesRows])
def test_batch_specific_program_is_refused_with_what_to_change(module, tmp_path):
    path = _export_batch1(module(), tmp_path / "model.pt2")
    with pytest.raises(AnatomyError, match="traced at batch 1 and does not run at batch 2") as info:
        capture(load_model(path), 64)
    assert str(info.value).endswith(REEXPORT) and "\n" not in str(info.value)


def test_refusal_is_one_plain_line_on_the_command_line(tmp_path):
    path = _export_batch1(_FoldsBatch(), tmp_path / "model.pt2")
    line = _one_line_error(_run("compile", str(path), "-o", str(tmp_path / "out"), ok=False), REEXPORT)
    assert "\x1b" not in line


def test_static_sequence_is_refused(tmp_path):
    path = _export_batch1(_FoldsBatch(), tmp_path / "model.pt2", dims={})
    with pytest.raises(AnatomyError, match=r"static sequence length \(12\): re-export"):
        capture(load_model(path), 64)
