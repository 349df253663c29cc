"""The drafter interface every drafter implements, and the empty drafter (plain decoding)."""

from __future__ import annotations

from typing import Protocol

from specdraft.model.llama import ForwardOutput
from specdraft.tree import Tree
from specdraft.verify import Accepted


class Drafter(Protocol):
    name: str
    hidden_layers: tuple[int, ...]  # target features the drafter reads (see ForwardOutput.hidden)
    default_budget: int  # drafted nodes per tree when the user gives no --budget

    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        """Start a new sequence: the prompt, the target's first token (the first root), prefill output."""

    def propose(self, budget: int) -> Tree:
        """A tree rooted at the last committed token with at most ``budget`` drafted nodes."""

    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        """The verifier kept ``accepted`` (out = the tree pass's output, for its features)."""


class NoDrafter:
    """Drafts nothing: every pass verifies the root alone, i.e. plain decoding."""

    name = "none"
    hidden_layers: tuple[int, ...] = ()
    default_budget = 0

    def __init__(self) -> None:
        self.last = -1

    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        self.last = first_token

    def propose(self, budget: int) -> Tree:
        return Tree.single(self.last)

    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        self.last = accepted.bonus
