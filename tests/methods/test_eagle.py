"""`--method eagle`: an EAGLE drafter (one decoder layer on the target's features) proposes K
tokens inside the engine call; the output must be exactly the target's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specgraph.compiler import CompileConfig, compile_model
from specgraph.errors import InputError, ModelLoadError, OutputError
from specgraph.loaders import load_model, model_fingerprint
from specgraph.methods.eagle.drafter import EagleDrafter, Shape, load_drafter, save_drafter
from specgraph.methods.eagle.train import train_eagle
from specgraph.runtime import Engine
from tests.greedy import assert_same_greedy, hf_greedy
from tests.methods.test_draft import NEW_TOKENS, PROMPTS
from tests.models.tiny import build
from tests.stored import float_copies

VOCAB = 256


def random_drafter(folder: Path, path: Path, seed: int = 1) -> Path:
    """An untrained drafter for the model in `folder` (its q is far from the target's p)."""
    loaded = load_model(str(folder))
    weight = loaded.hf_model.get_output_embeddings().weight
    torch.manual_seed(seed)
    drafter = EagleDrafter(Shape.for_model(loaded.hf_model.config, weight.shape[1], weight.shape[0]))
    save_drafter(path, drafter, {"model": loaded.name, "fingerprint": model_fingerprint(loaded)})
    return path


def token_prompts(folder: Path) -> Path:
    """24 training prompts of 5-11 random token ids (the tiny models have no tokenizer)."""
    gen = torch.Generator().manual_seed(3)
    prompts = folder / "prompts.jsonl"
    lines = [{"prompt_ids": torch.randint(2, VOCAB - 1, (5 + i % 7,), generator=gen).tolist()} for i in range(24)]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return prompts


@pytest.fixture(scope="module")
def trained(tiny_folder, tiny_bundle, tmp_path_factory):
    """A drafter trained on the tiny Llama's own greedy replies (it has no tokenizer: no code text)."""
    folder = tmp_path_factory.mktemp("eagle_train")
    prompts = token_prompts(folder)
    out = folder / "eagle.safetensors"
    report = train_eagle(str(tiny_folder("llama")), out, prompts=str(prompts), max_new_tokens=48, epochs=30,
                         lr=3e-3, batch_size=4, holdout=0.2, curve=2, threads=1, progress=False,
                         engine_bundle=str(tiny_bundle("llama", "none")))  # fmt: skip
    return report, out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, tiny_folder, trained):
    """(weights, num_draft) -> an eagle bundle of the tiny Llama with the trained drafter."""
    cache = {}

    def get(weights: str = "fp32", num_draft: int = 3):
        key = (weights, num_draft)
        if key not in cache:
            out = tmp_path_factory.mktemp("eagle") / "bundle"
            cfg = CompileConfig.of(tiny_folder("llama"), out, "eagle", max_context=160, weights=weights,
                                   eagle=str(trained[1]), num_draft=num_draft, adaptive=False)  # fmt: skip
            compile_model(cfg)
            cache[key] = out
        return cache[key]

    return get


def test_training_reports_a_curve_and_writes_a_loadable_drafter(trained):
    report, path = trained
    drafter = load_drafter(path, 64, VOCAB)
    assert drafter.meta["fingerprint"] == report["fingerprint"] and report["train_tokens"] > 0
    assert len(report["curve"]) == 2 and report["curve"][0]["train_tokens"] < report["curve"][1]["train_tokens"]
    depth1, depth2 = report["acceptance"]["chat"]
    assert 0.1 < depth1 <= 1 and 0 <= depth2 <= 1  # far above chance (1/256): the replies are learnable


def test_sampled_replies_widen_the_training_text(tiny_folder, tiny_bundle, tmp_path):
    """--samples N: N sampled replies per training prompt beside the greedy one, cached with it;
    held-out prompts are measured on their greedy replies only."""
    common = dict(prompts=str(token_prompts(tmp_path)), max_new_tokens=16, epochs=1, batch_size=4, holdout=0.2,
                  curve=1, threads=1, progress=False, engine_bundle=str(tiny_bundle("llama", "none")))  # fmt: skip
    model = str(tiny_folder("llama"))
    plain = train_eagle(model, tmp_path / "plain.safetensors", **common)
    wide = train_eagle(model, tmp_path / "wide.safetensors", samples=2, **common)
    greedy = json.loads((tmp_path / "plain.gen.json").read_text())
    cache = json.loads((tmp_path / "wide.gen.json").read_text())
    assert cache["key"]["samples"]["count"] == 2 and "samples" not in greedy["key"]
    assert [s["output_ids"] for s in cache["sequences"]] == [s["output_ids"] for s in greedy["sequences"]]
    assert all(len(s["sampled"]) == 2 for s in cache["sequences"])
    assert any(r != s["output_ids"] for s in cache["sequences"] for r in s["sampled"])  # not greedy again
    assert wide["train_tokens"] > 2 * plain["train_tokens"] and "2 sampled" in wide["corpus"]["chat"]
    again = train_eagle(model, tmp_path / "wide.safetensors", samples=2, force=True, **common)
    assert again["generation_cached"] and again["train_tokens"] == wide["train_tokens"]
    with pytest.raises(InputError, match="--samples"):
        train_eagle(model, tmp_path / "bad.safetensors", samples=-1, **common)


def test_added_prompts_reuse_the_cached_replies(tiny_folder, tiny_bundle, tmp_path, monkeypatch):
    """The generation cache keeps replies by prompt: a run with more prompts generates only theirs."""
    from specgraph.methods import replies

    prompts = token_prompts(tmp_path)
    common = dict(max_new_tokens=8, epochs=1, batch_size=4, holdout=0.2, curve=1, threads=1, progress=False,
                  engine_bundle=str(tiny_bundle("llama", "none")))  # fmt: skip
    model, out = str(tiny_folder("llama")), tmp_path / "d.safetensors"
    train_eagle(model, out, prompts=str(prompts), **common)
    first = json.loads((tmp_path / "d.gen.json").read_text())["sequences"]
    more = tmp_path / "more.jsonl"
    added = [{"prompt_ids": [7, 8, 9, 10 + i]} for i in range(3)]
    more.write_text(prompts.read_text() + "".join(json.dumps(line) + "\n" for line in added))
    asked = []
    reply_all = replies._reply_all
    monkeypatch.setattr(replies, "_reply_all", lambda engine, ids, *a: asked.extend(ids) or reply_all(engine, ids, *a))
    report = train_eagle(model, out, prompts=str(more), force=True, **common)
    assert asked == [line["prompt_ids"] for line in added] and not report["generation_cached"]
    cached = json.loads((tmp_path / "d.gen.json").read_text())["sequences"]
    assert cached[: len(first)] == first and len(cached) == len(first) + 3


def test_the_distribution_loss_and_deeper_training_reuse_the_cached_features(tiny_folder, tiny_bundle, tmp_path,
                                                                              monkeypatch):  # fmt: skip
    """A rerun on the same text reads the teacher-forced features from `<name>.features.safetensors`
    (no target pass); `--token-loss distribution` and `--train-depth 2` train from them; other text
    recomputes them; a file there that specgraph did not make is not replaced."""
    from specgraph.methods import teacher

    common = dict(prompts=str(token_prompts(tmp_path)), max_new_tokens=16, epochs=1, batch_size=4, holdout=0.2,
                  curve=1, threads=1, progress=False, engine_bundle=str(tiny_bundle("llama", "none")))  # fmt: skip
    model, out = str(tiny_folder("llama")), tmp_path / "d.safetensors"
    first = train_eagle(model, out, **common)
    assert not first["features_cached"] and (tmp_path / "d.features.safetensors").is_file()
    assert first["training"] == {"token_loss": "argmax", "depth": 1, "epochs": 1}
    computed = teacher.target_features

    def no_target_pass(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("the features should have come from the cache")

    monkeypatch.setattr(teacher, "target_features", no_target_pass)
    deeper = train_eagle(model, out, token_loss="distribution", depth=2, **common)  # replaces its own drafter
    assert deeper["features_cached"] and deeper["training"] == {"token_loss": "distribution", "depth": 2, "epochs": 1}
    assert all(v == v and v < 100 for v in deeper["epoch_loss"]) and deeper["train_tokens"] == first["train_tokens"]
    load_drafter(out, 64, VOCAB)
    monkeypatch.setattr(teacher, "target_features", computed)
    other = train_eagle(model, out, **{**common, "max_new_tokens": 12})
    assert not other["features_cached"] and other["train_tokens"] < first["train_tokens"]

    # the cache gives back exactly what the target's passes gave
    loaded = load_model(model)
    seqs = {"train": [([5, 6, 7, 8, 9], 1), ([9, 8, 7], 0)], "held.chat": [([3, 4, 5, 6], 2)]}
    fresh = lambda: {k: computed(loaded.hf_model, loaded.hf_model.get_output_embeddings(), v, 2, False, k, 1)  # noqa: E731
                     for k, v in seqs.items()}  # fmt: skip
    path, guard = tmp_path / "direct.features.safetensors", ([], False)
    made, cached = teacher._cached_features(path, loaded, seqs, 1, fresh, guard, False)
    again, cached_again = teacher._cached_features(path, loaded, seqs, 1, fresh, guard, False)
    assert not cached and cached_again
    for name in seqs:
        for a, b in zip(made[name], again[name], strict=True):
            assert a[3] == b[3] and all(torch.equal(x, y) for x, y in zip(a[:3] + a[4:], b[:3] + b[4:], strict=True))

    (tmp_path / "e.features.safetensors").write_text("my notes")
    with pytest.raises(OutputError, match="not a feature cache"):
        train_eagle(model, tmp_path / "e.safetensors", **common)
    assert (tmp_path / "e.features.safetensors").read_text() == "my notes"
    with pytest.raises(InputError, match="--train-depth"):
        train_eagle(model, tmp_path / "f.safetensors", depth=0, **common)
    with pytest.raises(InputError, match="--token-loss"):
        train_eagle(model, tmp_path / "f.safetensors", token_loss="soft", **common)


def test_function_prompts_are_humaneval_shaped_stubs():
    import ast

    from specgraph import corpus

    prompts = corpus.function_prompts(12, seed=1)
    assert len(prompts) == 12 and prompts == corpus.function_prompts(12, seed=1)
    for text in prompts:
        (node,) = ast.parse(text).body  # one function: a signature and its docstring, nothing else
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_")
        assert len(node.body) == 1 and ast.get_docstring(node) and not node.decorator_list


def test_function_prompts_need_a_tokenizer(tiny_folder, tmp_path):
    with pytest.raises(InputError, match="--function-prompts needs a model with a tokenizer"):
        train_eagle(str(tiny_folder("llama")), tmp_path / "f.safetensors", prompts=str(token_prompts(tmp_path)),
                    functions=4, progress=False)  # fmt: skip


def test_greedy_equals_hf_and_drafts_are_accepted(bundles, trained):
    model = build("llama")
    engine = Engine(bundles())
    assert engine.manifest["method"] == "eagle" and engine.manifest["draft_depth"] == 3
    taus = []
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))
        taus.append(result.mean_accepted)
    # the engine's drafts come from the features the training saw: they are accepted about as often
    assert max(taus) > 1.3, taus


def test_adaptive_engine_is_lossless_and_an_idle_call_skips_the_drafter(tiny_folder, trained, tmp_path):
    """`--adaptive`: the threshold is measured, the drafter sits in an `If` that runs only when
    some row drafts next round, the output is still HF's greedy output, and a call in which no row
    drafts leaves the drafter's cache as it was while a drafting call writes it."""
    import numpy as np
    import onnx

    out = tmp_path / "adaptive"
    compile_model(CompileConfig.of(tiny_folder("llama"), out, "eagle", max_context=160, eagle=str(trained[1]),
                                   num_draft=3, adaptive=True))  # fmt: skip
    engine = Engine(out)
    section = engine.manifest["eagle"]["adaptive"]
    assert section["threshold"] == section["measured_threshold"] > 0 and section["idle_ms"] < section["round_ms"]
    assert section["filled_caches"] == 0  # its layer is not the target's: a skipped call cannot fill it
    assert engine.manifest["graph"]["trims"] == {"next_tokens": "n_draft"}
    nodes = onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
    # gqa*: fused attention; sample*, speculative*: a sampling operator skipped in greedy calls (exporters/greedy_skip.py)
    gates = [n.name for n in nodes if n.op_type == "If" and not n.name.startswith(("gqa", "sample", "speculative"))]
    assert gates == ["draft_gate"]
    model = build("llama")
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))
    for score, drafts in ((-1e9, 0), (1e9, 3)):
        state = engine.new_state(1)
        feeds = engine.first_feeds(np.asarray([PROMPTS[0]], np.int64), len(PROMPTS[0]), 0)
        feeds["draft_score"] = np.full(1, score, np.float32)
        out_values = engine.call(engine.session.io_binding(), feeds, state)
        assert out_values["n_draft"].numpy().tolist() == [drafts]
        written = state["draft_past_key_0"].numpy().any()
        assert written == (drafts > 0), (score, written)


def test_confident_drafts_only_are_sent_and_the_output_is_unchanged(tiny_folder, trained, tmp_path):
    """`--draft-confidence P`: each row sends the leading drafts whose joint drafter probability
    is at least P (`n_draft`, which the host trims `next_tokens` by). The output is HF's greedy
    output whatever P is; P near 0 sends all K, P near 1 none (every round one token)."""
    import numpy as np

    from tests.bundles import with_initializer

    out = tmp_path / "confident"
    compile_model(CompileConfig.of(tiny_folder("llama"), out, "eagle", max_context=160, eagle=str(trained[1]),
                                   num_draft=3, draft_confidence=0.3))  # fmt: skip
    engine = Engine(out)
    assert engine.manifest["eagle"]["confidence"] == 0.3
    assert len(engine.manifest["eagle"]["stop_nodes"]) == 2  # an `If` after drafts 1 and 2 (exporters/draft_stop.py)
    assert engine.manifest["graph"]["trims"] == {"next_tokens": "n_draft"}
    model = build("llama")
    sent, taus = {}, {}
    for p in (0.3, 1e-12, 0.999999):
        bundle = out if p == 0.3 else tmp_path / f"p{p}"
        if p != 0.3:  # the same engine with another confidence (an initializer)
            with_initializer(out, bundle, "draft_log_confidence", np.log(np.asarray([p], np.float32)))
        live, counts, steps = Engine(bundle), set(), []
        for prompt in PROMPTS:
            feeds = live.first_feeds(np.asarray([prompt], np.int64), len(prompt), 0)
            first = live.call(live.session.io_binding(), feeds, live.new_state(1))
            counts.add(int(first["n_draft"].numpy()[0]))
            result = live.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
            assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))
            steps += result.accepted_per_step
        sent[p], taus[p] = counts, sum(steps) / len(steps)
    assert sent[1e-12] == {3} and sent[0.999999] == {0}, sent
    assert taus[0.999999] == 1.0 and taus[1e-12] > 1.1, taus
    batch = [PROMPTS[0][:7], PROMPTS[1], PROMPTS[2][:3]]
    for row, result in zip(batch, engine.generate_batch(batch, max_new_tokens=32, stop_at_eos=False), strict=True):
        assert result.output_ids == engine.generate(row, max_new_tokens=32, stop_at_eos=False).output_ids


def test_the_confident_count_is_the_leading_drafts_above_the_joint_probability():
    """`ModelDrafts._confident` by hand: drafts with probabilities 0.9, 0.5, 0.9 have joint
    probabilities 0.9, 0.45, 0.405, so P = 0.5 sends one, P = 0.4 all three; a weak first draft
    sends none, whatever follows it."""
    import math

    from specgraph.methods.draft import ModelDrafts

    engine = ModelDrafts.__new__(ModelDrafts)
    torch.nn.Module.__init__(engine)
    logps = torch.log(torch.tensor([[0.9, 0.5, 0.9], [0.1, 0.99, 0.99]]))
    for p, want in ((0.5, [1, 0]), (0.4, [3, 0]), (0.05, [3, 3]), (0.95, [0, 0])):
        engine.register_buffer("draft_log_confidence", torch.tensor([math.log(p)]))
        assert engine._confident(logps).tolist() == want, p


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_engines_equal_their_own_none_engine(bundles, tiny_folder, tmp_path, weights):
    none = tmp_path / "none"
    compile_model(CompileConfig.of(tiny_folder("llama"), none, "none", max_context=160, weights=weights))
    plain, eagle = Engine(none), Engine(bundles(weights))
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=32, stop_at_eos=False).output_ids
        assert eagle.generate(prompt, max_new_tokens=32, stop_at_eos=False).output_ids == want


def test_batch_rows_emit_what_each_would_alone(bundles):
    engine = Engine(bundles())
    rows = [PROMPTS[0][:7], PROMPTS[1], PROMPTS[2][:3]]
    batch = engine.generate_batch(rows, max_new_tokens=32, stop_at_eos=False)
    for row, result in zip(rows, batch, strict=True):
        assert result.output_ids == engine.generate(row, max_new_tokens=32, stop_at_eos=False).output_ids


def test_seeded_sampling_is_reproducible_and_stays_in_the_targets_support(bundles):
    model = build("llama")
    engine = Engine(bundles())
    assert engine.manifest["sampling"]["streams"] == 3
    kwargs = dict(max_new_tokens=32, stop_at_eos=False, temperature=0.8, top_k=5, seed=11)
    got = engine.generate(PROMPTS[0], **kwargs)
    assert engine.generate(PROMPTS[0], **kwargs).output_ids == got.output_ids
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0] + got.output_ids])).logits[0, len(PROMPTS[0]) - 1 : -1]
    top5 = logits.topk(5, dim=-1).indices
    assert all(tok in top5[i].tolist() for i, tok in enumerate(got.output_ids))


def test_writes_no_cache_slot_past_the_end(bundles):
    engine = Engine(bundles())
    result = engine.generate(list(range(1, 120)), max_new_tokens=200, stop_at_eos=False)
    assert result.stop_reason == "max_context"
    assert len(result.prompt_ids) + len(result.output_ids) + engine.extra_slots <= engine.max_context


def test_source_gguf_engine_equals_its_none_engine(tmp_path):
    """Q4_1 blocks run as stored: the drafter reads the quantised embedding table and LM head rows."""
    from tests.models.tiny_gguf import write_llama_gguf

    gguf = write_llama_gguf(tmp_path / "m.gguf", "Q4_1")
    drafter = random_drafter(gguf, tmp_path / "e.safetensors")
    engines = {}
    for method, own in (("none", {}), ("eagle", {"eagle": str(drafter), "num_draft": 3})):
        compile_model(CompileConfig.of(gguf, tmp_path / method, method, max_context=96, **own))
        engines[method] = Engine(tmp_path / method)
    weights = {m: dict(e.manifest["weights"]) for m, e in engines.items()}
    # the target's as stored; with native kernels only none's one-token calls take the lanes layout
    lanes = {m: w.pop("native_lanes", 0) for m, w in weights.items()}
    # and the final norm, whose output EAGLE's drafter reads too, stays a node in eagle's engine
    fused = {m: w.pop("native_fused", {}) for m, w in weights.items()}
    # eagle keeps pairs for its verify calls and the same codes again in lanes for one-token calls
    one_row = {m: (w.pop("native_one_row_lanes", 0), w.pop("native_one_row_bytes", 0)) for m, w in weights.items()}
    stored = {m: w.pop("block_bytes") for m, w in weights.items()}
    # the drafter embeds its drafts through the target's table: one more Gather of the same blocks
    # a draft step (K = 3), and no float copy of the table
    gathers = {m: w.pop("gathers") for m, w in weights.items()}
    # the drafter's cached attention is fused too, in each of its K runs (CachedAttention when native)
    attention = {m: w.pop("native_attention") for m, w in weights.items()}
    assert attention["eagle"] == attention["none"] + (3 if weights["none"]["kernels"] == "native" else 0)
    assert gathers == {"none": 1, "eagle": 4} and float_copies(tmp_path / "eagle") == []
    assert weights["eagle"] == weights["none"] and lanes["eagle"] == 0 and one_row["none"] == (0, 0)
    assert stored["eagle"] == stored["none"] + one_row["eagle"][1]
    # where AMX runs them every product is stored as digits (one layout for every call) instead
    digits = weights["none"].get("native_digits", 0)
    assert digits in (0, weights["none"]["matmuls"])
    if weights["none"]["kernels"] == "native" and not digits:
        assert one_row["eagle"][0] == weights["eagle"]["matmuls"]
    assert (lanes["none"] > 0) == (weights["none"]["kernels"] == "native" and not digits)
    if fused["none"]:
        assert fused["eagle"] == {**fused["none"], "norms": fused["none"]["norms"] - 1}
    own = engines["eagle"].manifest["eagle"]["weights"]
    assert own["weights"] == "int8" and own["kernels"] == weights["none"]["kernels"]  # the drafter's own blocks
    if own["kernels"] == "native":  # in float32, its norms, SwiGLU and residual adds folded in, per run
        assert own["activations"] == "float32"
        assert own["native_fused"] == {"norms": 2 * 3, "glus": 3, "residuals": 2 * 3}
    else:
        assert own["activations"] == "int8" and "native_fused" not in own
    for prompt in PROMPTS[:2]:
        want = engines["none"].generate(prompt, max_new_tokens=24, stop_at_eos=False).output_ids
        assert engines["eagle"].generate(prompt, max_new_tokens=24, stop_at_eos=False).output_ids == want


def test_a_float_drafter_is_exact_and_accepted_as_often(bundles, tiny_folder, trained, tmp_path):
    """--eagle-weights fp32 keeps the drafter's matrices float: still exact, and its drafts are
    accepted at least as often as the default int8 drafter's on these prompts."""
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "eagle", max_context=160, eagle=str(trained[1]),
                           num_draft=3, eagle_weights="fp32", adaptive=False)  # fmt: skip
    compile_model(cfg)
    float_engine, int8_engine = Engine(tmp_path / "b"), Engine(bundles())
    assert float_engine.manifest["eagle"]["weights"] == "float32"
    model = build("llama")
    taus = {"fp32": [], "int8": []}
    for prompt in PROMPTS:
        want = hf_greedy(model, prompt, NEW_TOKENS)
        for name, engine in (("fp32", float_engine), ("int8", int8_engine)):
            got = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
            assert_same_greedy(model, prompt, got.output_ids, want)
            taus[name].append(got.mean_accepted)
    assert sum(taus["fp32"]) >= 0.9 * sum(taus["int8"]), taus


def test_bad_options_are_refused(tiny_folder, tmp_path):
    for options, message in (({"eagle_weights": "int3"}, "--eagle-weights must be one of"),
                             ({"num_draft": 0}, "--num-draft must be between 1 and 16"),
                             ({"draft_vocab": -1}, "--draft-vocab must be 0")):  # fmt: skip
        with pytest.raises(InputError, match=message):
            CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "eagle", **options).check()


def test_a_drafter_for_another_model_is_refused(tiny_folder, tmp_path):
    other = random_drafter(tiny_folder("llama-v8"), tmp_path / "v8.safetensors")  # vocabulary 8
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "eagle", max_context=64, eagle=str(other))
    with pytest.raises(InputError, match="trained for a vocabulary of 8") as err:
        compile_model(cfg)
    assert "\n" not in str(err.value) and not (tmp_path / "b").exists()
    gemma = random_drafter(tiny_folder("gemma3"), tmp_path / "g.safetensors")
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "eagle", max_context=64, eagle=str(gemma))
    with pytest.raises(InputError, match="hidden size|vocabulary|another model"):
        compile_model(cfg)


def test_a_drafter_of_the_same_shape_for_another_model_is_refused(tiny_folder, tmp_path):
    from tests.models.tiny import save

    other = save("llama", tmp_path / "other", seed=7)  # same sizes, other weights: another fingerprint
    path = random_drafter(other, tmp_path / "e.safetensors")
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "eagle", max_context=64, eagle=str(path))
    with pytest.raises(InputError, match="trained for another model"):
        compile_model(cfg)


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", b"\x08\x00\x00\x00\x00\x00\x00\x00{}"])
def test_a_corrupt_drafter_file_is_one_line(tiny_folder, tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as err:
        load_drafter(path, 64, VOCAB)
    assert "\n" not in str(err.value)


def test_the_cli_refuses_a_missing_drafter_in_one_line(tiny_folder, tmp_path, capsys):
    from specgraph.cli import main

    folder = tiny_folder("llama")
    capsys.readouterr()  # what making the model printed
    code = main(["compile", str(folder), "--method", "eagle", "--eagle", str(tmp_path / "none.st"),
                 "--max-context", "64", "-o", str(tmp_path / "b")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "no such EAGLE drafter file" in err
    assert not (tmp_path / "b").exists()


def test_a_model_without_a_shipped_drafter_needs_one(tiny_folder, tmp_path):
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "eagle", max_context=64)
    with pytest.raises(InputError, match="needs --eagle"):
        compile_model(cfg)
