"""Log-probabilities (``GenerateConfig.logprobs``): each emitted token's entry is the target's own
log-softmax at the position that produced it, equal to a plain forward pass over prompt + answer, with
every drafter, alone and in a batch; and the server's ``logprobs`` / ``top_logprobs`` fields."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.batch import Batcher
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.ngram import NgramDrafter
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig
from specdraft.model.llama import causal_mask
from specdraft.verify import Sampling

from test_batch import fast_target, prompts, random_hybrid, run_batch, twin  # noqa: F401 (fixture)


def forward_logprobs(target, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log_softmax of one causal pass over prompt + answer: row i gives the distribution of answer[i]."""
    ids = prompt + answer
    n = len(ids)
    cache = target.model.new_cache(1, n)
    with torch.inference_mode():
        out = target.model(torch.tensor([ids]), torch.arange(n)[None], causal_mask(n, 0, target.device), cache, 0,
                           logits="all")
    return torch.log_softmax(out.logits[0, len(prompt) - 1:n - 1].float(), -1)


def check(result, ref: torch.Tensor, top: int) -> None:
    assert len(result.logprobs) == len(result.token_ids) == ref.shape[0]
    for i, (e, tok) in enumerate(zip(result.logprobs, result.token_ids)):
        assert e.token == tok
        assert e.logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        assert len(e.top) == top
        vals, ids = ref[i].topk(top)
        assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=1e-4)
        assert all(v <= 0 for _, v in e.top)


def drafter(name, target):
    if name == "none":
        return NoDrafter()
    if name == "ngram":
        d = NgramDrafter()
        d.default_budget = 4
        return d
    return random_hybrid(target)


@pytest.mark.parametrize("name", ["none", "ngram", "hybrid"])
def test_logprobs_equal_a_plain_forward_pass_alone_and_batched(fast_target, name):
    ps = prompts((7, 30, 12, 19))
    cfgs = [GenerateConfig(max_new_tokens=n, logprobs=k) for n, k in zip((20, 9, 25, 14), (0, 3, 5, 1))]
    engine = Engine(twin(fast_target), drafter(name, fast_target))
    plain = Engine(twin(fast_target))
    alone = [engine.generate(p, c) for p, c in zip(ps, cfgs)]
    for p, c, r in zip(ps, cfgs, alone):
        check(r, forward_logprobs(fast_target, p, r.token_ids), c.logprobs)
        ref = plain.generate(p, c)
        assert r.token_ids == ref.token_ids
        # the drafter's tree rows give the plain decoding's logits bit for bit: the same numbers
        assert [(e.token, e.logprob, e.top) for e in r.logprobs] == [(e.token, e.logprob, e.top) for e in ref.logprobs]
    seqs = run_batch(Batcher(engine, max_batch=3, prefill_rows=8), list(zip(ps, cfgs)))
    got = {tuple(s.prompt_ids): s.result for s in seqs}
    for p, a in zip(ps, alone):
        b = got[tuple(p)]
        assert b.token_ids == a.token_ids
        assert [(e.token, e.logprob, e.top) for e in b.logprobs] == [(e.token, e.logprob, e.top) for e in a.logprobs]


def test_logprobs_with_sampling_are_the_raw_distribution(fast_target):
    """With a temperature the entries are still the target's own log-softmax (before temperature / top-k)."""
    p = prompts((11,))[0]
    cfg = GenerateConfig(max_new_tokens=12, sampling=Sampling(temperature=0.8, top_k=5), seed=3, logprobs=2)
    r = Engine(twin(fast_target), NgramDrafter()).generate(p, cfg)
    check(r, forward_logprobs(fast_target, p, r.token_ids), 2)
    assert all(math.isfinite(e.logprob) for e in r.logprobs)


def test_streamed_logprobs_come_before_their_text(fast_target):
    p = prompts((9,))[0]
    events = []
    r = Engine(twin(fast_target)).generate(p, GenerateConfig(max_new_tokens=10, logprobs=0),
                                           on_logprobs=lambda es: events.append([e.token for e in es]))
    assert [t for chunk in events for t in chunk] == r.token_ids
    assert r.logprobs is not None and GenerateConfig().logprobs is None
    assert Engine(twin(fast_target)).generate(p, GenerateConfig(max_new_tokens=3)).logprobs is None


@pytest.mark.parametrize("bad", [-1, 21])
def test_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(SpecdraftError, match="logprobs must be in"):
        GenerateConfig(logprobs=bad)


# ---------------------------------------------------------------------- the server's fields
def _server(target, max_batch: int):
    from specdraft.server.app import ServerThread, create_app
    from specdraft.server.queue import RequestQueue

    queue = RequestQueue(Engine(twin(target), NgramDrafter()), model_id="tiny", max_queue=2, max_batch=max_batch,
                         default_max_tokens=12)
    return ServerThread(create_app(queue))


def _post(srv, path: str, body: dict) -> tuple[int, dict | list]:
    from test_server import raw_post, sse
    import json

    status, raw = raw_post(srv, path, json.dumps(body).encode())
    if body.get("stream") and status == 200:
        return status, [json.loads(e) for e in sse(raw) if e != "[DONE]"]
    return status, json.loads(raw)


@pytest.mark.parametrize("max_batch", [1, 3])
def test_server_logprobs_equal_the_offline_ones(tiny_chat_fast, max_batch):
    """Chat ``logprobs`` + ``top_logprobs`` and completions ``logprobs: N``, streamed and not, alone and in a
    batch: the target's own log-probabilities of each emitted token, their bytes spelling the answer."""
    t = tiny_chat_fast
    msgs = [{"role": "user", "content": "Tell me about owls."}]
    ids = t.encode_messages(msgs)
    ref = Engine(twin(t)).generate(ids, GenerateConfig(max_new_tokens=12, logprobs=3))
    want = [(e.logprob, [v for _, v in e.top]) for e in ref.logprobs]
    with _server(t, max_batch) as srv:
        status, r = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 12,
                                                         "logprobs": True, "top_logprobs": 3})
        assert status == 200, r
        content = r["choices"][0]["logprobs"]["content"]
        assert [(c["logprob"], [x["logprob"] for x in c["top_logprobs"]]) for c in content] == want
        assert bytes(b for c in content for b in c["bytes"]).decode() == r["choices"][0]["message"]["content"]
        assert all(c["top_logprobs"][0]["logprob"] >= c["logprob"] for c in content)

        status, chunks = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 12,
                                                              "logprobs": True, "top_logprobs": 3, "stream": True})
        streamed = [c for ch in chunks for c in ((ch["choices"][0].get("logprobs") or {}).get("content") or [])]
        assert [(c["logprob"], [x["logprob"] for x in c["top_logprobs"]]) for c in streamed] == want

        status, r = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 12})
        assert r["choices"][0]["logprobs"] is None  # not asked for: none

        status, r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 12, "logprobs": 2})
        lp = r["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == [e.logprob for e in ref.logprobs]
        assert all(len(d) <= 2 for d in lp["top_logprobs"]) and len(lp["tokens"]) == len(ref.token_ids)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])

        status, chunks = _post(srv, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 12,
                                                         "logprobs": 0, "stream": True})
        got = [x for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
               for x in ch["choices"][0]["logprobs"]["token_logprobs"]]
        assert got == [e.logprob for e in ref.logprobs]


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "auto"),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "logit_bias", {"5": 100}),
    ("/v1/chat/completions", "presence_penalty", 0.5),
    ("/v1/chat/completions", "frequency_penalty", -1.0),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "end"),
    ("/v1/chat/completions", "top_logprobs", 2),  # without logprobs: true
    ("/v1/chat/completions", "top_logprobs", 21),
    ("/v1/completions", "logprobs", 21),
    ("/v1/chat/completions", "logprobs", 3),  # chat's logprobs is a boolean
])
def test_fields_not_implemented_get_a_400_naming_them(tiny_chat_fast, path, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    with _server(tiny_chat_fast, 1) as srv:
        status, r = _post(srv, path, body)
        assert status == 400, r
        assert field in r["error"]["message"] and r["error"]["param"] == field
        # a value that asks for nothing is accepted
        for name, no_op in [("response_format", {"type": "text"}), ("logit_bias", {}), ("presence_penalty", 0),
                            ("tools", []), ("tool_choice", "none"), ("echo", False), ("best_of", 1)]:
            ok = dict(body)
            ok.pop(field)
            ok[name] = no_op
            if (name in ("echo", "best_of")) == ("chat" not in path):
                status, r = _post(srv, path, ok)
                assert status == 200, (name, r)
