"""The fused step engine: one call = one speculation round, accept rule and drafting included.

Inputs (every tensor keeps the batch dimension B):
  tokens      [B, T]  int64  the tokens to run: `n_fixed` known tokens, then the drafts
  n_fixed     [B]     int64  how many leading tokens are given (the prompt at prefill, 1 later);
                             per row, so prompts of different lengths share one prefill: a
                             row's tokens after its n_fixed are drafts like any other
  cache_len   [B]     int64  tokens already in the KV cache; this call writes at that offset
  *state_inputs       a drafter's own per-row state (lookup: history [B, S+1], every token so far)
  temperature [B] float, top_k [B] int64, top_p [B] float, uniforms [B, R*(S+1)] float
              (engines compiled with sampling; see sampling.py) how to draw, and the R uniforms
              for the token at each absolute position (R = `uniform_streams`: 1 for point-mass
              drafters, 3 for a drafter with a real proposal q); temperature 0 is greedy
  past_key_i  [B, Hkv, D, S] / past_value_i [B, Hkv, S, D]  the preallocated caches
Outputs:
  accepted    [B, T]  int64  tokens to emit this round; row b emits accepted[b, :n_accepted[b]]
  n_accepted  [B]     int64
  next_tokens [B, 1+K] int64 next round's tokens: the bonus token then K drafts
  cache_len_out [B]   int64
  *draft_outputs      the drafter's state for the next call (`<name>_out` feeds `<name>`) and
                      counts the host trims by (lookup: n_draft, see methods/lookup.py)
  present_key_i / present_value_i (bound onto the caches: written in place)
  logits      [B, T, V] (only when compiled with `emit_logits`, for tests)

The host binds each output to the matching input of the next call and emits accepted tokens;
it never edits a tensor.
"""

from __future__ import annotations

import torch
import torch.fx

from specgraph import sampling

_I64 = torch.int64
_SPAN_BUCKET = 64  # attention reads cache slots in multiples of this
MAX_BATCH = 64  # rows per call: the exported batch dimension's upper bound (hosts refuse more)


class StepEngine(torch.nn.Module):
    """The chain engine: verify the tokens given, accept the longest correct prefix, and propose
    the next round's tokens with `draft`. This class drafts nothing (plain decoding); a chain
    drafter subclasses it and declares the per-row state it carries between calls."""

    state_inputs: tuple[str, ...] = ()  # drafter state [B, ...], zero at the first call; fed by `<name>_out`
    draft_outputs: tuple[str, ...] = ()  # what `draft` returns besides next_tokens, in order
    trims: dict[str, str] = {}  # output -> the count output that says how much of it the next call needs
    extra_slots = 0  # cache slots a call writes beyond its tokens
    uniform_streams = 1  # uniforms per position: one draw (point-mass drafts) or more (see `proposal`)
    # True: `draft` also takes the target's caches as this call's verify left them (a self-draft
    # reads and writes them instead of keeping its own: `methods/draft.py`)
    reads_target_cache = False

    def __init__(
        self,
        target: torch.fx.GraphModule,
        num_layers: int,
        max_context: int,
        sliding_window: int | None = None,
        emit_logits: bool = False,
        sampling: bool = False,
    ) -> None:
        super().__init__()
        self.target = target
        self.sampling = sampling
        self.num_layers = num_layers
        self.max_context = max_context
        self.sliding_window = sliding_window
        self.emit_logits = emit_logits

    def io_names(self) -> tuple[list[str], list[str]]:
        """Graph input and output names, in the order forward takes and returns them."""
        inputs = ["tokens", "n_fixed", "cache_len", *self.state_inputs]
        outputs = ["accepted", "n_accepted", "next_tokens", "cache_len_out", *self.draft_outputs]
        if self.sampling:
            inputs += sampling.INPUTS
        inputs += kv_names("past", self.num_layers)
        outputs += kv_names("present", self.num_layers)
        return inputs, outputs + (["logits"] if self.emit_logits else [])

    def example_state(self, batch: int) -> list[torch.Tensor]:
        """Example values of `state_inputs` for tracing."""
        return []

    def example_inputs(self, kv_shapes: list[tuple[int, ...]], batch: int = 2, tokens: int = 4) -> tuple:
        """Inputs for tracing; batch and token counts must not be 1 (torch.export would specialise)."""
        args = [torch.zeros(batch, tokens, dtype=_I64), torch.ones(batch, dtype=_I64), torch.zeros(batch, dtype=_I64)]
        args += self.example_state(batch)
        if self.sampling:
            args += sampling.example_inputs(batch, self.max_context, self.uniform_streams)
        return (*args, *(torch.zeros(batch, *shape) for shape in kv_shapes))

    def dynamic_shapes(self, args: tuple) -> tuple:
        batch, tokens = dims(self.max_context)
        # forward(tokens, n_fixed, cache_len, *state): the varargs form one nested entry
        return ({0: batch, 1: tokens}, {0: batch}, {0: batch}, tuple({0: batch} for _ in args[3:]))

    def draft(self, state, tokens, cache_len, bonus, cache_len_out, params):  # type: ignore[no-untyped-def]
        """Next round's tokens [B, 1+K] (the bonus, then K drafts) and the `draft_outputs`.
        tokens [B, T] are this call's, cache_len [B] where they started; the committed ones are
        the first cache_len_out - cache_len, and the bonus [B, 1] goes at position cache_len_out.
        params: the four sampling inputs (empty for a greedy-only engine). A method whose pass
        adds outputs to the target graph gets them after `params`, and with `reads_target_cache`
        the target's caches follow."""
        return bonus, []

    def proposal(self, state):  # type: ignore[no-untyped-def]
        """The proposal distributions q [B, K, V] of this call's drafts tokens[:, 1:] (carried in
        `state` from the call that drew them), or None when every draft is a point mass (lookup,
        Medusa, greedy drafting): then the verifier uses the one-hot closed form of the rule."""
        return None

    def forward(self, tokens, n_fixed, cache_len, *rest):  # type: ignore[no-untyped-def]
        n_state = len(self.state_inputs)
        state, rest = rest[:n_state], rest[n_state:]
        params, kv = (rest[:4], rest[4:]) if self.sampling else ((), rest)
        b, t = tokens.shape
        s = kv[1].shape[-2]  # cache slots: past_value_0 is [B, Hkv, S, D]
        offsets = torch.arange(t, dtype=_I64)
        positions = cache_len[:, None] + offsets[None, :]  # [B, T]; a chain sits at consecutive slots
        masks = chain_masks(positions, s, self.sliding_window)
        span = attn_span(cache_len.max() + t, s)
        logits, *rest = self.target(tokens, positions, *masks, cache_len, span, *kv)
        # the caches, then any output a method's pass added (EAGLE: the LM head's input)
        present, added = rest[: 2 * self.num_layers], rest[2 * self.num_layers :]
        q = self.proposal(state) if self.sampling else None
        if q is not None:  # draws 0 and 1 of the token after each position: accept, residual
            cols = [sampling.stream(positions + 1, r, self.uniform_streams) for r in (0, 1)]
            u2 = torch.stack([sampling.position_uniforms(params[3], c) for c in cols], dim=-1)  # [B, T, 2]
            pred = _chain_targets(tokens, logits, n_fixed, params[:3], u2, q)
        elif self.sampling:
            u = sampling.position_uniforms(params[3], positions + 1)  # [B, T] for the token after each
            pred = _chain_targets(tokens, logits, n_fixed, params[:3], u)
        else:
            pred = logits.argmax(dim=-1)  # [B, T]
        accepted, n_accepted, bonus, committed = accept_chain(tokens, pred, n_fixed)
        cache_len_out = cache_len + committed  # [B]
        shared = present if self.reads_target_cache else ()
        next_tokens, extra = self.draft(state, tokens, cache_len, bonus, cache_len_out, params, *added, *shared)
        outputs = [accepted, n_accepted, next_tokens, cache_len_out, *extra, *present]
        if self.emit_logits:
            outputs.append(logits)
        return tuple(outputs)


def chain_masks(positions: torch.Tensor, slots: int, window: int | None) -> list[torch.Tensor]:
    """Attention masks [B, 1, T, S] of a chain at `positions` [B, T]: causal over the cache slots,
    and with a sliding window also `position - slot < window` (for the local layers)."""
    slot = torch.arange(slots, dtype=_I64)[None, None, None, :]
    mask = slot <= positions[:, None, :, None]
    return [mask, mask & ((positions[:, None, :, None] - slot) < window)] if window else [mask]


def attn_span(reach: torch.Tensor, slots: int) -> torch.Tensor:
    """[1]: how many cache slots attention reads: `reach` (one past the last position written)
    rounded up to a bucket so shapes repeat, at most the cache."""
    return torch.clamp((reach + _SPAN_BUCKET - 1) // _SPAN_BUCKET * _SPAN_BUCKET, max=slots).reshape(1)


def kv_names(prefix: str, num_layers: int) -> list[str]:
    return [f"{prefix}_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


def dims(max_context: int) -> tuple[torch.export.Dim, torch.export.Dim]:
    """The dynamic batch and token dimensions every engine exports with."""
    return torch.export.Dim("batch", min=1, max=MAX_BATCH), torch.export.Dim("tokens", min=1, max=max_context)


def _chain_targets(tokens, logits, n_fixed, params, u, q=None):  # type: ignore[no-untyped-def]
    """The target's token after each position under speculative sampling; `accept_chain` keeps
    the drafts that equal it. q [B, K, V]: the proposals of the drafts tokens[:, n_fixed:], and u
    [B, T, 2] the accept and residual draws: the general rule (`sampling.speculative`).
    q None (point-mass drafts) and u [B, T]: the same rule's closed form for one-hot q, x[t] ~ p~
    by inverse CDF with u[t] (argmax at temperature 0), which needs neither q nor the drafts (see
    sampling.py for why the two coincide)."""
    if q is None:
        return torch.ops.specgraph.sample(logits, n_fixed - 1, *params, u)
    t, k = tokens.shape[1], q.shape[1]
    # Only the last K + 1 positions can be read (at most K drafts follow the given tokens), so p~
    # is computed there alone: a prefill of P tokens must not filter P rows of the vocabulary.
    # Positions before the window carry no proposal; in a call whose given tokens end earlier (a
    # ragged batch's padded prefill row) they are drawn from p~ alone, with the residual stream.
    w = torch.sym_min(t, k + 1)  # [B, W] window
    d = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)[:, t - w :]  # [B, W] the draft after each position
    idx = torch.arange(t - w, t, dtype=_I64)[None, :]  # [1, W] the window's positions
    which = idx - (n_fixed[:, None] - 1)  # [B, W] which carried proposal drew that draft
    has_draft = (which >= 0) & (idx < t - 1)  # the last position has no draft after it
    which = torch.where(has_draft, which.clamp(max=k - 1), -1)  # -1: q = 0, draw from p~
    x = torch.ops.specgraph.speculative(logits[:, t - w :], q, which, d, *params, u[:, t - w :, 0], u[:, t - w :, 1])
    first = torch.clamp(n_fixed - 1, max=t - w)  # == T - W (nothing to draw) in every unpadded call
    before = torch.ops.specgraph.sample(logits[:, : t - w], first, *params, u[:, : t - w, 1])  # [B, T-W]
    return torch.cat([before, x], dim=1)  # [B, T]


def leading_run(ok: torch.Tensor) -> torch.Tensor:
    """How many leading entries along the last dimension of the bool `ok` are true (int64, one
    dimension fewer): the length of a chain's prefix whose every check passed."""
    return (torch.cumsum((~ok).to(_I64), dim=-1) == 0).to(_I64).sum(dim=-1)


def accept_chain(tokens: torch.Tensor, pred: torch.Tensor, n_fixed: torch.Tensor):  # type: ignore[no-untyped-def]
    """Verification of a chain: keep the longest draft prefix equal to the target's own tokens.

    Token t+1 is kept when it is given (t+1 < n_fixed) or equals pred[t], the target's token
    after position t (its argmax, or its draw with that position's uniform). With argmax this is
    the lossless greedy rule of speculative decoding; with draws it is speculative sampling for
    one-hot drafts. Either way the emitted text is what the target alone would have produced.
    """
    b, t = tokens.shape
    later = torch.arange(1, t, dtype=_I64)[None, :]  # index of the token being checked
    ok = (later < n_fixed[:, None]) | (pred[:, :-1] == tokens[:, 1:])  # [B, T-1]
    kept = leading_run(ok)  # [B] tokens after the first that are committed
    bonus = pred.gather(1, kept[:, None])  # [B, 1] the target's own next token
    shifted = torch.cat([tokens[:, 1:], bonus], dim=1)  # [B, T]: tokens[t+1], bonus last
    idx = torch.arange(t, dtype=_I64)[None, :]
    out_seq = torch.where(idx == kept[:, None], bonus, shifted)  # [B, T]
    start = n_fixed[:, None] - 1  # drafts begin after the given tokens
    gather_idx = torch.clamp(start + idx, max=t - 1)
    accepted = out_seq.gather(1, gather_idx)  # [B, T]
    n_accepted = kept - n_fixed + 2  # accepted drafts plus the bonus
    return accepted, n_accepted, bonus, kept + 1
