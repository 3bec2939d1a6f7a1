"""SmolLM2-135M-Instruct, the embedded default: engines against Hugging Face greedy generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specgraph.runtime import Engine
from specgraph.sampling import uniform_stream
from tests.greedy import assert_same_greedy, assert_same_sampled, hf_greedy
from tests.stored import float_copies

pytestmark = pytest.mark.slow
NEW_TOKENS = 64
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence, then repeat the answer.",
    "List three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def default(smollm2_bundle):
    from specgraph.loaders import load_model

    loaded = load_model("smollm2-135m")
    bundles = {method: Engine(smollm2_bundle(method), threads=2) for method in ("none", "lookup", "medusa", "eagle")}
    return loaded, bundles


def _chat_ids(engine: Engine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_greedy_equals_hf_generate(default):
    loaded, bundles = default
    for text in PROMPTS:
        prompt = _chat_ids(bundles["none"], text)
        want = hf_greedy(loaded.hf_model, prompt, NEW_TOKENS)
        for _method, engine in bundles.items():
            got = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).output_ids
            assert_same_greedy(loaded.hf_model, prompt, got, want)


def test_logits_match_eager(default):
    loaded, bundles = default
    engine = bundles["none"]
    prompt = _chat_ids(engine, PROMPTS[0])
    feeds = {
        "tokens": np.asarray([prompt], np.int64),
        "n_fixed": np.asarray([len(prompt)], np.int64),
        "cache_len": np.zeros(1, np.int64),
    }
    got = engine.call(engine.session.io_binding(), feeds, engine.new_state(1))["logits"].numpy()[0]
    with torch.no_grad():
        want = loaded.hf_model(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_bundle_runs_the_gguf_blocks_as_stored(default):
    """--weights source (the default): the Q4_1 matrices and the tied Q8_0 table run as stored,
    once each, and no float32 copy of them is in the bundle (the fp32 engine's file is 538 MB)."""
    _, bundles = default
    bundle = bundles["none"].bundle
    weights = bundles["none"].manifest["weights"]
    assert weights["formats"] == {"Q4_1": 120, "Q8_0": 1} and weights["gathers"] == 1 and weights["exact"]
    data = (bundle / "model.onnx.data").stat().st_size
    if weights.get("kernels") == "native":  # 4-bit digits (Q8_0: two), GGUF's float16 scales and offsets
        assert 100e6 < data < 112e6
    else:  # MatMulNBits: float32 scales and c'
        assert 110e6 < data < 125e6
    assert bundles["none"].manifest["eos_token_ids"] == [2]
    # nor in any method's: EAGLE's drafter embeds its drafts through the same blocks
    assert {method: float_copies(engine.bundle) for method, engine in bundles.items()} == dict.fromkeys(bundles, [])


def test_sampled_text_is_the_same_for_every_method(default):
    """Lossless sampling on the real model: with the same seed every point-mass speculative
    engine (lookup, Medusa; not `draft` or `eagle`, whose drafts are sampled) emits exactly the tokens
    plain sampling (`none`) emits, at each setting (a draw within float
    rounding of a CDF boundary may flip, like an argmax tie; it is reported, not failed)."""
    loaded, bundles = default
    differs_from_greedy = 0
    for i, text in enumerate(PROMPTS):
        prompt = _chat_ids(bundles["none"], text)
        greedy = bundles["none"].generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).output_ids
        for setting in [(0.7, 0, 1.0), (1.0, 50, 0.9)]:
            temperature, top_k, top_p = setting
            runs = {
                method: engine.generate(prompt, NEW_TOKENS, False, temperature=temperature, top_k=top_k, top_p=top_p,
                                        seed=100 + i).output_ids
                for method, engine in bundles.items()
                if method != "eagle"
            }  # fmt: skip
            uniforms = uniform_stream(100 + i, 1, bundles["none"].max_context + 1)[0]
            for method in ("lookup", "medusa"):
                assert_same_sampled(loaded.hf_model, prompt, runs[method], runs["none"], setting, uniforms)
            differs_from_greedy += runs["none"] != greedy
    assert differs_from_greedy >= 3  # the draws really sample


def test_shipped_heads_are_found_by_content_from_any_path():
    """The GGUF file itself (not the alias) finds the shipped Medusa heads: they are keyed by the
    model's fingerprint, not its name."""
    from specgraph.default_model import gguf_path
    from specgraph.loaders import load_model, model_fingerprint
    from specgraph.methods.medusa import SHIPPED_HEADS

    alias, gguf = load_model("smollm2-135m"), load_model(str(gguf_path()))
    assert alias.name != gguf.name
    assert model_fingerprint(alias) == model_fingerprint(gguf)
    assert model_fingerprint(gguf) in SHIPPED_HEADS
    from specgraph.methods.eagle import SHIPPED

    assert model_fingerprint(gguf) in SHIPPED
