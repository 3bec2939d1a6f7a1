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
    """K heads; by default read out through the target's LM head. With `lm_heads` (a copy of the
    LM head per Medusa head, [K, V, H], as in Medusa-1) each head has its own readout: more
    accurate heads, but every step then reads K more vocabulary matrices."""

    def __init__(self, hidden_size: int, num_heads: int = 4, lm_heads: torch.Tensor | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.weight = torch.nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))  # [K, out, in]
        self.bias = torch.nn.Parameter(torch.zeros(num_heads, hidden_size))  # [K, H]
        self.lm_heads = None if lm_heads is None else torch.nn.Parameter(lm_heads.clone())  # [K, V, H]
        self.meta: dict[str, Any] = {}  # a loaded file's header: model, training figures, measured acceptance
        self.vocab: tuple[torch.Tensor, dict[str, Any]] | None = None  # a reduced draft vocabulary (compile)

    def readout(self, h: torch.Tensor, shared: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Head states h [..., K, H] -> logits [..., K, V], through `shared` [V, H] or own LM heads
        (their `rows` only, when given: a reduced vocabulary that `shared` already holds)."""
        if self.lm_heads is None:
            return h @ shared.T
        own = self.lm_heads if rows is None else self.lm_heads[:, rows]  # [K, V, H]
        return torch.einsum("...kh,kvh->...kv", h, own)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., K, H]"""
        proj = torch.matmul(x[..., None, None, :], self.weight.transpose(-1, -2))[..., 0, :]  # [..., K, H]
        return x[..., None, :] + torch.nn.functional.silu(proj + self.bias)


def save_heads(path: str | Path, heads: MedusaHeads, meta: dict[str, Any]) -> None:
    """Write heads to safetensors; `meta` (model name, vocab size, acceptance...) goes in the header."""
    header = {"format": FORMAT, "hidden_size": str(heads.hidden_size), "num_heads": str(heads.num_heads)}
    header["meta"] = json.dumps(meta)
    tensors = {"weight": heads.weight.detach().contiguous(), "bias": heads.bias.detach().contiguous()}
    if heads.lm_heads is not None:
        tensors["lm_heads"] = heads.lm_heads.detach().contiguous()
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
            lm_heads = f.get_tensor("lm_heads") if "lm_heads" in f.keys() else None
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
    if lm_heads is not None and tuple(lm_heads.shape[1:]) != (vocab_size, hidden_size):
        raise InputError(
            f"{path.name} has LM heads for a vocabulary of {lm_heads.shape[1]}, this model has {vocab_size}"
        )
    heads = MedusaHeads(hidden_size, int(header["num_heads"]), lm_heads)
    with torch.no_grad():
        heads.weight.copy_(weight)
        heads.bias.copy_(bias)
    heads.meta = meta
    return heads, meta
