"""Medusa training end to end on the tiny random Llama (no tokenizer, so prompts are token ids and
no code corpus is read), and its labels: a head learns only where the text is the target's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specgraph.errors import InputError
from specgraph.methods.medusa.heads import load_heads
from specgraph.methods.medusa.train import NO_LABEL, _labels, train_medusa
from specgraph.methods.teacher import Schedule, Text

HEADS = 3
HIDDEN = 64  # tests/models/tiny.py
VOCAB = 256


def _prompt_file(folder: Path, n: int = 5) -> Path:
    gen = torch.Generator().manual_seed(1)
    path = folder / "prompts.jsonl"
    lines = [{"prompt_ids": torch.randint(2, VOCAB - 1, (6 + i,), generator=gen).tolist()} for i in range(n)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def trained(tiny_folder, tiny_bundle, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("train")
    kwargs = dict(
        model=str(tiny_folder("llama")),
        output=folder / "heads.safetensors",
        num_heads=HEADS,
        text=Text(str(_prompt_file(folder)), max_new_tokens=24, holdout=0.2),
        schedule=Schedule(epochs=2, lr=1e-2, batch_size=2),
        threads=1,
        progress=False,
        engine_bundle=str(tiny_bundle("llama", "none")),
    )
    return train_medusa(**kwargs), kwargs


def test_heads_file_loads_with_its_meta(trained) -> None:
    result, kwargs = trained
    heads, meta = load_heads(kwargs["output"], HIDDEN, VOCAB)
    assert heads.num_heads == HEADS
    assert meta["num_heads"] == HEADS and meta["vocab_size"] == VOCAB and meta["hidden_size"] == HIDDEN
    assert meta["train_tokens"] > 0 and meta["heldout_tokens"] > 0
    assert meta["command"].startswith("specgraph train --method medusa")
    assert {k: result[k] for k in meta} == meta


def test_acceptance_table_shape(trained) -> None:
    _, kwargs = trained
    _, meta = load_heads(kwargs["output"], HIDDEN, VOCAB)
    table = meta["acceptance"]
    assert len(table) == HEADS and all(len(row) == 10 for row in table)
    assert all(0 <= a <= 1 for row in table for a in row)
    assert all(sum(row) <= 1 + 1e-6 for row in table)
    assert meta["top1"] == [row[0] for row in table]


def test_loss_decreases_and_heads_moved(trained) -> None:
    result, kwargs = trained
    assert result["epoch_loss"][-1] < result["epoch_loss"][0]
    heads, _ = load_heads(kwargs["output"], HIDDEN, VOCAB)
    x = torch.randn(8, HIDDEN)
    zero_init = x[:, None, :].expand(8, HEADS, HIDDEN)  # zero weights: every head returns its input
    assert not torch.allclose(heads(x), zero_init)


def test_generated_text_matches_hf_and_is_cached(trained) -> None:
    result, kwargs = trained
    assert result["target_agreement"] > 0.95  # HF argmax reproduces the engine's greedy tokens
    assert not result["generation_cached"]
    assert Path(kwargs["output"]).with_name("heads.gen.json").is_file()
    again = train_medusa(
        **{**kwargs, "schedule": Schedule(epochs=1), "output": kwargs["output"].with_name("heads.again.safetensors")}
    )
    assert again["generation_cached"] and again["features_cached"]


def test_compiles_its_own_engine(tiny_folder, tmp_path: Path) -> None:
    result = train_medusa(
        model=str(tiny_folder("llama")),
        output=tmp_path / "h.safetensors",
        num_heads=1,
        text=Text(str(_prompt_file(tmp_path, n=2)), max_new_tokens=4),
        schedule=Schedule(epochs=1),
        threads=1,
        progress=False,
    )
    assert list(result["chain"]) == ["chat"] and len(result["chain"]["chat"]) == 1


def test_text_prompts_need_a_tokenizer(tiny_folder, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    with pytest.raises(InputError, match="prompt_ids"):
        train_medusa(model=str(tiny_folder("llama")), output=tmp_path / "h.safetensors", text=Text(str(prompts)),
                     progress=False)  # fmt: skip


def test_bad_arguments_are_input_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="holdout"):
        train_medusa(model="unused", output=tmp_path / "h.safetensors", text=Text("unused", holdout=1.0))


def test_trained_heads_compile_and_stay_lossless(trained, tiny_folder, tmp_path) -> None:
    """Heads trained on the target's own text raise the accepted length and keep greedy output."""
    from specgraph.compiler import CompileConfig, compile_model
    from specgraph.runtime import Engine
    from tests.greedy import assert_same_greedy, hf_greedy
    from tests.models.tiny import build

    _, kwargs = trained
    cfg = CompileConfig.of(model=kwargs["model"], output=tmp_path / "m", method="medusa", max_context=320,
                        heads=str(kwargs["output"]), tree="chain-4" if HEADS >= 4 else "auto")  # fmt: skip
    compile_model(cfg)
    engine, model = Engine(tmp_path / "m"), build("llama")
    prompt = json.loads(Path(kwargs["text"].prompts).read_text().splitlines()[0])["prompt_ids"]
    result = engine.generate(prompt, max_new_tokens=48, stop_at_eos=False)
    assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, 48))


def test_separate_lm_heads_train_and_compile(tiny_folder, tiny_bundle, tmp_path) -> None:
    from specgraph.compiler import CompileConfig, compile_model
    from specgraph.runtime import Engine
    from tests.greedy import assert_same_greedy, hf_greedy
    from tests.models.tiny import build

    prompts = _prompt_file(tmp_path, n=4)
    out = tmp_path / "own.safetensors"
    train_medusa(model=str(tiny_folder("llama")), output=out, num_heads=2, text=Text(str(prompts), max_new_tokens=16),
                 schedule=Schedule(epochs=1), threads=1, progress=False, separate_lm_heads=True,
                 engine_bundle=str(tiny_bundle("llama", "none")))  # fmt: skip
    heads, _ = load_heads(out, HIDDEN, VOCAB)
    assert heads.lm_heads is not None and tuple(heads.lm_heads.shape) == (2, VOCAB, HIDDEN)
    compile_model(CompileConfig.of(model=str(tiny_folder("llama")), output=tmp_path / "m", method="medusa",
                                max_context=320, heads=str(out), tree=str(_tree2(tmp_path))))  # fmt: skip
    engine, model = Engine(tmp_path / "m"), build("llama")
    prompt = [5, 6, 7, 8, 5, 6, 7]
    result = engine.generate(prompt, max_new_tokens=32, stop_at_eos=False)
    assert_same_greedy(model, prompt, result.output_ids, hf_greedy(model, prompt, 32))


def _tree2(folder: Path) -> Path:
    path = folder / "tree2.json"
    path.write_text(json.dumps([[0], [1], [0, 0]]))  # depth 2: fits two heads
    return path


def test_labels_follow_the_targets_own_text() -> None:
    """Head k at j learns the target's argmax at j + k + 1, only where tokens j+1 .. j+k+1 are the
    target's argmax at j .. j+k and j is counted; a reply's text counts everywhere after its prompt."""
    tokens = torch.tensor([10, 11, 12, 99, 14, 15])
    top = torch.tensor([11, 12, 13, 14, 15, 16])  # the target would have written 13, not 99, after 12
    labels = _labels((tokens, None, top, 1), 2)
    n = NO_LABEL
    # head 0: j=0 not counted; j=1: 12 follows 11 -> label top[2]; j=2: 99 is not 13 -> none;
    # j=3: 14 follows 99 -> top[4]; j=4: 15 -> top[5]; j=5: past the end
    assert labels[:, 0].tolist() == [n, 13, n, 15, 16, n]
    # head 1 also needs token j+2: j=1 reaches 99 -> none; j=3: 14, 15 -> top[5]
    assert labels[:, 1].tolist() == [n, n, n, 16, n, n]
    greedy = torch.tensor([5, 6, 7, 8])
    assert (_labels((greedy, None, torch.tensor([6, 7, 8, 9]), 0), 3) != NO_LABEL).sum(0).tolist() == [3, 2, 1]


def test_training_states_are_the_heads_own() -> None:
    """Training's one-product form of the heads equals the module the engine exports."""
    from specgraph.methods.medusa.heads import MedusaHeads
    from specgraph.methods.medusa.train import _states

    heads = MedusaHeads(HIDDEN, HEADS)
    with torch.no_grad():
        heads.weight.normal_()
        heads.bias.normal_()
    x = torch.randn(2, 5, HIDDEN)
    assert torch.allclose(_states(heads, x), heads(x), atol=1e-5)


def test_the_train_command_takes_the_shared_text_and_schedule_flags(tiny_folder, tiny_bundle, tmp_path, capsys):
    """`specgraph train --method medusa` with the corpus and schedule flags every method shares
    (no tokenizer, so no code text); the file records its own argv and the chain's acceptance;
    a learning rate that is not a positive number is refused in one line."""
    from specgraph.cli import main

    out = tmp_path / "h.safetensors"
    argv = ["train", str(tiny_folder("llama")), "--method", "medusa", "--heads", "2", "--prompts",
            str(_prompt_file(tmp_path)), "-o", str(out), "--epochs", "2", "--lr", "0.01", "--curve", "2",
            "--max-new-tokens", "12", "--corpus-mb", "0.5", "--threads", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    _, meta = load_heads(out, HIDDEN, VOCAB)
    assert meta["command"] == report["command"] and "--lr 0.01" in meta["command"]
    assert len(report["curve"]) == 2 and len(meta["chain"]["chat"]) == 2 and meta["draft_vocab"] is None
    with pytest.raises(SystemExit):
        main([*argv[:-1], "--lr", "0"])
    assert "expected a positive number" in capsys.readouterr().err
