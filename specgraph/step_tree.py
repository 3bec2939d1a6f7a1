"""The tree step engine: verify a tree of candidates in one call, accept the longest correct
branch, and let the drafter (`propose`, e.g. Medusa's heads in methods/medusa) fill the next
tree from the hidden state of the last accepted token. Every tree method is verified here.

Inputs beyond the chain engine's (see step.py):
  path_src [B, P], n_path [B]   last round's accepted nodes, moved into place by this call's write
  tree_mask [N, N] bool, tree_depths [N], tree_parent [N], tree_head [N], tree_rank [N],
  tree_retrieve [L, P+1]        the candidate tree (node 0 = root = the bonus token; -1 pads);
                                constants the host binds once, so one engine runs any tree
  temperature, top_k, top_p, uniforms   (engines compiled with sampling) as in step.py
Outputs: accepted [B, P+1], n_accepted [B], next_tokens [B, N], cache_len_out [B],
  path_src_out [B, P], n_path_out [B], present_*; logits [B, T, V] with emit_logits.
A call whose rows have n_fixed == 1 and T == N is a tree step; anything else (the prefill) is a
chain whose first n_fixed tokens are given and whose later tokens (a ragged batch's padding) are
rejected: it emits the bonus only. Per row: in a ragged prefill, a 1-token prompt padded to N
tokens is a tree step whose nodes are the padding, verified like any tree.
"""

from __future__ import annotations

import torch
import torch.fx

from specgraph import sampling
from specgraph.step import accept_chain, attn_span, dims, kv_names, leading_run

_I64 = torch.int64


class TreeStepEngine(torch.nn.Module):
    def __init__(
        self,
        target: torch.fx.GraphModule,
        num_layers: int,
        max_context: int,
        num_heads: int,
        sliding_window: int | None = None,
        emit_logits: bool = False,
        typical: tuple[float, float, float] | None = None,
        sampling: bool = False,
    ) -> None:
        super().__init__()
        self.sampling = sampling
        self.target = target
        self.num_layers = num_layers
        self.max_context = max_context
        self.num_heads = num_heads  # the deepest tree the drafter fills (Medusa: one head per depth)
        self.sliding_window = sliding_window
        self.emit_logits = emit_logits
        self.typical = typical  # (threshold, alpha, temperature): Medusa's LOSSY typical acceptance

    state_inputs = ("path_src", "n_path")  # last round's accepted path, zero at the first call
    trims: dict[str, str] = {}

    @property
    def extra_slots(self) -> int:
        """Cache slots a call writes beyond its tokens: last round's path, moved into place."""
        return self.num_heads

    def propose(self, h: torch.Tensor, tree_head: torch.Tensor, tree_rank: torch.Tensor) -> torch.Tensor:
        """The next tree's tokens [B, N] from the hidden state h [B, H] of the last accepted token:
        node i is the drafter's rank `tree_rank[i]` candidate at depth `tree_head[i] + 1`."""
        raise NotImplementedError

    TREE_INPUTS = ("tree_mask", "tree_depths", "tree_parent", "tree_head", "tree_rank", "tree_retrieve")

    def io_names(self) -> tuple[list[str], list[str]]:
        inputs = ["tokens", "n_fixed", "cache_len", "path_src", "n_path", *self.TREE_INPUTS]
        inputs += sampling.INPUTS if self.sampling else ()
        outputs = ["accepted", "n_accepted", "next_tokens", "cache_len_out", "path_src_out", "n_path_out"]
        inputs += kv_names("past", self.num_layers)
        outputs += kv_names("present", self.num_layers)
        return inputs, outputs + (["logits"] if self.emit_logits else [])

    def example_inputs(self, kv_shapes: list[tuple[int, ...]], batch: int = 2, tokens: int = 5) -> tuple:
        """A 4-node example tree ((0,), (1,), (0, 0)) and 5 tokens: no dimension equals another."""
        k = self.num_heads
        retrieve = torch.full((2, k + 1), -1, dtype=_I64)
        retrieve[0, :3] = torch.tensor([0, 1, 3])
        retrieve[1, :2] = torch.tensor([0, 2])
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        args = [
            torch.zeros(batch, tokens, dtype=_I64), torch.ones(batch, dtype=_I64), torch.zeros(batch, dtype=_I64),
            torch.zeros(batch, k, dtype=_I64), torch.zeros(batch, dtype=_I64),
            mask, torch.tensor([0, 1, 1, 2]), torch.tensor([-1, 0, 0, 1]), torch.tensor([-1, 0, 0, 1]),
            torch.tensor([0, 0, 1, 0]), retrieve,
        ]  # fmt: skip
        if self.sampling:
            args += sampling.example_inputs(batch, self.max_context)
        return (*args, *(torch.zeros(batch, *shape) for shape in kv_shapes))

    def dynamic_shapes(self, args: tuple) -> tuple:
        batch, tokens = dims(self.max_context)
        nodes = torch.export.Dim("tree_nodes", min=1, max=self.max_context)
        leaves = torch.export.Dim("tree_leaves", min=1, max=self.max_context)
        tree = ({0: nodes, 1: nodes}, {0: nodes}, {0: nodes}, {0: nodes}, {0: nodes}, {0: leaves})
        # forward(..., tree_retrieve, *state): sampling inputs and caches all lead with the batch
        return ({0: batch, 1: tokens}, {0: batch}, {0: batch}, {0: batch}, {0: batch}, *tree,
                tuple({0: batch} for _ in args[11:]))  # fmt: skip

    def forward(
        self,
        tokens,
        n_fixed,
        cache_len,
        path_src,
        n_path,
        tree_mask,
        tree_depths,
        tree_parent,  # type: ignore[no-untyped-def]
        tree_head,
        tree_rank,
        tree_retrieve,
        *state,
    ):
        params, kv = (state[:4], state[4:]) if self.sampling else ((), state)
        b, t = tokens.shape
        s = kv[1].shape[-2]
        n_nodes = tree_depths.shape[0]
        committed = cache_len + n_path  # [B] prefix length once last round's path is in place
        node = torch.clamp(torch.arange(t, dtype=_I64), max=n_nodes - 1)  # [T] tree node of each token
        t_val = torch.ones_like(tokens[0]).sum()
        is_tree = (n_fixed == 1) & (t_val == torch.ones_like(tree_depths).sum())  # [B]
        # Block structure: tree ancestors for a tree step, causal for a chain (prefill).
        causal = torch.arange(t)[:, None] >= torch.arange(t)[None, :]  # [T, T]
        tree_block = tree_mask[node][:, node]  # [T, T]
        tree_row = is_tree[:, None, None]
        block = (tree_row & tree_block[None]) | (~tree_row & causal[None])  # [B, T, T] (no bool Where in ORT)
        offsets = torch.where(is_tree[:, None], tree_depths[node][None], torch.arange(t, dtype=_I64)[None])  # [B, T]
        positions = committed[:, None] + offsets  # [B, T]: a node sits at its depth past the prefix
        slots = torch.arange(s, dtype=_I64)
        rel = slots[None, :] - committed[:, None]  # [B, S] slot relative to this call's block
        in_block = (rel >= 0) & (rel < t)
        seen = block.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, s))  # [B, T, S]
        mask = ((rel < 0)[:, None, :] | (in_block[:, None, :] & seen))[:, None]  # [B, 1, T, S]
        masks = [mask]
        if self.sliding_window:
            block_pos = committed[:, None] + offsets.gather(1, rel.clamp(0, t - 1))  # [B, S]
            key_pos = torch.where(in_block, block_pos, slots[None, :])  # the past is compact: slot = position
            recent = (positions[:, :, None] - key_pos[:, None, :]) < self.sliding_window  # [B, T, S]
            masks.append(mask & recent[:, None])
        span = attn_span(committed.max() + t, s)
        logits, *rest = self.target(tokens, positions, *masks, cache_len, span, *kv, path_src, n_path)
        present, hidden = rest[:-1], rest[-1]

        # A chain row (the prefill) keeps its given tokens and no draft: `accepted` has room for a
        # tree branch, not for a chain, so the tokens after n_fixed (a ragged batch's padding) are
        # all rejected here: -1 equals no token the target picks.
        given = torch.where(torch.arange(t, dtype=_I64)[None, :] < n_fixed[:, None], tokens, -torch.ones_like(tokens))
        if self.sampling:
            # Chain rule for the prefill rows (tree rows draw nothing here: first = T).
            u = sampling.position_uniforms(params[3], positions + 1)  # [B, T]
            first = torch.where(is_tree, torch.full_like(n_fixed, t), n_fixed - 1)
            c_acc, c_n, c_bonus, c_committed = accept_chain(
                given, torch.ops.specgraph.sample(logits, first, *params[:3], u), n_fixed
            )
            branch, n_acc, t_bonus = walk_tree(tokens, logits, tree_parent[node], params, committed, self.num_heads)
        else:
            c_acc, c_n, c_bonus, c_committed = accept_chain(given, logits.argmax(dim=-1), n_fixed)
            branch, n_acc, t_bonus = self._greedy_tree(tokens, logits, node, tree_parent, tree_retrieve)
        last = branch.gather(1, n_acc[:, None]).clamp(0, t - 1)  # [B, 1] (clamped: chain rows index garbage)
        width = branch.shape[1]
        branch_tokens = torch.cat([tokens.gather(1, branch[:, 1:].clamp(0, t - 1)), t_bonus], dim=1)  # [B, P+1]
        j = torch.arange(width, dtype=_I64)[None, :]
        t_acc = torch.where(j == n_acc[:, None], t_bonus, branch_tokens)  # accepted nodes then the bonus

        chain_acc = torch.cat([c_bonus, c_bonus.expand(b, width - 1)], dim=1)  # prefill emits the bonus only
        row = is_tree[:, None]
        accepted = torch.where(row, t_acc, chain_acc)
        n_accepted = torch.where(is_tree, n_acc + 1, c_n)
        bonus = torch.where(row, t_bonus, c_bonus)  # [B, 1]
        last_node = torch.where(row, last, c_committed[:, None] - 1)  # [B, 1] where the heads read
        cache_len_out = committed + torch.where(is_tree, torch.ones_like(n_acc), c_committed)
        path_src_out = torch.where(row, committed[:, None] + branch[:, 1:].clamp(min=0), torch.zeros_like(path_src))
        n_path_out = torch.where(is_tree, n_acc, torch.zeros_like(n_acc))

        # Next tree: the drafter reads the hidden state of the last accepted token.
        h = hidden.gather(1, last_node[:, :, None].expand(b, 1, hidden.shape[-1]))[:, 0]  # [B, H]
        nodes = self.propose(h, tree_head, tree_rank)  # [B, N]
        next_tokens = torch.cat([bonus, nodes[:, 1:]], dim=1)  # [B, N]: root = bonus

        outputs = [accepted, n_accepted, next_tokens, cache_len_out, path_src_out, n_path_out, *present]
        if self.emit_logits:
            outputs.append(logits)
        return tuple(outputs)

    def _greedy_tree(self, tokens, logits, node, tree_parent, tree_retrieve):  # type: ignore[no-untyped-def]
        """Greedy tree rule: a node is correct when it equals the target's argmax at its parent;
        the accepted branch is the longest all-correct root-to-leaf prefix (greedy verification of
        a token tree, as in Medusa/SpecInfer), so the output is exactly greedy decoding."""
        t = tokens.shape[1]
        pred = logits.argmax(dim=-1)  # [B, T]
        parent = tree_parent[node].clamp(min=0)  # [T]
        correct = (pred[:, parent] == tokens) | (torch.arange(t)[None, :] == 0)  # [B, T]
        if self.typical is not None:
            correct = correct | _typical(logits, parent, tokens, *self.typical)
        valid = tree_retrieve >= 0  # [L, P+1]
        ok = correct[:, tree_retrieve.clamp(0, t - 1)] & valid[None]  # [B, L, P+1]
        length = leading_run(ok) - 1  # [B, L] accepted nodes
        best = length.argmax(dim=-1)  # [B] first longest branch
        n_acc = length.max(dim=-1).values  # [B]
        branch = tree_retrieve[best]  # [B, P+1] node ids, root first
        last = branch.gather(1, n_acc[:, None]).clamp(0, t - 1)  # [B, 1]
        return branch, n_acc, pred.gather(1, last)


def walk_tree(tokens, logits, parent, params, committed, max_depth: int):  # type: ignore[no-untyped-def]
    """Tree verification by sampling: from the root, draw x ~ p~ at the current node with the
    uniform of the position after it and move to the child whose token is x; stop at the first
    node with no such child and emit x there.

    This is SpecInfer's recursive rejection sampling without replacement for deterministic
    (top-k) candidates: sibling c_i is accepted with probability p~(c_i) / (1 - mass of the
    siblings rejected before it), and on rejecting all of them x follows the residual, p~ without
    the siblings. At temperature 0, x is the argmax and this is greedy tree verification.
    Returns the branch [B, max_depth+1] (node ids, root first, -1 pads), accepted nodes [B] and
    the bonus token [B, 1].
    """
    b, t, v = logits.shape
    cur = torch.zeros(b, 1, dtype=_I64)  # [B, 1] the node reached
    alive = torch.ones(b, 1, dtype=torch.bool)
    bonus = torch.zeros(b, 1, dtype=_I64)
    n_acc = torch.zeros(b, dtype=_I64)
    steps = [cur]
    for depth in range(max_depth + 1):
        row = logits.gather(1, cur[:, :, None].expand(b, 1, v))  # [B, 1, V] the target at this node
        u = sampling.position_uniforms(params[3], committed[:, None] + depth + 1)  # [B, 1]
        children = parent[None, :] == cur  # [B, T]
        x = _node_draw(row, children, tokens, params, u)  # [B, 1]
        match = (children & (tokens == x)).to(_I64)  # [B, T]
        has = (match.amax(dim=-1, keepdim=True) > 0) & alive  # [B, 1]
        bonus = torch.where(alive & ~has, x, bonus)
        cur = torch.where(has, match.argmax(dim=-1, keepdim=True), cur)
        n_acc = n_acc + has[:, 0].to(_I64)
        alive = has
        if depth < max_depth:
            steps.append(torch.where(has, cur, torch.full_like(cur, -1)))
    return torch.cat(steps, dim=1), n_acc, bonus


def _node_draw(row, children, tokens, params, u):  # type: ignore[no-untyped-def]
    """The target's token after one node, x ~ p~ with that position's uniform; the exact rule
    needs neither the children nor the tokens (tests swap in broken rules that do)."""
    return torch.ops.specgraph.sample(row, torch.zeros_like(u[:, 0], dtype=_I64), *params[:3], u)  # [B, 1]


def _typical(logits, parent, tokens, threshold: float, alpha: float, temperature: float):  # type: ignore[no-untyped-def]
    """Medusa's typical acceptance (LOSSY: the output is no longer the target's greedy text):
    a node is also accepted when the target, at its parent, gives it probability above
    min(threshold, alpha * exp(-entropy))."""
    logp = torch.log_softmax(logits[:, parent] / temperature, dim=-1)  # [B, T, V] at each node's parent
    entropy = -(logp.exp() * logp).sum(-1)  # [B, T]
    bar = torch.clamp(alpha * torch.exp(-entropy), max=threshold)
    return logp.gather(2, tokens[:, :, None])[..., 0].exp() > bar  # [B, T]
