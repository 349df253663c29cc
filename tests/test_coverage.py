"""`specdraft analyze coverage`: shares of a benchmark's greedy output unseen in the training
responses and outside a drafter's draft vocabulary."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from specdraft.bench.coverage import coverage_report, coverage_stats, drafter_vocabulary, training_response_tokens
from specdraft.errors import SpecdraftError


def test_coverage_stats_on_hand_written_outputs():
    seen = Counter({1: 5, 2: 1, 3: 2})
    outs = [[1, 2, 9, 0], [4, 1, 0]]  # 0 = EOS, left out
    r = coverage_stats(outs, seen, {"small": {1, 4}, "full": None}, skip={0})
    assert r["tokens"] == 5 and r["distinct_tokens"] == 4
    assert r["unseen_in_training"] == pytest.approx(2 / 5)  # 9 and 4
    assert r["outside_draft_vocab"] == {"small": pytest.approx(2 / 5), "full": None}  # 2 and 9
    hybrid_like = SimpleNamespace(model=SimpleNamespace(vocab_ids=torch.tensor([3, 1])))
    assert drafter_vocabulary(hybrid_like) == {1, 3} and drafter_vocabulary(SimpleNamespace()) is None
    with pytest.raises(SpecdraftError, match="no output tokens"):
        coverage_stats([[0]], seen, {}, skip={0})


def test_coverage_report_replays_greedy_output_against_the_training_data(tiny_chat_target, tiny_train_data, tmp_path):
    from specdraft.replay import greedy_outputs
    from specdraft.train.data import load_sequences

    t = tiny_chat_target
    ds = tmp_path / "p.jsonl"
    ds.write_text("\n".join(json.dumps({"prompt": p}) for p in ["List three colours. (variant 0)", "Name a fish."]))
    res = coverage_report(t, [tiny_train_data / "data"], ["ngram"], [str(ds)], 2, 12, tmp_path / "out", quiet=True)
    seen = training_response_tokens([tiny_train_data / "data"])
    assert sum(seen.values()) == sum(len(s.response) for s in load_sequences(tiny_train_data / "data"))
    outs = greedy_outputs(t, [t.encode_prompt(p) for p in ["List three colours. (variant 0)", "Name a fish."]], 12)
    want = coverage_stats(outs, seen, {"ngram": None}, skip=set(t.eos_ids))
    assert res["datasets"][str(ds)] == want and (tmp_path / "out" / "coverage.json").is_file()
    with pytest.raises(SpecdraftError, match="at least one --data"):
        coverage_report(t, [], [], [str(ds)], 2, 12, tmp_path / "out", quiet=True)


def test_draft_vocabulary_of_the_shipped_hybrid_drafters(default_target):
    """The lookup reads a real hybrid checkpoint's stored ids (not only a stand-in object)."""
    from specdraft.nn.checkpoint import load_checkpoint
    from specdraft.drafters import make_drafter
    from specdraft.drafters.registry import weights_path

    for name in ("gumiho", "eagle", "medusa"):
        tensors, manifest = load_checkpoint(weights_path(name))
        vocab = drafter_vocabulary(make_drafter(name, default_target))
        assert vocab == set(tensors["vocab_ids"].tolist()) and len(vocab) == manifest["config"]["draft_vocab"]
    assert drafter_vocabulary(make_drafter("ngram", default_target)) is None
