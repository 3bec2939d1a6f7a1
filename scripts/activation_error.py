"""How far `--activations int8` is from exact fp32 activations, on the same stored weights.

From one float32 bundle compiled with `--emit-logits`, this makes the `--weights source` engines
with fp32 and with int8 activations (the same rewrite `compile` does: native kernels where the
library is built, as `--kernels auto` takes them), and int8 on ONNX Runtime's MatMulNBits
(`int8-ort`, accuracy level 4), then reports, side by side:
- perplexity on held-out text (HumanEval's canonical solutions, prompt + solution, teacher-forced
  through the engine's own logits), with Hugging Face's eager model on the dequantised GGUF as the
  reference the fp32-activation engine must equal;
- greedy agreement: identical outputs and the mean first divergence over the bench prompt sets.

    specgraph compile smollm2-135m -o out/fp32-logits --weights fp32 --emit-logits
    python scripts/activation_error.py out/fp32-logits --json docs/bench/activation-error.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from specgraph.bench import _humaneval_file, encode_prompt, read_prompts
from specgraph.exporters.manifest import write_manifest
from specgraph.kernels import resolve
from specgraph.loaders import load_model
from specgraph.runtime import Engine
from specgraph.weights import store_weights


def _variant(src: Path, dst: Path, model: str, activations: str, kernels: str) -> Engine:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["weights"] = store_weights(dst / "model.onnx", model, "source", activations, 32, kernels=kernels)
    write_manifest(dst, {k: v for k, v in manifest.items() if k not in ("files", "format_version", "sizes")})
    return Engine(dst, threads=2, verify=False)


def _logits(engine: Engine, ids: list[int]) -> np.ndarray:
    feeds = {"tokens": np.asarray([ids], np.int64), "n_fixed": np.asarray([len(ids)], np.int64),
             "cache_len": np.zeros(1, np.int64)}  # fmt: skip
    return engine.call(engine.session.io_binding(), feeds, engine.new_state(1))["logits"].numpy()[0].copy()


def _nll(logits: np.ndarray, ids: list[int]) -> tuple[float, int]:
    """Sum of -log p(next token) over positions 0..T-2, and the count."""
    x = logits[:-1].astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].sum()), len(ids) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="a float32 bundle compiled with --emit-logits")
    parser.add_argument("--model", default="smollm2-135m", help="the GGUF the bundle came from")
    parser.add_argument("--texts", type=int, default=40, help="held-out texts (HumanEval problems)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per bench set for greedy agreement")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="activation-error-"))
    try:
        arms = {"fp32": ("fp32", resolve("auto")), "int8": ("int8", resolve("auto")),
                "int8-ort": ("int8", "ort")}  # fmt: skip
        engines = {name: _variant(args.bundle, work / name, args.model, *arm) for name, arm in arms.items()}
        hf = load_model(args.model).hf_model
        tok = engines["fp32"].tokenizer
        with gzip.open(_humaneval_file(), "rt") as f:
            problems = [json.loads(line) for line in f][-args.texts :]  # the last problems: no prompt set uses them
        totals = {k: [0.0, 0] for k in ("hf", *engines)}
        worst = 0.0
        for p in problems:
            ids = tok.encode(p["prompt"] + p["canonical_solution"])[:1000]
            with torch.no_grad():
                ref = hf(torch.tensor([ids])).logits[0].numpy()
            got = {act: _logits(e, ids) for act, e in engines.items()}
            worst = max(worst, float(np.abs(got["fp32"] - ref).max() / np.abs(ref).max()))
            for key, lg in (("hf", ref), *got.items()):
                nll, n = _nll(lg, ids)
                totals[key][0] += nll
                totals[key][1] += n
        ppl = {k: round(float(np.exp(s / n)), 4) for k, (s, n) in totals.items()}
        agreement = {}
        for name in ("humaneval", "chat", "creative"):
            same, first = {k: 0 for k in ("int8", "int8-ort")}, {k: [] for k in ("int8", "int8-ort")}  # type: ignore[var-annotated]
            for text in read_prompts(name, args.prompts):
                ids = encode_prompt(tok, text)
                a = engines["fp32"].generate(ids, max_new_tokens=64, stop_at_eos=False).output_ids
                for arm in same:
                    b = engines[arm].generate(ids, max_new_tokens=64, stop_at_eos=False).output_ids
                    same[arm] += a == b
                    first[arm].append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)))
            agreement[name] = {
                arm: {
                    "identical": same[arm],
                    "prompts": args.prompts,
                    "mean_first_divergence": float(np.mean(first[arm])),
                }
                for arm in same
            }
        result = {
            "held_out": f"HumanEval problems {164 - args.texts}-163, prompt + canonical solution ({totals['hf'][1]} tokens)",
            "kernels": {name: arm[1] for name, arm in arms.items()},
            "perplexity": ppl,
            "fp32_activations_vs_hf_max_rel_logit_error": worst,
            "greedy_agreement_64_tokens": agreement,
        }
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
