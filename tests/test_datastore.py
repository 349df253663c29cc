"""The datastore of the target's own answers (drafters.datastore) and prompt lookup over it."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from specdraft.drafters import make_drafter
from specdraft.drafters.datastore import Datastore, read_manifest, store_for
from specdraft.drafters.ngram import NgramDrafter, lookup_key, store_cell
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate


def random_answers(seed: int, n: int = 40, vocab: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def brute_force(answers, history, max_n):
    """(n, Counter of the next token) for the longest n-gram ending ``history`` that some answer continues."""
    for n in range(min(max_n, len(history)), 0, -1):
        nxt = Counter(a[i + n] for a in answers for i in range(len(a) - n) if a[i : i + n] == history[-n:])
        if nxt:
            return n, nxt
    return 0, Counter()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookup_finds_the_longest_match_and_ranks_by_frequency(seed):
    answers = random_answers(seed)
    store = Datastore.from_sequences(answers, max_n=4, cap=10_000)
    rng = random.Random(seed + 10)
    for _ in range(60):
        history = [rng.randrange(12) for _ in range(rng.randrange(1, 8))]
        n, cands = store.lookup(history, depth=3, k=3)
        want_n, nxt = brute_force(answers, history, 4)
        assert n == want_n
        if not n:
            assert cands == []
            continue
        total = sum(nxt.values())
        best = max(nxt.values())
        assert cands[0][0][0] in {t for t, c in nxt.items() if c == best}  # the most frequent next token first
        assert cands[0][1] == pytest.approx(best / total)  # with its share of the matches
        for cont, share in cands:  # every continuation follows some match, inside one answer
            assert 1 <= len(cont) <= 3 and share == pytest.approx(nxt[cont[0]] / total)
            assert any(a[i : i + n + len(cont)] == history[-n:] + cont for a in answers for i in range(len(a)))


def test_many_matches_are_read_spread_out_and_ranked():
    # "1 2" is followed by 3 in 30 answers, by 4 5 in 10 and by 4 6 in 20: 60 matches, 16 read, evenly spread
    answers = [[1, 2, 3]] * 30 + [[1, 2, 4, 5]] * 10 + [[1, 2, 4, 6]] * 20
    store = Datastore.from_sequences(answers, cap=16)
    n, cands = store.lookup([1, 2], depth=2, k=3)
    assert n == 2
    # 3 and 4 first tokens in 8 of the 16 read matches each (first and last match read: both kinds are seen);
    # under 4, "4 6" (5 of the 8) before "4 5" (3 of the 8)
    conts = [c for c, _ in cands]
    assert set(map(tuple, conts)) == {(3,), (4, 5), (4, 6)} and conts.index([4, 6]) < conts.index([4, 5])
    assert all(share == pytest.approx(0.5) for _, share in cands)
    assert store.lookup([1, 2], depth=0, k=3) == (0, []) and store.lookup([1, 2], depth=2, k=0) == (0, [])
    assert store.lookup([1, 2], depth=2, k=3, min_n=0)[0] == 2  # min_n below 1 counts as 1


def test_no_match_and_min_n():
    store = Datastore.from_sequences([[1, 2, 3], [4, 5]], max_n=3)
    assert store.lookup([9, 9], depth=4, k=4) == (0, [])
    assert store.lookup([9, 2], depth=4, k=4) == (1, [([3], 1.0)])
    assert store.lookup([9, 2], depth=4, k=4, min_n=2) == (0, [])
    assert store.lookup([3], depth=4, k=4) == (0, [])  # an answer's last token continues nothing


def test_round_trip_and_index_cache(tmp_path):
    for vocab in (300, 150_000):  # uint16 in the file, then int32 (a vocabulary past 65,535)
        answers = [[random.Random(i).randrange(vocab) for _ in range(30)] + [7, 8, 9] for i in range(20)]
        store = Datastore.from_sequences(answers)
        path = tmp_path / f"store_{vocab}.safetensors"
        store.save(path, {"target_name": "t", "target_hash": "h"})
        assert read_manifest(path)["tokens"] == 20 * 33 and read_manifest(path)["answers"] == 20
        cold = Datastore.load(path, cache=tmp_path / "cache")
        with pytest.MonkeyPatch.context() as mp:  # the index is read back, not rebuilt
            mp.setattr(Datastore, "build_index", staticmethod(lambda *a: pytest.fail("the cached index was rebuilt")))
            warm = Datastore.load(path, cache=tmp_path / "cache")
        for s in (store, cold, warm):
            assert s.lookup([1, 7, 8], depth=2, k=2) == (2, [([9], 1.0)])
            assert np.array_equal(s.stream, store.stream)


def test_an_unwritable_cache_costs_only_the_saving(tmp_path):
    path = tmp_path / "store.safetensors"
    Datastore.from_sequences([[1, 2, 3], [1, 2, 4]]).save(path, {"target_name": "t", "target_hash": "h"})
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("a file where the cache folder would go")
    store = Datastore.load(path, cache=blocked / "datastore")  # mkdir fails: the index is built, not saved
    assert store.lookup([1, 2], depth=1, k=2) == (2, [([3], 0.5), ([4], 0.5)])


def test_bad_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(SpecdraftError, match="not a specdraft datastore"):
        Datastore.load(bad)
    from specdraft.drafters.registry import weights_path
    with pytest.raises(SpecdraftError, match="holds no specdraft datastore"):
        read_manifest(weights_path("phrase"))  # a drafter checkpoint is not a datastore
    with pytest.raises(ValueError, match="needs 'target_hash'"):
        Datastore.from_sequences([[1, 2]]).save(tmp_path / "x.safetensors", {"target_name": "t"})


def test_store_candidates_join_the_context_ones_in_the_tables_order():
    store = Datastore.from_sequences([[5, 6, 7, 8]] * 3 + [[5, 6, 1]])
    d = NgramDrafter(table={}, store=store)
    d.reset([1, 2, 3, 1, 9, 5], 6, None)  # context: "1" was followed by "2 3 1"; store: "5 6" by "7 8" (3 of 4)
    scored = d.scored()
    assert scored[0] == ([7, 8], store_cell(2, 0.75))  # the context has no "5 6" or "6": only the store matches
    assert ([1], store_cell(2, 0.75)) not in scored and ([1], "d2,2") in scored
    # context: "1" was followed by "9 6 1" and "2 3 1 9 6 1"; the store: "6 1" by "4 4"
    other = Datastore.from_sequences([[6, 1, 4, 4]] * 2)
    d = NgramDrafter(table={}, store=other)
    d.reset([1, 2, 3, 1, 9, 6], 1, None)
    assert d.scored() == [([9, 6, 1], "1,0"), ([2, 3, 1, 9, 6, 1], "1,1"), ([4, 4], "d2,0")]  # no table: context first
    table = {lookup_key(store_cell(2, 1.0), 1): 0.9, lookup_key("1,0", 1): 0.2}
    d = NgramDrafter(table=table, store=other)
    d.reset([1, 2, 3, 1, 9, 6], 1, None)
    assert d.scored()[0] == ([4, 4], "d2,0")  # a table: the store's candidate, measured better, goes first
    tree = d.propose(2)
    assert tree.tokens == [1, 4, 4] and tree.probs[1] == 0.9


@pytest.mark.parametrize("seed", [0, 1])
def test_lookup_with_a_store_equals_plain_greedy(tiny_llama, seed):
    """A datastore holding the very answer (and noise) drafts long accepted runs; the output stays plain greedy's."""
    _, target, _ = tiny_llama
    rng = random.Random(seed)
    vocab = target.config.vocab_size
    prompt = [rng.randrange(2, vocab) for _ in range(8)]
    cfg = GenerateConfig(max_new_tokens=48)
    ref = generate(target, prompt, None, cfg)
    noise = [[rng.randrange(2, vocab) for _ in range(40)] for _ in range(20)]
    store = Datastore.from_sequences(noise + [ref.token_ids[:30]] + noise)
    drafter = NgramDrafter(table={}, store=store)
    drafter.default_budget = 6
    got = generate(target, prompt, drafter, cfg)
    assert got.token_ids == ref.token_ids
    assert got.stats.committed / got.stats.passes > 1.5  # the stored answer was drafted and accepted


def test_build_store_from_data_folders(tiny_chat_target, tiny_train_data, tiny_llama, tmp_path):
    from specdraft.train.data import build_datastore, load_sequences

    out = tmp_path / "store.safetensors"
    m = build_datastore(tiny_chat_target, [tiny_train_data / "data"], out)
    seqs = load_sequences(tiny_train_data / "data")
    assert m["answers"] == len(seqs) and m["tokens"] == sum(len(s.response) for s in seqs)
    assert m["target_hash"] == tiny_chat_target.weight_hash and m["data"][0]["sequences"] == len(seqs)
    store = Datastore.load(out)
    first = seqs[0].response
    n, cands = store.lookup(first[:4], depth=3, k=4)
    assert n >= 1 and cands
    with pytest.raises(SpecdraftError, match="not the loaded target"):
        build_datastore(tiny_llama[1], [tiny_train_data / "data"], tmp_path / "other.safetensors")


def test_the_default_target_ships_one(default_target, tiny_llama):
    d = make_drafter("ngram", default_target)
    assert d.store is not None and d.store.manifest["target_hash"] == default_target.weight_hash
    assert make_drafter("ngram", default_target).store is d.store  # loaded once per process, shared
    assert make_drafter("ngram@datastore=0", default_target).store is None
    assert store_for(tiny_llama[1]) is None  # none ships for another model


def test_each_shipped_datastore_names_its_model_and_lookup_table():
    """Every shipped datastore is picked for its own model (another quantization included) and for no other; a
    datastore for another target than the default has that target's own lookup table (``ngram@MODEL``)."""
    import json
    from types import SimpleNamespace

    from specdraft.drafters.calibration import CALIBRATION_FILE
    from specdraft.drafters.datastore import shipped_stores
    from specdraft.drafters.ngram import lookup_table

    cals = json.loads(CALIBRATION_FILE.read_text())
    stores = shipped_stores()
    assert len(stores) >= 2  # the default target's and Qwen2.5-Coder's
    for path in stores:
        m = read_manifest(path)
        other = SimpleNamespace(weight_hash="another quantization", model_hash=m["target_model"])
        assert store_for(other).manifest["target_model"] == m["target_model"]
        assert m["tokens"] > 100_000 and m["data"]
        if "smollm2" not in path.name:
            entry = cals[f"ngram@{m['target_model'][:16]}"]
            assert entry["model"] == m["target_model"] and lookup_table(other) == entry["table"]
            assert any(k.startswith("d") for k in entry["table"])
    # without a target, the default target's own fit (which phrase's calibration was fitted with), never another's
    assert lookup_table(None) == cals["ngram"]["table"] and any(k.startswith("d") for k in lookup_table(None))
    assert store_for(SimpleNamespace(weight_hash="none", model_hash="none")) is None


def test_a_datastore_file_by_path(tiny_chat_target, tiny_train_data, tiny_llama, tmp_path):
    from specdraft.train.data import build_datastore

    out = tmp_path / "mine.safetensors"
    build_datastore(tiny_chat_target, [tiny_train_data / "data"], out)
    d = make_drafter(f"ngram@datastore={out}", tiny_chat_target)
    assert d.store is not None and len(d.store) > 0
    assert make_drafter("ngram", tiny_chat_target).store is None  # nothing ships for it
    with pytest.raises(SpecdraftError, match="not of the loaded target"):
        make_drafter(f"ngram@datastore={out}", tiny_llama[1])
    with pytest.raises(SpecdraftError, match="option datastore must be 0, 1 or a datastore file"):
        make_drafter(f"ngram@datastore={tmp_path / 'missing.safetensors'}", tiny_chat_target)


def test_ngram_without_a_target_has_no_datastore():
    assert make_drafter("ngram").store is None and make_drafter("ngram@datastore=0").store is None
