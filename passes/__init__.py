"""Graph rewrites, one per file; each takes `(gm, ctx)` and returns a PassResult."""

from specgraph.passes._infra import PassContext, PassResult, cleanup
from specgraph.passes.add_kv_cache_io import add_kv_cache_io
from specgraph.passes.fuse_projections import fuse_projections
from specgraph.passes.insert_tree_attention import insert_tree_attention

__all__ = ["PassContext", "PassResult", "add_kv_cache_io", "cleanup", "fuse_projections", "insert_tree_attention"]
