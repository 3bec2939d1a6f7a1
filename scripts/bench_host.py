"""The C++ host (host/, specgraph-host) against the Python host on the same bundles, in one run.

For each bundle, 3 prompts x --repeats, the two hosts run one after the other (interleaved, the
first of each pair alternating), each in a fresh process generating --max-new-tokens greedily with
--threads intra-op threads. Measured per run:

- tokens/s: the host's own `tokens_per_s` (decode only, as `specgraph generate --json` reports;
  EOS ignored so every run makes --max-new-tokens tokens);
- host overhead per engine call: (wall time of one generate - time inside ONNX Runtime's Run) /
  engine calls (prefill included), and the same over the prefill + decode loop only (without the
  set-up before prefill: zeroed caches, uniforms, checks). Python: `Engine.generate` timed in-process with
  `InferenceSession.run_with_iobinding` wrapped; C++: `SPECGRAPH_HOST_TIMING=1` makes
  specgraph-host print `calls=, run_s=, generate_s=` on stderr (host/src/engine.cpp);
- peak RSS of the process (`ru_maxrss` of the child from `os.wait4`).

The Python host runs as `python scripts/bench_host.py --python-worker ...`, which is
`specgraph.load(bundle, threads).generate(ids)` in one process (no tokenizer loaded). Both hosts
load with sha256 verification off (it costs load time only) unless --verify.

    python scripts/bench_host.py --json docs/bench/host.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "def fib(n):",
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
]
TIMING_PREFIX = "specgraph-host: timing: "


def python_worker(args: argparse.Namespace) -> None:
    """One generate with the Python host, Run wrapped to accumulate its time; JSON on stdout."""
    sys.path.insert(0, str(ROOT))
    import onnxruntime as ort

    import specgraph

    run_s = 0.0
    calls = 0
    original = ort.InferenceSession.run_with_iobinding

    def timed(self, iobinding, run_options=None):  # type: ignore[no-untyped-def]
        nonlocal run_s, calls
        start = time.perf_counter()
        try:
            return original(self, iobinding, run_options)
        finally:
            run_s += time.perf_counter() - start
            calls += 1

    ort.InferenceSession.run_with_iobinding = timed  # type: ignore[method-assign]
    engine = specgraph.load(args.python_worker, threads=args.threads, verify=args.verify)
    ids = [int(t) for t in args.prompt_ids.split(",")]
    start = time.perf_counter()
    result = engine.generate(ids, max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    generate_s = time.perf_counter() - start
    print(
        json.dumps(
            {
                "output_ids": list(result.output_ids),
                "steps": result.steps,
                "tokens_per_s": result.tokens_per_s,
                "prefill_s": result.prefill_s,
                "decode_s": result.decode_s,
                "calls": calls,
                "run_s": run_s,
                "generate_s": generate_s,
            }
        )
    )


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[str, str, float, int]:
    """Run cmd; its stdout, stderr, wall seconds and peak RSS in KiB (from wait4)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {stderr.strip()[-2000:]}")
    return stdout, stderr, wall, int(usage.ru_maxrss)


def run_cpp(args: argparse.Namespace, bundle: str, ids: list[int], env: dict[str, str]) -> dict:
    cmd = [args.host, bundle, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--threads", str(args.threads), "--ignore-eos", "--json"] + ([] if args.verify else ["--no-verify"])
    stdout, stderr, wall, rss = run_child(cmd, {**env, "SPECGRAPH_HOST_TIMING": "1"})
    result = json.loads(stdout)
    timing = next(line for line in stderr.splitlines() if line.startswith(TIMING_PREFIX))
    fields = dict(kv.split("=") for kv in timing[len(TIMING_PREFIX) :].split())
    return summarise(result, int(fields["calls"]), float(fields["run_s"]), float(fields["generate_s"]), wall, rss)


def run_python(args: argparse.Namespace, bundle: str, ids: list[int], env: dict[str, str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--python-worker", bundle]
    cmd += ["--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--threads", str(args.threads)] + (["--verify"] if args.verify else [])
    stdout, _, wall, rss = run_child(cmd, env)
    result = json.loads(stdout.strip().splitlines()[-1])
    return summarise(result, result["calls"], result["run_s"], result["generate_s"], wall, rss)


def summarise(result: dict, calls: int, run_s: float, generate_s: float, wall: float, rss_kib: int) -> dict:
    loop_s = float(result["prefill_s"]) + float(result["decode_s"])
    return {
        "output_ids": result["output_ids"],
        "steps": result["steps"],
        "tokens_per_s": round(float(result["tokens_per_s"]), 3),
        "calls": calls,
        "run_s": round(run_s, 4),
        "generate_s": round(generate_s, 4),
        "overhead_per_call_ms": round(1000 * (generate_s - run_s) / calls, 4),
        "overhead_share": round((generate_s - run_s) / generate_s, 5),
        "loop_overhead_per_call_ms": round(1000 * (loop_s - run_s) / calls, 4),
        "setup_ms": round(1000 * (generate_s - loop_s), 3),
        "process_wall_s": round(wall, 3),
        "peak_rss_mib": round(rss_kib / 1024, 1),
    }


def median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 4)


def bench_bundle(args: argparse.Namespace, bundle: str, env: dict[str, str]) -> dict:
    sys.path.insert(0, str(ROOT))
    from specgraph.loaders import load_tokenizer

    manifest = json.loads((ROOT / bundle / "manifest.json").read_text())
    tokenizer = load_tokenizer(ROOT / bundle / manifest["tokenizer"])
    prompts = [{"text": text, "ids": [int(t) for t in tokenizer.encode(text)]} for text in PROMPTS]
    runs: dict[str, list[dict]] = {"cpp": [], "python": []}
    pairs = []
    order = 0
    for repeat in range(args.repeats):
        for p, prompt in enumerate(prompts):
            first = ("cpp", "python") if order % 2 == 0 else ("python", "cpp")
            order += 1
            got = {}
            for host in first:
                run = (run_cpp if host == "cpp" else run_python)(args, bundle, prompt["ids"], env)
                run.update(prompt=p, repeat=repeat)
                runs[host].append(run)
                got[host] = run
                print(
                    f"{bundle} prompt {p} repeat {repeat} {host}: {run['tokens_per_s']} tok/s, "
                    f"{run['overhead_per_call_ms']} ms/call outside Run, {run['peak_rss_mib']} MiB",
                    flush=True,
                )
            pairs.append(
                {
                    "prompt": p,
                    "repeat": repeat,
                    "first": first[0],
                    "same_tokens": got["cpp"]["output_ids"] == got["python"]["output_ids"],
                    "tokens_per_s_ratio": round(got["cpp"]["tokens_per_s"] / got["python"]["tokens_per_s"], 4),
                }
            )
    keys = [
        "tokens_per_s",
        "overhead_per_call_ms",
        "loop_overhead_per_call_ms",
        "setup_ms",
        "overhead_share",
        "peak_rss_mib",
        "process_wall_s",
        "calls",
    ]
    medians = {host: {k: median(rs, k) for k in keys} for host, rs in runs.items()}
    return {
        "bundle": bundle,
        "method": manifest["method"],
        "weights": manifest.get("weights"),
        "max_context": manifest["max_context"],
        "prompts": prompts,
        "medians": medians,
        "cpp_over_python": {
            "tokens_per_s": round(medians["cpp"]["tokens_per_s"] / medians["python"]["tokens_per_s"], 4),
            "tokens_per_s_median_pair_ratio": round(statistics.median(p["tokens_per_s_ratio"] for p in pairs), 4),
            "overhead_per_call": round(
                medians["cpp"]["overhead_per_call_ms"] / medians["python"]["overhead_per_call_ms"], 4
            ),
            "loop_overhead_per_call": round(
                medians["cpp"]["loop_overhead_per_call_ms"] / medians["python"]["loop_overhead_per_call_ms"], 4
            ),
            "peak_rss": round(medians["cpp"]["peak_rss_mib"] / medians["python"]["peak_rss_mib"], 4),
        },
        "all_same_tokens": all(p["same_tokens"] for p in pairs),
        "pairs": pairs,
        "runs": {host: [{k: v for k, v in r.items() if k != "output_ids"} for r in rs] for host, rs in runs.items()},
    }


def ort_library() -> str:
    import onnxruntime

    capi = Path(onnxruntime.__file__).parent / "capi"
    return str(next(iter(sorted(capi.glob("libonnxruntime.so.1.*")))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundles", nargs="+", default=["out/fp32-none3", "out/fp32-draft4"])
    parser.add_argument("--host", default=str(ROOT / "host/build/specgraph-host"))
    parser.add_argument("--ort-lib", default=None, help="libonnxruntime.so.1.* (default: the onnxruntime wheel's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--verify", action="store_true", help="check sha256 on load (both hosts)")
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. the machine's load)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--python-worker", metavar="BUNDLE", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.python_worker:
        python_worker(args)
        return

    env = {**os.environ, "SPECGRAPH_ORT_LIB": args.ort_lib or os.environ.get("SPECGRAPH_ORT_LIB") or ort_library()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    import onnxruntime

    report = {
        "what": "specgraph-host (C++) against the Python host, interleaved, fresh process per run",
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "greedy": True,
        "verify": args.verify,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "note": args.note,
        "bundles": [bench_bundle(args, bundle, env) for bundle in args.bundles],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    for b in report["bundles"]:
        print(json.dumps({"bundle": b["bundle"], "medians": b["medians"], "cpp_over_python": b["cpp_over_python"]}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
