"""Phrase drafter: vocabulary mining and expansion on real tokenizer text, labels on hand-written
cases, training (resumable) on a tiny model, losslessness on real prompts, checkpoint errors."""

from __future__ import annotations

import pytest
import torch

from specdraft.drafters import make_drafter
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.phrase import PhraseDrafter
from specdraft.nn import phrase as NP
from specdraft.nn.checkpoint import load_draft_model
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate
from specdraft.train import phrase as P
from specdraft.train.data import Sequence

TEXT = [
    "The United States of America is a country. The United States has fifty states.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Step 1: 12 + 30 = 42. Step 2: 42 * 2 = 84. So the answer is 84.",
    "So the answer is 7. The answer is 7 because 3 + 4 = 7, and the United States of America agrees.",
    "Héllo wörld — naïve café, 東京 and emoji 🙂 appear in the text; the text ends here.",
]


@pytest.fixture(scope="module")
def vocab(default_target):
    return P.Vocab(default_target.tokenizer)


def test_word_starts_follow_the_pre_tokenizer(vocab, default_target):
    ids = default_target.tokenizer("Hello, world! United States").input_ids
    pieces = [vocab.piece_of[i] for i in ids]
    starts = vocab.word_starts(ids)
    assert pieces == ["Hello", ",", "Ġworld", "!", "ĠUnited", "ĠStates"]
    assert starts == [True] * 6
    ids = default_target.tokenizer(" unbelievability").input_ids
    assert len(ids) > 1 and vocab.word_starts(ids) == [True] + [False] * (len(ids) - 1)


def test_mined_entries_expand_and_decode_back(vocab, default_target):
    tok = default_target.tokenizer
    responses = [tok(t).input_ids for t in TEXT * 2]
    pv = P.mine_vocab(responses, vocab, size=400)
    assert len(pv) > 50
    texts = set()
    for text, exp in zip(pv.texts, pv.expansions):
        assert vocab.longest_match(text) == exp  # greedy longest match is the stored expansion
        assert vocab.pieces(exp) == text
        phrase = tok.decode(exp)  # the expansion re-decodes to the phrase
        assert phrase == tok.convert_tokens_to_string([vocab.piece_of[i] for i in exp])
        assert phrase in "".join(TEXT)
        # one to three words (a span starting mid-word counts its remainder as the first word)
        assert 1 <= len(vocab.pre.pre_tokenize_str(phrase)) <= 3
        texts.add(text)
    assert len(texts) == len(pv)  # no duplicate phrases
    # multi-word phrases exist and are ranked by expected tokens saved
    assert "ĠUnitedĠStatesĠof" in texts or "ĠUnitedĠStates" in texts
    saved = [c * len(e) for c, e in zip(pv.counts, pv.expansions)]
    assert saved == sorted(saved, reverse=True)


def test_longest_match_labels_on_hand_written_cases():
    pv = NP.PhraseVocab(texts=["a", "ab", "abc", "d"], expansions=[[1], [1, 2], [1, 2, 3], [4]], counts=[1] * 4)
    trie = pv.trie()
    assert P.longest_entry(trie, [1, 2, 3, 4], 0) == 2
    assert P.longest_entry(trie, [1, 2, 9], 0) == 1
    assert P.longest_entry(trie, [1, 9], 0) == 0
    assert P.longest_entry(trie, [9, 1], 0) == -1
    assert P.longest_entry(trie, [1, 2, 3], 0, end=2) == 1  # never past the response end
    assert P.longest_entry(trie, [1, 2, 3, 4], 3) == 3
    # prompt [7, 7] then response [5, 1, 2, 3, 4] and EOS (special 0): root n has features n - 1
    seq = Sequence(tokens=[7, 7, 5, 1, 2, 3, 4, 0], prompt_len=2, prompt_id=0, finished=True)
    ex = P.build_examples([seq], pv, special={0})
    # roots: n=2 (5) -> [1,2,3] = entry 2; n=3 (1) -> [2,..] none; n=4 (2) -> [3] none; n=5 (3) -> [4] entry 3
    assert ex.positions == 4
    assert ex.root.tolist() == [5, 3]
    assert ex.label.tolist() == [2, 3]
    assert ex.feat_index.tolist() == [1, 4]


def test_head_output_rows_are_257_parameters():
    a = NP.PhraseHead(NP.PhraseHeadConfig(hidden_size=64, vocab_size=100))
    b = NP.PhraseHead(NP.PhraseHeadConfig(hidden_size=64, vocab_size=300))
    assert b.n_params() - a.n_params() == 200 * 257


@pytest.fixture(scope="module")
def tiny_run(tiny_chat_target, tmp_path_factory):
    from specdraft.train import data as D

    root = tmp_path_factory.mktemp("phrase")
    from specdraft.train.prompts import Prompt

    prompts = [Prompt(id=i, source="gsm", text=f"{t} (variant {i})") for i, t in enumerate(TEXT * 2)]
    cfg = D.BuildConfig(n_prompts=len(prompts), max_new_tokens=24, batch_size=5, shard_size=4, sources=("gsm",))
    D.build_data(tiny_chat_target, root / "data", cfg, quiet=True, prompts=prompts)
    D.cache_features(tiny_chat_target, root / "data", root / "feat", (NP.FEATURE_LAYER,), quiet=True)
    return root


def _train(target, root, out, **kw):
    cfg = P.PhraseTrainConfig(vocab_size=64, epochs=2, batch_size=16, holdout=0.2, **kw)
    return P.train_phrase(target, root / "data", root / "feat", out, cfg, quiet=True, log=lambda *a: None)


def test_training_resumes_to_the_same_weights(tiny_chat_target, tiny_run, tmp_path, monkeypatch):
    from specdraft.nn.checkpoint import load_checkpoint

    ref = tmp_path / "ref.safetensors"
    _train(tiny_chat_target, tiny_run, ref)
    out = tmp_path / "cut.safetensors"
    real = P.nn.functional.cross_entropy
    state = P.Path(str(out) + ".resume.safetensors")

    def interrupt_in_epoch_2(*a, **k):  # the resume state is written after epoch 1
        if state.is_file():
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(P.nn.functional, "cross_entropy", interrupt_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        _train(tiny_chat_target, tiny_run, out)
    monkeypatch.setattr(P.nn.functional, "cross_entropy", real)
    assert not out.exists() and P.Path(str(out) + ".resume.safetensors").is_file()
    m = _train(tiny_chat_target, tiny_run, out)
    a, _ = load_checkpoint(ref)
    b, _ = load_checkpoint(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert m["kind"] == "phrase" and m["target_hash"] == tiny_chat_target.weight_hash and len(m["history"]) == 2


def test_training_on_several_data_folders(tiny_chat_target, tiny_run, tmp_path):
    from specdraft.errors import SpecdraftError
    from specdraft.train import data as D

    cfg = P.PhraseTrainConfig(vocab_size=64, epochs=1, batch_size=16, holdout=0.2)
    one = P.train_phrase(tiny_chat_target, tiny_run / "data", tiny_run / "feat", tmp_path / "one.safetensors", cfg,
                         quiet=True, log=lambda *a: None)
    two = P.train_phrase(tiny_chat_target, [tiny_run / "data"] * 2, [tiny_run / "feat"] * 2,
                         tmp_path / "two.safetensors", cfg, quiet=True, log=lambda *a: None)
    m = D.read_manifest(tiny_run / "data")
    assert two["data"]["sequences"] == one["data"]["sequences"] == m["sequences"]  # the first folder's split
    assert two["data"]["response_tokens"] == 2 * m["response_tokens"] and len(two["data"]["folders"]) == 2
    assert two["coverage"]["response_positions"] == 2 * one["coverage"]["response_positions"]
    assert "folders" not in one["data"]
    prof = P.add_acceptance_profile(tiny_chat_target, tmp_path / "two.safetensors", tiny_run / "data", tiny_run / "feat")
    assert all(v >= 1.0 for v in prof.values())
    with pytest.raises(SpecdraftError, match="give one --features per --data"):
        P.train_phrase(tiny_chat_target, [tiny_run / "data"] * 2, [tiny_run / "feat"], tmp_path / "x.safetensors", cfg,
                       quiet=True, log=lambda *a: None)


def test_trained_tiny_head_is_lossless(tiny_chat_target, tiny_run, tmp_path):
    path = tmp_path / "head.safetensors"
    _train(tiny_chat_target, tiny_run, path)
    ids = tiny_chat_target.encode_prompt(TEXT[0])
    ref = generate(tiny_chat_target, ids, NoDrafter(), GenerateConfig(max_new_tokens=30)).token_ids
    for budget in (1, 3, 8):
        d = make_drafter(str(path), tiny_chat_target, budget=budget)
        assert isinstance(d, PhraseDrafter)
        assert generate(tiny_chat_target, ids, d, GenerateConfig(max_new_tokens=30)).token_ids == ref


def test_corrupt_and_mismatched_checkpoints(default_target, tiny_chat_target, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(SpecdraftError, match="corrupt|not a specdraft"):
        make_drafter(str(bad), default_target)
    with pytest.raises(SpecdraftError, match="corrupt"):
        load_draft_model(default_target, bad, "phrase")
    with pytest.raises(SpecdraftError, match="trained for target"):
        make_drafter("phrase", tiny_chat_target)
    with pytest.raises(SpecdraftError, match="not found"):
        make_drafter(str(tmp_path / "missing.safetensors"), default_target)


def test_simulated_tokens_per_pass_matches_a_real_run(default_target):
    from specdraft.replay import sequence_hidden, simulate
    from specdraft.drafters.ngram import NgramDrafter

    ids = default_target.encode_prompt("List the first ten prime numbers and explain why each is prime.")
    ref = generate(default_target, ids, NoDrafter(), GenerateConfig(max_new_tokens=40))
    out = ref.token_ids
    hidden = sequence_hidden(default_target, ids + out, (NP.FEATURE_LAYER,))
    for d in (NgramDrafter(), make_drafter("phrase", default_target)):
        real = generate(default_target, ids, d, GenerateConfig(max_new_tokens=40, budget=3))
        sim = simulate(d, ids, out, hidden, 3)
        assert real.token_ids == out
        assert abs(sim["passes"] - real.stats.passes) <= (0 if d.name == "ngram" else 2), d.name


def test_shipped_weights_and_calibration_are_picked_per_target(default_target, tiny_chat_target, tiny_run, tmp_path,
                                                               monkeypatch):
    """Shipped files are NAME_MODEL.safetensors: each target gets the file trained for its model (the default
    target's file otherwise), and the calibration entry NAME@MODEL fitted for it."""
    import shutil

    from specdraft.drafters import calibration as C
    from specdraft.drafters import registry

    default_file = registry.weights_path("phrase")
    folder = tmp_path / "weights"
    folder.mkdir()
    shutil.copy(default_file, folder / default_file.name)
    _train(tiny_chat_target, tiny_run, folder / "phrase_tiny.safetensors")
    monkeypatch.setattr(registry, "WEIGHTS_DIR", folder)
    assert registry.weights_path("phrase", tiny_chat_target) == folder / "phrase_tiny.safetensors"
    assert registry.weights_path("phrase", default_target) == folder / default_file.name
    assert registry.weights_path("phrase") == folder / default_file.name
    key = C.entry_key("phrase", tiny_chat_target, default=False)
    assert key == f"phrase@{(tiny_chat_target.model_hash or tiny_chat_target.weight_hash)[:16]}"
    assert C.entry_key("phrase", default_target, True) == "phrase"
    cals = {"phrase": {"target": default_target.weight_hash, "model": default_target.model_hash,
                       "map": {"xs": [0.1, 0.9], "ys": [0.2, 0.5]}},
            key: {"target": tiny_chat_target.weight_hash, "model": tiny_chat_target.model_hash,
                  "map": {"xs": [0.1, 0.9], "ys": [0.3, 0.7]}}}
    monkeypatch.setattr(C, "shipped_calibrations", lambda: cals)
    assert C.calibration_for("phrase", tiny_chat_target).ys == [0.3, 0.7]
    assert C.calibration_for("phrase", default_target).ys == [0.2, 0.5]
    d = make_drafter("phrase", tiny_chat_target, budget=3)
    assert d.manifest["target_hash"] == tiny_chat_target.weight_hash and d.calibration.ys == [0.3, 0.7]
    del cals[key]  # no entry for this model: raw probabilities, never another model's map
    assert C.calibration_for("phrase", tiny_chat_target).xs == []


def test_the_heads_top_entries_on_the_kernel_equal_torchs(default_target):
    """On the fast kernel the head's three layers and its top-k are one call (``fast_mlp_topk``): the same entries
    in the same order as the head's modules (the same 8-bit layers) and torch's softmax top-k, their
    probabilities to float rounding."""
    d = make_drafter("phrase", default_target)
    assert d.fast == (default_target.precision == "fast")
    ids = default_target.encode_prompt("Write a haiku about the sea.")
    generate(default_target, ids, d, GenerateConfig(max_new_tokens=12))  # a state (h, root) mid-generation
    got = d.phrase_candidates(16)
    d.fast = False
    try:
        ref = d.phrase_candidates(16)
    finally:
        d.fast = default_target.precision == "fast"
    assert got[0] == ref[0] and len(got[0]) == 16
    assert got[1] == pytest.approx(ref[1], abs=1e-6, rel=1e-5)
