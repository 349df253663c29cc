"""The EAGLE-3 drafter: drafting equals the training maths (the training-time test), random and
trained drafters are lossless, its checkpoints load by path, and bad configurations are refused.
The network against EAGLE-3's equations: ``test_export_drafter`` (an independent reader of the export)."""

from __future__ import annotations

import pytest
import torch

from specdraft.drafters import make_drafter
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.hybrid import HybridDrafter, HybridOptions
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate
from specdraft.nn.eagle3 import Eagle3Config, Eagle3Model, default_layers
from specdraft.train import hybrid as H

PROMPTS = ["What is 17 * 23? Think step by step.", "Write a Python function that reverses a string.",
           "Tell me about the United States of America."]  # the first training prompts (tests/conftest.py)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_eagle3(target, layers=(0, 1, 2), steps: int = 4, vocab: int = 0, seed: int = 0) -> Eagle3Model:
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(target.config, feature_layers=layers, steps=steps, draft_vocab=vocab)
    tm = target.model
    ids = torch.randperm(target.config.vocab_size)[:vocab] if vocab else torch.arange(target.config.vocab_size)
    m = Eagle3Model(cfg, tm.embed.weight, tm.lm_head.weight, ids)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
            else:
                p.uniform_(0.5, 1.5)
    return m.eval()


def test_config_is_validated():
    shape = dict(hidden_size=8, vocab_size=10, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16)
    with pytest.raises(SpecdraftError, match="exactly 3 target layers"):
        Eagle3Config(**shape, feature_layers=(1, 2))
    with pytest.raises(SpecdraftError, match="exactly 3 target layers"):
        Eagle3Config(**shape, feature_layers=(1, 2, -1))
    with pytest.raises(SpecdraftError, match="steps >= 1"):
        Eagle3Config(**shape, feature_layers=(1, 2, 3), steps=0)
    assert default_layers(30) == (2, 15, 27)
    with pytest.raises(SpecdraftError, match="parallel 0"):
        H.HybridTrainConfig(arch="eagle3", serial=3, parallel=1)


def test_drafting_steps_equal_the_training_maths(tiny_llama):
    from tests.test_hybrid import check_drafting_equals_training

    _, target, _ = tiny_llama
    model = random_eagle3(target, steps=4, vocab=48)
    check_drafting_equals_training(target, model, HybridDrafter(model, HybridOptions(topk=8, beams=8), name="eagle3"),
                                   depth=4)


def test_fast_kernel_steps_equal_the_8_bit_network(tiny_llama):
    """On the fast kernel a step is one C++ call, its attention reading [input_layernorm(e) ; hidden_norm(g)] (2H)
    and its residual g: the same levels as the layer's own modules over the same 8-bit projections (to float
    rounding), after a prefill and after a commit."""
    from tests.test_hybrid import check_fast_equals_module

    _, target, _ = tiny_llama
    check_fast_equals_module(target, random_eagle3(target, steps=4, vocab=48), True, name="eagle3")


def test_attention_rows_given_apart_give_the_ordinary_blocks_bits_on_every_path(tiny_llama):
    """``fast_block``'s ``x_attn`` (EAGLE-3's layer: the rows its attention reads, normed by the caller, the residual x
    kept apart) gives the bits of the ordinary block, output and cache, when those rows are x's own attention norm
    (taken by the kernel's norm: ``fast_head`` without logits), on every implementation; given beside ``s_attn``
    it is refused."""
    from tests.test_hybrid import CONFIGS, _random_model

    _, target, _ = tiny_llama
    model = _random_model(target, *CONFIGS["gumiho"], vocab=48)
    assert model.prepack(int8=True)
    layer = model.layers[0]
    qkv, meta, s_attn, *rest = layer._fast
    op = torch.ops.specdraft_quant
    t, h = 5, layer.wo.out_features
    x = torch.randn(1, t, h, generator=torch.Generator().manual_seed(0))
    rot = model.rot_rows(torch.arange(3, 3 + t)[None])
    mask = torch.ones(1, t, 3 + t, dtype=torch.bool).tril(3)
    tail = (layer.eps, layer.hq, layer.hkv, layer.d, None, -1, None, None, False, 0.0)
    try:
        for which in range(op.fast_best_isa() + 1):
            op.fast_set_isa(which)
            kv_a, kv_b = (torch.randn(2, 1, layer.hkv, 12, layer.d, generator=torch.Generator().manual_seed(1))
                          for _ in "ab")
            want = op.fast_block(x, qkv, meta, s_attn, *rest, rot, mask, kv_a, 3, *tail)
            u = op.fast_head(x, s_attn, layer.eps, qkv, meta, False)[0]
            got = op.fast_block(x, qkv, meta, None, *rest, rot, mask, kv_b, 3, *tail, u)
            assert torch.equal(got, want) and torch.equal(kv_a, kv_b), which
            with pytest.raises(RuntimeError, match="x_attn"):
                op.fast_block(x, qkv, meta, s_attn, *rest, rot, mask, kv_b, 3, *tail, u)
    finally:
        op.fast_set_isa(-1)


def test_a_full_ranked_vocabulary_exports_in_id_order(tiny_llama):
    """A full draft vocabulary is stored ranked (most frequent first); the export writes its head rows in id order
    with d2t all 0, the same network (an engine may skip the map when the draft vocabulary is the target's)."""
    from specdraft.export.drafter import eagle3_tensors

    _, target, _ = tiny_llama
    v = target.config.vocab_size
    torch.manual_seed(0)
    ranked = torch.randperm(v)
    cfg = Eagle3Config.for_target(target.config, feature_layers=(0, 1, 2), steps=2, draft_vocab=0)
    model = Eagle3Model(cfg, target.model.embed.weight, target.model.lm_head.weight, ranked)
    out = eagle3_tensors(model)
    assert torch.equal(out["d2t"], torch.zeros(v, dtype=out["d2t"].dtype)) and bool(out["t2d"].all())
    assert torch.equal(out["lm_head.weight"][ranked], model.head_w.detach().cpu())


def test_random_eagle3_is_lossless_on_real_prompts(tiny_chat_target):
    t = tiny_chat_target
    model = random_eagle3(t, steps=5, vocab=512)
    for p in PROMPTS[:2]:
        ids = t.encode_prompt(p)
        ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=24)).token_ids
        for budget in (1, 4, 9):
            d = HybridDrafter(model, HybridOptions(topk=3, beams=2), name="eagle3")
            d.default_budget = budget
            assert generate(t, ids, d, GenerateConfig(max_new_tokens=24)).token_ids == ref, budget


def train_tiny(target, root, out, epochs=8, **kw):
    cfg = H.HybridTrainConfig(arch="eagle3", serial=4, parallel=0, feature_layers=(0, 1, 2), draft_vocab=256,
                              epochs=epochs, anchors=0, batch_tokens=256, lr=3e-3, warmup_steps=2, holdout=0.2,
                              distill=1.0, **kw)
    return H.train_hybrid(target, root / "data", root / "feat", out, cfg, quiet=True, log=lambda *a: None)


def test_trained_tiny_eagle3_is_lossless_and_accepts_drafts(tiny_chat_target, tiny_train_data, tmp_path):
    t = tiny_chat_target
    path = tmp_path / "e3.safetensors"
    m = train_tiny(t, tiny_train_data, path)
    assert m["kind"] == "eagle3" and m["drafter"] == "eagle3" and list(m["config"]["feature_layers"]) == [0, 1, 2]
    assert m["history"][-1]["train_loss"] < m["history"][0]["train_loss"]
    tpp = []
    for p in PROMPTS:
        ids = t.encode_prompt(f"{p} (variant 0)")
        ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=32)).token_ids
        for spec, budget in ((str(path), 1), (f"{path}@topk=1,beams=1", 4), (f"{path}@bf16=1", 8), (f"{path}@vocab=16", 4)):
            d = make_drafter(spec, t, budget=budget)
            assert isinstance(d, HybridDrafter) and d.name == "eagle3"
            r = generate(t, ids, d, GenerateConfig(max_new_tokens=32))
            assert r.token_ids == ref, (spec, budget)
            tpp.append(r.stats.tokens_per_pass)
    assert max(tpp) > 1.0  # drafts learned from the training responses get accepted
    # the trained lm_head is saved and loaded (it moved away from the target's rows)
    from specdraft.nn.checkpoint import load_checkpoint

    tensors, _ = load_checkpoint(path)
    start = t.model.lm_head.weight[tensors["vocab_ids"].long()]
    assert "head_w" in tensors and not torch.allclose(tensors["head_w"].float(), start, atol=1e-3)
    # a hybrid checkpoint is not an eagle3 one
    with pytest.raises(SpecdraftError, match="not 'hybrid'"):
        from specdraft.nn.checkpoint import load_draft_model

        load_draft_model(t, path, "hybrid")
