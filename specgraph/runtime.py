"""Stage 6: the host loop over ONNX Runtime.

`prefill` runs the prompt through the step engine; `step` runs one speculation round. The host
binds every output onto the matching input of the next call (the KV caches are the same
buffers in and out, so ONNX Runtime's TensorScatter writes them in place) and emits
`accepted[:n_accepted]`; it never edits a tensor.

What a caller passes is checked here, with the messages the CLI prints (`check_prompt_ids`,
`check_threads`), and a bundle is checked before ONNX Runtime sees it (`read_manifest`), then
against what ONNX Runtime found in its graph: every error is a specgraph error.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from specgraph import sampling
from specgraph.errors import BundleError, InputError
from specgraph.exporters.manifest import read_manifest
from specgraph.kernels import register, uses_native
from specgraph.sampling import SamplingParams, uniform_stream
from specgraph.step import MAX_BATCH

# Inputs every engine takes, with their ONNX types (a method's state and constants carry theirs
# in the manifest), and the outputs the host reads.
_FED = {"tokens": "int64", "n_fixed": "int64", "cache_len": "int64", "temperature": "float",
        "top_k": "int64", "top_p": "float", "uniforms": "float"}  # fmt: skip
_ONNX_TYPES = {"float32": "float", "int64": "int64", "bool": "bool"}
_READ = ("accepted", "n_accepted", "next_tokens", "cache_len_out")


def check_threads(threads: Any) -> int | None:
    """`threads` as ONNX Runtime intra-op threads: None (ORT's choice) or 1 to the machine's cores."""
    limit = os.cpu_count() or 1
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int | np.integer) or not 1 <= threads <= limit:
        raise InputError(f"threads must be an integer from 1 to {limit} (the cores of this machine), got {threads!r}")
    return int(threads)


def check_prompt_ids(ids: Any, vocab_size: int) -> list[int]:
    """A prompt as a list of ints in [0, vocab_size), or InputError saying what is wrong. The API
    and the CLI share it, so they refuse the same prompts with the same words."""
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
        ids = ids.tolist()
    if not isinstance(ids, list | tuple):
        raise InputError(f"a prompt is a list of token ids (ints), got {_show(ids)}")
    if not ids:
        raise InputError("the prompt is empty")
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise InputError(f"a prompt is a list of token ids (ints), but position {i} holds {_show(token)}")
        if not 0 <= token < vocab_size:
            raise InputError(f"token ids must lie in [0, {vocab_size}) for this model; position {i} holds {token}")
    return [int(t) for t in ids]


def _check_max_new_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {_show(value)}")
    return int(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class GenerationResult:
    """What `Engine.generate` returns; `as_dict()` is what `specgraph generate --json` prints."""

    prompt_ids: list[int]
    output_ids: list[int]
    steps: int  # engine calls after prefill
    prefill_s: float
    decode_s: float
    stop_reason: str  # "max_new_tokens" | "eos" | "max_context"
    text: str | None = None
    accepted_per_step: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per target forward after prefill (plain decoding = 1.0)."""
        return max(len(self.output_ids) - 1, 0) / self.steps if self.steps else float(len(self.output_ids) > 0)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the time of the steps that made them."""
        return max(len(self.output_ids) - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "text": self.text,
            "steps": self.steps,
            "mean_accepted": round(self.mean_accepted, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "stop_reason": self.stop_reason,
            **self.sampling.as_dict(),
        }


class Engine:
    """A compiled bundle loaded into ONNX Runtime. `specgraph.load(DIR)` returns one."""

    def __init__(self, bundle: str | Path, threads: int | None = None, verify: bool = True) -> None:
        self.bundle = Path(bundle)
        threads = check_threads(threads)
        self.manifest = read_manifest(self.bundle, verify=verify)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.inter_op_num_threads = 1
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3  # TensorScatter logs each non-in-place copy as a warning
        if uses_native(self.manifest):
            register(options, self.bundle)
        graph = self.bundle / self.manifest["graph"]["file"]
        try:
            # read_config_from_model=0: session options are ours, never the bundle's (ORT_LOAD_CONFIG_FROM_MODEL)
            self.session = ort.InferenceSession(
                str(graph), options, providers=["CPUExecutionProvider"], read_config_from_model=0
            )
        except Exception as exc:  # ORT raises its own Fail, InvalidGraph, InvalidProtobuf...
            raise BundleError(f"{self.bundle}: ONNX Runtime cannot load {graph.name}: {_first_line(exc)}") from exc
        self.method: str = self.manifest["method"]
        self.max_context: int = self.manifest["max_context"]
        self.eos_token_ids: list[int] = list(self.manifest.get("eos_token_ids") or [])
        graph = self.manifest["graph"]
        self._bindings: dict[str, str] = graph["bindings"]
        self._trims: dict[str, str] = graph["trims"]
        self._in_place: set[str] = set(graph["in_place"])
        self._output_names = [out.name for out in self.session.get_outputs()]
        self._declared = {v["name"]: v for v in graph["inputs"]}
        # a method's per-row state other than the caches: zeros at the first call, then fed by bindings
        written = {self._bindings[o] for o in self._in_place}
        self._zero_state = [name for name in graph["state"] if name not in written]
        self._buffers = [self._declared[name] for name in graph["state"] if name in written]  # the caches
        self._constants = {k: _constant(v) for k, v in graph["constants"].items()}
        self.extra_slots: int = graph["extra_slots"]
        self.draft_depth: int = self.manifest["draft_depth"]
        self.samples: bool = bool(self.manifest.get("sampling"))  # has the sampling inputs
        self._tokenizer: Any = None
        self._check_graph()
        # uniforms [B, R * (max_context + 1)], R draws per position (the graph declares the width)
        self.uniforms_width: int = int(self._declared["uniforms"]["shape"][1]) if self.samples else 0

    def _check_graph(self) -> None:
        """The graph ONNX Runtime loaded has the inputs and outputs the manifest declares, and the
        host can feed every input and read every output it needs."""
        declared = {v["name"]: v for v in self.manifest["graph"]["inputs"]}
        inputs = {v.name: v for v in self.session.get_inputs()}
        outputs = {v.name for v in self.session.get_outputs()}
        fed = {"tokens", "n_fixed", "cache_len", *self._constants, *self.manifest["graph"]["state"]}
        fed |= set(sampling.INPUTS) if self.samples else set()
        problem = None
        if set(inputs) != fed or set(declared) != fed:
            names = sorted((set(inputs) ^ fed) | (set(declared) ^ fed))
            problem = f"the graph's inputs do not match what its manifest describes ({', '.join(names[:3])})"
        elif not set(_READ) <= outputs:
            problem = f"the graph lacks outputs the host reads ({', '.join(sorted(set(_READ) - outputs))})"
        state = set(self.manifest["graph"]["state"])
        for name, value in inputs.items():
            if problem is not None:
                break
            want = _FED.get(name) or _ONNX_TYPES.get(declared[name]["dtype"], declared[name]["dtype"])
            if value.type != f"tensor({want})":
                problem = f"graph input {name} is {value.type}, the host feeds tensor({want})"
            elif name in state and list(value.shape[1:]) != declared[name]["shape"][1:]:
                problem = f"graph input {name} has shape {value.shape}, the manifest says {declared[name]['shape']}"
        width = declared["uniforms"]["shape"] if self.samples and problem is None else None
        if width is not None and (len(width) != 2 or not isinstance(width[1], int) or width[1] <= 0
                                  or width[1] % (self.max_context + 1)):  # fmt: skip
            problem = f"input uniforms has shape {width}, not [batch, R * (max_context + 1)]"
        for name in self._in_place:
            if problem is None and (name not in outputs or self._bindings.get(name) not in inputs):
                problem = f"graph output {name} has no input to write into"
        if problem is not None:
            raise BundleError(f"{self.bundle}: {problem}; recompile the bundle")

    def first_feeds(self, tokens: np.ndarray, n_fixed: int | list[int], cache_len: int) -> dict[str, Any]:
        """Inputs of a call that does not follow another (prefill, timing): the method's state
        zeroed, its constants as the manifest gives them. `n_fixed` is one count for every row or
        one per row (a ragged prefill: row b's tokens after its n_fixed[b] are drafts)."""
        batch = tokens.shape[0]
        feeds: dict[str, Any] = {
            "tokens": tokens,
            "n_fixed": np.broadcast_to(np.asarray(n_fixed, np.int64), (batch,)).copy(),
            "cache_len": np.full(batch, cache_len, np.int64),
            **self._constants,
        }
        for name in self._zero_state:
            v = self._declared[name]
            feeds[name] = np.zeros([batch, *v["shape"][1:]], _NUMPY[v["dtype"]])
        return feeds

    @property
    def weight_bytes(self) -> int:
        """Bytes of the bundle's weights: its external data file plus the graph file, which holds the
        initializers under 1 KB inline (a bound: the graph's own structure is counted too)."""
        graph = self.bundle / self.manifest["graph"]["file"]
        data = graph.with_name(graph.name + ".data")
        return graph.stat().st_size + (data.stat().st_size if data.is_file() else 0)

    @property
    def state_bytes_per_row(self) -> int:
        """Bytes of the in-place state (KV caches, a drafter's cache) that one batch row holds."""
        return sum(4 * int(np.prod(v["shape"][1:])) for v in self._buffers)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            tok_dir = self.manifest.get("tokenizer")
            if not tok_dir:
                raise InputError(f"{self.bundle} has no tokenizer (its source had none): pass token ids instead")
            from specgraph.loaders import load_tokenizer

            self._tokenizer = load_tokenizer(self.bundle / tok_dir, error=BundleError)
        return self._tokenizer

    def check_sampling(self, params: SamplingParams | None) -> SamplingParams:
        """Checked parameters (greedy when none), refused if they sample and the bundle cannot."""
        params = (params or SamplingParams()).check()
        if not params.greedy and not self.samples:
            raise InputError(f"{self.bundle} was compiled without sampling (--no-sampling, or --acceptance typical): "
                             "recompile it without those flags to sample")  # fmt: skip
        return params

    def new_state(self, batch: int, params: SamplingParams | None = None) -> dict[str, ort.OrtValue]:
        """Fresh zeroed caches (the in-place state) for `batch` rows, and the sampling inputs
        (greedy unless `params` say otherwise; `params` must carry a seed)."""
        state = {}
        if self.samples:
            p = params or SamplingParams()
            width = self.uniforms_width  # R * (max_context + 1): R draws per position
            uniforms = (uniform_stream(p.seed, batch, width) if p.seed is not None
                        else np.zeros((batch, width), np.float32))  # fmt: skip
            values = {"temperature": np.full(batch, p.temperature, np.float32), "top_k": np.full(batch, p.top_k, np.int64),
                      "top_p": np.full(batch, p.top_p, np.float32), "uniforms": uniforms}  # fmt: skip
            state.update({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in values.items()})
        for v in self._buffers:
            shape = [batch, *v["shape"][1:]]
            state[v["name"]] = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
        return state

    def call(
        self, io: ort.IOBinding, feeds: dict[str, Any], state: dict[str, ort.OrtValue], state_bound: bool = False
    ) -> dict[str, Any]:
        """One engine call; caches are bound in place, every other output comes back as an OrtValue.
        `state_bound`: `io` holds this `state` from the previous call on it (a decode loop), so only
        the call's own inputs and fresh outputs are bound again (a name bound again replaces its
        binding), not the 2 x layers caches in and out (with `_outputs`, the host's share of a SmolLM2
        token fell from 1.1-1.3 ms to 0.6 ms; docs/benchmarks.md)."""
        if not state_bound:
            io.clear_binding_inputs()
            io.clear_binding_outputs()
            for name, value in state.items():
                io.bind_ortvalue_input(name, value)
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                io.bind_ortvalue_input(name, value)
            else:
                io.bind_cpu_input(name, value)
        for name in self._output_names:
            if name not in self._in_place:
                io.bind_output(name)  # a fresh buffer: the last call's outputs are this call's inputs
            elif not state_bound:
                io.bind_ortvalue_output(name, state[self._bindings[name]])  # in place
        try:
            self.session.run_with_iobinding(io)
        except Exception as exc:  # ORT's own error types; the inputs were checked, so the graph failed
            raise BundleError(f"{self.bundle}: the engine failed: {_first_line(exc)}") from exc
        out = self._outputs(io, state)
        tokens = feeds["tokens"]
        batch = (tokens.shape() if isinstance(tokens, ort.OrtValue) else tokens.shape)[0]
        for name in _READ:
            shape = out[name].shape()
            if len(shape) != (1 if name in ("n_accepted", "cache_len_out") else 2) or shape[0] != batch:
                raise BundleError(f"{self.bundle}: the engine returned {name} of shape {shape}; recompile the bundle")
        return out

    def _outputs(self, io: ort.IOBinding, state: dict[str, ort.OrtValue]) -> dict[str, Any]:
        """The call's outputs by name: an in-place one is its state buffer; the others are wrapped
        from ONNX Runtime's own vector (`IOBinding.get_outputs` would wrap all of them, the 2 x
        layers caches too: about 0.5 ms a call on SmolLM2)."""
        raw = getattr(io, "_iobinding", None)
        if raw is None:  # not the onnxruntime this project pins: its public API
            return dict(zip(self._output_names, io.get_outputs(), strict=False))
        values = raw.get_outputs()
        return {
            name: state[self._bindings[name]] if name in self._in_place else ort.OrtValue(values[i])
            for i, name in enumerate(self._output_names)
        }

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 64,
        stop_at_eos: bool = True,
        on_tokens: Callable[[list[int]], None] | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> GenerationResult:
        """Generate for one prompt: greedy at temperature 0, else sampled (with `seed`, exactly
        reproducible). `on_tokens` receives each round's new tokens."""
        params = SamplingParams(temperature, top_k, top_p, seed)
        prompt = check_prompt_ids(prompt_ids, int(self.manifest["vocab_size"]))
        return self.generate_batch([prompt], max_new_tokens, stop_at_eos, params, on_tokens)[0]

    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 64,
        stop_at_eos: bool = True,
        params: SamplingParams | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for prompts of any lengths, one engine row each, in lockstep (rows that
        stopped keep running until all have). Row b draws with uniforms[b] of the seed's stream.

        One prefill call runs every prompt, padded to the longest, with n_fixed[b] = len(prompt b):
        the engine verifies a row's padding as drafts, so a row emits exactly what it would alone.
        The batch stops with "max_context" when its longest row's next round would not fit."""
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
        params = self.check_sampling(params)
        params = params.with_seed() if not params.greedy else params
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if not isinstance(prompts, list | tuple) or not prompts:
            raise InputError(f"generate_batch takes a non-empty list of prompts, got {_show(prompts)}")
        if len(prompts) > MAX_BATCH:
            raise InputError(f"generate_batch takes at most {MAX_BATCH} prompts (the engine's batch limit), "
                             f"got {len(prompts)}: split them into several calls")  # fmt: skip
        rows = [check_prompt_ids(p, int(self.manifest["vocab_size"])) for p in prompts]
        for b, ids in enumerate(rows):
            if len(ids) + self.extra_slots >= self.max_context:
                which = f"prompt {b}" if len(rows) > 1 else "prompt"
                raise InputError(
                    f"{which} has {len(ids)} tokens but the engine's maximum context is {self.max_context}; "
                    "recompile with a larger --max-context or shorten the prompt"
                )
        lengths = [len(row) for row in rows]
        longest = max(lengths)
        # Padding: each row is filled up to the longest with its own last token. The engine treats
        # every token after a row's n_fixed as a draft: it verifies it like any draft (a wrong
        # one is rejected; one equal to the target's own next token is accepted, which is the
        # output anyway), and its cache slots and (lookup) history entries lie past the committed
        # length, where the next call writes before anything reads. So any in-vocabulary id
        # would be lossless; the row's own token keeps a row's call a function of that row alone
        # (no other row's text enters it) and is always in the vocabulary.
        padded = np.asarray([row + [row[-1]] * (longest - len(row)) for row in rows], np.int64)
        batch = len(rows)
        state = self.new_state(batch, params)
        io = self.session.io_binding()
        start = time.perf_counter()
        out = self.call(io, self.first_feeds(padded, lengths, 0), state)
        prefill_s = time.perf_counter() - start
        emitted: list[list[int]] = [[] for _ in rows]
        counts: list[list[int]] = [[] for _ in rows]
        stops: list[str | None] = [None] * batch
        stream = on_tokens if batch == 1 else None
        self._emit(out, emitted, stops, max_new_tokens, stop_at_eos, stream)
        ones = np.ones(batch, np.int64)
        start = time.perf_counter()
        while any(stop is None for stop in stops):
            if max(map(len, counts)) > self.max_context:  # every call fills at least one cache slot
                raise BundleError(f"{self.bundle}: the engine makes no progress (its cache does not advance)")
            width = out["next_tokens"].shape()[1] + self.extra_slots
            if int(out["cache_len_out"].numpy().max()) + width > self.max_context:
                stops = [stop or "max_context" for stop in stops]
                break
            out = self.call(io, self.next_feeds(out, ones), state, state_bound=True)
            before = [len(e) if stop is None else -1 for e, stop in zip(emitted, stops, strict=True)]
            self._emit(out, emitted, stops, max_new_tokens, stop_at_eos, stream)
            for row, n in enumerate(before):
                if n >= 0:
                    counts[row].append(len(emitted[row]) - n)
        decode_s = time.perf_counter() - start
        return [GenerationResult(rows[b], emitted[b], len(counts[b]), prefill_s, decode_s, stops[b] or "max_new_tokens",
                                 None, counts[b], params) for b in range(batch)]  # fmt: skip

    def next_feeds(self, out: dict[str, Any], n_fixed: np.ndarray | None = None) -> dict[str, Any]:
        """The inputs of the call after the one that returned `out`, as a decode loop makes them:
        each output bound to the input it feeds (manifest "bindings"; the in-place caches are
        already there), a trimmed one cut to the columns some row uses (`graph.trims`: e.g. lookup
        sends only its real drafts), the constants, and `n_fixed` (default 1 a row)."""
        feeds = {i: out[o] for o, i in self._bindings.items() if o not in self._in_place}
        for name, count in self._trims.items():
            keep = 1 + int(out[count].numpy().max())
            if keep < out[name].shape()[1]:
                feeds[self._bindings[name]] = np.ascontiguousarray(out[name].numpy()[:, :keep])
        if n_fixed is None:
            n_fixed = np.ones(out["n_accepted"].shape()[0], np.int64)
        return {**feeds, **self._constants, "n_fixed": n_fixed}

    def _emit(self, out, emitted, stops, max_new_tokens, stop_at_eos, on_tokens) -> None:  # type: ignore[no-untyped-def]
        """Append each running row's `accepted[:n_accepted]`, cut at EOS or the token budget;
        record why a row stops."""
        n_acc = out["n_accepted"].numpy()
        accepted = out["accepted"].numpy()
        for row, stop in enumerate(stops):
            if stop is not None:
                continue
            new = [int(t) for t in accepted[row, : int(n_acc[row])]]
            if any(not 0 <= t < int(self.manifest["vocab_size"]) for t in new):
                raise BundleError(f"{self.bundle}: the engine emitted a token outside its vocabulary")
            reason = None
            if stop_at_eos:
                for i, tok in enumerate(new):
                    if tok in self.eos_token_ids:
                        new, reason = new[: i + 1], "eos"
                        break
            room = max_new_tokens - len(emitted[row])
            if len(new) >= room:
                new, reason = new[:room], reason if len(new) == room and reason else "max_new_tokens"
            emitted[row] += new
            stops[row] = reason
            if on_tokens and new:
                on_tokens(new)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


_NUMPY = {"float32": np.float32, "int64": np.int64, "bool": np.bool_}


def _constant(value: dict[str, Any]) -> np.ndarray:
    """A manifest constant ({dtype, shape, data}; the schema checked them) as an array."""
    return np.asarray(value["data"], _NUMPY[value["dtype"]]).reshape(value["shape"])
