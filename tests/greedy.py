"""Compare engine output with reference decoding (greedy or sampled); tell a float tie from a real bug."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from specgraph.sampling import filter_logits

TIE_MARGIN = 1e-4  # relative gap between the top two logits below which argmax may flip
DRAW_MARGIN = 1e-5  # distance of a uniform from a CDF boundary below which a float32 draw may flip


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Plain greedy `generate` for exactly n tokens: EOS is disabled, not suppressed (suppressing
    it with min_new_tokens would change the argmax wherever EOS is the top choice)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def assert_same_greedy(model: torch.nn.Module, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Fail on any divergence, unless the eager top-2 logits at that point are a float tie,
    which is reported as a warning (the outputs before it must still be identical)."""
    i = first_mismatch(got, want)
    if i is None:
        return
    assert i < min(len(got), len(want)), f"lengths differ: {len(got)} vs {len(want)}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:i]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    gap = float(top[0] - top[1]) / max(float(logits.abs().max()), 1e-6)
    if gap < TIE_MARGIN:
        warnings.warn(
            f"argmax tie at new token {i}: top-2 relative gap {gap:.2e}; engine {got[i]}, eager {want[i]}", stacklevel=2
        )
        return
    raise AssertionError(
        f"engine diverges from greedy at new token {i}: engine {got[i]}, eager {want[i]} (top-2 gap {gap:.2e}, not a tie)"
    )


def assert_same_sampled(
    model: torch.nn.Module,
    prompt: list[int],
    got: list[int],
    want: list[int],
    setting: tuple[float, int, float],
    uniforms: np.ndarray,
) -> None:
    """Two engines sampling with the same uniforms must emit the same tokens, unless at the first
    divergence the position's uniform lies within float rounding of a boundary of the CDF (the
    sampling analogue of an argmax tie: the engines' logits differ in the last bits), which is
    reported as a warning. `uniforms` is the row's stream, indexed by absolute position."""
    i = first_mismatch(got, want)
    if i is None:
        return
    assert i < min(len(got), len(want)), f"lengths differ: {len(got)} vs {len(want)}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:i]])).logits[0, -1].numpy()
    cdf = np.cumsum(filter_logits(logits, *setting))
    u = float(uniforms[len(prompt) + i])
    margin = float(np.abs(cdf - u).min())
    if margin < DRAW_MARGIN:
        warnings.warn(f"draw tie at new token {i}: u {u:.8f} is {margin:.1e} from a CDF boundary; "
                      f"tokens {got[i]} vs {want[i]}", stacklevel=2)  # fmt: skip
        return
    raise AssertionError(f"sampled outputs diverge at new token {i}: {got[i]} vs {want[i]} (u {margin:.1e} from "
                         "the nearest CDF boundary, not a tie)")  # fmt: skip
