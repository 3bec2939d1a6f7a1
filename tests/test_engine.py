"""Compiled engines in ONNX Runtime against eager PyTorch and Hugging Face greedy generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specgraph.errors import InputError
from specgraph.runtime import Engine
from tests.greedy import assert_same_greedy, hf_greedy
from tests.models.tiny import build

FAMILIES = ["llama", "qwen2", "gpt2", "gemma3"]
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 9, 5, 6],  # repeats: lookup drafts something useful
    [17, 3, 99, 42, 200, 13, 77],
    list(range(30, 70)),  # longer than gemma3's sliding window of 16
]
NEW_TOKENS = 64


@pytest.mark.parametrize("method", ["none", "lookup"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(family, method, tiny_bundle):
    model = build(family)
    engine = Engine(tiny_bundle(family, method))
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert len(result.output_ids) == NEW_TOKENS
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))
        if method == "none":
            assert result.steps == NEW_TOKENS - 1 and result.mean_accepted == 1.0


def test_lookup_accepts_more_than_one_token_on_repetitive_text(tiny_bundle):
    engine = Engine(tiny_bundle("llama", "lookup"))
    result = engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    assert result.mean_accepted > 1.2
    assert result.steps < NEW_TOKENS - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_eager(family, tiny_bundle):
    """The engine's logits for a prompt equal eager PyTorch to 1e-4 relative."""
    model = build(family)
    engine = Engine(tiny_bundle(family, "none"))
    prompt = PROMPTS[2]
    state = engine.new_state(1)
    feeds = {
        "tokens": np.asarray([prompt], np.int64),
        "n_fixed": np.asarray([len(prompt)], np.int64),
        "cache_len": np.zeros(1, np.int64),
    }
    out = engine.call(engine.session.io_binding(), feeds, state)
    got = out["logits"].numpy()[0]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale


def test_step_logits_match_eager_with_cache(tiny_bundle):
    """Decode steps read the cache: each step's logits equal eager logits of the full prefix."""
    model = build("llama")
    engine = Engine(tiny_bundle("llama", "none"))
    prompt = PROMPTS[1]
    state = engine.new_state(1)
    io = engine.session.io_binding()
    feeds = {
        "tokens": np.asarray([prompt], np.int64),
        "n_fixed": np.asarray([len(prompt)], np.int64),
        "cache_len": np.zeros(1, np.int64),
    }
    out = engine.call(io, feeds, state)
    seq = list(prompt)
    for _ in range(8):
        token = int(out["next_tokens"].numpy()[0, 0])
        seq.append(token)
        feeds = {
            "tokens": np.asarray([[token]], np.int64),
            "n_fixed": np.ones(1, np.int64),
            "cache_len": out["cache_len_out"].numpy(),
        }
        out = engine.call(io, feeds, state)
        with torch.no_grad():
            want = model(torch.tensor([seq])).logits[0, -1].numpy()
        got = out["logits"].numpy()[0, -1]
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_verify_of_several_tokens_matches_eager(tiny_bundle):
    """A chain of drafts verified in one call gives the same logits as eager (tree attention mask)."""
    model = build("qwen2")
    engine = Engine(tiny_bundle("qwen2", "none"))
    prompt, drafts = PROMPTS[1], [9, 8, 7, 6]
    state = engine.new_state(1)
    io = engine.session.io_binding()
    feeds = {
        "tokens": np.asarray([prompt[:-1]], np.int64),
        "n_fixed": np.asarray([len(prompt) - 1], np.int64),
        "cache_len": np.zeros(1, np.int64),
    }
    engine.call(io, feeds, state)
    feeds = {
        "tokens": np.asarray([[prompt[-1], *drafts]], np.int64),
        "n_fixed": np.ones(1, np.int64),
        "cache_len": np.asarray([len(prompt) - 1], np.int64),
    }
    got = engine.call(io, feeds, state)["logits"].numpy()[0]
    with torch.no_grad():
        want = model(torch.tensor([prompt + drafts])).logits[0, len(prompt) - 1 :].numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_eos_stops_generation(tiny_bundle):
    engine = Engine(tiny_bundle("llama", "none"))
    free = engine.generate(PROMPTS[1], max_new_tokens=20, stop_at_eos=False)
    engine.eos_token_ids = [free.output_ids[5]]
    stopped = engine.generate(PROMPTS[1], max_new_tokens=20)
    first = free.output_ids.index(free.output_ids[5])
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert stopped.stop_reason == "eos"


def test_max_context_stops_generation(tiny_bundle):
    engine = Engine(tiny_bundle("llama", "lookup"))
    result = engine.generate(list(range(10, 150)), max_new_tokens=100, stop_at_eos=False)
    assert result.stop_reason == "max_context"
    assert len(result.output_ids) < 100


def test_user_traced_torch_export_file(tmp_path):
    """A program the user traced and saved with torch.export.save compiles and decodes greedily."""
    from specgraph.capture import export_hf
    from specgraph.compiler import CompileConfig, compile_model

    model = build("llama", seed=3)
    path = tmp_path / "model.pt2"
    torch.export.save(export_hf(model, 256), str(path))
    for method in ("none", "lookup"):
        bundle = tmp_path / method
        compile_model(CompileConfig.of(model=str(path), output=bundle, method=method, max_context=128))
        engine = Engine(bundle)
        assert engine.manifest["source"]["kind"] == "torch.export" and engine.manifest["tokenizer"] is None
        for prompt in PROMPTS[:2]:
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
            assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))


# --- the API checks what the CLI checks (issue 8) --------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1, -1], r"token ids must lie in \[0, 256\) for this model; position 1 holds -1"),
        ([5, 256], "position 1 holds 256"),
        ([5, 2**63], "position 1 holds"),
        ([1, 2.0], "position 1 holds 2.0"),
        ([1.5], "position 0 holds 1.5"),
        ([True, 2], "position 0 holds True"),
        ([1, "2"], "position 1 holds '2'"),
        ("123", "a prompt is a list of token ids"),
        (b"123", "a prompt is a list of token ids"),
        ({1: 2}, "a prompt is a list of token ids"),
        (np.array([1.0, 2.0]), "a prompt is a list of token ids"),
        (np.array([[1, 2]]), "a prompt is a list of token ids"),
        ([], "the prompt is empty"),
        (None, "a prompt is a list of token ids"),
    ],
)
def test_generate_refuses_what_is_not_a_prompt(tiny_bundle, prompt, message):
    """Negative ids wrapped around, floats were truncated, a string became its digits, and an
    out-of-vocabulary id raised ONNX Runtime's own error."""
    engine = Engine(tiny_bundle("llama", "none"))
    with pytest.raises(InputError, match=message) as info:
        engine.generate(prompt, max_new_tokens=2)
    assert "\n" not in str(info.value)
    with pytest.raises(InputError, match=message):
        engine.generate_batch([prompt], max_new_tokens=2)


def test_integer_arrays_and_numpy_ints_are_prompts(tiny_bundle):
    engine = Engine(tiny_bundle("llama", "none"))
    want = engine.generate(PROMPTS[1], max_new_tokens=4, stop_at_eos=False).output_ids
    assert engine.generate(np.asarray(PROMPTS[1]), max_new_tokens=4, stop_at_eos=False).output_ids == want
    numpy_ints = [np.int32(t) for t in PROMPTS[1]]
    assert engine.generate(tuple(numpy_ints), max_new_tokens=np.int64(4), stop_at_eos=False).output_ids == want
    batch = engine.generate_batch(np.asarray([PROMPTS[1], PROMPTS[1]]), max_new_tokens=4, stop_at_eos=False)
    assert [r.output_ids for r in batch] == [want, want]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
def test_max_new_tokens_must_be_positive(tiny_bundle, bad):
    engine = Engine(tiny_bundle("llama", "none"))
    with pytest.raises(InputError, match="max_new_tokens must be a positive integer"):
        engine.generate([1, 2, 3], max_new_tokens=bad)


@pytest.mark.parametrize("prompts", ["12", [], [[1, 2], [3, -1]], [[1, 2], "34"], 7])
def test_generate_batch_checks_every_row(tiny_bundle, prompts):
    engine = Engine(tiny_bundle("llama", "none"))
    with pytest.raises(InputError):
        engine.generate_batch(prompts, max_new_tokens=2)


def test_rates_are_never_negative():
    from specgraph.runtime import GenerationResult

    empty = GenerationResult([1], [], steps=0, prefill_s=0.1, decode_s=0.5, stop_reason="max_new_tokens")
    assert empty.tokens_per_s == 0.0 and empty.mean_accepted == 0.0


def test_cli_and_api_refuse_a_prompt_with_the_same_words(tiny_bundle, capsys):
    from specgraph.cli import main

    bundle = tiny_bundle("llama", "none")
    with pytest.raises(InputError) as info:
        Engine(bundle).generate([1, -1])
    assert main(["generate", str(bundle), "--prompt-ids", "1,-1"]) == InputError.exit_code
    assert capsys.readouterr().err == f"specgraph generate: error: {info.value}\n"


# --- lookup --adaptive (issue 10: run-time draft length) ----------------------------------------


def _with_cost(bundle, out, cost):  # type: ignore[no-untyped-def]
    """A copy of the adaptive lookup `bundle` at `out` whose verify-cost curve is `cost`."""
    from tests.bundles import with_initializer

    return Engine(with_initializer(bundle, out, "lookup_cost", np.asarray(cost, np.float32)))


def test_adaptive_lookup_is_lossless_and_sends_only_drafts_that_pay(tiny_folder, tiny_bundle, tmp_path):
    """`--adaptive` (lookup's default): the cost curve is measured into the graph; the output
    equals HF greedy and lookup without it, batched too; a curve on which drafting never pays
    sends no draft (a plain step every round), a flat one sends every draft that lookup without
    `--adaptive` sends."""
    from specgraph.compiler import CompileConfig, compile_model

    model = build("llama")
    bundle = tiny_bundle("llama", "lookup")
    engine = Engine(bundle)
    section = engine.manifest["lookup"]["adaptive"]
    assert section["cost"][0] == 1.0 and len(section["cost"]) == 6
    assert section["cost"] == sorted(section["cost"])
    fixed = tmp_path / "fixed"
    compile_model(CompileConfig.of(tiny_folder("llama"), fixed, "lookup", max_context=160, num_draft=5, adaptive=False))
    plain = Engine(fixed)
    assert "adaptive" not in plain.manifest["lookup"] and "lookup_stats" not in plain.manifest["graph"]["state"]
    never = _with_cost(bundle, tmp_path / "never", [1.0, *[100.0] * 5])
    flat = _with_cost(bundle, tmp_path / "flat", [1.0] * 6)
    for prompt in PROMPTS:
        want = hf_greedy(model, prompt, NEW_TOKENS)
        ran = {name: e.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
               for name, e in (("adaptive", engine), ("plain", plain), ("never", never), ("flat", flat))}  # fmt: skip
        for result in ran.values():
            assert_same_greedy(model, prompt, result.output_ids, want)
        assert ran["never"].steps == NEW_TOKENS - 1
        assert ran["flat"].steps == ran["plain"].steps
    batch = engine.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    for prompt, result in zip(PROMPTS, batch, strict=True):
        assert result.output_ids == engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).output_ids
    assert batch[0].mean_accepted > 1.2  # the repetitive prompt still gains


def test_adaptive_lookup_learns_from_sent_and_withheld_drafts():
    """The acceptance statistics per match length and the draft count, on hand-made rounds."""
    from specgraph.methods.lookup import ADAPT_DECAY, _draft_count, _observe

    stats = torch.tensor([[2.0, 1.0]]).repeat(4, 3, 1)  # [B, 3 match lengths, 2]
    # rows: sent 3 after a 3-gram and 1 was accepted; sent 2 after a 1-gram, both accepted;
    # sent none after a 2-gram, withheld 7, 7 came; nothing proposed
    last = torch.tensor([[3, 0, 3], [2, 0, 1], [0, 8, 2], [0, 0, 0]])
    tokens = torch.tensor([[4, 9, 9, 9], [4, 5, 6, 0], [4, 7, 7, 7], [4, 7, 7, 7]])
    committed = torch.tensor([2, 3, 1, 1])
    bonus = torch.tensor([[1], [2], [7], [3]])
    got = _observe(stats, last, tokens, bonus, committed)
    d = ADAPT_DECAY
    want = stats.clone()  # only the match length each row's drafts followed moves
    want[0, 2] = torch.tensor([2 * d + 1, d + 1])
    want[1, 0] = torch.tensor([2 * d + 2, d])
    want[2, 1] = torch.tensor([2 * d + 1, d])
    assert torch.allclose(got, want)
    # a withheld draft that the target did not take counts as rejected
    miss = _observe(stats[2:3], last[2:3], tokens[2:3], torch.tensor([[6]]), committed[2:3])
    assert torch.allclose(miss[0, 1], torch.tensor([2 * d, d + 1])) and torch.equal(miss[0, ::2], stats[2, ::2])
    cost = torch.tensor([1.0, 1.05, 1.3, 1.5, 1.8])
    # one row that copies well after 3-gram matches, hopelessly after 1-gram ones, unsure after 2-grams
    row = torch.tensor([[[0.0, 40.0], [1.0, 3.0], [40.0, 0.0]]])
    assert _draft_count(row, cost, torch.tensor([3])).item() == 4
    assert _draft_count(row, cost, torch.tensor([2])).item() == 1
    assert _draft_count(row, cost, torch.tensor([1])).item() == 0
    # a length not seen yet borrows the row's rate over all lengths; one lucky round moves it only so far
    unseen, lucky = torch.tensor([[[0.0, 40.0], [0.0, 0.0], [0.0, 0.0]], [[0.0, 40.0], [0.0, 0.0], [1.0, 0.0]]])
    assert _draft_count(unseen[None], cost, torch.tensor([3])).item() == 0
    assert _draft_count(lucky[None], cost, torch.tensor([3])).item() == 1
    # a row that has observed nothing starts at FIRST_RATE: it withholds where a second verified
    # token is dear (it still learns from the withheld draft) and sends where it is cheap
    dear, cheap = torch.tensor([1.0, 1.46, 1.8, 2.1, 2.5]), torch.tensor([1.0, 1.09, 1.18, 1.26, 1.3])
    fresh = torch.zeros(1, 3, 2)
    assert _draft_count(fresh, dear, torch.tensor([3])).item() == 0
    assert _draft_count(fresh, cheap, torch.tensor([3])).item() >= 1
    # one withheld draft that the target took is enough to start sending after that match length
    taken = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]]])
    assert _draft_count(taken, dear, torch.tensor([3])).item() >= 1
