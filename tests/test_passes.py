"""Each pass on real traced graphs (compared with eager) and on graphs it must refuse."""

from __future__ import annotations

import pytest
import torch

from specgraph.anatomy import analyze
from specgraph.capture import capture
from specgraph.loaders import LoadedModel
from specgraph.passes import PassContext, add_kv_cache_io, insert_tree_attention
from tests.models.tiny import build

S = 64  # cache slots for these tests


def _graph(family: str):
    model = build(family)
    loaded = LoadedModel("hf", family, model, None, None, [], 256, None, model.config.to_dict())
    gm = capture(loaded, S)
    return model, gm, analyze(gm, model.config.to_dict())


def _causal(b: int, t: int, s: int, start: int = 0) -> torch.Tensor:
    pos = start + torch.arange(t)
    return (torch.arange(s)[None, :] <= pos[:, None]).expand(b, 1, t, s)  # [B, 1, T, S]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_insert_tree_attention_makes_mask_and_positions_inputs(family):
    model, gm, anatomy = _graph(family)
    result = insert_tree_attention(gm, PassContext(anatomy, S))
    assert result.modified and result.counts["masked_sites"] == anatomy.num_layers
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert names == ["input_ids", "position_ids", "attn_mask"]
    assert "arange" not in gm.code  # positions no longer built inside the graph
    ids = torch.randint(0, 256, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        (got,) = gm(ids, pos, _causal(2, 9, 9))
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_tree_mask_lets_a_sibling_ignore_its_brother():
    """Tokens [a, b, c] where b and c are both children of a: c sits at b's depth and sees only a."""
    model, gm, anatomy = _graph("llama")
    insert_tree_attention(gm, PassContext(anatomy, S))
    a, b, c = 11, 22, 33
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)[None, None]  # [1, 1, 3, 3]
    with torch.no_grad():
        (got,) = gm(torch.tensor([[a, b, c]]), torch.tensor([[0, 1, 1]]), mask)
        want_c = model(torch.tensor([[a, c]])).logits[0, 1]
        want_b = model(torch.tensor([[a, b]])).logits[0, 1]
    torch.testing.assert_close(got[0, 2], want_c, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[0, 1], want_b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "gemma3"])
def test_kv_cache_io_decodes_like_a_full_forward(family):
    model, gm, anatomy = _graph(family)
    ctx = PassContext(anatomy, S)
    insert_tree_attention(gm, ctx)
    result = add_kv_cache_io(gm, ctx)
    assert result.counts["kv_inputs"] == 2 * anatomy.num_layers
    assert "scaled_dot_product_attention" not in gm.code and "kv_write" in gm.code
    kv = []
    for site in anatomy.sites:
        kv += [torch.zeros(1, site.num_kv_heads, site.head_dim, S), torch.zeros(1, site.num_kv_heads, S, site.head_dim)]
    seq = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        want = model(seq).logits[0]
        window = next((s.sliding_window for s in anatomy.sites if s.sliding_window), None)

        def masks(t: int, start: int) -> list[torch.Tensor]:
            full = _causal(1, t, S, start)
            if not window:
                return [full]
            recent = (start + torch.arange(t))[:, None] - torch.arange(S)[None, :] < window  # [T, S]
            return [full, full & recent]

        prefill, chunk = 16, 4
        logits, *kv = gm(
            seq[:, :prefill], torch.arange(prefill)[None], *masks(prefill, 0), torch.tensor([0]), torch.tensor([S]), *kv
        )
        torch.testing.assert_close(logits[0], want[:prefill], rtol=1e-4, atol=1e-5)
        for start in range(prefill, 24, chunk):
            pos = torch.arange(start, start + chunk)[None]
            logits, *kv = gm(
                seq[:, start : start + chunk],
                pos,
                *masks(chunk, start),
                torch.tensor([start]),
                torch.tensor([start + chunk]),
                *kv,
            )
            torch.testing.assert_close(logits[0], want[start : start + chunk], rtol=1e-4, atol=1e-5)


def test_grouped_query_attention_never_repeats_the_cache():
    _, gm, anatomy = _graph("qwen2")  # 4 query heads on 1 KV head
    ctx = PassContext(anatomy, S)
    insert_tree_attention(gm, ctx)
    add_kv_cache_io(gm, ctx)
    expands = [n for n in gm.graph.nodes if n.target == torch.ops.aten.expand.default]
    kv_inputs = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("past_")}
    for node in expands:
        assert not (set(node.all_input_nodes) & kv_inputs)


@pytest.mark.parametrize(("family", "norms"), [("llama", 5), ("qwen2", 5), ("gemma3", 0), ("gpt2", 0)])
def test_fuse_rms_norm_matches_eager(family, norms):
    """Llama-style norms fuse (2 per block + final); Gemma's (1 + w) form and LayerNorm are left alone."""
    from specgraph.passes import fuse_rms_norm

    model, gm, anatomy = _graph(family)
    result = fuse_rms_norm(gm, PassContext(anatomy, S))
    assert result.counts["fused_norms"] == norms and result.modified == (norms > 0)
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        (got,) = gm(ids)
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
