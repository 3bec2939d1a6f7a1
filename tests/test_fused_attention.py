"""The fused cached attention (`exporters/gqa.py`): which engines get it, and that both of its
branches (ONNX Runtime's `GroupQueryAttention`, and the generic nodes for a batched verify)
compute what the unfused engine computes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from specgraph.kernels import library_path
from specgraph.runtime import Engine
from tests.models.tiny import build


def _ops(bundle) -> dict[str, int]:  # type: ignore[no-untyped-def]
    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                for inner in attr.g.node:
                    counts[inner.op_type] = counts.get(inner.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["none", "lookup"])
def test_every_layer_of_a_chain_engine_is_fused(family, method, tiny_bundle):
    layers = build(family).config.num_hidden_layers
    ops = _ops(tiny_bundle(family, method))
    if library_path() is not None:  # native kernels: each layer one CachedAttention, whatever the call
        assert ops.get("CachedAttention") == layers and "GroupQueryAttention" not in ops
    else:
        assert ops.get("GroupQueryAttention") == layers
        assert ops.get("If", 0) >= layers  # one a layer: the fused node, or the generic one for a batched verify


@pytest.mark.parametrize("family", ["gemma3", "gpt2"])
def test_sliding_windows_and_models_without_rotary_keep_the_generic_attention(family, tiny_bundle):
    ops = _ops(tiny_bundle(family, "none"))
    assert "GroupQueryAttention" not in ops and "CachedAttention" not in ops


def _logits(engine: Engine, rows: list[list[int]], cache_len: list[int], state) -> np.ndarray:  # type: ignore[no-untyped-def]
    feeds = {
        "tokens": np.asarray(rows, np.int64),
        "n_fixed": np.full(len(rows), len(rows[0]), np.int64),
        "cache_len": np.asarray(cache_len, np.int64),
    }
    return engine.call(engine.session.io_binding(), feeds, state)["logits"].numpy()


@pytest.mark.parametrize("kernels", ["ort", "auto"])
def test_a_batched_verify_equals_each_row_verified_alone(kernels, tiny_folder, tmp_path):
    """On ONNX Runtime's kernels two rows of three tokens over caches of different lengths take
    the generic branch (its kernel refuses them), each row alone the fused one; on native kernels
    (auto, where the library is built) every call runs `CachedAttention`. Same logits."""
    from specgraph.compiler import CompileConfig, compile_model

    compile_model(CompileConfig.of(tiny_folder("llama"), tmp_path / "b", max_context=160, emit_logits=True,
                                   kernels=kernels))  # fmt: skip
    engine = Engine(tmp_path / "b")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43]]
    drafts = [[12, 13, 14], [44, 45, 46]]
    alone = []
    for prompt, draft in zip(prompts, drafts, strict=True):
        state = engine.new_state(1)
        _logits(engine, [prompt], [0], state)  # prefill, batch 1: fused
        alone.append(_logits(engine, [draft], [len(prompt)], state)[0])  # verify, batch 1: fused
    state = engine.new_state(2)
    width = max(map(len, prompts))
    padded = [p + [0] * (width - len(p)) for p in prompts]
    _logits(engine, padded, [0, 0], state)  # batched prefill over empty caches: fused
    batched = _logits(engine, drafts, [len(p) for p in prompts], state)  # generic branch
    for got, want in zip(batched, alone, strict=True):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_a_draft_model_s_runs_are_fused_too_and_stay_exact(tiny_folder, tiny_bundle, tmp_path):
    """The draft model's cache is written by each of its K runs in turn (the catch-up, then one
    token a run): every run is fused, and the output is still the target's own."""
    from specgraph.compiler import CompileConfig, compile_model

    out = tmp_path / "draft"
    report = compile_model(CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=160, draft="self:int8",
                                            num_draft=3))  # fmt: skip
    layers = build("llama").config.num_hidden_layers
    assert report.pass_counts["fuse_cached_attention"] == {
        "fused_layers": layers, "generic_layers": 0, "fused_draft_runs": 3 * layers}  # fmt: skip
    assert _ops(out).get("CachedAttention" if library_path() is not None else "GroupQueryAttention") == 4 * layers
    engine, plain = Engine(out), Engine(tiny_bundle("llama", "none"))
    for prompt in ([5, 6, 7, 8, 5, 6, 7, 9, 5, 6], list(range(30, 70))):
        want = plain.generate(prompt, max_new_tokens=40, stop_at_eos=False).output_ids
        assert engine.generate(prompt, max_new_tokens=40, stop_at_eos=False).output_ids == want
    rows = [[5, 6, 7, 8, 5, 6, 7, 9], [17, 3, 99]]  # a batch: its verify and catch-up take the generic branch
    for row, got in zip(rows, engine.generate_batch(rows, max_new_tokens=24, stop_at_eos=False), strict=True):
        assert got.output_ids == plain.generate(row, max_new_tokens=24, stop_at_eos=False).output_ids
