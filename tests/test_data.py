"""Training data: batched greedy equals single-stream greedy, shards round-trip, an interrupted
build resumes without loss, and no benchmark prompt reaches the training prompts."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specdraft.model.batched_decode import generate_batch
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate
from specdraft.train import data as D
from specdraft.train.prompts import Prompt, benchmark_prompt_set, collect_prompts, is_benchmark, normalize


def test_batched_greedy_equals_single_stream(tiny_llama):
    _, target, _ = tiny_llama
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 96) for _ in range(rng.randint(1, 20))] for _ in range(9)]
    res = generate_batch(target.model, prompts, max_new_tokens=20, eos_ids=target.eos_ids)
    stopped = 0
    for p, toks, fin in zip(prompts, res.tokens, res.finished):
        ref = generate(target, p, None, GenerateConfig(max_new_tokens=20))
        assert toks == ref.token_ids
        assert fin == (ref.finish_reason == "stop")
        stopped += fin
    assert 0 < stopped < len(prompts)  # rows stop at different times (one at EOS, the rest at the limit)
    assert res.steps == 19  # the longest rows: 20 tokens, the first from prefill


def test_shard_round_trip(tmp_path):
    seqs = [D.Sequence([5, 6, 7, 8], 2, 10, True), D.Sequence([9], 1, 11, False), D.Sequence(list(range(300)), 17, 12, True)]
    path = tmp_path / "shard_00000.safetensors"
    D.save_shard(path, seqs)
    back = D.load_shard(path)
    assert back == seqs
    assert back[0].response == [7, 8]


def test_corrupt_shard_names_the_file(tmp_path):
    path = tmp_path / "shard_00000.safetensors"
    D.save_shard(path, [D.Sequence([1, 2, 3], 1, 0, True)])
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(SpecdraftError, match="shard_00000.safetensors"):
        D.load_shard(path)


def test_disk_full_is_a_clear_error(tmp_path, monkeypatch):
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(D, "save_file", full)
    with pytest.raises(SpecdraftError, match="disk full while writing .*shard_00003"):
        D.save_shard(tmp_path / "shard_00003.safetensors", [D.Sequence([1, 2], 1, 0, True)])


PROMPTS = [Prompt(i, "gsm", f"What is {i} plus {i + 1}? Answer briefly.", 1000) for i in range(7)]


def test_build_resumes_after_interruption(tiny_chat_target, tmp_path, monkeypatch):
    cfg = D.BuildConfig(n_prompts=7, max_new_tokens=6, batch_size=3, shard_size=2, sources=("gsm",))
    ref = D.build_data(tiny_chat_target, tmp_path / "ref", cfg, quiet=True, prompts=list(PROMPTS))
    assert ref["sequences"] == 7 and len(ref["shards"]) == 4

    real_save = D.save_shard
    calls = {"n": 0}

    def flaky(path, seqs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # the user hits Ctrl-C while the third shard is written
        real_save(path, seqs)

    monkeypatch.setattr(D, "save_shard", flaky)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        D.build_data(tiny_chat_target, out, cfg, quiet=True, prompts=list(PROMPTS))
    partial = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in partial["shards"]] == ["shard_00000.safetensors", "shard_00001.safetensors"]
    monkeypatch.setattr(D, "save_shard", real_save)
    resumed = D.build_data(tiny_chat_target, out, cfg, quiet=True)  # prompts come from prompts.jsonl
    assert resumed["sequences"] == 7 and resumed["response_tokens"] == ref["response_tokens"]
    assert D.load_sequences(out) == D.load_sequences(tmp_path / "ref")
    assert resumed["target_hash"] == tiny_chat_target.weight_hash and resumed["version"]


def test_build_refuses_other_targets_folder(tiny_chat_target, tiny_llama, tmp_path):
    cfg = D.BuildConfig(n_prompts=2, max_new_tokens=3, shard_size=2, sources=("gsm",))
    D.build_data(tiny_chat_target, tmp_path, cfg, quiet=True, prompts=PROMPTS[:2])
    with pytest.raises(SpecdraftError, match="not the loaded target"):
        D.build_data(tiny_llama[1], tmp_path, cfg, quiet=True)


def test_no_benchmark_prompt_in_training_prompts(monkeypatch):
    from specdraft.datasets import gsm_prompts, mtbench_prompts
    import specdraft.train.prompts as P

    bench = benchmark_prompt_set()
    eval_gsm = gsm_prompts(5)
    assert all(is_benchmark(p, bench) for p in eval_gsm + mtbench_prompts()[:5])
    # plant benchmark prompts among the generated training prompts: they must be dropped
    real = P.gsm_train_prompts
    monkeypatch.setattr(P, "gsm_train_prompts",
                        lambda n, seed=1000: [Prompt(0, "gsm", eval_gsm[0], 1000),
                                              Prompt(0, "gsm", "  " + eval_gsm[1].upper(), 1000)] + real(n, seed))
    prompts = collect_prompts(None, 120, sources=("gsm", "reasoning", "codeio"), quiet=True)
    assert len(prompts) >= 100
    assert {p.source for p in prompts} == {"gsm", "reasoning", "codeio"}
    assert not any(is_benchmark(p.text, bench) for p in prompts)
    assert len({normalize(p.text) for p in prompts}) == len(prompts)  # deduplicated
    assert [p.id for p in prompts] == list(range(len(prompts)))
    # prompts another data folder already holds are left out (`data build --exclude`)
    again = collect_prompts(None, 30, sources=("gsm",), quiet=True, exclude={normalize(prompts[0].text)})
    assert prompts[0].text not in {p.text for p in again} and len(again) == 30


def test_build_excludes_the_prompts_of_another_data_folder(tiny_chat_target, tmp_path):
    from specdraft.train.prompts import gsm_train_prompts

    first = gsm_train_prompts(2)
    cfg = D.BuildConfig(n_prompts=2, max_new_tokens=4, batch_size=2, shard_size=2, sources=("gsm",))
    D.build_data(tiny_chat_target, tmp_path / "a", cfg, quiet=True, prompts=list(first))
    assert D.read_manifest(tmp_path / "a")["config"]["exclude"] == []
    cfg = D.BuildConfig(n_prompts=3, max_new_tokens=4, batch_size=3, shard_size=3, sources=("gsm",),
                        exclude=(str(tmp_path / "a"),))
    m = D.build_data(tiny_chat_target, tmp_path / "b", cfg, quiet=True)
    got = {normalize(p.text) for p in D.read_prompts(tmp_path / "b" / D.PROMPTS)}
    assert len(got) == 3 and not got & {normalize(p.text) for p in first}
    assert m["config"]["exclude"] == [str(tmp_path / "a")] and m["sequences"] == 3
    with pytest.raises(SpecdraftError, match="not a data folder"):
        D.build_data(tiny_chat_target, tmp_path / "c", D.BuildConfig(**{**cfg.__dict__, "exclude": (str(tmp_path),)}),
                     quiet=True)


def test_magpie_prompts_come_from_the_user_prefix(tiny_chat_target):
    from specdraft.train.prompts import magpie_prompts
    from specdraft.train.sources import user_prefix

    prefix = user_prefix(tiny_chat_target.tokenizer)
    assert prefix.endswith("<|im_start|>user\n")
    got = magpie_prompts(tiny_chat_target, 3, batch_size=8, quiet=True)
    assert len({p.text for p in got}) == len(got)  # deduplicated (a random model may yield fewer)


def test_features_match_single_sequence_forward(tiny_chat_target):
    from specdraft.model.llama import FINAL

    seqs = [D.Sequence([1, 5, 9, 13, 2], 2, 0, True), D.Sequence([1, 7, 2], 1, 1, True)]
    fb = D.compute_features(tiny_chat_target, seqs, (1, FINAL))
    assert fb.response_mask.tolist() == [[False, False, True, True, True], [False, True, True, False, False]]
    single = D.compute_features(tiny_chat_target, seqs[1:], (1, FINAL))
    assert torch.allclose(fb.hidden[FINAL][1, :3], single.hidden[FINAL][0], atol=1e-5)
    assert D.feature_cache_bytes(seqs, (1, FINAL), 64) == 8 * 2 * 64 * 2


# ---------------------------------------------------------------------------- the broad mix


def test_mix_held_out_part_shares_nothing_with_training():
    from specdraft.train import mix

    for table in (mix.TOPICS, mix.WRITING_TASKS, mix.FOLLOWUPS, mix.CODE_TASKS, mix.REASONING_TASKS):
        assert table["train"] and table["heldout"] and not set(table["train"]) & set(table["heldout"])
    train = mix.code_prompts(300, seed=1, split="train")
    held = mix.code_prompts(60, seed=1, split="heldout")
    code = lambda t: t.split("\n\n", 1)[1]  # the program or task the instruction is about
    assert not {code(t) for t in train} & {code(t) for t in held}
    assert mix.code_prompts(5, seed=1) == train[:5] and mix.code_prompts(5, seed=2) != train[:5]
    assert len(mix.reasoning_mix(12, seed=3, split="heldout")) == 12
    with pytest.raises(SpecdraftError, match="unknown split"):
        mix.code_prompts(1, seed=1, split="test")


@pytest.fixture
def scripted_sampling(monkeypatch):
    """The mix's sampled texts replaced by numbered sentences: collection runs without a real target's
    sampling, and each text says which prefix it answered."""
    from specdraft.train import mix

    calls = []

    def fake(target, prefixes, max_new_tokens, seed, temperature=0.9, desc="", quiet=False, batch_size=32):
        calls.append((desc, len(prefixes), temperature))
        return [(f"reply {seed} {desc} {i}: the answer is a full sentence, long enough to be a passage. It has more.", True)
                for i in range(len(prefixes))]

    monkeypatch.setattr(mix, "sample_texts", fake)
    return calls


def test_collect_the_mix(tiny_chat_target, scripted_sampling, monkeypatch):
    import specdraft.train.prompts as P
    from specdraft.train.prompts import MIX, MIX_SOURCES, SAMPLED_TEMPERATURE

    # magpie's own test is above; a random model's near-uniform nucleus makes its sampling slow here
    monkeypatch.setattr(P, "magpie_prompts", lambda target, k, seed, quiet: [Prompt(0, "magpie", f"Question {i}?", seed)
                                                                           for i in range(k)])

    prompts = collect_prompts(tiny_chat_target, 60, MIX, quiet=True, seed=5, sampled=0.5)
    assert {p.source for p in prompts} == set(MIX)
    assert len({p.key for p in prompts}) == len(prompts) and [p.id for p in prompts] == list(range(len(prompts)))
    for p in prompts:
        if p.source == "followup":  # a question, the target's greedy answer, a follow-up
            assert [m["role"] for m in p.messages] == ["user", "assistant", "user"] and p.text == p.messages[-1]["content"]
            assert p.encode(tiny_chat_target) == tiny_chat_target.encode_messages(p.messages)
        else:
            assert p.messages is None and p.encode(tiny_chat_target) == tiny_chat_target.encode_prompt(p.text)
    assert any(d == "first answers" and t == 0.0 for d, _, t in scripted_sampling)  # the answers are greedy
    temps = [p.temperature for p in prompts]
    assert set(temps) == {0.0, SAMPLED_TEMPERATURE} and 0.25 < temps.count(SAMPLED_TEMPERATURE) / len(temps) < 0.75
    few = ("topics", "followup", "code")  # the seeded sources without reasoning-gym's slow task set-up
    one, two = (collect_prompts(tiny_chat_target, 20, few, quiet=True, seed=5, sampled=0.5) for _ in range(2))
    assert [p.to_dict() for p in one] == [p.to_dict() for p in two]  # seeded
    held = collect_prompts(tiny_chat_target, 20, MIX_SOURCES, quiet=True, seed=5, split="heldout")
    assert {p.source for p in held} == set(MIX_SOURCES)
    with pytest.raises(SpecdraftError, match="held-out build takes only"):
        collect_prompts(tiny_chat_target, 20, ("gsm", "topics"), quiet=True, split="heldout")


def test_build_samples_its_sampled_share_reproducibly(tiny_chat_target, tmp_path):
    from specdraft.train.prompts import SAMPLED_TEMPERATURE

    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"}]
    prompts = [Prompt(i, "topics", f"Tell me about the number {i}.", 1000,
                      temperature=SAMPLED_TEMPERATURE if i % 2 else 0.0) for i in range(6)]
    prompts.append(Prompt(6, "followup", conv[-1]["content"], 1000, messages=conv))
    cfg = D.BuildConfig(n_prompts=7, max_new_tokens=12, batch_size=2, shard_size=4, sources=("topics",), seed=3)
    a = D.build_data(tiny_chat_target, tmp_path / "a", cfg, quiet=True, prompts=[Prompt(**p.to_dict()) for p in prompts])
    b = D.build_data(tiny_chat_target, tmp_path / "b", cfg, quiet=True, prompts=[Prompt(**p.to_dict()) for p in prompts])
    sa, sb = D.load_sequences(tmp_path / "a"), D.load_sequences(tmp_path / "b")
    assert sa == sb and a["config"]["seed"] == 3  # the same seed, the same sampled responses
    assert sa[6].tokens[: sa[6].prompt_len] == tiny_chat_target.encode_messages(conv)
    back = D.read_prompts(tmp_path / "a" / D.PROMPTS)
    assert [p.temperature for p in back] == [p.temperature for p in prompts] and back[6].messages == conv
    greedy = D.build_data(tiny_chat_target, tmp_path / "g", cfg, quiet=True,
                          prompts=[Prompt(**{**p.to_dict(), "temperature": 0.0}) for p in prompts])
    sg = D.load_sequences(tmp_path / "g")
    assert [x.tokens for x in sg[::2]] == [x.tokens for x in sa[::2]]  # greedy rows do not depend on the sampled ones
    assert any(x.tokens != y.tokens for x, y in zip(sg[1::2], sa[1::2]))  # the sampled rows are sampled
    assert greedy["sequences"] == 7


def test_a_default_build_records_no_new_config_fields():
    cfg = D.BuildConfig().record()
    assert not {"seed", "split", "sampled"} & set(cfg)
    assert D.BuildConfig(seed=4, sampled=0.2).record()["sampled"] == 0.2


def test_replay_reads_a_data_folders_greedy_responses(tiny_chat_target, tmp_path):
    from specdraft.bench.acceptance import data_folder_outputs
    from specdraft.replay import greedy_outputs
    from specdraft.train.prompts import SAMPLED_TEMPERATURE

    prompts = [Prompt(i, "topics", f"Say something about {i}.", 1000, temperature=SAMPLED_TEMPERATURE if i == 1 else 0.0)
               for i in range(5)]
    cfg = D.BuildConfig(n_prompts=5, max_new_tokens=12, batch_size=3, shard_size=2, sources=("topics",))
    D.build_data(tiny_chat_target, tmp_path, cfg, quiet=True, prompts=prompts)
    for limit in (12, 5):
        ids, outs = data_folder_outputs(tiny_chat_target, tmp_path, 10, limit)
        assert len(ids) == 4  # the sampled response is left out
        assert ids == [p.encode(tiny_chat_target) for p in prompts if p.temperature == 0.0]
        assert outs == greedy_outputs(tiny_chat_target, ids, limit)


def test_mapped_features_equal_the_loaded_ones(tiny_chat_target, tmp_path):
    from specdraft.model.llama import FINAL

    prompts = [Prompt(i, "gsm", f"What is {i} times {i + 2}?", 1000) for i in range(5)]
    cfg = D.BuildConfig(n_prompts=5, max_new_tokens=6, batch_size=3, shard_size=2, sources=("gsm",))
    m = D.build_data(tiny_chat_target, tmp_path / "data", cfg, quiet=True, prompts=prompts)
    D.cache_features(tiny_chat_target, tmp_path / "data", tmp_path / "feat", (0, 2, FINAL), quiet=True)
    files = [s["file"] for s in m["shards"]]
    dense = D.read_features(tmp_path / "feat", files, (2, FINAL, 0))
    lazy = D.read_features(tmp_path / "feat", files, (2, FINAL, 0), mapped=True)
    assert lazy.shape == tuple(dense.shape) and len(files) == 3
    rows = torch.randint(0, dense.shape[0], (4, 7))
    assert torch.equal(lazy[rows], dense[rows])  # rows of every shard, in any order
    assert torch.equal(lazy[3:11], dense[3:11])
    h = dense.shape[1] // 3
    assert torch.equal(lazy.layers([1])[rows], dense[rows][..., h : 2 * h])
    both = D.FeatureRows.concat([lazy, lazy.layers([0, 1, 2])])
    assert torch.equal(both[torch.tensor([0, dense.shape[0] + 5])], dense[torch.tensor([0, 5])])


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_decoding_keeps_the_states_of_one_pass(tiny_chat_fast, sampled):
    """In the fast mode every row's hidden states, kept while decoding, equal one pass over its
    sequence alone bit for bit (prompt, response, and the last token of a row cut at the limit)."""
    from specdraft.model.llama import FINAL
    from specdraft.verify import Sampling

    target = tiny_chat_fast
    assert target.precision == "fast"
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 96) for _ in range(rng.randint(1, 20))] for _ in range(9)]
    layers = (0, 2, FINAL)

    def run(eos, **extra):
        kw = dict(sampling=Sampling(temperature=0.9), generator=torch.Generator().manual_seed(0)) if sampled else {}
        return generate_batch(target.model, prompts, 20, eos, **kw, **extra)

    eos = {run(target.eos_ids).tokens[0][6]}  # a token the rows do produce: some stop at it, the rest at the limit
    res, again = run(eos, hidden_layers=layers), run(eos)
    assert res.tokens == again.tokens and again.hidden is None  # keeping states changes nothing decoded
    assert 0 < sum(res.finished) < len(prompts)
    for p, toks, hid in zip(prompts, res.tokens, res.hidden):
        ref = D.compute_features(target, [D.Sequence(p + toks, len(p), 0, True)], layers)
        for k in layers:
            assert hid[k].shape == (len(p) + len(toks), ref.hidden[k].shape[-1])
            assert torch.equal(hid[k], ref.hidden[k][0].to(torch.float16)), k


def test_a_build_keeps_the_features_data_features_would_compute(tiny_chat_fast, tiny_chat_target, tmp_path):
    from specdraft.model.llama import FINAL
    from specdraft.train.prompts import SAMPLED_TEMPERATURE

    prompts = [Prompt(i, "topics", f"Tell me about {i} cats.", 1000, temperature=SAMPLED_TEMPERATURE * (i % 2))
               for i in range(7)]
    layers = (1, FINAL)
    cfg = D.BuildConfig(n_prompts=7, max_new_tokens=10, batch_size=3, shard_size=4, sources=("topics",),
                        feature_layers=layers)
    m = D.build_data(tiny_chat_fast, tmp_path / "data", cfg, quiet=True, prompts=prompts)
    assert m["config"]["feature_layers"] == [1, FINAL]
    files = [s["file"] for s in m["shards"]]
    kept = D.read_features(tmp_path / "data" / "features", files, layers)
    D.cache_features(tiny_chat_fast, tmp_path / "data", tmp_path / "again", layers, quiet=True)
    assert torch.equal(kept, D.read_features(tmp_path / "again", files, layers))
    with pytest.raises(SpecdraftError, match="needs the fast precision mode"):
        D.build_data(tiny_chat_target, tmp_path / "exact", cfg, quiet=True, prompts=prompts)
