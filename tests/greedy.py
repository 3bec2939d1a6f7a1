"""Compare engine output with reference greedy decoding; tell a float tie from a real bug."""

from __future__ import annotations

import warnings

import torch

TIE_MARGIN = 1e-4  # relative gap between the top two logits below which argmax may flip


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
