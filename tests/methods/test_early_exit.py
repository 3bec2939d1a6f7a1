"""`--method early-exit`: the target's first E layers plus a trained adapter (Kangaroo) draft K
tokens inside the engine call; the output must be exactly the target's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specgraph.compiler import CompileConfig, compile_model
from specgraph.errors import InputError
from specgraph.loaders import load_model, model_fingerprint
from specgraph.methods.early_exit.adapter import adapter_init, load_adapter, parts, save_adapter
from specgraph.methods.early_exit.train import train_early_exit
from specgraph.methods.teacher import Schedule, Text
from specgraph.runtime import Engine
from tests.greedy import assert_same_greedy, hf_greedy
from tests.methods.test_draft import NEW_TOKENS, PROMPTS
from tests.methods.test_eagle import token_prompts
from tests.models.tiny import build
from tests.stats import PROMPT, chi_square, engine_counts, exact_joint

VOCAB = 256
ALPHA = 1e-4  # as tests/test_sampling.py


def random_adapter(folder: Path, path: Path, exit_layer: int = 1, seed: int = 1, std: float = 0.2,
                   meta: dict | None = None) -> Path:  # fmt: skip
    """An untrained adapter for the model in `folder`: random attention matrices of this `std`
    (its q is far from the target's p), the norms as initialised; std 0: the initial adapter
    (the target's layer E + 1 without its MLP, which drafts well on the tiny models)."""
    loaded = load_model(str(folder))
    hf = loaded.hf_model
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=gen) * std if v.dim() == 2 and std else v
             for k, v in adapter_init(hf, exit_layer).items()}  # fmt: skip
    vocab, hidden = hf.get_output_embeddings().weight.shape
    header = {"model": loaded.name, "fingerprint": model_fingerprint(loaded), "exit_layer": exit_layer,
              "hidden_size": hidden, "vocab_size": vocab, "num_layers": len(parts(hf, loaded.name)[1])}  # fmt: skip
    save_adapter(path, state, {**header, **(meta or {})})
    return path


@pytest.fixture(scope="module")
def trained(tiny_folder, tiny_bundle, tmp_path_factory):
    """An adapter trained on the tiny Llama's own greedy replies (no tokenizer: no code text)."""
    folder = tmp_path_factory.mktemp("early_exit_train")
    prompts = token_prompts(folder)
    out = folder / "adapter.safetensors"
    text = Text(prompts=str(prompts), max_new_tokens=48, holdout=0.2)
    report = train_early_exit(str(tiny_folder("llama")), out, 1, text, Schedule(epochs=8, lr=3e-3, batch_size=4, curve=2),
                              threads=1, progress=False, engine_bundle=str(tiny_bundle("llama", "none")))  # fmt: skip
    return report, out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tiny_folder, trained):
    out = tmp_path_factory.mktemp("early_exit") / "bundle"
    cfg = CompileConfig.of(tiny_folder("llama"), out, "early-exit", max_context=160, exit_adapter=str(trained[1]),
                           num_draft=3, adaptive=False)  # fmt: skip
    compile_model(cfg)
    return out


def test_training_reports_a_curve_and_writes_a_loadable_adapter(trained, tiny_folder):
    report, path = trained
    tensors, meta = load_adapter(path)
    assert meta["fingerprint"] == report["fingerprint"] == model_fingerprint(load_model(str(tiny_folder("llama"))))
    assert (meta["exit_layer"], meta["hidden_size"], meta["vocab_size"], meta["num_layers"]) == (1, 64, VOCAB, 2)
    assert meta["command"].startswith("specgraph train --method early-exit") and report["train_tokens"] > 0
    assert all(k.startswith(("layer.", "norm.")) and "mlp" not in k for k in tensors)  # the adapter alone
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())
    assert len(report["curve"]) == 2 and report["curve"][0]["train_tokens"] < report["curve"][1]["train_tokens"]
    assert report["epoch_loss"][-1] < report["epoch_loss"][0]
    assert 0.1 < report["acceptance"]["chat"] <= 1  # far above chance (1/256)


def test_greedy_equals_the_none_engine_and_hf(bundle, tiny_bundle):
    model = build("llama")
    engine, plain = Engine(bundle), Engine(tiny_bundle("llama", "none"))
    section = engine.manifest["early-exit"]
    assert engine.manifest["draft_depth"] == 3 and section["exit_layer"] == 1 and section["layer_reuse"] is False
    taus = []
    for prompt in PROMPTS:
        got = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        want = plain.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).output_ids
        assert got.output_ids == want
        assert_same_greedy(model, prompt, got.output_ids, hf_greedy(model, prompt, NEW_TOKENS))
        taus.append(got.mean_accepted)
    assert max(taus) > 1.3, taus  # the trained adapter's drafts are accepted


def test_the_adapter_layer_has_no_mlp(bundle):
    """The drafter's layers 1..E have their MLPs; the adapter (layer E + 1) has none: the bundle
    holds exactly E down projections [H, intermediate] of the drafter's."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    down = [t.name for t in model.graph.initializer if t.name.startswith("draft_gm.") and list(t.dims) == [64, 128]]
    assert len(down) == 1, down


def test_a_random_adapter_is_still_exact(tiny_folder, tiny_bundle, tmp_path):
    adapter = random_adapter(tiny_folder("llama"), tmp_path / "r.safetensors")
    compile_model(CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "early-exit", max_context=160,
                                   exit_adapter=str(adapter), num_draft=4))  # fmt: skip
    engine, plain = Engine(tmp_path / "b"), Engine(tiny_bundle("llama", "none"))
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).output_ids
        assert engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).output_ids == want


@pytest.mark.parametrize(("family", "exit_layer", "layers"), [("gemma3", 1, 3), ("gemma3", 2, 3), ("qwen2", 1, 2)])
def test_other_families_are_exact(family, exit_layer, layers, tiny_folder, tiny_bundle, tmp_path):
    """Gemma 3 (sliding-window layers, its own norms around attention) at each exit layer, and
    Qwen2 (biases, one KV head, a tied head)."""
    folder = tiny_folder(family)
    adapter = random_adapter(folder, tmp_path / "g.safetensors", exit_layer=exit_layer)
    compile_model(CompileConfig.of(folder, tmp_path / "b", "early-exit", max_context=160, exit_adapter=str(adapter),
                                   exit_layer=exit_layer, num_draft=3))  # fmt: skip
    engine, plain = Engine(tmp_path / "b"), Engine(tiny_bundle(family, "none"))
    assert engine.manifest["early-exit"]["num_layers"] == layers
    for prompt in PROMPTS[:2]:
        want = plain.generate(prompt, max_new_tokens=32, stop_at_eos=False).output_ids
        assert engine.generate(prompt, max_new_tokens=32, stop_at_eos=False).output_ids == want


def test_at_the_stored_weights_the_drafter_runs_blocks_and_keeps_no_float_copy(tmp_path):
    """From a GGUF at `--weights source`, the drafter's layers 1..E and its readout are the
    target's stored blocks (matched by value, as the target's are), never float32 copies of
    them: the only float matrices the drafter keeps are its adapter's own. The output is the
    GGUF's `none` engine's, which is HF's on the same file."""
    import onnx

    from specgraph.default_model import read_gguf
    from tests.models.tiny_gguf import write_llama_gguf
    from tests.stored import float_copies

    path = write_llama_gguf(tmp_path / "m.gguf", "Q4_1", "Q8_0")
    adapter = random_adapter(path, tmp_path / "a.safetensors", std=0)
    out, plain = tmp_path / "ee", tmp_path / "none"
    compile_model(CompileConfig.of(str(path), out, "early-exit", max_context=160, exit_adapter=str(adapter),
                                   num_draft=3, adaptive=False))  # fmt: skip
    compile_model(CompileConfig.of(str(path), plain, "none", max_context=160))
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    floats = [t for t in model.graph.initializer if t.name.startswith("draft_gm.") and ".r0." not in t.name
              and len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT]  # (NAME.r0.*: a block's scales)  # fmt: skip
    tensors, _meta = load_adapter(adapter)
    assert sum(int(np.prod(t.dims)) for t in floats) == sum(v.numel() for v in tensors.values() if v.dim() == 2)
    assert not float_copies(out)
    engine, reference = Engine(out), Engine(plain)
    target = reference.manifest["weights"]["formats"]["Q4_1"]  # both layers' matrices
    # the drafter's copy of layer 1's (of the 2), and its readout's own Q8_0 rows of the table
    assert engine.manifest["weights"]["formats"] == {"Q4_1": target + target // 2, "Q8_0": 2}
    hf, _tok = read_gguf(path)
    for prompt in PROMPTS[:3]:
        got = engine.generate(prompt, max_new_tokens=48, stop_at_eos=False)
        assert got.output_ids == reference.generate(prompt, max_new_tokens=48, stop_at_eos=False).output_ids
        assert_same_greedy(hf, prompt, got.output_ids, hf_greedy(hf, prompt, 48))


def test_adaptive_and_a_quantised_drafter_stay_exact(tiny_folder, tiny_bundle, trained, tmp_path):
    compile_model(CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "early-exit", max_context=160,
                                   exit_adapter=str(trained[1]), num_draft=3, adaptive=True, exit_weights="int8"))  # fmt: skip
    engine, plain = Engine(tmp_path / "b"), Engine(tiny_bundle("llama", "none"))
    assert engine.manifest["early-exit"]["weights"]["weights"] == "int8"
    assert engine.manifest["early-exit"]["adaptive"]["threshold"] > 0
    # a skipped call fills the drafter's layers 1..E from the target's caches, not the adapter's
    section = engine.manifest["early-exit"]
    assert section["adaptive"]["filled_caches"] == 2 * section["exit_layer"]
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).output_ids
        assert engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).output_ids == want


@pytest.mark.parametrize("kernels", ["auto", "ort"])
def test_a_call_that_skips_the_drafter_fills_its_first_layers_with_the_targets(tiny_folder, tmp_path, kernels):
    """`--adaptive`: a call in which no row drafts skips the drafter (the gate's `If`) and writes
    the target's keys and values of its tokens into the caches of the drafter's layers 1..E
    (the target's own), so a later probe reads no stale slot there: one
    `specgraph.CopySlots` node with the kernel library (auto, where it is built), two ONNX
    nodes a cache without it. The adapter's own layer has nothing to fill it from. A round must
    accept all K = 3 drafts to pay here (threshold 3), so the row soon stops and probes."""
    from specgraph.kernels import library_path
    from tests.bundles import calls, idle_ops

    adapter = random_adapter(tiny_folder("llama"), tmp_path / "a.safetensors", std=0)
    out = tmp_path / "adaptive"
    compile_model(CompileConfig.of(tiny_folder("llama"), out, "early-exit", max_context=160, exit_adapter=str(adapter),
                                   num_draft=3, adaptive=True, adaptive_threshold=3.0, kernels=kernels))  # fmt: skip
    engine = Engine(out)
    filled = ["draft_past_key_0", "draft_past_value_0"]  # layer 1 of the drafter's 2 (the adapter's is layer 2)
    assert [n for n in engine.manifest["graph"]["state"] if n.startswith("draft_past_")] == [*filled,
            "draft_past_key_1", "draft_past_value_1"]  # fmt: skip
    assert engine.manifest["early-exit"]["adaptive"]["filled_caches"] == 2
    idle = idle_ops(out)
    native = kernels == "auto" and library_path() is not None
    assert idle.count("CopySlots") == (1 if native else 0)
    assert idle.count("TensorScatter") == (0 if native else 2)
    prompt = PROMPTS[2]
    at, skipped = 0, 0
    for result, state in calls(engine, prompt, 40):
        done = int(result["cache_len_out"].numpy()[0])
        if int(result["n_draft"].numpy()[0]) == 0:  # no row drafts next: this call skipped the drafter
            skipped += 1
            for name in filled:  # the slots this call wrote: the target's, in the drafter's cache
                mine, target = state[name].numpy(), state[name.replace("draft_", "")].numpy()
                np.testing.assert_array_equal(mine[:, :, at:done], target[:, :, at:done], err_msg=name)
        at = done
    assert skipped >= 20  # most calls skipped the drafter
    model = build("llama")
    result = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, NEW_TOKENS))


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.7, 4, 0.9)], ids=["T1.0", "T0.7-top4-p0.9"])
def test_joint_law_of_three_tokens_matches_direct_sampling(setting, tiny_folder, tmp_path_factory):
    """The statistical suite of tests/test_sampling.py at T = 1.0 and T = 0.7: an untrained
    adapter's sampled drafts (q far from p) with the general rule give the target's law."""
    folder = tiny_folder("llama-v8")
    root = tmp_path_factory.mktemp("early_exit_v8")
    adapter = random_adapter(folder, root / "a.safetensors")
    cfg = CompileConfig.of(folder, root / "b", "early-exit", max_context=64, exit_adapter=str(adapter), num_draft=3)
    compile_model(cfg)
    engine = Engine(cfg.output, threads=2)
    law = exact_joint(build("llama-v8"), PROMPT, setting)
    p_value, tv = chi_square(engine_counts(engine, setting, seed=41, v=8), law)
    print(f"early-exit {setting}: p = {p_value:.3g}, TV = {tv:.4f}")
    assert p_value > ALPHA, f"early-exit {setting}: chi-square p = {p_value:.2e}, TV = {tv:.4f}"


# --- refusals: one line, a non-zero exit, nothing written --------------------------------------


def _compile_cli(folder: Path, out: Path, capsys, *flags: str) -> tuple[int, str]:
    from specgraph.cli import main

    capsys.readouterr()  # what making the models printed
    code = main(["compile", str(folder), "--method", "early-exit", "--max-context", "64", "-o", str(out), *flags])
    return code, capsys.readouterr().err.strip()


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """A tiny Llama with 3 layers (so exit layers 1 and 2 are both in range)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    folder = tmp_path_factory.mktemp("llama3") / "model"
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize(
    ("family", "message"),
    [("llama-gqa3", "hidden size 96"), ("llama-v8", "vocabulary 8"), ("gemma3", "layer count 3")],
)
def test_an_adapter_for_another_model_is_refused(family, message, tiny_folder, tmp_path, capsys):
    adapter = random_adapter(tiny_folder(family), tmp_path / "a.safetensors")
    code, err = _compile_cli(tiny_folder("llama"), tmp_path / "b", capsys, "--exit-adapter", str(adapter))
    assert code != 0 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "b").exists()


def test_an_adapter_of_the_same_shape_for_another_model_is_refused(tiny_folder, tmp_path, capsys):
    from tests.models.tiny import save

    other = save("llama", tmp_path / "other", seed=7)  # same sizes, other weights: another fingerprint
    adapter = random_adapter(other, tmp_path / "a.safetensors")
    code, err = _compile_cli(tiny_folder("llama"), tmp_path / "b", capsys, "--exit-adapter", str(adapter))
    assert code != 0 and len(err.splitlines()) == 1 and "trained for another model" in err, err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(("layer", "message"), [("2", "between 1 and 1"), ("0", "at least 1"), ("-1", "at least 1")])
def test_an_exit_layer_out_of_range_is_refused(layer, message, tiny_folder, tmp_path, capsys):
    adapter = random_adapter(tiny_folder("llama"), tmp_path / "a.safetensors")
    code, err = _compile_cli(tiny_folder("llama"), tmp_path / "b", capsys, "--exit-adapter", str(adapter),
                             "--exit-layer", layer)  # fmt: skip
    assert code != 0 and len(err.splitlines()) == 1 and "--exit-layer must be" in err and message in err, err
    assert not (tmp_path / "b").exists()


def test_an_exit_layer_other_than_the_adapters_is_refused(three_layers, tmp_path, capsys):
    adapter = random_adapter(three_layers, tmp_path / "a.safetensors", exit_layer=1)
    code, err = _compile_cli(three_layers, tmp_path / "b", capsys, "--exit-adapter", str(adapter),
                             "--exit-layer", "2")  # fmt: skip
    assert code != 0 and len(err.splitlines()) == 1 and "trained for --exit-layer 1, not 2" in err, err
    assert not (tmp_path / "b").exists()
    code, err = _compile_cli(three_layers, tmp_path / "b", capsys, "--exit-adapter", str(adapter),
                             "--exit-layer", "3")  # fmt: skip
    assert code != 0 and "between 1 and 2" in err, err


def _truncated(path: Path) -> bytes:
    return path.read_bytes()[:-40]


def _without_exit_layer(path: Path) -> bytes:
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(header["meta"])
    del meta["exit_layer"]
    save_file(tensors, str(path), metadata={**header, "meta": json.dumps(meta)})
    return path.read_bytes()


def _wrong_tensor_shape(path: Path) -> bytes:
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["layer.self_attn.q_proj.weight"] = tensors["layer.self_attn.q_proj.weight"][:8]
    save_file(tensors, str(path), metadata=header)
    return path.read_bytes()


@pytest.mark.parametrize(
    "corrupt",
    [lambda p: b"", lambda p: b"not a safetensors file at all", lambda p: b"\x08\x00\x00\x00\x00\x00\x00\x00{}",
     _truncated, _without_exit_layer, _wrong_tensor_shape],
    ids=["empty", "text", "no-header", "truncated", "no-exit-layer", "wrong-shape"],
)  # fmt: skip
def test_a_corrupt_adapter_file_is_one_line(corrupt, tiny_folder, tmp_path, capsys):
    path = random_adapter(tiny_folder("llama"), tmp_path / "a.safetensors")
    path.write_bytes(corrupt(path))
    code, err = _compile_cli(tiny_folder("llama"), tmp_path / "b", capsys, "--exit-adapter", str(path))
    assert code != 0 and len(err.splitlines()) == 1 and "adapter" in err, err
    assert not (tmp_path / "b").exists()


def test_a_missing_adapter_says_how_to_train_one(tiny_folder, tmp_path, capsys):
    code, err = _compile_cli(tiny_folder("llama"), tmp_path / "b", capsys)
    assert code != 0 and len(err.splitlines()) == 1 and "specgraph train --method early-exit" in err, err
    code, err = _compile_cli(tiny_folder("llama"), tmp_path / "b", capsys, "--exit-adapter", str(tmp_path / "no"))
    assert code != 0 and len(err.splitlines()) == 1 and "no such early-exit adapter file" in err, err
    assert not (tmp_path / "b").exists()


def test_the_train_command_refuses_a_bad_exit_layer_in_one_line(tiny_folder, tmp_path, capsys):
    from specgraph.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [3, 4, 5]}) + "\n")
    folder = tiny_folder("llama")  # built before the capture (the first build prints progress)
    capsys.readouterr()
    for flags, message in (([], "needs --exit-layer"), (["--exit-layer", "2"], "between 1 and 1")):
        code = main(["train", str(folder), "--method", "early-exit", "--prompts", str(prompts),
                     "-o", str(tmp_path / "a.safetensors"), *flags])  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert code != 0 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "a.safetensors").exists()


def test_a_gpt2_target_is_refused_in_one_line(tiny_folder, tmp_path, capsys):
    code, err = _compile_cli(tiny_folder("gpt2"), tmp_path / "b", capsys, "--exit-adapter", str(tmp_path / "x"))
    assert code != 0 and len(err.splitlines()) == 1 and "rotary decoder" in err, err


def test_greedy_only_bundle_matches_and_carries_no_q(tiny_folder, trained, tmp_path):
    cfg = CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "early-exit", max_context=96, sampling=False,
                           exit_adapter=str(trained[1]), num_draft=2)  # fmt: skip
    compile_model(cfg)
    engine = Engine(tmp_path / "b")
    assert "draft_q" not in {i.name for i in engine.session.get_inputs()}
    model = build("llama")
    got = engine.generate(PROMPTS[0], max_new_tokens=32, stop_at_eos=False).output_ids
    assert_same_greedy(model, PROMPTS[0], got, hf_greedy(model, PROMPTS[0], 32))
    assert np.asarray(got).size == 32


def test_bad_options_are_refused(tiny_folder, tmp_path):
    for options, message in (({"exit_weights": "int3"}, "--exit-weights must be one of"),
                             ({"num_draft": 0}, "--num-draft must be between 1 and 16"),
                             ({"draft_vocab": -1}, "--draft-vocab must be 0"),
                             ({"adaptive": False, "adaptive_threshold": 1.0}, "--adaptive-threshold needs the adaptive gate")):  # fmt: skip
        with pytest.raises(InputError, match=message):
            CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "early-exit", **options).check()


def test_the_train_command_writes_an_adapter_that_compiles(tiny_folder, tmp_path, capsys):
    """`specgraph train --method early-exit` end to end (it compiles its own `none` engine to
    generate the replies), and the adapter it writes compiles to an exact engine."""
    from specgraph.cli import main

    out = tmp_path / "a.safetensors"
    code = main(["train", str(tiny_folder("llama")), "--method", "early-exit", "--exit-layer", "1",
                 "--prompts", str(token_prompts(tmp_path)), "-o", str(out), "--epochs", "1",
                 "--max-new-tokens", "12", "--curve", "1", "--threads", "1", "--json"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["exit_layer"] == 1 and len(report["curve"]) == 1
    _, meta = load_adapter(out)
    assert meta["command"] == report["command"] and meta["command"].startswith("specgraph ")  # its own argv
    assert (tmp_path / "a.gen.json").is_file()
    compile_model(CompileConfig.of(tiny_folder("llama"), tmp_path / "b", "early-exit", max_context=96,
                                   exit_adapter=str(out), num_draft=2))  # fmt: skip
    model = build("llama")
    got = Engine(tmp_path / "b").generate(PROMPTS[1], max_new_tokens=24, stop_at_eos=False).output_ids
    assert_same_greedy(model, PROMPTS[1], got, hf_greedy(model, PROMPTS[1], 24))
