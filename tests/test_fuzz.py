"""A small seeded fuzz pass over what users and strangers hand specgraph: bundle manifests (and
the files they list) and prompts files. Every case must end in success or a specgraph error
whose message is one line: never another exception type, never a traceback.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specgraph.errors import SpecgraphError
from specgraph.exporters.manifest import MANIFEST, read_manifest, sha256
from specgraph.runtime import Engine
from tests.test_load import _tiny_tokenizer

SEED = 20261201
MANIFEST_CASES = 300
ENGINE_CASES = 30  # manifests that pass read_manifest also load and generate (0.2 s each)
PROMPT_CASES = 200
HOSTILE = [None, True, False, 0, -1, 1.5, 2**63, -(2**63), 10**30, 1e12, float("nan"), float("inf"), "", " ",
           "../x", "/etc/passwd", "..", ".", "a/../../b", "C:\\x", "x\\..\\y", "\u00fc\u4e2d\U0001f600", "a\nb",
           "\0", "x" * 5000, [], [1, 2], [[["deep"]]], {}, {"a": 1}, {"\u2603": "\n"}]  # fmt: skip


def _one_line_specgraph_error(exc: BaseException, case: str) -> None:
    assert isinstance(exc, SpecgraphError), f"{case}: {type(exc).__name__}: {exc}"
    text = str(exc)
    assert text and "\n" not in text and "\r" not in text, f"{case}: {text!r}"


# --- manifests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def template(tiny_bundle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid lookup bundle with a tokenizer folder, so every manifest key points somewhere."""
    out = tmp_path_factory.mktemp("fuzz") / "template"
    shutil.copytree(tiny_bundle("llama", "lookup"), out)
    _tiny_tokenizer().save_pretrained(out / "tokenizer")
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["tokenizer"] = "tokenizer"
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest["files"] = {p.relative_to(out).as_posix(): {"size": p.stat().st_size, "sha256": sha256(p)} for p in files}
    (out / MANIFEST).write_text(json.dumps(manifest))
    read_manifest(out)
    return out


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a JSON tree (dict keys and list indices)."""
    found = [prefix] if prefix else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        found += _paths(value, (*prefix, key))
    return found


def _parent(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _mutate(manifest: dict[str, Any], rng: random.Random) -> tuple[str, dict[str, Any] | str]:
    """One random mutation: (what it did, the new manifest or raw manifest text)."""
    m = copy.deepcopy(manifest)
    path = rng.choice(_paths(m))
    parent, key = _parent(m, path), path[-1]
    kind = rng.choice(["drop", "replace", "replace", "retype", "add-key", "deep", "text", "files-entry"])
    if kind == "drop":
        del parent[key]
    elif kind == "replace":
        parent[key] = rng.choice(HOSTILE)
    elif kind == "retype":
        value = parent[key]
        parent[key] = [value] if not isinstance(value, list) else {"v": value}
    elif kind == "add-key" and isinstance(parent, dict):
        parent[rng.choice(["\u00e9t\u00e9", "files", "../k", "", "format_version"])] = rng.choice(HOSTILE)
    elif kind == "files-entry":
        name = rng.choice(["/etc/passwd", "../secret.json", "tokenizer/x.py", "model.onnx/", "a//b", MANIFEST])
        m["files"][name] = {"size": rng.choice([0, 13, -1]), "sha256": "0" * 64}
    elif kind == "deep":
        text = json.dumps(m)
        depth = rng.choice([100, 5000, 200_000])
        return f"{kind}:{depth}", text.replace('"method":', '"method": ' + "[" * depth + "]" * depth + ', "x":', 1)
    elif kind == "text":
        text = json.dumps(m)
        cut = rng.randrange(len(text))
        return f"{kind}:{cut}", rng.choice([text[:cut], text[:cut] + "\x00\udcff" + text[cut:], "1" * 5000])
    return f"{kind}:{'.'.join(map(str, path))}", m


def _symlink_case(bundle: Path, rng: random.Random) -> str:
    """Replace a listed file or folder by a symbolic link to a copy outside the bundle."""
    target = rng.choice(["model.onnx.data", "model.onnx", "tokenizer", "tokenizer/tokenizer.json"])
    outside = bundle.parent / f"outside-{target.replace('/', '_')}"
    source = bundle / target
    if source.is_dir():
        shutil.copytree(source, outside)
        shutil.rmtree(source)
    else:
        shutil.copy(source, outside)
        source.unlink()
    source.symlink_to(outside)
    return f"symlink:{target}"


def _fresh(template: Path, root: Path, index: int) -> Path:
    """A copy of the template made of hard links (cheap); mutations replace files, never edit them."""
    out = root / f"case{index}" / "bundle"
    shutil.copytree(template, out, copy_function=os.link)
    return out


def test_fuzzed_manifests_end_in_success_or_one_line(template: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    manifest = json.loads((template / MANIFEST).read_text())
    outcomes: dict[str, int] = {"ok": 0, "refused": 0, "loaded": 0}
    engines = 0
    start = time.perf_counter()
    for index in range(MANIFEST_CASES):
        bundle = _fresh(template, tmp_path, index)
        if rng.random() < 0.1:
            case = _symlink_case(bundle, rng)
        else:
            case, body = _mutate(manifest, rng)
            (bundle / MANIFEST).unlink()  # a hard link to the template's manifest: never write through it
            (bundle / MANIFEST).write_text(body if isinstance(body, str) else json.dumps(body), errors="surrogatepass")
        try:
            read_manifest(bundle, verify=rng.random() < 0.5)
            if engines < ENGINE_CASES:
                engines += 1
                engine = Engine(bundle, verify=False)
                engine.generate([1, 2, 3], max_new_tokens=3)
                if engine.manifest.get("tokenizer"):
                    engine.tokenizer.encode("w5 w6")
                outcomes["loaded"] += 1
            outcomes["ok"] += 1
        except Exception as exc:
            _one_line_specgraph_error(exc, case)
            outcomes["refused"] += 1
        shutil.rmtree(bundle.parent)
    print(f"fuzzed {MANIFEST_CASES} manifests in {time.perf_counter() - start:.1f} s: {outcomes}")
    assert outcomes["ok"] + outcomes["refused"] == MANIFEST_CASES > 0
    assert outcomes["refused"] > MANIFEST_CASES // 2  # the fuzzer does reach the checks


# --- prompts files ------------------------------------------------------------------------------


def _prompt_lines(rng: random.Random) -> bytes:
    """A prompts file: mostly valid JSONL lines, with one or more hostile ones."""
    good = [json.dumps({"prompt": "w5 w6", "prompt_ids": [rng.randrange(256) for _ in range(rng.randrange(1, 8))]})
            for _ in range(3)]  # fmt: skip
    hostile = [
        lambda: json.dumps({"prompt_ids": [rng.choice([-1, 256, 2**63, 2**70, -(2**70)])]}),
        lambda: json.dumps({"prompt_ids": [rng.choice([1.5, "1", None, True, [1], {"a": 1}])]}),
        lambda: json.dumps({"prompt_ids": rng.choice(["123", 5, None, {}, [], [[1, 2]]])}),
        lambda: json.dumps({"prompt": rng.choice([5, None, [], {"t": "x"}, "\u00fc\n\0", ""])}),
        lambda: json.dumps(rng.choice([[1, 2], "prompt", 5, None])),
        lambda: "[" * rng.choice([100, 10_000, 200_000]) + "]" * rng.choice([0, 10]),
        lambda: '{"prompt_ids": ' + "[" * 50_000 + "1" + "]" * 50_000 + "}",
        lambda: '{"prompt_ids": [' + "9" * rng.choice([20, 5000]) + "]}",
        lambda: '{"prompt": "unterminated',
        lambda: "\ufeff" + json.dumps({"prompt_ids": [1]}),
        lambda: json.dumps({"prompt_ids": [1], "prompt": "x"}) + " trailing",
        lambda: '{"prompt_ids": [NaN, Infinity]}',
    ]
    lines = good + [rng.choice(hostile)() for _ in range(rng.choice([0, 1, 1, 2]))]
    rng.shuffle(lines)
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    if rng.random() < 0.1:
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))  # binary garbage
    return data


def test_fuzzed_prompt_files_end_in_success_or_one_line(tiny_bundle, tmp_path: Path) -> None:
    from specgraph import bench

    rng = random.Random(SEED + 1)
    engine = Engine(tiny_bundle("llama", "none"))
    readers: list[tuple[str, Callable[[str], Any]]] = [
        ("read_prompts", bench.read_prompts),
        (
            "prompt_ids+generate",
            lambda p: [engine.generate(ids, max_new_tokens=1) for ids in bench.prompt_ids(p, None, engine, False)],
        ),  # fmt: skip
    ]
    outcomes = {"ok": 0, "refused": 0}
    failures: list[str] = []
    start = time.perf_counter()
    for index in range(PROMPT_CASES):
        suffix = rng.choice([".jsonl", ".jsonl", ".jsonl.gz", ".gz"])
        path = tmp_path / f"p{index}{suffix}"
        data = _prompt_lines(rng)
        path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") and rng.random() < 0.7 else data)
        name, read = readers[index % len(readers)]
        try:
            read(str(path))
            outcomes["ok"] += 1
        except Exception as exc:
            try:
                _one_line_specgraph_error(exc, name)
                outcomes["refused"] += 1
            except AssertionError:
                failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:70]} (file {path.name}: {data[:50]!r})")
    print(f"fuzzed {PROMPT_CASES} prompt files in {time.perf_counter() - start:.1f} s: {outcomes}")
    assert not failures, f"{len(failures)} non-specgraph errors, e.g. " + " | ".join(failures[:3])
    assert outcomes["ok"] + outcomes["refused"] + len(failures) == PROMPT_CASES > 0
    assert outcomes["ok"] > PROMPT_CASES // 10  # valid files do get through
