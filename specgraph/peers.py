"""Other engines run side by side with ours in `specgraph bench`: today llama.cpp, through
llama-cpp-python (an optional extra: `scripts/install_llamacpp.sh` builds it for this CPU).

How llama.cpp is timed, so that its figure reads like `GenerationResult.tokens_per_s`: its
`Llama.generate` generator evaluates the prompt and samples the first token on the first `next()`,
then evaluates one token and samples the next on each later `next()`. A clock is read after each
token comes out; prefill is the time to the first token, and decode is the time from the first
token to the last, over (new tokens - 1) tokens. The last token is never fed back, as in our
engine and in Hugging Face `generate`. Every run starts from an empty KV cache (`reset()`), so no
prompt prefix is reused from the run before. llama.cpp never stops at EOS here: it makes exactly
`max_new_tokens` tokens, like the Hugging Face baseline.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specgraph.runtime import GenerationResult
from specgraph.sampling import SamplingParams

Decoder = Callable[[list[int], int, SamplingParams], GenerationResult]
_SEEDS = 2**32 - 1  # llama.cpp seeds are uint32, and 0xFFFFFFFF asks it for a random one


def llama_cpp_decoder(gguf: Path, threads: int, n_ctx: int) -> Decoder:
    """Load `gguf` in llama.cpp on `threads` threads (prompt and decode alike) with room for
    `n_ctx` tokens, and return `decode(prompt_ids, max_new_tokens, params)`: exactly
    `max_new_tokens` new tokens from the token-id prompt, greedy or sampled with llama.cpp's own
    sampler (its random stream is not ours). Raises ImportError when llama-cpp-python is not
    installed; llama.cpp's own errors (a file it cannot load) pass through."""
    llama_cpp = importlib.import_module("llama_cpp")
    llama = llama_cpp.Llama(
        model_path=str(gguf),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        logits_all=False,
        verbose=False,
    )

    def decode(prompt_ids: list[int], max_new_tokens: int, params: SamplingParams) -> GenerationResult:
        llama.reset()  # an empty KV cache: no prefix reuse between runs
        if not params.greedy:
            llama.set_seed((params.seed or 0) % _SEEDS)
        tokens = llama.generate(prompt_ids, **_sampler(params))
        start = time.perf_counter()
        stamps: list[float] = []
        new: list[int] = []
        try:
            for token in tokens:
                stamps.append(time.perf_counter())
                new.append(int(token))
                if len(new) >= max_new_tokens:
                    break
        finally:
            tokens.close()
        return GenerationResult(
            prompt_ids=list(prompt_ids),
            output_ids=new,
            steps=max(len(new) - 1, 0),
            prefill_s=stamps[0] - start if stamps else 0.0,
            decode_s=stamps[-1] - stamps[0] if stamps else 0.0,
            stop_reason="max_new_tokens",
            sampling=params,
        )

    return decode


def _sampler(params: SamplingParams) -> dict[str, Any]:
    """llama.cpp's sampler settings for `params`: temp 0 is its greedy sampler; every filter
    llama-cpp-python turns on by default (min-p 0.05, top-k 40, top-p 0.95) is off unless asked."""
    if params.greedy:
        return {"temp": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
    return {"temp": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": 0.0,
            "typical_p": 1.0, "repeat_penalty": 1.0}  # fmt: skip
