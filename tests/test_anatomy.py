"""The anatomy pass on each supported family, and precise errors on graphs it cannot use."""

from __future__ import annotations

import pytest
import torch

from specgraph.anatomy import analyze
from specgraph.capture import capture, to_plain_graph_module
from specgraph.errors import AnatomyError
from specgraph.loaders import LoadedModel
from tests.models.tiny import build


def _analyze(family: str):
    model = build(family)
    loaded = LoadedModel("hf", family, model, None, None, [], 256, None, model.config.to_dict())
    return analyze(capture(loaded, 64), model.config.to_dict()).summary()


@pytest.mark.parametrize(
    ("family", "blocks", "heads", "kv_heads", "positions", "norm"),
    [
        ("llama", 2, 4, 2, "rotary", "LlamaRMSNorm"),
        ("qwen2", 2, 4, 1, "rotary", "Qwen2RMSNorm"),
        ("gpt2", 2, 4, 4, "learned", "LayerNorm"),
        ("gemma3", 3, 4, 2, "rotary", "Gemma3RMSNorm"),
    ],
)
def test_families(family, blocks, heads, kv_heads, positions, norm):
    s = _analyze(family)
    assert s["decoder_blocks"] == blocks
    assert (s["attention"]["num_heads"], s["attention"]["num_kv_heads"]) == (heads, kv_heads)
    assert s["positions"]["kind"] == positions
    assert s["final_norm"].endswith(f"({norm})")
    assert s["vocab_size"] == 256


def test_gemma3_sliding_layers_found():
    s = _analyze("gemma3")
    assert s["attention"]["sliding_window_layers"] == [0, 1]
    assert s["attention"]["sliding_window"] == 16


def test_tied_head_noted():
    assert "lm_head is tied to the token embedding" in _analyze("qwen2")["notes"]


class _NoAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(input_ids)))


class _NoNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # [B, T, 8]
        q = x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)  # [B, 2, T, 4]
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        pos = torch.arange(input_ids.shape[1])[None, :]
        x = x + a.transpose(1, 2).reshape(x.shape) + torch.cos(pos.float())[..., None]
        return self.head(x)


def _export(module: torch.nn.Module) -> torch.fx.GraphModule:
    t = torch.export.Dim("t", min=2, max=32)
    ep = torch.export.export(module, (torch.zeros(2, 4, dtype=torch.long),), dynamic_shapes={"input_ids": {1: t}})
    return to_plain_graph_module(ep)


def test_graph_without_attention_is_refused_with_the_reason():
    with pytest.raises(AnatomyError, match="no attention site found"):
        analyze(_export(_NoAttention()))


def test_graph_without_final_norm_is_refused_with_the_reason():
    with pytest.raises(AnatomyError, match="no final norm found before lm_head"):
        analyze(_export(_NoNorm()))
