"""The early-exit drafter as a model of the target's own architecture, and its adapter file.

Kangaroo's adapter reads the target's hidden state after layer E and stands in for layers
E+1..L: one attention layer with its input norm, then a final norm, read out by the target's LM
head. Here it is a decoder layer of the target's own class whose MLP is `NoMLP` (it returns
zeros, so the layer adds nothing after its attention; its weights do not exist), so the drafter is
an ordinary model of the target's class with E + 1 layers:

    layers 1..E   the target's own (copied at compile time, never trained or shipped)
    layer E + 1   the adapter: input norm + attention (+ the norms the architecture puts around
                  them; Llama's post-attention norm only fed the MLP, so it is computed for nothing
                  in eager and removed from the exported graph as dead code)
    final norm    the adapter's own (initialised from the target's)
    embedding, LM head   the target's

so `specgraph.loaders`, capture, anatomy and the draft-model engine (`methods/draft.py`) run it
unchanged. Its extra cost per draft token over E target layers is one attention block (4 H^2
multiply-adds for Llama's q, k, v, o at full heads, less with grouped KV) plus the LM head readout.

The file (`specgraph train --method early-exit`) holds only the adapter: `layer.*` (layer E + 1
without its MLP) and `norm.*`, in bfloat16, with the target's fingerprint and sizes, the exit
layer and the training figures in its header.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specgraph.errors import InputError, ModelLoadError

FORMAT = "specgraph-early-exit-1"


class NoMLP(torch.nn.Module):
    """The adapter layer's MLP: nothing (zeros of its input's shape, which read no input value,
    so the exported graph computes neither this nor the norm that fed it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)


def parts(hf: Any, name: str) -> tuple[Any, torch.nn.ModuleList, str]:
    """(the decoder, its layers, the final norm's attribute name) of a rotary decoder-only HF
    model (Llama, Qwen2, Gemma 3, SmolLM2 ...), or InputError."""
    base = getattr(hf, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not isinstance(getattr(base, "norm", None), torch.nn.Module) \
            or not hasattr(base, "rotary_emb") or not all(hasattr(layer, "mlp") for layer in layers):  # fmt: skip
        kind = getattr(getattr(hf, "config", None), "model_type", "?")
        raise InputError(f"--method early-exit needs a rotary decoder with model.layers and model.norm (Llama, "
                         f"Qwen2, Gemma 3); {name} is {kind}")  # fmt: skip
    return base, layers, "norm"


def check_exit_layer(exit_layer: int, num_layers: int) -> None:
    if not 1 <= exit_layer < num_layers:
        raise InputError(f"--exit-layer must be between 1 and {num_layers - 1} (the target has {num_layers} "
                         f"layers), got {exit_layer}")  # fmt: skip


def _config(hf: Any, keep: list[int]) -> Any:
    """The target's config with only the layers `keep` (their per-layer types too)."""
    config = copy.deepcopy(hf.config)
    types = getattr(config, "layer_types", None)
    config.num_hidden_layers = len(keep)
    if isinstance(types, list):
        config.layer_types = [types[i] for i in keep]
    return config


def adapter_init(hf: Any, exit_layer: int) -> dict[str, torch.Tensor]:
    """A new adapter's weights: the target's layer E + 1 (without its MLP) and final norm."""
    base, layers, norm = parts(hf, "the target")
    state = {f"layer.{k}": v for k, v in layers[exit_layer].state_dict().items() if not k.startswith("mlp.")}
    state.update({f"norm.{k}": v for k, v in getattr(base, norm).state_dict().items()})
    return {k: v.detach().to(torch.float32).clone() for k, v in state.items()}


def adapter_model(hf: Any, exit_layer: int, adapter: dict[str, torch.Tensor]) -> Any:
    """A one-layer model of the target's class that is the adapter alone (for training): fed the
    hidden states after layer E as `inputs_embeds`, its last hidden state is the drafter's feature."""
    model = type(hf)(_config(hf, [exit_layer]))
    base, layers, norm = parts(model, "the target")
    layers[0].mlp = NoMLP()
    _load_adapter_into(layers[0], getattr(base, norm), adapter)
    return model.eval()


def exit_model(hf: Any, exit_layer: int, adapter: dict[str, torch.Tensor]) -> Any:
    """The drafter: a model of the target's class with its first E layers, the adapter as layer
    E + 1 and the adapter's final norm; its embedding and LM head are the target's."""
    _, layers, _ = parts(hf, "the target")
    model = type(hf)(_config(hf, list(range(exit_layer + 1))))
    base, own, norm = parts(model, "the target")
    own[exit_layer].mlp = NoMLP()
    state = hf.state_dict()
    prefix = re.compile(r"^model\.layers\.(\d+)\.")
    kept = {k: v for k, v in state.items() if not (m := prefix.match(k)) or int(m.group(1)) < exit_layer}
    missing, unexpected = model.load_state_dict(kept, strict=False)
    assert not unexpected, unexpected
    _load_adapter_into(own[exit_layer], getattr(base, norm), adapter)
    left = [k for k in missing if not k.startswith((f"model.layers.{exit_layer}.", f"model.{norm}."))]
    assert not left, f"weights the target did not give the drafter: {left[:3]}"
    return model.eval().requires_grad_(False)


def _load_adapter_into(layer: torch.nn.Module, norm: torch.nn.Module, adapter: dict[str, torch.Tensor]) -> None:
    own = {k.removeprefix("layer."): v for k, v in adapter.items() if k.startswith("layer.")}
    final = {k.removeprefix("norm."): v for k, v in adapter.items() if k.startswith("norm.")}
    try:
        layer.load_state_dict({k: v.to(torch.float32) for k, v in own.items()}, strict=True)
        norm.load_state_dict({k: v.to(torch.float32) for k, v in final.items()}, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(
            f"the adapter's tensors do not fit this model's layer: {str(exc).splitlines()[0]}"
        ) from exc


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """A trained one-layer `adapter_model`'s weights as the file stores them."""
    base, layers, norm = parts(model, "the adapter")
    state = {f"layer.{k}": v for k, v in layers[0].state_dict().items()}
    state.update({f"norm.{k}": v for k, v in getattr(base, norm).state_dict().items()})
    return state


def save_adapter(path: str | Path, adapter: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write the adapter in bfloat16 (the engine computes in float32) with `meta` in the header
    (model, fingerprint, exit_layer, hidden_size, vocab_size, num_layers, the training figures and
    the command)."""
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in adapter.items()}
    save_file(tensors, str(path), metadata={"format": FORMAT, "meta": json.dumps(meta)})


def load_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An adapter file's tensors and header, or a one-line ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no such early-exit adapter file: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(header.get("meta", "{}"))
    except Exception as exc:  # safetensors and json raise several types for a bad file
        raise ModelLoadError(f"{path.name} is not an early-exit adapter file: {str(exc).splitlines()[0]}") from exc
    if header.get("format") != FORMAT or not isinstance(meta, dict):
        raise ModelLoadError(f"{path.name} is not a specgraph early-exit adapter (format {header.get('format')!r})")
    for key in ("exit_layer", "hidden_size", "vocab_size", "num_layers"):
        if not isinstance(meta.get(key), int):
            raise ModelLoadError(f"{path.name} is not a complete early-exit adapter: its header has no {key}")
    return tensors, meta


def check_fits(name: str, meta: dict[str, Any], hidden: int, vocab: int, num_layers: int, fingerprint: str | None,
               exit_layer: int | None, model: str) -> None:  # fmt: skip
    """One line unless the adapter was trained for this model and this exit layer."""
    who = meta.get("model", "?")
    for key, have, what in (("hidden_size", hidden, "hidden size"), ("vocab_size", vocab, "vocabulary"),
                            ("num_layers", num_layers, "layer count")):  # fmt: skip
        if meta[key] != have:
            raise InputError(f"{name} was trained for a model of {what} {meta[key]} ({who}), {model}'s is {have}")
    if fingerprint and meta.get("fingerprint") not in (None, fingerprint):
        raise InputError(f"{name} was trained for another model ({who}), not {model}: its fingerprint differs; "
                         "train one with `specgraph train --method early-exit`")  # fmt: skip
    if exit_layer is not None and exit_layer != meta["exit_layer"]:
        raise InputError(f"{name} was trained for --exit-layer {meta['exit_layer']}, not {exit_layer}: train one "
                         f"for layer {exit_layer} with `specgraph train --method early-exit --exit-layer {exit_layer}`")  # fmt: skip
