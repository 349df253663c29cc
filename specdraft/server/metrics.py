"""The server's Prometheus metrics (``GET /metrics``), in the text exposition format.

Recorded per finished generation (``Metrics.observe``) and read live from the queue:

- ``specdraft_requests_running`` / ``specdraft_requests_waiting`` (gauges) and the finished
  requests by outcome (``specdraft_requests_total{outcome=...}``);
- ``specdraft_time_to_first_token_seconds`` (histogram): from admission to the first token, so
  the time spent waiting in the queue counts, as a client feels it;
- ``specdraft_time_per_output_token_seconds`` (histogram): decoding time after the first token /
  the tokens after it, one observation per request;
- the speculative-decoding counters vLLM exposes, under our prefix:
  ``specdraft_spec_decode_num_drafts_total`` (target passes that verified a drafted tree),
  ``specdraft_spec_decode_num_draft_tokens_total`` (drafted nodes verified),
  ``specdraft_spec_decode_num_accepted_tokens_total`` (drafted tokens accepted), and the mean
  acceptance length (tokens committed per pass, 1 + accepted / passes) as a gauge.

Nothing here imports the web framework; the text is written by hand (no client library needed).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from specdraft.generate import GenerationStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds a token


@dataclass
class Histogram:
    """Cumulative-bucket histogram: ``counts[i]`` observations <= ``buckets[i]`` (the last: +Inf)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        running = 0
        for le, c in zip([*(repr(float(b)) for b in self.buckets), "+Inf"], self.counts):
            running += c
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {self.total!r}", f"{name}_count {running}"]
        return out


class Metrics:
    """Counters and histograms of the generations one server ran (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.drafts = 0  # passes that verified a drafted tree
        self.draft_tokens = 0  # drafted nodes verified
        self.accepted_tokens = 0  # drafted tokens accepted
        self.passes = 0  # all target passes after prefill
        self.committed = 0  # tokens those passes committed

    def observe(self, stats: GenerationStats, queued_s: float) -> None:
        """One finished generation: ``queued_s`` waited in the queue before it started."""
        accepted = max(0, stats.committed - stats.passes)  # every pass commits its bonus token plus those accepted
        with self._lock:
            self.ttft.observe(queued_s + stats.prefill_s)
            if stats.new_tokens > 1:
                self.tpot.observe(max(0.0, stats.wall_s - stats.prefill_s) / (stats.new_tokens - 1))
            if stats.tree_nodes:
                self.drafts += stats.passes
                self.draft_tokens += stats.tree_nodes
                self.accepted_tokens += accepted
            self.passes += stats.passes
            self.committed += stats.committed

    def text(self, load: dict) -> str:
        """The exposition text; ``load``: ``RequestQueue.load()`` (running, waiting and outcome counts)."""
        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"] + [f"{name}{labels} {v!r}" for labels, v in samples]

        with self._lock:
            out = metric("specdraft_requests_running", "gauge", "Generations running now.",
                         [("", float(load["running"]))])
            out += metric("specdraft_requests_waiting", "gauge", "Admitted generations waiting to start.",
                          [("", float(load["waiting"]))])
            out += metric("specdraft_requests_total", "counter", "Finished generations by outcome.",
                          [(f'{{outcome="{k}"}}', float(load[k])) for k in ("completed", "cancelled", "failed")])
            out += self.ttft.lines("specdraft_time_to_first_token_seconds",
                                   "Time from admission (queue wait included) to the first token.")
            out += self.tpot.lines("specdraft_time_per_output_token_seconds",
                                   "Decoding time per token after the first, one observation per request.")
            out += metric("specdraft_spec_decode_num_drafts_total", "counter", "Target passes that verified a drafted tree.",
                          [("", float(self.drafts))])
            out += metric("specdraft_spec_decode_num_draft_tokens_total", "counter", "Drafted tokens verified.",
                          [("", float(self.draft_tokens))])
            out += metric("specdraft_spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens accepted.",
                          [("", float(self.accepted_tokens))])
            mean = self.committed / self.passes if self.passes else 0.0
            out += metric("specdraft_spec_decode_mean_acceptance_length", "gauge",
                          "Tokens committed per target pass (1 + accepted drafted tokens per pass).", [("", mean)])
        return "\n".join(out) + "\n"
