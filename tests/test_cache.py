"""The KV cache after compaction: once a branch (not a linear prefix) of a tree is committed, the
next pass sees exactly the committed sequence, on the Python and the fused C++ decoder blocks; and a
generation that runs into the context ends with "length" and loses nothing."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.drafters.ngram import NgramDrafter
from specdraft.generate import GenerateConfig, generate
from specdraft.model import llama
from specdraft.tree import Tree


def _next_logits_after_branch(t, ids, branch_tokens, x):
    """Prefill ``ids``, run a tree whose second branch is ``branch_tokens``, commit that branch
    (nodes 0, 3, 4: a real compaction), then the logits of a one-token pass of ``x``."""
    out = t.prefill(ids, max_slots=len(ids) + 16)
    root = int(out.logits[0, -1].argmax())
    a, b = (branch_tokens[0] + 1) % 1000 + 100, (branch_tokens[1] + 7) % 1000 + 100  # a decoy first branch
    tree = Tree.from_paths(root, [[a, b], list(branch_tokens)])  # 0: root, 1: a, 2: b, 3, 4: the branch
    assert tree.parents == [-1, 0, 1, 0, 3]
    t.forward_tree(tree)
    t.commit([0, 3, 4])
    assert t.length == len(ids) + 3
    return root, t.forward_tree(Tree.single(x)).logits[0, 0].clone()


def _sequential_logits(t, ids, tokens, x):
    """The same sequence committed one token at a time (no compaction), then ``x``."""
    t.prefill(ids, max_slots=len(ids) + 16)
    for tok in tokens:
        t.forward_tree(Tree.single(tok))
        t.commit([0])
    return t.forward_tree(Tree.single(x)).logits[0, 0].clone()


@pytest.mark.parametrize("mode", ["fast", "exact-fused", "exact-python"])
def test_pass_after_a_branch_commit_equals_the_committed_sequence(default_target, exact_target, monkeypatch, mode):
    monkeypatch.setattr(llama, "FUSED_BLOCKS", mode == "exact-fused")
    t = default_target if mode == "fast" else exact_target
    ids = t.encode_prompt("Explain what a hash table is.")
    branch, x = [504, 2988], 288
    root, after_branch = _next_logits_after_branch(t, ids, branch, x)
    sequential = _sequential_logits(t, ids, [root] + branch, x)
    # one-token passes on both sides: the same kernels; the branch's K/V came from a 5-row pass
    assert torch.allclose(after_branch, sequential, rtol=0, atol=1e-3 * float(sequential.abs().max()))
    if mode == "fast":  # rows are computed independently of the pass: bit for bit
        assert torch.equal(after_branch, sequential)
    assert int(after_branch.argmax()) == int(sequential.argmax())
    # and a wrong compaction (the decoy branch's slots kept) is far off: the check can fail
    t.prefill(ids, max_slots=len(ids) + 16)
    tree = Tree.from_paths(root, [[(branch[0] + 1) % 1000 + 100, (branch[1] + 7) % 1000 + 100], branch])
    t.forward_tree(tree)
    t.commit([0, 1, 2])
    wrong = t.forward_tree(Tree.single(x)).logits[0, 0]
    assert not torch.allclose(wrong, sequential, rtol=0, atol=1e-3 * float(sequential.abs().max()))


def test_generation_into_the_context_limit_ends_with_length_and_loses_nothing(tiny_llama):
    _, t, _ = tiny_llama  # a context of 256 tokens
    ctx = t.config.max_position
    rng = random.Random(3)
    motif = [rng.randrange(2, 96) for _ in range(9)]
    prompt = (motif * 40)[: ctx - 12]  # repetitive: prompt lookup drafts deep trees up to the end
    ref = generate(t, prompt, None, GenerateConfig(max_new_tokens=100))
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12  # cut at the context
    for budget in (1, 4, 16):
        got = generate(t, prompt, NgramDrafter(), GenerateConfig(max_new_tokens=100, budget=budget))
        assert got.finish_reason == "length" and got.token_ids == ref.token_ids, budget
        assert got.stats.committed == 11  # the first token came from prefill
