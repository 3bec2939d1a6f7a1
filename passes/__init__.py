"""Graph rewrites, one per file; each takes `(gm, ctx)` and returns a PassResult."""

from specgraph.passes._infra import PassContext, PassResult, cleanup
from specgraph.passes.add_feature_output import add_feature_output
from specgraph.passes.add_kv_cache_io import add_kv_cache_io
from specgraph.passes.add_kv_compaction import add_kv_compaction
from specgraph.passes.add_medusa_heads import add_medusa_heads
from specgraph.passes.fuse_projections import fuse_projections
from specgraph.passes.fuse_rms_norm import fuse_rms_norm
from specgraph.passes.insert_tree_attention import insert_tree_attention

__all__ = [
    "PassContext",
    "PassResult",
    "add_feature_output",
    "add_kv_cache_io",
    "add_kv_compaction",
    "add_medusa_heads",
    "cleanup",
    "fuse_projections",
    "fuse_rms_norm",
    "insert_tree_attention",
]
