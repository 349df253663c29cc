"""Trees, masks, compaction and verification against hand-written cases."""

from __future__ import annotations

import pytest
import torch

from specdraft.model.config import ModelConfig
from specdraft.model.llama import KVCache
from specdraft.tree import Tree
from specdraft.verify import argmax_rows, verify_greedy


def test_trie_merge_and_depths():
    t = Tree.from_paths(5, [[1, 2, 3], [1, 4], [6]])
    assert t.tokens == [5, 1, 2, 3, 4, 6]
    assert t.parents == [-1, 0, 1, 2, 1, 0]
    assert t.depths == [0, 1, 2, 3, 2, 1]
    assert t.path_to(3) == [0, 1, 2, 3]
    assert t.leaves() == [3, 4, 5]


def test_budget_cuts_paths():
    t = Tree.from_paths(5, [[1, 2, 3], [1, 4], [6]], budget=4)
    assert t.tokens == [5, 1, 2, 3, 4]  # [6] no longer fits; shared prefix "1" costs nothing
    assert len(Tree.from_paths(5, [[1, 2, 3]], budget=0)) == 1


def test_ancestor_mask_hand_written():
    t = Tree.from_paths(5, [[1, 2], [3]])  # 0 -> 1 -> 2, 0 -> 3
    expected = torch.tensor([
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(t.ancestor_mask(), expected)


def test_invalid_trees_raise():
    with pytest.raises(ValueError):
        Tree(tokens=[1, 2], parents=[-1, 1])  # parent after child
    with pytest.raises(ValueError):
        Tree(tokens=[1, 2, 2], parents=[-1, 0, 0])  # duplicate sibling token
    with pytest.raises(ValueError):
        Tree(tokens=[1], parents=[0])


def test_greedy_verification_walk():
    t = Tree.from_paths(5, [[1, 2, 3], [1, 4], [6]])  # nodes: 0:5 1:1 2:2 3:3 4:4 5:6
    v = 8
    logits = torch.zeros(len(t), v)
    # target argmax: root -> 1, node1 -> 4, node4 -> 7 (not drafted)
    logits[0, 1] = logits[1, 4] = logits[4, 7] = 1.0
    acc = verify_greedy(t, logits)
    assert acc.path == [0, 1, 4] and acc.tokens == [1, 4] and acc.bonus == 7
    logits2 = torch.zeros(len(t), v)
    logits2[0, 7] = 1.0
    acc2 = verify_greedy(t, logits2)
    assert acc2.path == [0] and acc2.tokens == [] and acc2.bonus == 7


def test_compaction_hand_written():
    cfg = ModelConfig(arch="llama", vocab_size=4, hidden_size=4, intermediate_size=4, num_layers=2, num_heads=1,
                      num_kv_heads=1, head_dim=2)
    cache = KVCache(cfg, batch=1, max_slots=10, device="cpu", dtype=torch.float32)
    slots = torch.arange(10, dtype=torch.float32)
    cache.kv[:] = slots[:, None]  # entry value = its slot number
    # committed prefix = 3 slots; tree nodes at slots 3..8; accepted path = nodes [0, 2, 5]
    cache.compact(torch.tensor([0, 2, 5]) + 3, 3)
    got = cache.kv[0, 0, 0, 0, :, 0].tolist()
    assert got[:6] == [0, 1, 2, 3, 5, 8]
    assert torch.equal(cache.kv[1, 1, 0, 0, :6, 1], torch.tensor([0.0, 1, 2, 3, 5, 8]))


def test_commit_linear_path_is_noop_and_branch_compacts(tiny_llama, monkeypatch):
    _, target, _ = tiny_llama
    target.prefill([1, 2, 3], max_slots=16)
    t = Tree.from_paths(4, [[5, 6], [7, 8]])  # 0:4 1:5 2:6 3:7 4:8
    target.forward_tree(t)
    expected = target.cache.kv[:, :, :, :, [3, 6, 7]].clone()  # nodes 0, 3, 4
    target.commit([0, 3, 4])
    assert target.length == 6
    assert torch.equal(target.cache.kv[:, :, :, :, 3:6], expected)
    # a linear path (nodes 0, 1, 2, at slots 3..5 already) is left in place: no compaction at all
    target.prefill([1, 2, 3], max_slots=16)
    target.forward_tree(t)
    before = target.cache.kv.clone()
    calls = []
    real = target.cache.compact
    monkeypatch.setattr(target.cache, "compact", lambda *a: calls.append(a) or real(*a))
    target.commit([0, 1, 2])
    assert target.length == 6 and calls == []
    assert torch.equal(target.cache.kv, before)


def test_argmax_rows_matches_torch_including_ties():
    """The numpy argmax the greedy walk uses picks what torch.argmax picks: the first maximum."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 49152, generator=g)
    logits[2, 100] = logits[2, 40000] = logits[2].max() + 1  # a tie: the first index wins
    logits[3] = 0.0  # all equal
    logits[4, 17] = float("inf")
    assert argmax_rows(logits) == logits.argmax(-1).tolist()
    assert argmax_rows(logits)[2] == 100 and argmax_rows(logits)[3] == 0
    assert argmax_rows(logits[:, ::2]) == logits[:, ::2].argmax(-1).tolist()  # non-contiguous
    assert argmax_rows(logits.double()) == logits.argmax(-1).tolist()  # other dtypes: torch's


def test_probs_are_capped_by_the_parent_and_kept_by_a_cut():
    t = Tree.from_paths(9, [[1, 2, 3], [1, 4], [5]])  # nodes: 1, 2, 3, 4 (under 1), 5 (under the root)
    s = t.with_probs([0.0, 0.6, 0.9, 0.2, 0.3, 1.5])
    assert s.probs == [1.0, 0.6, 0.6, 0.2, 0.3, 1.0]  # a child never above its parent; clamped to [0, 1]
    assert t.walk([1, 4, 7]) == [1, 4] and t.walk([8]) == []
    sub = s.keep([1, 4, 5])
    assert sub.tokens == [9, 1, 4, 5] and sub.parents == [-1, 0, 1, 0] and sub.probs == [1.0, 0.6, 0.3, 1.0]
    assert t.keep([]).tokens == [9]
    with pytest.raises(ValueError):
        t.keep([2])  # node 2 without its parent 1
    with pytest.raises(ValueError):
        Tree(tokens=[1, 2], parents=[-1, 0], probs=[1.0])
