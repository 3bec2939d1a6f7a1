"""Stage 3: recognise the parts of a decoder LM in its ATen graph.

Finds the token embedding, the decoder blocks, every attention site (SDPA) with its key and
value sources before any grouped-query repeat, where positions come from (an `arange` that
feeds rotary tables or a position-embedding lookup), how each site is masked, the final norm
and the LM head. Each failure names what is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from specgraph.errors import AnatomyError

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")
# Ops that carry an integer position tensor forward without changing what it means.
_POSITION_CARRIERS = {
    aten.add.Tensor,
    aten.unsqueeze.default,
    aten.expand.default,
    aten.view.default,
    aten.reshape.default,
    aten.clone.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
}
_ROTARY_OR_LOOKUP = {aten.cos.default, aten.sin.default, aten.embedding.default, aten.index.Tensor}
_FEEDS_THROUGH = {
    aten.alias.default,
    aten.clone.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.view.default,
    aten.reshape.default,
}


@dataclass
class AttentionSite:
    """One SDPA call: its inputs, the un-repeated key/value sources and its layer."""

    node: torch.fx.Node
    layer: int
    query: torch.fx.Node
    key_source: torch.fx.Node  # [B, Hkv, T, D]
    value_source: torch.fx.Node  # [B, Hkv, T, D]
    scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None


@dataclass
class Anatomy:
    embedding: torch.fx.Node
    position_source: torch.fx.Node  # an integer [1 or B, T] tensor of positions
    position_kind: str  # "rotary" | "learned"
    sites: list[AttentionSite]
    final_norm: str
    lm_head: torch.fx.Node
    lm_head_module: str
    vocab_size: int
    hidden_size: int
    notes: list[str] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.sites)

    def summary(self) -> dict[str, Any]:
        """A JSON-ready description for `specgraph inspect`."""
        site = self.sites[0]
        return {
            "embedding": _module_path(self.embedding) or self.embedding.name,
            "decoder_blocks": self.num_layers,
            "attention": {
                "kind": "sdpa",
                "num_heads": site.num_heads,
                "num_kv_heads": site.num_kv_heads,
                "head_dim": site.head_dim,
                "sliding_window_layers": [s.layer for s in self.sites if s.sliding_window],
                "sliding_window": next((s.sliding_window for s in self.sites if s.sliding_window), None),
            },
            "positions": {"kind": self.position_kind, "source": self.position_source.name},
            "causal_mask": "causal (replaced by an engine input)",
            "final_norm": self.final_norm,
            "lm_head": self.lm_head_module,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "notes": self.notes,
        }


def _module_stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    stack = node.meta.get("nn_module_stack") or {}
    return [(path, str(cls)) for path, cls in stack.values()]


def _module_path(node: torch.fx.Node) -> str:
    stack = _module_stack(node)
    return stack[-1][0] if stack else ""


def _layer_of(node: torch.fx.Node) -> int | None:
    for path, _ in reversed(_module_stack(node)):
        match = _LAYER_RE.search(path)
        if match:
            return int(match.group(1))
    return None


def _shape(node: Any) -> tuple[Any, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _unrepeat(node: torch.fx.Node) -> torch.fx.Node:
    """Undo Hugging Face's `repeat_kv` (unsqueeze -> expand -> reshape), if present."""
    if node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        inner = node.args[0]
        if isinstance(inner, torch.fx.Node) and inner.target == aten.expand.default:
            src = inner.args[0]
            if isinstance(src, torch.fx.Node) and src.target == aten.unsqueeze.default:
                return src.args[0]  # type: ignore[return-value]
    return node


def _find_sites(gm: torch.fx.GraphModule, hf_config: dict | None) -> list[AttentionSite]:
    sdpa_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _SDPA]
    if not sdpa_nodes:
        raise AnatomyError(
            "no attention site found: the graph has no scaled_dot_product_attention "
            "(trace the model with attn_implementation='sdpa')"
        )
    windows = _sliding_windows(hf_config)
    sites = []
    for index, node in enumerate(sdpa_nodes):
        site = _site_from_sdpa(node, index, windows)
        sites.append(site)
    masks = {_mask_arg(s.node) for s in sites}
    if len(masks) > 1 and not any(s.sliding_window for s in sites):
        raise AnatomyError(
            f"attention sites use {len(masks)} different masks (sliding-window attention?) and "
            "the window is unknown: compile from the Hugging Face folder or GGUF so the config names it"
        )
    return sites


def _mask_arg(node: torch.fx.Node) -> Any:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _site_from_sdpa(node: torch.fx.Node, index: int, windows: dict[int, int]) -> AttentionSite:
    q, k, v = node.args[:3]
    layer = _layer_of(node)
    layer = index if layer is None else layer
    is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    if _mask_arg(node) is None and not is_causal:
        raise AnatomyError(f"attention in block {layer} has neither a mask nor is_causal: not a decoder")
    k_src, v_src = _unrepeat(k), _unrepeat(v)  # type: ignore[arg-type]
    q_shape, k_shape = _shape(q), _shape(k_src)
    if q_shape is None or k_shape is None or len(q_shape) != 4 or len(k_shape) != 4:
        raise AnatomyError(f"attention in block {layer}: query/key are not [B, H, T, D] tensors")
    heads, kv_heads, head_dim = int(q_shape[1]), int(k_shape[1]), int(q_shape[3])
    if heads % kv_heads:
        raise AnatomyError(f"attention in block {layer}: {heads} query heads do not group onto {kv_heads} KV heads")
    scale = node.kwargs.get("scale")
    scale = float(scale) if isinstance(scale, (int, float)) else head_dim**-0.5
    return AttentionSite(node, layer, q, k_src, v_src, scale, heads, kv_heads, head_dim, windows.get(layer))  # type: ignore[arg-type]


def _sliding_windows(hf_config: dict | None) -> dict[int, int]:
    """Layer index -> window, for configs that declare sliding-window layers."""
    if not hf_config:
        return {}
    window = hf_config.get("sliding_window")
    kinds = hf_config.get("layer_types") or []
    if not window:
        return {}
    return {i: int(window) for i, kind in enumerate(kinds) if kind == "sliding_attention"}


def _find_positions(gm: torch.fx.GraphModule, input_ids: torch.fx.Node) -> tuple[torch.fx.Node, str]:
    """The first rank-2 integer tensor derived from an `arange` that reaches rotary or a lookup."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (aten.arange.default, aten.arange.start):
            continue
        chain = _carrier_chain(node)
        for cand in chain:
            shape = _shape(cand)
            if shape is not None and len(shape) == 2:
                kind = _position_use(cand, input_ids)
                if kind:
                    return cand, kind
    raise AnatomyError(
        "no position source found: no arange over the sequence reaches rotary tables or a position embedding"
    )


def _carrier_chain(start: torch.fx.Node) -> list[torch.fx.Node]:
    chain, frontier = [start], [start]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and user.target in _POSITION_CARRIERS and user not in chain:
                if user.target == aten.add.Tensor and any(isinstance(a, torch.fx.Node) for a in user.args[1:]):
                    continue
                chain.append(user)
                frontier.append(user)
    return chain


def _position_use(node: torch.fx.Node, input_ids: torch.fx.Node, depth: int = 12) -> str | None:
    """Does `node` reach cos/sin (rotary) or an embedding lookup other than the token embedding?"""
    frontier, seen = [(node, 0)], set()
    while frontier:
        cur, d = frontier.pop()
        for user in cur.users:
            if user in seen or user.op != "call_function" or user.target == _SDPA:
                continue
            seen.add(user)
            if user.target in (aten.cos.default, aten.sin.default):
                return "rotary"
            if user.target == aten.embedding.default and user.args[1] is cur:
                return "learned"
            if d < depth:
                frontier.append((user, d + 1))
    return None


def _find_lm_head(gm: torch.fx.GraphModule) -> torch.fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node = out.args[0][0]
    for _ in range(16):
        if node.target in (aten.linear.default, aten.matmul.default, aten.mm.default):
            return node
        parents = [a for a in node.all_input_nodes if _shape(a) is not None]
        if not parents:
            break
        node = parents[0]
    raise AnatomyError("no LM head found: the logits are not produced by a linear layer")


def _final_norm(lm_head: torch.fx.Node) -> str:
    src = lm_head.args[0]
    while isinstance(src, torch.fx.Node) and src.target in _FEEDS_THROUGH:
        src = src.args[0]
    if isinstance(src, torch.fx.Node) and _module_stack(src):
        path, cls = _module_stack(src)[-1]  # the innermost module that produced the hidden state
        name = cls.rsplit(".", 1)[-1]
        is_norm_op = src.target in (aten.layer_norm.default, aten.rms_norm.default)
        named_norm = bool(path) and ("norm" in name.lower() or path.rsplit(".", 1)[-1].startswith(("ln", "norm")))
        if is_norm_op or named_norm:
            return f"{path} ({name})"
    raise AnatomyError("no final norm found before lm_head: the LM head reads an un-normalised hidden state")


def analyze(gm: torch.fx.GraphModule, hf_config: dict | None = None) -> Anatomy:
    """Recognise the decoder's parts; raise AnatomyError naming the first missing one."""
    input_ids = next(n for n in gm.graph.nodes if n.op == "placeholder")
    readers = [input_ids] + [u for u in input_ids.users if u.target in (aten.view.default, aten.reshape.default)]
    embeds = [u for r in readers for u in r.users if u.target == aten.embedding.default and u.args[1] is r]
    if not embeds:
        raise AnatomyError("no token embedding found: nothing looks up input_ids in an embedding table")
    sites = _find_sites(gm, hf_config)
    positions, kind = _find_positions(gm, input_ids)
    lm_head = _find_lm_head(gm)
    norm = _final_norm(lm_head)
    logits = _shape(lm_head)
    weight = lm_head.args[1]
    hidden = int(_shape(weight)[1]) if _shape(weight) else int(logits[-1])  # type: ignore[index]
    notes = []
    tied = isinstance(weight, torch.fx.Node) and weight.target == embeds[0].args[0].target
    if tied:
        notes.append("lm_head is tied to the token embedding")
    return Anatomy(
        embedding=embeds[0],
        position_source=positions,
        position_kind=kind,
        sites=sites,
        final_norm=norm,
        lm_head=lm_head,
        lm_head_module=_module_path(lm_head) or lm_head.name,
        vocab_size=int(logits[-1]),  # type: ignore[index]
        hidden_size=hidden,
        notes=notes,
    )
