"""Medusa candidate trees: their shape, the index arrays a tree-verify step needs, and the choice
of a tree from measured head acceptance and verify cost.

A tree is a list of paths ("medusa_choices"). Each path is a tuple of top-k ranks, one per head
depth: `(0,)` is head 1's top-1 token, `(0, 1)` is head 2's top-2 token placed after head 1's
top-1. The root, never listed, is the bonus token the target produced on the previous step.

Nodes are numbered as Medusa numbers them: node 0 is the root and nodes 1..N are the paths sorted
by depth, then lexicographically. Every array below is indexed by that numbering.
"""

from __future__ import annotations

import heapq
import json
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from specgraph.errors import InputError

TreePath = tuple[int, ...]
_TREES = Path(__file__).resolve().parents[2] / "data" / "trees"


@dataclass(frozen=True)
class Tree:
    """A prefix-closed tree of top-k paths; `Tree(paths)` validates and sorts them.

    Arrays (read-only numpy; int64 unless noted; S = size = N + 1 nodes, root included):
    - `parent [S]`: parent node of each node; the root's is -1.
    - `depths [S]`: path length; the root's is 0.
    - `head [S]`: which Medusa head proposed the node's token (depth - 1, 0-based); the root's is -1.
    - `rank [S]`: the token's top-k rank in that head's output; the root's is 0.
    - `ancestor_mask [S, S]` bool: node i may attend to node j iff j is i or an ancestor of i.
    - `retrieve [L, depth + 1]`: one row per leaf (leaves in node order), the node indices from the
      root (column 0) down to the leaf, padded on the right with -1. A root-only tree has one row [0].
    - `topk [depth]`: how many candidates head d (0-based) must supply: 1 + the largest rank used at
      depth d + 1. `max_topk` is its maximum (0 for a root-only tree).
    - `topk_index [S]`: where each node's token sits in the head-major flattened `[depth, max_topk]`
      array of candidate tokens: `head * max_topk + rank`; the root's is -1.
    """

    paths: tuple[TreePath, ...]
    parent: np.ndarray = field(init=False, repr=False, compare=False)
    depths: np.ndarray = field(init=False, repr=False, compare=False)
    head: np.ndarray = field(init=False, repr=False, compare=False)
    rank: np.ndarray = field(init=False, repr=False, compare=False)
    ancestor_mask: np.ndarray = field(init=False, repr=False, compare=False)
    retrieve: np.ndarray = field(init=False, repr=False, compare=False)
    topk: np.ndarray = field(init=False, repr=False, compare=False)
    topk_index: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        paths = tuple(sorted(_checked_paths(self.paths), key=lambda p: (len(p), p)))  # Medusa's order
        _check_prefix_closed(paths)
        object.__setattr__(self, "paths", paths)
        for name, array in _arrays(paths).items():
            array.setflags(write=False)
            object.__setattr__(self, name, array)

    @classmethod
    def from_paths(cls, paths: Iterable[Iterable[int]]) -> Tree:
        """A tree from any iterable of paths (lists or tuples), validated and sorted."""
        return cls(cast(tuple[TreePath, ...], tuple(paths)))  # __post_init__ checks and converts each path

    @property
    def size(self) -> int:
        """Nodes verified in one target pass, the root included."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        """The longest path, which is also the number of heads the tree needs."""
        return max((len(p) for p in self.paths), default=0)

    @property
    def max_topk(self) -> int:
        return int(self.topk.max()) if self.topk.size else 0

    def validate_for(self, num_heads: int, max_context: int) -> None:
        """Raise InputError if a model with `num_heads` heads and `max_context` positions cannot
        verify this tree in one step."""
        if self.depth > num_heads:
            raise InputError(f"tree needs {self.depth} heads but the model has {num_heads}")
        if self.size > max_context:
            raise InputError(f"tree of {self.size} nodes does not fit a context of {max_context}")


def _checked_paths(paths: Any) -> list[TreePath]:
    """The paths as tuples of ints; InputError on a malformed, negative, empty or repeated path."""
    if isinstance(paths, str | bytes) or not isinstance(paths, Iterable):
        raise InputError(f"tree paths must be a list of lists of ints, not {type(paths).__name__}")
    out: list[TreePath] = []
    seen: set[TreePath] = set()
    for raw in paths:
        if isinstance(raw, str | bytes) or not isinstance(raw, Iterable):
            raise InputError(f"tree path {reprlib.repr(raw)} is not a list of ints")
        path = tuple(raw)
        if not all(isinstance(r, int | np.integer) and not isinstance(r, bool) for r in path):
            raise InputError(f"tree path {reprlib.repr(raw)} is not a list of ints")
        path = tuple(int(r) for r in path)
        if not path:
            raise InputError("tree path () is empty: the root is implicit and must not be listed")
        if min(path) < 0:
            raise InputError(f"tree path {path} has a negative rank")
        if path in seen:
            raise InputError(f"tree lists path {path} twice")
        seen.add(path)
        out.append(path)
    return out


def _check_prefix_closed(paths: tuple[TreePath, ...]) -> None:
    # Checking each path's parent suffices: by induction every shorter prefix is then present too.
    present = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in present:
            raise InputError(f"tree is not prefix-closed: path {path} lacks its prefix {path[:-1]}")


def _arrays(paths: tuple[TreePath, ...]) -> dict[str, np.ndarray]:
    """The index arrays of a validated, sorted path list (see `Tree`)."""
    size = len(paths) + 1
    depth = max((len(p) for p in paths), default=0)
    index = {p: i + 1 for i, p in enumerate(paths)}
    parent = np.array([-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in paths], dtype=np.int64)  # [S]
    depths = np.array([0] + [len(p) for p in paths], dtype=np.int64)  # [S]
    rank = np.array([0] + [p[-1] for p in paths], dtype=np.int64)  # [S]
    topk = np.zeros(depth, dtype=np.int64)  # [depth]
    for p in paths:
        topk[len(p) - 1] = max(topk[len(p) - 1], p[-1] + 1)
    max_topk = int(topk.max()) if depth else 0
    topk_index = np.where(depths > 0, (depths - 1) * max_topk + rank, -1)  # [S]

    ancestor_mask = np.eye(size, dtype=bool)  # [S, S]
    for i in range(1, size):  # parents precede children in Medusa's order, so their rows are done
        ancestor_mask[i] |= ancestor_mask[parent[i]]

    is_parent = np.zeros(size, dtype=bool)
    is_parent[parent[1:]] = True
    leaves = np.flatnonzero(~is_parent)
    retrieve = np.full((len(leaves), depth + 1), -1, dtype=np.int64)  # [L, depth + 1]
    for row, leaf in enumerate(leaves):
        chain = np.flatnonzero(ancestor_mask[leaf])  # ancestors have smaller indices and depths
        retrieve[row, : len(chain)] = chain
    return {
        "parent": parent,
        "depths": depths,
        "head": depths - 1,
        "rank": rank,
        "ancestor_mask": ancestor_mask,
        "retrieve": retrieve,
        "topk": topk,
        "topk_index": topk_index,
    }


# --- files and presets -----------------------------------------------------------------------------


def load_tree(path: str | Path) -> Tree:
    """A tree from a JSON file: a list of paths (`[[0], [0, 0], [1]]`) or `{"paths": [...]}`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"no such tree file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read tree file {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"tree file {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise InputError(f"tree file {path} is nested too deeply to be a tree (a list of lists of ints)") from None
    if isinstance(data, dict):
        if "paths" not in data:
            raise InputError(f"tree file {path} is an object without a 'paths' key")
        data = data["paths"]
    if not isinstance(data, list):
        raise InputError(f"tree file {path} must hold a list of paths, not {type(data).__name__}")
    try:
        return Tree.from_paths(data)
    except InputError as e:
        raise InputError(f"tree file {path}: {e}") from None
    except RecursionError:  # a path nested just shallow enough to parse
        raise InputError(f"tree file {path} is nested too deeply to be a tree (a list of lists of ints)") from None


# A small tree for CPU engines, where verify cost climbs early: 12 paths (13 nodes), depth 4,
# top-3 at head 1 and top-2 below; sibling-closed (rank r only with ranks < r).
DEFAULT_TREE = Tree.from_paths(
    [
        (0,), (1,), (2,),
        (0, 0), (0, 1), (1, 0),
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
        (0, 0, 0, 0), (0, 0, 0, 1),
    ]
)  # fmt: skip

_BUILT_IN = {"chain-4": Tree.from_paths([(0,) * d for d in range(1, 5)]), "default": DEFAULT_TREE}


def tree_names() -> list[str]:
    """Names `named_tree` accepts: the built-in trees and the JSON files shipped in data/trees."""
    return sorted(set(_BUILT_IN) | {p.stem for p in _TREES.glob("*.json")})


def named_tree(name: str) -> Tree:
    """A preset: "chain-4" (four top-1 tokens in a row), "default", or "mc_sim_7b_63" (Medusa's
    63-path tree for Vicuna-7B, from Medusa's medusa_choices.py) and any other data/trees file."""
    if name in _BUILT_IN:
        return _BUILT_IN[name]
    file = _TREES / f"{name}.json"
    if name.startswith(".") or "/" in name or "\\" in name or not file.is_file():
        raise InputError(f"unknown tree {name!r}; choose one of: {', '.join(tree_names())}")
    return load_tree(file)


# --- a tree from measurement -----------------------------------------------------------------------


def build_tree(
    acceptance: np.ndarray, verify_cost: dict[int, float], max_nodes: int = 64, max_depth: int | None = None
) -> tuple[Tree, dict[str, Any]]:
    """The tree that maximises expected tokens per unit time, E[tokens](T) / c(|T|).

    `acceptance[d, r]`: measured probability that head d+1's rank-r candidate is the target's token
    at that depth, given the path above it was accepted. `verify_cost[n]`: c(n)/c(1), the time to
    verify n tokens (root included) relative to one; linear between measured n and beyond them.
    `max_nodes` bounds the size, root included. Returns the tree and a report: "size",
    "expected_tokens" (per step), "cost", "speedup" (= expected_tokens / cost, against plain
    decoding) and "table", one row per size 1..max_nodes with the node added at that size.
    """
    acc = _checked_acceptance(acceptance)
    if max_nodes < 1:
        raise InputError(f"max_nodes must be at least 1, not {max_nodes}")
    if max_depth is not None and max_depth < 0:
        raise InputError(f"max_depth must be 0 or more, not {max_depth}")
    depth_limit = acc.shape[0] if max_depth is None else min(max_depth, acc.shape[0])
    cost = _cost_curve(verify_cost)

    # Independence approximation (as in Medusa's tree search and Sequoia): P(node accepted) is the
    # product of acceptance[depth - 1, rank] along its path. Exactly one root-to-node path is
    # accepted, so by linearity of expectation E[accepted tokens] = 1 (the bonus) + sum over
    # non-root nodes of P(node accepted): siblings are exclusive candidates for the same token.
    # Greedy by path probability is optimal for every size: P(child) <= P(parent), so the n most
    # probable nodes (ties to the shallower, then lower rank, via the heap order) form a
    # prefix-closed tree with the largest sum. Sibling order (rank r after r-1) also holds when
    # each acceptance row is non-increasing in r; it is not needed for a valid tree.
    frontier: list[tuple[float, int, TreePath]] = []
    if depth_limit > 0:
        frontier = [(-acc[0, r], 1, (r,)) for r in range(acc.shape[1])]
        heapq.heapify(frontier)
    chosen: list[TreePath] = []
    expected = 1.0
    table = [_row(1, expected, cost(1), None)]
    while frontier and len(chosen) + 1 < max_nodes:
        neg_p, depth, path = heapq.heappop(frontier)
        chosen.append(path)
        expected += -neg_p
        table.append(_row(len(chosen) + 1, expected, cost(len(chosen) + 1), path))
        if depth < depth_limit:
            for r in range(acc.shape[1]):
                heapq.heappush(frontier, (neg_p * acc[depth, r], depth + 1, path + (r,)))

    best = max(table, key=lambda row: (row["speedup"], -row["size"]))  # ties go to the smaller tree
    tree = Tree.from_paths(chosen[: best["size"] - 1])
    report = {k: best[k] for k in ("size", "expected_tokens", "cost", "speedup")} | {"table": table}
    return tree, report


def _row(size: int, expected: float, cost: float, added: TreePath | None) -> dict[str, Any]:
    if cost <= 0:
        raise InputError(f"verify cost extrapolates to {cost:.3g} at n={size}; it must stay positive")
    return {"size": size, "added": added, "expected_tokens": expected, "cost": cost, "speedup": expected / cost}


def _checked_acceptance(acceptance: Any) -> np.ndarray:
    acc = np.asarray(acceptance, dtype=np.float64)
    if acc.ndim != 2 or acc.shape[0] == 0 or acc.shape[1] == 0:
        raise InputError(f"acceptance must be a non-empty [depth, rank] array, not shape {acc.shape}")
    if not np.all(np.isfinite(acc)) or acc.min() < 0 or acc.max() > 1:
        raise InputError("acceptance must hold probabilities in [0, 1]")
    return acc


def _cost_curve(verify_cost: dict[Any, float]) -> Callable[[int], float]:
    """c(n) by linear interpolation between the measured points and linear extrapolation past
    both ends (np.interp alone would clamp); a single point means a flat cost."""
    try:
        points = sorted((int(n), float(c)) for n, c in verify_cost.items())
    except (TypeError, ValueError, AttributeError):
        raise InputError("verify_cost must map token counts to cost ratios, e.g. {1: 1.0, 8: 1.3}") from None
    if not points:
        raise InputError("verify_cost is empty: measure c(n) for at least one n")
    ns = np.array([n for n, _ in points], dtype=np.float64)
    cs = np.array([c for _, c in points], dtype=np.float64)
    if len(set(ns.tolist())) != len(ns):
        raise InputError("verify_cost gives two costs for the same n")

    def cost(n: int) -> float:
        if len(ns) == 1:
            return float(cs[0])
        lo = 0 if n < ns[0] else len(ns) - 2 if n > ns[-1] else None
        if lo is None:
            return float(np.interp(n, ns, cs))
        slope = (cs[lo + 1] - cs[lo]) / (ns[lo + 1] - ns[lo])
        return float(cs[lo] + slope * (n - ns[lo]))

    return cost
