"""The server's request queue: a bounded queue in front of one generation at a time, or of a batch.

``RequestQueue`` admits at most ``max_batch + max_queue`` requests (running + waiting); a request
beyond that is refused at once (HTTP 429), so nothing waits without bound.  Each has a cancel flag (a
disconnected client stops its generation within one pass).

One loop (``run``) does all the model's work, on one thread:

* ``max_batch`` 1: it runs the waiting generations one at a time through the ``Engine``.
* ``max_batch`` N > 1: before every pass it moves waiting requests into a ``batch.Batcher`` (up to
  N), then runs one pass for all of them (continuous batching).  Needs the fast precision mode; with
  the exact mode the queue stays one at a time and says why in ``batch_note``.

``specdraft serve`` runs the loop on the main thread, the thread that loaded the model: the CPU
kernels' OpenMP threads belong to the thread that first ran them, and a pass on another thread
measured ~3x slower here (two thread teams on two cores).  ``start()`` runs it on a thread of its own
instead (tests, in-process servers).  Nothing here imports the web framework.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from specdraft.batch import Batcher, Sequence
from specdraft.engine import Cancelled, Engine
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, GenerationResult, TokenLogprob, check_budget
from specdraft.model.memory import give_back
from specdraft.server.metrics import Metrics
from specdraft.verify import Sampling

MIN_TEMPERATURE = 1e-4  # below this a request decodes greedily


@dataclass
class Job:
    prompt_ids: list[int]
    config: GenerateConfig
    on_text: Callable[[str], None] | None = None
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None  # with config.logprobs: as they come
    cancel: threading.Event = field(default_factory=threading.Event)
    future: Future = field(default_factory=Future)
    admitted: float = field(default_factory=time.perf_counter)  # when it entered the queue (metrics: TTFT)
    started: float = 0.0  # when its generation started


class RequestQueue:
    def __init__(self, engine: Engine, model_id: str | None = None, max_queue: int = 8, default_max_tokens: int = 512,
                 default_temperature: float = 0.0, budget: int | None = None, max_batch: int = 1) -> None:
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
        if max_batch < 1:
            raise SpecdraftError(f"--max-batch must be >= 1 (got {max_batch})")
        self.batch_note = ""  # why a --max-batch > 1 runs one at a time
        if max_batch > 1 and target.precision != "fast":
            self.batch_note = (f"--max-batch {max_batch} needs the fast precision mode (rows that do not depend on "
                               f"the batch); the target runs in the {target.precision} mode, so requests run one at a time")
            max_batch = 1
        self.max_batch = max_batch
        self.engine = engine
        self.target = target
        self.drafter = engine.drafter
        self.model_id = model_id or target.name
        self.capacity = max_batch + max_queue
        self.default_max_tokens = default_max_tokens
        self.default_temperature = default_temperature
        self.budget = budget
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # a job arrived, or the queue closed
        self._waiting: deque[Job] = deque()
        self._thread: threading.Thread | None = None  # start()'s thread
        self._jobs: set[int] = set()  # ids of admitted jobs (running or waiting)
        self._cancels: dict[int, threading.Event] = {}
        self.closed = False  # set by shutdown(): nothing more is admitted
        self.completed = 0  # generations that finished
        self.cancelled = 0  # generations stopped by their cancel flag
        self.failed = 0
        self.metrics = Metrics()  # GET /metrics
        self.batcher = Batcher(engine, max_batch=max_batch) if max_batch > 1 else None
        self._in_batch: dict[int, Job] = {}  # id(Sequence) -> its job
        target.fewest_tokens(0)  # the vocabulary's longest token, found now rather than inside a first request

    @property
    def context(self) -> int:
        return self.target.config.max_position

    # ------------------------------------------------------------------ requests
    def config(self, max_tokens: int | None, temperature: float | None, top_p: float | None,
               top_k: int | None, seed: int | None, stop: list[str], logprobs: int | None = None) -> GenerateConfig:
        temp = self.default_temperature if temperature is None else temperature
        if temp < MIN_TEMPERATURE:  # this close to 0 sampling is greedy in effect: decode greedily, no seed
            temp = 0.0
        sampling = Sampling(temperature=temp, top_p=1.0 if top_p is None else top_p, top_k=top_k or 0)
        if seed is None and not sampling.greedy:
            seed = secrets.randbits(63)  # OpenAI semantics: no seed, a fresh sample each time
        return GenerateConfig(max_new_tokens=max_tokens or self.default_max_tokens, sampling=sampling,
                              seed=seed, stop=stop, budget=self.budget, logprobs=logprobs)

    def check_text(self, nbytes: int) -> None:
        """Refuse, before any tokenizing, a prompt text of ``nbytes`` bytes that cannot fit the context (a
        multi-megabyte body would otherwise take seconds of a worker's time to tokenize)."""
        least = self.target.fewest_tokens(nbytes)
        if least >= self.context:
            raise SpecdraftError(f"the prompt is at least {least} tokens ({nbytes} bytes of text); the model's "
                                 f"context is {self.context} tokens")

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise SpecdraftError("the prompt is empty")
        if len(ids) >= self.context:
            raise SpecdraftError(f"the prompt is {len(ids)} tokens; the model's context is {self.context} tokens")

    def load(self) -> dict:
        with self._lock:
            admitted, waiting = len(self._jobs), len(self._waiting)
        running = admitted - waiting  # taken from the queue and not answered yet
        return {"running": running, "waiting": waiting, "capacity": self.capacity,
                "completed": self.completed, "cancelled": self.cancelled, "failed": self.failed}

    def submit(self, ids: list[int], config: GenerateConfig, on_text: Callable[[str], None] | None = None,
               on_logprobs: Callable[[list[TokenLogprob]], None] | None = None) -> Job | None:
        """Queue a generation; None when the queue is full (refuse the request)."""
        job = Job(ids, config, on_text, on_logprobs)
        with self._lock:
            if self.closed or len(self._jobs) >= self.capacity:
                return None
            self._jobs.add(id(job))
            self._cancels[id(job)] = job.cancel
            self._waiting.append(job)
            self._wake.notify()
        return job

    def _release(self, job: Job) -> None:
        with self._lock:
            self._jobs.discard(id(job))
            self._cancels.pop(id(job), None)

    # ------------------------------------------------------------------ the loop
    def start(self) -> None:
        """Run the loop on a daemon thread (an in-process server); once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="specdraft-generate", daemon=True)
            self._thread.start()

    def run(self, stop: Callable[[], bool] | None = None) -> None:
        """Do the queue's work until it is shut down and empty (or ``stop()`` turns true while idle)."""
        while True:
            with self._wake:
                idle = not self._waiting and not (self.batcher and self.batcher.live)
            if idle:
                self._give_back()  # nothing to do: the cache back to its idle size, freed pages to the system
            with self._wake:
                while not self._waiting and not (self.batcher and self.batcher.live):
                    if self.closed or (stop is not None and stop()):
                        return
                    self._wake.wait(timeout=0.5)
                if self.batcher is None:
                    jobs = [self._waiting.popleft()]
                else:
                    room = self.max_batch - len(self.batcher.live)
                    jobs = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            if self.batcher is None:
                self._run(jobs[0])
            else:
                for job in jobs:  # outside the lock: admitting may grow the KV cache
                    self._admit(job)
                self._step()

    def _give_back(self) -> None:
        if self.batcher is not None:
            self.batcher.slots.shrink()
        self.target.trim()
        give_back()

    def _run(self, job: Job) -> None:
        """One generation, alone (max_batch 1)."""
        job.started = time.perf_counter()
        result, error = None, None
        try:
            if job.cancel.is_set():
                raise Cancelled()
            result = self.engine.generate(job.prompt_ids, job.config, on_text=job.on_text, cancel=job.cancel,
                                          on_logprobs=job.on_logprobs)
        except Cancelled as e:
            self.cancelled += 1
            error = e
        except BaseException as e:  # reported to the request's waiter
            self.failed += 1
            error = e
        else:
            self.completed += 1
            self.metrics.observe(result.stats, queued_s=job.started - job.admitted)
        self._settle(job, result=result, error=error)

    def _step(self) -> None:
        """One pass of the batch; answers the requests that left it."""
        b = self.batcher
        try:
            left = b.step()
        except Exception as e:  # not expected (step reports failures per sequence): fail every job in the batch
            b.live.clear()
            for base in list(b.slots.used):
                b.slots.release(base)
            for job in self._in_batch.values():
                self.failed += 1
                self._settle(job, error=e)
            self._in_batch.clear()
            return
        for s in left:
            self._done(s)

    def _admit(self, job: Job) -> None:
        """Move a job taken from the queue into the batch."""
        job.started = time.perf_counter()
        if job.cancel.is_set():
            self.cancelled += 1
            self._settle(job, error=Cancelled())
            return
        try:
            seq = self.batcher.add(job.prompt_ids, job.config, on_text=job.on_text, cancel=job.cancel,
                                   on_logprobs=job.on_logprobs)
        except Exception as e:  # a request the batch cannot take (checked as a single generation would be)
            self.failed += 1
            self._settle(job, error=e)
            return
        self._in_batch[id(seq)] = job

    def _done(self, seq: Sequence) -> None:
        job = self._in_batch.pop(id(seq))
        if seq.error is None:
            self.completed += 1
            self.metrics.observe(seq.result.stats, queued_s=job.started - job.admitted)
            self._settle(job, result=seq.result)
        else:
            if isinstance(seq.error, Cancelled):
                self.cancelled += 1
            else:
                self.failed += 1
            self._settle(job, error=seq.error)

    def _settle(self, job: Job, result: GenerationResult | None = None, error: BaseException | None = None) -> None:
        """Free the job's place and answer its waiter (unless someone cancelled its future)."""
        self._release(job)
        if not job.future.set_running_or_notify_cancel():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    # ------------------------------------------------------------------ the batch (max_batch > 1)
    def health(self) -> dict:
        """The batch's state and budget rule for /health (one at a time: just that)."""
        if self.batcher is None:
            out = {"max_batch": 1}
            return {**out, "note": self.batch_note} if self.batch_note else out
        return self.batcher.health()

    def shutdown(self) -> None:
        """Refuse new requests and cancel every admitted one: running generations stop within one pass;
        waiting ones are answered ``Cancelled`` when the loop reaches them (counted in ``cancelled``, their
        places freed); then the loop returns.  Idempotent; returns without waiting."""
        with self._lock:
            self.closed = True
            for ev in self._cancels.values():
                ev.set()
            self._wake.notify_all()
