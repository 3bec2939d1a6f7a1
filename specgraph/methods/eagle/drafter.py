"""The EAGLE drafter: one decoder layer that reads [token embedding; target feature] and predicts
the target's next feature, read out by (rows of) the target's own LM head.

Entry j pairs the target's feature f_j (the LM head's input at position j, after the final norm)
with the embedding of token x_{j+1}; the layer predicts f_{j+1}, and the LM head's reading of it
proposes x_{j+2}. Drafting further feeds the predicted feature back with the drafted token.

    u = fc([rms(e); rms(f)])               fc: [H, 2H]
    a = u + attn(rms(u))                   rotary positions, the layer's own KV cache
    f' = rms_out(a + mlp(rms(a)))          SwiGLU, the target's intermediate size

The same weights run two ways: `sequence` (training: causal attention over whole sequences, no
cache) and `step` (the engine: new entries written into a preallocated cache with the shared
`specgraph::kv_write` / `specgraph::cache_attention` ops, as the target's layers are).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specgraph.errors import InputError, ModelLoadError

FORMAT = "specgraph-eagle-1"


@dataclass(frozen=True)
class Shape:
    """The drafter's sizes: the target's hidden size and vocabulary, the layer's attention heads."""

    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @classmethod
    def for_model(cls, config: Any, hidden: int, vocab: int) -> Shape:
        """The layer sized like one of the target's own (a config without those fields: 4 heads)."""
        heads = int(getattr(config, "num_attention_heads", 4) or 4)
        if hidden % heads:
            heads = 1
        kv = int(getattr(config, "num_key_value_heads", heads) or heads)
        kv = kv if heads % kv == 0 else heads
        inter = int(getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden)
        theta = float(getattr(config, "rope_theta", None) or 10000.0)
        return cls(hidden, vocab, heads, kv, hidden // heads, inter, theta,
                   float(getattr(config, "rms_norm_eps", 1e-5) or 1e-5))  # fmt: skip


class EagleDrafter(torch.nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape = shape
        h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(2 * h, h)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = lin(h, q), lin(h, kv), lin(h, kv), lin(q, h)
        self.gate_proj, self.up_proj = lin(h, shape.intermediate), lin(h, shape.intermediate)
        self.down_proj = lin(shape.intermediate, h)
        self.norms = torch.nn.Parameter(torch.ones(5, h))  # embedding, feature, attention, mlp, output
        half = torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (shape.rope_theta**half), persistent=False)
        self.qkv_proj: torch.nn.Linear | None = None  # q, k, v in one product (`pack`, for the engine)
        self.gate_up_proj: torch.nn.Linear | None = None  # gate and up in one product
        self.meta: dict[str, Any] = {}  # a loaded file's header: model, training figures
        self.vocab: tuple[torch.Tensor, dict[str, Any]] | None = None  # a reduced draft vocabulary (compile)

    def pack(self) -> None:
        """Run q, k, v as one product and gate, up as another (the same values, row for row): the
        export then reads the packed q/k/v in the fused attention and folds the SwiGLU into the
        down product, as it does for the target's layers (fewer nodes a call)."""
        packs = {"qkv_proj": (self.q_proj, self.k_proj, self.v_proj), "gate_up_proj": (self.gate_proj, self.up_proj)}
        for name, parts in packs.items():
            weight = torch.cat([p.weight.detach() for p in parts])
            packed = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            packed.weight = torch.nn.Parameter(weight, requires_grad=False)
            setattr(self, name, packed)

    def _rms(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.norms[i], self.shape.eps)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [B, heads, W, D] at positions [B, W] (Llama's half-split form, in
        Hugging Face's arithmetic, so the export's rotary and cached-attention fusions take it)."""
        freqs = positions[:, :, None].to(torch.float32) * self.inv_freq  # [B, W, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [B, W, D]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [B, 1, W, D]
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def _qkv(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor):  # type: ignore[no-untyped-def]
        s = self.shape
        b, w = emb.shape[0], emb.shape[1]
        u = self.fc(torch.cat([self._rms(emb, 0), self._rms(feat, 1)], dim=-1))  # [B, W, H]
        x = self._rms(u, 2)
        if self.qkv_proj is not None:
            kv = s.kv_heads * s.head_dim
            q, k, v = self.qkv_proj(x).split([s.heads * s.head_dim, kv, kv], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, w, s.heads, s.head_dim).transpose(1, 2)  # [B, Hq, W, D]
        k = k.reshape(b, w, s.kv_heads, s.head_dim).transpose(1, 2)  # [B, Hkv, W, D]
        v = v.reshape(b, w, s.kv_heads, s.head_dim).transpose(1, 2)
        return u, self._rotate(q, positions), self._rotate(k, positions), v

    def _out(self, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, w, _ = attn.shape
        a = u + self.o_proj(attn.transpose(1, 2).reshape(b, w, -1))
        x = self._rms(a, 3)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split([self.shape.intermediate, self.shape.intermediate], -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        a = a + self.down_proj(torch.nn.functional.silu(gate) * up)
        return self._rms(a, 4)

    def sequence(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """Predicted features [B, T, H] of whole sequences (entry j at position j), for training."""
        b, t = emb.shape[0], emb.shape[1]
        positions = torch.arange(t)[None, :].expand(b, t)
        u, q, k, v = self._qkv(emb, feat, positions)
        group = self.shape.heads // self.shape.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self._out(u, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))

    def step(self, emb, feat, positions, mask, write_at, span, k_cache, v_cache):  # type: ignore[no-untyped-def]
        """Entries [B, W] at consecutive `positions` [B, W] from `write_at` [B]: their predicted
        features [B, W, H] and the caches (keys [B, Hkv, D, S], values [B, Hkv, S, D]) with
        them written; `mask` [B, 1, W, S] says which slots each may see."""
        u, q, k, v = self._qkv(emb, feat, positions)
        k_cache = torch.ops.specgraph.kv_write(k_cache, k.transpose(2, 3), write_at, -1)
        v_cache = torch.ops.specgraph.kv_write(v_cache, v, write_at, -2)
        attn = torch.ops.specgraph.cache_attention(q, k_cache, v_cache, mask, span, self.shape.head_dim**-0.5)
        return self._out(u, attn), k_cache, v_cache

    def cache_shapes(self, slots: int) -> list[tuple[int, ...]]:
        s = self.shape
        return [(s.kv_heads, s.head_dim, slots), (s.kv_heads, slots, s.head_dim)]


def save_drafter(path: str | Path, drafter: EagleDrafter, meta: dict[str, Any]) -> None:
    """Write the drafter in bfloat16 (half the bytes; the engine computes in float32) with its
    shape and `meta` (model, fingerprint, training figures, the command) in the header."""
    header = {"format": FORMAT, "shape": json.dumps(asdict(drafter.shape)), "meta": json.dumps(meta)}
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(path), metadata=header)


def load_drafter(path: str | Path, hidden: int, vocab: int) -> EagleDrafter:
    """Read a drafter and check it was made for a model with this hidden size and vocabulary."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no such EAGLE drafter file: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        shape = Shape(**json.loads(header["shape"])) if header.get("format") == FORMAT else None
        meta = json.loads(header.get("meta", "{}"))
    except Exception as exc:  # safetensors and json raise several types for a bad file
        raise ModelLoadError(f"{path.name} is not an EAGLE drafter file: {str(exc).splitlines()[0]}") from exc
    if shape is None:
        raise ModelLoadError(f"{path.name} is not a specgraph EAGLE drafter (format {header.get('format')!r})")
    who = meta.get("model", "?")
    if shape.hidden != hidden:
        raise InputError(f"{path.name} was trained for hidden size {shape.hidden} ({who}), this model's is {hidden}")
    if shape.vocab != vocab:
        raise InputError(f"{path.name} was trained for a vocabulary of {shape.vocab} ({who}), this model's is {vocab}")
    drafter = EagleDrafter(shape)
    try:
        drafter.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()})
    except RuntimeError as exc:
        raise ModelLoadError(f"{path.name}: its tensors do not match its shape: {str(exc).splitlines()[0]}") from exc
    drafter.meta = meta
    return drafter
