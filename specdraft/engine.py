"""The Engine: a target, a drafter and ``generate``, in the one place that loads and generates.

``specdraft generate``, ``chat``, ``serve``, ``bench`` and ``analyze`` all start from
``Engine.load(target, drafter)``.  ``Engine.generate`` is ``specdraft.generate.generate`` plus two
hooks around every target pass:

* ``cancel``: a ``threading.Event`` checked before every pass; once set the generation stops
  within one pass with ``Cancelled`` (a disconnected client, a server shutting down, Ctrl-C);
* ``on_pass(tokens committed)``: called after every pass that does not end the generation (the
  chat's live tokens per pass).
"""

from __future__ import annotations

import threading
from typing import Callable

from specdraft.drafters import Drafter, NoDrafter, make_drafter
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, GenerationResult, TokenLogprob, check_budget, generate
from specdraft.model.fast import DEFAULT_PRECISION
from specdraft.target import Target


class Cancelled(Exception):
    """The generation's cancel flag was set (client gone, server shutting down, Ctrl-C)."""


class _Hooked:
    """The drafter protocol around ``inner`` with the cancel check and the per-pass callback."""

    def __init__(self, inner: Drafter, cancel: threading.Event | None, on_pass: Callable[[int], None] | None) -> None:
        self.inner, self.cancel, self.on_pass = inner, cancel, on_pass

    def __getattr__(self, name: str):  # name, hidden_layers, default_budget, anything else
        return getattr(self.inner, name)

    def _check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled()

    def reset(self, prompt_ids, first_token, prefill) -> None:
        self._check()
        self.inner.reset(prompt_ids, first_token, prefill)

    def propose(self, budget: int):
        self._check()
        return self.inner.propose(budget)

    def commit(self, accepted, out) -> None:
        self.inner.commit(accepted, out)
        if self.on_pass is not None:
            self.on_pass(len(accepted.new_tokens))


class Engine:
    """A target and a drafter; generations run one at a time (the target holds one KV cache)."""

    def __init__(self, target: Target, drafter: Drafter | None = None) -> None:
        self.target = target
        self.drafter = drafter or NoDrafter()

    @classmethod
    def load(cls, target: str = "default", drafter: str = "none", device: str = "cpu", dtype: str = "float32",
             budget: int | None = None, precision: str | None = DEFAULT_PRECISION) -> "Engine":
        """Load ``target`` ("default", a .gguf file or an HF folder) and build ``drafter`` (a registered
        name with options, ``NAME@key=value``, or a checkpoint path) for it; ``budget``: drafted nodes
        per tree (None = the drafter's budget on this machine); ``precision``: "fast" or "exact"."""
        if budget is not None and budget < 0:
            raise SpecdraftError(f"--budget must be >= 0 (got {budget})")
        t = Target.load(target, device=device, dtype=dtype, precision=precision)
        engine = cls(t, make_drafter(drafter, t, budget=budget))
        check_budget(engine.drafter.default_budget, t)  # a bad NAME@budget=N or --budget fails here, not per request
        return engine

    def generate(self, prompt_ids: list[int], config: GenerateConfig | None = None,
                 on_text: Callable[[str], None] | None = None, cancel: threading.Event | None = None,
                 on_pass: Callable[[int], None] | None = None,
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None) -> GenerationResult:
        """``generate`` with this engine's target and drafter (see the module docstring for the hooks)."""
        drafter = self.drafter if cancel is None and on_pass is None else _Hooked(self.drafter, cancel, on_pass)
        return generate(self.target, prompt_ids, drafter, config, on_text=on_text, on_logprobs=on_logprobs)
