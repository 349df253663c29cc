"""Speculative greedy output equals plain greedy token for token: random trees (hypothesis) on a
tiny model, and the ngram drafter on real prompts with the real default target."""

from __future__ import annotations

import random

import torch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdraft.drafters.ngram import NgramDrafter
from specdraft.generate import GenerateConfig, generate
from specdraft.tree import Tree


class RandomTreeDrafter:
    """Random trees that hide the true continuation (when known) at a random branch, so passes
    accept paths of every length through non-linear node orders."""

    name = "random"
    hidden_layers = ()

    def __init__(self, seed: int, vocab: int, truth: list[int] | None, width: int, depth: int, budget: int):
        self.rng = random.Random(seed)
        self.vocab, self.truth, self.width, self.depth = vocab, truth, width, depth
        self.default_budget = budget

    def reset(self, prompt_ids, first_token, prefill):
        self.done = [first_token]

    def commit(self, accepted, out):
        self.done.extend(accepted.new_tokens)

    def propose(self, budget):
        paths = [[self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, self.depth))]
                 for _ in range(self.width)]
        if self.truth is not None:
            k = len(self.done)
            true_path = self.truth[k : k + self.rng.randint(0, self.depth)]
            if self.rng.random() < 0.3 and true_path:  # corrupt the truth after a random prefix
                cut = self.rng.randrange(len(true_path))
                true_path = true_path[:cut] + [(true_path[cut] + 1) % self.vocab]
            paths.insert(self.rng.randrange(len(paths) + 1), true_path)
        return Tree.from_paths(self.done[-1], paths, budget=budget)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), width=st.integers(1, 6), depth=st.integers(1, 6), budget=st.integers(0, 24),
       plen=st.integers(1, 12))
def test_random_trees_equal_plain_greedy(tiny_llama, seed, width, depth, budget, plen):
    _, target, _ = tiny_llama
    vocab = target.config.vocab_size
    rng = random.Random(seed)
    prompt = [rng.randrange(2, vocab) for _ in range(plen)]
    cfg = GenerateConfig(max_new_tokens=24)
    ref = generate(target, prompt, None, cfg)
    drafter = RandomTreeDrafter(seed, vocab, ref.token_ids, width, depth, budget)
    got = generate(target, prompt, drafter, cfg)
    assert got.token_ids == ref.token_ids
    assert got.finish_reason == ref.finish_reason
    blind = generate(target, prompt, RandomTreeDrafter(seed, vocab, None, width, depth, budget), cfg)
    assert blind.token_ids == ref.token_ids


def test_plain_greedy_stats(tiny_llama):
    _, target, _ = tiny_llama
    r = generate(target, [5, 6, 7], None, GenerateConfig(max_new_tokens=10))
    assert r.finish_reason == "length" and len(r.token_ids) == 10  # this prompt never reaches EOS in 10 tokens
    # the first token comes from prefill, each later one from one single-node pass
    assert r.stats.passes == 9 and r.stats.committed == 9 and r.stats.tokens_per_pass == 1.0
    assert r.stats.accept_hist == {0: 9} and r.stats.tree_nodes == 0


def test_drafting_time_counts_the_drafters_commit_too(tiny_llama):
    """stats.draft_s is the drafter's whole work per pass: propose and commit (which reads the accepted
    features); a drafter whose commit takes 20 ms shows it."""
    import time

    from specdraft.drafters.base import NoDrafter

    class SlowCommit(NoDrafter):
        def commit(self, accepted, out):
            time.sleep(0.02)
            super().commit(accepted, out)

    _, target, _ = tiny_llama
    r = generate(target, [5, 6, 7], SlowCommit(), GenerateConfig(max_new_tokens=6))
    commits = r.stats.passes - 1  # no commit after the last pass
    assert commits >= 4 and r.stats.draft_s >= 0.02 * commits
    assert r.stats.verify_s < 0.02 * commits  # and not in the target's share


PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, then explain it.",
    "List three facts about the Moon, then repeat the list in reverse order.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


def test_ngram_equals_greedy_on_real_prompts(default_target):
    """Exact equality, no tie allowance; the stats agree with the per-pass histogram; the drafts get
    accepted (pooled tokens per pass measured 1.20 on these prompts; floor 1 + 0.75 x the gain)."""
    cfg = GenerateConfig(max_new_tokens=96)
    committed = passes = 0
    for p in PROMPTS:
        ids = default_target.encode_prompt(p)
        ref = generate(default_target, ids, None, cfg)
        got = generate(default_target, ids, NgramDrafter(), cfg)
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason
        gs = got.stats
        assert gs.passes == sum(gs.accept_hist.values())
        # every pass's accepted tokens were consumed, except past the token limit in the last pass
        overflow = sum((k + 1) * v for k, v in gs.accept_hist.items()) - gs.committed
        assert overflow == 0 or (got.finish_reason == "length" and 0 < overflow <= max(gs.accept_hist))
        assert gs.committed == gs.new_tokens - 1 + (got.finish_reason == "stop")  # EOS consumed, not emitted
        committed, passes = committed + gs.committed, passes + gs.passes
    assert committed / passes >= 1.15


def test_sampling_reproducible_with_seed(tiny_llama):
    from specdraft.verify import Sampling

    _, target, _ = tiny_llama
    cfg = GenerateConfig(max_new_tokens=12, sampling=Sampling(temperature=1.0), seed=7)
    a = generate(target, [4, 5], None, cfg).token_ids
    b = generate(target, [4, 5], None, cfg).token_ids
    assert a == b
    torch.manual_seed(0)  # global RNG state must not matter
    assert generate(target, [4, 5], None, cfg).token_ids == a


@pytest.mark.parametrize("mode", ["fast", "exact-fused", "exact-python"])
def test_random_trees_on_the_quantized_default_target(default_target, exact_target, monkeypatch, mode):
    """The same random trees on the real target's quantized kernel, with the fused C++ decoder blocks
    and without: tree passes of 1 to 25 nodes give plain greedy's tokens exactly."""
    from specdraft.model import llama

    monkeypatch.setattr(llama, "FUSED_BLOCKS", mode == "exact-fused")
    t = default_target if mode == "fast" else exact_target
    cfg = GenerateConfig(max_new_tokens=24)
    for seed, p in enumerate(PROMPTS):
        ids = t.encode_prompt(p)
        ref = generate(t, ids, None, cfg)
        for width, depth, budget in ((3, 4, 8), (6, 6, 24), (1, 6, 6)):
            drafter = RandomTreeDrafter(seed, t.config.vocab_size, ref.token_ids, width, depth, budget)
            got = generate(t, ids, drafter, cfg)
            assert got.token_ids == ref.token_ids, (p, width, depth, budget)
            assert max(got.stats.accept_hist) >= 2  # deep true paths were accepted through non-linear trees


class ScoredRandomDrafter(RandomTreeDrafter):
    """RandomTreeDrafter whose nodes carry random probabilities, so the live cut keeps random subtrees."""

    def propose(self, budget):
        tree = super().propose(budget)
        return tree.with_probs([self.rng.random() for _ in tree.tokens])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cut_trees_and_paused_drafting_equal_plain_greedy(tiny_llama, monkeypatch, seed):
    """The live policy (drafters.budget.LiveCosts) cuts scored trees and pauses drafting, the drafter catching up
    on the passes it missed in one commit: the output stays plain greedy's, whatever it decides."""
    import importlib

    from specdraft.drafters.budget import LiveCosts

    gen_module = importlib.import_module("specdraft.generate")
    _, target, _ = tiny_llama
    vocab = target.config.vocab_size
    costs = LiveCosts({"n": list(range(1, 33)), "ms": [1.0 + 0.1 * n for n in range(1, 33)]})
    rng = random.Random(seed)
    monkeypatch.setattr(gen_module, "live_costs", lambda t: costs)
    monkeypatch.setattr(costs, "drafting_pays", lambda name: rng.random() < 0.6)
    prompt = [rng.randrange(2, vocab) for _ in range(8)]
    cfg = GenerateConfig(max_new_tokens=40)
    ref = generate(target, prompt, None, cfg)
    for drafter in (ScoredRandomDrafter(seed, vocab, ref.token_ids, 3, 5, 12), NgramDrafter()):
        drafter.default_budget = 12
        got = generate(target, prompt, drafter, cfg)
        assert got.token_ids == ref.token_ids
        assert got.stats.pass_rows and sum(got.stats.pass_rows.values()) == got.stats.passes
    assert 1 in got.stats.pass_rows  # some passes paused (or cut to the root)
    assert costs.live  # the passes were timed
