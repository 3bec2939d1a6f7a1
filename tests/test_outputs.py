"""Where specgraph writes (specgraph/outputs.py): a user's files are never lost, an output never
touches the command's input, and a bad output is one line on stderr BEFORE any long work.

Each CLI test runs `specgraph.cli.main` in-process with the expensive stage replaced by a tripwire
(loading the model, running the benchmark): reaching it fails the test, so a refusal that came
only after the work (the old behaviour) cannot pass. Trees are hashed before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch

import specgraph.bench
import specgraph.compiler
import specgraph.methods.medusa.train
import specgraph.methods.replies
import specgraph.methods.teacher
from specgraph.cli import main
from specgraph.errors import InputError, OutputError
from specgraph.methods.teacher import Text
from specgraph.outputs import BENCH_JSON, BUNDLE, HEADS, check_output, replace_dir, staging_dir, write_file

VOCAB = 256  # tests/models/tiny.py


# --- helpers -------------------------------------------------------------------------------------


def tree_hash(root: Path) -> str:
    """One digest of every path, type, link target and byte under `root` (or of `root` itself)."""
    digest = hashlib.sha256()
    paths = [root] if not root.is_dir() or root.is_symlink() else sorted(root.rglob("*"))
    for path in paths:
        digest.update(str(path.relative_to(root) if path != root else ".").encode())
        if path.is_symlink():
            digest.update(b"L" + os.readlink(path).encode())
        elif path.is_file():
            digest.update(b"F" + path.read_bytes())
        elif path.is_dir():
            digest.update(b"D")
    return digest.hexdigest()


class Reached(AssertionError):
    """The long work started: the output should have been refused before it."""


@pytest.fixture
def tripwire(monkeypatch):
    """Make every expensive stage fail the test if reached."""

    def boom(*_args, **_kwargs):
        raise Reached("the long work started before the output was checked")

    monkeypatch.setattr(specgraph.compiler, "load_model", boom)
    monkeypatch.setattr(specgraph.methods.teacher, "load_model", boom)
    monkeypatch.setattr(specgraph.bench, "run_bench", boom)


def one_line_error(capsys, argv: list[str], *needles: str, within: float | None = 5.0) -> str:
    """Run the CLI in-process: a non-zero exit, one line on stderr naming `needles`, within
    `within` seconds (an output check reads no model; the first call in a test process also pays
    the CLI's cold imports, which took 4 s on a 2-core CI machine running the suite on both cores)."""
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, None), err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert within is None or elapsed < within, f"refused only after {elapsed:.1f} s"
    return lines[0]


def _fake_bundle(folder: Path, extra: str | None = None) -> Path:
    """A folder shaped like a bundle specgraph wrote (manifest with format_version listing its files)."""
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"graph")
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    files = {"model.onnx": "x", "tokenizer/tokenizer.json": "y"}
    (folder / "manifest.json").write_text(json.dumps({"format_version": 1, "files": files}))
    if extra:
        (folder / extra).write_text("the user's own notes")
    return folder


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory full of someone's work, with a model folder and a prompts file in it."""
    from tests.models.tiny import save

    work = tmp_path / "work"
    (work / "src" / "pkg").mkdir(parents=True)
    (work / "src" / "pkg" / "code.py").write_text("print('my work')\n")
    (work / "notes.txt").write_text("do not delete\n")
    save("llama", work / "model")
    (work / "prompts.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4, 5, 6]}\n')
    monkeypatch.chdir(work)
    return work


# --- 1. data loss through output paths -----------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "needle"),
    [
        ("src", "did not make"),  # an existing folder of the user's
        (".", "working directory"),
        ("", "working directory"),
        ("src/pkg/..", "did not make"),  # resolves to src/
        ("src/pkg/../..", "working directory"),
        ("..", "working directory"),
        ("model", "which this command reads"),  # the source model itself
        ("model/bundle", "is inside"),
        ("./model/../model", "it is"),
        ("notes.txt", "is a file"),
        ("notes.txt/x", "is a file, not a folder"),
        ("~", "home"),
    ],
)
def test_compile_refuses_outputs_it_did_not_make(workdir, tripwire, capsys, output, needle):
    before = tree_hash(workdir)
    one_line_error(capsys, ["compile", "model", "-o", output], needle)
    assert tree_hash(workdir) == before


def test_compile_refuses_a_symlink_and_a_bundle_holding_the_users_files(workdir, tripwire, capsys):
    (workdir / "link").symlink_to(workdir / "src", target_is_directory=True)
    _fake_bundle(workdir / "old", extra="mine.txt")
    before = tree_hash(workdir)
    one_line_error(capsys, ["compile", "model", "-o", "link"], "symbolic link")
    one_line_error(capsys, ["compile", "model", "-o", "link", "--force"], "symbolic link")
    one_line_error(capsys, ["compile", "model", "-o", "old"], "does not list: mine.txt")
    assert tree_hash(workdir) == before


def test_force_never_touches_input_or_working_directory(workdir, tripwire, capsys):
    before = tree_hash(workdir)
    for output in ("model", ".", "..", "model/sub", str(workdir.parent)):
        one_line_error(capsys, ["compile", "model", "-o", output, "--force"])
    heads = workdir / "heads.safetensors"
    heads.write_bytes(b"not heads")
    one_line_error(capsys, ["compile", "model", "--method", "medusa", "--heads", str(heads), "-o", str(heads),
                            "--force"], "which this command reads")  # fmt: skip
    one_line_error(
        capsys,
        ["train", "model", "--prompts", "prompts.jsonl", "-o", "prompts.jsonl", "--force"],
        "which this command reads",
    )
    one_line_error(capsys, ["train", "model", "--prompts", "prompts.jsonl", "-o", "model/model.safetensors", "--force"],
                   "is inside")  # fmt: skip
    one_line_error(capsys, ["compile", "src/pkg/code.py", "-o", "src", "--force"], "it holds src/pkg/code.py")
    heads.unlink()
    assert tree_hash(workdir) == before


def test_force_lets_the_long_work_start(workdir, tripwire):
    """--force passes the output check (so the tripwire is reached) and leaves the folder alone until
    the new bundle is complete."""
    before = tree_hash(workdir / "src")
    with pytest.raises(Reached):
        main(["compile", "model", "-o", "src", "--force"])
    assert tree_hash(workdir / "src") == before


def test_train_refuses_to_overwrite_weights_and_folders(workdir, tripwire, capsys):
    before = tree_hash(workdir)
    train = ["train", "model", "--prompts", "prompts.jsonl", "-o"]
    one_line_error(capsys, [*train, "model/model.safetensors"], "is inside")
    one_line_error(capsys, [*train, "src"], "is a folder")
    one_line_error(capsys, [*train, "notes.txt"], "not a Medusa heads, EAGLE drafter or early-exit adapter file")
    one_line_error(capsys, [*train, "notes.txt/heads.safetensors"], "is a file, not a folder")
    (workdir / "heads.gen.json").write_text("my own json\n")
    one_line_error(capsys, [*train, "heads.safetensors"], "heads.gen.json", "not a generation cache")
    one_line_error(capsys, [*train, "heads.gen.json"], "its own generation cache")
    (workdir / "heads.gen.json").unlink()
    assert tree_hash(workdir) == before


def test_train_api_checks_its_output_first(workdir, tripwire):
    before = tree_hash(workdir)
    with pytest.raises(OutputError, match="which this command reads"):
        specgraph.methods.medusa.train.train_medusa(
            "model", "model/model.safetensors", text=Text("prompts.jsonl"), progress=False
        )
    with pytest.raises(Reached):  # a new path is fine: the work starts
        specgraph.methods.medusa.train.train_medusa(
            "model", "new/heads.safetensors", text=Text("prompts.jsonl"), progress=False
        )
    assert tree_hash(workdir) == before and not (workdir / "new").exists()


def test_compile_api_checks_its_output_first(workdir, tripwire):
    import specgraph

    before = tree_hash(workdir)
    with pytest.raises(OutputError):
        specgraph.compile("model", "src")
    with pytest.raises(OutputError):
        specgraph.compile("model", "model")
    with pytest.raises(Reached):
        specgraph.compile("model", "src", force=True)
    assert tree_hash(workdir) == before


def test_bench_outputs_are_checked_before_the_run(workdir, tripwire, capsys):
    bundle = _fake_bundle(workdir / "bundle")
    (workdir / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"tEXtSoftware\x00GIMP" + bytes(64))
    before = tree_hash(workdir)
    bench = ["bench", "bundle", "--prompts", "prompts.jsonl"]
    one_line_error(capsys, [*bench, "--json", "src"], "is a folder")
    one_line_error(capsys, [*bench, "--json", "notes.txt"], "not a report written by specgraph bench")
    one_line_error(capsys, [*bench, "--json", "prompts.jsonl", "--force"], "which this command reads")
    one_line_error(capsys, [*bench, "--json", str(bundle / "r.json")], "is inside")
    one_line_error(capsys, [*bench, "--json", str(bundle / "manifest.json"), "--force"], "which this command reads")
    one_line_error(capsys, [*bench, "--plot", "src"], "is a folder")
    one_line_error(capsys, [*bench, "--plot", "photo.png"], "not a plot written by specgraph bench")
    one_line_error(capsys, [*bench, "--plot", "plot.jpg"], "must end in .png")
    one_line_error(capsys, [*bench, "--plot", "x.png", "--json", "x.png"], "same path")
    one_line_error(capsys, [*bench, "--json", "r.json", "--reference", "bundle/../src/.."], "is inside")
    assert tree_hash(workdir) == before


# --- the rule, unit by unit -----------------------------------------------------------------------


def test_new_paths_empty_folders_and_our_own_outputs_are_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_output("a/b/c", BUNDLE) == tmp_path / "a" / "b" / "c"
    assert not (tmp_path / "a").exists()  # checking creates nothing
    (tmp_path / "empty").mkdir()
    assert check_output("empty", BUNDLE) == tmp_path / "empty"
    assert check_output(_fake_bundle(tmp_path / "b"), BUNDLE) == tmp_path / "b"
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"aggregate": {}, "per_prompt": []}))
    assert check_output(report, BENCH_JSON) == report


def test_a_bundle_replaces_ours_atomically_and_a_failed_swap_keeps_the_old_one(tmp_path, monkeypatch):
    old = _fake_bundle(tmp_path / "out")
    before = tree_hash(old)
    staging = staging_dir(old)
    (staging / "manifest.json").write_text(json.dumps({"format_version": 1, "files": {}}))
    real_rename = os.rename

    def failing_rename(src, dst):
        if Path(src) == staging:
            raise OSError("disk full")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="disk full"):
        replace_dir(staging, old)
    assert tree_hash(old) == before  # the old bundle is back, whole
    monkeypatch.setattr(os, "rename", real_rename)
    replace_dir(staging, old)
    assert sorted(p.name for p in old.iterdir()) == ["manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left beside it


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    from specgraph.methods.medusa.heads import MedusaHeads, save_heads

    heads = tmp_path / "h.safetensors"
    save_heads(heads, MedusaHeads(8, 2), {"model": "x"})
    before = heads.read_bytes()

    def half_write(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_file(heads, half_write, HEADS)
    assert heads.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["h.safetensors"]
    write_file(heads, lambda tmp: save_heads(tmp, MedusaHeads(8, 3), {"model": "y"}), HEADS)  # ours: replaced
    assert heads.read_bytes() != before
    mask = os.umask(0o022)
    os.umask(mask)
    assert heads.stat().st_mode & 0o777 == 0o666 & ~mask  # as any new file, not the temporary name's 0600
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"\x08" + bytes(7) + b'{"a":1}')
    with pytest.raises(OutputError, match="not a Medusa heads, EAGLE drafter"):
        write_file(other, lambda tmp: save_heads(tmp, MedusaHeads(8, 3), {}), HEADS)


def test_compile_replaces_a_folder_only_with_force_and_only_when_done(tiny_folder, tmp_path, capsys):
    """One real compile: --force over someone's folder gives a complete bundle, nothing left beside."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("replace me")
    code = main(["compile", str(tiny_folder("gpt2")), "-o", str(out), "--max-context", "32", "--force", "--json"])
    assert code == 0, capsys.readouterr().err
    assert (out / "manifest.json").is_file() and not (out / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert check_output(out, BUNDLE) == out  # now ours: a later compile may replace it without --force


def test_a_compile_that_fails_half_way_keeps_the_old_bundle(tiny_folder, tmp_path, monkeypatch):
    from specgraph.compiler import CompileConfig, compile_model
    from specgraph.errors import ExportError

    old = _fake_bundle(tmp_path / "out")
    before = tree_hash(tmp_path)

    def failing_export(_engine, _shapes, path, *_rest):
        path.write_bytes(b"half an engine")
        raise ExportError("export failed half way")

    monkeypatch.setattr(specgraph.compiler, "export_onnx", failing_export)
    with pytest.raises(ExportError):
        compile_model(CompileConfig.of(model=str(tiny_folder("llama")), output=old, max_context=32))
    assert tree_hash(tmp_path) == before  # the old bundle whole, and no staging folder left beside it


# --- 6. limits the compiler should know -----------------------------------------------------------


def _gpt2(positions: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=positions)
    model = GPT2LMHeadModel(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


def test_max_context_above_the_position_limit_is_refused_before_capture(tmp_path, capsys, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    def boom(*_a, **_k):
        raise Reached("captured a model whose positions cannot reach --max-context")

    monkeypatch.setattr(specgraph.compiler, "capture", boom)
    _gpt2(32).save_pretrained(tmp_path / "gpt2")
    line = one_line_error(capsys, ["compile", str(tmp_path / "gpt2"), "-o", str(tmp_path / "b"), "--max-context",
                                   "64"], "--max-context 64 exceeds the 32 positions", within=None)  # fmt: skip
    assert "max_position_embeddings" in line
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, max_position_embeddings=48)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    one_line_error(capsys, ["compile", str(tmp_path / "llama"), "-o", str(tmp_path / "b"), "--max-context", "49"],
                   "exceeds the 48 positions", within=None)  # fmt: skip
    assert not (tmp_path / "b").exists()


def test_a_program_without_a_config_is_held_to_its_position_table(tmp_path, monkeypatch):
    from specgraph.capture import export_hf
    from specgraph.compiler import CompileConfig, compile_model

    path = tmp_path / "gpt2.pt2"
    torch.export.save(export_hf(_gpt2(32), 32), str(path))
    monkeypatch.setattr(specgraph.compiler, "export_onnx", lambda *_a: (_ for _ in ()).throw(Reached("exported")))
    with pytest.raises(InputError, match="exceeds the model's 32 learned positions"):
        compile_model(CompileConfig.of(model=str(path), output=tmp_path / "b", max_context=64))
    assert not (tmp_path / "b").exists()


# --- 8. hostile inputs next to the outputs --------------------------------------------------------


def test_a_deeply_nested_tree_file_is_refused_before_loading(workdir, tripwire, capsys):
    tree = workdir / "tree.json"
    tree.write_text("[" * 100_000 + "]" * 100_000)
    one_line_error(capsys, ["compile", "model", "--method", "medusa", "--tree", "tree.json", "-o", "b"], "tree file")


def test_nested_json_and_unknown_ids_in_prompt_files(workdir, tmp_path, tiny_bundle):
    from specgraph.bench import run_bench

    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"prompt_ids": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    oov = tmp_path / "oov.jsonl"
    oov.write_text(f'{{"prompt_ids": [1, 2]}}\n{{"prompt_ids": [1, {VOCAB}]}}\n')
    negative = tmp_path / "neg.jsonl"
    negative.write_text('{"prompt_ids": [3, -1]}\n')
    bundle = str(tiny_bundle("llama", "none"))
    with pytest.raises(InputError, match="nested too deeply"):
        run_bench(bundle, str(deep), progress=False, baseline=False)
    with pytest.raises(InputError, match=f"oov.jsonl:2: .*holds {VOCAB}, outside this model's vocabulary"):
        run_bench(bundle, str(oov), progress=False, baseline=False)
    with pytest.raises(InputError, match="holds -1"):
        run_bench(bundle, str(negative), progress=False, baseline=False)
    for prompts in (deep, oov):  # train reads the same files, before generating anything
        with pytest.raises(InputError, match="nested too deeply|outside this model's vocabulary"):
            specgraph.methods.medusa.train.train_medusa("model", tmp_path / "h.safetensors", text=Text(str(prompts)),
                                                        progress=False, engine_bundle=bundle)  # fmt: skip
    assert not (tmp_path / "h.safetensors").exists()


# --- 9. clear messages ----------------------------------------------------------------------------


def test_all_prompts_too_long_says_so_before_compiling(workdir, tmp_path, monkeypatch):
    def boom(*_a, **_k):
        raise Reached("compiled an engine for prompts that cannot fit")

    monkeypatch.setattr(specgraph.methods.replies, "_compile_none", boom)
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"prompt_ids": [5] * 600}) + "\n" for _ in range(3)))
    with pytest.raises(InputError, match=r"3 of the 3 prompts .* are too long.*shorter than 510 tokens"):
        specgraph.methods.medusa.train.train_medusa(
            "model", tmp_path / "h.safetensors", text=Text(str(long)), progress=False
        )


def test_plot_is_written_to_exactly_the_path_it_names(tmp_path, monkeypatch, capsys):
    from specgraph.plot import plot_bench

    result = {"method": "lookup", "aggregate": {"acceptance_by_depth": [0.7, 0.5], "mean_accepted": 1.9}}
    out = plot_bench({"chat": result}, tmp_path / "plot")
    assert out == tmp_path / "plot" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot"]
    plot_bench({"chat": result}, tmp_path / "plot")  # ours now: replaced without --force
    monkeypatch.setattr(specgraph.bench, "run_bench", lambda *_a, **_k: result)
    monkeypatch.setattr(specgraph.bench, "format_report", lambda _r: "report")
    bundle = _fake_bundle(tmp_path / "bundle")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1]}\n')
    assert main(["bench", str(bundle), "--prompts", str(prompts), "--plot", str(tmp_path / "X")]) == 0
    assert f"plot: {tmp_path / 'X'}\n" in capsys.readouterr().out
    assert (tmp_path / "X").is_file() and not (tmp_path / "X.png").exists()
