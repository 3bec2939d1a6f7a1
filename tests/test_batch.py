"""Ragged batches: `generate_batch` with prompts of different lengths, whose rows accept different
numbers of tokens per round, emits for every row exactly what the row emits alone, for every
method in the registry; bad batches are refused in one line."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specgraph import methods
from specgraph.compiler import CompileConfig, compile_model
from specgraph.errors import InputError
from specgraph.runtime import Engine
from specgraph.sampling import SamplingParams, uniform_stream
from specgraph.step import MAX_BATCH
from tests.greedy import assert_same_greedy, assert_same_sampled, hf_greedy
from tests.methods.test_eagle import random_drafter
from tests.methods.test_early_exit import random_adapter
from tests.models.tiny import build
from tests.test_medusa import _heads

# Lengths 10, 1, 23 and 7: padded to 23, the 1-token row gets 22 tokens of padding.
ROWS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [42], list(range(30, 53)), [17, 3, 99, 42, 200, 13, 77]]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def model():
    return build("llama")


@pytest.fixture(scope="module")
def bundle(tiny_bundle, tiny_folder, tmp_path_factory):
    """method -> a bundle of the tiny Llama (max context 160 for all, so seeded rows draw the same
    uniforms); Medusa gets seeded random heads, as in test_medusa.py, EAGLE an untrained drafter."""
    cache = {}

    def get(method: str):  # the drafters draft every round (not adaptive): see medusa's below
        if method not in cache:
            if method == "early-exit":  # an untrained adapter: the target's layer 2 without its MLP
                tmp = tmp_path_factory.mktemp("batch_early_exit")
                adapter = random_adapter(tiny_folder("llama"), tmp / "adapter.safetensors", std=0.0)
                cfg = CompileConfig.of(tiny_folder("llama"), tmp / "bundle", method, max_context=160,
                                       exit_adapter=str(adapter), num_draft=3, adaptive=False)  # fmt: skip
                compile_model(cfg)
                cache[method] = cfg.output
            elif method == "eagle":
                tmp = tmp_path_factory.mktemp("batch_eagle")
                drafter = random_drafter(tiny_folder("llama"), tmp / "eagle.safetensors")
                cfg = CompileConfig.of(tiny_folder("llama"), tmp / "bundle", method, max_context=160,
                                       eagle=str(drafter), num_draft=3, adaptive=False)  # fmt: skip
                compile_model(cfg)
                cache[method] = cfg.output
            elif method.startswith("medusa"):  # medusa: the chain engine (the default); medusa-tree: the tree engine
                tmp = tmp_path_factory.mktemp("batch_medusa")
                # the chain drafts every round (its gate's threshold is timed at compile time, so rows
                # that stop drafting on a busy machine would leave the rounds below nothing to compare)
                tree = {"tree": "default"} if method == "medusa-tree" else {"num_draft": 3, "adaptive": False}
                cfg = CompileConfig.of(tiny_folder("llama"), tmp / "bundle", "medusa", max_context=160,
                                       heads=str(_heads(tmp)), **tree)  # fmt: skip
                compile_model(cfg)
                cache[method] = cfg.output
            else:
                cache[method] = tiny_bundle("llama", method)
        return cache[method]

    return get


def _rounds_differ(results) -> bool:
    """Whether some round had rows emit different numbers of tokens (while all still ran)."""
    rounds = min(len(r.accepted_per_step) for r in results)
    return any(len({r.accepted_per_step[i] for r in results}) > 1 for i in range(rounds))


@pytest.mark.parametrize("method", [*methods.names(), "medusa-tree"])
def test_ragged_batch_equals_each_row_alone_and_hf_greedy(method, bundle, model):
    engine = Engine(bundle(method))
    batch = engine.generate_batch(ROWS, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    assert [r.prompt_ids for r in batch] == ROWS
    for row, result in zip(ROWS, batch, strict=True):
        alone = engine.generate(row, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert result.output_ids == alone.output_ids, f"{method}: row of {len(row)} tokens differs from its run alone"
        assert len(result.output_ids) == NEW_TOKENS and result.stop_reason == "max_new_tokens"
        assert_same_greedy(model, row, result.output_ids, hf_greedy(model, row, NEW_TOKENS))
    counts = [n for r in batch for n in r.accepted_per_step]
    if methods.get(method.removesuffix("-tree")).speculative:
        assert max(counts) > 1, f"{method} accepted no draft in {len(counts)} rounds"
        assert _rounds_differ(batch), f"{method}: every round accepted the same count in every row"
    else:
        assert set(counts) == {1}


@pytest.mark.parametrize("method", [*methods.names(), "medusa-tree"])
def test_padding_equal_to_the_target_s_tokens_is_accepted_as_drafts(method, bundle):
    """The contract behind ragged prefill: a row's tokens after its n_fixed are drafts. Pad the
    short row with its own greedy continuation: a chain engine keeps those drafts and emits them
    plus the bonus; the tree engine's prefill keeps no draft (its output holds a tree branch) and
    emits the bonus. Either way the long row in the same call emits its own next token."""
    engine = Engine(bundle(method))
    short, long = ROWS[3], ROWS[2]
    want = engine.generate(short, max_new_tokens=6, stop_at_eos=False).output_ids
    tokens = np.asarray([short + want[:5] + [0] * (len(long) - len(short) - 5), long], np.int64)
    out = engine.call(engine.session.io_binding(), engine.first_feeds(tokens, [len(short), len(long)], 0),
                      engine.new_state(2))  # fmt: skip
    n_accepted, accepted = out["n_accepted"].numpy(), out["accepted"].numpy()
    if "tree_depths" in engine.manifest["graph"]["constants"]:
        assert n_accepted[0] == 1 and accepted[0, 0] == want[0]
    else:
        assert n_accepted[0] >= 6 and accepted[0, :6].tolist() == want  # 5 padded drafts kept, then the bonus
    assert accepted[1, : n_accepted[1]].tolist()[:1] == engine.generate(long, max_new_tokens=1).output_ids
    assert out["cache_len_out"].numpy()[0] == len(short) + n_accepted[0] - 1  # the bonus is not cached yet


def test_a_one_token_row_padded_to_the_tree_size_is_verified_as_a_tree(bundle, model):
    """The tree engine takes a row with n_fixed 1 and as many tokens as tree nodes for a tree
    step: a 1-token prompt padded to exactly that many tokens is verified as a tree of padding
    drafts, which is still the target's greedy text."""
    engine = Engine(bundle("medusa-tree"))
    nodes = engine.manifest["medusa"]["tree_size"]
    rows = [[42], [1 + (7 * i) % 255 for i in range(nodes)]]  # no id 0: hf_greedy pads with it
    batch = engine.generate_batch(rows, max_new_tokens=24, stop_at_eos=False)
    for row, result in zip(rows, batch, strict=True):
        assert result.output_ids == engine.generate(row, max_new_tokens=24, stop_at_eos=False).output_ids
        assert_same_greedy(model, row, result.output_ids, hf_greedy(model, row, 24))


# Seeded text equals `none`'s for drafters whose proposals are point masses verified by the
# shared equality rule; `draft`, `eagle` and `early-exit` sample their drafts (the general rule, min(1, p/q)),
# so their text equals `none`'s in law only (tests/test_sampling.py): here they are tested greedy.
SEEDED = [m for m in methods.names() if methods.get(m).speculative and m not in ("draft", "eagle", "early-exit")]
SEEDED += ["medusa-tree"]  # medusa's chain and tree engines both draft point masses


@pytest.mark.parametrize("method", SEEDED)
def test_seeded_ragged_batch_equals_the_none_engine_s(method, bundle, model):
    setting = (0.3, 0, 0.9)  # a low temperature: the tiny model then repeats itself enough to accept drafts
    spec, plain = Engine(bundle(method)), Engine(bundle("none"))
    ragged = []
    for seed in (0, 11):
        params = SamplingParams(*setting, seed=seed)
        got = spec.generate_batch(ROWS, NEW_TOKENS, False, params)
        want = plain.generate_batch(ROWS, NEW_TOKENS, False, params)
        uniforms = uniform_stream(seed, len(ROWS), spec.max_context + 1)
        for b, row in enumerate(ROWS):
            assert_same_sampled(model, row, got[b].output_ids, want[b].output_ids, setting, uniforms[b])
            assert got[b].sampling.seed == seed and len(got[b].output_ids) == NEW_TOKENS
        ragged.append(_rounds_differ(got))
    assert any(ragged), f"{method}: no seeded batch had rows accept different counts in a round"


def test_a_long_padded_draft_row_draws_its_first_token_as_it_does_alone(bundle):
    """`draft` verifies with the general rule on the last K + 1 positions only; a row whose padding
    is longer puts its first new token before that window, where it must still be drawn from p
    (the residual stream of its position), not taken as the argmax. With no proposal at the
    prefill, the draw is the one the row makes alone with the same uniforms (row 0 of the seed)."""
    engine = Engine(bundle("draft"))
    short, long = [42], list(range(30, 53))  # 22 tokens of padding, K + 1 = 5 positions verified generally
    firsts, argmax_first = set(), engine.generate([42], 1, False).output_ids[0]
    for seed in range(12):
        params = SamplingParams(1.0, 0, 1.0, seed=seed)
        ragged = engine.generate_batch([short, long], 1, False, params)[0].output_ids[0]
        alone = engine.generate_batch([short], 1, False, params)[0].output_ids[0]
        assert ragged == alone, f"seed {seed}: the padded row drew {ragged}, alone {alone}"
        firsts.add(alone)
    assert firsts - {argmax_first}, "every draw was the argmax: the check cannot tell a draw from it"


def test_bad_batches_are_refused_in_one_line(bundle):
    engine = Engine(bundle("none"))
    too_long = [1] * engine.max_context
    cases = [
        ([], "non-empty list of prompts"),
        ([[1, 2]] * (MAX_BATCH + 1), f"at most {MAX_BATCH} prompts"),
        ([[1, 2], too_long], f"prompt 1 has {len(too_long)} tokens"),
        ([[1, 2], []], "the prompt is empty"),
        ([[1, 2], [3, 256]], "must lie in [0, 256)"),
    ]
    for prompts, message in cases:
        with pytest.raises(InputError, match=re.escape(message)) as info:
            engine.generate_batch(prompts, max_new_tokens=4)
        assert "\n" not in str(info.value)
    # the limit itself is accepted, and rows of different lengths stop on their own budgets
    rows = [[1 + i % 200] * (1 + i % 5) for i in range(MAX_BATCH)]
    results = engine.generate_batch(rows, max_new_tokens=2, stop_at_eos=False)
    assert [len(r.output_ids) for r in results] == [2] * MAX_BATCH
