"""Rewrite a bundle by hand to price a part of it (docs/benchmarks.md, the sections on the
drafter's weights inside the gate's branch and on stopping the draft loop): a copy of BUNDLE in
OUT with

    --inline-else   the gate's `If` replaced by its `else` branch (the drafter never runs: what
                    the idle call costs without the `If` and the outer values it is fed)
    --cut-rule      the adaptive rule's nodes replaced by pass-through state and
                    n_draft = (score >= 0) (what the rule's nodes cost)
    --confidence P  the `--draft-confidence` threshold set to P (the initializer
                    draft_log_confidence: the same engine at another P, without compiling again)

then time it against the bundle and `none`, for example
    python scripts/gate_variants.py out/y-eagle-ad out/x-eagle-norule --cut-rule
    FILL=draft_score=-1e9 WIDTHS=1 ROUNDS=40 python scripts/ab_step.py out/y-none out/y-eagle-ad out/x-eagle-norule
The copy's manifest records the rewritten graph's size and hash; an --inline-else or --cut-rule
copy's text is the bundle's only with every row's gate shut (--cut-rule's rows never stop), so
use those for timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from specgraph.exporters.gate import upstream
from specgraph.exporters.gemm import outer_reads
from specgraph.exporters.manifest import MANIFEST, reseal
from specgraph.exporters.onnx import set_initializer

RULE_OUTPUTS = ("draft_score_out", "draft_idle_out", "draft_wait_out", "n_draft")


def inline_else(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    nodes = []
    for node in graph.node:
        if node.name != "draft_gate":
            nodes.append(node)
            continue
        branch = next(a.g for a in node.attribute if a.name == "else_branch")
        rename = {o.name: real for o, real in zip(branch.output, node.output, strict=True)}
        for inner in branch.node:
            inner.output[:] = [rename.get(o, o) for o in inner.output]
            nodes.append(inner)
    return nodes


def cut_rule(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    nodes = list(graph.node)
    producer = {o: n for n in nodes for o in n.output}
    gate = next(n for n in nodes if n.name == "draft_gate")
    others = [o.name for o in graph.output if o.name not in RULE_OUTPUTS and o.name not in gate.output]
    keep = upstream(producer, [*others, *outer_reads(gate)])
    rule = upstream(producer, list(RULE_OUTPUTS)) - keep
    stand_in = [helper.make_node("Identity", [name.removesuffix("_out")], [name]) for name in RULE_OUTPUTS[:3]]
    stand_in += [
        helper.make_node("Constant", [], ["cut_zero"], value=helper.make_tensor("z", TensorProto.FLOAT, [], [0.0])),
        helper.make_node("GreaterOrEqual", ["draft_score", "cut_zero"], ["cut_wants"]),
        helper.make_node("Cast", ["cut_wants"], ["n_draft"], to=TensorProto.INT64),
    ]
    print(f"cut {len(rule)} nodes of the rule")
    return stand_in + [n for n in nodes if id(n) not in rule]


def set_value(out: Path, initializer: str, value: float, section: Any, key: str, said: float) -> None:
    """Set the one-value `initializer` of out's graph, and what the manifest says of it
    (`section(method's section)[key] = said`)."""
    set_initializer(out / "model.onnx", initializer, np.asarray([value], np.float32))
    manifest = json.loads((out / MANIFEST).read_text())
    section(manifest[manifest["method"]])[key] = said
    (out / MANIFEST).write_text(json.dumps(manifest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("out", type=Path)
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--inline-else", action="store_true")
    how.add_argument("--cut-rule", action="store_true")
    how.add_argument("--confidence", type=float, metavar="P")
    how.add_argument("--threshold", type=float, metavar="T")
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: choose a new folder")
    shutil.copytree(args.bundle, args.out)
    graph_path = args.out / "model.onnx"
    if args.confidence is not None:
        set_value(args.out, "draft_log_confidence", np.log(args.confidence), lambda m: m, "confidence", args.confidence)
    elif args.threshold is not None:
        set_value(args.out, "draft_threshold", args.threshold, lambda m: m["adaptive"], "threshold", args.threshold)
    else:
        model = onnx.load(str(args.bundle / "model.onnx"), load_external_data=False)
        nodes = inline_else(model.graph) if args.inline_else else cut_rule(model.graph)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        onnx.save_model(model, str(graph_path))
    reseal(args.out)


if __name__ == "__main__":
    main()
