"""``specdraft serve``: the real server on a loopback port, driven by the official ``openai`` client.

Most tests use a tiny random model over the real SmolLM2 tokenizer and chat template; one uses
the real default target.  Outputs are compared with offline ``generate`` on the same prompt ids.
"""

from __future__ import annotations

import http.client
import json
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
    r = c.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), len(ref.token_ids), len(ids) + len(ref.token_ids))
    assert u.passes >= 1 and u.tokens_per_pass >= 1.0 and u.drafter == "ngram"

    chunks = list(c.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids) and chunks[-1].usage.tokens_per_pass >= 1.0


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
    path, body = case
    status, raw = raw_post(server, path, body)
    event(f"status {status}")
    assert status in (200, 400, 413, 429), (status, raw[:300])
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
    cancelled = queue.cancelled
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
    assert queue.cancelled == cancelled + 1


def test_disconnecting_non_streaming_client_stops_its_generation(slow_server):
    queue = slow_server.queue
    wait_idle(queue)
    cancelled = queue.cancelled
    body = json.dumps({"model": "slow", "prompt": "Once upon a time", "max_tokens": 200}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", slow_server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 5
    while queue.load()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    conn.close()  # ~10 s of generation left, nobody to send it to
    wait_idle(queue, timeout=5)
    assert queue.cancelled == cancelled + 1


def test_full_queue_is_refused_at_once(slow_server):
    queue = slow_server.queue
    wait_idle(queue)
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
    r = client(slow_server).chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_concurrent_clients_all_answered(server, tiny_chat_target):
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
