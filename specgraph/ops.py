"""Custom operators the passes insert, with their eager, fake and ONNX forms.

`kv_write` writes a block of new keys or values into a preallocated cache at each row's
current length. In ONNX it becomes `TensorScatter` (opset 24), which ONNX Runtime updates in
place when the host binds the output to the input buffer, so a step never copies the cache.
"""

from __future__ import annotations

import onnxscript
import torch

_OPSET24 = onnxscript.values.Opset("", 24)


@torch.library.custom_op("specgraph::kv_write", mutates_args=())
def kv_write(cache: torch.Tensor, update: torch.Tensor, write_pos: torch.Tensor, axis: int) -> torch.Tensor:
    """Return `cache` with `update` written at `write_pos[b]` along `axis` for each row b."""
    out = cache.clone()
    axis = axis % cache.dim()
    length = update.shape[axis]
    for b in range(cache.shape[0]):
        start = int(write_pos[b])
        out[b].narrow(axis - 1, start, length).copy_(update[b])
    return out


@kv_write.register_fake
def _kv_write_fake(cache: torch.Tensor, update: torch.Tensor, write_pos: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.empty_like(cache)


def _kv_write_onnx(cache, update, write_pos, axis: int):  # type: ignore[no-untyped-def]
    return _OPSET24.TensorScatter(cache, update, write_pos, axis=axis, mode="linear")


ONNX_TRANSLATIONS = {torch.ops.specgraph.kv_write.default: _kv_write_onnx}


def grouped_attention(
    q: torch.Tensor,  # [B, H, T, D]
    k_t: torch.Tensor,  # [B, Hkv, D, S]  keys stored transposed so no step copies the cache
    v: torch.Tensor,  # [B, Hkv, S, D]
    mask: torch.Tensor,  # [B, 1, T, S] bool, True where a query may attend
    scale: float,
) -> torch.Tensor:
    """Masked attention over the whole cache; query heads are grouped onto their KV head (GQA)
    by reshaping the queries, never by repeating the cache."""
    b, h, t, d = q.shape
    h_kv = k_t.shape[1]
    s = k_t.shape[-1]
    group = h // h_kv
    q_g = q.reshape(b, h_kv, group * t, d)  # [B, Hkv, G*T, D]
    scores = torch.matmul(q_g, k_t) * scale  # [B, Hkv, G*T, S]
    scores = scores.view(b, h_kv, group, t, s)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask [B, 1, 1, T, S]
    probs = torch.softmax(scores, dim=-1).view(b, h_kv, group * t, s)
    out = torch.matmul(probs, v)  # [B, Hkv, G*T, D]
    return out.view(b, h, t, d)
