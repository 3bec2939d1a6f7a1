"""Medusa heads: K residual blocks on the target's last hidden state, read out by its LM head.

Head k (0-based) at position t proposes the token at t + k + 2 (the LM head itself gives t + 1):
    h_k = x + SiLU(W_k x + b_k),   logits_k = lm_head(h_k)
Zero weights make every head equal to the plain LM head, so an untrained head is harmless.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specgraph.errors import InputError, ModelLoadError

FORMAT = "specgraph-medusa-1"


class MedusaHeads(torch.nn.Module):
    def __init__(self, hidden_size: int, num_heads: int = 4) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.weight = torch.nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))  # [K, out, in]
        self.bias = torch.nn.Parameter(torch.zeros(num_heads, hidden_size))  # [K, H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., K, H]"""
        proj = torch.matmul(x[..., None, None, :], self.weight.transpose(-1, -2))[..., 0, :]  # [..., K, H]
        return x[..., None, :] + torch.nn.functional.silu(proj + self.bias)


def save_heads(path: str | Path, heads: MedusaHeads, meta: dict[str, Any]) -> None:
    """Write heads to safetensors; `meta` (model name, vocab size, acceptance...) goes in the header."""
    header = {"format": FORMAT, "hidden_size": str(heads.hidden_size), "num_heads": str(heads.num_heads)}
    header["meta"] = json.dumps(meta)
    tensors = {"weight": heads.weight.detach().contiguous(), "bias": heads.bias.detach().contiguous()}
    save_file(tensors, str(path), metadata=header)


def load_heads(path: str | Path, hidden_size: int, vocab_size: int) -> tuple[MedusaHeads, dict[str, Any]]:
    """Read heads and check they fit a model with this hidden size and vocabulary."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no such heads file: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            weight, bias = f.get_tensor("weight"), f.get_tensor("bias")
    except Exception as exc:  # safetensors raises several types for a bad file
        raise ModelLoadError(f"{path.name} is not a Medusa heads file: {str(exc).splitlines()[0]}") from exc
    if header.get("format") != FORMAT:
        raise ModelLoadError(f"{path.name} is not a specgraph Medusa heads file (format {header.get('format')!r})")
    meta = json.loads(header.get("meta", "{}"))
    if int(header["hidden_size"]) != hidden_size:
        raise InputError(
            f"{path.name} was trained for hidden size {header['hidden_size']} ({meta.get('model', '?')}), "
            f"but this model's hidden size is {hidden_size}"
        )
    if meta.get("vocab_size") not in (None, vocab_size):
        raise InputError(
            f"{path.name} was trained for a vocabulary of {meta['vocab_size']} ({meta.get('model', '?')}), "
            f"but this model's vocabulary is {vocab_size}"
        )
    heads = MedusaHeads(hidden_size, int(header["num_heads"]))
    with torch.no_grad():
        heads.weight.copy_(weight)
        heads.bias.copy_(bias)
    return heads, meta
