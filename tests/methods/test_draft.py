"""`--method draft`: a draft model (another one, or the target's own int4/int8 copy) proposes K
tokens inside the engine call; the output must be exactly the target's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specgraph.compiler import CompileConfig, compile_model
from specgraph.default_model import read_gguf
from specgraph.errors import InputError
from specgraph.methods.draft import DEAR_COPY, choose_draft_count
from specgraph.runtime import Engine
from tests.greedy import assert_same_greedy, hf_greedy
from tests.models.tiny import build, save

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 9, 5, 6],
    [17, 3, 99, 42, 200, 13, 77],
    list(range(30, 70)),
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, tiny_folder):
    """(draft, weights) -> a compiled draft bundle of the tiny Llama (and its none engine), drafting
    every round (not adaptive) so that every call verifies K drafts."""
    cache = {}

    def get(draft: str, weights: str = "fp32", num_draft: int = 3):
        key = (draft, weights, num_draft)
        if key not in cache:
            out = tmp_path_factory.mktemp("draft") / "bundle"
            cfg = CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=160, weights=weights,
                                   draft=draft, num_draft=num_draft, adaptive=False)  # fmt: skip
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
    assert engine.manifest["draft"]["bytes_share"] < DEAR_COPY  # a float32 target: the copy is far cheaper
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


def test_seeded_sampling_is_reproducible_and_stays_in_the_targets_support(bundles, other_llama):
    """Drafts are drawn from the draft's own q, so a seed fixes the text (not `none`'s text:
    only the law is the same, tests/test_sampling.py proves it); every token lies in the target's
    top-k given what precedes it, and some sampled drafts are accepted (the two random models'
    top-5 sets seldom meet, so not on every prompt)."""
    import torch

    model = build("llama")
    engine = Engine(bundles(str(other_llama)))
    assert engine.manifest["sampling"]["streams"] == 3 and engine.uniforms_width == 3 * (engine.max_context + 1)
    taus = []
    for prompt in PROMPTS[:2]:
        kwargs = dict(max_new_tokens=NEW_TOKENS, stop_at_eos=False, temperature=0.8, top_k=5, seed=11)
        got = engine.generate(prompt, **kwargs)
        assert engine.generate(prompt, **kwargs).output_ids == got.output_ids
        assert engine.generate(prompt, **{**kwargs, "seed": 12}).output_ids != got.output_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + got.output_ids])).logits[0, len(prompt) - 1 : -1]  # [N, V]
        top5 = logits.topk(5, dim=-1).indices
        assert all(tok in top5[i].tolist() for i, tok in enumerate(got.output_ids))
        taus.append(got.mean_accepted)
    assert max(taus) > 1.0, taus


def test_greedy_only_bundle_carries_no_proposals(tiny_folder, tmp_path, other_llama):
    """Without sampling the drafts are argmax tokens: no draft_q state, no uniforms, same text."""
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "draft", max_context=96, sampling=False,
                           draft=str(other_llama), num_draft=3)  # fmt: skip
    compile_model(cfg)
    engine = Engine(tmp_path / "b")
    names = {i.name for i in engine.session.get_inputs()}
    assert "draft_q" not in names and "uniforms" not in names and engine.manifest["sampling"] is None
    model = build("llama")
    result = engine.generate(PROMPTS[0], max_new_tokens=32, stop_at_eos=False)
    assert_same_greedy(model, PROMPTS[0], result.output_ids, hf_greedy(model, PROMPTS[0], 32))


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_cascade_equals_hf_greedy_and_sends_what_the_mid_model_agrees_with(adaptive, tiny_folder, tmp_path):
    """`--cascade self:int8`: the int4 copy makes K - 1 = 3 drafts, the int8 copy checks them in
    one run and sends the prefix it agrees with plus its own next token (`n_sent`, which trims
    next_tokens), up to K = 4. The output stays the target's. Adaptive with threshold 0 (every
    row drafts), the gated drafters' count passes through the `If` (0 in a call that skips them)."""
    out = tmp_path / "cascade"
    options = {"adaptive": True, "adaptive_threshold": 0.0} if adaptive else {"adaptive": False}
    compile_model(CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=160, draft="self:int4",
                                   cascade="self:int8", num_draft=4, **options))  # fmt: skip
    engine = Engine(out)
    section = engine.manifest["draft"]
    assert section["num_draft"] == 4 and section["cascade"]["drafter_steps"] == 3
    assert section["weights"]["weights"] == "int4" and section["cascade"]["weights"]["weights"] == "int8"
    # each copy's products read its own blocks: the two hold the target's bytes, never one shared weight
    assert section["cascade"]["weights"]["float32_bytes"] == section["weights"]["float32_bytes"] > 0
    assert engine.manifest["graph"]["trims"] == {"next_tokens": "n_sent"}
    model = build("llama")
    sent = []
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))
        sent += result.accepted_per_step[1:]
    assert max(sent) == 5  # the mid model's token after three agreed drafts, accepted with them and the bonus
    assert sum(sent) / len(sent) > 1.5


def test_batch_rows_accept_different_counts(bundles):
    engine = Engine(bundles("self:int4"))
    rows = [PROMPTS[0][:7], PROMPTS[1]]
    batch = engine.generate_batch(rows, max_new_tokens=32, stop_at_eos=False)
    for row, result in zip(rows, batch, strict=True):
        assert result.output_ids == engine.generate(row, max_new_tokens=32, stop_at_eos=False).output_ids


@pytest.mark.parametrize("kernels", ["auto", "ort"])
def test_a_self_draft_keeps_no_cache_and_a_call_that_skips_it_is_a_plain_step(tiny_folder, tiny_bundle, tmp_path,
                                                                              monkeypatch, kernels):  # fmt: skip
    """The target's own copy reads the target's keys and values of the committed tokens and
    writes its drafts' past them, where the next verify writes before anything reads: it keeps
    no cache of its own, so with `--adaptive` a call in which no row drafts (the gate's `If`)
    runs nothing of the drafter and fills nothing, and a later probe still reads every committed
    slot (the target's). A round must accept all K = 3 drafts to pay here (threshold 3), so the
    row soon stops and probes. The output stays the target's."""
    from tests.bundles import calls, idle_ops

    out = tmp_path / "adaptive"
    compile_model(CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=160, draft="self:int4",
                                   num_draft=3, adaptive=True, adaptive_threshold=3.0, kernels=kernels))  # fmt: skip
    engine = Engine(out)
    assert not [n for n in engine.manifest["graph"]["state"] if n.startswith("draft_past_")]
    assert engine.manifest["draft"]["adaptive"]["filled_caches"] == 0
    layers = engine.manifest["passes"]["fuse_cached_attention"]["fused_layers"]
    assert engine.manifest["passes"]["fuse_cached_attention"]["fused_draft_runs"] == 3 * layers > 0
    idle = idle_ops(out)
    assert "CopySlots" not in idle and "TensorScatter" not in idle
    prompt = PROMPTS[2]
    skipped, probes = 0, 0
    for result, _state in calls(engine, prompt, 40):
        drafts = int(result["n_draft"].numpy()[0])
        probes += drafts > 0 and skipped > 0  # a row that had stopped drafts again
        skipped += drafts == 0  # no row drafts next: the next call skips the drafter
    assert skipped >= 20 and probes >= 1  # most calls skipped the drafter, and a row drafted again after
    model = build("llama")
    result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))
    # bench's round line and the advisor's batch timings time this engine with its drafter running
    # (the rule would stop a row on the timing's random tokens, and the gate then skip the
    # drafter), the reference as it is
    from specgraph import bench
    from specgraph.advise import measure

    filled = []
    record = lambda e, *a, fill=None, **k: filled.append((e, fill)) or 1e-3  # noqa: E731
    monkeypatch.setattr(bench, "time_call", record)
    monkeypatch.setattr(measure, "time_call", record)
    reference = Engine(tiny_bundle("llama", "none"))
    bench.round_split(engine, reference, rounds=1)
    assert filled == [(engine, {"draft_score": 1e9}), (reference, None)]
    filled.clear()
    measure.call_times({"none": reference, "draft": engine}, {"none": 4, "draft": 4}, 32, [1, 2], 1, lambda: None)
    assert filled == [(reference, {}), (reference, {}), (engine, {"draft_score": 1e9}), (engine, {"draft_score": 1e9})]


def test_a_copy_as_dear_as_the_target_is_named_at_compile(tiny_folder, tmp_path):
    """A target already in blocks (here int4) with the int4 copy drafting: a draft run reads
    about what a plain step reads, so compile says drafting will seldom pay, and the gate (on by
    default) stops rows whose drafts do not pay; the output is still the target's own."""
    out = tmp_path / "b"
    report = compile_model(CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=96, weights="int4",
                                            draft="self:int4"))  # fmt: skip
    section = Engine(out).manifest["draft"]
    assert section["bytes_share"] >= DEAR_COPY and "adaptive" in section
    assert "drafting seldom pays" in report.details["summary"] and "--weights fp32" in report.details["summary"]


def test_a_call_stops_drafting_once_no_row_is_confident(tiny_folder, tmp_path, other_llama):
    """`--draft-confidence P`: the draft steps after draft i sit in an `If` (nested, one a step)
    that runs only while some row's joint drafter probability of drafts 1..i is at least P. The
    output is the target's whatever P is; ONNX Runtime's profile of a first call shows that with
    P near 1 none of the later steps' nodes ran, and with P near 0 they all did."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from specgraph.kernels import register, uses_native
    from specgraph.ops import STOP_DOMAIN
    from tests.bundles import with_initializer

    out = tmp_path / "confident"
    compile_model(CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=160, draft=str(other_llama),
                                   num_draft=3, draft_confidence=0.3))  # fmt: skip
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert STOP_DOMAIN not in {n.domain for n in model.graph.node} | {o.domain for o in model.opset_import}
    (first,) = [n for n in model.graph.node if n.name.startswith("draft_stop")]
    then = {a.name: a.g for a in first.attribute}["then_branch"]
    (second,) = [n for n in then.node if n.name.startswith("draft_stop")]
    assert (first.name, second.name) == ("draft_stop_1", "draft_stop_2")
    assert Engine(out).manifest["draft"]["stop_nodes"][0] > len(then.node) > 20  # the second step's run
    later = {n.name for n in then.node if n.op_type in ("Gemm", "CachedAttention", "GroupQueryAttention")}
    target = build("llama")
    ran = {}
    for p in (0.3, 1e-12, 0.999999):
        bundle = out if p == 0.3 else tmp_path / f"p{p}"
        if p != 0.3:  # the same engine with another confidence (an initializer)
            with_initializer(out, bundle, "draft_log_confidence", np.log(np.asarray([p], np.float32)))
        engine = Engine(bundle)
        for prompt in PROMPTS:
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
            assert_same_greedy(target, prompt, result.output_ids, hf_greedy(target, prompt, NEW_TOKENS))
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / f"profile-{p}")
        if uses_native(engine.manifest):
            register(options, engine.bundle)
        engine.session = ort.InferenceSession(str(bundle / "model.onnx"), options)
        feeds = engine.first_feeds(np.asarray([PROMPTS[1]], np.int64), len(PROMPTS[1]), 0)
        first_call = engine.call(engine.session.io_binding(), feeds, engine.new_state(1))
        events = json.loads(Path(engine.session.end_profiling()).read_text())
        ran[p] = {e["name"].removesuffix("_kernel_time") for e in events if e.get("cat") == "Node"} & later
        if p == 0.999999:  # stopping leaves padding after the first draft, and sends no draft
            assert first_call["next_tokens"].numpy()[0, 2:].tolist() == [0, 0]
            assert first_call["n_draft"].numpy().tolist() == [0]
    assert ran[1e-12] == later and not ran[0.999999], ran


@pytest.mark.parametrize(("draft", "options"), [("self:int4", {}), ("self:int4", {"draft_confidence": 1e-9}),
                                               ("self:int4", {"adaptive": True, "adaptive_threshold": 1.5}), ("other", {})],
                         ids=["self", "self-stopping", "self-gated", "own-cache"])  # fmt: skip
def test_later_draft_runs_write_their_cache_in_place(draft, options, tiny_folder, tmp_path, other_llama, monkeypatch):
    """With the kernel library, a drafter's runs after the first on a cache (a self-draft's on
    the target's, after the verify; another model's steps on its own, after its catch-up) write
    their keys and values into the first run's output instead of copying the cache's used slots
    into a buffer of their own (exporters/attention.py), also inside the stop's and the gate's
    `If`s. Every call's next tokens (the drafts) equal those of the same engine built with the
    copying runs (the gate's threshold given: a measured one differs from build to build)."""
    import onnx

    from specgraph.exporters import attention
    from specgraph.kernels import library_path
    from tests.bundles import calls

    if library_path() is None:
        pytest.skip("needs the kernel library (sh scripts/install.sh builds it)")

    def runs(path: Path) -> list[int]:  # outputs of each CachedAttention node, subgraphs included
        def walk(graph):  # type: ignore[no-untyped-def]
            for n in graph.node:
                yield n
                for a in n.attribute:
                    yield from walk(a.g) if a.HasField("g") else ()

        model = onnx.load(str(path / "model.onnx"), load_external_data=False)
        return [len(n.output) for n in walk(model.graph) if n.op_type == "CachedAttention"]

    def drafts(out: Path) -> list[list[list[int]]]:
        compile_model(CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=160, num_draft=3,
                                       draft=str(other_llama) if draft == "other" else draft,
                                       **{"adaptive": False, **options}))  # fmt: skip
        return [result["next_tokens"].numpy().tolist() for result, _state in calls(Engine(out), PROMPTS[1], 24)]

    in_place = drafts(tmp_path / "in_place")
    # a layer of the tiny Llama's 2: a self-draft's catch-up and 2 steps after the verify, another
    # model's 2 steps after its catch-up
    assert runs(tmp_path / "in_place").count(1) == 2 * (2 if draft == "other" else 3)
    monkeypatch.setattr(attention, "_later_runs_in_place", lambda graph: 0)
    assert drafts(tmp_path / "copying") == in_place
    assert 1 not in runs(tmp_path / "copying")


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
        ({"cascade": "self:int4"}, "a cascade is two of the target's own copies"),
        ({"cascade": "self:int8", "draft": "self:int8"}, "a cascade is two of the target's own copies"),
        ({"cascade": "self:int8", "num_draft": 1}, "--cascade needs --num-draft 2 or more"),
        ({"cascade": "self:int8", "num_draft": "auto"}, "--cascade takes a fixed --num-draft"),
        ({"cascade": "self:int8", "draft_confidence": 0.5}, "--cascade takes a fixed --num-draft"),
    ],
)
def test_bad_options_are_refused(tiny_folder, tmp_path, options, message):
    with pytest.raises(InputError, match=message):
        CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "draft", **options).check()


def test_a_block_size_that_does_not_divide_the_copy_is_refused_before_anything_is_written(tiny_folder, tmp_path):
    # the tiny llama's matrices read 64 or 128 inputs: 128-weight blocks fit only some of them, and
    # a copy left partly in float32 would cost what the user meant to save
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "draft", max_context=64, draft="self:int4",
                           draft_block_size=128)  # fmt: skip
    with pytest.raises(InputError) as err:
        compile_model(cfg)
    assert "\n" not in str(err.value) and str(err.value).startswith("--draft-block-size 128 does not divide")
    assert not (tmp_path / "b").exists()


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


def test_a_reduced_draft_vocabulary_is_lossless_and_proposes_only_its_tokens(tiny_folder, tmp_path):
    """`--draft-vocab 64`: the draft's readout scores 64 ranked ids; greedy output still equals HF,
    every draft (greedy or sampled) is one of the ids, and the carried q is a distribution that is
    zero outside them when sampling, and zero when greedy."""
    import numpy as np

    from tests.test_medusa import _ranking

    path, ranked = _ranking(tmp_path)
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "draft", max_context=160, draft="self:int8",
                           num_draft=3, draft_vocab=64, draft_vocab_file=str(path), adaptive=False)  # fmt: skip
    compile_model(cfg)
    engine = Engine(tmp_path / "b")
    ids = sorted(int(i) for i in ranked[:64])
    assert engine.manifest["draft"]["draft_vocab"]["ids"] == ids
    model = build("llama")
    for prompt in PROMPTS:
        got = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert_same_greedy(model, prompt, got.output_ids, hf_greedy(model, prompt, NEW_TOKENS))
    from specgraph.sampling import SamplingParams

    for params in (None, SamplingParams(0.9, 0, 1.0, seed=5)):
        state = engine.new_state(1, params)
        feeds = engine.first_feeds(np.asarray([PROMPTS[2]], np.int64), len(PROMPTS[2]), 0)
        out = engine.call(engine.session.io_binding(), feeds, state)
        assert set(out["next_tokens"].numpy()[0, 1:].tolist()) <= set(ids)
        q = out["draft_q_out"].numpy()[0]  # [K, V]; a greedy row carries q = 0 (the rule ignores it)
        assert np.allclose(q.sum(-1), 0 if params is None else 1, atol=1e-5)
        assert not q[:, np.setdiff1d(np.arange(q.shape[1]), ids)].any()


def test_num_draft_auto_measures_then_builds_the_k_it_predicts_fastest(tiny_folder, tmp_path):
    """`--num-draft auto`: the first build (K = 6 for draft, gated) generates the calibration prompts and
    times the engine; the bundle is then built again with the K of the best predicted speed-up,
    with the run-time gate (on by default), and it is still exactly the target."""
    prompts = tmp_path / "calibration.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "auto"
    cfg = CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=160, weights="fp32", draft="self:int8",
                           num_draft="auto", auto_prompts=str(prompts))  # fmt: skip
    report = compile_model(cfg)
    engine = Engine(out)
    section = engine.manifest["draft"]
    auto, k = section["auto"], section["num_draft"]
    assert [row["k"] for row in auto["table"]] == [1, 2, 3, 4, 5, 6]  # DraftOptions.auto_longest
    assert auto["chosen"] == k == max(auto["table"], key=lambda row: row["speedup"])["k"]
    assert engine.manifest["draft_depth"] == k and section["adaptive"]["threshold"] >= 0
    assert auto["rounds"] > 0 and all(0 <= a <= 1 for a in auto["acceptance_by_depth"])
    assert "--num-draft auto" in report.details["summary"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto", "calibration.jsonl"]  # no staging left behind
    model = build("llama")
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))


def test_choose_draft_count_weighs_acceptance_against_the_measured_round():
    ms = 1e-3
    rounds = {1: 30 * ms, 2: 31 * ms, 3: 32 * ms, 4: 33 * ms, 5: 34 * ms}  # every call runs 4 draft runs of 5 ms
    report = choose_draft_count([0.9, 0.8, 0.5, 0.2], rounds, 10 * ms, 4)
    costs = [row["round_ms"] for row in report["table"]]
    assert costs == pytest.approx([16, 22, 28, 34]) and report["draft_run_ms"] == pytest.approx(5)
    assert [row["tau"] for row in report["table"]] == pytest.approx([1.9, 2.62, 2.98, 3.052])
    assert report["chosen"] == 2 and report["predicted_speedup"] == pytest.approx(2.62 * 10 / 22, abs=1e-4)
    # a drafter that does not pay anywhere: the cheapest loss is kept, and reported below 1
    poor = choose_draft_count([0.1, 0.1, 0.1, 0.1], rounds, 10 * ms, 4)
    assert poor["chosen"] == 1 and poor["predicted_speedup"] < 1


def _drafting_calls(accepts: list[int], threshold: float = 0.8, prior: float = 1.0) -> list[int]:
    """The calls (0 = the prompt's) of one adaptive row (K = 1) that verify a draft, when the
    i-th of them after the prompt's accepts `accepts[i]` drafts (0 once they run out). The
    prompt's call counts as a round that accepted `prior` drafts (every draft by default)."""
    from types import SimpleNamespace

    from specgraph.methods.draft import ModelDrafts

    row = SimpleNamespace(num_draft=1, draft_threshold=torch.tensor([threshold]), draft_prior=torch.tensor([prior]))
    state = [torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]
    calls, width, accepts, at = [], 5, list(accepts), 0
    for call in range(400):
        if width > 1:
            calls.append(call)
        accepted = 1 if call == 0 else (accepts.pop(0) if accepts else 0) if width > 1 else 0
        *state, n_draft = ModelDrafts._adapt(row, state, torch.zeros(1, width, dtype=torch.int64),
                                             torch.tensor([at]), torch.tensor([at + 1 + accepted]))  # fmt: skip
        width, at = 1 + int(n_draft[0]), at + 1 + accepted
    return calls


def test_probes_wait_twice_as_long_after_each_that_does_not_pay():
    """`--adaptive`: a row whose drafts stop paying stops drafting, probes after PROBE_EVERY rounds,
    then after twice as many after each probe whose loss is more than PROBE_BUDGET of the rounds
    it waited (here a drafting round costs 1.8 steps: threshold 0.8), up to PROBE_MAX_WAIT; a
    probe that pays brings the short wait back; where a round costs little more than a step, the
    wait grows only until the probes' share is within the budget, or never."""
    from specgraph.methods.draft import PROBE_EVERY, PROBE_MAX_WAIT

    calls = _drafting_calls([])  # nothing is accepted after the prompt's call
    gaps = [b - a for a, b in zip(calls[1:], calls[2:], strict=False)]
    assert calls[:2] == [0, 1]  # the prompt's round paid: the first decode call drafts, then it stops
    assert gaps[:5] == [PROBE_EVERY + 1, 2 * PROBE_EVERY + 1, 4 * PROBE_EVERY + 1, PROBE_MAX_WAIT + 1,
                        PROBE_MAX_WAIT + 1]  # fmt: skip
    # the fifth probe accepts its draft (its score stays below 0), the next ones do not: the wait
    # starts again from PROBE_EVERY
    calls = _drafting_calls([0, 0, 0, 0, 0, 1])
    gaps = [b - a for a, b in zip(calls[1:], calls[2:], strict=False)]
    assert gaps[4:7] == [PROBE_MAX_WAIT + 1, PROBE_EVERY + 1, 2 * PROBE_EVERY + 1]
    # a probe that brings the score back to 0 or above drafts again at once
    calls = _drafting_calls([0, 1], threshold=0.6)
    assert [b - a for a, b in zip(calls[1:], calls[2:], strict=False)][:2] == [PROBE_EVERY + 1, 1]
    # a round of 1.38 steps (Medusa's chain at the stored weights): 0.38 lost a probe, within 2% of 32 rounds
    calls = _drafting_calls([], threshold=0.38)
    gaps = [b - a for a, b in zip(calls[1:], calls[2:], strict=False)]
    assert gaps[:5] == [1, PROBE_EVERY + 1, 2 * PROBE_EVERY + 1, 4 * PROBE_EVERY + 1, 4 * PROBE_EVERY + 1]
    # cheap probes (a drafting round costs 1.15 steps, an fp32 target) never wait longer
    calls = _drafting_calls([], threshold=0.15)
    gaps = [b - a for a, b in zip(calls[1:], calls[2:], strict=False)]
    assert gaps[:4] == [1, 1, 1, 1] and set(gaps[4:]) == {PROBE_EVERY + 1}  # (its score stays above 0 4 rounds longer)


def test_a_row_never_probes_where_no_round_could_pay():
    """A measured threshold above K (the default model's int4 copy at its stored weights: a round
    of 2.16 steps returning at most 2 tokens) means no round pays even with every draft accepted,
    so a stopped row never probes; at a threshold of exactly K it still does."""
    from specgraph.methods.draft import PROBE_EVERY

    assert _drafting_calls([], threshold=1.16) == [0]
    assert _drafting_calls([1] * 10, threshold=1.16) == [0]
    calls = _drafting_calls([], threshold=1.0)
    assert calls[:2] == [0, 1] and calls[2] - calls[1] == PROBE_EVERY + 1 and len(calls) > 4


def test_a_threshold_above_k_stops_the_engines_probes(tiny_folder, tmp_path):
    """The engine reads whether a round can pay from its threshold at run time (`finish` writes
    the measured one after the export, which must not fold the comparison with the placeholder):
    with a threshold above K no call drafts after the prompt's; at K a stopped row probes."""
    import numpy as np

    from specgraph.exporters.onnx import set_initializer

    out = tmp_path / "b"
    compile_model(CompileConfig.of(tiny_folder("llama"), out, "draft", max_context=160, draft="self:int4",
                                   num_draft=1, adaptive=True, adaptive_threshold=1.0))  # fmt: skip

    def drafting_calls() -> list[int]:
        engine = Engine(out, verify=False)
        state, io = engine.new_state(1), engine.session.io_binding()
        feeds = engine.first_feeds(np.asarray([PROMPTS[2]], np.int64), [len(PROMPTS[2])], 0)
        drafting = []
        for call in range(30):
            result = engine.call(io, feeds, state)
            if int(result["n_draft"].numpy()[0]):
                drafting.append(call + 1)
            feeds = engine.next_feeds(result)
        return drafting

    assert drafting_calls()  # threshold K: probes (and rows that pay) draft
    set_initializer(out / "model.onnx", "draft_threshold", np.array([1.5], np.float32))
    assert drafting_calls() == []


def test_a_row_starts_stopped_where_the_drafter_is_not_expected_to_pay():
    """`--adaptive` with a drafter whose trained acceptance (the prompt's round, `draft_prior`) is
    below the threshold: the first decode call does not draft; the row's first draft is a probe
    after PROBE_EVERY rounds. Above the threshold it drafts at once, as with the default prior K."""
    from specgraph.methods.draft import PROBE_EVERY, trained_accepted

    assert _drafting_calls([], threshold=0.8, prior=0.49)[:2] == [0, PROBE_EVERY + 1]
    assert _drafting_calls([], threshold=0.13, prior=0.49)[:2] == [0, 1]
    # the prior of a K-draft round: the best held-out set's a1 (1 + a2 + ...), one rate for early exit
    assert trained_accepted({"chat": [0.4, 0.5], "code": [0.5, 0.2]}, 2) == pytest.approx(0.6)
    assert trained_accepted({"chat": 0.5}, 3) == pytest.approx(0.875) and trained_accepted(None, 2) is None
    # Medusa's heads: one rate per depth, the last kept further down
    assert trained_accepted({"chat": [0.5, 0.4, 0.2]}, 4) == pytest.approx(0.5 + 0.2 + 0.04 + 0.008)


def test_a_row_whose_drafts_pay_on_average_drafts_through_runs_of_rejections():
    """`--adaptive` with a cheap round (an fp32 target: threshold 0.13) and one draft in five
    accepted, in runs of four rejections: drafting pays on average (0.2 > 0.13), and the row's
    score, which weighs its past rounds by ADAPT_DECAY, stays at 0 or above, so it drafts every
    round (with a shorter memory it stopped after each run and waited PROBE_EVERY rounds)."""
    calls = _drafting_calls([1, 0, 0, 0, 0] * 20, threshold=0.13)
    assert calls[:100] == list(range(100))


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [
        ("lookup", {"num_draft": "auto"}, "--num-draft auto is for draft, eagle and early-exit"),
        ("draft", {"num_draft": "many"}, "--num-draft must be a number from 1 to 16 or auto"),
        ("draft", {"num_draft": "auto", "auto_prompts": " , "}, "--auto-prompts needs at least one prompt set"),
        ("draft", {"num_draft": "auto", "adaptive": False, "adaptive_threshold": 1.0}, "--adaptive-threshold needs"),
        ("eagle", {"draft_confidence": 0.3, "adaptive_threshold": 1.0}, "--adaptive-threshold needs the adaptive gate"),
        ("draft", {"num_draft": "auto", "auto_prompts": "chat,nowhere.jsonl"}, "no such prompt file: nowhere.jsonl"),
        (
            "eagle",
            {"num_draft": "auto", "adaptive": True, "adaptive_threshold": 5.0},
            r"between 0 and --num-draft \(4\)",
        ),
        ("eagle", {"draft_confidence": 0.0}, r"--draft-confidence must be between 0 and 1 \(exclusive\)"),
        ("draft", {"draft_confidence": 1.5}, r"--draft-confidence must be between 0 and 1 \(exclusive\)"),
        ("eagle", {"draft_confidence": 0.3, "adaptive": True}, "cannot be combined with --adaptive"),
        ("early-exit", {"draft_confidence": 0.3, "num_draft": "auto"}, "cannot be combined with --adaptive"),
    ],
)
def test_bad_draft_counts_are_refused(tiny_folder, tmp_path, method, options, message):
    with pytest.raises(InputError, match=message):
        CompileConfig.of(tiny_folder("llama"), tmp_path / "b", method, **options).check()


@pytest.mark.parametrize(("draft", "kernels", "kept"), [("self:int4", "auto", 8), ("self:int4", "ort", 8),
                                                       ("self:int8", "auto", 9)])  # fmt: skip
def test_the_copy_keeps_the_blocks_the_model_file_stores(draft, kernels, kept, tmp_path):
    """A GGUF's float32 weights are its blocks dequantised: a copy keeps every matrix stored in
    blocks of at most its width (not a requantisation onto another grid): the int4 copy the Q4_1
    matrices, requantising the Q8_0 table to int4; the int8 copy both. A float model has nothing stored."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specgraph.gguf_table import tensor_table
    from specgraph.methods.draft import stored_blocks, stored_index
    from tests.models.tiny_gguf import write_llama_gguf

    path = write_llama_gguf(tmp_path / "q41.gguf", "Q4_1", "Q8_0")
    tables = {t.name: t for t in tensor_table(path)}
    stored = {}
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        t = tables[name]
        cols, rows = t.shape
        stored[name] = (t.data, dequantize(t.data, GGMLQuantizationType[t.type_name]).reshape(rows, cols))
    index = stored_index(str(path))
    int4, int8 = stored_blocks(index, 4, 32), stored_blocks(index, 8, 32)
    data, down = stored["blk.0.ffn_down.weight"]
    runs = int4(down)
    assert runs is not None and [r.format for r in runs] == ["Q4_1"]
    assert np.array_equal(np.concatenate([r.dequantize() for r in runs]), down)
    assert [r.format for r in int8(down)] == ["Q4_1"] and stored_blocks(index, 4, 64)(down) is None
    table = stored["token_embd.weight"][1]
    assert int4(table) is None and [r.format for r in int8(table)] == ["Q8_0"]
    assert int4(down + 1e-3) is None  # values no stored row has

    out = tmp_path / "b"
    compile_model(CompileConfig.of(str(path), out, "draft", max_context=160, weights="fp32", draft=draft,
                                   num_draft=3, adaptive=False, kernels=kernels))  # fmt: skip
    engine = Engine(out)
    copy = engine.manifest["draft"]["weights"]
    assert kernels != "ort" or copy["kernels"] == "ort"  # ONNX Runtime's MatMulNBits takes Q4_1's offsets too
    assert copy["stored_blocks"] == kept  # 2 layers' Q/K/V, output, gate/up and down products (and the tied table)
    model, _tok = read_gguf(path)
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))


def test_a_float_model_has_no_stored_blocks_to_keep(bundles):
    assert Engine(bundles("self:int4")).manifest["draft"]["weights"]["stored_blocks"] == 0
