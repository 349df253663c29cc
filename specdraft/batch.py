"""Continuous batching: the target passes of many generations run as one (``serve --max-batch N``).

Every live sequence owns a range of slots in one KV cache (``SlotCache``): its committed prefix sits at
``base .. base+length-1``.  A range starts at the prompt and a first stretch and doubles as the sequence
grows (in place, or moved with its K/V), never ``prompt + max tokens`` up front; when sequences leave,
the cache's free tail is given back.  The slots after all ranges (from ``SlotCache.scratch``) take the rows of the
pass being run.  A pass concatenates, per sequence, a chunk of its prompt (while it prefills) or its
draft tree into one row list [1, T]:

    rows  | seq a: prompt chunk | seq b: tree (root, drafted nodes) | seq c: tree | ...
    mask  a row sees its own sequence's committed slots, then its own ancestors among the pass's rows
          (a prompt row: the chunk's rows up to itself), both in slot order
    RoPE  a tree node at its sequence's length + depth, a prompt row at its index in the prompt

In the fast precision mode every row's arithmetic is its own (``model/fast.py``: per-row quantization,
attention over the row's visible slots in slot order), and a row sees the same keys in the same order
as in ``generate``.  So a row's logits are bit-identical to its single-stream pass, and each request's
tokens equal its offline run whatever shares its passes.  After the pass each sequence verifies its own
tree, and its accepted rows' K/V are copied from the scratch slots into its range.

    Batcher.step():
        cancelled sequences leave
        b = drafted nodes per tree for L decoding sequences (``drafters.budget.batch_budget``)
        rows = prompt chunks (``prefill_rows`` in all) + each decoding sequence's drafter.propose(b),
               the scored trees cut together to the nodes that pay (``LiveCosts.cut_many``)
        one target pass over the rows (logits only for tree rows and prompts' last rows)
        per sequence: prompt done -> first token, drafter.reset;  tree -> verify, commit, emit,
                      drafter.commit;  done (EOS / max tokens / stop string) -> leaves, slots freed
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdraft.drafters.base import Drafter, NoDrafter
from specdraft.drafters.budget import BATCH_RULE, batch_budget, batch_rows, live_costs, load_cost_curve
from specdraft.drafters.calibration import Calibration, rescored, sampled_calibration
from specdraft.engine import Cancelled, Engine
from specdraft.errors import SpecdraftError
from specdraft.generate import (Emitter, GenerateConfig, GenerationResult, GenerationStats, TokenLogprob, catch_up,
                                path_rows, plan)
from specdraft.model.llama import ForwardOutput, KVCache, Transformer
from specdraft.target import GROW_SLOTS
from specdraft.tree import Tree
from specdraft.verify import argmax_rows, sample, verify

MAX_DEFERRED = 256  # passes a drafter may fall behind (while its sequence drafts nothing) before it catches up


class SlotCache:
    """Slot ranges in one KV cache [L, 2, 1, Hkv, size + rows, D]: ranges ``[0, size)`` are handed out
    first fit; the ``rows`` slots after them (from ``scratch``) take a pass's rows.  When a range or a
    pass does not fit, the cache is reallocated bigger, the ranges copied (their bases do not move).  A
    range grows in place, or moves with its K/V (``extend``); ``shrink`` gives a free tail back."""

    def __init__(self, model: Transformer, size: int = 1024, rows: int = 64) -> None:
        self.model = model
        self.initial = (size, rows)  # what ``shrink`` returns to
        self.size, self.rows = size, rows
        self.cache: KVCache = model.new_cache(1, size + rows)
        self.free: list[tuple[int, int]] = [(0, size)]  # (start, length), sorted by start, never adjacent
        self.used: dict[int, int] = {}  # base -> length of each handed-out range

    @property
    def scratch(self) -> int:
        """The first slot of the pass rows (every range lies below it)."""
        return self.size

    def alloc(self, n: int) -> int:
        """The base of a free range of ``n`` slots."""
        for i, (s, length) in enumerate(self.free):
            if length >= n:
                self.free[i:i + 1] = [(s + n, length - n)] if length > n else []
                self.used[s] = n
                return s
        end = self.free[-1][0] if self.free and sum(self.free[-1]) == self.size else self.size
        self._grow(max(2 * self.size, end + n), self.rows)
        return self.alloc(n)

    def release(self, base: int) -> None:
        n = self.used.pop(base)
        self.free.append((base, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, length in self.free:
            if merged and sum(merged[-1]) == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((s, length))
        self.free = merged

    def extend(self, base: int, n: int, keep: int) -> int:
        """The range at ``base``, now ``n`` slots (more than before): grown in place when the slots after it
        are free, else moved to a new range with its first ``keep`` slots' K/V.  Returns its base.  A row
        reads its sequence's slots in the same order wherever they lie, so a move changes no logit."""
        cur = self.used[base]
        if n <= cur:
            return base
        end = base + cur
        tail = self.free[-1] if self.free and sum(self.free[-1]) == self.size else None
        if end == self.size or (tail is not None and tail[0] == end and tail[1] < n - cur):
            self._grow(max(2 * self.size, base + n), self.rows)  # the last range: the cache grows under it
        for i, (s, length) in enumerate(self.free):
            if s == end and length >= n - cur:
                self.free[i:i + 1] = [(s + n - cur, length - n + cur)] if length > n - cur else []
                self.used[base] = n
                return base
        new = self.alloc(n)
        self.copy(list(range(base, base + keep)), list(range(new, new + keep)))
        self.release(base)
        return new

    def shrink(self) -> None:
        """Give memory back: with no range in use, return to the initial size; else cut the cache to the
        larger of that and twice the end of the ranges in use, when this at least halves it.  The free
        tail goes; no range moves."""
        end = max((b + n for b, n in self.used.items()), default=0)
        size, rows = max(self.initial[0], 2 * end), self.rows if self.used else self.initial[1]
        if (size, rows) == (self.size, self.rows) or (self.used and 2 * (size + rows) > self.size + self.rows):
            return
        kept = self.cache.kv[..., :end, :].clone()  # at most half of it: the old cache goes before the new one
        self.cache = None
        self.cache = self.model.new_cache(1, size + rows)
        self.cache.kv[..., :end, :] = kept
        self.free = [(s, min(length, size - s)) for s, length in self.free if s < size]  # [end, size) stays free
        self.size, self.rows = size, rows

    def fit_rows(self, t: int) -> None:
        """Room for a pass of ``t`` rows."""
        if t > self.rows:
            self._grow(self.size, max(t, 2 * self.rows))

    def _grow(self, size: int, rows: int) -> None:
        old, old_size = self.cache, self.size
        self.cache = self.model.new_cache(1, size + rows)
        self.cache.kv[..., :old_size, :] = old.kv[..., :old_size, :]
        if size > old_size:
            if self.free and sum(self.free[-1]) == old_size:
                self.free[-1] = (self.free[-1][0], self.free[-1][1] + size - old_size)
            else:
                self.free.append((old_size, size - old_size))
        self.size, self.rows = size, rows

    def copy(self, src: list[int], dst: list[int]) -> None:
        """K/V of slots ``src`` to slots ``dst`` in every layer (disjoint sets)."""
        if src:
            kv, dev = self.cache.kv, self.cache.kv.device
            kv.index_copy_(4, torch.tensor(dst, device=dev), kv.index_select(4, torch.tensor(src, device=dev)))


@dataclass(eq=False)  # compared by identity (two requests may be equal field for field)
class Sequence:
    """One generation in the batch: its request, its slots, its drafter and what it has produced."""

    prompt_ids: list[int]
    config: GenerateConfig
    drafter: Drafter
    emit: Emitter
    budget: int  # its own drafted nodes per tree (the cap of the batch rule)
    base: int  # first slot of its range in the SlotCache (a range may move as it grows)
    capacity: int  # slots in its range now (it grows as the sequence does, up to ``limit``)
    limit: int  # slots the sequence may fill: prompt + max tokens + budget + 1 (``generate.Plan.slots``)
    cancel: threading.Event | None = None
    generator: torch.Generator | None = None  # its sampling stream (seeded as in ``generate``)
    sampled: Calibration | None = None  # its drafter's node probabilities -> acceptance at its temperature (``generate``)
    length: int = 0  # committed slots (prompt rows prefilled, then committed tree rows)
    started: float = field(default_factory=time.perf_counter)
    stats: GenerationStats = field(default_factory=GenerationStats)
    hist: Counter = field(default_factory=Counter)
    committed: int = 0  # tokens the tree passes consumed
    features: list[dict] = field(default_factory=list)  # the prompt chunks' hidden states (drafters that read them)
    root: int = -1  # the next tree's root: the last token produced
    deferred: list[tuple[list[int], dict]] = field(default_factory=list)  # passes its drafter has not seen yet:
    # (tokens produced, hidden rows of the committed nodes) while its budget is 0
    decoding: bool = False  # prefill done, first token out
    result: GenerationResult | None = None
    error: BaseException | None = None

    @property
    def prefilling(self) -> bool:
        return not self.decoding


@dataclass(eq=False)
class _Segment:
    seq: Sequence
    lo: int  # its first row in the pass
    tokens: list[int]
    positions: list[int]  # RoPE positions
    visible: torch.Tensor  # [n, n] bool: which of its own rows each row sees
    tree: Tree | None  # None: a prompt chunk
    logit_row: int = -1  # its first row in the pass's logits; -1: none


class Batcher:
    """Runs many generations in shared target passes (the module docstring); fast precision mode only.

    b = Batcher(engine, max_batch=8)
    s = b.add(prompt_ids, GenerateConfig(max_new_tokens=64))
    b.run()              # or b.step() per pass, adding sequences between passes
    s.result.token_ids   # equal to engine.generate(prompt_ids, config).token_ids
    """

    def __init__(self, engine: Engine, max_batch: int = 8, prefill_rows: int = 64, dynamic: bool = True) -> None:
        target = engine.target
        if target.precision != "fast":
            raise SpecdraftError("batching needs the fast precision mode (its rows do not depend on the pass); "
                                 f"the target runs in the {target.precision} mode: use one request at a time")
        if max_batch < 1:
            raise SpecdraftError(f"--max-batch must be >= 1 (got {max_batch})")
        if prefill_rows < 1:
            raise SpecdraftError(f"prefill rows per pass must be >= 1 (got {prefill_rows})")
        self.target = target
        self.drafter: Drafter = engine.drafter or NoDrafter()
        self.max_batch, self.prefill_rows = max_batch, prefill_rows
        self.dynamic = dynamic  # scored trees cut together by the live costs (drafters.budget.LiveCosts.cut_many)
        self.slots = SlotCache(target.model, rows=max(64, prefill_rows))
        self.live: list[Sequence] = []
        self.curve = load_cost_curve(target)
        manifest = getattr(self.drafter, "manifest", None) or {}
        self.profile = manifest.get("acceptance_by_budget")
        self.draft_ms = manifest.get("budget_profile", {}).get("draft_ms")
        self.last_budget: int | None = None  # drafted nodes per tree in the last pass (for /health)
        self.last_rows = 0  # rows in the last pass
        self.peak_live = 0  # most sequences in one pass so far

    # ------------------------------------------------------------------ admission
    def add(self, prompt_ids: list[int], config: GenerateConfig | None = None,
            on_text: Callable[[str], None] | None = None, cancel: threading.Event | None = None,
            on_logprobs: Callable[[list[TokenLogprob]], None] | None = None) -> Sequence:
        """Start a generation at the next pass (checks as ``generate``; refused when the batch is full)."""
        cfg = config or GenerateConfig()
        if len(self.live) >= self.max_batch:
            raise SpecdraftError(f"the batch is full ({self.max_batch} sequences)")
        p = plan(self.target, prompt_ids, self.drafter, cfg)
        first = min(p.slots, len(prompt_ids) + p.budget + 1 + GROW_SLOTS)  # the prompt and a first stretch
        seq = Sequence(list(prompt_ids), cfg, self.drafter.fork(),
                       Emitter(self.target, p.max_new, cfg.stop, on_text, cfg.logprobs, on_logprobs),
                       p.budget, self.slots.alloc(first), first, p.slots, cancel, p.generator,
                       sampled_calibration(getattr(self.drafter, "sampled", None), cfg.sampling))
        self.live.append(seq)
        return seq

    # ------------------------------------------------------------------ the budget rule
    @property
    def cap(self) -> int:
        """The largest own budget among the live sequences (the drafter's without any): the rule's B."""
        return max((s.budget for s in self.live), default=self.drafter.default_budget)

    def budget(self, live: int) -> int:
        """Drafted nodes per tree (before each sequence's own cap) with ``live`` decoding sequences."""
        return batch_budget(self.curve, live, self.cap, self.profile, self.draft_ms)

    def health(self) -> dict:
        """The batch's state and its budget rule (the server's /health)."""
        decoding = sum(s.decoding for s in self.live)
        rows = batch_rows(self.curve, self.cap)
        return {"max_batch": self.max_batch, "live": len(self.live), "prefilling": len(self.live) - decoding,
                "budget_now": self.last_budget, "rows_last_pass": self.last_rows, "peak_live": self.peak_live,
                "budget_by_live": {n: self.budget(n) for n in (1, 2, 4, 8, 16) if n <= self.max_batch},
                "rows_per_pass": rows, "cost_curve": self.curve is not None, "profile": bool(self.profile),
                "rule": BATCH_RULE}

    # ------------------------------------------------------------------ one pass
    def run(self) -> None:
        """Step until every sequence has left."""
        while self.live:
            self.step()

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One target pass over every live sequence; returns those that left (``result`` or ``error`` set)."""
        left = [s for s in self.live if s.cancel is not None and s.cancel.is_set()]
        for s in left:
            self._leave(s, Cancelled())
        if left:
            self.slots.shrink()
        decoding = [s for s in self.live if s.decoding]
        b = self.budget(len(decoding)) if decoding else None
        segments, rows, room = [], 0, self.prefill_rows
        for s in self.live:  # prompt chunks first come, first served
            if s.prefilling and room > 0:
                k = min(room, len(s.prompt_ids) - s.length)
                room -= k
                segments.append(_Segment(s, rows, s.prompt_ids[s.length:s.length + k], list(range(s.length, s.length + k)),
                                         torch.ones(k, k, dtype=torch.bool).tril(), None))
                rows += k
        proposed = []  # (sequence, its tree, its drafting s)
        for s in decoding:
            t0 = time.perf_counter()
            try:
                self._fit(s)
                budget = min(b, s.budget)
                if budget == 0 and len(s.deferred) < MAX_DEFERRED:
                    tree = Tree.single(s.root)  # drafts nothing: its drafter catches up later (``_catch_up``)
                else:
                    self._catch_up(s)
                    tree = rescored(s.drafter.propose(budget), s.sampled)
                self._check_tree(s, tree, budget)
            except Exception as e:  # this sequence fails, the others go on
                self._leave(s, e)
                left.append(s)
                continue
            drafting = time.perf_counter() - t0
            s.stats.draft_s += drafting
            proposed.append((s, tree, drafting))
        costs = live_costs(self.target) if self.dynamic else None
        if costs is not None and proposed:  # the scored trees cut together: the nodes that pay for their rows
            cut = costs.cut_many([t for _, t, _ in proposed], 1000 * sum(d for *_, d in proposed), other_rows=rows)
            proposed = [(s, t, d) for (s, _, d), t in zip(proposed, cut)]
        for s, tree, _ in proposed:
            segments.append(_Segment(s, rows, tree.tokens, [s.length + d for d in tree.depths], tree.ancestor_mask(),
                                     tree))
            rows += len(tree)
        if not segments:
            return left
        self.last_budget, self.last_rows = b, rows
        self.peak_live = max(self.peak_live, len(segments))
        t0 = time.perf_counter()
        try:
            out = self._forward(segments, rows)
        except Exception as e:  # the pass failed: every sequence in it fails
            for seg in segments:
                self._leave(seg.seq, e)
                left.append(seg.seq)
            return left
        pass_s = time.perf_counter() - t0
        if costs is not None:
            costs.observe_pass(rows, 1000 * pass_s)
        src, dst = [], []
        start = self.slots.scratch
        for seg in segments:
            s = seg.seq
            try:
                done = self._take(seg, out, start, src, dst, pass_s)
            except Exception as e:
                done, s.error = True, e
            if done:
                left.append(s)
        self.slots.copy(src, dst)  # the committed rows' K/V into their ranges, before any range is reused
        for s in left:
            if s in self.live:
                self._leave(s, s.error)
        if left:
            self.slots.shrink()  # memory follows the load
        return left

    def _fit(self, s: Sequence) -> None:
        """Room in its range for the next tree and the one after (it doubles, at most to ``limit``)."""
        need = s.length + s.budget + 2
        if need > s.capacity:
            n = min(s.limit, max(2 * s.capacity, need + GROW_SLOTS))
            s.base, s.capacity = self.slots.extend(s.base, n, s.length), n

    def _check_tree(self, s: Sequence, tree: Tree, budget: int) -> None:
        """A tree that would write past its sequence's range or cannot be embedded fails that sequence only."""
        vocab = self.target.config.vocab_size
        if len(tree) > budget + 1 or s.length + len(tree) > s.capacity:
            raise SpecdraftError(f"the drafter proposed {len(tree) - 1} nodes for a budget of {budget}")
        if tree.tokens[0] != s.root or not all(0 <= t < vocab for t in tree.tokens):
            raise SpecdraftError("the drafter proposed a tree with a wrong root or a token outside the vocabulary")

    def _forward(self, segments: list[_Segment], rows: int) -> ForwardOutput:
        """One target pass over the segments' rows (the module docstring's mask and positions)."""
        self.slots.fit_rows(rows)
        start, dev = self.slots.scratch, self.target.device
        mask = torch.zeros(rows, start + rows, dtype=torch.bool)
        windows = self.target.config.sliding_window is not None
        keys = torch.zeros(start + rows, dtype=torch.long) if windows else None  # each slot's position (windows)
        tokens, positions, logit_rows = [], [], []
        for seg in segments:
            s, n = seg.seq, len(seg.tokens)
            mask[seg.lo:seg.lo + n, s.base:s.base + s.length] = True
            if windows:
                keys[s.base:s.base + s.length] = torch.arange(s.length)
                keys[start + seg.lo:start + seg.lo + n] = torch.tensor(seg.positions)
            mask[seg.lo:seg.lo + n, start + seg.lo:start + seg.lo + n] = seg.visible
            tokens += seg.tokens
            positions += seg.positions
            if seg.tree is not None:
                seg.logit_row = len(logit_rows)
                logit_rows += range(seg.lo, seg.lo + n)
            elif s.length + n == len(s.prompt_ids):  # the prompt's last chunk: its last row's logits
                seg.logit_row = len(logit_rows)
                logit_rows.append(seg.lo + n - 1)
        return self.target.model(torch.tensor([tokens], device=dev), torch.tensor([positions], device=dev),
                                 mask[None].to(dev), self.slots.cache, start, hidden_layers=self.drafter.hidden_layers,
                                 logits=torch.tensor(logit_rows, dtype=torch.long, device=dev),
                                 key_positions=None if keys is None else keys[None].to(dev))

    def _take(self, seg: _Segment, out: ForwardOutput, start: int, src: list[int], dst: list[int], pass_s: float) -> bool:
        """Apply the pass to one sequence (its K/V copies queued in ``src``/``dst``); True when it is done."""
        s, n = seg.seq, len(seg.tokens)
        hidden = {layer: h[:, seg.lo:seg.lo + n] for layer, h in out.hidden.items()}
        if seg.tree is None:  # a prompt chunk: all its rows are committed
            src += range(start + seg.lo, start + seg.lo + n)
            dst += range(s.base + s.length, s.base + s.length + n)
            s.length += n
            if hidden:
                s.features.append({k: v.clone() for k, v in hidden.items()})
            if s.length < len(s.prompt_ids):
                return False
            logits = out.logits[0, seg.logit_row]
            cfg = s.config
            first = argmax_rows(logits[None])[0] if cfg.sampling.greedy else sample(logits, cfg.sampling, s.generator)
            s.stats.prefill_s = time.perf_counter() - s.started
            s.decoding, s.root = True, first
            s.emit.push([first], logits[None])
            if s.emit.done:
                return True
            feats = {k: torch.cat([c[k] for c in s.features], 1) for k in s.features[0]} if s.features else {}
            s.features = []
            s.drafter.reset(s.prompt_ids, first, ForwardOutput(logits=out.logits[:, seg.logit_row:seg.logit_row + 1],
                                                               hidden=feats))
            return False
        tree = seg.tree
        t0 = time.perf_counter()
        acc = verify(tree, out.logits[0, seg.logit_row:seg.logit_row + n], s.config.sampling, s.generator)
        src += [start + seg.lo + i for i in acc.path]
        dst += range(s.base + s.length, s.base + s.length + len(acc.path))
        s.length += len(acc.path)
        st = s.stats
        st.verify_s += pass_s + time.perf_counter() - t0
        st.passes += 1
        st.tree_nodes += n - 1
        s.hist[len(acc.tokens)] += 1
        rows = out.logits[0, seg.logit_row + torch.tensor(acc.path)] if s.config.logprobs is not None else None
        s.committed += s.emit.push(acc.new_tokens, rows)
        if s.emit.done:
            return True
        s.root = acc.bonus
        if n == 1:  # a lone root: the drafter catches up before it next drafts
            s.deferred.append((acc.new_tokens, path_rows(hidden, acc.path, copy=True)))
        else:
            t1 = time.perf_counter()
            s.drafter.commit(acc, ForwardOutput(logits=out.logits[:, seg.logit_row:seg.logit_row + n], hidden=hidden))
            st.draft_s += time.perf_counter() - t1
        return s.length + s.budget + 2 > s.limit  # context exhausted (as in ``generate``)

    @staticmethod
    def _catch_up(s: Sequence) -> None:
        """Give the drafter the passes it has not seen (``generate.catch_up``)."""
        catch_up(s.drafter, s.deferred)

    def _leave(self, s: Sequence, error: BaseException | None) -> None:
        self.live.remove(s)
        self.slots.release(s.base)
        s.error = error
        if error is None:
            s.stats.finish(len(s.emit.tokens), s.committed, s.hist, time.perf_counter() - s.started)
            s.result = s.emit.result(s.stats)
