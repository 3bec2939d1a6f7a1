"""Move last round's accepted tree path into contiguous cache slots, inside this round's write.

Requires: `add_kv_cache_io` has run (each cache is written once, by `specgraph::kv_write` at
`cache_len`).
Ensures: inputs `path_src [B, P]` (cache slots of the nodes accepted last round, in path order)
and `n_path [B]` (how many of them are real). Every cache write now writes, at `cache_len`, the
`n_path` accepted nodes' keys/values gathered from their tree slots followed by this call's new
ones, so after the write the committed prefix is contiguous and this call's tokens sit at
`cache_len + n_path`. The gather reads the cache before the write (it feeds it), so the write
stays a single in-place TensorScatter; slots past the real entries hold garbage that the
attention mask never shows.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

import specgraph.ops  # noqa: F401  (registers specgraph::kv_write)
from specgraph.ops import compact_update
from specgraph.passes._infra import PassContext, PassResult, add_placeholder, cleanup

logger = logging.getLogger("specgraph.passes")
_kv_write = torch.ops.specgraph.kv_write.default


def add_kv_compaction(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    path_src = add_placeholder(gm, "path_src")
    n_path = add_placeholder(gm, "n_path")
    count = 0
    for node in list(gm.graph.nodes):
        if node.target != _kv_write or node.args[0].op != "placeholder":
            continue
        past, update, write_pos, axis = node.args
        with gm.graph.inserting_before(node):
            merged = gm.graph.call_function(compact_update, (past, update, path_src, n_path, axis))
        node.args = (past, merged, write_pos, axis)
        count += 1
    cleanup(gm)
    logger.debug("kv compaction: %d cache writes now move the accepted path first", count)
    return PassResult(gm, count > 0, {"compacting_writes": count, "inputs_added": 2})
