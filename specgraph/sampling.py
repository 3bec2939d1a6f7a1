"""Lossless sampling inside the step engine: temperature, top-k and top-p, with host-drawn
uniforms for every generated position.

The rule (speculative sampling; Leviathan et al. 2023, Chen et al. 2023). A drafter proposes d
from its distribution q; the target's filtered distribution p~ (temperature, top-k, top-p in
Hugging Face's order) keeps d with probability min(1, p~(d)/q(d)), and on rejection the token is
drawn from the residual max(0, p~ - q) normalised; either way the token is distributed as p~.
`speculative_draw` implements it with q as an input, and the operator `speculative` wraps it for
the engine (`step._chain_targets` calls it for chains); `filtered` computes p~ (the one-hot of
the argmax at temperature 0, which makes the rule the greedy one: keep d iff it is the target's
argmax, else emit that argmax), and `propose` a sampling drafter's draft and its q. Their ONNX
forms compute nothing over the vocabulary in a call whose rows are all greedy.

Point masses are the special case q = one-hot at d (lookup copies earlier text, Medusa takes the
heads' top-k, so their q is one-hot), computed in closed form with one uniform u per position:
draw x ~ p~ by inverse CDF with u and keep d exactly when d == x. This is the general rule under
one coupling of its two draws. Let C(d) be p~'s mass before d in vocabulary order and take the
accept draw u_a = (u - C(d)) mod 1 (uniform): u_a < p~(d) = min(1, p~(d)/1) exactly when
C(d) <= u < C(d) + p~(d), that is when x == d. On rejection u_a is uniform on [p~(d), 1), so
u_r = (u_a - p~(d)) / (1 - p~(d)) is a fresh uniform, and the inverse CDF of the residual
(p~ without d, renormalised) taken in the cyclic order d+1, ..., V-1, 0, ..., d-1 at u_r lands on
the token whose interval [C(j), C(j) + p~(j)) holds u: x again. So "emit x, keep d iff d == x"
needs neither q nor a second uniform. For a tree it is SpecInfer's recursive rejection sampling
without replacement over the siblings (children are distinct tokens; child i is accepted with
probability p~(c_i) / (1 - sum of the rejected siblings' p~), the law of x given that it missed
the earlier siblings). Because the uniform belongs to the position, not to the draft, point-mass
engines emit the same tokens as plain sampling with the same uniforms: a seeded lookup or Medusa
run equals a seeded `none` run. A drafter that samples its drafts (`draft`) is only equal in law.

Uniforms: `uniforms[b, R*i + r]` is draw r for the token at absolute position i of row b (prompt
positions are never read), R = the graph's declared width / (S + 1): 1 for point-mass engines
(u), 3 for `draft` (r = 0 the accept draw, 1 the residual draw, also the plain draw where no
draft is verified, 2 the draft's own draw of d ~ q; see `stream`). The host draws them once per
generation with `uniform_stream`. Why the draws stay independent although a position can be
drafted in several calls: a position's verification draws decide something emitted at most
once (the first rejection emits its position), and a draft at a position is either verified
(then that position is emitted, accepted or not) or dropped unverified behind an earlier
rejection, having influenced nothing emitted; so when the next call redrafts that position with
the same draw, the draw is still uniform and independent of everything emitted.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import onnxscript
import torch

from specgraph.errors import InputError

_OPSET24 = onnxscript.values.Opset("", 24)
_I64 = torch.int64
_INT64 = onnxscript.ir.DataType.INT64
SORTED_PREFIX = 256  # top-k/top-p thresholds come from the 256 best tokens when they lie there
INPUTS = ("temperature", "top_k", "top_p", "uniforms")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token: temperature 0 is greedy; top_k 0 and top_p 1 switch those off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed, reported with the result

    def check(self) -> SamplingParams:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InputError(f"--temperature must be a number >= 0 (0 = greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise InputError(f"--top-k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise InputError(f"--top-p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InputError(f"--seed must be an integer in [0, 2**63), got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, default: int | None = None) -> SamplingParams:
        """These parameters with a concrete seed: `default`, or one drawn from the OS."""
        if self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63) if default is None else default)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def uniform_stream(seed: int, rows: int, length: int) -> np.ndarray:
    """The uniforms a run with `seed` uses: numpy's PCG64 float32 stream, row-major [rows, length]."""
    return np.random.Generator(np.random.PCG64(seed)).random((rows, length), dtype=np.float32)


def filter_logits(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The reference: p~ in float64 for the last axis, with Hugging Face's warpers' semantics
    (temperature, then top-k keeping ties, then top-p dropping the tail whose mass is <= 1 - top_p)."""
    z = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    v = z.shape[-1]
    if 0 < top_k < v:
        kth = np.sort(z, axis=-1)[..., v - top_k][..., None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p  # mass of the better tokens
        keep = np.zeros_like(p, bool)
        np.put_along_axis(keep, order, before < top_p, -1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


# --- the engine op: one draw per (row, position) -------------------------------------------------
# The inverse CDF runs in two levels: sums of blocks of BLOCK tokens pick the block, a cumulative
# sum inside that block picks the token (a cumulative sum over the whole vocabulary is the
# slowest kernel ONNX Runtime has for this; block sums are one vectorised reduction).
BLOCK = 256


@torch.library.custom_op("specgraph::sample", mutates_args=())
def sample(
    logits: torch.Tensor,  # [B, T, V]
    first: torch.Tensor,  # [B] positions before this are not drawn (they return the argmax)
    temperature: torch.Tensor,  # [B] float, 0 = greedy
    top_k: torch.Tensor,  # [B] int64, 0 = off
    top_p: torch.Tensor,  # [B] float, 1 = off
    u: torch.Tensor,  # [B, T] uniforms in [0, 1)
) -> torch.Tensor:
    """x[b, t] ~ p~ by inverse CDF in vocabulary order with u[b, t]; the argmax where temperature
    is 0 or t < first[b]. Eager form: the same arithmetic as the ONNX form, on every position."""
    b, t, v = logits.shape
    out = logits.argmax(dim=-1)  # [B, T]
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z = (logits.float() / temp[:, None, None]).reshape(b * t, v)  # [N, V]
    spread = lambda x: x[:, None].expand(b, t).reshape(-1)  # noqa: E731  [B] -> [N]
    x = _draw_rows_eager(z, spread(top_k), spread(top_p.float()), u.reshape(-1).float()).reshape(b, t)
    drawn = (torch.arange(t)[None, :] >= first[:, None]) & (temperature > 0)[:, None]
    return torch.where(drawn, x, out)


def _draw_rows_eager(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The eager twin of `_draw_rows`: a full sort stands in for its two TopK stages (the
    thresholds are the same logits), then the same two-level inverse CDF."""
    n, v = z.shape
    w = _kept_weights_eager(z, top_k, top_p)  # [N, V]
    pad = (-v) % BLOCK
    w3 = torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, BLOCK)  # [N, nb, BLOCK]
    wb = w3.sum(-1)  # [N, nb]
    cb = torch.cumsum(wb, -1)
    target = u[:, None] * cb[:, -1:]  # [N, 1]
    blk = torch.minimum((cb <= target).sum(-1), _last_positive_eager(wb))  # [N]
    within = w3[torch.arange(n), blk]  # [N, BLOCK]
    cw = torch.cumsum(within, -1) + (cb.gather(1, blk[:, None]) - wb.gather(1, blk[:, None]))
    pos = torch.minimum((cw <= target).sum(-1), _last_positive_eager(within))
    return blk * BLOCK + pos


def _kept_weights_eager(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, V]: exp(z - max) on the tokens top-k then top-p keep, 0 elsewhere (unnormalised p~)."""
    n, v = z.shape
    k_eff = torch.where(top_k > 0, torch.clamp(top_k, max=v), torch.full_like(top_k, v))  # [N]
    s = torch.sort(z, dim=-1, descending=True).values  # [N, V]
    e = torch.exp(z - s[:, :1])  # [N, V]
    es = torch.where(torch.arange(v)[None, :] < k_eff[:, None], torch.exp(s - s[:, :1]), torch.zeros_like(s))
    before = (torch.cumsum(es, -1) - es) / es.sum(-1, keepdim=True)  # [N, V] mass of the better tokens
    keep = (torch.arange(v)[None, :] < k_eff[:, None]) & (before < top_p[:, None])
    thr = s.gather(1, keep.sum(-1, keepdim=True) - 1)  # [N, 1] smallest kept logit
    return torch.where(z >= thr, e, torch.zeros_like(e))


def _last_positive_eager(w: torch.Tensor) -> torch.Tensor:
    idx = torch.arange(w.shape[-1])[None, :].expand_as(w)
    return torch.where(w > 0, idx, torch.zeros_like(idx)).max(-1).values


@sample.register_fake
def _sample_fake(logits, first, temperature, top_k, top_p, u):  # type: ignore[no-untyped-def]
    return torch.empty(logits.shape[:2], dtype=_I64, device=logits.device)


def _sample_onnx(logits, first, temperature, top_k, top_p, u):  # type: ignore[no-untyped-def]
    """ONNX form. Only the rows that need a draw are computed: R = T - min(first) positions per
    row, and R = 0 when every row is greedy, so a greedy call pays nothing for sampling."""
    op = _OPSET24
    zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
    t_len = op.Shape(logits, start=1, end=2)  # [1]
    vocab = op.Shape(logits, start=2, end=3)  # [1]
    greedy_row = op.LessOrEqual(temperature, op.CastLike(op.Constant(value_float=0.0), temperature))  # [B]
    any_drawn = op.ReduceMax(op.Cast(op.Not(greedy_row), to=_INT64), keepdims=1)  # [1]
    rows = op.Mul(op.Sub(t_len, op.ReduceMin(first, keepdims=1)), any_drawn)  # [1] R
    j = op.Range(op.Constant(value_int=0), op.Squeeze(rows, zero), op.Constant(value_int=1))  # [R]
    pos = op.Min(op.Add(op.Unsqueeze(first, one), op.Unsqueeze(j, zero)), op.Sub(t_len, one))  # [B, R]
    batch = op.Shape(first)  # [1]
    row0 = op.Mul(op.Range(op.Constant(value_int=0), op.Squeeze(batch, zero), op.Constant(value_int=1)), t_len)
    flat_pos = op.Reshape(op.Add(op.Unsqueeze(row0, one), pos), op.Constant(value_ints=[-1]))  # [N], N = B*R
    z = op.Gather(op.Reshape(logits, op.Concat(op.Constant(value_ints=[-1]), vocab, axis=0)), flat_pos, axis=0)
    per_row = op.Shape(pos)  # [2]: B, R

    def spread(x):  # type: ignore[no-untyped-def]  # [B] -> [N]
        return op.Reshape(op.Expand(op.Unsqueeze(x, one), per_row), op.Constant(value_ints=[-1]))

    temp = spread(op.Where(greedy_row, op.CastLike(op.Constant(value_float=1.0), temperature), temperature))
    z = op.Div(z, op.CastLike(op.Unsqueeze(temp, one), z))  # [N, V]
    u_rows = op.Reshape(op.GatherElements(u, pos, axis=1), op.Constant(value_ints=[-1]))  # [N]
    x = _draw_rows(op, z, spread(top_k), op.CastLike(spread(top_p), z), op.CastLike(u_rows, z))
    pad_col = op.Expand(op.Constant(value_ints=[0]), op.Concat(batch, one, axis=0))  # [B, 1]
    drawn = op.Concat(op.Reshape(x, per_row, allowzero=1), pad_col, axis=1)  # [B, R+1]
    t_idx = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(t_len, zero), op.Constant(value_int=1)), zero)
    rel = op.Sub(t_idx, op.Unsqueeze(first, one))  # [B, T]
    back = op.GatherElements(drawn, op.Min(op.Max(rel, zero), rows), axis=1)  # [B, T] (R = the pad)
    use = op.And(op.GreaterOrEqual(rel, zero), op.Not(op.Unsqueeze(greedy_row, one)))
    return op.Where(use, back, op.ArgMax(logits, axis=2, keepdims=0))


def _draw_rows(op, z, top_k, top_p, u):  # type: ignore[no-untyped-def]
    """x[n] ~ softmax(z[n]) restricted by top-k then top-p; z [N, V], top_k/top_p/u [N]."""
    vocab = op.Shape(z, start=1, end=2)  # [1]
    return _inverse_cdf_two_levels(op, _kept_weights(op, z, top_k, top_p), vocab, u)


def _kept_weights(op, z, top_k, top_p):  # type: ignore[no-untyped-def]
    """[N, V]: exp(z - max) on the tokens top-k then top-p keep, 0 elsewhere (unnormalised p~)."""
    zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
    vocab = op.Shape(z, start=1, end=2)  # [1]
    k_eff = op.Where(op.Greater(top_k, op.Constant(value_int=0)), op.Min(top_k, vocab), vocab)  # [N]
    need = op.Or(op.Less(k_eff, vocab), op.Less(top_p, op.CastLike(op.Constant(value_float=1.0), top_p)))  # [N]
    any_need = op.ReduceMax(op.Cast(need, to=_INT64), keepdims=1)  # [1]; no rows: the lowest int64
    top = op.ReduceMax(z, one, keepdims=1)  # [N, 1]
    e = op.Exp(op.Sub(z, top))  # [N, V]
    total = op.ReduceSum(e, one, keepdims=0)  # [N]
    # Stage 1: the best min(256, V) tokens, sorted; enough whenever the kept set lies inside them.
    # (A TopK whose result is not used runs on one row: any row will do, its output is discarded.)
    needed = op.Greater(any_need, zero)  # [1]
    k1 = op.Where(needed, op.Min(vocab, op.Constant(value_ints=[SORTED_PREFIX])), one)
    s1 = _sorted_prefix(op, z, k1, needed)  # [N, k1]
    k_off = op.Equal(k_eff, vocab)  # [N] no top-k cut
    thr1, fits = _threshold(op, s1, top, total, k_eff, k_off, top_p)
    # Stage 2 (only when some row's kept set reaches past the prefix): the whole vocabulary, sorted.
    all_fit = op.ReduceMin(op.Cast(op.Or(fits, op.Not(need)), to=_INT64), keepdims=1)
    short = op.Greater(all_fit, zero)  # [1]
    s2 = _sorted_prefix(op, z, op.Where(short, one, vocab), op.Not(short))  # [N, 1] or [N, V]
    thr2, _ = _threshold(op, s2, top, total, k_eff, k_off, top_p)
    neg_inf = op.CastLike(op.Constant(value_float=float("-inf")), z)
    thr = op.Where(need, op.Where(fits, thr1, thr2), neg_inf)  # [N]
    return op.Mul(e, op.CastLike(op.GreaterOrEqual(z, op.Unsqueeze(thr, one)), e))  # [N, V] (Mul beats Where)


def _inverse_cdf_two_levels(op, w, vocab, u):  # type: ignore[no-untyped-def]
    """The index where u [N] * total falls in the running sum of w [N, V] (see BLOCK)."""
    zero, one, two = op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), op.Constant(value_ints=[2])
    pad = op.Mod(op.Sub(op.Constant(value_ints=[BLOCK]), op.Mod(vocab, op.Constant(value_ints=[BLOCK]))),
                 op.Constant(value_ints=[BLOCK]))  # fmt: skip
    w = op.Pad(w, op.Concat(zero, zero, zero, pad, axis=0))  # [N, nb * BLOCK]
    blocks = op.Div(op.Add(vocab, pad), op.Constant(value_ints=[BLOCK]))  # [1] nb
    w3 = op.Reshape(w, op.Concat(op.Shape(w, start=0, end=1), blocks, op.Constant(value_ints=[BLOCK]), axis=0),
                    allowzero=1)  # [N, nb, BLOCK]  # fmt: skip
    wb = op.ReduceSum(w3, two, keepdims=0)  # [N, nb]
    cb = op.CumSum(wb, op.Constant(value_int=1))  # [N, nb]
    target = op.Mul(
        op.Unsqueeze(u, one), op.Slice(cb, op.Constant(value_ints=[-1]), op.Constant(value_ints=[2**62]), one)
    )
    blk = op.Min(_count_le(op, cb, target), _last_positive(op, wb))  # [N]
    blk_ = op.Unsqueeze(blk, one)  # [N, 1]
    within = op.Squeeze(op.GatherElements(w3, op.Expand(op.Unsqueeze(blk_, two),
                        op.Concat(op.Shape(blk_), op.Constant(value_ints=[BLOCK]), axis=0)), axis=1), one)  # fmt: skip
    start = op.Sub(op.GatherElements(cb, blk_, axis=1), op.GatherElements(wb, blk_, axis=1))  # [N, 1]
    cw = op.Add(op.CumSum(within, op.Constant(value_int=1)), start)  # [N, BLOCK]
    pos = op.Min(_count_le(op, cw, target), _last_positive(op, within))
    return op.Add(op.Mul(blk, op.Constant(value_int=BLOCK)), pos)


def _sorted_prefix(op, z, k, used):  # type: ignore[no-untyped-def]
    """The k largest entries of each row of z [N, V], sorted; computed on one row (and repeated)
    when `used` [1] is false, since the caller then discards them."""
    n = op.Shape(z, start=0, end=1)  # [1]
    rows = op.Where(used, n, op.Min(n, op.Constant(value_ints=[1])))
    s, _ = op.TopK(op.Slice(z, op.Constant(value_ints=[0]), rows, op.Constant(value_ints=[0])), k, axis=-1)
    return op.Expand(s, op.Concat(n, k, axis=0))


def _count_le(op, c, target):  # type: ignore[no-untyped-def]
    """[N]: how many entries of c [N, M] are <= target [N, 1] (c ascending: the first index past it)."""
    return op.ReduceSum(op.Cast(op.LessOrEqual(c, target), to=_INT64), op.Constant(value_ints=[1]), keepdims=0)


def _last_positive(op, w):  # type: ignore[no-untyped-def]
    """[N]: the last index with w > 0 (guards the inverse CDF against rounding past the support)."""
    idx = op.Range(op.Constant(value_int=0), op.Squeeze(op.Shape(w, start=1, end=2), op.Constant(value_ints=[0])),
                   op.Constant(value_int=1))  # fmt: skip
    pos = op.Where(op.Greater(w, op.CastLike(op.Constant(value_float=0.0), w)), op.Unsqueeze(idx, op.Constant(value_ints=[0])),
                   op.Constant(value_int=0))  # fmt: skip
    return op.ReduceMax(pos, op.Constant(value_ints=[1]), keepdims=0)


def _threshold(op, s, top, total, k_eff, k_off, top_p):  # type: ignore[no-untyped-def]
    """From the best k tokens' scaled logits s [N, k] (sorted), the smallest kept logit and whether
    the list was long enough to know it. Kept: the top-k, then tokens whose better tokens' mass
    (within the top-k) is below top_p. The list suffices when it holds the whole top-k, or when
    there is no top-k cut and the top-p boundary lies inside it."""
    one = op.Constant(value_ints=[1])
    width = op.Shape(s, start=1, end=2)  # [1] k
    j = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(width, op.Constant(value_ints=[0])),
                              op.Constant(value_int=1)), op.Constant(value_ints=[0]))  # [1, k]  # fmt: skip
    in_k = op.Less(j, op.Unsqueeze(k_eff, one))  # [N, k]
    k_fits = op.LessOrEqual(k_eff, width)  # [N] the top-k cut lies inside the list
    es = op.Where(in_k, op.Exp(op.Sub(s, top)), op.CastLike(op.Constant(value_float=0.0), s))  # [N, k]
    mass = op.Where(k_fits, op.ReduceSum(es, one, keepdims=0), total)  # [N] the top-k's mass
    before = op.Div(op.Sub(op.CumSum(es, op.Constant(value_int=1)), es), op.Unsqueeze(mass, one))  # [N, k]
    keep = op.And(in_k, op.Less(before, op.Unsqueeze(top_p, one)))  # [N, k]
    n_keep = op.ReduceSum(op.Cast(keep, to=_INT64), one, keepdims=0)  # [N] >= 1
    thr = op.Squeeze(op.GatherElements(s, op.Unsqueeze(op.Sub(n_keep, op.Constant(value_int=1)), one), axis=1), one)
    inside = op.Less(n_keep, op.Squeeze(width, op.Constant(value_ints=[0])))  # [N] a token was cut by top-p
    fits = op.Or(k_fits, op.And(k_off, inside))  # [N]
    return thr, fits


# --- the general rule: drafts with a real proposal distribution q ----------------------------------


def filtered(
    logits: torch.Tensor,  # [B, T, V]
    temperature: torch.Tensor,  # [B] float, 0 = greedy
    top_k: torch.Tensor,  # [B] int64, 0 = off
    top_p: torch.Tensor,  # [B] float, 1 = off
) -> torch.Tensor:
    """p~ [B, T, V] float32: softmax(logits / temperature) restricted by top-k then top-p and
    renormalised; at temperature 0 the one-hot of the argmax (the limit of p~ as T -> 0, and what
    makes the general rule below the greedy rule). Eager only: the engines export it inside
    `speculative` and `propose`, whose ONNX forms compute it on the drawn rows alone."""
    b, t, v = logits.shape
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z = (logits.float() / temp[:, None, None]).reshape(b * t, v)  # [N, V]
    spread = lambda x: x[:, None].expand(b, t).reshape(-1)  # noqa: E731  [B] -> [N]
    w = _kept_weights_eager(z, spread(top_k), spread(top_p.float()))  # [N, V]
    p = (w / w.sum(-1, keepdim=True)).reshape(b, t, v)
    onehot = (torch.arange(v)[None, None, :] == logits.argmax(dim=-1, keepdim=True)).float()  # [B, T, V]
    return torch.where((temperature > 0)[:, None, None], p, onehot)


def inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[...] int64: the token where u [...] * sum(w) falls in the running sum of w [..., V]
    (w >= 0, not necessarily normalised), never past the last token with w > 0."""
    c = torch.cumsum(w, dim=-1)  # [..., V]
    at = (c <= u[..., None] * c[..., -1:]).sum(dim=-1)  # [...]
    idx = torch.arange(w.shape[-1], dtype=_I64)
    last = torch.where(w > 0, idx, torch.zeros_like(idx)).amax(dim=-1)  # [...]
    return torch.minimum(at, last)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) [..., V]: what a rejected draft's token is drawn from (normalised by the draw)."""
    return torch.clamp(p - q, min=0)


def speculative_draw(
    p: torch.Tensor,  # [B, T, V] the target's p~ after each position
    q: torch.Tensor,  # [B, T, V] the proposal of the draft after each position (zeros: no draft)
    d: torch.Tensor,  # [B, T] the draft after each position
    u_accept: torch.Tensor,  # [B, T]
    u_residual: torch.Tensor,  # [B, T]
) -> torch.Tensor:
    """The target's token after each position under speculative sampling (Leviathan et al. 2023,
    Chen et al. 2023, Theorem 1): d ~ q is kept with probability min(1, p(d)/q(d)), else the
    token is drawn from max(0, p - q) normalised; either way it is distributed as p. A position
    with no draft (q = 0) draws from p. Returns d where kept, else the draw [B, T]."""
    pd = p.gather(2, d[..., None])[..., 0]  # [B, T]
    qd = q.gather(2, d[..., None])[..., 0]
    keep = (qd > 0) & (u_accept * qd < pd)  # u < p/q without dividing; q(d) > 0 for a drawn d
    res = residual(p, q)  # [B, T, V]
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, p)  # p == q up to rounding: rejection never happens
    return torch.where(keep, d, inverse_cdf(res, u_residual))


# --- the general rule as operators: a greedy call of a sampling engine pays only an argmax -------
# `filtered` and `speculative_draw` run over the whole vocabulary at every position they are given,
# also for rows at temperature 0 (where they reduce to the argmax): 8.4 ms of SmolLM2's 5-token
# verify against 0.3 ms for the argmax. These two operators are the same rule whose ONNX forms
# draw nothing when every row of the call is greedy (R = 0 rows computed, as `sample` does).


@torch.library.custom_op("specgraph::speculative", mutates_args=())
def speculative(
    logits: torch.Tensor,  # [B, W, V] the target's logits after each position
    q: torch.Tensor,  # [B, K, V] the proposals carried from the call that drew the drafts
    which: torch.Tensor,  # [B, W] int64: which proposal drew the draft after each position, -1: none
    d: torch.Tensor,  # [B, W] the draft after each position
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    u_accept: torch.Tensor,  # [B, W]
    u_residual: torch.Tensor,  # [B, W]
) -> torch.Tensor:
    """[B, W] int64: the target's token after each position under the general rule
    (`speculative_draw` on p~ = `filtered(logits)` and q = q[which], 0 where there is no draft);
    a row at temperature 0 gets the argmax."""
    p = filtered(logits, temperature, top_k, top_p)
    b, w, v = logits.shape
    q_t = q.gather(1, which.clamp(min=0)[..., None].expand(b, w, v)) * (which >= 0)[..., None].to(q.dtype)
    return speculative_draw(p, q_t, d, u_accept, u_residual)


@speculative.register_fake
def _speculative_fake(logits, q, which, d, temperature, top_k, top_p, u_accept, u_residual):  # type: ignore[no-untyped-def]
    return torch.empty(logits.shape[:2], dtype=_I64, device=logits.device)


def _speculative_onnx(logits, q, which, d, temperature, top_k, top_p, u_accept, u_residual):  # type: ignore[no-untyped-def]
    """ONNX form: the rule on the drawn rows only (all B*W, or none when every row is greedy)."""
    op = _OPSET24
    one = op.Constant(value_ints=[1])
    greedy_row, rows, z, take, spread = _drawn_rows(op, logits, temperature)
    p = _normalised(op, _kept_weights(op, z, spread(top_k), op.CastLike(spread(top_p), z)))  # [R, V]
    k = op.Shape(q, start=1, end=2)  # [1]
    row = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(op.Shape(q, start=0, end=1), op.Constant(value_ints=[0])),
                                op.Constant(value_int=1)), one)  # [B, 1]  # fmt: skip
    which_r = take(op.Add(op.Mul(row, k), op.Max(which, op.Constant(value_int=0))))  # [R] rows of q [B*K, V]
    has = op.CastLike(take(op.GreaterOrEqual(which, op.Constant(value_int=0))), logits)  # [R]
    q_flat = op.Reshape(q, op.Concat(op.Constant(value_ints=[-1]), op.Shape(q, start=2), axis=0))
    q_r = op.Mul(op.Gather(q_flat, which_r, axis=0), op.Unsqueeze(has, one))  # [R, V]
    d_r = take(d)  # [R]
    d_col = op.Unsqueeze(d_r, one)  # [R, 1]
    pd = op.Squeeze(op.GatherElements(p, d_col, axis=1), one)  # [R]
    qd = op.Squeeze(op.GatherElements(q_r, d_col, axis=1), one)
    zero_f = op.CastLike(op.Constant(value_float=0.0), p)
    keep = op.And(op.Greater(qd, zero_f), op.Less(op.Mul(op.CastLike(take(u_accept), p), qd), pd))  # [R]
    res = residual_onnx(op, p, q_r)  # [R, V]
    res = op.Where(op.Greater(op.ReduceSum(res, one, keepdims=1), zero_f), res, p)
    vocab = op.Shape(logits, start=2, end=3)
    x_r = op.Where(keep, d_r, _inverse_cdf_two_levels(op, res, vocab, op.CastLike(take(u_residual), p)))  # [R]
    x = _back_to_rows(op, x_r, rows, logits)  # [B, W]
    return op.Where(op.Unsqueeze(greedy_row, one), op.ArgMax(logits, axis=2, keepdims=0), x)


def residual_onnx(op, p, q):  # type: ignore[no-untyped-def]
    """ONNX form of `residual`: max(0, p - q)."""
    return op.Relu(op.Sub(p, q))


@torch.library.custom_op("specgraph::propose", mutates_args=())
def propose(
    logits: torch.Tensor,  # [B, T, V] a drafter's logits
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    u: torch.Tensor,  # [B, T] the draft's own draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's tokens d [B, T] int64 and their proposal q [B, T, V]: d ~ q = `filtered(logits)`
    by inverse CDF with u. A row at temperature 0 drafts its argmax and carries q = 0: the rule
    gives such a row the target's argmax whatever q says, so q is never computed there."""
    q = filtered(logits, temperature, top_k, top_p)
    d = inverse_cdf(q, u)
    return d, q * (temperature > 0)[:, None, None].to(q.dtype)


@propose.register_fake
def _propose_fake(logits, temperature, top_k, top_p, u):  # type: ignore[no-untyped-def]
    return torch.empty(logits.shape[:2], dtype=_I64, device=logits.device), torch.empty_like(
        logits, dtype=torch.float32
    )


def _propose_onnx(logits, temperature, top_k, top_p, u):  # type: ignore[no-untyped-def]
    """ONNX form: the draw on the drawn rows only (all B*T, or none when every row is greedy)."""
    op = _OPSET24
    one, two = op.Constant(value_ints=[1]), op.Constant(value_ints=[2])
    greedy_row, rows, z, take, spread = _drawn_rows(op, logits, temperature)
    w = _kept_weights(op, z, spread(top_k), op.CastLike(spread(top_p), z))  # [R, V]
    vocab = op.Shape(logits, start=2, end=3)
    d_r = _inverse_cdf_two_levels(op, w, vocab, op.CastLike(take(u), w))  # [R]
    d = op.Where(
        op.Unsqueeze(greedy_row, one), op.ArgMax(logits, axis=2, keepdims=0), _back_to_rows(op, d_r, rows, logits)
    )
    q = _back_to_rows(op, _normalised(op, w), rows, logits)  # [B, T, V]
    sampled = op.CastLike(op.Not(greedy_row), q)  # [B]: a greedy row carries q = 0
    return d, op.Mul(q, op.Unsqueeze(sampled, op.Concat(one, two, axis=0)))


def _drawn_rows(op, logits, temperature):  # type: ignore[no-untyped-def]
    """The rows of logits [B, T, V] a call draws: all N = B*T when any row samples, else none.
    Returns the greedy rows [B], R [1], their scaled logits z [R, V] (temperature 1 on greedy
    rows, whose result the caller replaces by the argmax), `take` ([B, T, ...] -> its first R
    rows [R, ...]) and `spread` ([B] -> [R])."""
    zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
    b_t = op.Shape(logits, start=0, end=2)  # [2]
    greedy_row = op.LessOrEqual(temperature, op.CastLike(op.Constant(value_float=0.0), temperature))  # [B]
    any_drawn = op.ReduceMax(op.Cast(op.Not(greedy_row), to=_INT64), keepdims=1)  # [1]
    rows = op.Mul(op.ReduceProd(b_t, keepdims=1), any_drawn)  # [1] R

    def take(x):  # type: ignore[no-untyped-def]
        flat = op.Concat(op.Constant(value_ints=[-1]), op.Shape(x, start=2), axis=0)
        return op.Slice(op.Reshape(x, flat), zero, rows, zero)

    def spread(x):  # type: ignore[no-untyped-def]  # [B] -> [R]
        return take(op.Expand(op.Unsqueeze(x, one), b_t))

    temp = op.Where(greedy_row, op.CastLike(op.Constant(value_float=1.0), temperature), temperature)
    z = op.Cast(take(logits), to=onnxscript.ir.DataType.FLOAT)  # [R, V]
    z = op.Div(z, op.Cast(op.Unsqueeze(spread(temp), one), to=onnxscript.ir.DataType.FLOAT))
    return greedy_row, rows, z, take, spread


def _normalised(op, w):  # type: ignore[no-untyped-def]
    return op.Div(w, op.ReduceSum(w, op.Constant(value_ints=[1]), keepdims=1))


def _back_to_rows(op, x_r, rows, logits):  # type: ignore[no-untyped-def]
    """x_r [R, ...] back to [B, T, ...] (R = B*T, or 0: then zeros)."""
    b_t = op.Shape(logits, start=0, end=2)
    n = op.ReduceProd(b_t, keepdims=1)  # [1]
    rest = op.Shape(x_r, start=1)  # [] or [V]
    pad = op.ConstantOfShape(op.Concat(op.Sub(n, rows), rest, axis=0))  # float zeros
    full = op.Concat(x_r, op.CastLike(pad, x_r), axis=0)  # [N, ...]
    return op.Reshape(full, op.Concat(b_t, rest, axis=0))


ONNX_TRANSLATIONS: dict[Any, Any] = {
    torch.ops.specgraph.sample.default: _sample_onnx,
    torch.ops.specgraph.speculative.default: _speculative_onnx,
    torch.ops.specgraph.propose.default: _propose_onnx,
}


def example_inputs(batch: int, max_context: int, streams: int = 1) -> list[torch.Tensor]:
    """Tracing values for the four sampling inputs (uniforms [B, streams * (S+1)])."""
    return [torch.zeros(batch), torch.zeros(batch, dtype=_I64), torch.ones(batch),
            torch.zeros(batch, streams * (max_context + 1))]  # fmt: skip


def position_uniforms(uniforms: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u for drawing the token at each of `positions` [B, R] from the [B, S+1] stream."""
    return uniforms.gather(1, positions.clamp(max=uniforms.shape[1] - 1))


def stream(positions: torch.Tensor, r: int, streams: int) -> torch.Tensor:
    """Column of draw r of the token at `positions` in uniforms [B, streams * (S+1)]: the
    columns are position-major (streams * i + r), so one stream of length streams * (S+1) serves."""
    return positions * streams + r if streams > 1 else positions
