"""The fused step engine: one call = one speculation round, accept rule and drafting included.

Inputs (every tensor keeps the batch dimension B):
  tokens      [B, T]  int64  the tokens to run: `n_fixed` known tokens, then the drafts
  n_fixed     [B]     int64  how many leading tokens are given (the prompt at prefill, 1 later)
  cache_len   [B]     int64  tokens already in the KV cache; this call writes at that offset
  history     [B, S+1] int64 (lookup only) every token so far, for the n-gram proposer
  temperature [B] float, top_k [B] int64, top_p [B] float, uniforms [B, S+1] float
              (engines compiled with sampling; see sampling.py) how to draw, and the uniform
              for the token at each absolute position; temperature 0 is greedy
  past_key_i  [B, Hkv, D, S] / past_value_i [B, Hkv, S, D]  the preallocated caches
Outputs:
  accepted    [B, T]  int64  tokens to emit this round; row b emits accepted[b, :n_accepted[b]]
  n_accepted  [B]     int64
  next_tokens [B, 1+K] int64 next round's tokens: the bonus token then K drafts
  cache_len_out [B]   int64
  n_draft     [B]     int64 (lookup only) how many of the K drafts are real: the next call should
                      send tokens = next_tokens[:, :1 + max(n_draft)] (the rest repeat a token
                      for want of a match, and verifying them costs time for nothing)
  history_out (lookup only), present_key_i / present_value_i (bind them onto the inputs)
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


class StepEngine(torch.nn.Module):
    def __init__(
        self,
        target: torch.fx.GraphModule,
        num_layers: int,
        max_context: int,
        method: str = "none",
        num_draft: int = 0,
        max_ngram: int = 3,
        sliding_window: int | None = None,
        emit_logits: bool = False,
        sampling: bool = False,
    ) -> None:
        super().__init__()
        self.target = target
        self.sampling = sampling
        self.num_layers = num_layers
        self.max_context = max_context
        self.method = method
        self.num_draft = num_draft if method == "lookup" else 0
        self.max_ngram = max_ngram
        self.sliding_window = sliding_window
        self.emit_logits = emit_logits

    def io_names(self) -> tuple[list[str], list[str]]:
        """Graph input and output names, in the order forward takes and returns them."""
        inputs = ["tokens", "n_fixed", "cache_len"]
        outputs = ["accepted", "n_accepted", "next_tokens", "cache_len_out"]
        if self.method == "lookup":
            inputs.append("history")
            outputs += ["history_out", "n_draft"]
        if self.sampling:
            inputs += sampling.INPUTS
        inputs += kv_names("past", self.num_layers)
        outputs += kv_names("present", self.num_layers)
        return inputs, outputs + (["logits"] if self.emit_logits else [])

    def example_inputs(self, kv_shapes: list[tuple[int, ...]], batch: int = 2, tokens: int = 4) -> tuple:
        """Inputs for tracing; batch and token counts must not be 1 (torch.export would specialise)."""
        args = [torch.zeros(batch, tokens, dtype=_I64), torch.ones(batch, dtype=_I64), torch.zeros(batch, dtype=_I64)]
        if self.method == "lookup":
            args.append(torch.zeros(batch, self.max_context + 1, dtype=_I64))
        if self.sampling:
            args += sampling.example_inputs(batch, self.max_context)
        return (*args, *(torch.zeros(batch, *shape) for shape in kv_shapes))

    def dynamic_shapes(self, args: tuple) -> tuple:
        batch, tokens = dims(self.max_context)
        # forward(tokens, n_fixed, cache_len, *state): the varargs form one nested entry
        return ({0: batch, 1: tokens}, {0: batch}, {0: batch}, tuple({0: batch} for _ in args[3:]))

    def forward(self, tokens, n_fixed, cache_len, *state):  # type: ignore[no-untyped-def]
        history = state[0] if self.method == "lookup" else None
        state = state[1:] if self.method == "lookup" else state
        params, kv = (state[:4], state[4:]) if self.sampling else ((), state)
        b, t = tokens.shape
        s = kv[1].shape[-2]  # cache slots: past_value_0 is [B, Hkv, S, D]
        offsets = torch.arange(t, dtype=_I64)
        positions = cache_len[:, None] + offsets[None, :]  # [B, T]; a chain sits at consecutive slots
        slots = torch.arange(s, dtype=_I64)
        mask = slots[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S] causal over the cache
        masks = [mask]
        if self.sliding_window:
            recent = (positions[:, None, :, None] - slots[None, None, None, :]) < self.sliding_window
            masks.append(mask & recent)
        # Attend over the used slots only, rounded up to a bucket so shapes repeat.
        reach = cache_len.max() + t
        span = torch.clamp((reach + _SPAN_BUCKET - 1) // _SPAN_BUCKET * _SPAN_BUCKET, max=s).reshape(1)  # [1]
        logits, *present = self.target(tokens, positions, *masks, cache_len, span, *kv)
        if self.sampling:
            u = sampling.position_uniforms(params[3], positions + 1)  # [B, T] for the token after each
            pred = _chain_targets(tokens, logits, n_fixed, params[:3], u)
        else:
            pred = logits.argmax(dim=-1)  # [B, T]
        accepted, n_accepted, bonus, committed = accept_chain(tokens, pred, n_fixed)
        cache_len_out = cache_len + committed  # [B]
        outputs = [accepted, n_accepted]
        if self.method == "lookup":
            history_out = _record(history, tokens, cache_len, bonus, cache_len_out)
            drafts, n_draft = _lookup_drafts(history_out, cache_len_out, self.num_draft, self.max_ngram)
            next_tokens = torch.cat([bonus, drafts], dim=1)  # [B, 1+K]
            outputs += [next_tokens, cache_len_out, history_out, n_draft]
        else:
            outputs += [bonus, cache_len_out]
        outputs += present
        if self.emit_logits:
            outputs.append(logits)
        return tuple(outputs)


def kv_names(prefix: str, num_layers: int) -> list[str]:
    return [f"{prefix}_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


def dims(max_context: int) -> tuple[torch.export.Dim, torch.export.Dim]:
    """The dynamic batch and token dimensions every engine exports with."""
    return torch.export.Dim("batch", min=1, max=64), torch.export.Dim("tokens", min=1, max=max_context)


def _chain_targets(tokens, logits, n_fixed, params, u):  # type: ignore[no-untyped-def]
    """The target's token after each position: x[t] ~ p~(. | tokens[..t]) drawn with u[t]
    (argmax at temperature 0). Accepting the drafts that equal x is speculative sampling with
    one-hot draft distributions (see sampling.py); `tokens` is unused by this exact rule."""
    return torch.ops.specgraph.sample(logits, n_fixed - 1, *params, u)


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
    run = (torch.cumsum((~ok).to(_I64), dim=-1) == 0).to(_I64)  # 1 while every check so far passed
    kept = run.sum(dim=-1)  # [B] tokens after the first that are committed
    bonus = pred.gather(1, kept[:, None])  # [B, 1] the target's own next token
    shifted = torch.cat([tokens[:, 1:], bonus], dim=1)  # [B, T]: tokens[t+1], bonus last
    idx = torch.arange(t, dtype=_I64)[None, :]
    out_seq = torch.where(idx == kept[:, None], bonus, shifted)  # [B, T]
    start = n_fixed[:, None] - 1  # drafts begin after the given tokens
    gather_idx = torch.clamp(start + idx, max=t - 1)
    accepted = out_seq.gather(1, gather_idx)  # [B, T]
    n_accepted = kept - n_fixed + 2  # accepted drafts plus the bonus
    return accepted, n_accepted, bonus, kept + 1


def _record(history, tokens, cache_len, bonus, cache_len_out):  # type: ignore[no-untyped-def]
    """Write this call's tokens, then the bonus, into the token history ([B, S+1])."""
    hist = torch.ops.specgraph.kv_write(history, tokens, cache_len, -1)
    return torch.ops.specgraph.kv_write(hist, bonus, cache_len_out, -1)


def _lookup_drafts(seq: torch.Tensor, last: torch.Tensor, k: int, max_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafting: find the latest earlier occurrence of the longest n-gram
    (n = max_ngram..1) ending at position `last` and propose the k tokens that followed it.

    seq [B, L] holds valid tokens at 0..last[b]; positions past `last` are ignored. Returns the
    drafts [B, K] and how many are real [B]: a row with no match proposes the bonus token
    repeated (0 real), and a match near the end repeats the last token past what followed it.
    """
    b, length = seq.shape
    start = torch.full_like(last, -1)  # [B] first draft's index in seq, -1 = none yet
    for n in range(max_ngram, 0, -1):
        windows = length - n + 1
        tail_idx = torch.clamp(last[:, None] - (n - 1) + torch.arange(n, dtype=_I64)[None, :], min=0)  # [B, n]
        tail = seq.gather(1, tail_idx)  # [B, n]
        hit = torch.ones(b, windows, dtype=torch.bool)
        for i in range(n):
            hit = hit & (seq[:, i : i + windows] == tail[:, i : i + 1])  # [B, W]
        j = torch.arange(windows, dtype=_I64)[None, :]
        valid = (j <= (last[:, None] - n)) & (last[:, None] >= n - 1)  # strictly earlier than the tail
        best = torch.where(hit & valid, j, torch.full_like(j, -1)).max(dim=-1).values  # [B] latest match
        found = torch.where(best >= 0, best + n, torch.full_like(best, -1))
        start = torch.where(start < 0, found, start)
    idx = start[:, None] + torch.arange(k, dtype=_I64)[None, :]  # [B, K]
    idx = torch.where(start[:, None] < 0, last[:, None], torch.minimum(idx, last[:, None]))
    real = torch.where(start < 0, torch.zeros_like(start), torch.clamp(last - start + 1, max=k))  # [B]
    return seq.gather(1, idx), real
