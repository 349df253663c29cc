"""Sample-and-match is lossless: speculative sampling through random trees reproduces the
target's own distribution over 3-token continuations (chi-square, fixed seed)."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import torch
from scipy.stats import chisquare

from specdraft.generate import GenerateConfig, generate
from specdraft.tree import Tree
from specdraft.verify import Sampling, target_probs

SAMPLING = Sampling(temperature=0.9, top_k=3, top_p=0.95)
PROMPT = [7, 21, 3]


def exact_probs(target, prefix: list[int]) -> torch.Tensor:
    out = target.prefill(PROMPT + prefix, max_slots=len(PROMPT) + len(prefix) + 1)
    return target_probs(out.logits[0, -1], SAMPLING)


class TopTreeDrafter:
    """Random sub-trees of the target's top-3 x top-3 tree: every acceptance length occurs."""

    name = "toptree"
    hidden_layers = ()
    default_budget = 12

    def __init__(self, top: dict, seed: int):
        self.top, self.rng = top, random.Random(seed)

    def reset(self, prompt_ids, first_token, prefill):
        self.done = [first_token]

    def commit(self, accepted, out):
        self.done.extend(accepted.new_tokens)

    def propose(self, budget):
        paths = []
        for a in self.top.get(tuple(self.done), []):
            if self.rng.random() < 0.7:
                kids = [b for b in self.top.get(tuple(self.done) + (a,), []) if self.rng.random() < 0.6]
                paths += [[a, b] for b in kids] or [[a]]
        self.rng.shuffle(paths)
        return Tree.from_paths(self.done[-1], paths, budget=budget)


def test_sample_and_match_reproduces_target_distribution(tiny_llama, monkeypatch):
    _, target, _ = tiny_llama
    monkeypatch.setattr(target.model.cfg, "eos_token_ids", [])  # count full 3-token continuations
    # exact distribution over (t1, t2, t3) with the sampling transforms applied
    p1 = exact_probs(target, [])
    support1 = p1.nonzero().flatten().tolist()
    expected: dict[tuple[int, ...], float] = {}
    top: dict[tuple[int, ...], list[int]] = {}
    for a in support1:
        p2 = exact_probs(target, [a])
        s2 = p2.nonzero().flatten().tolist()
        top[(a,)] = s2
        for b in s2:
            p3 = exact_probs(target, [a, b])
            s3 = p3.nonzero().flatten().tolist()
            top[(a, b)] = s3
            for c in s3:
                expected[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    assert abs(sum(expected.values()) - 1) < 1e-4 and len(expected) > 8

    n = 2500
    counts: Counter = Counter()
    accepted_lengths: Counter = Counter()
    for i in range(n):
        cfg = GenerateConfig(max_new_tokens=3, sampling=SAMPLING, seed=i)
        r = generate(target, PROMPT, TopTreeDrafter(top, seed=i), cfg)
        assert r.finish_reason == "length" or len(r.token_ids) < 3
        counts[tuple(r.token_ids)] += 1
        accepted_lengths.update(r.stats.accept_hist)
    assert sum(counts[k] for k in expected) == n  # nothing outside the support
    keys = sorted(expected)
    f_obs = [counts[k] for k in keys]
    total = sum(expected.values())
    f_exp = [expected[k] / total * n for k in keys]
    assert chisquare(f_obs, f_exp).pvalue > 1e-3
    assert accepted_lengths[1] > 0 and accepted_lengths[0] > 0  # trees were really used

    # the test has power: a distribution off by a little is rejected on the same counts
    skew = [e * (1.3 if j % 2 else 0.7) for j, e in enumerate(f_exp)]
    skew = [s * n / sum(skew) for s in skew]
    assert chisquare(f_obs, skew).pvalue < 1e-3


def test_target_probs_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = target_probs(logits, Sampling(temperature=1.0, top_k=2))
    assert p[2] == 0 and p[3] == 0 and abs(float(p.sum()) - 1) < 1e-6
    p = target_probs(logits, Sampling(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0  # the first token alone already holds >= 0.5 of the mass


def test_tiny_temperatures_give_a_distribution_not_nan():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 10
    for t in (5e-324, 1e-40, 1e-30, 1e-6):
        p = target_probs(logits, Sampling(temperature=t, top_p=0.9, top_k=5))
        assert not torch.isnan(p).any() and torch.allclose(p.sum(-1), torch.ones(4))
        assert torch.equal(p.argmax(-1), logits.argmax(-1))


def _reference_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The transforms written plainly over the whole vocabulary: mask below the k-th logit, softmax,
    sort everything and keep tokens while the mass before them is below top-p."""
    z = (logits - logits.max()) / s.temperature
    if s.top_k:
        z = z.masked_fill(z < torch.topk(z, s.top_k).values[-1], float("-inf"))
    p = torch.softmax(z, -1)
    if s.top_p < 1:
        sp, idx = torch.sort(p, descending=True)
        sp = sp.masked_fill(sp.cumsum(-1) - sp >= s.top_p, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sp)
    return p / p.sum()


def test_candidate_sampling_equals_the_whole_vocabulary_definition():
    """Only the top-k (or a few hundred candidates for top-p) are sorted; the kept tokens and their
    probabilities are those of the plain definition (random logits: no ties at the cut)."""
    g = torch.Generator().manual_seed(0)
    settings = [Sampling(temperature=0.7, top_p=0.9), Sampling(temperature=1.0, top_k=5),
                Sampling(temperature=0.8, top_k=3, top_p=0.6), Sampling(temperature=1.3),
                Sampling(temperature=1.0, top_p=0.999), Sampling(temperature=0.5, top_k=40, top_p=0.95)]
    for trial in range(60):
        v = (50, 1000, 49152)[trial % 3]
        logits = torch.randn(v, generator=g) * (0.2 + 8 * float(torch.rand(1, generator=g)))
        for s in settings:
            got, want = target_probs(logits, s), _reference_probs(logits, s)
            assert torch.equal(got > 0, want > 0), (trial, s)
            assert torch.allclose(got, want, rtol=0, atol=1e-6), (trial, s)


def test_a_top_p_below_float32_range_keeps_the_most_likely_token():
    """top-p 1e-256 is valid (in (0, 1]) but rounds to 0 in float32: the nucleus is then the top token,
    not empty (it once was, and the server answered 500)."""
    from specdraft.verify import Sampling, candidates, sample

    logits = torch.tensor([0.5, 3.0, 1.0, -2.0])
    ids, p = candidates(logits, Sampling(temperature=1.0, top_p=1.477982095968267e-256))
    assert ids.tolist() == [1] and p.tolist() == [1.0]
    assert sample(logits, Sampling(temperature=1.0, top_p=1e-300), torch.Generator().manual_seed(0)) == 1


class ChainDrafter:
    """Proposes the same 4-token chain after every root, each node scored 0.9 (``Tree.probs``); a serial drafter's
    ``floor`` (the loop sets it each pass) is recorded."""

    name = "chain"
    hidden_layers = ()
    default_budget = 4

    def __init__(self, sampled=None):
        self.sampled, self.floor, self.floors = sampled or {}, 0.0, []

    def reset(self, prompt_ids, first_token, prefill):
        self.last = first_token

    def commit(self, accepted, out):
        self.last = accepted.bonus

    def fork(self):
        return ChainDrafter(self.sampled)

    def propose(self, budget):
        self.floors.append(self.floor)
        tree = Tree.from_paths(self.last, [[5, 6, 7, 8]], budget=budget)
        return tree.with_probs([0.9] * len(tree))


def test_sampled_maps_rescore_the_cut_under_sampling_only(tiny_llama, monkeypatch):
    """A sampling generation passes its trees' probabilities through the drafter's ``sampled`` map for its
    temperature before the live cut (greedy ones do not), and the floor of a serial drafter back through it: a map
    to 0 leaves every tree its root alone, the identity keeps the nodes; the output is plain sampling's either way."""
    import importlib

    from specdraft.drafters import calibration as C
    from specdraft.drafters.budget import LiveCosts

    gen_module = importlib.import_module("specdraft.generate")
    _, target, _ = tiny_llama
    costs = LiveCosts({"n": list(range(1, 33)), "ms": [1.0 + 0.05 * n for n in range(1, 33)]})
    monkeypatch.setattr(gen_module, "live_costs", lambda t: costs)
    monkeypatch.setattr(costs, "drafting_pays", lambda name: True)
    # the curve as given, not this machine's timings: a tiny model's 1- and 2-row passes are too close for a noisy
    # runner's measurements to keep the floor, (pass(2) - pass(1)) / pass(1), below 1
    monkeypatch.setattr(costs, "observe", lambda *args, **kwargs: None)
    floor = costs.floor("chain")
    assert 0.0 < floor < 1.0
    zero, same = C.Calibration([0.0, 1.0], [0.0, 0.0]), C.Calibration([0.0, 1.0], [0.0, 1.0])
    maps = {0.7: zero, 1.5: same}
    assert C.sampled_calibration(maps, Sampling()) is None  # greedy: no map
    assert C.sampled_calibration(maps, Sampling(temperature=0.9, top_k=1)) is None  # one-hot: greedy too
    assert C.sampled_calibration(maps, Sampling(temperature=0.9)) is zero  # the nearest temperature's
    assert C.sampled_calibration(maps, Sampling(temperature=1.2)) is same
    assert C.sampled_calibration({}, Sampling(temperature=0.7)) is None
    blend = C.sampled_calibration({0.8: C.Calibration([0.2, 0.6], [0.1, 0.3])}, Sampling(temperature=0.2))
    assert abs(blend(0.6) - (0.75 * 0.6 + 0.25 * 0.3)) < 1e-12 and abs(blend(0.9) - (0.75 * 0.9 + 0.25 * 0.3)) < 1e-12
    half = C.rescored(Tree.from_paths(1, [[2, 3], [4]]).with_probs([1.0, 0.8, 0.6, 0.9]), C.Calibration([0, 1], [0, 0.5]))
    assert half.probs == [1.0, 0.4, 0.3, 0.45]
    m = C.Calibration([0.1, 0.5, 0.9], [0.05, 0.3, 0.6])  # a serial drafter's floor, carried back through the map
    assert m.below(0.3) == 0.5 and abs(m(m.below(0.45)) - 0.45) < 1e-12
    assert m.below(0.01) == 0.0 and m.below(0.7) == float("inf") and C.Calibration().below(0.2) == 0.2

    greedy = generate(target, PROMPT, ChainDrafter(maps), GenerateConfig(max_new_tokens=12))
    assert greedy.stats.tree_nodes > 0  # greedy trees are cut by their own probabilities
    for temperature, drafted in ((0.7, False), (1.4, True)):
        cfg = GenerateConfig(max_new_tokens=12, sampling=Sampling(temperature=temperature), seed=3)
        plain = generate(target, PROMPT, None, cfg)
        d = ChainDrafter(maps)
        got = generate(target, PROMPT, d, cfg)
        assert got.token_ids == plain.token_ids
        assert (got.stats.tree_nodes > 0) == drafted, temperature
        # the floor as the map gives it: none of a map to 0 can pay (inf); the identity's is the costs' own
        assert d.floors and all(f == (floor if drafted else float("inf")) for f in d.floors), d.floors
