"""Block drafter (DFlash) and Multi-Future Drafting (MFD): the many-blocks training pass equals
per-block drafting, losslessness with every tree shape, marginals, checkpoint errors and
resumable training."""

from __future__ import annotations

import pytest
import torch

from specdraft.drafters import make_drafter
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.block import TREES, BlockDrafter, BlockOptions
from specdraft.nn.block import BlockConfig, BlockModel
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate
from specdraft.model.llama import FINAL, ForwardOutput
from specdraft.train import block as TB
from specdraft.train.corpus import AnchorBatch as Batch

PROMPTS = ["What is 17 * 23? Think step by step.", "Write a Python function that reverses a string.",
           "Tell me about the United States of America."]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run faster on one thread (no hand-offs between threads on a busy 2-core CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


DFLASH = dict(qk_norm=True, mask_token=5)  # DFlash's shape: q/k norm, the target's embedding of token 5 as the mask
NARROW = dict(width=32)  # the network at width 32 (two of the tiny target's 16-wide heads), read out through a lift


def _random_model(target, modes: int, block: int = 5, layers: int = 2, vocab: int = 0, seed: int = 0,
                  gate: bool = False, **shape) -> BlockModel:
    torch.manual_seed(seed)
    cfg = BlockConfig.for_target(target.config, layers=layers, block_size=block, feature_layers=(1, FINAL),
                                 modes=modes, draft_vocab=vocab, gate=gate, **shape)
    tm = target.model
    ids = torch.randperm(target.config.vocab_size)[:vocab] if vocab else torch.arange(target.config.vocab_size)
    m = BlockModel(cfg, tm.embed.weight, tm.lm_head.weight, ids)
    with torch.no_grad():
        for p in m.parameters():  # sharper than the default init
            p.normal_(0, 0.3)
    return m.eval()


# ---------------------------------------------------------------------------- training == drafting


@pytest.mark.parametrize("modes,shape", [(1, {}), (3, {}), (1, DFLASH), (3, NARROW)])
def test_block_mask_pass_equals_per_block_drafting(tiny_llama, modes, shape):
    from specdraft.replay import sequence_hidden

    _, target, _ = tiny_llama
    model = _random_model(target, modes, vocab=0, gate=True, **shape)
    assert model.cfg.gate == (modes > 1)
    d = BlockDrafter(model)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(2, 96, (n,), generator=gen).tolist() for n in (30, 22)]
    width = max(map(len, seqs))
    hid = [sequence_hidden(target, s, d.hidden_layers) for s in seqs]
    feats = torch.zeros(2, width, 2 * target.config.hidden_size)
    tokens = torch.zeros(2, width, dtype=torch.long)
    for b, (s, h) in enumerate(zip(seqs, hid)):
        feats[b, : len(s)] = torch.cat([h[k][0] for k in d.hidden_layers], -1)
        tokens[b, : len(s)] = torch.tensor(s)
    roots = [[1, 7, 12, 27, 29], [3, 9, 20, 0, 0]]  # root positions a; the second row padded
    ok = torch.tensor([[True] * 5, [True, True, True, False, False]])
    batch = Batch(tokens, torch.tensor([len(s) for s in seqs]), torch.tensor([0, 0]), feats, None,
                  torch.tensor(roots) - 1, ok)
    t2d = torch.arange(96)  # draft vocabulary = the target's
    with torch.no_grad():
        states = TB.block_states(model, batch)  # [2, 5, K, B, H]
        logits = model.logits(states[..., 1:, :])
        gate = model.mode_logp(states[..., 0, :])  # [2, 5, K]
        out = TB.forward_blocks(model, batch, t2d)
    # the loss keeps the 7 real blocks with a label (a root at the last position has none)
    assert out.logits.shape == (7, modes, 4, 96) and out.ok.shape == (7, 4)
    for b in range(2):
        for i, a in enumerate(roots[b]):
            if not ok[b, i]:
                continue
            d.reset(seqs[b][:a], seqs[b][a], ForwardOutput(None, {k: v[:, :a] for k, v in hid[b].items()}))
            ref = d.block_logp()  # [K, D, V']: this block alone, context strictly before a
            got = torch.log_softmax(logits[b, i], -1)
            assert torch.allclose(got, ref, atol=1e-5), (modes, b, a, float((got - ref).abs().max()))
            assert torch.allclose(gate[b, i], d.mode_prior(), atol=1e-5)  # the gate too
            assert abs(float(d.mode_prior().exp().sum()) - 1) < 1e-5


@pytest.mark.parametrize("modes,shape", [(1, {}), (3, {}), (1, DFLASH), (3, NARROW)])
def test_drafting_on_the_fast_kernel_equals_the_8_bit_network(tiny_llama, modes, shape):
    """On the fast kernel (``prepack(int8=True)``) each drafter layer is one C++ call (q/k norm included),
    the last computing only the rows the tree reads, and the top-k is taken in C++: the same numbers as the
    network's own modules with the same 8-bit projections (to float rounding), at every depth."""
    import copy

    from specdraft.replay import sequence_hidden

    _, target, _ = tiny_llama
    model = _random_model(target, modes, vocab=40, gate=True, **shape)
    module = copy.deepcopy(model)
    assert model.prepack(int8=True) and module.prepack(int8=True, fused=False)
    assert model.fast and all(layer.fast for layer in model.layers) and not module.fast
    fast, slow = BlockDrafter(model), BlockDrafter(module)
    seq = torch.randint(2, 96, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    hid = sequence_hidden(target, seq, fast.hidden_layers)
    for n in (20, 27):
        for depth in (4, 1, 2):
            for d in (fast, slow):
                d.reset(seq[:n], seq[n], ForwardOutput(None, {k: v[:, :n] for k, v in hid.items()}))
            torch.testing.assert_close(fast.block_logp(depth), slow.block_logp(depth), atol=1e-4, rtol=0)
            torch.testing.assert_close(fast.mode_prior(), slow.mode_prior(), atol=1e-5, rtol=0)
            (ta, la), (tb, lb) = fast.marginals(5, depth), slow.marginals(5, depth)
            assert torch.equal(ta, tb) and la.shape == (modes, depth, 5)
            torch.testing.assert_close(la, lb, atol=1e-4, rtol=0)
            assert fast.propose(depth).tokens == slow.propose(depth).tokens


def test_dflash_shape(tiny_llama):
    """DFlash's shape: q/k norms in every layer, the mask rows are the target's frozen embedding of
    the mask token (no learned mask or mode embeddings), one mode; anything else is refused."""
    _, target, _ = tiny_llama
    m = _random_model(target, 1, **DFLASH)
    names = {n for n, _ in m.named_parameters()}
    assert m.cfg.dflash and "mask_emb" not in names and "mode_emb" not in names
    assert {"layers.0.q_norm.weight", "layers.0.k_norm.weight"} <= names
    x = m.block_inputs(torch.tensor([7]))  # [1, 1, B, H]
    assert torch.equal(x[0, 0, 0], m.embed[7]) and all(torch.equal(r, m.embed[5]) for r in x[0, 0, 1:])
    plain = _random_model(target, 1)
    assert not plain.cfg.dflash and not any("q_norm" in n for n, _ in plain.named_parameters())
    assert not _random_model(target, 1, qk_norm=True).cfg.dflash  # a learned mask is not DFlash's
    with pytest.raises(SpecdraftError, match="needs a single mode"):
        _random_model(target, 2, **DFLASH)
    with pytest.raises(SpecdraftError, match="must be a target token id"):
        _random_model(target, 1, qk_norm=True, mask_token=target.config.vocab_size)
    with pytest.raises(SpecdraftError, match="target's width"):
        _random_model(target, 1, **DFLASH, **NARROW)


def test_narrow_shape(tiny_llama):
    """A narrow block drafter: context, block rows, layers and gate at width W, e(root) projected to it, the
    scores lifted into the frozen head rows (folded into them for inference); widths the layers cannot take
    are refused."""
    _, target, _ = tiny_llama
    h = target.config.hidden_size
    m = _random_model(target, 3, gate=True, vocab=40, **NARROW)
    assert m.layer_cfg.hidden_size == 32 and m.fuse.weight.shape == (32, 2 * h) and m.inp.weight.shape == (32, h)
    assert m.mask_emb.shape == (32,) and m.mode_emb.shape == (3, 32) and m.lift.weight.shape == (h, 32)
    x = m.block_inputs(torch.tensor([7]))  # [1, K, B, W]
    assert x.shape == (1, 3, 5, 32)
    torch.testing.assert_close(x[0, :, 0], m.inp(m.embed[7]) + m.mode_emb)
    assert _random_model(target, 1, width=h).inp is None  # W = H: the target-shaped network
    for bad in (20, 48 + h):
        with pytest.raises(SpecdraftError, match="width"):
            _random_model(target, 1, width=bad)


def test_commit_extends_the_context_with_accepted_features(tiny_llama):
    """After committing an accepted path, the drafter equals one reset on the longer prefix."""
    from specdraft.replay import sequence_hidden
    from specdraft.verify import Accepted

    _, target, _ = tiny_llama
    model = _random_model(target, 2, vocab=0)
    seq = torch.randint(2, 96, (26,), generator=torch.Generator().manual_seed(1)).tolist()
    hid = sequence_hidden(target, seq, (1, FINAL))
    p = 10
    a = BlockDrafter(model)
    a.reset(seq[:p], seq[p], ForwardOutput(None, {k: v[:, :p] for k, v in hid.items()}))
    path = [0, 2, 5]  # root + two accepted nodes at tree slots 2 and 5; NaN elsewhere
    fake = {k: torch.full((1, 7, v.shape[-1]), float("nan")) for k, v in hid.items()}
    for k, v in hid.items():
        fake[k][0, path] = v[0, p : p + 3]
    a.commit(Accepted(path=path, tokens=seq[p + 1 : p + 3], bonus=seq[p + 3]), ForwardOutput(None, fake))
    b = BlockDrafter(model)
    b.reset(seq[: p + 3], seq[p + 3], ForwardOutput(None, {k: v[:, : p + 3] for k, v in hid.items()}))
    assert torch.allclose(a.block_logp(), b.block_logp(), atol=1e-5)


def test_marginals_shapes_and_sorting(tiny_llama):
    _, target, _ = tiny_llama
    model = _random_model(target, 3, block=6, vocab=40)
    d = BlockDrafter(model)
    seq = torch.randint(2, 96, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    from specdraft.replay import sequence_hidden

    hid = sequence_hidden(target, seq, d.hidden_layers)
    d.reset(seq[:11], seq[11], ForwardOutput(None, hid))
    tokens, logp = d.marginals(7)
    assert tokens.shape == logp.shape == (3, 5, 7)
    assert tokens.dtype == torch.long and logp.dtype == torch.float32
    assert bool((logp[..., :-1] >= logp[..., 1:]).all()) and bool((logp <= 0).all())
    assert set(tokens.flatten().tolist()) <= set(model.vocab_ids.tolist())
    full = d.block_logp()
    assert torch.allclose(logp[..., 0], full.max(-1).values)
    assert torch.allclose(full.exp().sum(-1), torch.ones(3, 5), atol=1e-5)
    assert d.marginals(100)[0].shape == (3, 5, 40)  # capped at the draft vocabulary
    # the first positions only (what a small tree needs): the same numbers as the full block's
    d.reset(seq[:11], seq[11], ForwardOutput(None, hid))
    short = d.block_logp(2)
    assert short.shape == (3, 2, 40)
    torch.testing.assert_close(short, full[:, :2])
    assert d.block_logp().shape == (3, 5, 40) and d.marginals(3, depth=4)[0].shape == (3, 4, 3)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no native bfloat16")
def test_prepacked_bf16_drafter_drafts_the_same(tiny_llama):
    """bfloat16 drafting with weights oneDNN packed once gives the unpacked bfloat16 numbers."""
    _, target, _ = tiny_llama
    model = _random_model(target, 3, block=6, vocab=40, gate=True).to(torch.bfloat16)
    seq = torch.randint(2, 96, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    from specdraft.replay import sequence_hidden

    hid = sequence_hidden(target, seq, (1, FINAL))
    outs = []
    for pack in (False, True):
        if pack:
            assert model.prepack() and model._head is not None
            assert not any(type(m) is torch.nn.Linear for m in model.modules())
        d = BlockDrafter(model)
        d.reset(seq[:11], seq[11], ForwardOutput(None, hid))
        outs.append((d.block_logp(), d.mode_prior(), [c[0][:, :, : d.n].clone() for c in d.cache.kv]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-2, atol=1e-2)
    for a, b in zip(outs[0][2], outs[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------- lossless decoding


@pytest.mark.parametrize("modes,gate,shape", [(1, False, {}), (3, False, {}), (3, True, {}), (1, False, DFLASH),
                                              (3, True, NARROW)])
def test_random_drafters_are_lossless_with_every_tree(tiny_chat_target, modes, gate, shape):
    import copy

    t = tiny_chat_target
    model = _random_model(t, modes, block=6, vocab=512, gate=gate, **shape)
    fused = copy.deepcopy(model)
    assert fused.prepack(int8=True) and fused.fast  # the fast kernel's drafting path too
    for p in PROMPTS[:2]:
        ids = t.encode_prompt(p)
        ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=20)).token_ids
        for tree in TREES:
            for budget in (1, 4, 20):
                for m in (model, fused):
                    d = BlockDrafter(m, BlockOptions(tree=tree, topk=4))
                    d.default_budget = budget
                    got = generate(t, ids, d, GenerateConfig(max_new_tokens=20)).token_ids
                    assert got == ref, (modes, tree, budget, m.fast)


def _train(target, root, out, modes=1, log=lambda *a: None, **kw):
    base = dict(modes=modes, draft_layers=1, block_size=5, feature_layers=(1, FINAL), draft_vocab=256, epochs=6,
                anchors=8, batch_tokens=256, lr=3e-3, holdout=0.2)
    cfg = TB.BlockTrainConfig(**{**base, **kw})
    return TB.train_block(target, root / "data", root / "feat", out, cfg, quiet=True, log=log)


@pytest.fixture(scope="module")
def trained(tiny_chat_target, tiny_train_data, tmp_path_factory):
    """Tiny drafters trained briefly, K = 1 and K = 3, with the same steps."""
    root = tmp_path_factory.mktemp("block_ckpt")
    return {k: (root / f"k{k}.safetensors", _train(tiny_chat_target, tiny_train_data, root / f"k{k}.safetensors", modes=k))
            for k in (1, 3)}


def test_trained_tiny_drafters_are_lossless_and_accept_drafts(tiny_chat_target, trained):
    t = tiny_chat_target
    assert trained[1][1]["steps"] == trained[3][1]["steps"]
    for modes, (path, m) in trained.items():
        assert m["kind"] == "block" and m["drafter"] == ("mfd" if modes > 1 else "block")
        assert m["config"]["modes"] == modes and m["history"][-1]["train_loss"] < m["history"][0]["train_loss"]
        assert abs(sum(m["history"][-1]["win_share"]) - 1) < 1e-6
        assert m["config"]["gate"] == (modes > 1)  # K > 1 trains a mode gate by default
        assert 0.0 <= m["history"][-1]["val"]["gate_accuracy"] <= 1.0
        tpp = []
        for p in PROMPTS:
            ids = t.encode_prompt(f"{p} (variant 0)")
            ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=32)).token_ids
            for spec, budget in ((str(path), 1), (f"{path}@tree=linear,bf16=0", 6), (f"{path}@tree=ddtree,topk=3", 8),
                                 (f"{path}@tree=mixture,bf16=1", 20)):
                d = make_drafter(spec, t, budget=budget)
                assert isinstance(d, BlockDrafter) and d.name == ("mfd" if modes > 1 else "block")
                r = generate(t, ids, d, GenerateConfig(max_new_tokens=32))
                assert r.token_ids == ref, (modes, spec, budget)
                tpp.append(r.stats.tokens_per_pass)
        assert max(tpp) > 1.0, modes  # drafts learned from the training responses get accepted
    d = make_drafter(str(trained[3][0]), t)
    assert d.tree == "mixture" and make_drafter(str(trained[1][0]), t).tree == "ddtree"


def test_trained_tiny_dflash_drafter_is_lossless_and_accepts_drafts(tiny_chat_target, tiny_train_data, tmp_path):
    """A drafter trained in DFlash's shape (``train block --dflash``) saves q/k norms and no mask or
    mode embeddings, loads by checkpoint path in every precision and decodes losslessly."""
    from safetensors import safe_open

    t = tiny_chat_target
    path = tmp_path / "dflash.safetensors"
    m = _train(t, tiny_train_data, path, qk_norm=True, mask_token=0, draft_vocab=0, draft_rows=64)
    assert m["config"]["qk_norm"] and m["config"]["mask_token"] == 0 and m["draft_rows"] == 64
    assert make_drafter(str(path), t).model.head_w.shape[0] == 64  # --draft-rows: the full head kept, 64 rows drafted
    assert m["history"][-1]["train_loss"] < m["history"][0]["train_loss"]
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert any(k.endswith("q_norm.weight") for k in keys) and not any("mask_emb" in k or "mode_emb" in k for k in keys)
    tpp = []
    for p in PROMPTS:
        ids = t.encode_prompt(f"{p} (variant 0)")
        ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=32)).token_ids
        for spec, budget in ((f"{path}@tree=linear,bf16=0,vocab=0", 4), (f"{path}@bf16=1", 8), (f"{path}@int8=1", 8)):
            d = make_drafter(spec, t, budget=budget)
            assert isinstance(d, BlockDrafter) and d.model.cfg.dflash
            r = generate(t, ids, d, GenerateConfig(max_new_tokens=32))
            assert r.token_ids == ref, spec
            tpp.append(r.stats.tokens_per_pass)
    assert max(tpp) > 1.0


def test_full_vocabulary_is_ranked_like_a_draft_vocabulary():
    """``--draft-vocab 0`` keeps every token but ranks them as a draft vocabulary is ranked (the end-of-turn ids,
    then by count in the responses, then in the prompts, then by id), so a drafter can draft from its first rows."""
    from specdraft.train.corpus import Corpus, draft_vocabulary

    corpus = Corpus(tokens=[[7, 7, 3, 3, 3, 5], [6, 5, 3, 9, 9]], prompt_len=[2, 1], offsets=[0, 6], feats=None, final=None)
    # responses: 3 four times, 5 and 9 twice (ties by id); prompts alone: 7 twice, 6 once
    ranked = draft_vocabulary(corpus, [0, 1], 0, 12, always={1}).tolist()
    assert ranked[:6] == [1, 3, 5, 9, 7, 6] and sorted(ranked) == list(range(12))  # unseen ids last, by id
    assert draft_vocabulary(corpus, [0, 1], 3, 12, always={1}).tolist() == ranked[:3]


def test_drafting_from_the_first_rows_of_the_draft_vocabulary(tiny_chat_target, trained, tmp_path):
    """``vocab=N`` drafts from the draft vocabulary's N most frequent tokens (a smaller head each step); a
    checkpoint's ``draft_rows`` sets N by default and ``vocab=0`` reads every row.  Lossless whatever N."""
    from specdraft.nn.checkpoint import load_checkpoint, save_checkpoint

    t = tiny_chat_target
    path = trained[3][0]
    full = make_drafter(f"{path}@int8=1", t)  # its head packed for the fast kernel
    for spec, rows in ((f"{path}@vocab=8", 8), (f"{path}@vocab=8,int8=1", 8), (f"{path}@vocab=8,int8=0,bf16=0", 8),
                       (f"{path}@vocab=100000", 256)):
        d = make_drafter(spec, t)
        assert d.model.head_w.shape[0] == rows and torch.equal(d.model.vocab_ids, full.model.vocab_ids[:rows])
        tokens, _ = d.marginals(4, 2)
        assert set(tokens.flatten().tolist()) <= set(full.model.vocab_ids[:rows].tolist())
    tensors, manifest = load_checkpoint(path)
    cut = tmp_path / "cut.safetensors"
    save_checkpoint(cut, tensors, {**manifest, "draft_rows": 16})
    assert make_drafter(str(cut), t).model.head_w.shape[0] == 16
    assert make_drafter(f"{cut}@vocab=0", t).model.head_w.shape[0] == 256
    for p in PROMPTS:
        ids = t.encode_prompt(f"{p} (variant 0)")
        ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=32)).token_ids
        for spec in (str(cut), f"{cut}@int8=1", f"{path}@vocab=2,tree=ddtree", f"{path}@vocab=1,tree=linear"):
            assert generate(t, ids, make_drafter(spec, t, budget=6), GenerateConfig(max_new_tokens=32)).token_ids == ref, spec
    with pytest.raises(SpecdraftError, match="option vocab must be >= 0"):
        make_drafter(f"{path}@vocab=-2", t)
    save_checkpoint(cut, tensors, {**manifest, "draft_rows": True})
    with pytest.raises(SpecdraftError, match="draft_rows must be an integer"):
        make_drafter(str(cut), t)
    with pytest.raises(SpecdraftError, match="before prepack"):
        full.model.keep_vocab(4)  # its head is packed already


# ---------------------------------------------------------------------------- checkpoints and training


def test_corrupt_mismatched_and_missing_checkpoints(tiny_chat_target, tiny_llama, trained, tmp_path, monkeypatch):
    from specdraft.drafters import registry
    from specdraft.nn.checkpoint import load_draft_model

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(SpecdraftError, match="corrupt|not a specdraft"):
        make_drafter(str(bad), tiny_chat_target)
    with pytest.raises(SpecdraftError, match="corrupt"):
        load_draft_model(tiny_chat_target, bad, "block")
    good = trained[1][0]
    with pytest.raises(SpecdraftError, match="trained for target"):
        make_drafter(str(good), tiny_llama[1])
    with pytest.raises(SpecdraftError, match="has no option 'beams'"):
        make_drafter(f"{good}@beams=3", tiny_chat_target)
    with pytest.raises(SpecdraftError, match="tree must be one of"):
        make_drafter(f"{good}@tree=beam", tiny_chat_target)
    with pytest.raises(SpecdraftError, match="topk must be"):
        make_drafter(f"{good}@topk=0", tiny_chat_target)
    with pytest.raises(SpecdraftError, match="bf16 must be 0 or 1"):
        make_drafter(f"{good}@bf16=2", tiny_chat_target)
    monkeypatch.setattr(registry, "WEIGHTS_DIR", tmp_path / "none")
    for name, k in (("block", 1), ("mfd", 4)):
        with pytest.raises(SpecdraftError, match=f"not in this install yet.*train block --modes {k}"):
            make_drafter(name, tiny_chat_target)


def test_narrow_drafter_trains_on_two_data_folders(tiny_chat_target, tiny_train_data, tiny_more_data, tmp_path):
    """`train block --width W` with several --data folders: each folder keeps its own held-out split (the
    first's is the one a budget profile replays), the manifest names every folder, and the narrow drafter
    loads by path and decodes losslessly, in every precision (fp32 modules, the fast kernel, bfloat16);
    a folder repeated is refused."""
    from specdraft.train.corpus import held_out_split
    from specdraft.train.data import load_sequences
    from specdraft.train.profile import held_out_sequences

    t, more = tiny_chat_target, tiny_more_data
    path = tmp_path / "narrow.safetensors"
    cfg = TB.BlockTrainConfig(modes=2, block_size=5, feature_layers=(1, FINAL), draft_vocab=256, epochs=6, anchors=8,
                              batch_tokens=256, lr=3e-3, holdout=0.2, width=32)
    m = TB.train_block(t, [tiny_train_data / "data", more / "data"], [tiny_train_data / "feat", more / "feat"], path, cfg,
                       quiet=True, log=lambda *a: None)
    assert m["config"]["width"] == 32 and m["history"][-1]["train_loss"] < m["history"][0]["train_loss"]
    assert m["data"]["dir"] == str(tiny_train_data / "data") and [d["sequences"] for d in m["data_more"]] == [5]
    seqs = load_sequences(tiny_train_data / "data")
    own = held_out_split(len(seqs), cfg.seed, cfg.holdout)[1]  # the first folder's split, as if trained alone
    prompts, _ = held_out_sequences(tiny_train_data / "data", m, 32)
    assert prompts == [seqs[i].tokens[: seqs[i].prompt_len] for i in own] and m["train"]["bf16"] in (0, 1)
    for p in PROMPTS:
        ids = t.encode_prompt(f"{p} (variant 0)")
        ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=32)).token_ids
        for spec in (str(path), f"{path}@int8=0,bf16=0", f"{path}@tree=ddtree", f"{path}@int8=1", f"{path}@int8=0,bf16=1"):
            d = make_drafter(spec, t, budget=6)
            assert d.model.layer_cfg.hidden_size == 32
            assert generate(t, ids, d, GenerateConfig(max_new_tokens=32)).token_ids == ref, spec
    with pytest.raises(SpecdraftError, match="more than one --data folder"):
        TB.train_block(t, [more / "data", more / "data"], [more / "feat", more / "feat"], tmp_path / "x.safetensors",
                       cfg, quiet=True, log=lambda *a: None)


def test_bf16_autocast_only_where_native(monkeypatch):
    from specdraft.model.packed import native_bf16

    cpu = torch.device("cpu")
    assert TB.BlockTrainConfig().use_bf16(cpu) == native_bf16(cpu)
    assert TB.BlockTrainConfig(bf16=1).use_bf16(cpu) and not TB.BlockTrainConfig(bf16=0).use_bf16(cpu)
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(including_emulation) or False)
    assert not TB.BlockTrainConfig().use_bf16(torch.device("cuda")) and asked == [False]  # an emulating GPU: float32
    for bad in (dict(bf16=2), dict(width=-32)):
        with pytest.raises(SpecdraftError, match="bf16 must be"):
            TB.BlockTrainConfig(**bad)


def test_training_resumes_to_the_same_weights(tiny_chat_target, tiny_train_data, tmp_path, monkeypatch):
    from specdraft.nn.checkpoint import load_checkpoint

    kw = dict(modes=2, epochs=2, save_every=3)
    ref = tmp_path / "ref.safetensors"
    _train(tiny_chat_target, tiny_train_data, ref, **kw)
    out = tmp_path / "cut.safetensors"
    state = TB.state_path(out)
    real = TB.forward_blocks
    calls = {"n": 0}

    def interrupt(*a, **k):  # after the mid-epoch save at step 3, before step 5's update
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(TB, "forward_blocks", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _train(tiny_chat_target, tiny_train_data, out, **kw)
    monkeypatch.setattr(TB, "forward_blocks", real)
    assert not out.exists() and state.is_file()
    lines: list[str] = []
    m = _train(tiny_chat_target, tiny_train_data, out, log=lines.append, **kw)
    assert any("resuming" in x and "at step 3 " in x for x in lines), lines  # from the mid-run save
    a, _ = load_checkpoint(ref)
    b, _ = load_checkpoint(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(m["history"]) == 2 and not state.exists()


def test_budget_profile_is_stored_and_picks_the_budget(tiny_chat_target, tiny_train_data, trained, tmp_path, monkeypatch):
    """`specdraft train profile`: held-out tokens per pass and drafting time per budget go into the
    manifest; a drafter loaded without a budget then picks it from the machine's cost curve."""
    import shutil

    from specdraft.drafters import budget as cost
    from specdraft.nn.checkpoint import load_checkpoint
    from specdraft.train.profile import add_budget_profile

    path = tmp_path / "k3.safetensors"
    shutil.copy(trained[3][0], path)
    before, _ = load_checkpoint(path)
    prof = add_budget_profile(tiny_chat_target, path, tiny_train_data / "data", budgets=(1, 2, 4, 8))
    tensors, manifest = load_checkpoint(path)
    assert set(tensors) == set(before) and all(torch.equal(tensors[k], before[k]) for k in tensors)  # weights kept
    assert manifest["acceptance_by_budget"] == prof["tokens_per_pass"] and set(prof["draft_ms"]) == {"1", "2", "4", "8"}
    # the stored profile is the replay of the checkpoint's own held-out responses, at each budget
    from specdraft.replay import simulate_dataset
    from specdraft.train.profile import held_out_sequences

    prompts, outputs = held_out_sequences(tiny_train_data / "data", manifest, 32)
    want = simulate_dataset(tiny_chat_target, {"d": make_drafter(str(path), tiny_chat_target)}, prompts, outputs, [1, 2, 4, 8])
    assert prof["sequences"] == len(prompts) >= 1
    assert prof["tokens_per_pass"] == {str(b): round(v, 4) for b, v in want["d"].items()}
    assert all(v > 0 for v in prof["draft_ms"].values())
    # a flat cost curve: the biggest tree with the most tokens per pass wins; a steep one: budget 1
    flat = {"n": list(range(1, 10)), "ratio": [1.0] * 9, "ms": [1e30] * 9}  # drafting time negligible
    monkeypatch.setattr(cost, "load_cost_curve", lambda target: flat)
    best = max(prof["tokens_per_pass"].items(), key=lambda kv: (kv[1], int(kv[0])))
    assert make_drafter(str(path), tiny_chat_target).default_budget == int(best[0])
    steep = {"n": list(range(1, 10)), "ratio": [1.0, 1.0] + [50.0] * 7, "ms": [1e30] * 9}  # only budget 1 is cheap
    monkeypatch.setattr(cost, "load_cost_curve", lambda target: steep)
    assert make_drafter(str(path), tiny_chat_target).default_budget == 1
    import json

    # the same data rebuilt another day (the fast mode is bit-exact): only when and how long differ
    rebuilt = tmp_path / "rebuilt"
    shutil.copytree(tiny_train_data / "data", rebuilt)
    m = json.loads((rebuilt / "manifest.json").read_text())
    m.update(wall_s=m.get("wall_s", 0) + 123.0, created="2027-01-01 00:00:00")
    (rebuilt / "manifest.json").write_text(json.dumps(m))
    assert add_budget_profile(tiny_chat_target, path, rebuilt, budgets=(1, 2))["tokens_per_pass"]
    with pytest.raises(SpecdraftError, match="not the data this drafter was trained on"):
        other = tmp_path / "other"
        shutil.copytree(tiny_train_data / "data", other)
        (other / "manifest.json").write_text((other / "manifest.json").read_text().replace("}", ', "x": 1}', 1))
        add_budget_profile(tiny_chat_target, path, other)
