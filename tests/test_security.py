"""Hostile and careless input (issue 8): nothing a file holds runs, nothing outside a bundle is
read, and a small file cannot make specgraph allocate or wait more than its real contents allow.

Each test asserts the outcome (no marker file, no read outside the bundle, one line and a typed
error, memory and time under a fixed cap), so it fails on code without the fix.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from specgraph.errors import BundleError, InputError, ModelLoadError, SpecgraphError
from specgraph.exporters.manifest import FORMAT_VERSION, MANIFEST, read_manifest, sha256
from specgraph.loaders import load_model, load_tokenizer, save_tokenizer, source_path
from specgraph.runtime import Engine
from tests.test_load import _save_exported, _tiny_llama, _tiny_tokenizer, _TinyLM

MARKER_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""
PROMPT_TEXT = "Do you wish to run the custom code"
MIB = 1 << 20


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text and "\r" not in text, text
    return text


def _run_cli(args: list[str], cwd: Path, timeout: float = 120, stdin: str = "") -> tuple[int, str, float, float]:
    """Run `specgraph ARGS` in a child (address space capped at 6 GiB so a regression fails
    instead of swapping the machine); return exit code, stderr, peak RSS in MiB and wall seconds."""
    rss_file = cwd / "rss.txt"
    # The child's own peak: VmHWM of its address space. getrusage's ru_maxrss is not: Linux carries
    # the forked parent's (this test runner's, a gigabyte late in the suite) peak across exec.
    code = (
        "import atexit, sys\n"
        "def peak():\n"
        "    kb = next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        f"    open({str(rss_file)!r}, 'w').write(kb)\n"
        "atexit.register(peak)\n"
        "from specgraph.cli import main\n"
        f"sys.exit(main({args!r}))\n"
    )

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, preexec_fn=cap)  # fmt: skip
    wall = time.perf_counter() - start
    return proc.returncode, proc.stderr, int(rss_file.read_text()) / 1024, wall


def _stderr_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


# --- 2. no repository code runs, a bundle never carries code -----------------------------------


def _evil_folder(root: Path, marker: Path, local_class: bool) -> Path:
    """A tiny Llama folder whose tokenizer_config names custom code (auto_map) that would create
    `marker`; with `local_class` it also names a class transformers has, without only the code."""
    folder = root / ("evil-local" if local_class else "evil")
    _tiny_llama().save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)
    (folder / "evil_tok.py").write_text(MARKER_CODE.format(marker=str(marker)))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast" if local_class else "EvilTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tok.EvilTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def yes_on_stdin(monkeypatch: pytest.MonkeyPatch) -> Callable[[], str]:
    """Answer 'y' to any prompt; return what was printed (a prompt would show there)."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    monkeypatch.setattr(sys, "stdout", out)
    return out.getvalue


def test_custom_tokenizer_code_never_runs(tmp_path: Path, yes_on_stdin: Callable[[], str]) -> None:
    marker = tmp_path / "MARKER"
    folder = _evil_folder(tmp_path, marker, local_class=False)
    with pytest.raises(ModelLoadError, match="custom code") as info:
        load_model(folder)
    _one_line(info.value)
    with pytest.raises(ModelLoadError):
        load_tokenizer(folder)
    assert not marker.exists() and PROMPT_TEXT not in yes_on_stdin()


def test_compile_refuses_custom_tokenizer_code_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CLI, with 'y' piped in: exit 2, one line, nothing ran, nothing written."""
    from specgraph.cli import main

    marker = tmp_path / "MARKER"
    folder = _evil_folder(tmp_path, marker, local_class=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    capsys.readouterr()  # the fixture's own output
    assert main(["compile", str(folder), "-o", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert "custom code" in _stderr_line(captured.err) and PROMPT_TEXT not in captured.out + captured.err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_saved_tokenizer_is_data_only(tmp_path: Path, yes_on_stdin: Callable[[], str]) -> None:
    """A folder whose config names both a class transformers has and custom code: the local
    class is used, and the copy has no .py and no auto_map."""
    marker = tmp_path / "MARKER"
    folder = _evil_folder(tmp_path, marker, local_class=True)
    out = tmp_path / "copy"
    save_tokenizer(folder, out)
    assert not marker.exists() and PROMPT_TEXT not in yes_on_stdin()
    assert all(p.suffix in (".json", ".jinja", ".txt", ".model") for p in out.rglob("*"))
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    assert load_tokenizer(out).encode("w5 w6", add_special_tokens=False) == [5, 6]


def test_compiled_bundle_from_a_relative_path_is_code_free_and_records_an_absolute_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: compile from a relative path with a code-naming tokenizer ('y' on stdin)."""
    from specgraph.compiler import CompileConfig, compile_model

    marker = tmp_path / "MARKER"
    folder = _evil_folder(tmp_path, marker, local_class=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    compile_model(CompileConfig.of(model=folder.name, output=Path("bundle"), max_context=32, sampling=False))
    bundle = tmp_path / "bundle"
    manifest = read_manifest(bundle)
    assert not marker.exists() and not list(bundle.rglob("*.py"))
    assert all(Path(name).suffix != ".py" for name in manifest["files"])
    assert manifest["source"]["path"] == str(folder.resolve())
    monkeypatch.chdir(tmp_path.parent)  # bench resolves the source from elsewhere: same model
    assert load_model(manifest["source"]["path"]).name == folder.name
    assert Engine(bundle).tokenizer.encode("w7", add_special_tokens=False) == [7]


def test_source_path_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert source_path("model.gguf") == str(tmp_path.resolve() / "model.gguf")
    assert source_path("smollm2-135m") == "smollm2-135m"


def test_offline_is_set_in_process_and_a_missing_tokenizer_never_waits_on_a_hub(tiny_bundle, tmp_path: Path) -> None:
    """In a child without the test suite's HF_HUB_OFFLINE: importing specgraph sets offline
    mode, and a bundle naming a missing tokenizer folder fails fast, before transformers."""
    bundle = _copy(tiny_bundle("llama", "none"), tmp_path)
    _edit(bundle, lambda m: m.update(tokenizer="tokenizer"))
    code = (
        "import os, sys, specgraph\n"
        "print(os.environ['HF_HUB_OFFLINE'], os.environ['TRANSFORMERS_OFFLINE'])\n"
        "from specgraph.errors import BundleError\n"
        "try:\n"
        f"    specgraph.load({str(bundle)!r}).tokenizer\n"
        "except BundleError as exc:\n"
        "    print('BundleError', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    assert time.perf_counter() - start < 40  # the import takes most of it; a hub retry takes 47 s
    assert out.splitlines()[0] == "1 1"
    assert out.splitlines()[1].startswith("BundleError") and "tokenizer" in out.splitlines()[1]


def test_bundle_tokenizer_naming_code_runs_nothing(
    tiny_bundle, tmp_path: Path, yes_on_stdin: Callable[[], str]
) -> None:
    """A hand-made bundle whose tokenizer_config names code (with no code to run inside it)."""
    marker = tmp_path / "MARKER"
    bundle = _copy(tiny_bundle("llama", "none"), tmp_path)
    _tiny_tokenizer().save_pretrained(bundle / "tokenizer")
    config = json.loads((bundle / "tokenizer" / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil_tok.EvilTokenizer"]})
    (bundle / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    _edit(bundle, lambda m: m.update(tokenizer="tokenizer"))
    with pytest.raises(BundleError, match="custom code") as info:
        Engine(bundle).tokenizer.encode("w5")
    _one_line(info.value)
    assert not marker.exists() and PROMPT_TEXT not in yes_on_stdin()


@pytest.mark.parametrize("listed", [True, False])
def test_bundle_with_code_is_refused(tiny_bundle, tmp_path: Path, listed: bool) -> None:
    """A .py in the tokenizer folder: refused whether the manifest lists it (and checksums it) or not."""
    marker = tmp_path / "MARKER"
    bundle = _copy(tiny_bundle("llama", "none"), tmp_path)
    _tiny_tokenizer().save_pretrained(bundle / "tokenizer")
    (bundle / "tokenizer" / "evil_tok.py").write_text(MARKER_CODE.format(marker=str(marker)))
    _edit(bundle, lambda m: m.update(tokenizer="tokenizer"), skip=() if listed else ("tokenizer/evil_tok.py",))
    with pytest.raises(BundleError, match="never carries code" if listed else "not listed") as info:
        Engine(bundle)
    _one_line(info.value)
    assert not marker.exists()


# --- 4. limits from the files' real contents ----------------------------------------------------


def _gguf(
    path: Path,
    block_count: int = 2,
    embedding: int = 64,
    layers: int = 2,
    skip: tuple[str, ...] = (),
    wide: tuple[str, ...] = (),
) -> Path:
    """A float32 Llama GGUF (no tokenizer) with `layers` blocks of tensors for a config of
    `block_count` blocks; tensors in `skip` are left out, those in `wide` get an extra column."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(embedding)
    writer.add_block_count(block_count)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(128)
    shapes = {"token_embd.weight": (128, 64), "output_norm.weight": (64,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (64,), f"blk.{i}.attn_q.weight": (64, 64),
                   f"blk.{i}.attn_k.weight": (32, 64), f"blk.{i}.attn_v.weight": (32, 64),
                   f"blk.{i}.attn_output.weight": (64, 64), f"blk.{i}.ffn_norm.weight": (64,),
                   f"blk.{i}.ffn_gate.weight": (128, 64), f"blk.{i}.ffn_up.weight": (128, 64),
                   f"blk.{i}.ffn_down.weight": (64, 128)}  # fmt: skip
    for name, shape in shapes.items():
        if name not in skip:
            shape = (*shape[:-1], shape[-1] + 1) if name in wide else shape
            writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _arch_only_gguf(path: Path) -> Path:
    """A GGUF holding only general.architecture=llama (under 100 bytes): transformers fills in a
    7B Llama's defaults."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert path.stat().st_size < 100
    return path


def _hf_folder(root: Path, **config: Any) -> Path:
    """The tiny Llama's folder with its config.json edited (the weights stay as they are)."""
    folder = root / "hf"
    _tiny_llama().save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(data | config))
    return folder


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: _arch_only_gguf(d / "arch-only.gguf"), "asks for 32 layers but the weights hold tensors for 0"),
        (lambda d: _gguf(d / "deep.gguf", block_count=1_000_000), "asks for 1000000 layers"),
        (lambda d: _hf_folder(d, num_hidden_layers=1_000_000), "asks for 1000000 layers"),
    ],
    ids=["gguf-arch-only", "gguf-million-layers", "hf-million-layers"],
)
def test_small_hostile_model_is_refused_in_bounded_memory_and_time(tmp_path: Path, make, message: str) -> None:
    """`specgraph inspect` of a small file describing a huge model: one line, exit 2, under 1 GiB
    and 90 s (the import alone takes about 300 MiB and 10 s here)."""
    path = make(tmp_path)
    code, stderr, rss_mib, wall = _run_cli(["inspect", str(path)], tmp_path)
    assert code == 2 and message in _stderr_line(stderr)
    assert rss_mib < 1024 and wall < 90, (rss_mib, wall)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"skip": ("blk.1.ffn_down.weight",)}, r"lacks 1 tensors its config needs \(blk.1.ffn_down.weight\)"),
        ({"skip": ("token_embd.weight", "output_norm.weight")}, "lacks 2 tensors"),
        ({"wide": ("blk.0.attn_q.weight",)}, "blk.0.attn_q.weight has 4,160 values, the config needs 4,096"),
        ({"embedding": 1 << 16}, "parameters but the weights hold"),
    ],
    ids=["missing-one", "missing-two", "wrong-shape", "huge-hidden"],
)
def test_gguf_is_checked_against_its_config_before_anything_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], message: str
) -> None:
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    read = gguf_utils.load_gguf_checkpoint

    def no_dequantising(path: str, return_tensors: bool = False, **rest: Any) -> Any:
        assert not return_tensors, "tensors were dequantised before the header was checked"
        return read(path, return_tensors=return_tensors, **rest)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_dequantising)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(_gguf(tmp_path / "model.gguf", **kwargs))
    assert time.perf_counter() - start < 20
    _one_line(info.value)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"intermediate_size": 10**9}, "parameters but the weights hold"),
        ({"vocab_size": 10**8}, "parameters but the weights hold"),
        ({"hidden_size": 32, "head_dim": 8}, "shapes config.json does not give them"),
        ({"num_hidden_layers": 3}, "asks for 3 layers but the weights hold tensors for 2"),
    ],
)
def test_hf_config_is_checked_against_the_safetensors_headers(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(_hf_folder(tmp_path, **config))
    assert time.perf_counter() - start < 20
    _one_line(info.value)


@pytest.mark.parametrize("member", ["archive_format", "models/model.json", "data/weights/model_weights_config.json"])
def test_pt2_members_are_read_with_a_cap(tmp_path: Path, member: str) -> None:
    """A member that inflates to 200 MiB from a file of a few hundred KiB: refused after
    reading at most a few MiB."""
    exported = _save_exported(_TinyLM(), tmp_path / "tiny.pt2", torch.zeros(1, 5, dtype=torch.long))
    path = _zip_bomb(exported, tmp_path / "bomb.pt2", member, 200 * MIB)
    assert path.stat().st_size < 2 * MIB
    tracemalloc.start()
    try:
        with pytest.raises(ModelLoadError, match="inflate") as info:
            load_model(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MIB, peak
    _one_line(info.value)


def _zip_bomb(exported: Path, out: Path, member: str, size: int) -> Path:
    with zipfile.ZipFile(exported) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.split("/", 1)[1] != member:
                zout.writestr(info.filename, zin.read(info))
                continue
            with zout.open(info.filename, "w", force_zip64=True) as dst:
                zeros = bytes(MIB)
                for _ in range(size // MIB):
                    dst.write(zeros)
    return out


def test_pt2_with_deeply_nested_json_is_one_line(tmp_path: Path) -> None:
    exported = _save_exported(_TinyLM(), tmp_path / "tiny.pt2", torch.zeros(1, 5, dtype=torch.long))
    out = tmp_path / "deep.pt2"
    with zipfile.ZipFile(exported) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            deep = info.filename.endswith("models/model.json")
            zout.writestr(info.filename, b"[" * 100_000 + b"]" * 100_000 if deep else zin.read(info))
    with pytest.raises(ModelLoadError, match="not valid JSON") as info:
        load_model(out)
    _one_line(info.value)


@pytest.mark.parametrize("threads", [-1, 0, True, 2.5, "2", (os.cpu_count() or 1) + 1, 1_000_000])
def test_threads_are_checked_in_the_runtime(tiny_bundle, threads: Any) -> None:
    bundle = tiny_bundle("llama", "none")  # compiled outside the timed part
    start = time.perf_counter()
    with pytest.raises(InputError, match="threads must be an integer from 1 to") as info:
        Engine(bundle, threads=threads)
    assert time.perf_counter() - start < 5
    _one_line(info.value)


def test_cli_threads_beyond_the_cores_is_one_line(tiny_bundle, capsys: pytest.CaptureFixture[str]) -> None:
    from specgraph.cli import main

    bundle = str(tiny_bundle("llama", "none"))
    assert main(["generate", bundle, "--prompt-ids", "1,2", "--threads", "1000000"]) == InputError.exit_code
    assert "threads must be an integer from 1 to" in _stderr_line(capsys.readouterr().err)


# --- 5. bundles: confined, listed, verified -----------------------------------------------------


def _copy(bundle: Path, tmp_path: Path) -> Path:
    out = tmp_path / "bundle"
    shutil.copytree(bundle, out)
    return out


def _edit(bundle: Path, change: Callable[[dict[str, Any]], Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Edit the manifest as a hostile author would: apply `change`, then list every file in the
    bundle with its right size and sha256 (except `skip`), unless `change` set the files itself."""
    path = bundle / MANIFEST
    manifest = json.loads(path.read_text())
    before = manifest["files"]
    change(manifest)
    if manifest.get("files") is before:
        files = sorted(p for p in bundle.rglob("*") if p.is_file() and not p.is_symlink() and p.name != MANIFEST)
        manifest["files"] = {
            p.relative_to(bundle).as_posix(): {"size": p.stat().st_size, "sha256": sha256(p)}
            for p in files
            if p.relative_to(bundle).as_posix() not in skip
        }
    path.write_text(json.dumps(manifest))
    return manifest


@contextmanager
def _reads_under(folder: Path) -> Iterator[list[str]]:
    """Record every file Python opens or lists under `folder` while the block runs."""
    seen: list[str] = []
    _WATCH.append((str(folder), seen))
    try:
        yield seen
    finally:
        _WATCH.pop()


_WATCH: list[tuple[str, list[str]]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WATCH and event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str | bytes | Path):
        path = os.fsdecode(args[0])
        for folder, seen in _WATCH:
            if os.path.abspath(path).startswith(folder):
                seen.append(path)


sys.addaudithook(_audit)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the bundle holding a secret and a valid copy of the bundle's files."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.json").write_text('{"secret": 1}')
    return folder


@pytest.fixture
def hostile(tiny_bundle, tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch):
    """(bundle copy, a function that loads it and asserts it was refused without reading outside)."""
    bundle = _copy(tiny_bundle("llama", "lookup"), tmp_path)
    shutil.copy(bundle / "model.onnx", outside / "model.onnx")
    shutil.copy(bundle / "model.onnx.data", outside / "model.onnx.data")
    _tiny_tokenizer().save_pretrained(outside / "tokenizer")
    import specgraph.runtime

    sessions: list[str] = []
    real = specgraph.runtime.ort.InferenceSession
    monkeypatch.setattr(
        specgraph.runtime.ort, "InferenceSession", lambda p, *a, **k: sessions.append(p) or real(p, *a, **k)
    )

    def refused(match: str, verify: bool = True) -> BundleError:
        with _reads_under(outside) as seen, pytest.raises(BundleError, match=match) as info:
            engine = Engine(bundle, verify=verify)
            if engine.manifest.get("tokenizer"):
                engine.tokenizer.encode("w5")
        assert seen == [] and sessions == []
        _one_line(info.value)
        return info.value

    return bundle, refused


def _abs(outside: Path, name: str) -> str:
    return str(outside / name)


@pytest.mark.parametrize(
    "change",
    [
        lambda m, o: m["graph"].update(file=_abs(o, "model.onnx")),
        lambda m, o: m["graph"].update(file="../outside/model.onnx"),
        lambda m, o: m["graph"].update(weights="../outside/model.onnx.data"),
        lambda m, o: m.update(tokenizer="../outside/tokenizer"),
        lambda m, o: m.update(tokenizer=_abs(o, "tokenizer")),
        lambda m, o: m["graph"].update(file="sub/../../outside/model.onnx"),
        lambda m, o: m["graph"].update(file="C:/outside/model.onnx"),
        lambda m, o: m["graph"].update(file="model.onnx\\..\\..\\outside"),
    ],
    ids=[
        "graph-abs",
        "graph-dotdot",
        "weights-dotdot",
        "tok-dotdot",
        "tok-abs",
        "graph-nested-dotdot",
        "graph-drive",
        "graph-backslash",
    ],  # fmt: skip
)
def test_manifest_paths_stay_inside_the_bundle(hostile, outside: Path, change) -> None:
    bundle, refused = hostile
    _edit(bundle, lambda m: change(m, outside))
    refused("relative path inside the bundle")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda g: g.update(constants={"tokens": {"dtype": "int64", "shape": [2], "data": [1]}}), "2 values"),
        (lambda g: g.update(constants={"tokens": {"dtype": "int8", "shape": [1], "data": [1]}}), "one of bool"),
        (lambda g: g.update(constants={"tokens": {"dtype": "int64", "shape": [1], "data": ["x"]}}), "int64 value"),
        (lambda g: g.update(constants={"nowhere": {"dtype": "int64", "shape": [1], "data": [1]}}), "graph inputs"),
        (lambda g: g.update(state=[*g["state"], "nowhere"]), "graph inputs"),
        (lambda g: g.update(in_place=["accepted"]), "bound to the input"),
        (lambda g: g.update(extra_slots=-1), "graph.extra_slots"),
    ],
    ids=["constant-size", "constant-dtype", "constant-value", "constant-name", "state-name", "in-place", "slots"],
)
def test_graph_section_is_checked_before_the_engine_runs(hostile, change, match: str) -> None:
    """What a host zero-fills, binds once or writes in place comes from the manifest: checked first."""
    bundle, refused = hostile
    _edit(bundle, lambda m: change(m["graph"]))
    refused(match)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        (lambda o: {}, "at least one file"),
        (lambda o: {_abs(o, "secret.json"): {"size": 13, "sha256": sha256(o / "secret.json")}}, "relative path"),
        (lambda o: {"../outside/secret.json": {"size": 13, "sha256": sha256(o / "secret.json")}}, "relative path"),
    ],
    ids=["empty", "absolute-with-right-digest", "dotdot-with-right-digest"],
)
def test_files_map_cannot_turn_verification_off_or_probe_outside(hostile, outside: Path, files, match: str) -> None:
    bundle, refused = hostile
    _edit(bundle, lambda m: m.update(files=files(outside)))
    refused(match)


def test_every_file_the_engine_reads_is_listed(hostile) -> None:
    bundle, refused = hostile
    _edit(bundle, lambda m: None, skip=("model.onnx.data",))
    refused("model.onnx.data is not listed")


@pytest.mark.parametrize("verify", [True, False])
def test_symlink_to_a_huge_sparse_file_is_refused_without_reading_it(hostile, outside: Path, verify: bool) -> None:
    bundle, refused = hostile
    huge = outside / "huge.data"
    with open(huge, "wb") as f:
        f.truncate(64 << 30)  # 64 GiB of holes: hashing it would take minutes
    (bundle / "model.onnx.data").unlink()
    (bundle / "model.onnx.data").symlink_to(huge)
    start = time.perf_counter()
    refused("symbolic link", verify=verify)
    assert time.perf_counter() - start < 10


def test_symlinked_tokenizer_folder_is_refused(hostile, outside: Path) -> None:
    bundle, refused = hostile
    (bundle / "tokenizer").symlink_to(outside / "tokenizer", target_is_directory=True)
    _edit(bundle, lambda m: m.update(tokenizer="tokenizer"))
    refused("symbolic link")


def test_size_is_checked_before_hashing(hostile) -> None:
    """A listed file swapped for a huge sparse one inside the bundle: refused by its size, unhashed."""
    bundle, refused = hostile
    with open(bundle / "model.onnx.data", "r+b") as f:
        f.truncate(64 << 30)
    start = time.perf_counter()
    refused("has 68,719,476,736 bytes, the manifest says")
    assert time.perf_counter() - start < 10


def _onnx_with_location(bundle: Path, location: str) -> None:
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(bundle / "model.onnx"))


@pytest.mark.parametrize(
    ("location", "match"),
    [
        (lambda o: _abs(o, "model.onnx.data"), "relative path inside the bundle"),
        (lambda o: "../outside/model.onnx.data", "relative path inside the bundle"),
        (lambda o: "other.data", "does not list"),
    ],
    ids=["absolute", "dotdot", "unlisted"],
)
def test_onnx_external_data_stays_inside_the_bundle(hostile, outside: Path, location, match: str) -> None:
    bundle, refused = hostile
    _onnx_with_location(bundle, location(outside))
    shutil.copy(outside / "model.onnx.data", outside / "other.data")
    _edit(bundle, lambda m: None)
    refused(match)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda m: m.pop("max_context"), "max_context: expected a value, got nothing"),
        (
            lambda m: m.update(max_context=1e12),
            r"max_context: expected an integer in \[16, 131072\], got 1000000000000\.0",
        ),
        (lambda m: m.update(max_context=10**12), "max_context"),
        (lambda m: m.update(vocab_size=10**9), "vocab_size"),
        (lambda m: m.update(vocab_size="256"), "vocab_size"),
        (lambda m: m.update(method="exec(1)"), "method: expected a method name"),
        (lambda m: m.pop("graph"), "graph: expected a value"),
        (lambda m: m["graph"].update(inputs="tokens"), "graph.inputs: expected a list"),
        (lambda m: m["graph"]["inputs"][0].pop("shape"), r"graph.inputs\[0\].shape"),
        (lambda m: m["graph"]["bindings"].update(next_tokens="nowhere"), "graph.bindings.next_tokens"),
        (lambda m: m.update(eos_token_ids=[10**6]), r"eos_token_ids\[0\]"),
        (lambda m: m.update(eos_token_ids=[-1]), r"eos_token_ids\[0\]"),
        (lambda m: m.update(lookup=[7]), "lookup: expected an object"),
        (lambda m: m.pop("draft_depth"), "draft_depth: expected a value"),
        (lambda m: m["graph"].pop("state"), "graph.state: expected a value"),
        (lambda m: m.update(source={"name": "x", "kind": "hf", "path": "relative/model"}), "source.path"),
        (lambda m: m["graph"]["inputs"][-1].update(shape=["batch", 10**6, 10**6, 10**6]), "past_"),
    ],
)
def test_manifest_schema_errors_name_the_key(hostile, change, key: str) -> None:
    bundle, refused = hostile
    _edit(bundle, change)
    refused(key)


def test_old_format_says_recompile(hostile) -> None:
    bundle, refused = hostile
    _edit(bundle, lambda m: m.update(format_version=FORMAT_VERSION - 1))
    refused("recompile it")


def test_an_honest_bundle_still_loads(hostile) -> None:
    bundle, _ = hostile
    _edit(bundle, lambda m: None)
    assert Engine(bundle).generate([1, 2, 3], max_new_tokens=4).output_ids


def test_every_specgraph_error_is_one_line() -> None:
    assert str(SpecgraphError("a\nb\r\nc")) == "a b c"
