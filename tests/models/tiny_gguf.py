"""Tiny random Llama models written as GGUF files with chosen block formats (the `gguf` package
quantises and writes them), with a byte-level tokenizer, so tests can compile a GGUF in seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 256


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest for 256 + n."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_llama_gguf(path: Path, matrix_format: str, embed_format: str | None = None, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 64, GQA 4:2, vocabulary 256, tied head) whose matrices are stored as
    `matrix_format` (e.g. "Q4_1") and whose embedding table as `embed_format` (default: the same)."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(_byte_tokens())
    writer.add_token_types([1] * VOCAB)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(VOCAB - 1)

    def matrix(name: str, rows: int, cols: int, fmt: str) -> None:
        w = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[fmt]
        data = w if fmt == "F32" else quantize(w, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, HIDDEN, embed_format or matrix_format)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, matrix_format)
        matrix(f"blk.{i}.attn_k.weight", kv, HIDDEN, matrix_format)
        matrix(f"blk.{i}.attn_v.weight", kv, HIDDEN, matrix_format)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, matrix_format)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, matrix_format)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, matrix_format)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, matrix_format)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
