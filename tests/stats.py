"""The statistics behind tests/test_sampling.py (and scripts/sampling_stats.py): the exact law
of the first three tokens of direct sampling, draws from an engine, and a chi-square test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specgraph.compiler import CompileConfig
from specgraph.methods.medusa.heads import MedusaHeads, save_heads
from specgraph.runtime import Engine
from specgraph.sampling import SamplingParams
from tests.models.tiny import save

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so lookup drafts often (and often wrongly)
ROWS, BATCHES = 64, 256  # 16,384 draws per check
TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]]  # siblings at depths 1 and 2
DRAFT_SEED = 1  # the draft model's weights: the target is seed 0


def v8_config(folder: Path, root: Path, method: str) -> CompileConfig:
    """How the 8-token model is compiled for the statistics: 3 lookup drafts, random Medusa
    heads (so candidates disagree with the target) with TREE, 3 drafts sampled from another
    8-token model (DRAFT_SEED: its q is far from the target's p, total variation 0.4 for the first
    token at temperature 1), a cascade's 3 argmax drafts (`draft-cascade`), or 3 drafts sampled
    from an untrained EAGLE drafter; writes the heads, tree, draft model and drafter once."""
    heads, tree, draft = root / "heads.safetensors", root / "tree.json", root / "draft-v8"
    if not draft.exists():
        save("llama-v8", draft, seed=DRAFT_SEED)
    if not heads.exists():
        torch.manual_seed(1)
        module = MedusaHeads(64, 4)
        with torch.no_grad():
            module.weight.normal_(0, 0.05)
            module.bias.normal_(0, 0.05)
        save_heads(heads, module, {"vocab_size": 8, "model": "tiny"})
        tree.write_text(json.dumps({"paths": TREE}))
    eagle = root / "eagle.safetensors"
    if method.startswith("eagle") and not eagle.exists():
        from tests.methods.test_eagle import random_drafter

        random_drafter(folder, eagle)  # untrained: its q is far from p
    name = method.split("-")[0]
    own = {"lookup": {"num_draft": 3}, "medusa": {"heads": str(heads), "tree": str(tree)},
           "draft": {"draft": str(draft), "num_draft": 3, "adaptive": False},  # drafting every round
           "eagle": {"eagle": str(eagle), "num_draft": 3, "adaptive": False}}.get(name, {})  # fmt: skip
    if method == "medusa-chain":  # the chain engine: the heads' argmax drafts (point masses), 3 a round
        own = {"heads": str(heads), "num_draft": 3, "adaptive": False}
    if method.endswith("-adaptive"):  # a threshold that switches drafting on and off within three tokens
        own = {**own, "adaptive": True, "adaptive_threshold": 2.5}
    if method.endswith("-confident"):  # the untrained drafter's greedy drafts: 1 to 3 of them are this sure
        own = {**own, "draft_confidence": 0.05}
    if method.endswith("-fixed"):  # lookup sends every draft it finds
        own = {**own, "adaptive": False}
    if method == "draft-cascade":  # the int4 copy's 2 drafts checked and extended by the int8 copy: point masses
        own = {"draft": "self:int4", "cascade": "self:int8", "num_draft": 3, "adaptive": False}
    return CompileConfig.of(folder, root / method, name, max_context=64, **own)


def hf_law(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """p~ with Hugging Face's warpers, in the order `generate` applies them, in float64."""
    scores = logits.double()
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores, dim=-1).numpy()


def exact_joint(model, prompt: list[int], setting: tuple[float, int, float]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """P(x1, x2, x3) of direct sampling from `model`, [V, V, V]."""
    v = model.config.vocab_size
    with torch.no_grad():
        last = lambda seqs: model(torch.tensor(seqs)).logits[:, -1]  # noqa: E731
        p1 = hf_law(last([prompt]), *setting)[0]  # [V]
        p2 = hf_law(last([prompt + [a] for a in range(v)]), *setting)  # [V, V]
        p3 = hf_law(last([prompt + [a, b] for a in range(v) for b in range(v)]), *setting).reshape(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def engine_counts(engine: Engine, setting: tuple[float, int, float], seed: int, v: int) -> np.ndarray:
    counts = np.zeros(v**3, np.int64)
    for i in range(BATCHES):
        params = SamplingParams(*setting, seed=seed * 100_000 + i)
        for result in engine.generate_batch([PROMPT] * ROWS, 3, stop_at_eos=False, params=params):
            x1, x2, x3 = result.output_ids
            counts[(x1 * v + x2) * v + x3] += 1
    return counts


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(p-value, total variation). Cells expecting fewer than 5 draws are pooled; any draw of a
    sequence the law gives probability 0 (a token top-k/top-p removed) is a failure by itself."""
    probs = probs.reshape(-1)
    assert counts[probs == 0].sum() == 0, "drew a sequence that has probability 0 under the target"
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    pooled = ~big & (probs > 0)
    if expected[pooled].sum() >= 5:
        obs.append(counts[pooled].sum())
        exp.append(expected[pooled].sum())
    elif pooled.any():  # too little to stand alone: join the smallest cell
        i = int(np.argmin(exp))
        obs[i] += counts[pooled].sum()
        exp[i] += expected[pooled].sum()
    obs_a, exp_a = np.asarray(obs, np.float64), np.asarray(exp, np.float64)
    statistic = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    p_value = float(stats.chi2.sf(statistic, len(obs_a) - 1))
    return p_value, 0.5 * float(np.abs(counts / n - probs).sum())
