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
    with open(broken / "model.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    _one_line_error(_run("generate", str(broken), "--prompt-ids", "1,2", ok=False), "sha256")
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
