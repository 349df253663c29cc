"""Prompt-lookup drafting as a tree (training-free).

HF's prompt lookup copies the continuation of *one* earlier match of the last n-gram.  Here the
latest n-grams (n = max_n .. min_n) are looked up in an incremental index of the whole context
(prompt + generated text); the continuations of several earlier matches become candidate paths,
ranked by match length, then by how many matches agree on the continuation, then recency.  With a
datastore of the target's own answers to other prompts (``drafters.datastore``, shipped per target) the
same n-grams are also looked up there, and its most frequent continuations join the candidates.  Each candidate
carries a cell (where it came from, how long its match, how it ranks) whose acceptance per depth is
measured (``scripts/calibrate.py``); the candidates are trie-merged under the node budget in order of
their first node's measured acceptance.  When nothing matches the tree is the root alone, so a pass
costs what plain decoding costs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specdraft.drafters.calibration import entry_for
from specdraft.drafters.datastore import Datastore, load_store, store_for
from specdraft.errors import SpecdraftError
from specdraft.model.llama import ForwardOutput
from specdraft.tree import Tree
from specdraft.verify import Accepted


def context_cell(n: int, rank: int) -> str:
    """A context candidate's cell: the match length n and whether its continuation was the first of that n
    (rank 0) or a later one (1)."""
    return f"{n},{min(rank, 1)}"


def store_cell(n: int, share: float) -> str:
    """A datastore candidate's cell: ``d`` + the match length n, and how many of the matches continue with its first
    token (0: at least 3/4, 1: at least 2/5, 2: fewer)."""
    return f"d{n},{0 if share >= 0.75 else 1 if share >= 0.4 else 2}"


def lookup_key(cell: str, depth: int) -> str:
    """A lookup node's cell in the acceptance table: its candidate's cell and its depth in the continuation
    (1-based, at most 8)."""
    return f"{cell},{min(depth, 8)}"


def lookup_table(target=None) -> dict[str, float]:
    """Measured acceptance of a lookup node per ``lookup_key`` (``scripts/calibrate.py``) for ``target`` (its own
    fit, else the one fitted on the default target); {} when none was fitted (then lookup trees carry no
    probabilities and are used as proposed)."""
    return entry_for("ngram", target).get("table", {})


@dataclass
class NgramConfig:
    max_n: int = 4  # longest n-gram matched
    min_n: int = 1  # shortest n-gram matched (1 = a single token)
    depth: int = 8  # longest continuation copied per match
    matches_per_n: int = 4  # most recent matches considered per n-gram length
    store_k: int = 4  # continuations taken from the datastore per pass (when the drafter has one)


@dataclass
class NgramOptions:
    """``ngram@key=value,...``."""

    # the datastore of the target's own answers also looked up: 1 = the one shipped for the target (if any), 0 = none
    # (the context alone), or a datastore file's path (`specdraft data datastore`)
    datastore: str = "1"

    def __post_init__(self) -> None:
        if self.datastore not in ("0", "1") and not Path(self.datastore).is_file():
            raise SpecdraftError(f"option datastore must be 0, 1 or a datastore file (no file {self.datastore!r})")


class NgramDrafter:
    name = "ngram"
    hidden_layers: tuple[int, ...] = ()
    default_budget = 2  # drafted nodes per tree without a cost curve (the registry sets the machine's)

    def __init__(self, config: NgramConfig | None = None, table: dict[str, float] | None = None,
                 store: Datastore | None = None) -> None:
        self.cfg = config or NgramConfig()
        self.table = lookup_table() if table is None else table  # node acceptance per lookup_key
        self.store = store  # the target's own answers, searched beside the context (None: the context alone)
        self.history: list[int] = []
        # n-gram -> positions just after each occurrence (ascending)
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        self.history = []
        self.index = defaultdict(list)
        self._extend(list(prompt_ids) + [first_token])

    def _extend(self, tokens: list[int]) -> None:
        h = self.history
        for tok in tokens:
            h.append(tok)
            end = len(h)
            for n in range(self.cfg.min_n, self.cfg.max_n + 1):
                if end - n < 0:
                    break
                # the n-gram ending here; its continuation starts at `end`
                self.index[tuple(h[end - n : end])].append(end)

    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        self._extend(accepted.new_tokens)

    def fork(self) -> "NgramDrafter":
        new = type(self)(self.cfg, self.table, self.store)
        new.default_budget = self.default_budget
        return new

    def candidates(self) -> list[list[int]]:
        """Candidate continuations of the current context, best first."""
        return [c for c, _ in self.scored()]

    def scored(self) -> list[tuple[list[int], str]]:
        """(continuation, its cell), best first: the context's and the datastore's candidates, in order of their
        first node's measured acceptance (the context's first where the table says nothing)."""
        ranked = self.context_scored()
        if self.store is not None and self.cfg.store_k > 0:
            seen = {tuple(c) for c, _ in ranked}
            n, conts = self.store.lookup(self.history, self.cfg.depth, self.cfg.store_k, self.cfg.min_n)
            ranked += [(c, store_cell(n, share)) for c, share in conts if tuple(c) not in seen]
            if self.table:
                ranked.sort(key=lambda cc: -self.table.get(lookup_key(cc[1], 1), 0.0))  # stable: ties keep order
        return ranked

    def context_scored(self) -> list[tuple[list[int], str]]:
        """(continuation, its cell) from the context alone: longest match first, then continuations seen more
        often, then the most recent."""
        h, cfg = self.history, self.cfg
        end = len(h)
        seen: set[tuple[int, ...]] = set()
        ranked: list[tuple[list[int], str]] = []
        for n in range(min(cfg.max_n, end), cfg.min_n - 1, -1):
            starts = self.index.get(tuple(h[end - n :]))
            if not starts:
                continue
            conts: dict[tuple[int, ...], list[int]] = {}
            order: list[tuple[int, ...]] = []
            for s in reversed(starts):  # most recent first; the current end has no continuation
                if s >= end:
                    continue
                cont = tuple(h[s : s + cfg.depth])
                if cont in seen or cont in conts:
                    conts.setdefault(cont, []).append(s)
                    continue
                conts[cont] = [s]
                order.append(cont)
                if len(order) >= cfg.matches_per_n:
                    break
            # within one n: continuations seen more often first, then the most recent
            order.sort(key=lambda c: -len(conts[c]))
            rank = 0
            for c in order:
                if c not in seen:
                    seen.add(c)
                    ranked.append((list(c), context_cell(n, rank)))
                    rank += 1
        return ranked

    def node_probs(self, tree: Tree, scored: list[tuple[list[int], str]]) -> list[float]:
        """Each node's measured acceptance as a lookup node (0 for nodes no candidate reaches); the first,
        best candidate reaching a node decides its cell."""
        p = [1.0] + [0.0] * (len(tree) - 1)
        done = [True] + [False] * (len(tree) - 1)
        for cont, cell in scored:
            for depth, node in enumerate(tree.walk(cont), 1):
                if not done[node]:
                    p[node], done[node] = self.table.get(lookup_key(cell, depth), 0.0), True
        return p

    def propose(self, budget: int) -> Tree:
        root = self.history[-1]
        if budget <= 0:
            return Tree.single(root)
        scored = self.scored()
        tree = Tree.from_paths(root, [c for c, _ in scored], budget=budget)
        return tree.with_probs(self.node_probs(tree, scored)) if self.table and len(tree) > 1 else tree


def load_ngram(target, ckpt, options: NgramOptions, name: str | None) -> NgramDrafter:
    """The registry's builder: prompt lookup with ``target``'s measured lookup table and the datastore ``datastore``
    names (the shipped one: none for a target without one, then the context alone)."""
    if options.datastore == "1":
        store = store_for(target) if target is not None else None
    elif options.datastore == "0":
        store = None
    else:
        store = load_store(options.datastore, target)
    return NgramDrafter(table=lookup_table(target), store=store)
