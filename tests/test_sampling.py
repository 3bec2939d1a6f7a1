"""Sampling: the op against a float64 reference, seeded runs, and the statistical proof.

The statistical tests draw the first three generated tokens many times from each engine of a
tiny 8-token-vocabulary model and compare their joint law (512 cells) with the exact law of
direct sampling from the target: every conditional computed from the Hugging Face model with
Hugging Face's own warpers (temperature, top-k, top-p). A chi-square test rejects at
ALPHA = 1e-4, so each check falsely alarms with probability 1e-4 on a fresh seed (the seeds
here are fixed, so a run is deterministic); the same test must reject engines compiled with a
deliberately broken acceptance rule. docs/benchmarks.md records the p-values and power.
"""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch

import specgraph.sampling
import specgraph.step
import specgraph.step_tree
from specgraph.compiler import CompileConfig, compile_model
from specgraph.errors import BundleError, InputError
from specgraph.runtime import Engine
from specgraph.sampling import ONNX_TRANSLATIONS, filter_logits, sample, uniform_stream
from tests.greedy import assert_same_sampled
from tests.models.tiny import build
from tests.stats import PROMPT, chi_square, engine_counts, exact_joint, hf_law, v8_config

SETTINGS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.7)]  # temperature, top_k, top_p
# the draft's q is filtered like p: also top-k and top-p together at a low temperature
OWN = [(0.7, 4, 0.9)]
OWN_SETTINGS = {"draft": OWN, "eagle": OWN, "eagle-adaptive": OWN, "eagle-confident": OWN}
ALPHA = 1e-4


# --- engines of the 8-token model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def v8(tiny_folder, tmp_path_factory):
    """method -> compiled bundle of the 8-token model, plus the model itself."""
    folder = tiny_folder("llama-v8")
    root = tmp_path_factory.mktemp("v8")
    bundles = {}

    def get(method: str) -> Engine:
        if method not in bundles:
            cfg = v8_config(folder, root, method)
            compile_model(cfg)
            bundles[method] = Engine(cfg.output, threads=2)
        return bundles[method]

    return get, build("llama-v8")


METHODS = [
    "none",
    "lookup",
    "lookup-fixed",
    "medusa",
    "medusa-chain",
    "draft",
    "draft-cascade",
    "eagle",
    "eagle-adaptive",
    "eagle-confident",
]


@pytest.mark.parametrize("method", METHODS)
def test_joint_law_of_three_tokens_matches_direct_sampling(method, v8):
    get, model = v8
    engine = get(method)
    for i, setting in enumerate(SETTINGS + OWN_SETTINGS.get(method, [])):
        law = exact_joint(model, PROMPT, setting)
        p_value, tv = chi_square(engine_counts(engine, setting, seed=7 + i, v=8), law)
        print(f"{method} {setting}: p = {p_value:.3g}, TV = {tv:.4f}")  # shown with -s
        assert p_value > ALPHA, f"{method} {setting}: chi-square p = {p_value:.2e}, TV = {tv:.4f}"


def _residual_forgotten(tokens, logits, n_fixed, params, u):  # type: ignore[no-untyped-def]
    """BROKEN on purpose: accept the next draft d when u < p(d) (right for a one-hot draft), but
    on rejection draw from p itself instead of the residual, so a rejected draft can come back."""
    x = torch.ops.specgraph.sample(logits, n_fixed - 1, *params, u)
    p = torch.softmax(logits / params[0].clamp(min=1e-6)[:, None, None], dim=-1)  # [B, T, V]
    draft = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # the draft after each position
    return torch.where(u < p.gather(2, draft[:, :, None])[..., 0], draft, x)


def _siblings_as_if_alone(row, children, tokens, params, u):  # type: ignore[no-untyped-def]
    """BROKEN on purpose ('q treated as 1' for every sibling): accept the first child c with
    u < p(c), each judged against the full p with the same uniform, with no residual between
    siblings; otherwise draw from p."""
    x = torch.ops.specgraph.sample(row, torch.zeros_like(u[:, 0], dtype=torch.int64), *params[:3], u)  # [B, 1]
    p = torch.softmax(row[:, 0] / params[0].clamp(min=1e-6)[:, None], dim=-1)  # [B, V]
    hit = children & (u < p.gather(1, tokens))  # [B, T]
    first = hit.to(torch.int64).argmax(dim=-1, keepdim=True)
    return torch.where(hit.to(torch.int64).amax(dim=-1, keepdim=True) > 0, tokens.gather(1, first), x)


def _residual_is_p(op, p, q):  # type: ignore[no-untyped-def]
    """BROKEN on purpose (the rule's ONNX form): after rejecting a draft d ~ q, draw from p itself
    instead of max(0, p - q); tokens q over-proposes then come out too often."""
    return p


def _uniform_reused(uniforms, positions):  # type: ignore[no-untyped-def]
    """BROKEN on purpose: positions 2i and 2i+1 share a uniform. Each token's own law is still
    exactly right; only the joint law is wrong, which a per-token test would never see."""
    return uniforms.gather(1, (positions // 2 * 2).clamp(max=uniforms.shape[1] - 1))


@pytest.mark.parametrize(
    ("method", "module", "name", "broken"),
    [
        ("lookup", specgraph.step, "_chain_targets", _residual_forgotten),
        ("medusa", specgraph.step_tree, "_node_draw", _siblings_as_if_alone),
        ("none", specgraph.sampling, "position_uniforms", _uniform_reused),
        ("draft", specgraph.sampling, "residual_onnx", _residual_is_p),
    ],
)
def test_the_same_test_rejects_a_broken_rule(method, module, name, broken, v8, monkeypatch):
    get, model = v8
    monkeypatch.setattr(module, name, broken)
    engine = get(f"{method}-broken")
    setting = SETTINGS[0]
    p_value, tv = chi_square(engine_counts(engine, setting, seed=3, v=8), exact_joint(model, PROMPT, setting))
    print(f"broken {method} {setting}: p = {p_value:.3g}, TV = {tv:.4f}")  # shown with -s
    assert p_value < ALPHA, f"a broken {method} rule passed: p = {p_value:.2e}, TV = {tv:.4f}"


# --- the op, seeded runs, bad input --------------------------------------------------------------


class _SampleOp(torch.nn.Module):
    def forward(self, logits, first, temperature, top_k, top_p, u):  # type: ignore[no-untyped-def]
        return torch.ops.specgraph.sample(logits, first, temperature, top_k, top_p, u)


@pytest.fixture(scope="module")
def sample_session(tmp_path_factory):
    """The op alone, exported to ONNX with dynamic batch, positions and vocabulary."""
    path = tmp_path_factory.mktemp("op") / "sample.onnx"
    batch, tokens = torch.export.Dim("b", min=1, max=64), torch.export.Dim("t", min=1, max=64)
    vocab = torch.export.Dim("v", min=2, max=200_000)
    args = (torch.randn(2, 5, 300), torch.tensor([1, 2]), torch.ones(2), torch.zeros(2, dtype=torch.int64),
            torch.ones(2), torch.rand(2, 5))  # fmt: skip
    dyn = ({0: batch, 1: tokens, 2: vocab}, {0: batch}, {0: batch}, {0: batch}, {0: batch}, {0: batch, 1: tokens})
    names = ["logits", "first", "temperature", "top_k", "top_p", "u"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(_SampleOp(), args, dynamo=True, opset_version=24, input_names=names,
                                    output_names=["x"], dynamic_shapes=dyn, custom_translation_table=ONNX_TRANSLATIONS)  # fmt: skip
    program.save(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), names


def test_sample_op_draws_the_reference_inverse_cdf(sample_session):
    """ONNX and eager forms pick the token the float64 reference's inverse CDF picks (away from
    a CDF boundary), for vocabularies above and below the 256-token sorted prefix and past it."""
    session, names = sample_session
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(200):
        b, t, v = int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.choice([7, 300, 5000]))
        logits = (rng.standard_normal((b, t, v)) * rng.uniform(0.5, 6)).astype(np.float32)
        feeds = [logits, rng.integers(0, t, b), rng.choice([0, 0.5, 1, 2], b).astype(np.float32),
                 rng.choice([0, 1, 3, 20, 400, 2000], b), rng.choice([1, 0.9, 0.5, 0.1, 0.999], b).astype(np.float32),
                 rng.random((b, t), dtype=np.float32)]  # fmt: skip
        onnx_x = session.run(None, dict(zip(names, feeds, strict=True)))[0]
        eager_x = sample(*(torch.from_numpy(np.asarray(f)) for f in feeds)).numpy()
        for i in range(b):
            for j in range(t):
                temp, first, k, p, u = feeds[2][i], feeds[1][i], feeds[3][i], feeds[4][i], feeds[5][i, j]
                if temp == 0 or j < first:
                    assert onnx_x[i, j] == eager_x[i, j] == logits[i, j].argmax()
                    continue
                cdf = np.cumsum(filter_logits(logits[i, j], temp, k, p))
                want = int(np.searchsorted(cdf, u, side="right"))
                if np.abs(cdf - u).min() < 1e-5:  # a draw this close to a boundary may round either way
                    continue
                assert onnx_x[i, j] == want and eager_x[i, j] == want, (v, temp, k, p)
                checked += 1
    assert checked > 400


def _export_op(module, args, dyn, names, outputs, path):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, opset_version=24, input_names=names,
                                    output_names=outputs, dynamic_shapes=dyn, custom_translation_table=ONNX_TRANSLATIONS)  # fmt: skip
    program.save(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


class _RuleOps(torch.nn.Module):
    def forward(self, logits, q, which, d, temperature, top_k, top_p, u_accept, u_residual):  # type: ignore[no-untyped-def]
        x = torch.ops.specgraph.speculative(logits, q, which, d, temperature, top_k, top_p, u_accept, u_residual)
        drafted, q_drafted = torch.ops.specgraph.propose(logits, temperature, top_k, top_p, u_accept)
        return x, drafted, q_drafted


def test_rule_ops_follow_the_reference_and_a_greedy_call_is_the_argmax(tmp_path):
    """`speculative` (the general rule) and `propose` (a drafter's draw and q) in ONNX and eager
    give what a float64 reference gives (away from a boundary), and every greedy row, in a
    greedy call or a mixed one, is the argmax with q = 0; the ONNX forms compute nothing for
    a call whose rows are all greedy."""
    b_, w_, v_, k_ = (torch.export.Dim(n, min=1, max=512) for n in "bwvk")
    args = (torch.randn(2, 3, 300), torch.rand(2, 2, 300), torch.tensor([[0, 1, -1], [1, -1, 0]]),
            torch.zeros(2, 3, dtype=torch.int64), torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2),
            torch.rand(2, 3), torch.rand(2, 3))  # fmt: skip
    dyn = ({0: b_, 1: w_, 2: v_}, {0: b_, 1: k_, 2: v_}, {0: b_, 1: w_}, {0: b_, 1: w_}, {0: b_}, {0: b_}, {0: b_},
           {0: b_, 1: w_}, {0: b_, 1: w_})  # fmt: skip
    names = ["logits", "q", "which", "d", "temperature", "top_k", "top_p", "u_accept", "u_residual"]
    session = _export_op(_RuleOps(), args, dyn, names, ["x", "drafted", "q_drafted"], tmp_path / "rule.onnx")
    rng = np.random.default_rng(1)
    checked = 0
    for case in range(150):
        b, w, k, v = (
            int(rng.integers(1, 4)),
            int(rng.integers(1, 5)),
            int(rng.integers(1, 4)),
            int(rng.choice([7, 300, 3000])),
        )
        logits = (rng.standard_normal((b, w, v)) * rng.uniform(0.5, 4)).astype(np.float32)
        temps = rng.choice([0, 0.7, 1, 1.5], b).astype(np.float32) if case % 3 else np.zeros(b, np.float32)
        top_k, top_p = rng.choice([0, 1, 3, 50], b), rng.choice([1, 0.9, 0.5], b).astype(np.float32)
        q = np.stack([[filter_logits(rng.standard_normal(v) * 2, 1.0, 0, 1.0) for _ in range(k)] for _ in range(b)])
        q = q.astype(np.float32)
        which = rng.integers(-1, k, (b, w))
        # half the drafts are the draft's likeliest token, so acceptance happens
        d = np.where(
            rng.random((b, w)) < 0.5, q.argmax(-1)[np.arange(b)[:, None], which.clip(0)], rng.integers(0, v, (b, w))
        )
        ua, ur = rng.random((b, w), dtype=np.float32), rng.random((b, w), dtype=np.float32)
        feeds = [logits, q, which, d, temps, top_k, top_p, ua, ur]
        onnx_out = session.run(None, dict(zip(names, feeds, strict=True)))
        eager_out = [t.numpy() for t in _RuleOps()(*(torch.from_numpy(np.asarray(f)) for f in feeds))]
        for i in range(b):
            for j in range(w):
                if temps[i] == 0:
                    for x in (*onnx_out[:2], *eager_out[:2]):
                        assert x[i, j] == logits[i, j].argmax()
                    assert not onnx_out[2][i, j].any() and not eager_out[2][i, j].any()
                    continue
                p = filter_logits(logits[i, j], temps[i], top_k[i], top_p[i])
                np.testing.assert_allclose(onnx_out[2][i, j], p, atol=1e-5)
                drawn = np.cumsum(p)
                qt = q[i, which[i, j]] if which[i, j] >= 0 else np.zeros(v)
                margin = abs(ua[i, j] * qt[d[i, j]] - p[d[i, j]])
                res = np.maximum(p - qt, 0)
                res = res if res.sum() > 0 else p
                cdf = np.cumsum(res) / res.sum()
                if min(margin, np.abs(cdf - ur[i, j]).min(), np.abs(drawn - ua[i, j]).min()) < 1e-5:
                    continue  # this close to a boundary float32 may round either way
                keep = qt[d[i, j]] > 0 and ua[i, j] * qt[d[i, j]] < p[d[i, j]]
                want = d[i, j] if keep else int(np.searchsorted(cdf, ur[i, j], side="right"))
                assert onnx_out[0][i, j] == eager_out[0][i, j] == want, (v, temps[i], top_k[i], top_p[i])
                want_draft = int(np.searchsorted(drawn, ua[i, j], side="right"))
                assert onnx_out[1][i, j] == eager_out[1][i, j] == want_draft
                checked += 1
    assert checked > 150


@pytest.mark.parametrize(("method", "operators"), [("none", 1), ("lookup", 1), ("eagle", 5), ("draft", 5)])
def test_a_greedy_call_skips_the_sampling_operators(method, operators, v8):
    """exporters/greedy_skip.py: each sampling operator's nodes sit in the `then` branch of an
    `If` on "some row samples", whose `else` branch is the argmax; only the few values another
    operator shares stay outside (the greedy and sampled runs above and in the statistical tests
    check both branches' results)."""
    import onnx

    from specgraph.exporters.greedy_skip import _CALL

    get, _ = v8
    graph = onnx.load(str(get(method).bundle / "model.onnx"), load_external_data=False).graph
    nodes = list(graph.node)
    for node in graph.node:  # an adaptive engine's drafter sits in its own gate (exporters/gate.py)
        nodes += [n for a in node.attribute if a.name == "then_branch" and node.name == "draft_gate" for n in a.g.node]
    gates = [n for n in nodes if n.op_type == "If" and n.name.endswith(".gate")]
    assert len(gates) == operators, [n.name for n in gates]
    for gate in gates:
        branches = {a.name: a.g for a in gate.attribute}
        assert len(branches["then_branch"].node) > 50
        assert branches["else_branch"].node[0].op_type == "ArgMax"
    fx = [next((p.value for p in n.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "") for n in nodes]
    assert sum(bool(_CALL.match(f)) for f in fx) < 15 * operators  # what stays: a few shared values
    # nor does any main-graph node whose values only one gate's drawing branch reads (the general
    # rule's window of drafts and proposals around `speculative`): it moved into that branch
    from specgraph.exporters.gemm import outer_reads
    from specgraph.exporters.greedy_skip import _branch_reads

    main_gates = [n for n in graph.node if n.op_type == "If" and n.name.endswith(".gate")]
    drawing = {name: {id(g) for g in main_gates if name in _branch_reads(g.attribute[0].g if g.attribute[0].name ==
               "then_branch" else g.attribute[1].g)} for node in graph.node for name in node.output}  # fmt: skip
    read_in_main = {i for n in graph.node if n not in main_gates for i in [*n.input, *outer_reads(n)]}
    read_in_main |= {i for g in main_gates for i in g.input} | {o.name for o in graph.output}
    for g in main_gates:
        read_in_main |= _branch_reads(next(a.g for a in g.attribute if a.name == "else_branch"))
    lone = [node.name for node in graph.node if node.op_type != "If" and node.output and
            all(o not in read_in_main and len(drawing[o]) == 1 for o in node.output if o)]  # fmt: skip
    assert not lone, lone


def test_reference_filter_matches_hugging_face_warpers():
    rng = np.random.default_rng(1)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.6, 5, 1.0), (1.4, 0, 0.75), (0.9, 40, 0.9), (2.0, 1, 0.5)]:
        logits = rng.standard_normal((4, 100)) * 3
        ours = filter_logits(logits, temperature, top_k, top_p)
        np.testing.assert_allclose(ours, hf_law(torch.from_numpy(logits), temperature, top_k, top_p), atol=1e-12)


def test_seeded_sampling_is_the_same_text_for_every_method(tiny_bundle):
    """Uniforms belong to positions, so an engine whose drafts are point masses (lookup here;
    Medusa in test_default_model) emits exactly the tokens `none` emits with the same seed (up to
    a draw within float rounding of a CDF boundary, reported as a tie), and a seed reproduces a
    run. `draft` samples its drafts, so it is equal in law only (tests/methods/test_draft.py)."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    model = build("llama")
    engines = [Engine(tiny_bundle("llama", m)) for m in ("none", "lookup")]
    for setting, seed in [((0.8, 0, 1.0), 1), ((1.1, 20, 0.9), 2), ((0.5, 0, 0.6), 3)]:
        temperature, top_k, top_p = setting
        runs = [e.generate(prompt, 32, False, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
                for e in engines]  # fmt: skip
        uniforms = uniform_stream(seed, 1, engines[0].max_context + 1)[0]
        assert_same_sampled(model, prompt, runs[1].output_ids, runs[0].output_ids, setting, uniforms)
        again = engines[1].generate(prompt, 32, False, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        assert again.output_ids == runs[1].output_ids and again.sampling.seed == seed
    seeds = {tuple(engines[0].generate(prompt, 32, False, temperature=0.8, seed=s).output_ids) for s in (7, 8, 9)}
    assert len(seeds) == 3  # 32 tokens of a near-flat 256-token model: seeds that agree would be a bug


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "--temperature must be"),
        ({"temperature": 0.7, "top_p": 0.0}, "--top-p must be in (0, 1]"),
        ({"temperature": 0.7, "top_p": 1.5}, "--top-p must be in (0, 1]"),
        ({"temperature": 0.7, "top_k": -1}, "--top-k must be"),
    ],
)
def test_bad_sampling_values_are_one_line_errors(kwargs, message, tiny_bundle):
    engine = Engine(tiny_bundle("llama", "none"))
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        engine.generate([1, 2, 3], 4, **kwargs)


def test_a_uniforms_width_that_is_not_whole_positions_is_refused(tiny_bundle, tmp_path):
    """The host fills the declared width, R draws per position: a width that is not a multiple
    of max_context + 1 is a broken bundle, refused in one line (as by the C++ host)."""
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle("llama", "none"), bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    spec = next(v for v in manifest["graph"]["inputs"] if v["name"] == "uniforms")
    spec["shape"] = [spec["shape"][0], 100]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"input uniforms has shape .* not \[batch, R \* \(max_context \+ 1\)\]"):
        Engine(bundle)


def test_a_greedy_only_bundle_refuses_to_sample(tiny_folder, tmp_path):
    compile_model(
        CompileConfig.of(model=str(tiny_folder("llama")), output=tmp_path / "b", max_context=64, sampling=False)
    )
    engine = Engine(tmp_path / "b")
    assert not engine.samples and "temperature" not in [i.name for i in engine.session.get_inputs()]
    assert engine.generate([1, 2, 3], 4, temperature=0).output_ids  # greedy still works
    with pytest.raises(InputError, match="compiled without sampling"):
        engine.generate([1, 2, 3], 4, temperature=0.7)
