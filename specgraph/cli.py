"""The `specgraph` command: a thin layer that parses flags, calls the library, maps errors.

Every library error becomes one line on stderr and a non-zero exit code; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from specgraph.errors import InputError, SpecgraphError
from specgraph.kernels import KERNELS

EXIT_USAGE = 2
_TOP_K_MAX = 2**31 - 1  # the engine's top_k input is int64; no vocabulary comes near this
_FORCE_HELP = (
    "replace an existing {what} that specgraph did not make (never a symbolic link, the working directory, "
    "or this command's own input)"
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the fix."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(EXIT_USAGE)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _top_k(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value > _TOP_K_MAX:
        raise argparse.ArgumentTypeError(
            f"at most {_TOP_K_MAX} (any k at or above the vocabulary size keeps every token), got {value}"
        )
    return value  # a negative k is refused by the sampling check, with its own message


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (the default) is greedy; above 0 samples, with the same law as plain sampling",
    )
    parser.add_argument("--top-k", type=_top_k, default=0, help="sample from the k most likely tokens only (0 = off)")
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set of tokens holding this much probability (1 = off)",
    )
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for the engine's uniforms: the same seed gives the same text (and the same text as "
                        "--method none, except with --method draft or eagle, whose drafts are sampled too) "
                        "(default: a fresh seed, reported in --json output)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specgraph", description="Compile language models into lossless speculative-decoding engines."
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    c = sub.add_parser(
        "compile",
        help="compile a model into an engine bundle",
        description=(
            "Compile MODEL into a bundle (ONNX step engine, tokenizer, manifest.json). MODEL is a torch.export "
            "file (.pt/.pt2), a Hugging Face folder, a .gguf file, or 'smollm2-135m' (the embedded default)."
        ),
    )
    c.add_argument("model", help="model file or folder, or 'smollm2-135m'")
    c.add_argument(
        "-o",
        "--output",
        required=True,
        type=Path,
        help="bundle folder to write: a new path, an empty folder, or a bundle specgraph wrote (replaced atomically)",
    )
    c.add_argument("--force", action="store_true", help=_FORCE_HELP.format(what="folder"))
    from specgraph import methods
    from specgraph.advise.bundles import default_methods

    c.add_argument(
        "--method",
        default="none",
        choices=[*methods.names(), "auto"],
        help="; ".join(f"{m.name}: {m.summary}" for m in methods.REGISTRY.values())
        + "; auto: compile none and each of "
        + ",".join(default_methods())
        + ", run `specgraph advise` on --prompts at batch 1 and keep the one that measured fastest"
        + " (lossless: greedy, or sampled with the target's exact law, unless a flag says otherwise)",
    )
    c.add_argument(
        "--max-context", type=_positive, default=1024, help="KV-cache slots: prompt plus output tokens (default 1024)"
    )
    c.add_argument(
        "--no-sampling",
        action="store_true",
        help="leave out the sampling inputs (temperature, top-k, top-p, uniforms): a greedy-only engine. Sampling "
        "costs a greedy call nothing measurable, so this is rarely needed",
    )
    c.add_argument(
        "--weights",
        default="source",
        choices=["source", "fp32", "int8", "int4"],
        help="source (default): run a GGUF's quantised blocks as stored (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), "
        "exact against HF's dequantised model; other sources keep float32. fp32: dequantise everything. "
        "int8/int4: weight-only blocks quantised here from a float source",
    )
    c.add_argument(
        "--activations",
        default="fp32",
        choices=["fp32", "int8"],
        help="fp32 (default): multiply in float32, exact against the weights. int8: quantise activations per "
        "block of 32 for integer dot products (as llama.cpp does): a slightly different model (its "
        "speculative engines still match its own none engine), faster only where the CPU has VNNI",
    )
    c.add_argument(
        "--kernels",
        default="auto",
        choices=list(KERNELS),
        help="how quantised weights are multiplied. native: specgraph's own ONNX Runtime operator "
        "(libspecgraph_kernels.so, built by scripts/install.sh), 1.8x MatMulNBits per step on an AVX2 CPU at "
        "fp32 activations; the bundle then runs only where that library is (the Python and C++ hosts load it). "
        "At --weights fp32 native runs only the attention (CachedAttention; the float32 products stay "
        "ONNX Runtime's). ort: ONNX Runtime's MatMulNBits and attention, which any ONNX Runtime runs. auto "
        "(default): native when the library is built, else ort",
    )
    c.add_argument(
        "--block-size", type=_positive, default=32, help="int8/int4: weights per quantisation block (default 32)"
    )
    c.add_argument(
        "--attention",
        default="fused",
        choices=["fused", "portable"],
        help="fused (default): each layer's attention around the KV cache is one ONNX Runtime "
        "GroupQueryAttention node (com.microsoft) where the engine allows it (chain engines without sliding "
        "windows): fewer nodes, faster steps. portable: standard ONNX operators only, for other runtimes "
        "(TensorRT)",
    )
    c.add_argument("--emit-logits", action="store_true", help="also output logits (for testing; slower)")
    c.add_argument("--json", action="store_true", help="print the compile report as JSON")
    for method in methods.REGISTRY.values():
        method.add_flags(_MethodFlags(c, c.add_argument_group(f"--method {method.name}")))
    auto = c.add_argument_group("--method auto")
    auto.add_argument("--prompts", default=None,
                      help="auto: comma-separated prompt sets to choose on, like your traffic (JSONL files, or "
                      "humaneval|chat|creative|repeat; default chat)")  # fmt: skip
    auto.add_argument(
        "--limit", type=_positive, default=None, help="auto: prompts per set, half to calibrate (default 8)"
    )
    auto.add_argument("--candidates", type=Path, default=None,
                      help="auto: where the candidate bundles go, one folder per method, reused when already there "
                      "with the same settings (default out/advise)")  # fmt: skip

    g = sub.add_parser(
        "generate",
        help="generate text from a bundle",
        description="Generate text, streamed as it is produced: greedy by default, or sampled with --temperature "
        "(lossless: the text has exactly the law of plain sampling from the model).",
    )
    g.add_argument("bundle", type=Path, help="bundle directory from `specgraph compile`")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the bundle's tokenizer)")
    src.add_argument("--prompt-ids", type=_token_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=_positive, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument(
        "--threads", type=_positive, default=None, help="ONNX Runtime intra-op threads (default: ORT's choice)"
    )
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--no-verify", action="store_true", help="skip the bundle's sha256 checks (faster load)")
    _add_sampling_flags(g)

    b = sub.add_parser(
        "bench",
        help="measure a bundle against plain decoding",
        description=(
            "Measure tokens/s and mean accepted length on a prompt set. For a 'none' bundle also Hugging Face "
            "generate, the memory-bandwidth floor and the verify-cost curve c(N)/c(1)."
        ),
    )
    b.add_argument("bundle", type=Path, help="bundle directory")
    b.add_argument(
        "--prompts",
        required=True,
        help="JSONL file with a 'prompt' field per line (.gz ok), or humaneval|chat|creative|repeat",
    )
    b.add_argument("--max-new-tokens", type=_positive, default=64, help="tokens per prompt (default 64)")
    b.add_argument("--limit", type=_positive, default=None, help="use only the first N prompts")
    b.add_argument("--threads", type=_positive, default=2, help="ONNX Runtime and torch threads (default 2)")
    b.add_argument(
        "--reference", type=Path, default=None, help="a 'none' bundle of the same model to compare with in the same run"
    )
    b.add_argument("--no-baseline", action="store_true", help="skip Hugging Face generate and the floor (none bundles)")
    b.add_argument("--no-chat", action="store_true", help="do not apply the chat template to prompts")
    b.add_argument(
        "--repeats",
        type=_positive,
        default=1,
        help="run every prompt N times in each engine (the bundle, --reference, llama.cpp), their order rotated "
        "each time, and keep each engine's run of median speed (default 1; 3 steadies ratios on a noisy machine)",
    )
    b.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="OUT",
        help="also write the full result as JSON to OUT (a new file, or a report bench wrote)",
    )
    b.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="write a PNG plot of acceptance by depth and speed-up by prompt set to exactly this path, a new file "
        "or a plot bench wrote (give several sets: --prompts humaneval,chat,creative)",
    )
    b.add_argument("--force", action="store_true", help=_FORCE_HELP.format(what="file at --json or --plot"))
    _add_sampling_flags(b)

    a = sub.add_parser(
        "advise",
        help="measure on your prompts whether speculation pays, which method, and when it does not",
        description=(
            "Compare speculative methods with plain decoding on your prompts and machine. Each prompt set is split "
            "alternately: the calibration half measures each method's tokens per call and call costs (at every batch "
            "size of a sweep), from which the speed-ups are predicted; the held-out half measures them. Prints one "
            "recommendation per prompt set and batch size (which may be none), the warnings (the batch size and reply "
            "length from which speculation stops paying, prompt sets with too little acceptance, memory), and "
            "predicted against measured for every cell. TARGET is a model to compile the bundles from (into "
            "--bundles) or the bundles themselves: one none bundle and one per method, of the same model."
        ),
    )
    a.add_argument("targets", nargs="+", metavar="TARGET", help="a model (file, folder or 'smollm2-135m') or bundles")
    a.add_argument(
        "--prompts", required=True, help="comma-separated prompt sets: JSONL files, or humaneval|chat|creative|repeat"
    )
    a.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods to compare with none (default: every bundle given; for a model: "
        + ",".join(default_methods())
        + ")",
    )
    a.add_argument("--batch", default="1,4", help="comma-separated batch sizes to predict and measure (default 1,4)")
    a.add_argument("--max-new-tokens", type=_positive, default=64, help="reply length per prompt (default 64)")
    a.add_argument("--limit", type=_positive, default=None, help="use only the first N prompts of each set")
    a.add_argument("--threads", type=_positive, default=2, help="ONNX Runtime threads (default 2)")
    a.add_argument("--no-chat", action="store_true", help="do not apply the chat template to prompts")
    a.add_argument(
        "--bundles",
        type=Path,
        default=Path("out/advise"),
        help="where bundles compiled from a model go, one folder per method, reused when already there "
        "(default out/advise)",
    )
    a.add_argument(
        "--memory-mb",
        type=float,
        default=None,
        help="memory to plan for, in MB (default: what this machine has available now)",
    )
    a.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the full report as JSON to OUT")
    a.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="write a PNG of predicted against measured and the two crossovers to exactly this path")  # fmt: skip
    a.add_argument("--force", action="store_true", help=_FORCE_HELP.format(what="file at --json or --plot"))
    _add_sampling_flags(a)

    trainable = [m for m in methods.REGISTRY.values() if m.trains]
    t = sub.add_parser(
        "train",
        help="train a method's drafter by self-distillation (" + ", ".join(m.name for m in trainable) + ")",
        description=(
            "Train a drafter on the frozen target's teacher-forced features over its own replies to PROMPTS and "
            "--corpus-mb MB of the Python standard library's sources; only the drafter learns. Prints its "
            "held-out acceptance as it trains and stores it in the file it writes (compile uses it, e.g. "
            "--num-draft auto, --tree auto)."
        ),
    )
    t.add_argument("model", help="model file or folder, or 'smollm2-135m'")
    t.add_argument(
        "--method", default=trainable[0].name, choices=[m.name for m in trainable], help="whose drafter to train"
    )
    t.add_argument("--prompts", required=True, help="JSONL with a 'prompt' field per line, or a shipped set name")
    t.add_argument(
        "-o",
        "--output",
        required=True,
        type=Path,
        help="drafter file to write (.safetensors): a new path, or one specgraph wrote (replaced atomically); "
        "the generated text and the target's features are cached beside it as NAME.gen.json and "
        "NAME.features.safetensors, for a rerun on the same text",
    )
    t.add_argument("--force", action="store_true", help=_FORCE_HELP.format(what="file at -o or its cache"))
    t.add_argument(
        "--max-new-tokens", type=_positive, default=None,
        help="tokens the target generates per prompt (default 128)",
    )  # fmt: skip
    t.add_argument("--epochs", type=_positive, default=None,
                   help="passes over the training data (default: medusa 8, eagle and early-exit 2)")  # fmt: skip
    t.add_argument("--lr", type=_positive_float, default=None,
                   help="peak learning rate, cosine-decayed (default: medusa 0.003, eagle 0.001, early-exit 0.0005)")  # fmt: skip
    t.add_argument("--threads", type=_positive, default=2, help="torch and ONNX Runtime threads (default 2)")
    t.add_argument("--json", action="store_true", help="print the training report as JSON")
    for method in trainable:
        method.add_train_flags(t.add_argument_group(f"--method {method.name}"))

    i = sub.add_parser("inspect", help="show what the compiler recognises in a model")
    i.add_argument("model", help="model file or folder, or 'smollm2-135m'")
    i.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _cmd_compile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specgraph.compiler import CompileConfig, compile_model, passes_for

    shared = dict(max_context=args.max_context, emit_logits=args.emit_logits, sampling=not args.no_sampling,
                  force=args.force, weights=args.weights, activations=args.activations, kernels=args.kernels,
                  block_size=args.block_size, attention=args.attention)  # fmt: skip
    if args.method == "auto":
        return _compile_auto(args, shared)
    for name in _AUTO_FLAGS:
        if getattr(args, name) is not None:
            raise InputError(f"--{name} is a --method auto option; it does nothing with --method {args.method}")
    cfg = CompileConfig.of(args.model, args.output, args.method, **shared, **_method_flags(args))
    cfg.check()
    stages = ["load", "capture", "anatomy", *(p.__name__ for p in passes_for(cfg.spec, cfg.opts)), "export onnx"]
    stages += ["index stored blocks", "store weights as blocks", *cfg.spec.stages(cfg.opts)]
    with tqdm(
        total=len(stages), desc="compile", unit="stage", file=sys.stderr, disable=True if args.json else None
    ) as bar:

        def progress(stage: str) -> None:
            bar.set_postfix_str(stage)
            if stage != "load":
                bar.update(1)

        report = compile_model(cfg, progress)
        bar.update(1)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        a = report.anatomy
        print(f"compiled {args.model} -> {report.bundle} (method {report.method})")
        print(
            f"  anatomy: {a['decoder_blocks']} blocks, {a['attention']['num_heads']} heads / "
            f"{a['attention']['num_kv_heads']} kv heads, positions {a['positions']['kind']}, vocab {a['vocab_size']}"
        )
        for name, counts in report.pass_counts.items():
            print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
        print("  seconds: " + ", ".join(f"{k} {v}" for k, v in report.seconds.items()))
        if report.weights:
            print("  " + _weights_line(report.weights))
        if report.details:
            print(f"  {report.method}: " + _details_line(report.details))
    return 0


_AUTO_FLAGS = ("prompts", "limit", "candidates")


def _compile_auto(args: argparse.Namespace, shared: dict[str, Any]) -> int:
    from specgraph.advise import Settings
    from specgraph.advise.auto import compile_auto
    from specgraph.compiler import CompileConfig, compile_model

    _method_flags(args)  # a method's own flag does nothing here: refuse it
    prompts = args.prompts or "chat"
    settings = Settings([p for p in prompts.split(",") if p], [1], limit=args.limit or 8).check()
    force = shared.pop("force")

    def compile_one(model: str, method: str, path: Path, options: dict[str, Any]) -> None:
        print(f"compiling candidate {method} into {path}", file=sys.stderr, flush=True)
        compile_model(CompileConfig.of(model, path, method, **options))

    candidates = args.candidates or Path("out/advise")
    method, report = compile_auto(args.model, args.output, candidates, settings, compile_one, shared, force)
    if args.json:
        print(json.dumps({"bundle": str(args.output), "method": method, "advice": report}, indent=2))
        return 0
    for method_left_out, why in report["skipped"].items():
        print(f"left out {method_left_out}: {why}")
    for r in report["recommendations"]:
        print(f"{r['prompts']}: {r['reason']}; measured {r['measured']:.2f}x")
    print(f"compiled {args.model} -> {args.output} (method {method}, the fastest measured on {prompts})")
    return 0


class _MethodFlags:
    """The argument group a method adds its flags to. A flag is absent from the parsed namespace
    unless given (the method's options dataclass holds the defaults), and methods may share a
    flag (--num-draft): the first registration serves both."""

    def __init__(self, parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> None:
        self.parser, self.group = parser, group

    def add_argument(self, *names: str, **kwargs: Any) -> None:
        if any(n in self.parser._option_string_actions for n in names):
            return
        self.group.add_argument(*names, **{**kwargs, "default": argparse.SUPPRESS})


def _method_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The chosen method's options from the flags given. A flag only another method takes is an
    error: it would do nothing, and the user meant something by it."""
    from specgraph import methods

    chosen = None if args.method == "auto" else methods.get(args.method).options_type
    mine = {f.name for f in dataclasses.fields(chosen)} if chosen else set()
    for other in methods.REGISTRY.values():
        for f in dataclasses.fields(other.options_type):
            if f.name not in mine and hasattr(args, f.name):
                flag = "--" + f.name.replace("_", "-")
                owners = "/".join(m.name for m in methods.REGISTRY.values()
                                  if f.name in {g.name for g in dataclasses.fields(m.options_type)})  # fmt: skip
                raise InputError(f"{flag} is a --method {owners} option; it does nothing with --method {args.method}")
    return {name: getattr(args, name) for name in mine if hasattr(args, name)}


def _details_line(details: dict[str, Any]) -> str:
    """The method's report as one line: its own summary, else its scalar settings."""
    if isinstance(details.get("summary"), str):
        return details["summary"]
    return ", ".join(f"{k} {v}" for k, v in details.items() if isinstance(v, int | float | str))


def _weights_line(w: dict[str, Any]) -> str:
    """One line on what the engine multiplies by, e.g. 'weights: source, stored Q4_1 x120 + Q8_0 x1 ...'."""
    if w.get("stored") != "blocks":
        return f"weights: {w['weights']}, float32" + _kernels_note(w)
    formats = " + ".join(f"{k} x{v}" for k, v in sorted(w["formats"].items()))
    exact = "exact against the dequantised weights" if w["exact"] else "a different model (rounded activations)"
    same = w.get("rows_agree", {}).get("same_text_as")
    return (
        f"weights: {w['weights']}, stored {formats} ({w['block_bytes'] / 1e6:.1f} MB instead of "
        f"{w['float32_bytes'] / 1e6:.1f} MB float32{_one_row_note(w)}), {w['activations']} activations, {exact}"
        + (f"; the same text as --method {same} with these weights" if same else "")
        + _kernels_note(w)
    )


def _one_row_note(w: dict[str, Any]) -> str:
    extra = w.get("native_one_row_bytes", 0)
    return f"; {extra / 1e6:.1f} MB of it the one-digit codes again, in lanes for one-token calls" if extra else ""


def _kernels_note(w: dict[str, Any]) -> str:
    if w.get("kernels") != "native":
        return ""
    what = "the products and the attention" if w.get("stored") == "blocks" else "the attention"
    if w.get("native_digits"):
        what = (f"the products ({w['native_digits']} of them in integer digits for AMX's tiles, exact; "
                f"the same bits on any CPU) and the attention")  # fmt: skip
    return f"; native kernels for {what} (runs where libspecgraph_kernels.so is: --kernels ort for any ONNX Runtime)"


def _cmd_generate(args: argparse.Namespace) -> int:
    from specgraph.runtime import Engine

    engine = Engine(args.bundle, threads=args.threads, verify=not args.no_verify)
    if args.prompt is not None:
        tok = engine.tokenizer
        if args.chat and not getattr(tok, "chat_template", None):
            raise InputError("--chat: this bundle's tokenizer has no chat template; leave out --chat")
        if args.chat:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tok.encode(args.prompt)
    else:
        if args.chat:
            raise InputError("--chat needs --prompt text, not --prompt-ids")
        ids = args.prompt_ids  # engine.generate checks them (runtime.check_prompt_ids: the API's words)
    stream = None if args.json else _Streamer(engine)
    result = engine.generate(
        ids,
        max_new_tokens=args.max_new_tokens,
        stop_at_eos=not args.ignore_eos,
        on_tokens=stream.push if stream else None,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    if engine.manifest.get("tokenizer"):
        result.text = engine.tokenizer.decode(result.output_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        if stream:
            stream.finish()
        sys.stderr.write(
            f"[{len(result.output_ids)} tokens, {result.tokens_per_s:.1f} tokens/s, "
            f"{result.mean_accepted:.2f} tokens/step, {result.steps} steps, stop: {result.stop_reason}"
            + (f", seed {result.sampling.seed}]\n" if result.sampling.seed is not None else "]\n")
        )
    return 0


class _Streamer:
    """Print text as tokens arrive (decoding the whole output keeps multi-byte characters whole)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.ids: list[int] = []
        self.shown = 0
        self.has_text = bool(engine.manifest.get("tokenizer"))

    def push(self, new: list[int]) -> None:
        self.ids += new
        if not self.has_text:
            print(" ".join(map(str, new)), end=" ", flush=True)
            return
        text = self.engine.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # an incomplete character; wait for the next token
        print(text[self.shown :], end="", flush=True)
        self.shown = len(text)

    def finish(self) -> None:
        print(flush=True)


def _cmd_bench(args: argparse.Namespace) -> int:
    from specgraph.bench import bench_inputs, format_report, run_bench
    from specgraph.outputs import BENCH_JSON, check_distinct, check_output, write_file
    from specgraph.plot import check_plot_path, plot_bench
    from specgraph.sampling import SamplingParams

    sets = [p for p in args.prompts.split(",") if p]
    inputs = bench_inputs(args.bundle, sets, args.reference)
    # every output is checked before the run, which can take many minutes
    json_out = check_output(args.json, BENCH_JSON, inputs, args.force) if args.json else None
    plot_out = check_plot_path(args.plot, inputs, args.force) if args.plot else None
    check_distinct(json_out, plot_out)
    results = {}
    for prompts in sets:
        results[prompts] = run_bench(
            str(args.bundle),
            prompts,
            max_new_tokens=args.max_new_tokens,
            threads=args.threads,
            limit=args.limit,
            baseline=not args.no_baseline,
            chat=not args.no_chat,
            reference=str(args.reference) if args.reference else None,
            sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
            repeats=args.repeats,
        )
        print(format_report(results[prompts]))
    if json_out:
        single = next(iter(results.values())) if len(results) == 1 else {"sets": results}
        text = json.dumps(single, indent=2) + "\n"
        write_file(json_out, lambda tmp: tmp.write_text(text), BENCH_JSON, inputs, args.force)
    if plot_out:
        print(f"plot: {plot_bench(results, plot_out, inputs, args.force)}")
    return 0


def _batch_sizes(text: str) -> list[int]:
    try:
        return [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise InputError(f"--batch takes comma-separated integers, got {text!r}") from None


def _cmd_advise(args: argparse.Namespace) -> int:
    from specgraph.advise import Settings, run_advise
    from specgraph.advise.bundles import parse_methods, resolve
    from specgraph.advise.report import format_report, plot_advice
    from specgraph.bench import bench_inputs
    from specgraph.compiler import CompileConfig, compile_model
    from specgraph.outputs import ADVICE_JSON, check_distinct, check_output, write_file
    from specgraph.plot import check_plot_path
    from specgraph.sampling import SamplingParams

    sets = [p for p in args.prompts.split(",") if p]
    settings = Settings(sets, _batch_sizes(args.batch), args.max_new_tokens, args.limit, args.threads,
                        not args.no_chat, memory_mb=args.memory_mb,
                        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)).check()  # fmt: skip
    wanted = parse_methods(args.methods)
    inputs = [*bench_inputs(args.targets[0], sets), *args.targets]
    json_out = check_output(args.json, ADVICE_JSON, inputs, args.force) if args.json else None
    plot_out = check_plot_path(args.plot, inputs, args.force) if args.plot else None
    check_distinct(json_out, plot_out)

    def compile_one(model: str, method: str, path: Path, options: dict[str, Any]) -> None:
        print(f"compiling {model} with --method {method} into {path}", file=sys.stderr, flush=True)
        compile_model(CompileConfig.of(model, path, method, **options))

    def skipped(method: str, why: str) -> None:
        print(f"leaving out {method}: {why}", file=sys.stderr, flush=True)

    bundles = resolve(args.targets, wanted, args.bundles, compile_one, skipped=skipped)
    report = run_advise(bundles, settings)
    print(format_report(report))
    if json_out:
        text = json.dumps(report, indent=2) + "\n"
        write_file(json_out, lambda tmp: tmp.write_text(text), ADVICE_JSON, inputs, args.force)
    if plot_out:
        print(f"plot: {plot_advice(report, plot_out, inputs, args.force)}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from specgraph import methods

    command = " ".join(["specgraph", *args.argv])
    report = methods.get(args.method).train(args, progress=not args.json, command=command)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from specgraph.anatomy import analyze
    from specgraph.capture import capture
    from specgraph.loaders import load_model

    loaded = load_model(args.model)
    summary = {"model": loaded.name, "kind": loaded.kind, **analyze(capture(loaded, 1024), loaded.hf_config).summary()}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for key, value in summary.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        print(f"{key:>15}: {value}")
    return 0


_COMMANDS = {"compile": _cmd_compile, "generate": _cmd_generate, "bench": _cmd_bench, "advise": _cmd_advise,
             "train": _cmd_train, "inspect": _cmd_inspect}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # as given, for a report that records its own command (train)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(name)s: %(message)s")
    if not args.debug:
        _quiet_libraries()
    try:
        return _COMMANDS[args.command](args)
    except SpecgraphError as exc:
        if args.debug:
            raise
        sys.stderr.write(f"specgraph {args.command}: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("specgraph: interrupted\n")
        return 130


def _quiet_libraries() -> None:
    """Keep third-party progress chatter (export steps, weight loading) off the terminal."""
    import os
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in ("torch", "torch.onnx", "torch.onnx._internal.exporter._registration", "onnxscript", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars; our own bars say what is happening


if __name__ == "__main__":
    raise SystemExit(main())
