"""`lookup`'s adaptive round as one native operator (`specgraph.LookupRound`, host/src/kernels/lookup.h):
it makes the drafts, the draft counts and the state that the graph of methods/lookup.py makes,
call for call, and refuses a row that does not fit its history."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from specgraph.compiler import CompileConfig, compile_model
from specgraph.exporters.nbits import NATIVE_DOMAIN
from specgraph.kernels import library_path
from specgraph.methods.lookup import ADAPT_DECAY, FIRST_RATE, PRIOR_WEIGHT, lookup_round
from specgraph.runtime import Engine
from tests.bundles import with_initializer
from tests.greedy import assert_same_greedy, hf_greedy
from tests.models.tiny import build

pytestmark = pytest.mark.skipif(
    library_path() is None, reason="specgraph's kernel library is not built (sh scripts/install.sh needs cmake)"
)

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [17, 3, 99, 42, 200, 13, 77], [9, 8, 7, 9, 8, 7, 9] * 3, list(range(30, 60))]
NEW_TOKENS = 48
# c(1 + k) / c(1): a dear verify (drafts sent only after matches that have paid) and a cheap one
CURVES = ([1.0, 1.5, 1.9, 2.2, 2.6, 3.0], [1.0, 1.05, 1.1, 1.2, 1.3, 1.4])


def _ops(bundle) -> list[str]:  # type: ignore[no-untyped-def]
    return [n.op_type for n in onnx.load(str(bundle / "model.onnx"), load_external_data=False).graph.node]


def test_native_round_equals_the_graph_call_for_call(tiny_folder, tmp_path):
    """A lookup engine on native kernels runs the round as one node; with the same cost curve it
    verifies the same tokens every call as the graph that ONNX Runtime alone runs (`--kernels ort`),
    one row at a time and batched, and both give HF's greedy text."""
    model = build("llama")
    built = {}
    for kernels in ("native", "ort"):
        compile_model(CompileConfig.of(tiny_folder("llama"), tmp_path / kernels, "lookup", max_context=160, num_draft=5,
                                       kernels=kernels))  # fmt: skip
        built[kernels] = _ops(tmp_path / kernels)
    assert built["native"].count("LookupRound") == 1 and "LookupRound" not in built["ort"]
    sections = {k: Engine(tmp_path / k, verify=False).manifest["lookup"] for k in built}
    assert sections["native"]["native_round"] is True and "native_round" not in sections["ort"]
    assert len(built["ort"]) - len(built["native"]) > 100  # the nodes the operator replaces
    for i, curve in enumerate(CURVES):
        engines = {k: Engine(with_initializer(tmp_path / k, tmp_path / f"{k}{i}", "lookup_cost",
                                              np.asarray(curve, np.float32)), threads=1) for k in built}  # fmt: skip
        for prompt in PROMPTS:
            ran = {k: e.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False) for k, e in engines.items()}
            assert ran["native"].accepted_per_step == ran["ort"].accepted_per_step
            assert_same_greedy(model, prompt, ran["native"].output_ids, hf_greedy(model, prompt, NEW_TOKENS))
        batches = [e.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS, stop_at_eos=False) for e in engines.values()]
        for native, graph in zip(*batches, strict=True):
            assert (native.output_ids, native.accepted_per_step) == (graph.output_ids, graph.accepted_per_step)
    assert any(n > 1 for n in ran["native"].accepted_per_step)  # the cheap curve sends drafts that are taken


def _round_session() -> ort.InferenceSession:
    names = ["history", "tokens", "cache_len", "bonus", "cache_len_out", "stats", "last", "cost"]
    outs = ["next_tokens", "history_out", "stats_out", "last_out", "n_draft"]
    node = helper.make_node("LookupRound", names, outs, domain=NATIVE_DOMAIN, num_draft=4, max_ngram=3,
                            decay=ADAPT_DECAY, prior_weight=PRIOR_WEIGHT, first_rate=FIRST_RATE)  # fmt: skip
    kinds = {"stats": TensorProto.FLOAT, "cost": TensorProto.FLOAT, "stats_out": TensorProto.FLOAT}
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, kinds.get(n, TensorProto.INT64), None)
                                            for n in names],
                              [helper.make_tensor_value_info(n, kinds.get(n, TensorProto.INT64), None) for n in outs])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(NATIVE_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_round_node_equals_the_eager_round_and_refuses_what_does_not_fit():
    """Hand-made rounds (histories over 4 token ids, so n-grams recur; state of every kind; rows
    that accepted 0..T-1 drafts): the node's outputs, written to fresh buffers (not in place),
    equal the eager round's: every integer exactly, the decayed counts to float rounding."""
    session = _round_session()
    rng = np.random.default_rng(0)
    batch, length, width = 6, 40, 5
    for _ in range(50):
        cache_len = rng.integers(0, 30, batch)
        committed = rng.integers(1, width + 1, batch)
        feeds = {
            "history": rng.integers(0, 4, (batch, length)), "tokens": rng.integers(0, 4, (batch, width)),
            "cache_len": cache_len, "bonus": rng.integers(0, 4, (batch, 1)), "cache_len_out": cache_len + committed,
            "stats": (rng.random((batch, 3, 2)) * rng.integers(0, 6, (batch, 1, 1))).astype(np.float32),
            "last": np.stack([rng.integers(0, 3, batch) * rng.integers(0, 2, batch), rng.integers(0, 6, batch),
                              rng.integers(0, 4, batch)], axis=1),
            "cost": np.asarray([1.0, 1.1, 1.3, 1.6, 2.0], np.float32),
        }  # fmt: skip
        got = session.run(None, feeds)
        want = lookup_round(*(torch.from_numpy(np.asarray(v)) for v in feeds.values()), 4, 3)
        for name, g, w in zip(("next_tokens", "history", "stats", "last", "n_draft"), got, want, strict=True):
            if name == "stats":
                np.testing.assert_allclose(g, w.numpy(), rtol=1e-6, err_msg=name)
            else:
                np.testing.assert_array_equal(g, w.numpy(), err_msg=name)
    feeds["cache_len_out"] = np.full(batch, length)  # the bonus would land past the history's end
    with pytest.raises(Exception, match="LookupRound: a row's tokens do not fit its history"):
        session.run(None, feeds)
