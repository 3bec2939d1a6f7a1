"""`--method draft`: a draft model (another one, or the target's own int4/int8 copy) proposes K
tokens inside the engine call; the output must be exactly the target's."""

from __future__ import annotations

import pytest

from specgraph.compiler import CompileConfig, compile_model
from specgraph.errors import InputError
from specgraph.runtime import Engine
from specgraph.sampling import uniform_stream
from tests.greedy import assert_same_greedy, assert_same_sampled, hf_greedy
from tests.models.tiny import build, save

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 9, 5, 6],
    [17, 3, 99, 42, 200, 13, 77],
    list(range(30, 70)),
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, tiny_folder):
    """(draft, weights) -> a compiled draft bundle of the tiny Llama (and its none engine)."""
    cache = {}

    def get(draft: str, weights: str = "fp32", num_draft: int = 3):
        key = (draft, weights, num_draft)
        if key not in cache:
            out = tmp_path_factory.mktemp("draft") / "bundle"
            cfg = CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=160, weights=weights,
                                   draft=draft, num_draft=num_draft)  # fmt: skip
            compile_model(cfg)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """Another tiny Llama: the same vocabulary, other weights (a draft that often disagrees)."""
    return save("llama", tmp_path_factory.mktemp("other_llama"), seed=7)


@pytest.mark.parametrize("draft", ["self:int8", "self:int4"])
def test_self_draft_equals_hf_greedy(draft, bundles):
    model = build("llama")
    engine = Engine(bundles(draft))
    assert engine.manifest["draft"]["weights"]["weights"] == draft.split(":")[1]
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))
        assert result.mean_accepted > 1.5  # the quantised copy agrees with the target most of the time


def test_other_model_as_draft_equals_hf_greedy(bundles, other_llama):
    model = build("llama")
    engine = Engine(bundles(str(other_llama)))
    assert engine.manifest["draft"]["weights"] == "float32"
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))


def test_seeded_sampling_equals_the_none_engine(bundles, tiny_bundle):
    """The drafts are the draft's argmax (point masses), so the shared rule draws every emitted
    token with its position's uniform: the same seed gives the none engine's tokens."""
    model = build("llama")
    draft, plain = Engine(bundles("self:int8")), Engine(tiny_bundle("llama", "none"))
    for prompt in PROMPTS[:2]:
        for seed in (0, 11):
            kwargs = dict(max_new_tokens=NEW_TOKENS, stop_at_eos=False, temperature=0.8, top_p=0.9, seed=seed)
            got, want = draft.generate(prompt, **kwargs), plain.generate(prompt, **kwargs)
            uniforms = uniform_stream(seed, 1, draft.max_context + 1)[0]
            assert_same_sampled(model, prompt, got.output_ids, want.output_ids, (0.8, 0, 0.9), uniforms)


def test_batch_rows_accept_different_counts(bundles):
    engine = Engine(bundles("self:int4"))
    rows = [PROMPTS[0][:7], PROMPTS[1]]
    batch = engine.generate_batch(rows, max_new_tokens=32, stop_at_eos=False)
    for row, result in zip(rows, batch, strict=True):
        assert result.output_ids == engine.generate(row, max_new_tokens=32, stop_at_eos=False).output_ids


def test_draft_writes_no_cache_slot_past_the_end(bundles):
    """The draft's steps write past the bonus: the host stops before they would leave the cache."""
    engine = Engine(bundles("self:int8"))
    assert engine.extra_slots == 3
    result = engine.generate(list(range(1, 120)), max_new_tokens=200, stop_at_eos=False)
    assert result.stop_reason == "max_context"
    assert len(result.prompt_ids) + len(result.output_ids) + engine.extra_slots <= engine.max_context


def test_a_draft_with_another_vocabulary_is_refused(tiny_folder, tmp_path):
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "draft", max_context=64,
                           draft=str(tiny_folder("llama-v8")))  # fmt: skip
    with pytest.raises(InputError, match="a draft must share the target's vocabulary"):
        compile_model(cfg)
    assert not (tmp_path / "b").exists()


def test_a_missing_draft_is_one_line(tiny_folder, tmp_path):
    cfg = CompileConfig.of(
        tiny_folder("llama"), tmp_path / "b", "draft", max_context=64, draft=str(tmp_path / "nowhere")
    )
    with pytest.raises(InputError) as err:
        compile_model(cfg)
    assert "\n" not in str(err.value) and "nowhere" in str(err.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"draft": "self:int3"}, "self:int4 or self:int8"),
        ({"num_draft": 0}, "--num-draft must be between 1 and 16"),
        ({"draft_block_size": 48}, "--draft-block-size"),
        ({"tree": "default"}, "--method draft has no option 'tree'"),
    ],
)
def test_bad_options_are_refused(tiny_folder, tmp_path, options, message):
    with pytest.raises(InputError, match=message):
        CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "draft", **options).check()


def test_tokenizers_must_map_every_string_to_the_same_id(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specgraph.methods.draft import check_same_tokenizer

    class Loaded:
        def __init__(self, name, vocab):
            self.name, self.tokenizer_dir = name, tmp_path / name
            tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
            PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(self.tokenizer_dir))

    target = Loaded("target", {"<unk>": 0, "a": 1, "b": 2})
    check_same_tokenizer(target, Loaded("same", {"<unk>": 0, "a": 1, "b": 2}))
    with pytest.raises(InputError, match="'a' is id 2 in the draft and 1 in the target"):
        check_same_tokenizer(target, Loaded("swapped", {"<unk>": 0, "b": 1, "a": 2}))
