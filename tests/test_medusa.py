"""Medusa: heads, the chain engine, tree verification with KV compaction, tree files and auto
trees, bad input."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from specgraph.compiler import CompileConfig, compile_model
from specgraph.errors import InputError
from specgraph.methods.medusa.heads import MedusaHeads, save_heads
from specgraph.ops import compact_update
from specgraph.runtime import Engine
from tests.greedy import assert_same_greedy, hf_greedy
from tests.models.tiny import VOCAB, build

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [17, 3, 99, 42, 200, 13, 77], list(range(30, 70))]
ACCEPTANCE = [[0.5, 0.2, 0.1] + [0.01] * 7] * 4


def _heads(tmp_path, hidden: int = 64, vocab: int = VOCAB, seed: int = 1):
    torch.manual_seed(seed)
    heads = MedusaHeads(hidden, 4)
    with torch.no_grad():
        heads.weight.normal_(0, 0.05)
        heads.bias.normal_(0, 0.05)
    path = tmp_path / f"heads_{hidden}_{vocab}.safetensors"
    save_heads(path, heads, {"vocab_size": vocab, "model": "tiny", "acceptance": ACCEPTANCE})
    return path


def _compile(folder, out, heads, tree="default", max_context=320):
    cfg = CompileConfig.of(model=str(folder), output=out, method="medusa", max_context=max_context, heads=str(heads),
                        tree=tree)  # fmt: skip
    return compile_model(cfg)


@pytest.mark.parametrize(("family", "tree"), [("llama", "default"), ("gemma3", "mc_sim_7b_63"), ("gpt2", "chain-4")])
def test_medusa_greedy_matches_hf_generate(family, tree, tiny_folder, tmp_path):
    _compile(tiny_folder(family), tmp_path / "b", _heads(tmp_path), tree)
    engine = Engine(tmp_path / "b")
    model = build(family)
    accepted = []
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=64, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, 64))
        accepted.append(result.mean_accepted)
    if tree == "mc_sim_7b_63":
        assert engine.manifest["medusa"]["tree_size"] == 64
        assert max(accepted) > 2.0  # the tiny model repeats itself: deep branches get accepted and compacted


@pytest.mark.parametrize(("family", "options"), [("llama", {}), ("gemma3", {"num_draft": 3, "adaptive": False}),
                                                ("gpt2", {"num_draft": 4, "adaptive": False})])  # fmt: skip
def test_chain_greedy_and_seeded_match_none(family, options, tiny_folder, tiny_bundle, tmp_path):
    """`--tree chain` (the default): heads 1..K's argmax drafts on the chain engine, with its fused
    attention and no cache moves: greedy text is HF's, and seeded text is plain sampling's token
    for token (the drafts are point masses, verified by the one-hot rule)."""
    out = tmp_path / "b"
    compile_model(CompileConfig.of(model=str(tiny_folder(family)), output=out, method="medusa", max_context=320,
                                   heads=str(_heads(tmp_path)), **options))  # fmt: skip
    engine, none = Engine(out), Engine(tiny_bundle(family, "none"))
    section = engine.manifest["medusa"]
    assert section["tree"] == "chain" and section["num_draft"] == options.get("num_draft", 1)
    assert ("adaptive" in section) == (options.get("adaptive") is not False)
    assert section["weights"]["weights"] == "int8" and section["weights"]["matmuls"] >= 1
    ops = [[n.op_type for n in onnx.load(str(b / "model.onnx"), load_external_data=False).graph.node]
           for b in (out, none.bundle)]  # fmt: skip
    # cache writes as `none`'s (no compaction), and the attention fused alike
    for op in ("TensorScatter", "GroupQueryAttention"):
        assert ops[0].count(op) == ops[1].count(op)
    assert "draft_q" not in {i.name for i in engine.session.get_inputs()}  # point masses: no q carried
    model = build(family)
    accepted = []
    for i, prompt in enumerate(PROMPTS):
        result = engine.generate(prompt, max_new_tokens=64, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, 64))
        accepted.append(result.mean_accepted)
        kw = {"max_new_tokens": 32, "stop_at_eos": False, "temperature": 0.8, "top_p": 0.9, "seed": 5 + i}
        assert engine.generate(prompt, **kw).output_ids == none.generate(prompt, **kw).output_ids
    if family == "gpt2":
        assert max(accepted) > 1.2  # the tiny model repeats itself: the heads' drafts get accepted


def test_chain_num_draft_auto_builds_the_k_it_predicts_fastest(tiny_folder, tmp_path):
    """`--num-draft auto` on the chain: heads 1..4 are timed and scored on the calibration
    prompts, and the bundle is built again with the best K (adaptive, as by default)."""
    prompts = tmp_path / "calibration.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "auto"
    compile_model(CompileConfig.of(model=str(tiny_folder("llama")), output=out, method="medusa", max_context=320,
                                   heads=str(_heads(tmp_path)), num_draft="auto", auto_prompts=str(prompts)))  # fmt: skip
    engine = Engine(out)
    section = engine.manifest["medusa"]
    assert section["auto"]["chosen"] == section["num_draft"] == engine.manifest["draft_depth"] in (1, 2, 3, 4)
    assert "adaptive" in section
    model = build("llama")
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=48, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, 48))


@pytest.mark.parametrize(("options", "message"), [
    ({"acceptance": "typical"}, "--acceptance typical verifies a tree: add --tree default"),
    ({"tree": "default", "num_draft": 2}, "--num-draft is for medusa's chain engine"),
    ({"tree": "auto", "adaptive": True}, "--adaptive is for medusa's chain engine"),
    ({"num_draft": 5}, "--num-draft 5 drafts a round, but heads_64_256.safetensors has 4 heads"),
    ({"num_draft": 2, "draft_confidence": 0.3, "adaptive": True}, "cannot be combined with --adaptive"),
])  # fmt: skip
def test_bad_chain_options(options, message, tiny_folder, tmp_path):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(".", r"\.")):
        compile_model(CompileConfig.of(model=str(tiny_folder("llama")), output=tmp_path / "b", method="medusa",
                                       max_context=320, heads=str(_heads(tmp_path)), **options))  # fmt: skip
    assert not (tmp_path / "b").exists()


def test_compact_update_moves_the_path_first():
    past = torch.arange(2 * 1 * 3 * 10, dtype=torch.float32).reshape(2, 1, 10, 3)  # [B, Hkv, S, D]
    update = -torch.ones(2, 1, 2, 3)  # two new entries
    path_src = torch.tensor([[6, 8], [4, 5]])
    n_path = torch.tensor([1, 2])
    out = compact_update(past, update, path_src, n_path, -2)  # [B, 1, 4, 3]
    torch.testing.assert_close(out[0, 0, 0], past[0, 0, 6])
    torch.testing.assert_close(out[0, 0, 1:3], update[0, 0])
    torch.testing.assert_close(out[1, 0, :2], past[1, 0, 4:6])
    torch.testing.assert_close(out[1, 0, 2:4], update[1, 0])


def test_auto_tree_uses_measured_cost(tiny_folder, tmp_path):
    report = _compile(tiny_folder("llama"), tmp_path / "b", _heads(tmp_path), "auto")
    assert report.method == "medusa"
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    auto = manifest["medusa"]["auto_tree"]
    assert auto["verify_cost"]["1"] == 1.0 and auto["size"] == manifest["medusa"]["tree_size"]
    engine = Engine(tmp_path / "b")
    model = build("llama")
    result = engine.generate(PROMPTS[0], max_new_tokens=32, stop_at_eos=False)
    assert_same_greedy(model, PROMPTS[0], result.output_ids, hf_greedy(model, PROMPTS[0], 32))


def test_heads_for_another_model_are_refused(tiny_folder, tmp_path):
    with pytest.raises(InputError, match="hidden size 32"):
        _compile(tiny_folder("llama"), tmp_path / "b", _heads(tmp_path, hidden=32))
    with pytest.raises(InputError, match="vocabulary of 999"):
        _compile(tiny_folder("llama"), tmp_path / "b", _heads(tmp_path, vocab=999))


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([[0], [0, 1, 2]], "not prefix-closed"),
        ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]], "needs 5 heads but the model has 4"),
    ],
)
def test_bad_tree_files(paths, message, tiny_folder, tmp_path):
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps(paths))
    with pytest.raises(InputError, match=message):
        _compile(tiny_folder("llama"), tmp_path / "b", _heads(tmp_path), str(tree))


def test_tree_larger_than_context(tiny_folder, tmp_path):
    with pytest.raises(InputError, match="does not fit a context of 32"):
        _compile(tiny_folder("llama"), tmp_path / "b", _heads(tmp_path), "mc_sim_7b_63", max_context=32)


def test_typical_acceptance_is_flagged_lossy_and_accepts_more(tiny_folder, tmp_path):
    """Typical acceptance (LOSSY, opt-in) accepts at least what greedy verification accepts on
    the first step, and the bundle says it is not lossless."""
    heads = _heads(tmp_path)
    for rule in ("greedy", "typical"):
        cfg = CompileConfig.of(model=str(tiny_folder("llama")), output=tmp_path / rule, method="medusa", max_context=320,
                            heads=str(heads), tree="chain-4", acceptance=rule)  # fmt: skip
        compile_model(cfg)
    greedy, typical = Engine(tmp_path / "greedy"), Engine(tmp_path / "typical")
    assert greedy.manifest["medusa"]["lossless"] and not typical.manifest["medusa"]["lossless"]
    prompt = PROMPTS[1]
    g = greedy.generate(prompt, max_new_tokens=40, stop_at_eos=False)
    t = typical.generate(prompt, max_new_tokens=40, stop_at_eos=False)
    assert t.accepted_per_step[0] >= g.accepted_per_step[0]
    assert t.mean_accepted >= 1.0 and len(t.output_ids) == 40


def test_typical_acceptance_needs_medusa(tiny_folder, tmp_path):
    with pytest.raises(InputError, match="--method lookup has no option 'acceptance'"):
        CompileConfig.of(model=str(tiny_folder("llama")), output=tmp_path / "b", method="lookup", acceptance="typical")


def test_heads_for_another_model_are_refused_by_fingerprint(tiny_folder, tmp_path):
    heads = MedusaHeads(64, 4)
    path = tmp_path / "foreign.safetensors"
    save_heads(path, heads, {"vocab_size": VOCAB, "model": "other", "fingerprint": "0" * 32})
    with pytest.raises(InputError, match="trained for another model \\(other\\)"):
        _compile(tiny_folder("llama"), tmp_path / "b", path)
    assert not (tmp_path / "b").exists()


def test_heads_trained_for_this_model_carry_its_fingerprint(tiny_folder, tmp_path):
    from specgraph.loaders import load_model, model_fingerprint

    loaded = load_model(str(tiny_folder("llama")))
    heads = MedusaHeads(64, 4)
    path = tmp_path / "own.safetensors"
    save_heads(path, heads, {"vocab_size": VOCAB, "model": "tiny", "fingerprint": model_fingerprint(loaded)})
    _compile(tiny_folder("llama"), tmp_path / "b", path, max_context=64)
    assert Engine(tmp_path / "b").generate(PROMPTS[0], max_new_tokens=4, stop_at_eos=False).output_ids


# --- reduced draft vocabulary (specgraph/draft_vocab.py) --------------------------------------------


def _ranking(tmp_path, seed: int = 3):
    from specgraph.draft_vocab import rank_tokens, save_ranking

    counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(seed)).numpy()
    path = tmp_path / "ranking.json"
    save_ranking(path, rank_tokens(counts), {"model": "tiny", "coverage": {"code": {"64": 0.5}}})
    return path, rank_tokens(counts)


@pytest.mark.parametrize("tree", ["chain", "default"])
def test_reduced_draft_vocabulary_is_lossless_and_drafts_only_its_tokens(tree, tiny_folder, tmp_path):
    import numpy as np

    path, ranked = _ranking(tmp_path)
    cfg = CompileConfig.of(model=str(tiny_folder("llama")), output=tmp_path / "b", method="medusa", max_context=320,
                           heads=str(_heads(tmp_path)), draft_vocab=64, draft_vocab_file=str(path), tree=tree)  # fmt: skip
    compile_model(cfg)
    engine = Engine(tmp_path / "b")
    section = engine.manifest["medusa"]["draft_vocab"]
    assert section["size"] == 64 and section["of"] == VOCAB and section["coverage"] == {"code": 0.5}
    assert section["ids"] == sorted(int(i) for i in ranked[:64])
    model = build("llama")
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=48, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, 48))
    # every draft the heads propose (next_tokens after the bonus) is in the set
    state = engine.new_state(1)
    io = engine.session.io_binding()
    feeds = engine.first_feeds(np.asarray([PROMPTS[2]], np.int64), len(PROMPTS[2]), 0)
    out = engine.call(io, feeds, state)
    drafts = out["next_tokens"].numpy()[0, 1:]
    assert len(drafts) > 0 and set(drafts.tolist()) <= set(section["ids"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"draft_vocab": -1}, "--draft-vocab must be 0"),
    ({"draft_vocab": 64}, "needs a token ranking for"),
    ({"draft_vocab": VOCAB + 1, "ranking": True}, "--draft-vocab must be 0 (the whole vocabulary) or 1.."),
    ({"draft_vocab": 8, "ranking": "short"}, "ranks a vocabulary of 10 tokens"),
])  # fmt: skip
def test_bad_draft_vocabulary_options(kwargs, message, tiny_folder, tmp_path):
    from specgraph.draft_vocab import save_ranking

    kwargs = dict(kwargs)
    ranking = kwargs.pop("ranking", None)
    if ranking == "short":
        save_ranking(tmp_path / "r.json", torch.arange(10).numpy(), {})
        kwargs["draft_vocab_file"] = str(tmp_path / "r.json")
    elif ranking:
        kwargs["draft_vocab_file"] = str(_ranking(tmp_path)[0])
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        cfg = CompileConfig.of(model=str(tiny_folder("llama")), output=tmp_path / "b", method="medusa",
                               max_context=320, heads=str(_heads(tmp_path)), **kwargs)  # fmt: skip
        compile_model(cfg)
    assert not (tmp_path / "b").exists()
