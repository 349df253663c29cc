"""GET /metrics: Prometheus text that prometheus_client's own parser reads, with counters that add up
to what the requests' ``usage`` reported."""

from __future__ import annotations

import http.client

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdraft.generate import GenerationStats
from specdraft.server.metrics import TTFT_BUCKETS, Metrics


def parse(text: str) -> dict[str, dict]:
    """family name -> {sample name + labels: value}"""
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = {s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())): s.value
                         for s in fam.samples}
    return out


def stats(passes: int, committed: int, nodes: int, new: int, prefill: float, wall: float) -> GenerationStats:
    return GenerationStats(new_tokens=new, passes=passes, committed=committed, tree_nodes=nodes, prefill_s=prefill,
                           wall_s=wall)


def test_metrics_count_drafts_acceptance_and_latency():
    m = Metrics()
    m.observe(stats(passes=10, committed=25, nodes=40, new=26, prefill=0.02, wall=0.52), queued_s=0.1)
    m.observe(stats(passes=5, committed=5, nodes=0, new=6, prefill=0.01, wall=0.06), queued_s=0.0)  # plain decoding
    got = parse(m.text({"running": 1, "waiting": 2, "completed": 2, "cancelled": 1, "failed": 0}))
    assert got["specdraft_requests_running"]["specdraft_requests_running"] == 1
    assert got["specdraft_requests_waiting"]["specdraft_requests_waiting"] == 2
    assert got["specdraft_requests"]["specdraft_requests_total|outcome=cancelled"] == 1
    assert got["specdraft_spec_decode_num_drafts"]["specdraft_spec_decode_num_drafts_total"] == 10  # drafted passes only
    assert got["specdraft_spec_decode_num_draft_tokens"]["specdraft_spec_decode_num_draft_tokens_total"] == 40
    assert got["specdraft_spec_decode_num_accepted_tokens"]["specdraft_spec_decode_num_accepted_tokens_total"] == 15
    assert got["specdraft_spec_decode_mean_acceptance_length"][
        "specdraft_spec_decode_mean_acceptance_length"] == pytest.approx(30 / 15)
    ttft = got["specdraft_time_to_first_token_seconds"]
    assert ttft["specdraft_time_to_first_token_seconds_count"] == 2
    assert ttft["specdraft_time_to_first_token_seconds_sum"] == pytest.approx(0.12 + 0.01)
    assert ttft["specdraft_time_to_first_token_seconds_bucket|le=0.01"] == 1  # the unqueued one
    assert ttft["specdraft_time_to_first_token_seconds_bucket|le=0.1"] == 1  # 0.12 s is above 0.1
    assert ttft["specdraft_time_to_first_token_seconds_bucket|le=+Inf"] == 2
    tpot = got["specdraft_time_per_output_token_seconds"]
    assert tpot["specdraft_time_per_output_token_seconds_sum"] == pytest.approx(0.5 / 25 + 0.05 / 5)
    assert len(TTFT_BUCKETS) + 3 == len(ttft)  # every bucket, +Inf, sum and count


@pytest.fixture(scope="module")
def server(tiny_chat_target):
    from test_server import MODEL, twin

    from specdraft.engine import Engine
    from specdraft.server.app import ServerThread, create_app
    from specdraft.server.queue import RequestQueue

    from test_speculative_greedy import RandomTreeDrafter

    t = twin(tiny_chat_target)
    drafter = RandomTreeDrafter(0, t.config.vocab_size, None, width=2, depth=3, budget=4)  # drafts every pass
    queue = RequestQueue(Engine(t, drafter), model_id=MODEL, default_max_tokens=12)
    with ServerThread(create_app(queue)) as srv:
        yield srv


def test_server_metrics_add_up_to_the_usage_it_reported(server):
    from test_server import MODEL, client

    def scrape() -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
        return parse(resp.read().decode())

    before = scrape()
    usages = [client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Count to {k}: 1 2 3"}], max_tokens=12,
        temperature=0).usage for k in (3, 5, 7)]
    after = scrape()

    def delta(fam: str, sample: str) -> float:
        return after[fam][sample] - before[fam][sample]

    assert delta("specdraft_requests", "specdraft_requests_total|outcome=completed") == 3
    assert delta("specdraft_time_to_first_token_seconds", "specdraft_time_to_first_token_seconds_count") == 3
    passes = sum(u.passes for u in usages)
    accepted = sum(round(u.tokens_per_pass * u.passes) - u.passes for u in usages)
    assert delta("specdraft_spec_decode_num_accepted_tokens", "specdraft_spec_decode_num_accepted_tokens_total") == accepted
    assert 0 < delta("specdraft_spec_decode_num_drafts", "specdraft_spec_decode_num_drafts_total") <= passes
    assert delta("specdraft_spec_decode_num_draft_tokens", "specdraft_spec_decode_num_draft_tokens_total") > 0
    assert after["specdraft_requests_running"]["specdraft_requests_running"] == 0
