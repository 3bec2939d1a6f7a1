"""Tiny random-weight models, built in code, one per architecture family the anatomy supports."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 256


def _llama(vocab: int = VOCAB) -> torch.nn.Module:
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=vocab - 1,
        bos_token_id=1,
    )
    return LlamaForCausalLM(cfg)


def _llama_gqa3() -> torch.nn.Module:
    """Three query heads per KV head (6:2, head size 16), as in issue 10's traced-batch-1 report."""
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=VOCAB - 1,
        bos_token_id=1,
    )
    return LlamaForCausalLM(cfg)


def _llama_v8() -> torch.nn.Module:
    """An 8-token vocabulary: small enough to enumerate the joint law of three tokens (512 cells)."""
    return _llama(8)


def _qwen2() -> torch.nn.Module:
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=VOCAB - 1,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def _gpt2() -> torch.nn.Module:
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        eos_token_id=VOCAB - 1,
        bos_token_id=VOCAB - 1,
    )
    return GPT2LMHeadModel(cfg)


def _gemma3() -> torch.nn.Module:
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        eos_token_id=VOCAB - 1,
        pad_token_id=0,
        bos_token_id=2,
    )
    return Gemma3ForCausalLM(cfg)


BUILDERS = {
    "llama": _llama,
    "llama-gqa3": _llama_gqa3,
    "llama-v8": _llama_v8,
    "qwen2": _qwen2,
    "gpt2": _gpt2,
    "gemma3": _gemma3,
}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A seeded random-weight model of `family`, in eval mode, SDPA attention."""
    torch.manual_seed(seed)
    model = BUILDERS[family]()
    model.config._attn_implementation = "sdpa"
    # Random init is nearly flat; sharpen the head so greedy choices are not near-ties.
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight.mul_(4.0)
    return model.eval()


def save(family: str, folder: Path, seed: int = 0) -> Path:
    """Write the tiny model as a Hugging Face folder (config.json + safetensors)."""
    model = build(family, seed)
    model.save_pretrained(str(folder))
    return folder
