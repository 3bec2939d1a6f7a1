"""Medusa trees: index arrays checked by hand, validation errors, presets, files, and the choice
of a tree from acceptance and verify cost (small cases worked out by hand in the comments)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from specgraph.errors import InputError
from specgraph.methods.medusa.tree import DEFAULT_TREE, Tree, _cost_curve, build_tree, load_tree, named_tree, tree_names

# The realistic cost curve of the brief: c(n)/c(1) measured at powers of two.
REALISTIC = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 1.8, 32: 2.6, 64: 4.6}


def test_four_node_tree_arrays_by_hand():
    #        0 (root)
    #       / \
    #  1 (0,)  2 (1,)      sorted by depth then lexicographically: (0,), (1,), (0, 0)
    #     |
    #  3 (0, 0)
    tree = Tree.from_paths([(0,), (1,), (0, 0)])
    assert tree.paths == ((0,), (1,), (0, 0))
    assert tree.size == 4 and tree.depth == 2
    np.testing.assert_array_equal(tree.parent, [-1, 0, 0, 1])
    np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2])
    np.testing.assert_array_equal(tree.head, [-1, 0, 0, 1])
    np.testing.assert_array_equal(tree.rank, [0, 0, 1, 0])
    np.testing.assert_array_equal(
        tree.ancestor_mask,
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 1, 0, 1],
        ],
    )
    assert tree.ancestor_mask.dtype == bool
    # Leaves 2 and 3, in node order; rows run root to leaf, padded with -1.
    np.testing.assert_array_equal(tree.retrieve, [[0, 2, -1], [0, 1, 3]])
    # Head 1 supplies its top-2, head 2 its top-1; candidates are a [2, 2] array, head-major.
    np.testing.assert_array_equal(tree.topk, [2, 1])
    assert tree.max_topk == 2
    np.testing.assert_array_equal(tree.topk_index, [-1, 0, 1, 2])
    for name in ("parent", "depths", "head", "rank", "retrieve", "topk", "topk_index"):
        assert getattr(tree, name).dtype == np.int64, name


def test_root_only_tree():
    tree = Tree.from_paths([])
    assert tree.size == 1 and tree.depth == 0 and tree.max_topk == 0
    np.testing.assert_array_equal(tree.parent, [-1])
    np.testing.assert_array_equal(tree.ancestor_mask, [[True]])
    np.testing.assert_array_equal(tree.retrieve, [[0]])
    np.testing.assert_array_equal(tree.topk_index, [-1])
    assert tree.topk.shape == (0,)


def test_tree_is_frozen_sorted_and_compares_by_paths():
    a = Tree.from_paths([[1], [0, 0], [0]])
    b = Tree(((0,), (1,), (0, 0)))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.paths = ()  # type: ignore[misc]
    with pytest.raises(ValueError):
        a.parent[0] = 5


@pytest.mark.parametrize(
    "paths, message",
    [
        ([(0,), (0, 1, 2)], "tree is not prefix-closed: path (0, 1, 2) lacks its prefix (0, 1)"),
        ([(0, 0)], "tree is not prefix-closed: path (0, 0) lacks its prefix (0,)"),
        ([(0,), (0,)], "tree lists path (0,) twice"),
        ([(0,), (0, -1)], "tree path (0, -1) has a negative rank"),
        ([()], "tree path () is empty"),
        ([(0,), ("a",)], "is not a list of ints"),
        ([(True,)], "is not a list of ints"),
        ([5], "is not a list of ints"),
    ],
)
def test_bad_paths_are_refused(paths, message):
    with pytest.raises(InputError) as err:
        Tree.from_paths(paths)
    assert message in str(err.value)


def test_validate_for_heads_and_context():
    tree = Tree.from_paths([(0,) * d for d in range(1, 6)])  # a chain of 5: 6 nodes
    tree.validate_for(num_heads=5, max_context=6)
    with pytest.raises(InputError, match=r"^tree needs 5 heads but the model has 4$"):
        tree.validate_for(num_heads=4, max_context=100)
    big = named_tree("mc_sim_7b_63")
    with pytest.raises(InputError, match=r"^tree of 64 nodes does not fit a context of 48$"):
        big.validate_for(num_heads=5, max_context=48)


def test_load_tree_both_formats(tmp_path):
    paths = [[0], [1], [0, 0]]
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(paths))
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"paths": paths, "note": "any other keys are ignored"}))
    assert load_tree(plain) == load_tree(str(wrapped)) == Tree.from_paths(paths)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[0], [1]", "is not valid JSON"),
        ('{"choices": [[0]]}', "without a 'paths' key"),
        ("7", "must hold a list of paths, not int"),
        ('[[0], "01"]', "is not a list of ints"),
        ("[[0, 0]]", "lacks its prefix (0,)"),
    ],
)
def test_load_tree_errors(tmp_path, text, message):
    file = tmp_path / "tree.json"
    file.write_text(text)
    with pytest.raises(InputError) as err:
        load_tree(file)
    assert message in str(err.value) and "tree.json" in str(err.value)
    with pytest.raises(InputError, match="no such tree file"):
        load_tree(tmp_path / "missing.json")


def test_presets():
    assert {"chain-4", "default", "mc_sim_7b_63"} <= set(tree_names())
    chain = named_tree("chain-4")
    assert chain.paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    np.testing.assert_array_equal(chain.retrieve, [[0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(chain.topk_index, [-1, 0, 1, 2, 3])  # max_topk 1: index = head
    assert named_tree("default") is DEFAULT_TREE
    assert 10 <= DEFAULT_TREE.size <= 16 and DEFAULT_TREE.depth <= 4
    with pytest.raises(InputError, match="unknown tree 'nope'; choose one of: chain-4, default, mc_sim_7b_63"):
        named_tree("nope")
    with pytest.raises(InputError, match="unknown tree"):
        named_tree("../trees/mc_sim_7b_63")


def test_mc_sim_7b_63():
    tree = named_tree("mc_sim_7b_63")
    assert len(tree.paths) == 63 and tree.size == 64 and tree.depth == 4
    np.testing.assert_array_equal(tree.topk, [10, 10, 10, 2])
    assert tree.retrieve.shape == (42, 5)  # Medusa's retrieve_indices for this tree: 42 leaves
    present = set(tree.paths)
    for path in tree.paths:  # prefix-closed, and sibling-closed: rank r only after rank r - 1
        assert len(path) == 1 or path[:-1] in present
        assert path[-1] == 0 or path[:-1] + (path[-1] - 1,) in present


@pytest.mark.parametrize("name", ["chain-4", "default", "mc_sim_7b_63"])
def test_arrays_agree_with_each_other(name):
    tree = named_tree(name)
    index = {path: i + 1 for i, path in enumerate(tree.paths)}
    for path, i in index.items():
        assert tree.depths[i] == len(path) and tree.rank[i] == path[-1]
        assert tree.parent[i] == index.get(path[:-1], 0)
        assert tree.topk_index[i] == (len(path) - 1) * tree.max_topk + path[-1]
        ancestors = {0} | {index[path[:k]] for k in range(1, len(path) + 1)}
        assert set(np.flatnonzero(tree.ancestor_mask[i]).tolist()) == ancestors
    leaves = set(range(tree.size)) - set(tree.parent[1:].tolist())
    ends = []
    for row in tree.retrieve:
        nodes = row[row >= 0]
        assert (row[len(nodes) :] == -1).all()  # padding only on the right
        assert nodes[0] == 0 and all(tree.parent[b] == a for a, b in zip(nodes[:-1], nodes[1:], strict=True))
        ends.append(int(nodes[-1]))
    assert ends == sorted(leaves)  # one row per leaf, in node order


# --- build_tree ------------------------------------------------------------------------------------


def test_flat_cost_grows_to_max_nodes():
    # Path probabilities: (0,) .8, (0, 0) .4, (1,) .3, (0, 1) .2, (0, 0, 0) .16, (1, 0) .15,
    # (0, 1, 0) .08, (1, 1) .075, ...: with c(n) = 1 every node pays, so the 7 most probable go in.
    acceptance = np.array([[0.8, 0.3], [0.5, 0.25], [0.4, 0.1]])
    for flat in ({1: 1.0}, {1: 1.0, 64: 1.0}):
        tree, report = build_tree(acceptance, flat, max_nodes=8)
        assert tree.size == 8 and report["size"] == 8
        assert [row["size"] for row in report["table"]] == list(range(1, 9))
        assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))
        assert report["expected_tokens"] == pytest.approx(1 + 0.8 + 0.4 + 0.3 + 0.2 + 0.16 + 0.15 + 0.08)
    # All 2 + 4 + 8 = 14 candidates fit under the default max_nodes=64: the table stops at 15.
    tree, report = build_tree(acceptance, {1: 1.0})
    assert tree.size == 15 and len(report["table"]) == 15


def test_steep_cost_keeps_the_root_only():
    # c(n) = n (two points, extrapolated). size 1: 1/1 = 1; size 2: (1 + 0.8)/2 = 0.9 -> size 1.
    acceptance = np.array([[0.8, 0.1], [0.5, 0.05]])
    tree, report = build_tree(acceptance, {1: 1.0, 2: 2.0})
    assert tree.paths == () and tree.size == 1
    assert report["size"] == 1 and report["speedup"] == pytest.approx(1.0)
    assert report["table"][1]["speedup"] == pytest.approx(0.9)
    assert report["table"][-1]["cost"] == pytest.approx(7.0)  # all 6 candidates + root


def test_realistic_cost_by_hand():
    # Node probabilities: (0,) .8, (0,0) .48, (1,) .1, (1,0) .06, (0,1) .04, (1,1) .005.
    # size  E      c(n) (interpolated)   E / c
    #  1    1      1.0                   1.0
    #  2    1.8    1.05                  1.714
    #  3    2.28   1.075                 2.121
    #  4    2.38   1.1                   2.164   <- best
    #  5    2.44   1.15                  2.122
    #  6    2.48   1.2                   2.067
    #  7    2.485  1.25                  1.988
    acceptance = np.array([[0.8, 0.1], [0.6, 0.05]])
    tree, report = build_tree(acceptance, REALISTIC)
    assert tree == Tree.from_paths([(0,), (1,), (0, 0)])
    assert report["size"] == 4
    assert report["expected_tokens"] == pytest.approx(2.38)
    assert report["cost"] == pytest.approx(1.1)
    assert report["speedup"] == pytest.approx(2.38 / 1.1)
    table = report["table"]
    assert [row["added"] for row in table] == [None, (0,), (0, 0), (1,), (1, 0), (0, 1), (1, 1)]
    assert [row["expected_tokens"] for row in table] == pytest.approx([1, 1.8, 2.28, 2.38, 2.44, 2.48, 2.485])
    assert [row["cost"] for row in table] == pytest.approx([1, 1.05, 1.075, 1.1, 1.15, 1.2, 1.25])


def test_max_depth_limits_the_tree():
    # Depth 1 only: size 2 -> 1.8 / 1.05 = 1.714, size 3 -> 1.9 / 1.075 = 1.767 -> (0,), (1,).
    acceptance = np.array([[0.8, 0.1], [0.6, 0.05]])
    tree, report = build_tree(acceptance, REALISTIC, max_depth=1)
    assert tree.paths == ((0,), (1,)) and report["speedup"] == pytest.approx(1.9 / 1.075)
    tree, _ = build_tree(acceptance, REALISTIC, max_depth=0)
    assert tree.size == 1


def test_cost_curve_interpolates_and_extrapolates():
    cost = _cost_curve(REALISTIC)
    assert cost(1) == pytest.approx(1.0)
    assert cost(12) == pytest.approx(1.55)  # halfway from 8 (1.3) to 16 (1.8)
    assert cost(128) == pytest.approx(4.6 + 64 * (2.0 / 32))  # the 32..64 slope continued
    assert _cost_curve({"1": 1.0, "8": 2.4})(4) == pytest.approx(1.6)  # keys from a JSON report


@pytest.mark.parametrize(
    "acceptance, cost, message",
    [
        (np.array([0.8, 0.1]), {1: 1.0}, "acceptance must be a non-empty [depth, rank] array"),
        (np.array([[1.2]]), {1: 1.0}, "acceptance must hold probabilities in [0, 1]"),
        (np.array([[np.nan]]), {1: 1.0}, "acceptance must hold probabilities in [0, 1]"),
        (np.array([[0.5]]), {}, "verify_cost is empty"),
        (np.array([[0.5]]), {"x": 1.0}, "verify_cost must map token counts"),
        (np.array([[0.5, 0.5]]), {2: 1.0, 3: 2.0}, "verify cost extrapolates to 0 at n=1"),
    ],
)
def test_build_tree_errors(acceptance, cost, message):
    with pytest.raises(InputError) as err:
        build_tree(acceptance, cost)
    assert message in str(err.value)
