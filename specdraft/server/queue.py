"""The server's request queue: one generation at a time from a bounded queue.

``RequestQueue`` admits at most ``1 + max_queue`` requests (running + waiting); a request beyond
that is refused at once (HTTP 429), so nothing waits without bound.  Generations run on a single
worker thread through the ``Engine``, so the target's KV cache is never shared; each has a cancel
flag (a disconnected client stops its generation within one pass).  Nothing here imports the web
framework.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from specdraft.engine import Cancelled, Engine
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, GenerationResult, check_budget
from specdraft.server.metrics import Metrics
from specdraft.verify import Sampling

MIN_TEMPERATURE = 1e-4  # below this a request decodes greedily


@dataclass
class Job:
    prompt_ids: list[int]
    config: GenerateConfig
    on_text: Callable[[str], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    future: Future | None = None
    admitted: float = field(default_factory=time.perf_counter)  # when it entered the queue (metrics: TTFT)


class RequestQueue:
    def __init__(self, engine: Engine, model_id: str | None = None, max_queue: int = 8, default_max_tokens: int = 512,
                 default_temperature: float = 0.0, budget: int | None = None) -> None:
        target = engine.target
        if target.tokenizer is None:
            raise SpecdraftError("the target has no tokenizer; the server needs one")
        if max_queue < 0:
            raise SpecdraftError(f"--max-queue must be >= 0 (got {max_queue})")
        if default_max_tokens < 1:
            raise SpecdraftError(f"--max-tokens must be >= 1 (got {default_max_tokens})")
        Sampling(temperature=default_temperature)  # a NaN, infinite or negative default fails here, not per request
        if budget is not None:
            check_budget(budget, target)  # likewise a --budget past the context
        self.engine = engine
        self.target = target
        self.drafter = engine.drafter
        self.model_id = model_id or target.name
        self.capacity = 1 + max_queue
        self.default_max_tokens = default_max_tokens
        self.default_temperature = default_temperature
        self.budget = budget
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdraft-generate")
        self._lock = threading.Lock()
        self._jobs: set[int] = set()  # ids of admitted jobs (running or waiting)
        self._cancels: dict[int, threading.Event] = {}
        self.closed = False  # set by shutdown(): nothing more is admitted
        self.running = False
        self.completed = 0  # generations that finished
        self.cancelled = 0  # generations stopped by their cancel flag
        self.failed = 0
        self.metrics = Metrics()  # GET /metrics

    @property
    def context(self) -> int:
        return self.target.config.max_position

    # ------------------------------------------------------------------ requests
    def config(self, max_tokens: int | None, temperature: float | None, top_p: float | None,
               top_k: int | None, seed: int | None, stop: list[str]) -> GenerateConfig:
        temp = self.default_temperature if temperature is None else temperature
        if temp < MIN_TEMPERATURE:  # this close to 0 sampling is greedy in effect: decode greedily, no seed
            temp = 0.0
        sampling = Sampling(temperature=temp, top_p=1.0 if top_p is None else top_p, top_k=top_k or 0)
        if seed is None and not sampling.greedy:
            seed = secrets.randbits(63)  # OpenAI semantics: no seed, a fresh sample each time
        return GenerateConfig(max_new_tokens=max_tokens or self.default_max_tokens, sampling=sampling,
                              seed=seed, stop=stop, budget=self.budget)

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise SpecdraftError("the prompt is empty")
        if len(ids) >= self.context:
            raise SpecdraftError(f"the prompt is {len(ids)} tokens; the model's context is {self.context} tokens")

    def load(self) -> dict:
        with self._lock:
            admitted = len(self._jobs)
        running = 1 if self.running else 0
        return {"running": running, "waiting": max(0, admitted - running), "capacity": self.capacity,
                "completed": self.completed, "cancelled": self.cancelled, "failed": self.failed}

    def submit(self, ids: list[int], config: GenerateConfig, on_text: Callable[[str], None] | None = None) -> Job | None:
        """Queue a generation; None when the queue is full (refuse the request)."""
        job = Job(ids, config, on_text)
        with self._lock:
            if self.closed or len(self._jobs) >= self.capacity:
                return None
            self._jobs.add(id(job))
            self._cancels[id(job)] = job.cancel
        try:
            job.future = self._pool.submit(self._run, job)
        except RuntimeError:  # the pool is shut down
            self._release(job)
            return None
        return job

    def _release(self, job: Job) -> None:
        with self._lock:
            self._jobs.discard(id(job))
            self._cancels.pop(id(job), None)

    def _run(self, job: Job) -> GenerationResult:
        try:
            if job.cancel.is_set():
                raise Cancelled()
            self.running = True
            started = time.perf_counter()
            r = self.engine.generate(job.prompt_ids, job.config, on_text=job.on_text, cancel=job.cancel)
            self.completed += 1
            self.metrics.observe(r.stats, queued_s=started - job.admitted)
            return r
        except Cancelled:
            self.cancelled += 1
            raise
        except BaseException:
            self.failed += 1
            raise
        finally:
            self.running = False
            self._release(job)

    def shutdown(self) -> None:
        """Refuse new requests and cancel every admitted one: the running generation stops within one
        pass; each waiting one still reaches ``_run``, which stops it before it starts, so it is counted
        in ``cancelled``, its slot is freed and its waiter hears ``Cancelled`` (cancelling the pool's
        futures instead would skip all three).  Idempotent; returns without waiting."""
        with self._lock:
            self.closed = True
            for ev in self._cancels.values():
                ev.set()
        self._pool.shutdown(wait=False)
