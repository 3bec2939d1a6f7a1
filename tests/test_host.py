"""The C++ host (host/): built once per session with CMake, then held to the Python host.

For none, lookup, medusa and draft bundles it must emit the Python host's tokens, greedy and seeded; its
parts (numpy's uniform stream, SHA-256, every ONNX Runtime API slot it declares) are checked one by
one; bad bundles, flags and requests give one line on stderr and a non-zero exit. The module is
skipped, saying why, where CMake or a C++ compiler is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import specgraph
from specgraph.runtime import Engine

ROOT = Path(__file__).resolve().parents[1]
HOST_SRC = ROOT / "host"
BUILD = HOST_SRC / "build"  # ignored (.gitignore: build/)
_COMPILERS = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
_MISSING = [name for name, found in [("cmake", shutil.which("cmake")),
                                     ("a C++ compiler", any(c and shutil.which(c) for c in _COMPILERS))] if not found]  # fmt: skip

pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"the C++ host needs {' and '.join(_MISSING)} to build")

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [17, 3, 99, 42, 200, 13, 77], list(range(30, 70))]
# (temperature, top_k, top_p, seed): greedy, nucleus, nucleus with top-k, top-k alone
SETTINGS = [(0.0, 0, 1.0, None), (0.7, 0, 0.9, 3), (0.7, 5, 0.9, 2**40 + 3), (1.0, 20, 1.0, 11)]
COMPARED = (
    "prompt_ids",
    "output_ids",
    "steps",
    "mean_accepted",
    "stop_reason",
    "temperature",
    "top_k",
    "top_p",
    "seed",
)


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def host() -> dict[str, Path]:
    """Build the host (incrementally, into host/build) and return its programs."""
    for cmd in (["cmake", "-S", str(HOST_SRC), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release"],
                ["cmake", "--build", str(BUILD), "-j2"]):  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-3000:]}"
    names = ("specgraph-host", "specgraph-host-check", "specgraph-host-concurrency", "embed")
    return {name: BUILD / name for name in names}


@pytest.fixture(scope="session")
def ort_lib() -> Path:
    """The libonnxruntime.so that the onnxruntime wheel ships (no headers: the host declares its slots)."""
    import onnxruntime

    libs = sorted((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
    if not libs:
        pytest.skip("the onnxruntime package ships no libonnxruntime.so here")
    return libs[-1]


@pytest.fixture(scope="session")
def bundles(tiny_bundle, tiny_folder, tmp_path_factory) -> dict[str, Path]:
    """Tiny llama bundles: none and lookup from conftest, medusa with seeded random heads, draft
    with another tiny llama as the draft (sampled drafts: 3 uniforms per position, q as state),
    eagle with an untrained drafter (its cache as state, its features an added target output)."""
    from specgraph.methods.medusa.heads import MedusaHeads, save_heads
    from tests.methods.test_eagle import random_drafter
    from tests.models.tiny import VOCAB, save

    tmp = tmp_path_factory.mktemp("host_medusa")
    torch.manual_seed(1)
    heads = MedusaHeads(64, 4)
    with torch.no_grad():
        heads.weight.normal_(0, 0.05)
        heads.bias.normal_(0, 0.05)
    save_heads(tmp / "heads.safetensors", heads, {"vocab_size": VOCAB, "model": "tiny",
                                                  "acceptance": [[0.5, 0.2, 0.1] + [0.01] * 7] * 4})  # fmt: skip
    medusa, tree = tmp / "bundle", tmp / "tree_bundle"  # the chain engine (the default), and the tree engine
    specgraph.compile(tiny_folder("llama"), medusa, method="medusa", max_context=160,
                      heads=str(tmp / "heads.safetensors"))  # fmt: skip
    specgraph.compile(tiny_folder("llama"), tree, method="medusa", max_context=160,
                      heads=str(tmp / "heads.safetensors"), tree="default")  # fmt: skip
    draft = tmp / "draft_bundle"
    specgraph.compile(tiny_folder("llama"), draft, method="draft", max_context=160, num_draft=3,
                      draft=str(save("llama", tmp / "other_llama", seed=7)))  # fmt: skip
    eagle = tmp / "eagle_bundle"
    drafter = random_drafter(tiny_folder("llama"), tmp / "eagle.safetensors")
    # adaptive: the drafter sits in an If and the host trims next_tokens by n_draft
    specgraph.compile(tiny_folder("llama"), eagle, method="eagle", max_context=160, num_draft=3, eagle=str(drafter),
                      adaptive=True, adaptive_threshold=1.5)  # fmt: skip
    # the target's own copy, adaptive, where a round pays only if all 3 drafts are accepted: most calls
    # skip the drafter and fill its cache from the target's (the gate's else branch, exporters/gate.py)
    self_adaptive = tmp / "self_adaptive"
    specgraph.compile(tiny_folder("llama"), self_adaptive, method="draft", max_context=160, num_draft=3,
                      draft="self:int4", adaptive=True, adaptive_threshold=3.0)  # fmt: skip
    # a cascade, gated with every row drafting: the host trims next_tokens by the mid model's n_sent,
    # which the gate's idle branch passes as n_draft's zeros
    cascade = tmp / "cascade"
    specgraph.compile(tiny_folder("llama"), cascade, method="draft", max_context=160, num_draft=3, draft="self:int4",
                      cascade="self:int8", adaptive=True, adaptive_threshold=0.0)  # fmt: skip
    # lookup on ONNX Runtime's own kernels: a graph that a session without specgraph's library loads
    # (the others run their fused attention natively where the library is built)
    lookup_ort = tmp / "lookup_ort"
    specgraph.compile(tiny_folder("llama"), lookup_ort, method="lookup", max_context=160, num_draft=5, kernels="ort")
    return {"none": tiny_bundle("llama", "none"), "lookup": tiny_bundle("llama", "lookup"), "medusa": medusa,
            "medusa-tree": tree, "draft": draft, "eagle": eagle, "lookup-ort": lookup_ort,
            "draft-self-adaptive": self_adaptive, "draft-cascade": cascade}  # fmt: skip


@pytest.fixture(scope="session")
def engines(bundles) -> dict[str, Engine]:
    return {method: Engine(path, threads=1) for method, path in bundles.items()}


def _run(program: Path, *args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(program), *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})  # fmt: skip


def _generate(host, ort_lib, bundle, prompt, max_new, setting=(0.0, 0, 1.0, None), eos=True, *extra) -> dict:
    temperature, top_k, top_p, seed = setting
    args = [bundle, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", max_new, "--json",
            "--ort-lib", ort_lib, "--threads", 1, "--temperature", temperature, "--top-k", top_k, "--top-p", top_p]  # fmt: skip
    args += ["--seed", seed] if seed is not None else []
    args += [] if eos else ["--ignore-eos"]
    done = _run(host["specgraph-host"], *args, *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _python(engine: Engine, prompt, max_new, setting=(0.0, 0, 1.0, None), eos=True) -> dict:
    temperature, top_k, top_p, seed = setting
    return engine.generate(prompt, max_new, eos, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed).as_dict()  # fmt: skip


def _assert_same(got: dict, want: dict) -> None:
    diff = {k: (got[k], want[k]) for k in COMPARED if got[k] != want[k]}
    assert not diff, f"C++ host vs Python host: {diff}"


def _one_line_error(done: subprocess.CompletedProcess[str], code: int, words: str) -> None:
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specgraph-host: error: "), done.stderr
    assert words in lines[0], lines[0]


# --- the parts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 12345, 2**32 - 1, 2**32, 2**32 + 5, 2**62 + 77, 2**63 - 1])
def test_uniforms_are_numpys_pcg64_stream(host, seed):
    """Bit for bit numpy.random.Generator(PCG64(seed)).random(n, float32), at odd and even lengths
    (numpy splits each 64-bit output into two 32-bit draws, low half first)."""
    for n in (1, 2, 7, 161, 1025):
        done = _run(host["specgraph-host-check"], "uniforms", seed, n)
        assert done.returncode == 0, done.stderr
        got = np.array([int(x) for x in done.stdout.split()], np.uint32)
        want = np.random.Generator(np.random.PCG64(seed)).random(n, dtype=np.float32).view(np.uint32)
        assert np.array_equal(got, want), (seed, n)


def test_sha256_matches_hashlib(host, tmp_path):
    rng = np.random.default_rng(0)
    for size in (0, 1, 55, 56, 63, 64, 65, 1000, (1 << 22) + 3):  # padding edges and the read buffer
        path = tmp_path / f"f{size}.data"
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        path.write_bytes(data)
        done = _run(host["specgraph-host-check"], "sha256", path)
        assert done.stdout.strip() == hashlib.sha256(data).hexdigest(), size


@pytest.mark.parametrize("method", ["lookup-ort", "medusa-tree"])
def test_every_ort_slot_does_what_its_index_promises(host, ort_lib, bundles, method):
    """Each declared slot of ONNX Runtime's API table is called and answers as that function must
    (docs/host.md lists the evidence per slot); the library is 1.32.0 and offers API version 32.
    The check opens the graph with a bare session, so the bundles run ONNX Runtime's own kernels."""
    done = _run(host["specgraph-host-check"], "ort-slots", ort_lib, bundles[method])
    assert done.returncode == 0 and done.stdout.strip().endswith("ALL OK"), done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "version 1.32.0"
    checked = {int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("ok ")}
    assert {1, 2, 3, 7, 10, 22, 23, 24, 25, 30, 31, 33, 34, 36, 37, 49, 51, 65, 69, 78, 93, 133, 134, 135, 136,
            137, 138, 140, 141, 142} <= checked  # fmt: skip


# --- the same tokens as the Python host ---------------------------------------------------------


@pytest.mark.parametrize(
    "method", ["none", "lookup", "medusa", "medusa-tree", "draft", "eagle", "draft-self-adaptive", "draft-cascade"]
)
def test_same_tokens_as_python(host, ort_lib, bundles, engines, method):
    """Greedy and seeded sampling (T 0.7 with top-p 0.9, with and without top-k; top-k alone)."""
    for prompt in PROMPTS:
        for setting in SETTINGS:
            got = _generate(host, ort_lib, bundles[method], prompt, 40, setting)
            _assert_same(got, _python(engines[method], prompt, 40, setting))
    assert set(got) >= {"tokens_per_s", "prefill_s", "decode_s"}


@pytest.mark.parametrize("method", ["none", "lookup", "medusa", "medusa-tree"])
def test_stops_like_python(host, ort_lib, bundles, engines, method, tmp_path):
    """max_context (the budget outlasts the cache), and EOS inside a round: a copy of the bundle
    names as EOS a token the model emits mid-output (the manifest itself carries no checksum)."""
    prompt = PROMPTS[0]
    got = _generate(host, ort_lib, bundles[method], prompt, 400, SETTINGS[1], False)
    _assert_same(got, _python(engines[method], prompt, 400, SETTINGS[1], False))
    assert got["stop_reason"] == "max_context"
    free = _python(engines[method], prompt, 40, SETTINGS[0], False)["output_ids"]
    copy = tmp_path / "bundle"
    shutil.copytree(bundles[method], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["eos_token_ids"] = [free[12]]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    got = _generate(host, ort_lib, copy, prompt, 40)
    _assert_same(got, _python(Engine(copy, threads=1), prompt, 40))
    assert got["stop_reason"] == "eos" and got["output_ids"][-1] == free[12]


def test_embedding_example_runs_and_agrees(host, ort_lib, bundles, engines):
    done = _run(host["embed"], bundles["lookup"], "5,6,7,8,5,6", 16, env={"SPECGRAPH_ORT_LIB": str(ort_lib)})
    assert done.returncode == 0, done.stderr
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines()}
    greedy = _python(engines["lookup"], [5, 6, 7, 8, 5, 6], 16)["output_ids"]
    sampled = _python(engines["lookup"], [5, 6, 7, 8, 5, 6], 16, (0.7, 0, 0.9, 7))["output_ids"]
    assert lines["greedy"].split()[1] == ",".join(map(str, greedy))
    assert lines["sampled"].split()[1] == ",".join(map(str, sampled))
    assert (
        lines["bad prompt"] == "bad prompt: code 6: token ids must lie in [0, 256) for this model; position 0 holds -1"
    )
    assert "ONNX Runtime 1.32.0" in done.stdout


@pytest.mark.parametrize("pair", [("lookup", "lookup"), ("none", "medusa")], ids=["same bundle", "two bundles"])
def test_two_engines_on_two_threads_as_one_after_the_other(host, ort_lib, bundles, engines, pair):
    """host/tests/concurrency.c: two engines (over one bundle, or over two) run greedy and seeded
    requests on two threads at once, 8 rounds, then each thread loads its own engine; every output
    must equal the sequential run's, which in turn is the Python host's."""
    prompt = PROMPTS[0]
    done = _run(host["specgraph-host-concurrency"], bundles[pair[0]], bundles[pair[1]], ",".join(map(str, prompt)),
                40, 8, env={"SPECGRAPH_ORT_LIB": str(ort_lib)})  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0 and done.stdout.strip().endswith("concurrency: OK (8 rounds)"), out
    lines = {line.split(":")[0]: line.split(":")[1].strip() for line in done.stdout.splitlines()}
    for label, method in zip("ab", pair, strict=True):
        for name, setting in (("greedy", SETTINGS[0]), ("sampled", (0.7, 0, 0.9, 7))):
            want = _python(engines[method], prompt, 40, setting)["output_ids"]
            assert lines[f"{label} {name}"] == ",".join(map(str, want)), (label, name)


# --- bad bundles, flags and requests ------------------------------------------------------------


def _edit_manifest(bundle: Path, change) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    change(manifest)
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def _move_external_data(bundle: Path, location: str) -> None:
    """Point the graph's first external tensor at `location`, re-recording the graph's size and
    sha256 so only the location check can catch it."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
    (bundle / "model.onnx").write_bytes(model.SerializeToString())
    data = (bundle / "model.onnx").read_bytes()
    _edit_manifest(bundle, lambda m: m["files"].update(
        {"model.onnx": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}))  # fmt: skip


def _uniforms_width(width: int):  # type: ignore[no-untyped-def]
    """A manifest edit: declare uniforms [batch, width] (the host fills the declared width)."""

    def change(manifest: dict) -> None:
        spec = next(v for v in manifest["graph"]["inputs"] if v["name"] == "uniforms")
        spec["shape"] = [spec["shape"][0], width]

    return change


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


BAD_BUNDLES = {
    "missing manifest": (lambda b: (b / "manifest.json").unlink(), "is not a specgraph bundle (no manifest.json)"),
    "edited weights": (lambda b: _flip_last_byte(b / "model.onnx.data"), "model.onnx.data fails its sha256 checksum"),
    "grown weights": (lambda b: (b / "model.onnx.data").open("ab").write(b"x"), "the manifest says"),
    "missing file": (lambda b: (b / "model.onnx.data").unlink(), "model.onnx.data listed in the manifest is missing"),
    "path with ..": (lambda b: _edit_manifest(b, lambda m: m["files"].update({"../x.data": m["files"]["model.onnx"]})),
                     "expected a relative path inside the bundle"),
    "absolute path": (lambda b: _edit_manifest(b, lambda m: m["files"].update({"/etc/x.data": m["files"]["model.onnx"]})),
                      "expected a relative path inside the bundle"),
    "symbolic link": (lambda b: ((b / "model.onnx.data").rename(b / "real"), (b / "model.onnx.data").symlink_to("real")),
                      "goes through a symbolic link"),
    "old format": (lambda b: _edit_manifest(b, lambda m: m.update(format_version=2)), "has bundle format 2"),
    "unknown format": (lambda b: _edit_manifest(b, lambda m: m.update(format_version=99)), "has bundle format 99"),
    "not json": (lambda b: (b / "manifest.json").write_text("{\"format_version\": 3,"), "is not valid JSON"),
    "unlisted graph": (lambda b: _edit_manifest(b, lambda m: m["files"].pop("model.onnx")), "is not listed"),
    "external data outside": (lambda b: _move_external_data(b, "../model.onnx.data"), "external data of"),
    "external data unlisted": (lambda b: _move_external_data(b, "other.data"),
                               "reads external data from other.data, which the manifest does not list"),
    "state not an input": (lambda b: _edit_manifest(b, lambda m: m["graph"]["state"].append("nope")), "graph.state"),
    "uniforms width": (lambda b: _edit_manifest(b, _uniforms_width(100)),
                       "input uniforms is not [batch, R * (max_context + 1)]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_BUNDLES))
def test_bad_bundle_is_one_line_and_exit_5(host, ort_lib, bundles, tmp_path, case):
    edit, words = BAD_BUNDLES[case]
    bundle = tmp_path / "bundle"
    shutil.copytree(bundles["lookup"], bundle)
    edit(bundle)
    done = _run(host["specgraph-host"], bundle, "--prompt-ids", "1,2,3", "--ort-lib", ort_lib)
    _one_line_error(done, 5, words)


BAD_REQUESTS = {
    "no prompt": ([], 2, "--prompt-ids is required"),
    "zero budget": (["--prompt-ids", "1,2", "--max-new-tokens", "0"], 2, "expected a positive integer"),
    "not ids": (["--prompt-ids", "1,x"], 2, "takes comma-separated integers"),
    "unknown flag": (["--prompt-ids", "1", "--fast"], 2, "unrecognized arguments: --fast"),
    "bad float": (["--prompt-ids", "1", "--temperature", "hot"], 2, "invalid float value"),
    "outside vocabulary": (["--prompt-ids", "1,256"], 6, "position 1 holds 256"),
    "longer than context": (["--prompt-ids", ",".join(["1"] * 160)], 6, "maximum context is 160"),
    "top-p zero": (["--prompt-ids", "1", "--temperature", "0.7", "--top-p", "0"], 6, "--top-p must be in (0, 1]"),
    "negative seed": (["--prompt-ids", "1", "--seed", "-1"], 6, "--seed must be an integer in [0, 2**63)"),
    "huge seed": (["--prompt-ids", "1", "--seed", str(2**64)], 6, "--seed must be an integer in [0, 2**63)"),
    "negative temperature": (["--prompt-ids", "1", "--temperature", "-1"], 6, "--temperature must be a number >= 0"),
    "too many threads": (["--prompt-ids", "1", "--threads", "100000"], 6, "threads must be an integer from 1 to"),
    "no library": (["--prompt-ids", "1", "--ort-lib", "/nonexistent/libonnxruntime.so"], 7, "cannot load ONNX Runtime"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_flags_and_requests(host, ort_lib, bundles, case):
    args, code, words = BAD_REQUESTS[case]
    lib = [] if "--ort-lib" in args else ["--ort-lib", ort_lib]
    _one_line_error(_run(host["specgraph-host"], bundles["lookup"], *args, *lib), code, words)


def test_bundle_session_options_stay_ours(host, ort_lib, bundles):
    done = _run(host["specgraph-host"], bundles["none"], "--prompt-ids", "1", "--ort-lib", ort_lib,
                env={"ORT_LOAD_CONFIG_FROM_MODEL": "1"})  # fmt: skip
    _one_line_error(done, 6, "ORT_LOAD_CONFIG_FROM_MODEL")


def test_plain_output_and_no_verify(host, ort_lib, bundles, engines):
    """Without --json: the ids on stdout, a summary on stderr. --no-verify skips only the hashes."""
    done = _run(host["specgraph-host"], bundles["none"], "--prompt-ids", "5,6,7", "--max-new-tokens", 8,
                "--ort-lib", ort_lib, "--no-verify")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ",".join(map(str, _python(engines["none"], [5, 6, 7], 8)["output_ids"]))
    assert done.stderr.startswith("[8 tokens,") and "stop: max_new_tokens" in done.stderr


def test_sampling_without_seed_reports_a_fresh_one(host, ort_lib, bundles, engines):
    got = _generate(host, ort_lib, bundles["none"], PROMPTS[1], 12, (0.7, 0, 0.9, None))
    assert isinstance(got["seed"], int) and 0 <= got["seed"] < 2**63
    _assert_same(got, _python(engines["none"], PROMPTS[1], 12, (0.7, 0, 0.9, got["seed"])))


def test_float_fields_print_as_python_does(host, ort_lib, bundles):
    got = _generate(host, ort_lib, bundles["none"], [1, 2], 3, (1e-05, 0, 1.0, 5))
    assert got["temperature"] == 1e-05 and struct.pack("d", got["top_p"]) == struct.pack("d", 1.0)


# --- the default model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_bundle) -> dict[str, Path]:
    return {method: smollm2_bundle(method) for method in ("none", "lookup", "medusa")}  # medusa: the shipped heads


@pytest.mark.slow
def test_default_model_same_tokens_as_python(host, ort_lib, smollm2):
    engines = {method: Engine(path, threads=2) for method, path in smollm2.items()}
    tok = engines["none"].tokenizer
    for text in ("Write a Python function that returns the n-th Fibonacci number.", "List three colours."):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        for method, bundle in smollm2.items():
            for setting in ((0.0, 0, 1.0, None), (0.7, 0, 0.9, 100)):
                got = _generate(host, ort_lib, bundle, prompt, 48, setting, True, "--threads", 2)
                _assert_same(got, _python(engines[method], prompt, 48, setting))


def test_native_kernel_bundle_runs_in_the_host_as_in_python(host, ort_lib, tiny_folder, tmp_path):
    """A `--kernels native` bundle: the host loads libspecgraph_kernels.so from its own build (never
    from the bundle) and generates what Python generates; without the library, one line and exit 7."""
    bundle = tmp_path / "native"
    specgraph.compile(tiny_folder("llama"), bundle, method="lookup", max_context=160, weights="int4",
                      kernels="native")  # fmt: skip
    engine = Engine(bundle, threads=1)
    for prompt in PROMPTS:
        for setting in SETTINGS[:2]:
            got = _generate(host, ort_lib, bundle, prompt, 24, setting)
            want = _python(engine, prompt, 24, setting)
            assert {k: got[k] for k in COMPARED} == {k: want[k] for k in COMPARED}
    done = _run(host["specgraph-host"], bundle, "--prompt-ids", "1,2", "--ort-lib", ort_lib,
                env={"SPECGRAPH_KERNELS_LIB": str(tmp_path / "absent.so")})  # fmt: skip
    assert done.returncode == 7 and len(done.stderr.strip().splitlines()) == 1 and "native kernels" in done.stderr
