"""Hybrid drafter (Gumiho; Medusa = serial 0, EAGLE-style = parallel 0): tree construction on
hand-written head outputs, training maths == drafting maths, losslessness on real prompts with a
tiny model, checkpoint errors, resumable training."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.drafters import make_drafter
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.hybrid import (HybridDrafter, HybridOptions, Level, build_beam_tree, expand_level,
                                       parallel_levels)
from specdraft.nn.hybrid import HybridConfig, HybridModel
from specdraft.train import corpus as C
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate
from specdraft.model.llama import FINAL, ForwardOutput
from specdraft.train import hybrid as H
from specdraft.verify import Accepted

L = math.log
CONFIGS = {"gumiho": (2, 2), "medusa": (0, 3), "eagle": (3, 0)}
PROMPTS = ["What is 17 * 23? Think step by step.", "Write a Python function that reverses a string.",
           "Tell me about the United States of America."]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run faster on one thread (no hand-offs between threads on a busy 2-core CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------- tree construction


def test_global_top_budget_tree_on_hand_written_levels():
    # log-probabilities in whole numbers (exact sums, so ties are real ties)
    # depth 1: a -1, b -2, c -4; depth 2 under a: d -1, e -2; under b: f -0.5; depth 3 under d: g 0, under f: h -1
    lv = [Level([0, 0, 0], [10, 11, 12], [-1.0, -2.0, -4.0]),
          Level([0, 0, 1], [13, 14, 15], [-1.0, -2.0, -0.5]),
          Level([0, 2], [16, 17], [0.0, -1.0])]
    # cumulative: a -1, b -2, c -4, ad -2, ae -3, bf -2.5, adg -2, bfh -3.5
    tree, picked, _ = build_beam_tree(99, lv, budget=5)
    # a; the ties at -2 shallowest first: b, ad, adg; then bf
    assert tree.tokens == [99, 10, 11, 13, 16, 15]
    assert tree.parents == [-1, 0, 0, 1, 3, 2]
    assert picked == [(0, 0), (0, 1), (1, 0), (2, 0), (1, 2)]
    tree, _, _ = build_beam_tree(99, lv, budget=7)  # then ae (-3) and bfh (-3.5); c (-4) stays out
    assert tree.tokens == [99, 10, 11, 13, 16, 15, 14, 17]
    assert tree.parents == [-1, 0, 0, 1, 3, 2, 1, 5]
    assert build_beam_tree(99, lv, budget=0)[0].tokens == [99]
    assert sorted(build_beam_tree(99, lv, budget=100)[0].tokens) == [10, 11, 12, 13, 14, 15, 16, 17, 99]


def test_prefix_closed_even_when_a_child_ties_its_parent():
    lv = [Level([0, 0], [1, 2], [L(0.5), L(0.5)]), Level([1], [3], [0.0])]  # node 2's child has prob 1
    tree, _, _ = build_beam_tree(0, lv, budget=2)
    assert tree.tokens == [0, 1, 2]  # the child (score .5, depth 2) waits for depth-1 ties
    tree, _, _ = build_beam_tree(0, lv, budget=3)
    assert tree.tokens == [0, 1, 2, 3] and tree.parents == [-1, 0, 0, 2]


def test_beam_expansion_of_serial_and_parallel_levels():
    # serial expansion: two expanded nodes (cumulative log .5, .2), top-2 children each, width 3
    lv, cums = expand_level([L(0.5), L(0.2)], [[7, 8], [9, 7]], [[L(0.5), L(0.4)], [L(0.9), L(0.1)]], width=3)
    assert lv.parents == [0, 0, 1] and lv.tokens == [7, 8, 9]
    assert [round(math.exp(c), 4) for c in cums] == [0.25, 0.2, 0.18]
    # parallel: beams (.5, .25); head 0 and head 1 top-2 per beam, width 2 per depth
    toks = [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    lps = [[[L(0.8), L(0.2)], [L(0.6), L(0.4)]], [[L(0.9), L(0.1)], [L(0.5), L(0.5)]]]
    par = parallel_levels([L(0.5), L(0.25)], toks, lps, width=2)
    # depth +1: beam0/1 (.4), beam1/5 (.225) ; depth +2: under 1 -> 3 (.24), 4 (.16)
    assert par[0].parents == [0, 1] and par[0].tokens == [1, 5]
    assert par[1].parents == [0, 0] and par[1].tokens == [3, 4]  # head 1 of beam 0 under node "1"
    assert [round(math.exp(x), 4) for x in par[1].logps] == [0.6, 0.4]
    tree, _, _ = build_beam_tree(0, [Level([0, 0], [50, 51], [L(0.5), L(0.25)])] + par, budget=4)
    assert tree.tokens == [0, 50, 1, 51, 3] and tree.parents == [-1, 0, 1, 0, 2]


# ---------------------------------------------------------------------------- training == drafting


def _random_model(target, serial: int, parallel: int, seed: int = 0, vocab: int = 0, width: int = 0,
                  layers: tuple[int, ...] = (1, FINAL)) -> HybridModel:
    torch.manual_seed(seed)
    cfg = HybridConfig.for_target(target.config, serial=serial, parallel=parallel, head_blocks=1,
                                  feature_layers=layers, draft_vocab=vocab, width=width)
    tm = target.model
    ids = torch.randperm(target.config.vocab_size)[:vocab] if vocab else torch.arange(target.config.vocab_size)
    m = HybridModel(cfg, tm.embed.weight, tm.lm_head.weight, ids)
    with torch.no_grad():
        for p in m.parameters():  # sharper than the default init, residual blocks included
            p.normal_(0, 0.3)
    return m.eval()


def check_drafting_equals_training(target, model, d: HybridDrafter, depth: int | None = None) -> None:
    """The drafter's top-1 chain, after a prefill and after a commit of two drafted tokens, against
    the teacher-forced training states (``train.hybrid.draft_states``) at the same anchor."""
    from specdraft.replay import sequence_hidden

    seq = torch.randint(2, 96, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    hid = sequence_hidden(target, seq, d.hidden_layers)
    p = 12

    def check(n: int) -> None:
        """The drafter's top-1 chain at root x_n against teacher-forced training states at anchor n-1."""
        levels = d.levels(64)  # wide enough that no child of an expanded node is pruned
        if depth is not None:
            assert len(levels) == depth
        chain, node = [], 0
        for lv in levels:  # best child of the current node (levels are sorted best first)
            i = next(i for i, par in enumerate(lv.parents) if par == node)
            chain.append((lv.tokens[i], lv.logps[i]))
            node = i
        toks = seq[: n + 1] + [t for t, _ in chain]
        feats = torch.zeros(len(toks), sum(hid[k].shape[-1] for k in d.hidden_layers))
        feats[:n] = torch.cat([hid[k][0, :n] for k in d.hidden_layers], -1)
        batch = H.AnchorBatch(torch.tensor([toks]), torch.tensor([len(toks)]), torch.tensor([0]), feats[None], None,
                        torch.tensor([[n - 1]]), torch.tensor([[True]]))
        with torch.no_grad():
            states = H.draft_states(model, batch)
            if depth is not None:
                assert len(states) == depth
            for k, (h, (tok, lp)) in enumerate(zip(states, chain), 1):
                ref = torch.log_softmax(model.logits(h[0, 0]), -1)
                j = int((model.vocab_ids == tok).nonzero())
                assert abs(float(ref[j]) - lp) < 1e-4, k
                assert int(ref.argmax()) == j  # the chain is the training states' top-1 too

    prefill = ForwardOutput(None, {k: v[:, :p] for k, v in hid.items()})
    d.reset(seq[:p], seq[p], prefill)
    check(p)
    # accept two drafted tokens + bonus: the drafter reads the true features of the accepted nodes only
    path = [0, 3, 5]
    fake = {k: torch.full((1, 7, v.shape[-1]), float("nan")) for k, v in hid.items()}
    for k, v in hid.items():
        fake[k][0, path] = v[0, p : p + 3]
    d.commit(Accepted(path=path, tokens=seq[p + 1 : p + 3], bonus=seq[p + 3]), ForwardOutput(None, fake))
    check(p + 3)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_drafting_steps_equal_the_training_maths(tiny_llama, kind):
    _, target, _ = tiny_llama
    model = _random_model(target, *CONFIGS[kind], vocab=48)
    check_drafting_equals_training(target, model, HybridDrafter(model, HybridOptions(topk=8, beams=8)))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_drafting_on_the_fast_kernel_equals_the_8_bit_network(tiny_llama, kind):
    """On the fast kernel (``prepack(int8=True)``) each serial step is one C++ call per layer and the top-k is
    taken in C++: the same levels as the network's own modules with the same 8-bit projections (to float
    rounding), after a prefill and after a commit; the steps' K/V go through the cache's scratch slots."""
    _, target, _ = tiny_llama
    check_fast_equals_module(target, _random_model(target, *CONFIGS[kind], vocab=48), CONFIGS[kind][0] > 0)


def check_fast_equals_module(target, model, serial: bool, name: str | None = None) -> None:
    """``model`` on the fast kernel against a copy in torch's modules over the same 8-bit projections: the same
    levels (to float rounding) after a prefill and after a commit; ``serial``: whether its steps are fast."""
    import copy

    from specdraft.replay import sequence_hidden

    module = copy.deepcopy(model)
    assert model.prepack(int8=True) and module.prepack(int8=True, fused=False)
    assert model.fast and model.fast_serial == serial and not module.fast_serial
    fast, slow = (HybridDrafter(m, HybridOptions(topk=6, beams=3), name=name) for m in (model, module))
    seq = torch.randint(2, 96, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    hid = sequence_hidden(target, seq, fast.hidden_layers)
    p = 12

    def same() -> None:
        a, b = fast.levels(12), slow.levels(12)
        assert len(a) == len(b)
        for la, lb in zip(a, b):
            assert la.parents == lb.parents and la.tokens == lb.tokens
            assert max(abs(x - y) for x, y in zip(la.logps, lb.logps)) < 1e-4

    for d in (fast, slow):
        d.reset(seq[:p], seq[p], ForwardOutput(None, {k: v[:, :p] for k, v in hid.items()}))
    same()
    path = [0, 2, 4]
    fake = {k: torch.full((1, 6, v.shape[-1]), float("nan")) for k, v in hid.items()}
    for k, v in hid.items():
        fake[k][0, path] = v[0, p : p + 3]
    for d in (fast, slow):
        d.commit(Accepted(path=path, tokens=seq[p + 1 : p + 3], bonus=seq[p + 3]), ForwardOutput(None, fake))
    same()


def test_each_feature_layer_is_normalised_before_fusing(tiny_llama):
    """A middle layer's massive activations (SmolLM2-135M: |x| up to 2.5e4) must not
    swamp the fused feature: scaling one layer's feature leaves the fused state unchanged, while
    changing its direction does change it."""
    _, target, _ = tiny_llama
    model = _random_model(target, 1, 1, vocab=48)
    h = target.config.hidden_size
    f = torch.randn(5, 2 * h, generator=torch.Generator().manual_seed(0))
    scaled = f.clone()
    scaled[:, :h] *= 1000.0
    torch.testing.assert_close(model.feature(scaled), model.feature(f), rtol=1e-4, atol=1e-4)
    other = f.clone()
    other[:, :h] = torch.randn(5, h, generator=torch.Generator().manual_seed(1))
    assert (model.feature(other) - model.feature(f)).abs().max() > 1e-2
    with torch.no_grad():  # the layers' norms taken together are each layer's RMSNorm module
        for nm in model.feat_norms:
            nm.weight.normal_(1.0, 0.5)
        one_by_one = torch.cat([nm(x) for nm, x in zip(model.feat_norms, f.split(h, -1))], -1)
        torch.testing.assert_close(model.feature(f), model.fuse(one_by_one), rtol=1e-6, atol=1e-6)


def test_folding_the_feature_norms_keeps_the_fused_feature(tiny_llama):
    """For inference (``prepack``) each feature layer's norm weight goes into the fusing projection's columns and
    the norms become one op: the same fused feature to float rounding, folded once however often asked."""
    _, target, _ = tiny_llama
    model = _random_model(target, 1, 1, vocab=48, layers=(1, 2, FINAL))
    h = target.config.hidden_size
    f = torch.randn(4, 3 * h, generator=torch.Generator().manual_seed(2)) * torch.tensor([30.0] * h + [1.0] * 2 * h)
    with torch.no_grad():
        for nm in model.feat_norms:
            nm.weight.normal_(1.0, 0.5)
        before = model.feature(f)
        model.fold_feature_norms()
        model.fold_feature_norms()
        assert model._norms_folded and all(bool((nm.weight == 1).all()) for nm in model.feat_norms)
        torch.testing.assert_close(model.feature(f), before, rtol=1e-5, atol=1e-5)
    folded = _random_model(target, 1, 1, vocab=48, layers=(1, 2, FINAL))
    assert folded.prepack() in (True, False) and folded._norms_folded  # whatever the CPU prepacks to


def test_the_fused_feature_in_one_kernel_call_equals_the_modules(tiny_llama):
    """On the fast kernel a commit's features are one call (``fast_norms_linear``: the rows picked from each layer,
    normed, joined and projected): the modules' 8-bit result to float rounding, the same bits on every
    implementation, whatever rows (an int, a list, a slice) the drafter asks for."""
    import copy

    _, target, _ = tiny_llama
    model = _random_model(target, 1, 1, vocab=48, layers=(1, 2, FINAL))
    with torch.no_grad():
        for nm in model.feat_norms:
            nm.weight.normal_(1.0, 0.5)
    module = copy.deepcopy(model)
    assert model.prepack(int8=True) and model.fast_features
    assert module.prepack(int8=True, fused=False) and not module.fast_features
    h = target.config.hidden_size
    gen = torch.Generator().manual_seed(8)
    feats = [torch.randn(7, h, generator=gen) * s for s in (40.0, 3.0, 1.0)]
    rows = [0, 3, 6, 3]
    ref = module.feature(torch.cat(feats, -1)[rows])
    op = torch.ops.specdraft_quant
    outs = []
    for which in range(op.fast_best_isa() + 1):
        op.fast_set_isa(which)
        outs.append(model.features_fast(feats, rows))
        torch.testing.assert_close(outs[-1], ref, rtol=1e-4, atol=1e-4)
    op.fast_set_isa(-1)
    assert all(torch.equal(o, outs[0]) for o in outs)
    d = HybridDrafter(model, HybridOptions())
    hidden = {layer: f[None] for layer, f in zip(model.cfg.feature_layers, feats)}
    out = ForwardOutput(None, hidden)
    assert torch.equal(d._features(out, 3), outs[0][1]) and torch.equal(d._features(out, [6, 3]), outs[0][2:])
    torch.testing.assert_close(d._features(out, slice(0, 7)), module.feature(torch.cat(feats, -1)), rtol=1e-4, atol=1e-4)
    with pytest.raises(IndexError, match="out of range"):
        model.features_fast(feats, [7])


def test_step_masks_are_the_masks_built_directly():
    """The serial steps' masks and positions as template views equal those built from scratch, as the context
    grows past the templates and for more rows than they hold."""
    from specdraft.drafters.hybrid import StepMasks

    masks, cpu = StepMasks(), torch.device("cpu")
    for n, t in ((0, 1), (5, 3), (300, 16), (1500, 2), (4000, 7), (9, 20), (2, 1)):
        chain = torch.ones(1, 1, t, n + t, dtype=torch.bool)
        chain[0, 0, :, n:] = torch.tril(chain[0, 0, :, n:])
        sib = torch.zeros(1, 1, t, n + t, dtype=torch.bool)
        sib[..., :n] = True
        sib[0, 0, :, n:] = torch.eye(t, dtype=torch.bool)
        assert torch.equal(masks.chain(n, t, cpu), chain), (n, t)
        assert torch.equal(masks.siblings(n, t, cpu), sib), (n, t)
        assert torch.equal(masks.positions(n, t, cpu), torch.arange(n, n + t)[None])
    assert masks.k >= 4000


def test_serial_unroll_adds_the_longer_serial_parts_states_only(tiny_llama):
    """Training with --serial-unroll U: the S+M drafter states are unchanged and the extra states are
    exactly those of a U-step serial part with the same weights (EAGLE-style, no heads)."""
    _, target, _ = tiny_llama
    model = _random_model(target, 2, 3, vocab=48)
    longer = _random_model(target, 4, 0, vocab=48)
    longer.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("heads")}, strict=False)
    gen = torch.Generator().manual_seed(5)
    toks = torch.randint(2, 96, (2, 24), generator=gen)
    feats = torch.randn(2, 24, 2 * target.config.hidden_size, generator=gen)
    batch = H.AnchorBatch(toks, torch.tensor([24, 20]), torch.tensor([3, 3]), feats, None,
                    torch.tensor([[4, 9, 12], [5, 6, 10]]), torch.ones(2, 3, dtype=torch.bool))
    with torch.no_grad():
        base = H.draft_states(model, batch)
        unrolled = H.draft_states(model, batch, unroll=4)
        ref = H.draft_states(longer, batch)
    assert len(base) == 5 and len(unrolled) == 7
    for a, b in zip(base, unrolled[:5]):
        assert torch.equal(a, b)
    for a, b in zip(unrolled[5:], ref[2:4]):
        torch.testing.assert_close(a, b)
    with pytest.raises(SpecdraftError, match="serial_unroll"):
        H.HybridTrainConfig(serial=2, serial_unroll=1)


def test_head_grad_scales_only_the_heads_gradient_into_the_serial_part(tiny_llama):
    """--head-grad 0 detaches the serial states the MLP heads read: the heads' loss then leaves the
    serial part without gradient (its own depths still train it), the forward values are unchanged,
    and a share in (0, 1) scales that gradient linearly."""
    _, target, _ = tiny_llama
    model = _random_model(target, 2, 3, vocab=48).train()
    gen = torch.Generator().manual_seed(6)
    toks = torch.randint(2, 96, (2, 24), generator=gen)
    feats = torch.randn(2, 24, 2 * target.config.hidden_size, generator=gen)
    batch = H.AnchorBatch(toks, torch.tensor([24, 20]), torch.tensor([3, 3]), feats, None,
                    torch.tensor([[4, 9, 12], [5, 6, 10]]), torch.ones(2, 3, dtype=torch.bool))
    serial = [p for n, p in model.named_parameters() if not n.startswith("heads")]

    def grads(share: float, depths: slice) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model.zero_grad(set_to_none=False)
        states = H.draft_states(model, batch, head_grad=share)
        sum(h.square().sum() for h in states[depths]).backward()
        return [s.detach().clone() for s in states], [p.grad.clone() for p in serial]

    full_states, full = grads(1.0, slice(2, None))  # the heads' states only
    none_states, none = grads(0.0, slice(2, None))
    half_states, half = grads(0.5, slice(2, None))
    for a, b, c in zip(full_states, none_states, half_states):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert max(float(g.abs().max()) for g in full) > 0
    assert all(float(g.abs().max()) == 0 for g in none)
    for a, b in zip(full, half):
        torch.testing.assert_close(b, 0.5 * a, rtol=1e-4, atol=1e-6)
    _, own = grads(0.0, slice(0, 2))  # the serial depths still train the serial part
    assert max(float(g.abs().max()) for g in own) > 0
    with pytest.raises(SpecdraftError, match="head_grad"):
        H.HybridTrainConfig(head_grad=1.5)


def _loss_setup(tiny_llama, seed: int, vocab: int = 48):
    """A random gumiho-shaped model (S = M = 2) over a ``vocab``-token draft vocabulary, its target-to-draft
    id map, two 24-token sequences of draft tokens with one label outside the vocabulary (position
    15 of row 0: masked out of every loss), and random input features."""
    _, target, _ = tiny_llama
    model = _random_model(target, 2, 2, vocab=vocab).train()
    gen = torch.Generator().manual_seed(seed)
    t2d = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    t2d[model.vocab_ids] = torch.arange(vocab)
    toks = model.vocab_ids[torch.randint(0, vocab, (2, 24), generator=gen)]
    toks[0, 15] = int((t2d < 0).nonzero()[0])
    feats = torch.randn(2, 24, 2 * target.config.hidden_size, generator=gen)
    return target, model, gen, t2d, toks, feats


def test_distill_mixes_the_label_loss_with_the_targets_distribution(tiny_llama):
    """--distill A: share A of each depth's cross-entropy is taken against the target's own
    distribution (its final feature through the drafter's LM-head rows).  With a final feature that
    points hard at each label, A = 1 gives the label loss; the mix is linear in A; a real (soft)
    target distribution gives another loss."""
    target, model, gen, t2d, toks, feats = _loss_setup(tiny_llama, 8)
    # f_p predicts x_{p+1}: a final feature that makes the target's distribution ~one-hot on it
    rows = model.head_w[t2d[toks[:, 1:]].clamp(min=0)]
    sharp = torch.zeros(2, 24, target.config.hidden_size)
    sharp[:, :-1] = 1e3 * rows / rows.norm(dim=-1, keepdim=True)
    anchors = torch.tensor([[4, 9, 12], [5, 6, 10]])

    def loss(distill: float, final: torch.Tensor | None) -> float:
        cfg = H.HybridTrainConfig(serial=2, parallel=2, distill=distill)
        batch = H.AnchorBatch(toks, torch.tensor([24, 20]), torch.tensor([3, 3]), feats, final, anchors,
                        torch.ones(2, 3, dtype=torch.bool))
        with torch.no_grad():
            return float(H.losses(model, batch, t2d, cfg)[0])

    label = loss(0.0, sharp)
    torch.testing.assert_close(loss(1.0, sharp), label, rtol=1e-4, atol=1e-4)
    soft = torch.randn(2, 24, target.config.hidden_size, generator=gen)
    full = loss(1.0, soft)
    assert abs(full - label) > 1e-2
    torch.testing.assert_close(loss(0.25, soft), 0.75 * label + 0.25 * full, rtol=1e-5, atol=1e-5)
    with pytest.raises(SpecdraftError, match="distill"):
        H.HybridTrainConfig(distill=-0.1)


def test_feature_loss_adds_the_depth_weighted_regression_of_the_serial_states(tiny_llama):
    """--feature-loss W (the shipped gumiho: 1): on top of the cross-entropy, W * 0.8^(d-1) *
    SmoothL1(h^d, f_{i+d}) for every serial depth d over its labelled anchors; the parallel heads'
    states are not regressed, and serial states equal to their targets add nothing."""
    import torch.nn.functional as F

    target, model, gen, t2d, toks, feats = _loss_setup(tiny_llama, 9)
    final = torch.randn(2, 24, target.config.hidden_size, generator=gen)
    # anchors whose depth-1 and depth-2 positions never coincide (so every target can be set below)
    batch = H.AnchorBatch(toks, torch.tensor([24, 20]), torch.tensor([3, 3]), feats, final,
                    torch.tensor([[4, 9, 12], [3, 8, 13]]), torch.ones(2, 3, dtype=torch.bool))

    def loss(w: float, b: H.AnchorBatch) -> float:
        with torch.no_grad():
            return float(H.losses(model, b, t2d, H.HybridTrainConfig(serial=2, parallel=2, feature_loss=w))[0])

    with torch.no_grad():
        states = H.draft_states(model, batch)
        want = 0.0
        for d in (1, 2):  # the serial depths only
            lab, ok = H.token_at(batch, 1 + d)
            ok = ok & (t2d[lab] >= 0)
            want += 0.8 ** (d - 1) * float(F.smooth_l1_loss(states[d - 1][ok], H.final_at(batch, d)[ok]))
    base = loss(0.0, batch)
    assert want > 1e-3
    torch.testing.assert_close(loss(1.0, batch) - base, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss(2.5, batch) - base, 2.5 * want, rtol=1e-4, atol=1e-5)
    # final features equal to the serial states they regress onto: no extra loss
    exact = final.clone()
    for d in (1, 2):
        j = (batch.anchors + d).clamp(max=23)
        exact[torch.arange(2)[:, None], j] = states[d - 1]
    hit = H.AnchorBatch(toks, batch.lengths, batch.prompt_len, feats, exact, batch.anchors, batch.anchor_ok)
    torch.testing.assert_close(loss(1.0, hit), loss(0.0, hit), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- lossless decoding


def test_random_drafters_are_lossless_on_real_prompts(tiny_chat_target):
    t = tiny_chat_target
    for kind, (s, m) in CONFIGS.items():
        model = _random_model(t, s, m, vocab=512)
        for p in PROMPTS[:2]:
            ids = t.encode_prompt(p)
            ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=24)).token_ids
            for budget in (1, 4, 9):
                d = HybridDrafter(model, HybridOptions(topk=3, beams=2))
                d.default_budget = budget
                assert generate(t, ids, d, GenerateConfig(max_new_tokens=24)).token_ids == ref, (kind, budget)


def test_fused_drafting_with_8_and_4_bit_weights_is_lossless(tiny_chat_target):
    """On the fast kernel (fused steps, C++ top-k) with Q8_0 and with Q4_0 weights: plain greedy, token for token."""
    t = tiny_chat_target
    ids = t.encode_prompt(PROMPTS[0])
    ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=24)).token_ids
    for kind, (s, m) in CONFIGS.items():
        for blocks in ("Q8_0", "Q4_0"):
            model = _random_model(t, s, m, vocab=512)
            assert model.prepack(int8=True, kind=blocks) and model.fast
            d = HybridDrafter(model, HybridOptions(topk=3, beams=2))
            d.default_budget = 5
            got = generate(t, ids, d, GenerateConfig(max_new_tokens=24))
            assert got.token_ids == ref, (kind, blocks)
            assert got.stats.tree_nodes > 0


def _train(target, root, out, kind="gumiho", epochs=2, **kw):
    s, m = CONFIGS[kind]
    cfg = H.HybridTrainConfig(serial=s, parallel=m, feature_layers=(1, FINAL), draft_vocab=256, epochs=epochs,
                        anchors=16, batch_tokens=256, lr=3e-3, warmup_steps=2, holdout=0.2, **kw)
    return H.train_hybrid(target, root / "data", root / "feat", out, cfg, quiet=True, log=lambda *a: None)


def test_trained_tiny_drafters_are_lossless_and_accept_drafts(tiny_chat_target, tiny_train_data, tmp_path):
    t = tiny_chat_target
    for kind in CONFIGS:
        path = tmp_path / f"{kind}.safetensors"
        m = _train(t, tiny_train_data, path, kind=kind, epochs=6, feature_loss=0.1 if kind != "medusa" else 0.0)
        assert m["kind"] == "hybrid" and m["drafter"] == kind
        assert m["history"][-1]["train_loss"] < m["history"][0]["train_loss"]
        tpp = []
        for p in PROMPTS:
            ids = t.encode_prompt(f"{p} (variant 0)")
            ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=32)).token_ids
            for spec, budget in ((str(path), 1), (f"{path}@topk=2,beams=1,bf16=0", 3), (f"{path}@bf16=1", 8)):
                d = make_drafter(spec, t, budget=budget)
                assert isinstance(d, HybridDrafter) and d.name == kind
                r = generate(t, ids, d, GenerateConfig(max_new_tokens=32))
                assert r.token_ids == ref, (kind, spec, budget)
                tpp.append(r.stats.tokens_per_pass)
        assert max(tpp) > 1.0, kind  # drafts learned from the training responses get accepted
    # `specdraft train profile` works for a hybrid checkpoint too, and the budget then follows the curve
    from specdraft.drafters import budget as cost
    from specdraft.train.profile import add_budget_profile

    from specdraft.nn.checkpoint import load_checkpoint
    from specdraft.replay import simulate_dataset
    from specdraft.train.profile import held_out_sequences

    prof = add_budget_profile(t, path, tiny_train_data / "data", budgets=(1, 2, 4))
    # the stored profile is the replay of the checkpoint's own held-out responses, at each budget
    prompts, outputs = held_out_sequences(tiny_train_data / "data", load_checkpoint(path)[1], 32)
    want = simulate_dataset(t, {"d": make_drafter(str(path), t)}, prompts, outputs, [1, 2, 4])["d"]
    assert prof["tokens_per_pass"] == {str(b): round(v, 4) for b, v in want.items()}
    best = max(prof["tokens_per_pass"].items(), key=lambda kv: (kv[1], int(kv[0])))
    flat = {"n": list(range(1, 10)), "ratio": [1.0] * 9, "ms": [1e30] * 9}
    steep = {"n": list(range(1, 10)), "ratio": [1.0, 1.0] + [50.0] * 7, "ms": [1e30] * 9}
    for curve, want in ((flat, int(best[0])), (steep, 1)):
        cost_curve = curve
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cost, "load_cost_curve", lambda target: cost_curve)
            assert make_drafter(str(path), t).default_budget == want


# ---------------------------------------------------------------------------- checkpoints and training


def test_corrupt_mismatched_and_missing_checkpoints(tiny_chat_target, tiny_llama, tiny_train_data, tmp_path, monkeypatch):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(SpecdraftError, match="corrupt|not a specdraft"):
        make_drafter(str(bad), tiny_chat_target)
    from specdraft.nn.checkpoint import load_draft_model

    with pytest.raises(SpecdraftError, match="corrupt"):
        load_draft_model(tiny_chat_target, bad, "hybrid")
    good = tmp_path / "g.safetensors"
    _train(tiny_chat_target, tiny_train_data, good, kind="medusa", epochs=1)
    with pytest.raises(SpecdraftError, match="trained for target"):
        make_drafter(str(good), tiny_llama[1])
    with pytest.raises(SpecdraftError, match="has no option 'top_n'"):
        make_drafter(f"{good}@top_n=3", tiny_chat_target)
    with pytest.raises(SpecdraftError, match="must be an integer"):
        make_drafter(f"{good}@topk=x", tiny_chat_target)
    with pytest.raises(SpecdraftError, match="0 or 1"):
        make_drafter(f"{good}@bf16=2", tiny_chat_target)
    with pytest.raises(SpecdraftError, match="has no option 'tree'"):
        make_drafter(f"{good}@tree=ddtree", tiny_chat_target)
    from specdraft.drafters import registry

    monkeypatch.setattr(registry, "WEIGHTS_DIR", tmp_path / "none")  # an install without the shipped weights
    for name, args in (("gumiho", "--serial 2 --parallel 5"), ("medusa", "--serial 0 --parallel 7"),
                       ("eagle", "--serial 7 --parallel 0")):
        with pytest.raises(SpecdraftError, match=f"not in this install yet.*specdraft train hybrid {args}"):
            make_drafter(name, tiny_chat_target)


def test_training_resumes_to_the_same_weights(tiny_chat_target, tiny_train_data, tmp_path, monkeypatch):
    from specdraft.nn.checkpoint import load_checkpoint

    ref = tmp_path / "ref.safetensors"
    _train(tiny_chat_target, tiny_train_data, ref, feature_loss=0.1)
    out = tmp_path / "cut.safetensors"
    state = H.state_path(out)
    real = H.losses

    def interrupt_in_epoch_2(*a, **k):  # the resume state is written after epoch 1
        if state.is_file():
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(H, "losses", interrupt_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        _train(tiny_chat_target, tiny_train_data, out, feature_loss=0.1)
    monkeypatch.setattr(H, "losses", real)
    assert not out.exists() and state.is_file()
    m = _train(tiny_chat_target, tiny_train_data, out, feature_loss=0.1)
    a, _ = load_checkpoint(ref)
    b, _ = load_checkpoint(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(m["history"]) == 2 and not state.exists()


def test_fine_tuning_from_a_checkpoint_on_two_data_folders(tiny_chat_target, tiny_train_data, tiny_more_data, tmp_path):
    """--init starts from a trained drafter (its weights and draft vocabulary), several --data folders
    train together, each keeps its own held-out split, and a drafter of another shape is refused."""
    from specdraft.nn.checkpoint import load_checkpoint
    from specdraft.train.corpus import load_corpora
    from specdraft.train.profile import held_out_sequences

    t, more = tiny_chat_target, tiny_more_data
    base = tmp_path / "base.safetensors"
    m0 = _train(t, tiny_train_data, base, epochs=1)
    s, m = CONFIGS["gumiho"]

    def tune(out, lr, init=base, serial=s, parallel=m, seed=0, folders=(tiny_train_data, more)):
        cfg = H.HybridTrainConfig(serial=serial, parallel=parallel, feature_layers=(1, FINAL), draft_vocab=256, epochs=1,
                            anchors=16, batch_tokens=256, lr=lr, warmup_steps=2, holdout=0.2, init=str(init), seed=seed)
        return H.train_hybrid(t, [f / "data" for f in folders], [f / "feat" for f in folders],
                              out, cfg, quiet=True, log=lambda *a: None)

    used = {}
    real_split = H.split_and_vocabulary

    def spy(*a, **k):
        out = real_split(*a, **k)
        used.update(groups=k.get("groups"), val=out[1])
        return out

    frozen = tmp_path / "frozen.safetensors"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(H, "split_and_vocabulary", spy)
        mf = tune(frozen, lr=0.0)  # no step moves a weight: the result is the checkpoint it started from
    a, _ = load_checkpoint(base)
    b, _ = load_checkpoint(frozen)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    n1 = m0["data"]["sequences"]
    assert mf["data"]["sequences"] == n1 and mf["data"]["manifest_sha256"] == m0["data"]["manifest_sha256"]
    assert [d["sequences"] for d in mf["data_more"]] == [5] and mf["init"]["history"] == m0["history"]
    # the first folder's held-out split is the one it had alone, so its budget profile replays the same sequences
    assert held_out_sequences(tiny_train_data / "data", mf, 8) == held_out_sequences(tiny_train_data / "data", m0, 8)
    corpus, _, groups = load_corpora([(tiny_train_data / "data", tiny_train_data / "feat"), (more / "data", more / "feat")],
                                       (1, FINAL), need_final=False)
    assert groups == [n1, 5] and len(corpus.tokens) == n1 + 5
    tr, va, *_ = H.split_and_vocabulary(corpus, 0, 0.2, 256, t, groups=groups)
    tr1, va1 = C.held_out_split(n1, 0, 0.2)
    tr2, va2 = C.held_out_split(5, 0, 0.2)
    assert va == va1 + [n1 + i for i in va2] and tr == tr1 + [n1 + i for i in tr2]
    assert used["groups"] == [n1, 5] and used["val"] == va  # the trainer split each folder on its own
    moved = tmp_path / "moved.safetensors"
    mm = tune(moved, lr=3e-3)  # it trains from there
    c, _ = load_checkpoint(moved)
    assert torch.equal(a["vocab_ids"], c["vocab_ids"]) and any(not torch.equal(a[k], c[k]) for k in a if k != "vocab_ids")
    # a fine-tune of the fine-tune keeps the whole history: the earlier extra folder and the first start
    again = tune(tmp_path / "again.safetensors", lr=0.0, init=moved)
    assert again["init"]["data_more"] == mm["data_more"] and again["init"]["init"]["history"] == m0["history"]
    assert "init" not in mm["init"] and "data_more" not in mm["init"]  # base itself was neither
    with pytest.raises(SpecdraftError, match="another shape: parallel 2 .this run: 0.*serial 2 .this run: 3"):
        tune(tmp_path / "eagle.safetensors", lr=3e-3, serial=3, parallel=0)
    with pytest.raises(SpecdraftError, match="held-out sequences would include ones the checkpoint trained on"):
        tune(tmp_path / "seed1.safetensors", lr=0.0, seed=1)  # another split of the folder base trained on
    with pytest.raises(SpecdraftError, match="prompts occur in more than one --data folder"):
        tune(tmp_path / "twice.safetensors", lr=0.0, folders=(tiny_train_data, tiny_train_data))
    with pytest.raises(SpecdraftError, match="--init and --out are the same file"):
        tune(base, lr=0.0)
    with pytest.raises(SpecdraftError, match="one feature folder per data folder"):
        H.train_hybrid(t, [tiny_train_data / "data", more / "data"], [tiny_train_data / "feat"], tmp_path / "x.safetensors",
                       H.HybridTrainConfig(serial=s, parallel=m, feature_layers=(1, FINAL)), quiet=True, log=lambda *a: None)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_scored_trees_cut_and_paused_drafting_stay_exact(tiny_llama, monkeypatch, kind):
    """A hybrid's tree carries each node's path probability (its product of draft probabilities, through the
    calibration); the live policy cuts it and pauses drafting, the serial layers catching up on the missed
    passes in one step: plain greedy's output all the same."""
    import importlib
    import random

    from specdraft.drafters.budget import LiveCosts
    from specdraft.drafters.calibration import Calibration

    gen_module = importlib.import_module("specdraft.generate")
    _, target, _ = tiny_llama
    model = _random_model(target, *CONFIGS[kind], vocab=48)
    d = HybridDrafter(model, HybridOptions(topk=4, beams=4))
    d.calibration = Calibration()
    d.reset([3, 4, 5], 6, target.prefill([3, 4, 5], 40, hidden_layers=d.hidden_layers))
    tree = d.propose(6)
    assert tree.probs and all(0.0 <= p <= 1.0 for p in tree.probs)
    assert all(tree.probs[i] <= tree.probs[tree.parents[i]] for i in range(1, len(tree)))
    d.floor = 0.999  # no path can pay: the serial steps stop after the first depth (Medusa has none)
    assert max(d.propose(6).depths) <= (1 if CONFIGS[kind][0] > 0 else len(tree))
    d.floor = 0.0
    assert d.propose(6).tokens == tree.tokens
    costs = LiveCosts({"n": list(range(1, 17)), "ms": [1.0 + 0.05 * n for n in range(1, 17)]})
    rng = random.Random(0)
    monkeypatch.setattr(gen_module, "live_costs", lambda t: costs)
    monkeypatch.setattr(costs, "drafting_pays", lambda name: rng.random() < 0.5)
    cfg = GenerateConfig(max_new_tokens=30, budget=6)
    ref = generate(target, [7, 8, 9, 10], None, cfg)
    assert generate(target, [7, 8, 9, 10], d, cfg).token_ids == ref.token_ids


# ---------------------------------------------------------------------------- narrow drafters


def test_narrow_layer_shape():
    from specdraft.nn.layers import TargetShape

    smol = TargetShape(hidden_size=576, vocab_size=49152, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
    n = smol.narrow(256)
    assert (n.hidden_size, n.num_heads, n.num_kv_heads, n.head_dim, n.intermediate_size) == (256, 4, 1, 64, 672)
    assert smol.narrow(0) is smol and smol.narrow(576) is smol
    n = smol.narrow(384)  # 6 heads: 2 key/value heads keep the target's group of 3
    assert (n.num_heads, n.num_kv_heads, n.intermediate_size) == (6, 2, 1024)
    for bad in (100, 32, 96):  # not a multiple of the head size 64 (or of 32)
        with pytest.raises(SpecdraftError, match="multiple of the head size"):
            smol.narrow(bad)
    for bad in (-64, 640, 100):  # negative, wider than the target, not a multiple
        with pytest.raises(SpecdraftError):
            HybridConfig(**{**smol.__dict__, "width": bad})
    cfg = HybridConfig.from_json({**smol.__dict__, "width": 256})
    assert cfg.width == 256


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_narrow_drafting_equals_the_training_maths(tiny_llama, kind):
    """A network of half the target's width (its layers, heads and states 32 wide, read out through the lift):
    the drafter's steps are the training maths, with the lift folded into the head rows or not."""
    _, target, _ = tiny_llama
    for layers in ((1, FINAL), (FINAL,)):  # several feature layers fused into W, or one projected into W
        model = _random_model(target, *CONFIGS[kind], vocab=48, width=32, layers=layers)
        assert model.layer_cfg.hidden_size == 32 and model.lift.weight.shape == (64, 32)
        check_drafting_equals_training(target, model, HybridDrafter(model, HybridOptions(topk=8, beams=8)))
        folded = _random_model(target, *CONFIGS[kind], vocab=48, width=32, layers=layers)
        h = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
        want = folded.logits(h)
        folded.fold_lift()
        assert folded.lift is None and folded.head_w.shape == (48, 32)
        torch.testing.assert_close(folded.logits(h), want, rtol=1e-5, atol=1e-5)
        with pytest.raises(SpecdraftError, match="no teacher scores"):
            folded.teacher_logits(torch.randn(2, 64))
        # the drafter on the folded copy (the same seed: the same weights) against the unfolded network's maths
        check_drafting_equals_training(target, model, HybridDrafter(folded, HybridOptions(topk=8, beams=8)))


def test_narrow_drafters_on_the_fast_kernel_are_lossless(tiny_chat_target):
    """Narrow networks, folded and on the fast kernel (fused steps at width 32, Q8_0 and Q4_0) or in torch's
    modules: plain greedy, token for token."""
    t = tiny_chat_target
    ids = t.encode_prompt(PROMPTS[0])
    ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=24)).token_ids
    for kind, (s, m) in CONFIGS.items():
        for blocks in ("Q8_0", "Q4_0", None):
            model = _random_model(t, s, m, vocab=512, width=32)
            if blocks:
                assert model.prepack(int8=True, kind=blocks) and model.fast and model.lift is None
                assert model.fast_serial == (s > 0)
            d = HybridDrafter(model, HybridOptions(topk=3, beams=2))
            d.default_budget = 5
            got = generate(t, ids, d, GenerateConfig(max_new_tokens=24))
            assert got.token_ids == ref, (kind, blocks)
            assert got.stats.tree_nodes > 0


def test_a_trained_narrow_drafter_loads_and_stays_exact(tiny_chat_target, tiny_train_data, tmp_path):
    t = tiny_chat_target
    path = tmp_path / "narrow.safetensors"
    m = _train(t, tiny_train_data, path, epochs=3, feature_loss=0.1, width=32)
    assert m["config"]["width"] == 32 and m["history"][-1]["train_loss"] < m["history"][0]["train_loss"]
    wide = _train(t, tiny_train_data, tmp_path / "wide.safetensors", epochs=1)
    assert m["params"] < wide["params"]
    for spec in (str(path), f"{path}@int8=1", f"{path}@bf16=1"):
        d = make_drafter(spec, t, budget=4)
        assert isinstance(d, HybridDrafter) and d.model.layer_cfg.hidden_size == 32
        for p in PROMPTS[:2]:
            ids = t.encode_prompt(p)
            ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=24)).token_ids
            assert generate(t, ids, d, GenerateConfig(max_new_tokens=24)).token_ids == ref, spec
    with pytest.raises(SpecdraftError, match="width"):
        H.HybridTrainConfig(arch="eagle3", serial=2, parallel=0, width=32)
