"""Our decoder equals HF transformers on the same weights (fp32): prefill and cached decoding."""

from __future__ import annotations

import pytest
import torch

from specdraft.model.llama import FINAL, causal_mask
from tests.conftest import make_tiny_hf, tiny_target

TOL = 1e-4


def check_against_hf(hf, target, ids: list[int], steps: int) -> None:
    model = target.model
    n = len(ids)
    cache = model.new_cache(1, n + steps + 1)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True)
        out = model(x, torch.arange(n)[None], causal_mask(n, 0), cache, 0, hidden_layers=(1, FINAL))
        assert (out.logits - ref.logits).abs().max().item() < TOL
        assert (out.hidden[1] - ref.hidden_states[1]).abs().max().item() < TOL
        seq = list(ids)
        for step in range(steps):  # cached one-token decoding against a full uncached HF forward
            tok = int(out.logits[0, -1].argmax())
            seq.append(tok)
            pos = len(seq) - 1
            out = model(torch.tensor([[tok]]), torch.tensor([[pos]]), None, cache, pos)
            full = hf(torch.tensor([seq])).logits[0, -1]
            assert (out.logits[0, -1] - full).abs().max().item() < TOL, f"step {step}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tiny_models_match_hf(tmp_path, arch):
    hf = make_tiny_hf(arch, tmp_path)
    target = tiny_target(tmp_path)
    check_against_hf(hf, target, [0, 5, 17, 33, 2, 91, 40, 8], steps=6)


def test_default_target_matches_hf(exact_target, default_hf):
    """The exact precision mode's promise (the fast mode rounds activations to 8 bits and does not make it)."""
    ids = exact_target.encode_prompt("The capital of France is Paris. The capital of Germany is", raw=True)
    check_against_hf(default_hf, exact_target, ids, steps=4)


def test_default_target_knows_berlin(default_target):
    # the GGUF's q/k rows are un-permuted correctly only if the model makes sense
    ids = default_target.encode_prompt("The capital of France is Paris. The capital of Germany is", raw=True)
    out = default_target.prefill(ids, max_slots=len(ids) + 1)
    assert default_target.decode([int(out.logits[0, -1].argmax())]).strip() == "Berlin"


def test_tree_pass_equals_sequential(tiny_llama):
    """Logits at tree nodes equal those of running each root-to-node path as a plain sequence."""
    _, target, _ = tiny_llama
    from specdraft.tree import Tree

    prompt = [3, 9, 27, 4]
    tree = Tree.from_paths(50, [[7, 8, 9], [7, 11], [12, 13]])
    target.prefill(prompt, max_slots=32)
    logits = target.forward_tree(tree).logits[0]
    for node in range(len(tree)):
        seq = prompt + [tree.tokens[i] for i in tree.path_to(node)]
        out = target.prefill(seq, max_slots=32)
        assert (out.logits[0, -1] - logits[node]).abs().max().item() < TOL
        target.prefill(prompt, max_slots=32)


def test_packed_weights_match_the_generic_path(tiny_llama):
    from specdraft.model.llama import mkl_packing_available
    from specdraft.tree import Tree

    target = tiny_llama[1]
    if not mkl_packing_available():
        pytest.skip("this torch build has no MKL packed GEMM (the generic path is the only one)")
    tree = Tree(tokens=[5, 6, 7, 8, 9], parents=[-1, 0, 0, 1, 2])
    target.model.drop_packs()
    target.prefill([1, 2, 3, 4], max_slots=16)
    ref = target.forward_tree(tree).logits
    assert target.model.pack_for_rows(len(tree)) and target.model.lm_head.packs
    target.prefill([1, 2, 3, 4], max_slots=16)
    got = target.forward_tree(tree).logits
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    for rows in (2, 3, 9):  # at most two sizes are held
        target.model.pack_for_rows(rows)
    assert sorted(target.model.lm_head.packs) == [3, 9]
    target.model.drop_packs()


def test_best_budget_uses_the_cost_envelope():
    from specdraft.drafters.budget import best_budget

    curve = {"n": [1, 2, 3, 4, 5], "ratio": [1.0, 1.1, 1.6, 1.2, 1.3]}
    # budget b costs the envelope at b + 1: 1.1, 1.6, 1.6, 1.6
    assert best_budget(curve, {"1": 1.5, "2": 2.0, "3": 2.2, "4": 2.4}, default=7) == 4
    assert best_budget(curve, {"1": 1.5, "2": 1.6}, default=7) == 1
    assert best_budget(None, {"1": 1.5}, default=7) == 7
    assert best_budget(curve, {}, default=7) == 7
    # drafting time counts in units of the one-token pass (10 ms): 4 ms more at budgets 3-4 tips it to 1
    curve["ms"] = [10.0, 11.0, 16.0, 12.0, 13.0]
    tpp = {"1": 1.5, "2": 2.0, "3": 2.2, "4": 2.4}
    assert best_budget(curve, tpp, default=7, draft_ms={"1": 1.0, "2": 1.0, "3": 1.0, "4": 1.0}) == 4
    assert best_budget(curve, tpp, default=7, draft_ms={"1": 1.0, "2": 1.0, "3": 5.0, "4": 5.0}) == 1
