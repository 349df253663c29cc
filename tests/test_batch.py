"""Continuous batching (``specdraft.batch``): every request's tokens equal its offline run, token for token,
whatever shares its passes: mixed prompt lengths, chunked prompts, joins and leaves between passes,
drafters that read the target's features, seeded sampling, cancellation, and the budget rule."""

from __future__ import annotations

import threading

import pytest
import torch

from specdraft.batch import Batcher, SlotCache
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.block import BlockDrafter
from specdraft.drafters.budget import batch_budget, pass_ratio
from specdraft.drafters.hybrid import HybridDrafter, HybridOptions
from specdraft.drafters.ngram import NgramDrafter
from specdraft.engine import Cancelled, Engine
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig
from specdraft.model.llama import FINAL
from specdraft.model.load import build_model, load_hf_folder
from specdraft.nn.block import BlockConfig, BlockModel
from specdraft.nn.hybrid import HybridConfig, HybridModel
from specdraft.target import Target
from specdraft.tree import Tree
from specdraft.verify import Sampling

from conftest import make_tiny_hf


@pytest.fixture(scope="module")
def fast_target(tmp_path_factory) -> Target:
    path = tmp_path_factory.mktemp("tiny_batch")
    make_tiny_hf("llama", path, scale=3.0)
    w = load_hf_folder(path)
    t = Target(build_model(w, precision="fast"), tokenizer=None, name=w.name, weight_hash=w.weight_hash)
    assert t.precision == "fast"
    return t


def twin(t: Target) -> Target:
    return Target(t.model, t.tokenizer, t.name, t.weight_hash)


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats in them (so prompt lookup finds matches) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        motif = torch.randint(2, 96, (5,), generator=g).tolist()
        noise = torch.randint(2, 96, (n,), generator=g).tolist()
        out.append([motif[i % 5] if i % 3 else noise[i] for i in range(n)])
    return out


class OracleDrafter:
    """Drafts the offline answer's next tokens on one branch (so whole paths are accepted) and a random
    sibling at every depth (so rejected rows sit between accepted ones); knows the answers by prompt."""

    name = "oracle"
    hidden_layers: tuple[int, ...] = ()
    default_budget = 6

    def __init__(self, answers: dict[tuple, list[int]], seed: int = 0) -> None:
        self.answers, self.seed = answers, seed
        self.fork_count = 0

    def fork(self) -> "OracleDrafter":
        self.fork_count += 1
        return OracleDrafter(self.answers, self.seed + self.fork_count)

    def reset(self, prompt_ids, first_token, prefill) -> None:
        self.answer, self.done = self.answers[tuple(prompt_ids)], 1
        self.gen = torch.Generator().manual_seed(self.seed)

    def propose(self, budget: int) -> Tree:
        root = self.answer[self.done - 1]
        truth = self.answer[self.done:self.done + budget // 2]
        tokens, parents, node = [root], [-1], 0
        for tok in truth:
            wrong = int(torch.randint(2, 96, (1,), generator=self.gen))
            if wrong != tok:
                tokens.append(wrong)
                parents.append(node)
            tokens.append(tok)
            parents.append(node)
            node = len(tokens) - 1
        return Tree(tokens, parents)

    def commit(self, accepted, out) -> None:
        self.done += len(accepted.new_tokens)


def random_hybrid(target: Target, seed: int = 0) -> HybridDrafter:
    torch.manual_seed(seed)
    cfg = HybridConfig.for_target(target.config, serial=1, parallel=2, head_blocks=1, feature_layers=(1, FINAL))
    tm = target.model
    m = HybridModel(cfg, tm.embed.weight, tm.lm_head.weight, torch.arange(target.config.vocab_size))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    d = HybridDrafter(m.eval(), HybridOptions(topk=4, beams=4))
    d.default_budget = 5
    return d


def random_block(target: Target, seed: int = 0) -> BlockDrafter:
    torch.manual_seed(seed)
    cfg = BlockConfig.for_target(target.config, layers=1, block_size=4, feature_layers=(1, FINAL), modes=2)
    tm = target.model
    m = BlockModel(cfg, tm.embed.weight, tm.lm_head.weight, torch.arange(target.config.vocab_size))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    d = BlockDrafter(m.eval())
    d.default_budget = 5
    return d


def run_batch(batcher: Batcher, work: list[tuple[list[int], GenerateConfig]], join_every: int = 3) -> list:
    """Start up to max_batch requests, then one more every ``join_every`` passes or whenever one leaves."""
    pending, seqs, passes = list(work), [], 0
    while pending and len(batcher.live) < batcher.max_batch:
        seqs.append(batcher.add(*pending.pop(0)))
    while batcher.live or pending:
        left = batcher.step()
        passes += 1
        joins = len(left) + (1 if passes % join_every == 0 else 0)
        for _ in range(joins):
            if pending and len(batcher.live) < batcher.max_batch:
                seqs.append(batcher.add(*pending.pop(0)))
    return seqs


LENGTHS = (3, 41, 9, 70, 17, 5, 28, 12)


@pytest.mark.parametrize("drafter", ["none", "ngram", "oracle", "hybrid", "block"])
def test_batched_greedy_equals_offline(fast_target, drafter):
    """Mixed prompt lengths, prompts chunked over passes (8 rows a pass), requests joining and leaving
    between passes, max tokens and EOS ends: every answer equals offline ``generate``, bit for bit."""
    ps = prompts(LENGTHS)
    cfgs = [GenerateConfig(max_new_tokens=n) for n in (30, 12, 40, 25, 33, 8, 20, 1)]
    plain = Engine(twin(fast_target))
    refs = [plain.generate(p, c).token_ids for p, c in zip(ps, cfgs)]
    d = {"none": NoDrafter(), "ngram": NgramDrafter(), "hybrid": random_hybrid(fast_target),
         "block": random_block(fast_target),
         "oracle": OracleDrafter({tuple(p): r for p, r in zip(ps, refs)})}[drafter]
    if drafter == "ngram":
        d.default_budget = 4
    engine = Engine(twin(fast_target), d)
    alone = [engine.generate(p, c) for p, c in zip(ps, cfgs)]
    assert [a.token_ids for a in alone] == refs  # speculative == plain, single stream (the engine's promise)
    batcher = Batcher(engine, max_batch=4, prefill_rows=8)
    seqs = run_batch(batcher, list(zip(ps, cfgs)))
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    got = {tuple(s.prompt_ids): s.result for s in seqs}
    for p, a in zip(ps, alone):
        r = got[tuple(p)]
        assert r.token_ids == a.token_ids
        assert r.finish_reason == a.finish_reason
    if drafter == "oracle":  # whole paths were accepted inside shared passes
        assert max(max(got[tuple(p)].stats.accept_hist, default=0) for p in ps) >= 2
    assert batcher.live == [] and batcher.slots.used == {}  # every range freed


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_seeded_sampling_in_a_batch_equals_the_same_seed_alone(fast_target, drafter):
    ps = prompts((6, 30, 12, 50))
    s = Sampling(temperature=1.0, top_k=20, top_p=0.9)
    cfgs = [GenerateConfig(max_new_tokens=24, sampling=s, seed=seed) for seed in (1, 2, 3, 4)]
    d = NgramDrafter() if drafter == "ngram" else random_hybrid(fast_target)
    d.default_budget = 3
    engine = Engine(twin(fast_target), d)
    alone = [engine.generate(p, c).token_ids for p, c in zip(ps, cfgs)]
    seqs = run_batch(Batcher(engine, max_batch=3, prefill_rows=16), list(zip(ps, cfgs)))
    got = {tuple(x.prompt_ids): x.result.token_ids for x in seqs}
    assert [got[tuple(p)] for p in ps] == alone
    assert len({tuple(a) for a in alone}) == 4  # the seeds made different samples


def test_a_cancelled_request_frees_its_slots_and_the_others_are_unaffected(fast_target):
    ps = prompts((10, 20, 15))
    cfg = GenerateConfig(max_new_tokens=30)
    engine = Engine(twin(fast_target), NgramDrafter())
    refs = [engine.generate(p, cfg).token_ids for p in ps]
    b = Batcher(engine, max_batch=3)
    flag = threading.Event()
    seqs = [b.add(ps[0], cfg), b.add(ps[1], cfg, cancel=flag), b.add(ps[2], cfg)]
    for _ in range(5):
        b.step()
    base = seqs[1].base
    assert base in b.slots.used
    flag.set()
    left = b.step()
    assert seqs[1] in left and isinstance(seqs[1].error, Cancelled) and seqs[1].result is None
    assert base not in b.slots.used and seqs[1] not in b.live
    late = b.add(ps[1], cfg)  # the freed range is the first that fits again
    assert late.base == base
    b.run()
    assert [seqs[0].result.token_ids, late.result.token_ids, seqs[2].result.token_ids] == refs


class FailingDrafter(NgramDrafter):
    """Prompt lookup that raises at its third tree for one prompt (a drafter bug)."""

    def __init__(self, bad: list[int], config=None) -> None:
        super().__init__(config)
        self.bad, self.calls = bad, 0

    def fork(self) -> "FailingDrafter":
        new = FailingDrafter(self.bad, self.cfg)
        new.default_budget = self.default_budget
        return new

    def reset(self, prompt_ids, first_token, prefill) -> None:
        super().reset(prompt_ids, first_token, prefill)
        self.failing = list(prompt_ids) == self.bad

    def propose(self, budget: int) -> Tree:
        self.calls += 1
        if self.failing and self.calls == 3:
            raise RuntimeError("drafter bug")
        return super().propose(budget)


def test_a_failing_drafter_fails_only_its_own_request(fast_target):
    ps = prompts((10, 20, 15))
    cfg = GenerateConfig(max_new_tokens=20)
    d = FailingDrafter(ps[1])
    d.default_budget = 8  # R = 9 without a curve: 2 nodes each for three requests, so it drafts
    refs = [Engine(twin(fast_target)).generate(p, cfg).token_ids for p in ps]
    b = Batcher(Engine(twin(fast_target), d), max_batch=3)
    seqs = [b.add(p, cfg) for p in ps]
    b.run()
    assert isinstance(seqs[1].error, RuntimeError) and seqs[1].result is None
    assert [seqs[0].result.token_ids, seqs[2].result.token_ids] == [refs[0], refs[2]]
    assert b.slots.used == {}


def test_bad_requests_are_refused_and_lose_nothing(fast_target):
    b = Batcher(Engine(twin(fast_target)), max_batch=1)
    with pytest.raises(SpecdraftError, match="empty"):
        b.add([], GenerateConfig())
    with pytest.raises(SpecdraftError, match="context"):
        b.add([5] * fast_target.config.max_position, GenerateConfig())
    with pytest.raises(SpecdraftError, match="max new tokens"):
        b.add([5, 6], GenerateConfig(max_new_tokens=0))
    s = b.add([5, 6], GenerateConfig(max_new_tokens=4))
    with pytest.raises(SpecdraftError, match="full"):
        b.add([5, 6], GenerateConfig(max_new_tokens=4))
    b.run()
    assert s.result.token_ids == Engine(twin(fast_target)).generate([5, 6], GenerateConfig(max_new_tokens=4)).token_ids


def test_batching_refuses_the_exact_mode(tiny_llama):
    _, target, _ = tiny_llama
    exact = Target(target.model, None, target.name, target.weight_hash)
    if exact.precision == "fast":
        pytest.skip("this tiny model loads in the fast mode")
    with pytest.raises(SpecdraftError, match="fast precision mode"):
        Batcher(Engine(exact), max_batch=2)


def test_slot_cache_grows_without_moving_ranges(fast_target):
    sc = SlotCache(fast_target.model, size=16, rows=4)
    a = sc.alloc(10)
    sc.cache.kv[..., a:a + 10, :] = 1.5
    b = sc.alloc(12)  # does not fit: the cache doubles, range a keeps its slots and contents
    assert sc.size >= 22 and b >= 10 and sc.scratch == sc.size
    assert bool((sc.cache.kv[..., a:a + 10, :] == 1.5).all())
    sc.release(a)
    assert sc.alloc(10) == a  # first fit reuses the freed range
    sc.fit_rows(40)
    assert sc.cache.max_slots >= sc.size + 40


def test_a_range_grows_in_place_or_moves_with_its_kv_and_the_cache_shrinks_back(fast_target):
    sc = SlotCache(fast_target.model, size=16, rows=4)
    a, b = sc.alloc(4), sc.alloc(4)
    sc.cache.kv[..., a:a + 4, :], sc.cache.kv[..., b:b + 4, :] = 1.0, 2.0
    assert sc.extend(b, 8, 4) == b and sc.used[b] == 8  # the slots after it are free: in place
    moved = sc.extend(a, 6, 3)  # b sits right after it: it moves, its first 3 slots' K/V with it
    assert moved != a and sc.used[moved] == 6 and a not in sc.used
    assert bool((sc.cache.kv[..., moved:moved + 3, :] == 1.0).all())
    assert bool((sc.cache.kv[..., b:b + 4, :] == 2.0).all())
    assert sc.extend(moved, 300, 3) == moved  # the last range, past the end: the cache grows under it
    assert sc.size >= moved + 300 and bool((sc.cache.kv[..., moved:moved + 3, :] == 1.0).all())
    assert bool((sc.cache.kv[..., b:b + 4, :] == 2.0).all())
    sc.release(moved)
    big = sc.size
    sc.shrink()  # only b is left: the free tail goes
    assert sc.size < big and sc.size >= 2 * (b + 8) and bool((sc.cache.kv[..., b:b + 4, :] == 2.0).all())
    rest = sc.alloc(sc.size - b - 8)
    assert rest == b + 8 and sc.free == [(0, b)]  # the free list covers the rest, no more
    sc.release(rest)
    sc.release(b)
    sc.shrink()
    assert (sc.size, sc.rows) == (16, 4) and sc.free == [(0, 16)] and sc.cache.max_slots == 20


@pytest.mark.parametrize("drafter", ["oracle", "hybrid"])
def test_growing_and_moving_ranges_change_no_answer(fast_target, drafter, monkeypatch):
    """Ranges that start small and grow by a few slots at a time (in place, moved, the cache regrown and
    shrunk between): every answer still equals offline ``generate``, bit for bit."""
    import specdraft.batch
    import specdraft.target

    monkeypatch.setattr(specdraft.batch, "GROW_SLOTS", 2)
    monkeypatch.setattr(specdraft.target, "GROW_SLOTS", 2)  # the single stream's cache grows too
    ps = prompts(LENGTHS)
    cfgs = [GenerateConfig(max_new_tokens=n) for n in (60, 42, 50, 25, 53, 18, 40, 31)]
    plain = Engine(twin(fast_target))
    refs = [plain.generate(p, c).token_ids for p, c in zip(ps, cfgs)]
    d = random_hybrid(fast_target) if drafter == "hybrid" else OracleDrafter({tuple(p): r for p, r in zip(ps, refs)})
    engine = Engine(twin(fast_target), d)
    batcher = Batcher(engine, max_batch=4, prefill_rows=8)
    batcher.slots = SlotCache(fast_target.model, size=8, rows=64)
    moves = []
    extend = batcher.slots.extend

    def counted(base, n, keep):
        new = extend(base, n, keep)
        moves.append(new != base)
        return new

    batcher.slots.extend = counted
    seqs = run_batch(batcher, list(zip(ps, cfgs)))
    got = {tuple(s.prompt_ids): s.result.token_ids for s in seqs}
    assert [got[tuple(p)] for p in ps] == refs
    assert any(moves) and not all(moves)  # ranges grew in place and moved
    assert batcher.slots.used == {} and batcher.slots.size == 8  # everything given back


def test_batch_budget_follows_the_load():
    curve = {"n": [1, 2, 4, 8, 16, 32, 64], "ratio": [1.0, 1.05, 1.34, 1.9, 3.3, 6.8, 10.6],
             "ms": [4.4, 4.6, 5.9, 8.4, 14.5, 29.8, 46.8]}
    got = [batch_budget(curve, live, 8) for live in (1, 2, 4, 8, 16)]
    assert got == sorted(got, reverse=True) and got[0] > 0 and got[-1] == 0  # shrinks down to no speculation
    assert batch_budget(curve, 1, 3) == 3  # never above a request's own budget
    assert batch_budget(None, 1, 4) == 4 and batch_budget(None, 4, 4) == 0  # no curve: the tree's rows shared out
    profile = {"1": 1.6, "2": 1.9, "4": 2.2, "8": 2.4}
    one = batch_budget(curve, 1, 8, profile)
    assert one in (2, 4) and batch_budget(curve, 16, 8, profile) == 0
    assert pass_ratio(curve, 3) == pytest.approx(1.195) and pass_ratio(curve, 128) > 10.6


# ---------------------------------------------------------------------- the batched server


# ---------------------------------------------------------------------- the batched server
def _server_parts():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from specdraft.server.app import ServerThread, create_app
    from specdraft.server.queue import RequestQueue

    return openai, ServerThread, create_app, RequestQueue


class SlowNgram(NgramDrafter):
    """Prompt lookup at <= ~30 passes/s: generations long enough to disconnect from or queue behind."""

    def propose(self, budget):
        import time

        time.sleep(0.03)
        return super().propose(budget)


def test_batched_server_answers_equal_offline(tiny_chat_fast):
    """Concurrent requests (streaming and not, different lengths) share passes: each answer equals offline
    greedy, /health shows the batch and its rule, /metrics parses and counts every request."""
    import http.client
    import json

    from prometheus_client.parser import text_string_to_metric_families

    openai, ServerThread, create_app, RequestQueue = _server_parts()
    t = tiny_chat_fast
    asks = [f"Tell me about {x}." for x in ("owls", "salt", "the moon and the tides of the sea", "maps", "tea", "snow")]
    limits = [20, 7, 33, 15, 26, 11]
    plain = Engine(twin(t))
    offline = [plain.generate(t.encode_messages([{"role": "user", "content": a}]), GenerateConfig(max_new_tokens=n))
               for a, n in zip(asks, limits)]
    full = offline[2].text
    stop = full[len(full) // 3:len(full) // 3 + 3]  # a stop string inside request 2's answer
    offline[2] = plain.generate(t.encode_messages([{"role": "user", "content": asks[2]}]),
                                GenerateConfig(max_new_tokens=limits[2], stop=[stop]))
    want = [r.text for r in offline]
    assert stop.strip() and len(want[2]) < len(full)  # the stop string cut it
    queue = RequestQueue(Engine(twin(t), NgramDrafter()), model_id="tiny-chat", max_queue=2, max_batch=4)
    assert queue.capacity == 6 and queue.batcher is not None
    got: dict[int, str] = {}
    usage: dict[int, object] = {}

    def ask(i: int) -> None:
        api = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": asks[i]}]
        extra = {"stop": [stop]} if i == 2 else {}
        if i % 2 == 0 and i != 2:
            r = api.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=limits[i], temperature=0)
            got[i] = r.choices[0].message.content
            usage[i] = r.usage
        elif i % 2:
            got[i] = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
                model="tiny-chat", messages=msgs, max_tokens=limits[i], temperature=0, stream=True) if c.choices)
        else:
            got[i] = api.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=limits[i],
                                                 temperature=0, **extra).choices[0].message.content

    with ServerThread(create_app(queue)) as srv:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert queue.load()["running"] == 0 and queue.batcher.peak_live >= 2  # requests did share passes
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("GET", "/health")
        health = json.loads(conn.getresponse().read())
        conn.request("GET", "/metrics")
        families = {f.name: f for f in text_string_to_metric_families(conn.getresponse().read().decode())}
    assert [got[i] for i in range(len(asks))] == want
    assert health["batch"]["max_batch"] == 4 and "rule" in health["batch"] and health["batch"]["live"] == 0
    done = {s.labels["outcome"]: s.value for s in families["specdraft_requests"].samples}
    assert done == {"completed": 6, "cancelled": 0, "failed": 0}
    assert sorted(usage) == [0, 4]
    for i, u in usage.items():  # usage counts what offline generation counts
        assert u.completion_tokens == offline[i].stats.new_tokens and u.prompt_tokens > 0


def test_batched_server_cancel_and_429(tiny_chat_fast):
    """A client that leaves mid-batch stops only its own generation (its slots freed, the other answer
    unchanged); a request beyond max_batch + max_queue is refused at once with 429."""
    import time

    openai, ServerThread, create_app, RequestQueue = _server_parts()
    t = tiny_chat_fast
    d = SlowNgram()
    d.default_budget = 2
    queue = RequestQueue(Engine(twin(t), d), model_id="tiny-chat", max_queue=1, max_batch=2, default_max_tokens=60)
    msgs = [{"role": "user", "content": "Write a long story."}]
    want = Engine(twin(t)).generate(t.encode_messages(msgs), GenerateConfig(max_new_tokens=60)).text
    with ServerThread(create_app(queue)) as srv:
        api = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        leaving = api.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=60, stream=True)
        it = iter(leaving)
        next(it), next(it)  # the role chunk and some text: it is in the batch
        staying = api.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=60, stream=True)
        rest = iter(staying)
        parts = [next(rest).choices[0].delta.content or ""]  # in the batch too
        waiting = api.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=60, stream=True)
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError, match="busy"):  # 2 running + 1 waiting = capacity 3
            api.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=2)
        assert time.monotonic() - t0 < 2
        leaving.close()
        parts += [c.choices[0].delta.content or "" for c in rest if c.choices]
        waited = "".join(c.choices[0].delta.content or "" for c in waiting if c.choices)
        deadline = time.monotonic() + 10
        while queue.load()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "".join(parts) == want and waited == want
    assert (queue.completed, queue.cancelled, queue.failed) == (2, 1, 0)
    assert queue.batcher.slots.used == {} and queue.batcher.live == []


def test_exact_mode_server_stays_one_at_a_time(tiny_chat_target):
    _, _, _, RequestQueue = _server_parts()
    queue = RequestQueue(Engine(twin(tiny_chat_target)), max_batch=4, max_queue=2)
    assert queue.batcher is None and queue.max_batch == 1 and queue.capacity == 3
    assert "fast precision mode" in queue.batch_note and queue.health()["note"] == queue.batch_note


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_trees_cut_together_in_a_batch_change_no_answer(fast_target, drafter, monkeypatch):
    """The batch cuts its sequences' scored trees together by the live costs (``LiveCosts.cut_many``): every
    answer still equals offline plain decoding, and some passes kept drafted rows."""
    import specdraft.batch as batch_module
    from specdraft.drafters.budget import LiveCosts
    from specdraft.drafters.calibration import Calibration

    costs = LiveCosts({"n": list(range(1, 65)), "ms": [1.0 + 0.05 * n for n in range(1, 65)]})
    monkeypatch.setattr(batch_module, "live_costs", lambda target: costs)
    ps = prompts(LENGTHS[:6])
    cfgs = [GenerateConfig(max_new_tokens=n) for n in (30, 12, 40, 25, 33, 8)]
    plain = Engine(twin(fast_target))
    refs = [plain.generate(p, c).token_ids for p, c in zip(ps, cfgs)]
    if drafter == "ngram":
        d = NgramDrafter(table={"1,0,1": 0.5, "2,0,1": 0.6, "1,0,2": 0.3, "2,0,2": 0.4, "3,0,1": 0.7})
    else:
        d = random_hybrid(fast_target)
        d.calibration = Calibration()
    d.default_budget = 4
    batcher = Batcher(Engine(twin(fast_target), d), max_batch=4, prefill_rows=8)
    seqs = run_batch(batcher, list(zip(ps, cfgs)))
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    got = {tuple(s.prompt_ids): s.result.token_ids for s in seqs}
    assert [got[tuple(p)] for p in ps] == refs
    assert costs.live and max(costs.live) > 4  # passes were timed, some with drafted rows


def test_sampled_maps_rescore_a_batch_per_sequence(fast_target, monkeypatch):
    """In a batch each sampling sequence rescores its trees with its drafter's ``sampled`` map at its own
    temperature before the cut (``generate`` does the same): a map to 0 keeps no drafted row of those sequences,
    the greedy one drafts; every answer equals the same request alone."""
    import specdraft.batch as batch_module
    from specdraft.drafters import calibration as C
    from specdraft.drafters.budget import LiveCosts

    costs = LiveCosts({"n": list(range(1, 65)), "ms": [1.0 + 0.05 * n for n in range(1, 65)]})
    monkeypatch.setattr(batch_module, "live_costs", lambda target: costs)
    ps = prompts((6, 30, 12))
    ps = [p * 3 for p in ps]  # repeats: prompt lookup finds continuations
    cfgs = [GenerateConfig(max_new_tokens=24, sampling=Sampling(temperature=0.7), seed=1),
            GenerateConfig(max_new_tokens=24),
            GenerateConfig(max_new_tokens=24, sampling=Sampling(temperature=0.7), seed=2)]
    d = NgramDrafter(table={"1,0,1": 0.9, "2,0,1": 0.9, "3,0,1": 0.9, "4,0,1": 0.9, "4,0,2": 0.9, "4,0,3": 0.9})
    d.default_budget, d.sampled = 3, {0.7: C.Calibration([0.0, 1.0], [0.0, 0.0])}
    engine = Engine(twin(fast_target), d)
    alone = [Engine(twin(fast_target)).generate(p, c).token_ids for p, c in zip(ps, cfgs)]
    seqs = run_batch(Batcher(engine, max_batch=3, prefill_rows=16), list(zip(ps, cfgs)))
    got = {tuple(x.prompt_ids): x.result for x in seqs}
    assert [got[tuple(p)].token_ids for p in ps] == alone
    assert [got[tuple(p)].stats.tree_nodes > 0 for p in ps] == [False, True, False]
