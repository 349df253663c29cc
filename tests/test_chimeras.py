"""Chimera analysis: node classes on hand-made trees, target futures, and the pooled statistics
with a fake block drafter over a tiny random target."""

from __future__ import annotations

import pytest
import torch

from specdraft.bench.chimeras import (ChimeraConfig, Tally, analyze_prompt, chimera_report, chimera_stats, classify,
                                      context_steps, continuations)
from specdraft.replay import greedy_outputs
from specdraft.errors import SpecdraftError
from specdraft.model.llama import causal_mask
from specdraft.search import ddtree, mixture_marginals, mixture_tree
from specdraft.tree import Tree


def test_classify_hand_written():
    futures = [[1, 2, 3], [1, 5, 6], [4]]
    tree = Tree.from_paths(0, [[1, 2, 3], [1, 2, 6], [1, 5, 3], [4, 2], [7], [1, 9]])
    by_prefix = {tuple(tree.tokens[j] for j in tree.path_to(i)[1:]): c for i, c in enumerate(classify(tree, futures))}
    assert by_prefix[()] is None  # the root
    assert by_prefix[(1,)] == by_prefix[(1, 2)] == by_prefix[(1, 2, 3)] == by_prefix[(4,)] == "coherent"
    assert by_prefix[(1, 2, 6)] == by_prefix[(1, 5, 3)] == "chimera"  # stitched from the first two futures
    assert by_prefix[(4, 2)] == "chimera"  # 4 from the third, 2 from the first
    assert by_prefix[(7,)] == by_prefix[(1, 9)] == "off_future"


def test_tally_on_the_chimera_example():
    tokens = torch.tensor([[[1, 0], [2, 5], [3, 6]], [[1, 0], [5, 2], [6, 3]]])  # futures (1,2,3) and (1,5,6)
    logp = torch.tensor([[[1.0, 0.0], [0.8, 0.2], [0.7, 0.3]], [[1.0, 0.0], [0.9, 0.1], [0.9, 0.1]]]).log()
    futures = [[1, 2, 3], [1, 5, 6]]
    product, mixture = Tally(), Tally()
    product.add(ddtree(0, *mixture_marginals(tokens, logp), 5), futures)
    mixture.add(mixture_tree(0, tokens, logp, 5), futures)
    p, m = product.summary(), mixture.summary()
    assert product.nodes == {"coherent": 4, "chimera": 1, "off_future": 0}
    assert p["mass_share"]["chimera"] == pytest.approx(0.45 * 0.6 / (1 + 0.55 + 0.45 + 0.33 + 0.27))  # (1, 2, 6)
    assert mixture.nodes == {"coherent": 5, "chimera": 0, "off_future": 0}
    assert m["node_share"]["coherent"] == 1.0 and p["by_depth"][3] == {"coherent": 1, "chimera": 1, "off_future": 0}


def test_context_steps():
    assert context_steps(10, 1, 8) == []  # no token after the only root
    assert context_steps(10, 5, 8) == [10, 11, 12, 13]
    assert context_steps(10, 101, 4) == [10, 35, 60, 85]


def _tiny_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (6 + i,), generator=g).tolist() for i in range(n)]


def test_greedy_continuations_match_greedy_output(tiny_llama):
    _, target, _ = tiny_llama
    prompt = _tiny_prompts(1)[0]
    out = greedy_outputs(target, [prompt], 20)[0]
    full = prompt + out
    cache = target.model.new_cache(1, len(full))
    res = target.model(torch.tensor([full]), torch.arange(len(full))[None], causal_mask(len(full), 0), cache, 0)
    n = len(prompt) + 3
    conts = continuations(target, cache, res.logits[0, n], n, 6, 3, target.eos_ids, temperature=0.0)
    want = full[n + 1 : n + 7]
    end = next((i for i, t in enumerate(want) if t in target.eos_ids), None)
    assert conts == [want if end is None else want[: end + 1]] * 3
    sampled = continuations(target, cache, res.logits[0, n], n, 6, 4, target.eos_ids,
                            generator=torch.Generator().manual_seed(0))
    assert len(sampled) == 4 and all(1 <= len(s) <= 6 for s in sampled)


class FakeBlock:
    """A block drafter stand-in that knows the greedy outputs: mode 0 puts the true next D tokens
    first (q = 0.6), the other modes are random; checks that it is reset and committed along the output."""

    name = "fake-block"
    hidden_layers = (1,)
    default_budget = 8

    def __init__(self, sequences: list[list[int]], modes: int = 1, depth: int = 4, vocab: int = 96) -> None:
        self.sequences, self.modes, self.depth, self.vocab = sequences, modes, depth, vocab
        self.full: list[int] = []
        self.n = 0
        self.g = torch.Generator().manual_seed(0)

    def reset(self, prompt_ids, first_token, prefill) -> None:
        assert prefill.hidden[1].shape[1] == len(prompt_ids)
        self.full = next(s for s in self.sequences if s[: len(prompt_ids)] == list(prompt_ids))
        self.n = len(prompt_ids)
        assert self.full[self.n] == first_token

    def propose(self, budget: int) -> Tree:
        return Tree.from_paths(self.full[self.n], [self.full[self.n + 1 : self.n + 4]], budget)

    def commit(self, accepted, out) -> None:
        assert out.hidden[1].shape[1] >= len(accepted.path)
        self.n += len(accepted.tokens) + 1
        assert self.full[self.n] == accepted.bonus

    def marginals(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(self.modes, self.depth, k, dtype=torch.long)
        logp = torch.zeros(self.modes, self.depth, k)
        for m in range(self.modes):
            for i in range(self.depth):
                cand = torch.randperm(self.vocab, generator=self.g)[:k]
                if m == 0 and self.n + 1 + i < len(self.full):
                    true = self.full[self.n + 1 + i]
                    cand = torch.cat([torch.tensor([true]), cand[cand != true]])[:k]
                    probs = torch.cat([torch.tensor([0.6]), torch.full((k - 1,), 0.4 / k)])
                else:
                    probs = torch.rand(k, generator=self.g).sort(descending=True).values
                    probs = probs / probs.sum() * 0.9
                tokens[m, i], logp[m, i] = cand, probs.log()
        return tokens, logp


@pytest.mark.parametrize("modes", [1, 2])
def test_chimera_stats_with_a_fake_block_drafter(tiny_llama, modes):
    _, target, _ = tiny_llama
    prompts = _tiny_prompts(3)
    outputs = greedy_outputs(target, prompts, 24)
    drafter = FakeBlock([p + o for p, o in zip(prompts, outputs)], modes=modes)
    cfg = ChimeraConfig(budget=12, contexts_per_prompt=3, samples=5, top_k=4)
    r = chimera_stats(target, drafter, prompts, outputs, cfg)
    assert 1 <= r["contexts"] <= 9 and r["modes"] == modes and r["draft_positions"] == 4
    assert 1.0 <= r["mean_distinct_futures"] <= 6
    kinds = ["product"] + (["mixture"] if modes > 1 else [])
    assert [k for k in ("product", "mixture") if k in r] == kinds
    for kind in kinds:
        t = r[kind]
        assert t["trees"] == r["contexts"] and t["nodes_per_tree"] == 12
        assert sum(t["node_share"].values()) == pytest.approx(1.0)
        assert sum(t["mass_share"].values()) == pytest.approx(1.0)
        assert t["node_share"]["coherent"] > 0  # the greedy path is drafted first and is a future
        assert 0 < t["mass_per_tree"] < 12
    assert r["product"]["by_depth"][1]["chimera"] == 0  # one token cannot be stitched
    ctx = analyze_prompt(target, drafter, prompts[0], outputs[0], cfg, torch.Generator().manual_seed(0))
    assert [c["n"] for c in ctx] == context_steps(len(prompts[0]), len(outputs[0]), 3)  # lands on every wanted slot
    for c in ctx:  # the greedy future comes first: the output's next 4 tokens, cut after an EOS
        greedy = (prompts[0] + outputs[0])[c["n"] + 1 : c["n"] + 5]
        end = next((i for i, tok in enumerate(greedy) if tok in target.eos_ids), None)
        assert c["futures"][0] == (greedy if end is None else greedy[: end + 1])
    again = chimera_stats(target, FakeBlock([p + o for p, o in zip(prompts, outputs)], modes=modes), prompts, outputs, cfg)
    assert again == r  # seeded: reproducible


def test_drafter_without_marginals_is_refused(tiny_llama, tmp_path):
    _, target, _ = tiny_llama
    with pytest.raises(SpecdraftError, match="--drafter ngram has no per-position distributions; use block or mfd"):
        chimera_report(target, "ngram", ["gsm"], 2, 8, ChimeraConfig(), tmp_path)
    with pytest.raises(SpecdraftError, match="--budget, --contexts-per-prompt and --top-k must be >= 1"):
        ChimeraConfig(budget=0)
