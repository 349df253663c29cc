"""``specdraft generate`` end to end on the real default target, and the generate loop's stops."""

from __future__ import annotations

import json

from specdraft import cli
from specdraft.generate import GenerateConfig, generate


def test_generate_json(capsys, default_target):
    rc = cli.main(["generate", "What is 2+2?", "--json", "--max-new-tokens", "12", "--drafter", "ngram"])
    out = capsys.readouterr().out
    assert rc == 0
    obj = json.loads(out)
    assert set(obj) >= {"text", "token_ids", "stats"}
    assert set(obj["stats"]) >= {"new_tokens", "passes", "tokens_per_pass", "wall_s", "tok_s"}
    assert obj["stats"]["new_tokens"] == len(obj["token_ids"]) <= 12
    assert obj["text"].strip()


def test_generate_streams_text_and_stats(capsys, default_target):
    rc = cli.main(["generate", "Name a colour.", "--max-new-tokens", "8", "--drafter", "none"])
    cap = capsys.readouterr()
    assert rc == 0 and cap.out.strip()
    assert "tokens/pass" in cap.err


def test_streamed_text_equals_final_text(default_target):
    ids = default_target.encode_prompt("Count from one to ten in words.")
    pieces: list[str] = []
    r = generate(default_target, ids, None, GenerateConfig(max_new_tokens=40), on_text=pieces.append)
    assert "".join(pieces) == r.text


def test_stop_string(default_target):
    ids = default_target.encode_prompt("Count from one to ten in words, separated by commas.")
    full = generate(default_target, ids, None, GenerateConfig(max_new_tokens=40))
    assert len(full.text) > 20
    stop = full.text[12:15]  # a piece of what greedy decoding writes anyway
    pieces: list[str] = []
    r = generate(default_target, ids, None, GenerateConfig(max_new_tokens=40, stop=[stop]), on_text=pieces.append)
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.find(stop)]
    assert "".join(pieces) == r.text


def test_max_new_tokens_respected_with_drafter(default_target):
    from specdraft.drafters.ngram import NgramDrafter

    ids = default_target.encode_prompt("Repeat the word 'apple' twenty times.")
    for n in (1, 3, 17):
        r = generate(default_target, ids, NgramDrafter(), GenerateConfig(max_new_tokens=n))
        assert len(r.token_ids) <= n


def test_generate_verbose_says_what_runs_the_passes(capsys, default_target):
    from specdraft.model import fast

    rc = cli.main(["generate", "Name a colour.", "--max-new-tokens", "4", "--drafter", "none", "--verbose"])
    err = capsys.readouterr().err
    assert rc == 0
    assert f"precision fast, kernel {fast.isa()}, blocks {{'Q4_1': " in err  # the default GGUF: Q4_1 and Q8_0 blocks
    assert "'Q8_0': " in err
