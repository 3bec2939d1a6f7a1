"""Custom operators the passes insert, with their eager, fake and ONNX forms.

`kv_write` writes a block of new keys or values into a preallocated cache at each row's
current length. In ONNX it becomes `TensorScatter` (opset 24), which ONNX Runtime updates in
place when the host binds the output to the input buffer, so a step never copies the cache.

`draft_stop` marks where a drafter may stop early: the `torch.where`s on its result choose
between the later draft steps' values and what stopping leaves. Eagerly it is the identity (both
sides are computed); in ONNX it is a `DraftStop` node that `exporters/draft_stop.py` replaces,
with those `Where`s, by an `If` whose `then` branch holds the later steps, so they run only
when the condition holds.
"""

from __future__ import annotations

from typing import Any

import onnxscript
import torch
from onnx import defs

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


@torch.library.custom_op("specgraph::cache_attention", mutates_args=())
def cache_attention(
    q: torch.Tensor,  # [B, H, T, D]
    k_t: torch.Tensor,  # [B, Hkv, D, S]  keys stored transposed so no step copies the cache
    v: torch.Tensor,  # [B, Hkv, S, D]
    mask: torch.Tensor,  # [B, 1, T, S] bool, True where a query may attend
    span: torch.Tensor,  # [1] int64: slots [0, span) hold every key any query may see
    scale: float,
) -> torch.Tensor:
    """Masked attention over the first `span` cache slots. Query heads are grouped onto their
    KV head (GQA) by reshaping the queries, never by repeating the cache. Slots past `span` are
    masked anyway, so the result equals attention over the whole cache; reading only the span
    makes a step's attention cost follow the context length instead of the cache size."""
    end = int(span[0])
    b, h, t, d = q.shape
    h_kv = k_t.shape[1]
    group = h // h_kv
    q_g = q.reshape(b, h_kv, group * t, d)  # [B, Hkv, G*T, D]: rows ordered (g, t)
    scores = torch.matmul(q_g, k_t[..., :end]) * scale  # [B, Hkv, G*T, W]
    visible = mask[..., :end].repeat(1, 1, group, 1)  # [B, 1, G*T, W]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v[:, :, :end])  # [B, Hkv, G*T, D]
    return out.reshape(b, h, t, d)


@cache_attention.register_fake
def _cache_attention_fake(q, k_t, v, mask, span, scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)


def _cache_attention_onnx(q, k_t, v, mask, span, scale: float):  # type: ignore[no-untyped-def]
    op = _OPSET24
    zero = op.Constant(value_ints=[0])
    k_w = op.Slice(k_t, zero, span, op.Constant(value_ints=[3]))  # [B, Hkv, D, W]
    v_w = op.Slice(v, zero, span, op.Constant(value_ints=[2]))  # [B, Hkv, W, D]
    m_w = op.Slice(mask, zero, span, op.Constant(value_ints=[3]))  # [B, 1, T, W]
    q_shape = op.Shape(q)
    h_kv = op.Shape(k_t, start=1, end=2)
    head_dim = op.Shape(q, start=3, end=4)
    group = op.Div(op.Shape(q, start=1, end=2), h_kv)
    q_g = op.Reshape(q, op.Concat(op.Constant(value_ints=[0]), h_kv, op.Constant(value_ints=[-1]), head_dim, axis=0))
    scores = op.Mul(op.MatMul(q_g, k_w), op.CastLike(op.Constant(value_float=scale), q))  # [B, Hkv, G*T, W]
    visible = op.Tile(m_w, op.Concat(op.Constant(value_ints=[1, 1]), group, op.Constant(value_ints=[1]), axis=0))
    neg_inf = op.CastLike(op.Constant(value_float=float("-inf")), q)
    probs = op.Softmax(op.Where(visible, scores, neg_inf), axis=-1)
    return op.Reshape(op.MatMul(probs, v_w), q_shape)  # [B, H, T, D]


@torch.library.custom_op("specgraph::draft_stop", mutates_args=())
def draft_stop(go: torch.Tensor, step: int) -> torch.Tensor:
    """`go` (a 0-d bool: the drafter goes on after its draft `step`), marked for the export."""
    return go.clone()


@draft_stop.register_fake
def _draft_stop_fake(go: torch.Tensor, step: int) -> torch.Tensor:
    return torch.empty_like(go)


STOP_DOMAIN = "specgraph.stop"  # only ever in a staged graph: exporters/draft_stop.py removes it
_STOP = onnxscript.values.Op(
    onnxscript.values.Opset(STOP_DOMAIN, 1),
    "DraftStop",
    defs.OpSchema(
        "DraftStop", STOP_DOMAIN, 1,
        inputs=[defs.OpSchema.FormalParameter("go", "tensor(bool)")],
        outputs=[defs.OpSchema.FormalParameter("marked", "tensor(bool)")],
        attributes=[defs.OpSchema.Attribute("step", defs.OpSchema.AttrType.INT, "the draft after which it may stop")],
    ),
)  # fmt: skip


def _draft_stop_onnx(go, step: int):  # type: ignore[no-untyped-def]
    return _STOP(go, step=step)


ONNX_TRANSLATIONS: dict[Any, Any] = {
    torch.ops.specgraph.kv_write.default: _kv_write_onnx,
    torch.ops.specgraph.cache_attention.default: _cache_attention_onnx,
    torch.ops.specgraph.draft_stop.default: _draft_stop_onnx,
}


def compact_update(
    past: torch.Tensor,  # [B, Hkv, D, S] (axis -1) or [B, Hkv, S, D] (axis -2)
    update: torch.Tensor,  # this call's new entries, T along `axis`
    path_src: torch.Tensor,  # [B, P] cache slots of last round's accepted nodes
    n_path: torch.Tensor,  # [B] how many of them are real
    axis: int,
) -> torch.Tensor:
    """The block to write at `cache_len`: the accepted path's entries, then the new ones."""
    b, h_kv = past.shape[0], past.shape[1]
    p = path_src.shape[1]
    if axis == -1:
        d = past.shape[2]
        src = path_src[:, None, None, :].expand(b, h_kv, d, p)
    else:
        d = past.shape[3]
        src = path_src[:, None, :, None].expand(b, h_kv, p, d)
    moved = past.gather(axis, src)  # [.., P ..] read before this call's write
    both = torch.cat([moved, update], dim=axis)  # [.., P + T ..]
    width = both.shape[axis]
    j = torch.arange(width, dtype=torch.int64)[None, :]  # [1, P+T]
    order = torch.where(j < n_path[:, None], j, j - n_path[:, None] + p).clamp(max=width - 1)  # [B, P+T]
    if axis == -1:
        idx = order[:, None, None, :].expand(b, h_kv, d, width)
    else:
        idx = order[:, None, :, None].expand(b, h_kv, width, d)
    return both.gather(axis, idx)
