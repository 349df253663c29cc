"""``specdraft serve``: the real server on a loopback port, driven by the official ``openai`` client.

Most tests use a tiny random model over the real SmolLM2 tokenizer and chat template; one uses
the real default target.  Outputs are compared with offline ``generate`` on the same prompt ids.
"""

from __future__ import annotations

import http.client
import json
import re
import logging
import math
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from specdraft.drafters import make_drafter  # noqa: E402
from specdraft.drafters.base import NoDrafter  # noqa: E402
from specdraft.drafters.ngram import NgramDrafter  # noqa: E402
from specdraft.generate import GenerateConfig, generate  # noqa: E402
from specdraft.engine import Engine  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.server.app import ServerThread, create_app  # noqa: E402
from specdraft.server.queue import RequestQueue  # noqa: E402
from specdraft.target import Target  # noqa: E402
from specdraft.verify import Sampling  # noqa: E402

MODEL = "tiny-chat"


def twin(t: Target) -> Target:
    """The same weights with their own KV cache (the server's worker and the test never share one)."""
    return Target(t.model, t.tokenizer, t.name, t.weight_hash)


def client(srv: ServerThread) -> "openai.OpenAI":
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def offline(target: Target, ids: list[int], max_tokens: int, drafter=None, **kw):
    return generate(target, ids, drafter or NoDrafter(), GenerateConfig(max_new_tokens=max_tokens, **kw))


@pytest.fixture(scope="module")
def server(tiny_chat_target):
    queue = RequestQueue(Engine(twin(tiny_chat_target), make_drafter("ngram")), model_id=MODEL, max_queue=4, default_max_tokens=12)
    with ServerThread(create_app(queue)) as srv:
        srv.queue = queue
        yield srv


class SlowDrafter(NoDrafter):
    """Plain decoding at ~20 passes/s: long enough generations to disconnect from or queue behind."""

    name = "slow"

    def propose(self, budget):
        time.sleep(0.05)
        return super().propose(budget)


@pytest.fixture(scope="module")
def slow_server(tiny_chat_target):
    queue = RequestQueue(Engine(twin(tiny_chat_target), SlowDrafter()), model_id="slow", max_queue=1, default_max_tokens=200)
    with ServerThread(create_app(queue)) as srv:
        srv.queue = queue
        yield srv


def wait_idle(queue: RequestQueue, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = queue.load()
        if q["running"] == 0 and q["waiting"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the queue is still busy: {queue.load()}")


def counts(queue: RequestQueue) -> dict[str, int]:
    return {k: getattr(queue, k) for k in ("completed", "cancelled", "failed")}


def moved(queue: RequestQueue, before: dict[str, int]) -> dict[str, int]:
    """How far each of the queue's counters moved since ``before = counts(queue)``."""
    return {k: getattr(queue, k) - v for k, v in before.items()}


def sse(raw: bytes) -> list[str]:
    """The data of each server-sent event in a stream's body."""
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), raw[:300]
    return [e[len("data: "):] for e in events]


def raw_post(srv: ServerThread, path: str, body: bytes, timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And a fruit?"},
]


# ---------------------------------------------------------------------- happy paths
def test_models_and_health(server):
    c = client(server)
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    health = json.loads(resp.read())
    assert resp.status == 200 and health["status"] == "ok" and health["model"] == MODEL
    assert health["drafter"] == "ngram" and health["queue"]["capacity"] == 5


def test_chat_equals_offline_greedy(server, tiny_chat_target):
    c = client(server)
    ids = tiny_chat_target.encode_messages(CONVERSATION)
    ref = offline(tiny_chat_target, ids, 20)
    spec = offline(tiny_chat_target, ids, 20, drafter=make_drafter("ngram"))  # the server's drafter, for its stats
    assert spec.text == ref.text and spec.stats.passes >= 1
    assert spec.stats.tokens_per_pass == spec.stats.committed / spec.stats.passes
    stats = {"passes": spec.stats.passes, "tokens_per_pass": round(spec.stats.committed / spec.stats.passes, 4),
             "accept_hist": {str(k): v for k, v in spec.stats.accept_hist.items()}, "drafter": "ngram"}
    r = c.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), len(ref.token_ids), len(ids) + len(ref.token_ids))
    assert {k: getattr(u, k) for k in stats} == stats

    chunks = list(c.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert {k: getattr(chunks[-1].usage, k) for k in stats} == stats


def test_one_user_message_uses_the_same_ids_as_generate(tiny_chat_target):
    msg = "Write a haiku about the sea."
    assert tiny_chat_target.encode_messages([{"role": "user", "content": msg}]) == tiny_chat_target.encode_prompt(msg)


def test_completion_equals_offline_greedy(server, tiny_chat_target):
    c = client(server)
    prompt = "The quick brown fox"
    ids = tiny_chat_target.encode_prompt(prompt, raw=True)
    ref = offline(tiny_chat_target, ids, 16)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.prompt_tokens == len(ids)
    pieces = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                                 temperature=0, stream=True)]
    assert "".join(pieces) == ref.text
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)  # token ids
    assert r.choices[0].text == ref.text


def test_stop_and_defaults(server, tiny_chat_target):
    c = client(server)
    msgs = [{"role": "user", "content": "Tell me a story."}]
    ids = tiny_chat_target.encode_messages(msgs)
    full = offline(tiny_chat_target, ids, 12)  # the server's default max_tokens is 12
    r = c.chat.completions.create(model=MODEL, messages=msgs)
    assert r.choices[0].message.content == full.text and r.choices[0].finish_reason == "length"
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip()
    r = c.chat.completions.create(model=MODEL, messages=msgs, stop=[stop, "never-there"], temperature=0)
    assert r.choices[0].message.content == full.text[: full.text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seeded_sampling_equals_offline(server, tiny_chat_target):
    c = client(server)
    msgs = [{"role": "user", "content": "Say something."}]
    ids = tiny_chat_target.encode_messages(msgs)
    ref = offline(tiny_chat_target, ids, 16, drafter=NgramDrafter(), sampling=Sampling(temperature=0.9, top_p=0.95), seed=7)
    got = [c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0.9, top_p=0.95,
                                     seed=7).choices[0].message.content for _ in range(2)]
    assert got == [ref.text, ref.text]


def test_default_target_chat_and_stream_equal_offline_greedy(default_target):
    queue = RequestQueue(Engine(twin(default_target), make_drafter("ngram", default_target)), max_queue=2)
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = default_target.encode_messages(msgs)
    ref = offline(default_target, ids, 24)
    with ServerThread(create_app(queue)) as srv:
        c = client(srv)
        r = c.chat.completions.create(model=default_target.name, messages=msgs, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == ref.text and ref.text.strip()
        assert r.usage.completion_tokens == len(ref.token_ids)
        stream = c.chat.completions.create(model=default_target.name, messages=msgs, max_tokens=24, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == ref.text


# ---------------------------------------------------------------------- bad requests
BAD = [
    (b"", "not valid JSON"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"{}", "model: Field required"),
    (json.dumps({"model": MODEL}).encode(), "messages: Field required"),
    (json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode(), "not found"),
    (json.dumps({"model": MODEL, "messages": []}).encode(), "messages"),
    (json.dumps({"model": MODEL, "messages": [{"role": "tool", "content": "hi"}]}).encode(), "role"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode(), "content"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), "messages"),
    (json.dumps({"model": 3, "messages": [{"role": "user", "content": "hi"}]}).encode(), "model"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -0.1}).encode(), "temperature"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}).encode(), "temperature"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": True}).encode(), "temperature"),
    (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}).encode(), "top_p"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}).encode(), "top_p"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}).encode(), "seed"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}).encode(), "n"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}).encode(), "stop"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [""]}).encode(), "stop"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}).encode(), "stream"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 400}]}).encode(), "context"),
]
BAD_COMPLETIONS = [
    (json.dumps({"model": MODEL}).encode(), "prompt: Field required"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), "empty"),
    (json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode(), "one prompt"),
    (json.dumps({"model": MODEL, "prompt": []}).encode(), "prompt"),
    (json.dumps({"model": MODEL, "prompt": [1, 10**9]}).encode(), "token ids"),
    (json.dumps({"model": MODEL, "prompt": {"text": "a"}}).encode(), "prompt"),
]


@pytest.mark.parametrize("body,expect", BAD)
def test_bad_chat_requests_get_400(server, body, expect):
    status, raw = raw_post(server, "/v1/chat/completions", body)
    err = json.loads(raw)["error"]
    assert status == 400, raw
    assert expect in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,expect", BAD_COMPLETIONS)
def test_bad_completion_requests_get_400(server, body, expect):
    status, raw = raw_post(server, "/v1/completions", body)
    assert status == 400 and expect in json.loads(raw)["error"]["message"], raw


def test_client_errors_are_openai_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="not found"):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=MODEL, prompt="hi", temperature=5)
    status, raw = raw_post(server, "/v1/nothing", b"{}")
    assert status == 404 and "error" in json.loads(raw)
    status, raw = raw_post(server, "/v1/chat/completions", b"x" * (5 << 20))
    assert status == 413


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", ""]) | JSON,
     "content": st.text(max_size=40) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2) | JSON})
VALID_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]),
     "content": st.text(max_size=40) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2)})
FIELDS = {
    "model": st.just(MODEL) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=4) | st.lists(st.text(max_size=5), max_size=2) | JSON,
    "max_tokens": st.integers(-2, 24) | st.integers() | JSON,
    "max_completion_tokens": st.integers(-2, 24) | JSON,
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON,
    "top_k": st.integers(-3, 50) | JSON,
    "seed": st.integers() | JSON,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "n": st.integers(-1, 3) | JSON,
}
GOOD = {  # in range: these requests run a generation
    "max_tokens": st.integers(1, 16),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}


def near_valid(path: str, required: dict):
    """A valid request (random in-range options), sometimes with one field replaced by anything."""
    valid = st.fixed_dictionaries(required, optional=GOOD)
    mutated = st.tuples(valid, st.sampled_from(sorted(FIELDS)), st.data()).map(
        lambda t: {**t[0], t[1]: t[2].draw(FIELDS[t[1]])})
    return st.tuples(st.just(path), (valid | mutated).map(lambda d: json.dumps(d).encode()))


ANY_PATH = st.sampled_from(["/v1/chat/completions", "/v1/completions"])
CASES = st.one_of(
    near_valid("/v1/chat/completions", {"model": st.just(MODEL), "messages": st.lists(VALID_MESSAGE, min_size=1, max_size=3)}),
    near_valid("/v1/completions", {"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=40)}),
    st.tuples(ANY_PATH, st.fixed_dictionaries({}, optional=FIELDS).map(lambda d: json.dumps(d).encode())),
    st.tuples(ANY_PATH, JSON.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=40)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=CASES)
def test_fuzzed_requests_never_get_500(server, case):
    queue = server.queue
    before = counts(queue)
    path, body = case
    status, raw = raw_post(server, path, body)
    event(f"status {status}")
    # one request at a time: never a full queue (429), and each answered request has freed its slot
    assert status in (200, 400, 413), (status, raw[:300])
    q = queue.load()
    assert (q["running"], q["waiting"]) == (0, 0), q
    assert moved(queue, before) == {"completed": 1 if status == 200 else 0, "cancelled": 0, "failed": 0}
    if status != 200:
        assert json.loads(raw)["error"]["message"]
    elif raw.startswith(b"data:"):
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert all("error" not in json.loads(e[6:]) for e in events[:-1]), raw[:300]
    else:
        assert json.loads(raw)["usage"]["completion_tokens"] >= 0


# ---------------------------------------------------------------------- queue and disconnects
def test_disconnecting_stream_frees_the_server(slow_server):
    queue = slow_server.queue
    wait_idle(queue)
    before = counts(queue)
    c = client(slow_server)
    msgs = [{"role": "user", "content": "Write a long story."}]
    t0 = time.monotonic()
    stream = c.chat.completions.create(model="slow", messages=msgs, max_tokens=200, stream=True)
    it = iter(stream)
    next(it), next(it), next(it)  # the role chunk and two pieces of text: the generation is running
    stream.close()  # ~10 s of generation left
    r = c.chat.completions.create(model="slow", messages=msgs, max_tokens=3)
    assert r.usage.completion_tokens == 3
    assert time.monotonic() - t0 < 7, "the next request waited for the abandoned generation"
    assert moved(queue, before) == {"completed": 1, "cancelled": 1, "failed": 0}


def test_disconnecting_non_streaming_client_stops_its_generation(slow_server):
    queue = slow_server.queue
    wait_idle(queue)
    before = counts(queue)
    body = json.dumps({"model": "slow", "prompt": "Once upon a time", "max_tokens": 200}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", slow_server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 5
    while queue.load()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    conn.close()  # ~10 s of generation left, nobody to send it to
    wait_idle(queue, timeout=5)
    assert moved(queue, before) == {"completed": 0, "cancelled": 1, "failed": 0}


def test_full_queue_is_refused_at_once(slow_server):
    queue = slow_server.queue
    wait_idle(queue)
    before = counts(queue)
    body = json.dumps({"model": "slow", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 200,
                       "stream": True}).encode()
    conns = []
    try:
        for _ in range(queue.capacity):  # one running, max_queue waiting
            conn = http.client.HTTPConnection("127.0.0.1", slow_server.port, timeout=30)
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            conns.append((conn, resp))
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError, match="busy"):
            client(slow_server).chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=2)
        with pytest.raises(openai.RateLimitError):
            client(slow_server).completions.create(model="slow", prompt="hi", max_tokens=2, stream=True)
        assert time.monotonic() - t0 < 2
    finally:
        for conn, resp in conns:
            resp.close()
            conn.close()
    wait_idle(queue)  # both abandoned generations (running and queued) were dropped
    assert moved(queue, before) == {"completed": 0, "cancelled": queue.capacity, "failed": 0}
    r = client(slow_server).chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert moved(queue, before) == {"completed": 1, "cancelled": queue.capacity, "failed": 0}


def test_concurrent_clients_all_answered(server, tiny_chat_target):
    wait_idle(server.queue)
    before = counts(server.queue)
    prompts = [f"Question number {i}?" for i in range(4)]
    refs = {p: offline(tiny_chat_target, tiny_chat_target.encode_messages([{"role": "user", "content": p}]), 10).text
            for p in prompts}
    got: dict[str, str] = {}

    def ask(p: str) -> None:
        r = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=10)
        got[p] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == refs
    assert moved(server.queue, before) == {"completed": len(prompts), "cancelled": 0, "failed": 0}


def test_concurrent_streams_and_seeded_samples_equal_offline(server, tiny_chat_target):
    """Streaming greedy and seeded sampling requests at once (the queue's whole capacity): each answer is
    the offline ``generate`` of its own request, with the server's drafter kind for the sampled ones."""
    queue = server.queue
    wait_idle(queue)
    before = counts(queue)
    greedy = {f"Story number {i}, please.": None for i in range(2)}
    seeds = [3, 11, 2**40 + 5]
    msgs = [{"role": "user", "content": "Say something."}]
    ids = tiny_chat_target.encode_messages(msgs)
    refs = {p: offline(tiny_chat_target, tiny_chat_target.encode_messages([{"role": "user", "content": p}]), 12)
            for p in greedy}
    sampled_refs = {seed: offline(tiny_chat_target, ids, 12, drafter=make_drafter("ngram"),
                                  sampling=Sampling(temperature=0.8, top_p=0.9), seed=seed) for seed in seeds}
    assert len({r.text for r in sampled_refs.values()}) == len(seeds)  # a mixed-up seed would show
    assert len(greedy) + len(seeds) == queue.capacity
    got: dict = {}
    start = threading.Barrier(queue.capacity)

    def stream(p: str) -> None:
        c = client(server)
        start.wait(10)
        chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=12,
                                                temperature=0, stream=True))
        got[p] = ("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
                  [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1])

    def sample(seed: int) -> None:
        c = client(server)
        start.wait(10)
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0.8, top_p=0.9, seed=seed)
        got[seed] = (r.choices[0].message.content, r.choices[0].finish_reason)

    threads = [threading.Thread(target=stream, args=(p,)) for p in greedy]
    threads += [threading.Thread(target=sample, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = {k: (r.text, r.finish_reason) for k, r in {**refs, **sampled_refs}.items()}
    assert got == want
    assert moved(queue, before) == {"completed": queue.capacity, "cancelled": 0, "failed": 0}


class FailingDrafter(NoDrafter):
    """Plain decoding whose ``propose`` raises on pass ``fail_at`` of every generation (shorter ones succeed)."""

    name = "failing"

    def __init__(self, fail_at: int = 4) -> None:
        super().__init__()
        self.fail_at, self.passes = fail_at, 0

    def reset(self, prompt_ids, first_token, prefill) -> None:
        super().reset(prompt_ids, first_token, prefill)
        self.passes = 0

    def propose(self, budget):
        self.passes += 1
        if self.passes == self.fail_at:
            raise RuntimeError("the drafter broke")
        return super().propose(budget)


def test_generation_error_mid_stream_gives_an_error_event_then_done(tiny_chat_target):
    queue = RequestQueue(Engine(twin(tiny_chat_target), FailingDrafter(fail_at=4)), model_id="failing", max_queue=1)
    msgs = [{"role": "user", "content": "Write a long story."}]
    ids = tiny_chat_target.encode_messages(msgs)
    full = offline(tiny_chat_target, ids, 20)
    head = offline(tiny_chat_target, ids, 4)  # the prefill's token and 3 passes: what comes before the failure
    assert len(full.token_ids) == 20 and full.text.startswith(head.text) and head.text
    body = {"model": "failing", "messages": msgs, "max_tokens": 20}
    with ServerThread(create_app(queue)) as srv:
        before = counts(queue)
        status, raw = raw_post(srv, "/v1/chat/completions", json.dumps({**body, "stream": True}).encode())
        assert status == 200
        events = sse(raw)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert error == {"error": {"message": "generation stopped: RuntimeError", "type": "server_error",
                                   "param": None, "code": None}}
        chunks = [json.loads(e) for e in events[:-2]]
        assert all("error" not in ch for ch in chunks)
        assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks)  # it never claims to have finished
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
        assert text and head.text.startswith(text), (text, head.text)  # the text up to the failure, no more
        wait_idle(queue)
        assert moved(queue, before) == {"completed": 0, "cancelled": 0, "failed": 1}

        status, raw = raw_post(srv, "/v1/chat/completions", json.dumps(body).encode())  # the same, not streamed
        assert status == 500, raw
        assert json.loads(raw) == {"error": {"message": "internal error: RuntimeError", "type": "server_error",
                                             "param": None, "code": None}}
        wait_idle(queue)
        assert moved(queue, before) == {"completed": 0, "cancelled": 0, "failed": 2}

        r = client(srv).chat.completions.create(model="failing", messages=msgs, max_tokens=3)  # 2 passes: no failure
        assert r.choices[0].message.content == offline(tiny_chat_target, ids, 3).text
        assert moved(queue, before) == {"completed": 1, "cancelled": 0, "failed": 2}


def test_shutdown_ends_open_requests_and_cancels_their_generations(tiny_chat_target):
    """Stopping the server with two streams open on a slow drafter (one generating, one waiting) and a
    non-streaming request waiting behind them: after the grace each stream ends properly with an
    ``error`` event then ``data: [DONE]`` (its connection is not cut mid-body), the non-streaming
    request gets a 503, all three generations are cancelled, and the queue refuses new work."""
    queue = RequestQueue(Engine(twin(tiny_chat_target), SlowDrafter()), model_id="slow", max_queue=2, default_max_tokens=200)
    msgs = [{"role": "user", "content": "Write a long story."}]
    body = json.dumps({"model": "slow", "messages": msgs, "max_tokens": 200, "stream": True}).encode()  # ~10 s each
    grace = 0.3
    results: dict[int, tuple[bytes, bool]] = {}

    def drain(i: int, resp: http.client.HTTPResponse, head: bytes) -> None:
        try:
            results[i] = (head + resp.read(), True)
        except http.client.IncompleteRead as e:  # the connection closed mid-body
            results[i] = (head + e.partial, False)

    def post() -> None:
        results[2] = raw_post(srv, "/v1/chat/completions", json.dumps({"model": "slow", "messages": msgs}).encode())

    stop = 10.0  # generous: on a loaded machine ending the responses may take a while; they must end, not be cut
    with ServerThread(create_app(queue), grace_s=grace, stop_s=stop) as srv:
        before = counts(queue)
        opened = []
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            opened.append((conn, resp))
        head = b""
        while not re.search(rb'"content": "[^"]', head):  # a chunk with text (the role chunk's content is ""): streaming
            head += opened[0][1].readline()
        threads = [threading.Thread(target=drain, args=(i, resp, head if i == 0 else b""))
                   for i, (conn, resp) in enumerate(opened)] + [threading.Thread(target=post)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while queue.load()["waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (queue.load()["running"], queue.load()["waiting"]) == (1, 2)
        t0 = time.monotonic()
    took = time.monotonic() - t0  # leaving the block shuts the server down and waits for it
    for t in threads:
        t.join(10)
    for conn, _ in opened:
        conn.close()
    assert took < grace + stop, f"shutdown took {took:.1f} s: the requests were cut, not ended"
    for i in range(2):
        raw, complete = results[i]
        assert complete, raw[-300:]
        events = sse(raw)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]) == {"error": {"message": "the generation was cancelled (server shutting down)",
                                                    "type": "server_error", "param": None, "code": None}}
        chunks = [json.loads(e) for e in events[:-2]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks)
        texts = [ch["choices"][0]["delta"]["content"] for ch in chunks[1:]]
        if i == 0:  # it was generating
            assert texts and all(texts), texts
        else:  # it was waiting: it never started
            assert texts == []
    status, raw = results[2]
    assert status == 503 and json.loads(raw)["error"]["message"] == "the generation was cancelled (server shutting down)"
    assert moved(queue, before) == {"completed": 0, "cancelled": 3, "failed": 0}
    assert (queue.load()["running"], queue.load()["waiting"]) == (0, 0)
    assert queue.submit(queue.target.encode_prompt("hi", raw=True), queue.config(2, None, None, None, None, [])) is None
    assert queue.load()["waiting"] == 0


def test_client_leaving_while_its_body_is_read_is_a_disconnect(server, caplog):
    """A client that sends its headers and part of its body, then closes: handled as a disconnect
    (logged at info), not as an internal error, and the server goes on serving."""
    caplog.set_level(logging.INFO, logger="specdraft.server")
    before = counts(server.queue)
    part = b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "'
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(part) + 100_000}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + part)
        time.sleep(0.2)  # the handler is waiting for the rest of the body
    deadline = time.monotonic() + 5
    while not [r for r in caplog.records if r.name == "specdraft.server"] and time.monotonic() < deadline:
        time.sleep(0.02)
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "specdraft.server"]
    assert records == [(logging.INFO, "client disconnected before its request body was read")]
    r = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert moved(server.queue, before) == {"completed": 1, "cancelled": 0, "failed": 0}


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -1.0])
def test_bad_default_temperature_fails_at_construction(tiny_chat_target, temperature):
    with pytest.raises(SpecdraftError, match="temperature"):
        RequestQueue(Engine(twin(tiny_chat_target)), default_temperature=temperature)
