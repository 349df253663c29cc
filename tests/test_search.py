"""DDTree and the MFD mixture tree against brute-force enumeration of every prefix."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from specdraft.search import Ranked, ddtree, mixture_marginals, mixture_tree

NEG = -math.inf


def brute_scores(modes: list[list[list[tuple[int, float]]]], prior: list[float] | None = None) -> dict[tuple[int, ...], float]:
    """Every prefix with a finite best-mode score: modes[m][depth] = [(token, logp), ...]; mode m's
    score starts at prior[m] (0 without a prior)."""
    depth = len(modes[0])
    lookup = [[{t: lp for t, lp in modes[m][i] if math.isfinite(lp)} for i in range(depth)] for m in range(len(modes))]
    union = [sorted({t for m in lookup for t in m[i]}) for i in range(depth)]
    out = {}
    for d in range(1, depth + 1):
        for prefix in itertools.product(*union[:d]):
            best = NEG
            for mi, m in enumerate(lookup):
                s = prior[mi] if prior else 0.0
                for i, t in enumerate(prefix):
                    s += m[i].get(t, NEG)
                best = max(best, s)
            if math.isfinite(best):
                out[prefix] = best
    return out


def prefixes(r: Ranked) -> list[tuple[int, ...]]:
    t = r.tree
    return [tuple(t.tokens[j] for j in t.path_to(i)[1:]) for i in range(1, len(t))]


def check_top(r: Ranked, root: int, brute: dict[tuple[int, ...], float], budget: int) -> None:
    t = r.tree
    assert t.tokens[0] == root and r.scores[0] == 0.0 and len(r.scores) == len(t)
    got = prefixes(r)
    assert len(set(got)) == len(got)  # no duplicate prefixes
    assert len(got) == min(budget, len(brute))
    for i, p in enumerate(got, start=1):
        assert p in brute
        assert r.scores[i] == pytest.approx(brute[p], abs=1e-12)
        assert t.parents[i] < i  # topological: prefix-closed with the parent first
    want = sorted(brute.values(), reverse=True)[: len(got)]
    assert sorted(r.scores[1:], reverse=True) == pytest.approx(want, abs=1e-12)  # the top-B score multiset
    if got:
        cut = min(r.scores[1:])
        assert all(p in set(got) for p, s in brute.items() if s > cut + 1e-12)  # nothing better left out


def random_mode(rng: random.Random, depth: int, k: int, vocab: int, ties: bool) -> list[list[tuple[int, float]]]:
    out = []
    for _ in range(depth):
        toks = rng.sample(range(vocab), k)
        if ties:
            lps = [math.log(rng.choice([0.5, 0.25, 0.125])) for _ in range(k)]
        else:
            w = [rng.random() + 1e-3 for _ in range(k + 1)]  # one unit of mass left outside the top-k
            lps = [math.log(x / sum(w)) for x in w[:k]]
        if rng.random() < 0.2:
            lps[rng.randrange(k)] = NEG
        row = sorted(zip(toks, lps), key=lambda x: -x[1])
        out.append(row)
    return out


def as_tensors(modes: list[list[list[tuple[int, float]]]]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([[[t for t, _ in row] for row in m] for m in modes])  # [K, D, k]
    logp = torch.tensor([[[lp for _, lp in row] for row in m] for m in modes], dtype=torch.float64)
    return tokens, logp


@pytest.mark.parametrize("seed", range(40))
def test_ddtree_matches_brute_force(seed):
    rng = random.Random(seed)
    depth, k = rng.randint(1, 4), rng.randint(1, 4)
    mode = random_mode(rng, depth, k, vocab=8, ties=seed % 2 == 1)
    brute = brute_scores([mode])
    tokens, logp = as_tensors([mode])
    for budget in range(len(brute) + 2):
        check_top(ddtree(7, tokens[0], logp[0], budget), 7, brute, budget)


@pytest.mark.parametrize("seed", range(40))
def test_mixture_matches_brute_force(seed):
    rng = random.Random(1000 + seed)
    n_modes, depth, k = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4)
    modes = [random_mode(rng, depth, k, vocab=5, ties=seed % 2 == 1) for _ in range(n_modes)]  # small vocab: overlaps
    brute = brute_scores(modes)
    tokens, logp = as_tensors(modes)
    for budget in range(len(brute) + 2):
        check_top(mixture_tree(7, tokens, logp, budget), 7, brute, budget)


@pytest.mark.parametrize("seed", range(20))
def test_gated_mixture_matches_brute_force(seed):
    """With a mode gate: s(p) = max_k [log pi_k + sum_i log q_k(p_i)]."""
    rng = random.Random(2000 + seed)
    n_modes, depth, k = rng.randint(2, 3), rng.randint(1, 3), rng.randint(1, 4)
    modes = [random_mode(rng, depth, k, vocab=5, ties=seed % 2 == 1) for _ in range(n_modes)]
    w = [rng.random() + 0.05 for _ in range(n_modes)]
    prior = [math.log(x / sum(w)) for x in w]
    brute = brute_scores(modes, prior)
    tokens, logp = as_tensors(modes)
    for budget in range(len(brute) + 2):
        r = mixture_tree(7, tokens, logp, budget, prior=torch.tensor(prior, dtype=torch.float64))
        check_top(r, 7, brute, budget)
    with pytest.raises(ValueError):
        mixture_tree(7, tokens, logp, 3, prior=torch.zeros(n_modes + 1))
    with pytest.raises(ValueError):
        mixture_tree(7, tokens, logp, 3, prior=torch.full((n_modes,), 0.5))


def test_single_mode_mixture_equals_ddtree():
    rng = random.Random(3)
    mode = random_mode(rng, 4, 4, vocab=10, ties=False)
    tokens, logp = as_tensors([mode])
    a, b = ddtree(0, tokens[0], logp[0], 20), mixture_tree(0, tokens, logp, 20)
    assert a.tree.tokens == b.tree.tokens and a.tree.parents == b.tree.parents and a.scores == b.scores


def test_edge_cases():
    tokens = torch.tensor([[3, 4], [5, 6]])
    logp = torch.tensor([[-0.1, NEG], [NEG, NEG]])
    r = ddtree(9, tokens, logp, 0)
    assert r.tree.tokens == [9] and r.scores == [0.0]
    r = ddtree(9, tokens, logp, 64)  # one finite prefix only
    assert r.tree.tokens == [9, 3] and r.scores == pytest.approx([0.0, -0.1])
    r = mixture_tree(9, tokens[None], logp[None], 64)
    assert r.tree.tokens == [9, 3]
    empty = ddtree(9, torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0), 8)
    assert empty.tree.tokens == [9]


def test_ties_are_deterministic_and_shallow_first():
    tokens = torch.tensor([[1, 2], [3, 4]])
    logp = torch.log(torch.tensor([[0.5, 0.5], [1.0, 0.5]]))  # (1), (2), (1,3), (2,3) all tie at log 0.5
    r1, r2 = ddtree(0, tokens, logp, 3), ddtree(0, tokens, logp, 3)
    assert r1.tree.tokens == r2.tree.tokens == [0, 1, 2, 3]
    assert r1.tree.depths == [0, 1, 1, 2]


def test_repeated_tokens_across_modes_are_one_node():
    tokens = torch.tensor([[[1, 2], [3, 4]], [[1, 2], [3, 4]]])  # two identical modes
    logp = torch.log(torch.tensor([[[0.6, 0.4], [0.7, 0.3]], [[0.9, 0.1], [0.2, 0.8]]]))
    r = mixture_tree(0, tokens, logp, 64)
    assert len(r.tree) == 1 + 2 + 4  # every prefix once
    # best mode per prefix: (1) 0.9 (mode 2); (1,4) 0.72 (mode 2); (2,3) 0.28 (mode 1)
    s = dict(zip(prefixes(r), r.scores[1:]))
    assert math.exp(s[(1,)]) == pytest.approx(0.9)
    assert math.exp(s[(1, 4)]) == pytest.approx(0.72)
    assert math.exp(s[(2, 3)]) == pytest.approx(0.28)


def chimera_modes() -> tuple[torch.Tensor, torch.Tensor]:
    """Two futures that disagree at 2 positions: A = (1, 2, 3), B = (1, 5, 6)."""
    tokens = torch.tensor([[[1, 0], [2, 5], [3, 6]],  # mode A
                           [[1, 0], [5, 2], [6, 3]]])  # mode B
    probs = torch.tensor([[[1.0, 0.0], [0.8, 0.2], [0.7, 0.3]],
                          [[1.0, 0.0], [0.9, 0.1], [0.9, 0.1]]])
    return tokens, probs.log()


def test_chimera_example_product_vs_mixture():
    tokens, logp = chimera_modes()
    mt, ml = mixture_marginals(tokens, logp)  # depth 2: 5 .55, 2 .45; depth 3: 6 .6, 3 .4
    assert mt[1].tolist() == [5, 2] and torch.exp(ml[1]).tolist() == pytest.approx([0.55, 0.45])
    product = prefixes(ddtree(0, mt, ml, 5))
    assert product == [(1,), (1, 5), (1, 2), (1, 5, 6), (1, 2, 6)]  # (1, 2, 6): a chimera; future A's end is missing
    mixture = prefixes(mixture_tree(0, tokens, logp, 5))
    assert sorted(mixture) == sorted([(1,), (1, 2), (1, 5), (1, 2, 3), (1, 5, 6)])  # both futures, nothing stitched


def test_mixture_marginals_width_and_padding():
    tokens, logp = chimera_modes()
    mt, ml = mixture_marginals(tokens, logp, k=3)
    assert mt.shape == ml.shape == (3, 3)
    assert mt[0].tolist() == [1, -1, -1] and ml[0, 1:].tolist() == [NEG, NEG]  # p(0) = 0 is dropped
    assert torch.exp(ml).nansum(-1).tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_mixture_marginals_weigh_modes_by_the_gate():
    tokens = torch.tensor([[[1, 2]], [[3, 2]]])  # K=2, D=1, k=2
    logp = torch.log(torch.tensor([[[0.6, 0.4]], [[0.9, 0.1]]]))
    prior = torch.log(torch.tensor([0.25, 0.75]))
    mt, ml = mixture_marginals(tokens, logp, prior=prior)
    got = dict(zip(mt[0].tolist(), torch.exp(ml[0]).tolist()))
    assert got == pytest.approx({3: 0.675, 1: 0.15, 2: 0.175})
    assert mt[0].tolist() == [3, 2, 1]
    uniform = dict(zip(*[x[0].tolist() for x in mixture_marginals(tokens, logp)]))
    assert math.exp(uniform[2]) == pytest.approx(0.25)
