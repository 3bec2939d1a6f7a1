"""The command line: bad input is one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys

import pytest
import torch


def _run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "specgraph.cli", *args], capture_output=True, text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_unknown_flag():
    _one_line_error(_run("compile", "x", "-o", "y", "--frobnicate", ok=False), "unrecognized arguments: --frobnicate")


def test_help_explains_every_command():
    out = _run("--help").stdout
    for command in ("compile", "generate", "bench", "inspect"):
        assert command in out
    assert "--max-context" in _run("compile", "--help").stdout


def test_pickle_is_refused(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), path)
    _one_line_error(_run("compile", str(path), "-o", str(tmp_path / "out"), ok=False), "pickle")
    raw = tmp_path / "model.pt2"
    raw.write_bytes(pickle.dumps({"a": 1}))
    _one_line_error(_run("inspect", str(raw), ok=False), "model.pt2")


def test_truncated_model_file(tmp_path, tiny_folder):
    from specgraph.capture import export_hf
    from tests.models.tiny import build

    path = tmp_path / "model.pt2"
    torch.export.save(export_hf(build("llama"), 64), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _one_line_error(_run("inspect", str(path), ok=False), "truncated or corrupt")


def test_inspect_json(tiny_folder):
    summary = json.loads(_run("inspect", str(tiny_folder("gpt2")), "--json").stdout)
    assert summary["decoder_blocks"] == 2 and summary["positions"]["kind"] == "learned"


def test_generate_json_and_errors(tiny_bundle, tmp_path):
    bundle = tiny_bundle("llama", "lookup")
    out = json.loads(
        _run(
            "generate", str(bundle), "--prompt-ids", "5,6,7,8,5,6,7", "--max-new-tokens", "12", "--ignore-eos", "--json"
        ).stdout
    )
    for key in ("prompt_ids", "output_ids", "text", "steps", "mean_accepted", "tokens_per_s"):
        assert key in out
    assert len(out["output_ids"]) == 12 and out["prompt_ids"] == [5, 6, 7, 8, 5, 6, 7]

    too_long = ",".join(["3"] * 200)  # the tiny bundles hold 160 tokens
    _one_line_error(_run("generate", str(bundle), "--prompt-ids", too_long, ok=False), "maximum context is 160")
    _one_line_error(_run("generate", str(bundle), "--prompt", "hi", ok=False), "no tokenizer")

    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken)
    with open(broken / "model.onnx.data", "r+b") as f:  # the weights: only the checksum can tell
        f.seek(100)
        f.write(b"\x00\x01\x02")
    _one_line_error(_run("generate", str(broken), "--prompt-ids", "1,2", ok=False), "sha256")
    shutil.copy(bundle / "model.onnx.data", broken / "model.onnx.data")
    with open(broken / "model.onnx", "r+b") as f:  # the graph: unparseable, or a failed checksum
        f.seek(100)
        f.write(b"\x00\x01\x02")
    _one_line_error(_run("generate", str(broken), "--prompt-ids", "1,2", ok=False), "model.onnx")
    _one_line_error(_run("generate", str(tmp_path), "--prompt-ids", "1,2", ok=False), "not a specgraph bundle")


def test_anatomy_failure_names_what_is_missing(tmp_path):
    from tests.test_anatomy import _NoAttention

    t = torch.export.Dim("t", min=2, max=32)
    ep = torch.export.export(
        _NoAttention(), (torch.zeros(1, 4, dtype=torch.long),), dynamic_shapes={"input_ids": {1: t}}
    )
    path = tmp_path / "noattn.pt2"
    torch.export.save(ep, str(path))
    _one_line_error(_run("compile", str(path), "-o", str(tmp_path / "out"), ok=False), "no attention site found")


@pytest.mark.parametrize("bad", [["--max-new-tokens", "0"], ["--prompt-ids", "a,b"]])
def test_bad_values(bad, tmp_path):
    _one_line_error(
        _run("generate", str(tmp_path), *(["--prompt-ids", "1"] if "--prompt-ids" not in bad else []), *bad, ok=False)
    )


def test_generate_samples_with_a_seed(tiny_bundle):
    bundle = str(tiny_bundle("llama", "lookup"))
    args = ["generate", bundle, "--prompt-ids", "5,6,7,8,5,6,7", "--max-new-tokens", "12", "--ignore-eos", "--json"]
    first = json.loads(_run(*args, "--temperature", "0.8", "--top-p", "0.9", "--seed", "4").stdout)
    again = json.loads(_run(*args, "--temperature", "0.8", "--top-p", "0.9", "--seed", "4").stdout)
    assert first["output_ids"] == again["output_ids"] and first["seed"] == 4 and first["temperature"] == 0.8
    fresh = json.loads(_run(*args, "--temperature", "0.8").stdout)
    assert isinstance(fresh["seed"], int)  # a fresh seed is reported, so the run can be repeated


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--temperature", "-1"], "--temperature must be a number >= 0"),
        (["--temperature", "0.7", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--temperature", "0.7", "--top-p", "1.2"], "--top-p must be in (0, 1]"),
        (["--temperature", "0.7", "--top-k", "-3"], "--top-k must be an integer >= 0"),
        (["--temperature", "hot"], "invalid float value"),
    ],
)
def test_bad_sampling_flags(flags, needle, tiny_bundle):
    proc = _run("generate", str(tiny_bundle("llama", "none")), "--prompt-ids", "1,2", *flags, ok=False)
    _one_line_error(proc, needle)


# --- issue 8: one line where a traceback was, and messages that say what happened -----------------


def _main_error(capsys, argv: list[str], *needles: str) -> str:
    """`specgraph.cli.main` in-process: non-zero exit, one stderr line holding `needles`."""
    from specgraph.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, None) and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("k", [str(2**63), str(2**31), "99999999999999999999999"])
def test_top_k_too_large_is_one_line(k, capsys, tmp_path):
    _main_error(capsys, ["generate", str(tmp_path), "--prompt", "x", "--temperature", "0.5", "--top-k", k], "at most")
    _main_error(capsys, ["bench", str(tmp_path), "--prompts", "chat", "--top-k", k], "--top-k")


def test_chat_without_a_template_is_one_line(capsys, monkeypatch, tmp_path):
    import specgraph.runtime

    class _NoTemplate:
        chat_template = None

        def apply_chat_template(self, *_a, **_k):
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set\n...")

    class _Engine:
        def __init__(self, *_a, **_k):
            self.tokenizer = _NoTemplate()
            self.manifest = {"tokenizer": "tokenizer", "vocab_size": 8}

    monkeypatch.setattr(specgraph.runtime, "Engine", _Engine)
    _main_error(capsys, ["generate", str(tmp_path), "--prompt", "hi", "--chat"], "no chat template", "--chat")


@pytest.mark.parametrize("protocol", [0, 1, 2, 5])
def test_pickles_of_every_protocol_are_called_pickles(protocol, capsys, tmp_path):
    path = tmp_path / "model.pt2"
    path.write_bytes(pickle.dumps({"weights": [1.0, 2.0], "name": "x"}, protocol=protocol))
    line = _main_error(capsys, ["inspect", str(path)], "pickle")
    assert "truncated" not in line and "corrupt" not in line


def test_a_mismatched_weight_is_named_not_an_above_report(capsys, tmp_path, tiny_folder):
    """transformers says "look at the above report" and hides the report; specgraph names the tensor."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(tiny_folder("llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    line = _main_error(capsys, ["inspect", str(folder)], "model.layers.0.mlp.gate_proj.weight", "[100, 64]")
    assert "above report" not in line


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--method", "lookup", "--num-draft", "auto"], "--num-draft auto is for draft, eagle and early-exit"),
        (["--method", "draft", "--num-draft", "some"], "expected a number or auto, got 'some'"),
        (["--method", "eagle", "--num-draft", "auto", "--auto-prompts", "nowhere.jsonl"], "no such prompt file"),
        (
            ["--method", "lookup", "--auto-prompts", "chat"],
            "--auto-prompts is a --method medusa/draft/eagle/early-exit option",
        ),
    ],
)
def test_num_draft_auto_flags_are_checked_before_anything_is_built(flags, needle, tiny_folder, tmp_path):
    out = tmp_path / "out"
    _one_line_error(_run("compile", str(tiny_folder("llama")), "-o", str(out), *flags, ok=False), needle)
    assert not out.exists()
