"""Does an engine compute the same logits for a token whatever the number of tokens in the call?
Compares an 8-token verify call with eight 1-token calls on the same prefix, for fp32 and int8
activations over the same stored weights. With int8 activations only a bit-for-bit match lets
speculation reproduce plain decoding: on a Zen 4 the portable attention gives 0, the fused one
2e-2 unless one-token calls run as two (what int8 engines do since; exporters/gqa.py). The
int8 variant here is rewritten from the float32 bundle, so it is not padded.

    specgraph compile smollm2-135m -o out/fp32-logits --weights fp32 --emit-logits [--attention portable]
    python scripts/rows_consistency.py out/fp32-logits
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np
from activation_error import _logits, _variant  # the sibling script (run from the repository root)


def _call(engine, io, state, ids: list[int], start: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    feeds = {"tokens": np.asarray([ids], np.int64), "n_fixed": np.asarray([len(ids)], np.int64),
             "cache_len": np.asarray([start], np.int64)}  # fmt: skip
    return engine.call(io, feeds, state)["logits"].numpy()[0].copy()  # its memory is reused by later calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="a float32 bundle compiled with --emit-logits")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rows-"))
    try:
        for act in ("fp32", "int8"):
            engine = _variant(args.bundle, work / act, args.model, act)
            ids = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return")
            n0 = len(ids) - 8
            scale = np.abs(_logits(engine, ids)).max()
            state, io = engine.new_state(1), engine.session.io_binding()
            _call(engine, io, state, ids[:n0], 0)
            eight = _call(engine, io, state, ids[n0:], n0)
            state, io = engine.new_state(1), engine.session.io_binding()
            _call(engine, io, state, ids[:n0], 0)
            ones = np.stack([_call(engine, io, state, [ids[n0 + i]], n0 + i)[-1] for i in range(8)])
            print(f"{act} activations: 8-token call vs 1-token calls, max relative logit difference "
                  f"{np.abs(ones - eight).max() / scale:.2e}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
