"""llama.cpp's greedy decode of the default GGUF on 1 and 2 threads, alternated: how much of its
speed is bound by its arithmetic rather than by memory (a step bound by reading its weights gains
little from a second core).

    python scripts/llamacpp_threads.py            # needs scripts/install_llamacpp.sh's build
"""

from __future__ import annotations

import time

import llama_cpp

from specgraph.default_model import gguf_path


def main() -> None:
    for threads in (1, 2, 1, 2):
        llama = llama_cpp.Llama(model_path=str(gguf_path()), n_threads=threads, n_threads_batch=threads, n_ctx=512,
                                verbose=False)  # fmt: skip
        llama.eval(llama.tokenize(b"def quicksort(arr):"))
        start = time.perf_counter()
        for _ in range(96):
            llama.eval([llama.sample(temp=0.0)])
        print(f"{threads} thread(s): {96 / (time.perf_counter() - start):.1f} tokens/s")


if __name__ == "__main__":
    main()
