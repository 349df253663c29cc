"""Sampling stays exact through real drafters on the real (quantized) default target: the joint
distribution of the first three sampled tokens with ngram, a hybrid, eagle3 and a block drafter equals the
target's own (chi-square against the exact probabilities, two sampling settings), the drafts being
accepted along the way; and the same test rejects a verifier with a small bias (its power).

Slow (real model): about two minutes on a 2-core CPU."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdraft.drafters import make_drafter
from specdraft.generate import GenerateConfig, generate
from specdraft.verify import Accepted, Sampling, target_probs

pytestmark = pytest.mark.slow

N = 150  # samples per drafter and setting
SETTINGS = [Sampling(temperature=1.0, top_k=2), Sampling(temperature=0.7, top_k=3, top_p=0.9)]  # top-k keeps the support enumerable
# prompts whose continuations the drafters can draft: raw text repeating itself for prompt lookup,
# chat prompts with several likely openings for the trained drafters
PROMPTS = {"ngram": ("red apple, green pear, red apple, green pear, red apple, green pear, red", True),
           "gumiho": ("Give me a word that rhymes with cat.", False),
           "eagle3": ("Give me a word that rhymes with cat.", False),
           "mfd": ("Name three fruits.", False)}


def exact(target, ids: list[int], s: Sampling, depth: int = 3) -> dict[tuple[int, ...], float]:
    """The target's exact probability of every sampled continuation of ``depth`` tokens (EOS ends one)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], p: float) -> None:
        if len(prefix) == depth or (prefix and prefix[-1] in target.eos_ids):
            out[tuple(prefix)] = p
            return
        logits = target.prefill(ids + prefix, max_slots=len(ids) + len(prefix) + 1).logits[0, -1]
        probs = target_probs(logits, s)
        for tok in probs.nonzero().flatten().tolist():
            walk(prefix + [tok], p * float(probs[tok]))

    walk([], 1.0)
    return out


def counts_of(target, drafter, ids: list[int], s: Sampling) -> tuple[Counter, Counter]:
    """Sampled 3-token continuations over N seeds, and how many drafted tokens the passes accepted."""
    seqs, accepted = Counter(), Counter()
    for seed in range(N):
        r = generate(target, ids, drafter, GenerateConfig(max_new_tokens=3, sampling=s, seed=seed, budget=4))
        eos = [min(target.eos_ids)] if r.finish_reason == "stop" else []
        seqs[tuple(r.token_ids + eos)] += 1
        accepted.update(r.stats.accept_hist)
    return seqs, accepted


def consistent(seqs: Counter, expected: dict[tuple[int, ...], float]) -> tuple[bool, str]:
    """Whether the samples can come from ``expected``: none outside its support, and a chi-square
    p-value above 1e-3 (cells expecting fewer than 5 samples pooled into one)."""
    outside = set(seqs) - set(expected)
    if outside:
        return False, f"outside the target's support: {sorted(outside)[:3]}"
    total = sum(expected.values())
    small = [k for k in expected if expected[k] / total * N < 5]
    big = [k for k in expected if k not in small]
    f_obs = [seqs[k] for k in big] + ([sum(seqs[k] for k in small)] if small else [])
    f_exp = [expected[k] / total * N for k in big] + ([sum(expected[k] for k in small) / total * N] if small else [])
    assert len(f_obs) >= 3, "too few cells for a test"
    p = chisquare(f_obs, f_exp).pvalue
    return p > 1e-3, f"chi-square p = {p:.2g} over {len(f_obs)} cells"


@pytest.mark.parametrize("name", list(PROMPTS))
def test_sampling_through_shipped_drafters_is_exact(default_target, name):
    drafter = make_drafter(name, default_target)
    ids = default_target.encode_prompt(*PROMPTS[name])
    for s in SETTINGS:
        seqs, accepted = counts_of(default_target, drafter, ids, s)
        assert sum(v for k, v in accepted.items() if k > 0) > N // 20, (name, s, accepted)  # drafts were accepted
        ok, why = consistent(seqs, exact(default_target, ids, s))
        assert ok, (name, s, why)


def test_a_biased_verifier_is_caught(default_target, monkeypatch):
    """A verifier that accepts a drafted child whenever it is the target's most likely token, and
    samples only where no draft is (a common slip: greedy acceptance under sampling), must fail the
    same test; its outputs stay inside the target's support, so the chi-square itself must see it."""

    def biased(tree, logits, s, generator=None):
        node, path = 0, [0]
        while True:
            probs = target_probs(logits[node], s)
            nxt = tree.child(node, int(probs.argmax()))
            if nxt is None:
                x = int(torch.multinomial(probs, 1, generator=generator))
                return Accepted(path=path, tokens=[tree.tokens[i] for i in path[1:]], bonus=x)
            node, path = nxt, path + [nxt]

    monkeypatch.setattr(sys.modules["specdraft.generate"], "verify", biased)  # the module; specdraft.generate is the function
    s = SETTINGS[0]
    ids = default_target.encode_prompt(*PROMPTS["gumiho"])
    seqs, _ = counts_of(default_target, make_drafter("gumiho", default_target), ids, s)
    ok, why = consistent(seqs, exact(default_target, ids, s))
    assert not ok and why.startswith("chi-square"), why  # inside the support: the chi-square itself saw it
