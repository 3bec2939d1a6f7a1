"""specgraph.advise: its arithmetic on synthetic measurements with known answers, a whole run on
the tiny models (structure, losslessness of every measured cell), and one-line errors on bad input.

Timings on a shared CPU are noisy, so nothing here asserts a measured speed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from specgraph.advise import Settings, run_advise
from specgraph.advise import predict as p
from specgraph.advise.auto import compile_auto, pick
from specgraph.advise.bundles import parse_methods, resolve
from specgraph.advise.report import format_report
from specgraph.cli import main
from specgraph.errors import InputError
from specgraph.runtime import Engine
from tests.test_outputs import one_line_error


def _cal(lengths: list[int], per_call: int, step_s: float = 1.0, prefill_s: float = 0.0) -> p.Calibration:
    """Traces of prompts that emit `per_call` tokens every call (the last call what is left)."""
    traces = []
    for n in lengths:
        left, counts = n - 1, []
        while left > 0:
            counts.append(min(per_call, left))
            left -= counts[-1]
        traces.append(p.Trace(n, tuple(counts), prefill_s, len(counts) * step_s))
    return p.Calibration(traces)


# --- the arithmetic ------------------------------------------------------------------------------


def test_calls_for_reads_the_trace_and_stops_where_it_ends():
    assert p.calls_for([3, 1, 2], 0) == 0
    assert p.calls_for([3, 1, 2], 3) == 1
    assert p.calls_for([3, 1, 2], 4) == 2
    assert p.calls_for([3, 1, 2], 5) == 3
    assert p.calls_for([3, 1, 2], 50) == 3  # the row stopped (EOS): all its calls


def test_calibration_pools_tau_and_step_time():
    cal = _cal([65, 33], per_call=4, step_s=0.5)
    assert cal.tau == pytest.approx((64 + 32) / (16 + 8))
    assert cal.step_s == pytest.approx(0.5)


def test_speedup_at_batch_1_is_tau_over_the_cost_ratio():
    none, method = _cal([65] * 3, 1), _cal([65] * 3, 2)
    # 64 tokens: 64 plain calls at 1 s against 32 calls at 1.5 s
    assert p.speedup(none, method, 1.0, 1.5) == pytest.approx(64 / (32 * 1.5))
    assert p.break_even_tau(1.0, 1.5) == 1.5


def test_a_batch_waits_for_its_slowest_row():
    # half the prompts accept 4 per call, half accept nothing: a batch of 2 with one slow row
    # costs as many calls as plain decoding
    none = _cal([33, 33], 1)
    method = p.Calibration([_cal([33], 4).traces[0], _cal([33], 1).traces[0]])
    alone = p.speedup(none, method, 1.0, 1.0, batch=1)
    assert alone == pytest.approx((32 + 32) / (8 + 32))
    batches = p.groups(2, 2)
    mixed = sum(len(set(g)) == 2 for g in batches)  # groups holding the slow row cost 32 calls; (0, 0) costs 8
    slow = sum(1 in g for g in batches)
    expected = (32 * len(batches)) / (32 * slow + 8 * (len(batches) - slow))
    assert mixed > 0
    assert p.speedup(none, method, 1.0, 1.0, batch=2) == pytest.approx(expected)
    assert p.speedup(none, method, 1.0, 1.0, batch=2) < alone


def test_identical_prompts_predict_the_same_speedup_at_every_batch_for_equal_costs():
    none, method = _cal([41] * 4, 1), _cal([41] * 4, 3)
    for batch in (1, 2, 8):
        assert p.speedup(none, method, 2.0, 3.0, batch) == pytest.approx(40 / (math.ceil(40 / 3) * 1.5))


def test_scaled_step_time_follows_the_timed_ratio_from_the_nearest_measured_batch():
    timed = {1: 0.010, 2: 0.014, 4: 0.025, 8: 0.050}
    assert p.scaled_step_s({1: 0.02}, timed, 4) == pytest.approx(0.05)
    measured = {1: 0.02, 4: 0.06}  # at batch 4 the calls were wider than the 1-row mean suggests
    assert p.scaled_step_s(measured, timed, 2) == pytest.approx(0.028)
    assert p.scaled_step_s(measured, timed, 4) == pytest.approx(0.06)
    assert p.scaled_step_s(measured, timed, 8) == pytest.approx(0.12)


def test_prefill_makes_short_replies_not_pay():
    # the method's prefill costs 6 plain steps more; it saves half the calls after it
    none, method = _cal([65] * 2, 1, prefill_s=2.0), _cal([65] * 2, 2, prefill_s=8.0)
    curve = {r: p.speedup(none, method, 1.0, 1.0, 1, reply=r, prefill=True) for r in (2, 4, 8, 16, 32, 64)}
    for r, value in curve.items():
        assert value == pytest.approx((2 + (r - 1)) / (8 + math.ceil((r - 1) / 2)))
    assert curve[8] < 1.0 < curve[32]
    assert p.first_at_least(curve) == 16  # 17 / 16: from 16 tokens on it pays


def test_crossover_finders():
    assert p.first_below({1: 1.4, 2: 1.2, 4: 0.9, 8: 0.7}) == 4
    assert p.first_below({1: 1.4, 2: 0.9, 4: 1.1, 8: 0.7}) == 8  # from where it stays below
    assert p.first_below({1: 1.4, 2: 1.2}) is None
    assert p.first_at_least({2: 0.5, 4: 1.0, 8: 1.2}) == 4
    assert p.first_at_least({2: 0.5, 4: 0.9}) is None


def test_recommend_picks_the_best_or_none():
    assert p.recommend({"lookup": 1.3, "medusa": 1.1}) == "lookup"
    assert p.recommend({"lookup": 0.97, "medusa": 0.8}) == "none"
    assert p.recommend({}) == "none"
    assert p.relative_error(1.1, 1.0) == pytest.approx(0.1)


def test_groups_are_seeded_and_cover_batch_1_exactly():
    assert p.groups(3, 1) == [[0], [1], [2]]
    assert p.groups(5, 4) == p.groups(5, 4)
    assert all(len(g) == 4 for g in p.groups(5, 4))


# --- a whole run on the tiny models --------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [17, 3, 99, 42, 200, 13, 77], list(range(30, 60)), [9, 8, 7, 9, 8, 7, 9]]


@pytest.fixture
def ids_file(tmp_path: Path) -> Path:
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in PROMPTS))
    return path


def test_run_advise_on_the_tiny_models(tiny_bundle, ids_file):
    bundles = [tiny_bundle("llama", "none"), tiny_bundle("llama", "lookup")]
    report = run_advise(bundles, Settings([str(ids_file)], [2, 1], max_new_tokens=8, threads=1, repeats=2),
                        progress=False)  # fmt: skip
    result = report["sets"][str(ids_file)]
    assert (result["calibration_prompts"], result["held_out_prompts"]) == (2, 2)
    assert [(c["method"], c["batch"]) for c in result["cells"]] == [("lookup", 1), ("lookup", 2)]
    for cell in result["cells"]:
        assert cell["first_difference"] is None  # lossless on every held-out row, batched too
        assert cell["predicted"] > 0 and cell["measured"] > 0
        # predicted and measured are rounded to 4 decimals: the ratio's rounding grows as 1/measured^2
        p, m = cell["predicted"], cell["measured"]
        assert abs(cell["error"] - (p / m - 1)) <= 1e-4 * (1 + 1 / m + p / m**2)
    assert set(result["batch_curve"]["lookup"]) == {1, 2, 4, 8, 16, 32}
    assert set(result["reply_curve"]["lookup"]) == {2, 4, 8}
    assert result["reply_measured"]["method"] == "lookup"
    assert result["methods"]["none"]["width"] == 1 and result["methods"]["lookup"]["width"] == 6
    assert [r["batch"] for r in report["recommendations"]] == [1, 2]
    assert all(r["method"] in ("none", "lookup") and r["reason"] for r in report["recommendations"])
    memory = report["memory"]
    assert memory["lookup"]["state_mb_per_row"] > 0 and memory["none"]["extra_mb"] == 0
    assert report["accuracy"]["cells"] == 2
    text = format_report(report)
    assert "recommendation for" in text and "predicted" in text
    json.dumps(report)  # JSON-ready


def test_advise_cli_writes_json_and_plot(tiny_bundle, ids_file, tmp_path, capsys):
    out, plot = tmp_path / "advice.json", tmp_path / "advice.png"
    argv = ["advise", str(tiny_bundle("llama", "none")), str(tiny_bundle("llama", "lookup")), "--prompts",
            str(ids_file), "--batch", "1", "--max-new-tokens", "6", "--threads", "1", "--json", str(out),
            "--plot", str(plot)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["advice"] == 1
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert main(argv) == 0  # both are ours now: replaced without --force
    assert "recommendation for" in capsys.readouterr().out


# --- bad input -----------------------------------------------------------------------------------


@pytest.fixture
def pair(tiny_bundle, capsys) -> list[str]:
    """The tiny none and lookup bundles, built before a test reads stderr (building prints)."""
    bundles = [
        str(tiny_bundle("llama", "none")),
        str(tiny_bundle("llama", "lookup")),
        str(tiny_bundle("qwen2", "lookup")),
    ]
    capsys.readouterr()
    return bundles


def _advise(pair: list[str], *extra: str) -> list[str]:
    return ["advise", *pair[:2], *extra]


@pytest.mark.parametrize("content, needle", [("", "holds no prompts"), ("{not json\n", "not a JSON object")])
def test_bad_prompt_files(pair, tmp_path, capsys, content, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    one_line_error(capsys, _advise(pair, "--prompts", str(bad)), needle, within=None)


def test_one_prompt_is_too_few(pair, tmp_path, capsys):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    one_line_error(capsys, _advise(pair, "--prompts", str(one)), "at least 2 prompts", within=None)


def test_unknown_method_and_bad_batches(pair, ids_file, capsys):
    one_line_error(capsys, _advise(pair, "--prompts", str(ids_file), "--methods", "lookup,nonsense"),
                   "unknown method 'nonsense'")  # fmt: skip
    one_line_error(capsys, _advise(pair, "--prompts", str(ids_file), "--batch", "1,65"), "1 to 64")
    one_line_error(capsys, _advise(pair, "--prompts", str(ids_file), "--batch", "0"), "1 to 64")
    one_line_error(capsys, _advise(pair, "--prompts", str(ids_file), "--batch", "four"), "integers")
    one_line_error(capsys, _advise(pair, "--prompts", str(ids_file), "--methods", "medusa"),
                   "no bundle for method medusa")  # fmt: skip


def test_a_bundle_of_another_model(pair, ids_file, capsys):
    argv = ["advise", pair[0], pair[2], "--prompts", str(ids_file)]
    one_line_error(capsys, argv, "another model", within=None)


def test_no_none_bundle_and_none_alone(pair, ids_file, capsys):
    one_line_error(capsys, ["advise", pair[1], "--prompts", str(ids_file)], "no `none` bundle", within=None)
    one_line_error(capsys, ["advise", pair[0], "--prompts", str(ids_file)], "only a `none` bundle", within=None)


def test_parse_methods_and_resolve_compiles_only_what_is_missing(tmp_path, tiny_bundle):
    assert parse_methods(None) is None
    assert parse_methods("lookup,none,lookup") == ["lookup"]
    with pytest.raises(InputError, match="only none"):
        parse_methods("none")
    made: list[tuple[str, str, Path, dict]] = []
    given = tiny_bundle("llama", "none")
    bundles = resolve(["model-x", str(given)], ["lookup"], tmp_path / "b", lambda *a: made.append(a))
    assert bundles == [given, tmp_path / "b" / "lookup"]
    assert [m for _, m, _, _ in made] == ["lookup"]  # none was given: only lookup is compiled
    resolve(["model-x"], None, tmp_path / "c", lambda *a: made.append(a))
    assert [(m, o) for _, m, _, o in made[1:]] == [("none", {}), ("lookup", {}), ("medusa", {})]
    with pytest.raises(InputError, match="one model"):
        resolve(["a", "b"], None, tmp_path, lambda *a: None)
    with pytest.raises(InputError, match="--draft MODEL"):
        resolve(["model-x"], ["draft"], tmp_path, lambda *a: None)


# --- compile --method auto -----------------------------------------------------------------------


def test_pick_takes_the_best_geometric_mean_of_measured_speedups():
    def report(cells: list[tuple[str, str, int, float]]) -> dict:
        sets: dict = {}
        for name, method, batch, measured in cells:
            sets.setdefault(name, {"cells": []})["cells"].append(
                {"method": method, "batch": batch, "measured": measured}
            )
        return {"sets": sets}

    # lookup gains 1.5x on code but loses 0.6x on chat (geomean 0.95): medusa's 1.05 and 1.0 win
    cells = [("code", "lookup", 1, 1.5), ("chat", "lookup", 1, 0.6), ("code", "medusa", 1, 1.05),
             ("chat", "medusa", 1, 1.0), ("code", "lookup", 4, 9.0)]  # fmt: skip
    assert pick(report(cells)) == "medusa"
    assert pick(report([("chat", "lookup", 1, 0.9), ("chat", "medusa", 1, 0.8)])) == "none"


def test_compile_auto_compiles_the_candidates_and_keeps_the_fastest(tiny_folder, ids_file, tmp_path):
    from specgraph.compiler import CompileConfig, compile_model

    made: list[str] = []

    def compile_one(model: str, method: str, path: Path, options: dict) -> None:
        made.append(method)
        compile_model(CompileConfig.of(model, path, method, **options))

    settings = Settings([str(ids_file)], [1], max_new_tokens=6, threads=1, repeats=1)
    out, candidates = tmp_path / "engine", tmp_path / "candidates"
    method, report = compile_auto(str(tiny_folder("llama")), out, candidates, settings, compile_one,
                                  {"max_context": 160}, progress=False)  # fmt: skip
    assert made == ["none", "lookup", "medusa"]
    assert "--heads" in report["skipped"]["medusa"]  # no shipped heads for the tiny model: left out
    assert method == pick(report) and method in ("none", "lookup")
    engine = Engine(out)
    assert engine.method == method
    assert (
        engine.generate(PROMPTS[0], max_new_tokens=6).output_ids
        == Engine(candidates / "none").generate(PROMPTS[0], max_new_tokens=6).output_ids
    )
    made.clear()
    compile_auto(str(tiny_folder("llama")), out, candidates, settings, compile_one, {"max_context": 160},
                 progress=False)  # fmt: skip
    assert made == ["medusa"]  # none and lookup reused (same settings); out was ours, so replaced


def test_auto_flags_belong_to_auto(tiny_folder, tmp_path, capsys):
    folder = str(tiny_folder("llama"))
    capsys.readouterr()
    argv = ["compile", folder, "-o", str(tmp_path / "b"), "--method", "lookup", "--prompts", "chat"]
    one_line_error(capsys, argv, "--prompts is a --method auto option")
    argv = ["compile", folder, "-o", str(tmp_path / "b"), "--method", "auto", "--num-draft", "3"]
    # the methods that own --num-draft come from the registry; lookup is one of them
    one_line_error(capsys, argv, "--num-draft is a --method lookup/", "option; it does nothing with --method auto")
