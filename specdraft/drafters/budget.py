"""The one budget policy: how many drafted nodes a drafter's tree gets when the user gives none.

On a CPU a pass over N tokens costs more than one token, so the budget must be sized to the
machine.  ``specdraft prepare`` (N = 1..32, once) and ``specdraft bench --cost-curve`` (N = 1..64) measure
the target's pass time for N tokens and store it per target, device, dtype and thread count
(``curve_path``).  A drafter then takes:

1. with a budget profile in its checkpoint (``acceptance_by_budget``: held-out tokens per pass per
   budget, from ``specdraft train profile``) and a stored cost curve: the budget maximising tokens
   per pass / (the pass over budget + 1 tokens + the measured drafting time) (``best_budget``);
2. with a cost curve but no profile, for a drafter whose registry entry scales with the curve
   (prompt lookup, the hybrid drafters): the largest tree costing at most 1.5x a one-token pass
   (``budget_from_curve``);
3. otherwise: the drafter's own fallback (its registry entry).

With a drafter that scores its nodes (``Tree.probs``: each node's calibrated probability of being
accepted) that budget is only the tree's cap: each pass the tree is cut to the nodes that pay
(``LiveCosts.cut``).  Taking nodes best first, k drafted nodes are worth 1 + p_1 + ... + p_k tokens
for a step of pass(k + 1) + drafting ms; the cut keeps the k with the most tokens per ms, k = 0 (a
plain step) when nothing is confident enough.  pass(n) and drafting are live: moving averages of
this process's own passes, started from the stored cost curve.  A drafter whose drafted steps commit
fewer tokens per ms than a plain pass pauses, probing now and then with a few drafted steps
(``LiveCosts.drafting_pays``).  The batch cuts its sequences' trees together (``LiveCosts.cut_many``).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch

from specdraft.model.load import cache_dir

CURVE_VERSION = 4  # bumped whenever a pass's cost changes (2: fused quantized decoder blocks; 3: their glue as plain
# loops; 4: the fast precision mode, whose curves are stored apart from the exact mode's): older curves are stale


def curve_path(target) -> Path:
    """Where this machine's cost curve for ``target`` (as loaded: device, dtype, precision / kernel, threads) lives."""
    dtype = str(target.model.dtype).replace("torch.", "")
    q = target.model.quantized_rows
    mode = "fast" if target.model.precision == "fast" else (f"q{q}" if q else "")
    name = (f"{target.weight_hash[:16]}_{target.device.type}_{dtype}{f'_{mode}' if mode else ''}"
            f"_t{torch.get_num_threads()}_e{CURVE_VERSION}.json")
    return cache_dir() / "cost_curves" / name


def save_cost_curve(target, curve: dict) -> Path:
    path = curve_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve, indent=1))
    return path


def load_cost_curve(target) -> dict | None:
    path = curve_path(target)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # a torn file: treated as not measured


def budget_from_curve(curve: dict, max_ratio: float = 1.5, default: int = 8, cap: int = 32) -> int:
    """Drafted nodes (tree size - 1) of the largest tree costing <= max_ratio x one token."""
    ok = [n for n, r in zip(curve["n"], curve["ratio"]) if r <= max_ratio]
    if not ok:
        return default
    return max(1, min(cap, max(ok) - 1))


def best_budget(curve: dict | None, tokens_per_pass: dict, default: int, draft_ms: dict | None = None) -> int:
    """The budget maximising tokens per pass / cost of a step (``tokens_per_pass``: budget -> measured
    tokens per pass, e.g. a drafter's held-out profile).  A step costs the curve's pass over budget + 1
    tokens, plus ``draft_ms[budget]`` (drafting time per pass, when given) in units of the curve's
    one-token pass.  ``default`` without a curve or profile."""
    if not curve or not tokens_per_pass:
        return default
    ratio, worst = {}, 0.0
    for n, r in zip(curve["n"], curve["ratio"]):  # a bigger tree is never counted as cheaper (noise)
        worst = max(worst, r)
        ratio[n] = worst
    one = float(curve["ms"][0]) if curve.get("ms") else 0.0
    draft = {int(b): float(v) for b, v in (draft_ms or {}).items()}

    def cost(b: int) -> float:
        return ratio[b + 1] + (draft.get(b, 0.0) / one if one > 0 else 0.0)

    scored = [(float(t) / cost(int(b)), int(b)) for b, t in tokens_per_pass.items() if int(b) + 1 in ratio]
    return max(scored)[1] if scored else default


def default_budget(target, fallback: int, manifest: dict | None = None, scale_with_curve: bool = True) -> int:
    """The policy in the module docstring; ``manifest``: the drafter checkpoint's (None: no profile)."""
    curve = load_cost_curve(target)
    if curve is None:
        return fallback
    profile = (manifest or {}).get("acceptance_by_budget")
    if profile:
        return best_budget(curve, profile, fallback, (manifest or {}).get("budget_profile", {}).get("draft_ms"))
    return budget_from_curve(curve, default=fallback) if scale_with_curve else fallback


# ---------------------------------------------------------------------- many sequences in one pass
BATCH_RULE = ("each of the L sequences sharing a pass gets b drafted nodes, at most its own budget B: with the "
              "drafter's budget profile a(b) (tokens per pass) and the cost curve c(rows), the b maximising "
              "L a(b) / (c(L (b+1)) + L draft(b)); without a profile b = R // L - 1 (at least 0), R = the largest "
              "pass costing <= 1.5x one token (B + 1 without a curve)")


def pass_ratio(curve: dict, rows: int) -> float:
    """A pass over ``rows`` rows in units of one token's, from the cost curve: linear between its points
    (never cheaper than a smaller pass: noise), past its end along its last segment."""
    n = [int(x) for x in curve["n"]]
    r, worst = [], 0.0
    for x in curve["ratio"]:
        worst = max(worst, float(x))
        r.append(worst)
    if rows <= n[0]:
        return r[0]
    for i in range(1, len(n)):
        if rows <= n[i]:
            return r[i - 1] + (r[i] - r[i - 1]) * (rows - n[i - 1]) / (n[i] - n[i - 1])
    slope = (r[-1] - r[-2]) / (n[-1] - n[-2]) if len(n) > 1 else 0.0
    return r[-1] + slope * (rows - n[-1])


def batch_budget(curve: dict | None, live: int, budget: int, profile: dict | None = None,
                 draft_ms: dict | None = None) -> int:
    """Drafted nodes per tree when ``live`` sequences share every pass (``BATCH_RULE``); ``budget``: a
    sequence's own (single-stream) budget, the cap; ``profile``: budget -> tokens per pass (a checkpoint's
    ``acceptance_by_budget``); ``draft_ms``: budget -> drafting ms per sequence and pass."""
    if budget <= 0 or live <= 0:
        return max(0, budget)
    if curve is not None and profile:
        one = float(curve["ms"][0]) if curve.get("ms") else 0.0
        draft = {int(b): float(v) for b, v in (draft_ms or {}).items()}
        tokens = {0: 1.0, **{int(b): float(t) for b, t in profile.items() if int(b) <= budget}}

        def rate(b: int) -> float:
            extra = live * draft.get(b, 0.0) / one if one > 0 and b > 0 else 0.0
            return live * tokens[b] / (pass_ratio(curve, live * (b + 1)) + extra)

        return max(tokens, key=lambda b: (rate(b), -b))
    return max(0, min(budget, batch_rows(curve, budget) // live - 1))


def batch_rows(curve: dict | None, budget: int) -> int:
    """R of ``BATCH_RULE``: the rows of the largest pass costing <= 1.5x one token (not capped at one tree's
    size as ``budget_from_curve`` is); ``budget`` + 1 without a curve."""
    if curve is None:
        return budget + 1
    return budget_from_curve(curve, default=budget, cap=max(int(n) for n in curve["n"])) + 1


# ---------------------------------------------------------------------- live costs and the tree cut
EMA = 0.1  # weight of the newest pass in the moving averages
SEEN = 8  # passes of one size after which its own average replaces the scaled curve
STALE = 256  # passes after which a size not seen since loses its own average (the scaled curve again, from which its
# average starts over when next seen): else a size priced high once is never cut to again, so never re-measured
CLIP = 1.5  # a pass counts as at most this many times the current estimate (a preempted pass is noise, not pace)
PROBE = 16  # a drafter whose drafted steps do not pay pauses for this many steps, then probes ...
PROBE_MAX = 128  # ... the pause doubling after each probe that leaves it paused, up to this (each new generation
# starts again at PROBE: new text may suit it)
BURST = 6  # a probe: this many drafted steps, their mean blended half and half into the moving average below
# (one step would hardly move an average over ~30)
GATE_EMA = 0.03  # weight of the newest drafted step in what drafting gains and costs (~30 steps: one unlucky
# stretch does not stop it)


class LiveCosts:
    """This machine's step costs as measured live (ms): a target pass over n rows and each drafter's
    drafting per pass.  A size seen ``SEEN`` times costs its own moving average; any other size the
    stored curve's time times the live/curve ratio averaged over every pass so far (the machine's
    current pace), as does a size not seen for ``STALE`` passes.  A bigger pass is never counted as cheaper than a
    smaller one.  Per drafter it also keeps what a drafted step gains (tokens) and costs (ms), so drafting stops
    where it does not pay."""

    def __init__(self, curve: dict, source: Path | None = None) -> None:
        self.source = source  # the stored curve's file
        self.curve = {int(n): float(m) for n, m in zip(curve["n"], curve["ms"])}
        self.top = max(self.curve)
        self.scale = 1.0  # live / curve, averaged over passes
        self.live: dict[int, tuple[float, int]] = {}  # rows -> (average ms, passes seen since it (re)started)
        self.passes = 0  # passes observed
        self.last: dict[int, int] = {}  # rows -> the pass (count) that last had that many rows
        self.totals: dict[int, list[float]] = {}  # rows -> [sum of the passes' ms as measured, passes]: their mean
        self.propose: dict[str, float] = {}  # drafter name -> average ms of a propose
        self.commit: dict[str, float] = {}  # drafter name -> average ms of its commit
        self.drafted: dict[str, list[float]] = {}  # drafter name -> [average tokens, average ms, steps] of drafted steps
        self.skipped: dict[str, int] = {}  # drafter name -> steps not drafted since its last drafted step
        self.pause: dict[str, int] = {}  # drafter name -> steps between probes while its drafting does not pay
        self.burst: dict[str, list[float]] = {}  # drafter name -> [tokens, ms, steps] of the probe under way

    def curve_ms(self, rows: int) -> float:
        """The stored curve at ``rows`` (past its end: along its last two points)."""
        if rows <= self.top:
            return self.curve.get(rows) or self.curve[min(self.curve, key=lambda n: abs(n - rows))]
        step = self.curve[self.top] - self.curve.get(self.top - 1, 0.0)
        return self.curve[self.top] + max(step, 0.0) * (rows - self.top)

    def pass_ms(self, most: int) -> list[float]:
        """Estimated ms of a pass over 1..``most`` rows (index n - 1)."""
        out, worst = [], 0.0
        for n in range(1, most + 1):
            ms, seen = self.live.get(n, (0.0, 0))
            own = seen >= SEEN and self.passes - self.last[n] <= STALE
            worst = max(worst, ms if own else self.scale * self.curve_ms(n))
            out.append(worst)
        return out

    def draft_ms(self, drafter: str) -> float:
        """A step's drafting (propose and commit), ms."""
        return self.propose.get(drafter, 0.0) + self.commit.get(drafter, 0.0)

    def observe(self, drafter: str, rows: int, pass_ms: float, propose_ms: float, commit_ms: float, tokens: int,
                drafted: bool, catch_up_ms: float = 0.0) -> None:
        """One step: its pass over ``rows`` rows, the drafter's propose and commit (if ``drafted``) and catch-up (the
        passes it did not see while paused, given at once: part of a probe's cost, what resuming costs), the
        tokens it committed."""
        pass_ms = self.observe_pass(rows, pass_ms)
        if not drafted:
            return
        _average(self.commit, drafter, commit_ms)
        _average(self.propose, drafter, propose_ms)
        step_ms = pass_ms + propose_ms + commit_ms  # what drafting costs from step to step
        burst = self.burst.get(drafter)
        if burst is not None:
            burst[0] += tokens
            burst[1] += step_ms + catch_up_ms
            burst[2] += 1
            if burst[2] >= BURST:  # the probe's mean counts half: new text moves the gate at once
                del self.burst[drafter]
                d = self.drafted[drafter]
                d[0], d[1] = (d[0] + burst[0] / burst[2]) / 2, (d[1] + burst[1] / burst[2]) / 2
                self.pause[drafter] = PROBE if self._pays(drafter) else min(2 * self.pause[drafter], PROBE_MAX)
            return
        d = self.drafted.setdefault(drafter, [float(tokens), step_ms, 0])
        d[0] += GATE_EMA * (tokens - d[0])
        d[1] += GATE_EMA * (min(step_ms, CLIP * d[1]) - d[1])
        d[2] += 1

    def observe_pass(self, rows: int, pass_ms: float) -> float:
        """A target pass over ``rows`` rows took ``pass_ms``; returns it as counted (clipped)."""
        total = self.totals.setdefault(rows, [0.0, 0])
        total[0] += pass_ms
        total[1] += 1
        avg, seen = self.live.get(rows, (pass_ms, 0))
        if self.passes - self.last.get(rows, self.passes) > STALE:  # an old average: start over from the scaled curve
            avg, seen = self.scale * self.curve_ms(rows), 0
        self.passes += 1
        self.last[rows] = self.passes
        pass_ms = min(pass_ms, CLIP * avg)
        self.live[rows] = (avg + EMA * (pass_ms - avg), seen + 1)
        self.scale += EMA * (min(pass_ms / self.curve_ms(rows), CLIP * self.scale) - self.scale)
        return pass_ms

    def start(self, drafter: str) -> None:
        """A new generation: a paused drafter's pause is cut back to ``PROBE`` steps, counted from its last drafted
        step (so one paused longer than that probes at once): new text may suit it."""
        if drafter in self.pause:
            self.pause[drafter] = PROBE

    def _pays(self, drafter: str) -> bool:
        """Whether ``drafter``'s drafted steps (their moving average) commit more tokens per ms than plain passes,
        or are too few to say."""
        d = self.drafted.get(drafter)
        return d is None or d[2] < SEEN or d[0] / d[1] > 1.0 / self.pass_ms(1)[0]

    def drafting_pays(self, drafter: str) -> bool:
        """Whether to draft this step: while ``_pays``, yes.  Otherwise the drafter pauses, and after ``PROBE``
        steps probes: ``BURST`` drafted steps whose mean moves the average half way, resuming drafting if that
        makes it pay, else pausing twice as long (up to ``PROBE_MAX``).  A drafter that keeps not paying costs
        ever less (its catch-up grows rarer and cheaper per token); one that pays again resumes."""
        if drafter in self.burst or self._pays(drafter):
            self.skipped[drafter] = 0
            return True
        self.skipped[drafter] = self.skipped.get(drafter, 0) + 1
        if self.skipped[drafter] <= self.pause.setdefault(drafter, PROBE):
            return False
        self.skipped[drafter] = 0
        self.burst[drafter] = [0.0, 0.0, 0]
        return True

    def floor(self, drafter: str) -> float:
        """The probability below which no node pays for its row now: even as the only node, one with p adds p
        tokens for pass(2) - pass(1) more ms, which pays only if p > (pass(2) - pass(1)) / (pass(1) + drafting);
        deeper nodes face a higher rate.  Serial drafters stop drafting deeper where no path reaches it."""
        one, two = self.pass_ms(2)
        return (two - one) / (one + self.draft_ms(drafter))

    def cut(self, tree, drafter: str):
        """``tree`` (with ``probs``) cut to the k best nodes maximising (1 + their probabilities) /
        (pass(k + 1) + drafting ms): the tree itself, a part of it, or the root alone."""
        return self.cut_many([tree], self.draft_ms(drafter))[0]

    def cut_many(self, trees: list, draft_ms: float, other_rows: int = 0) -> list:
        """The trees of one pass (a batch's sequences; ``other_rows`` more rows share it, e.g. prompt chunks)
        cut together: their nodes best first, the k maximising (L + p_1 + ... + p_k) / (pass(L + other_rows + k)
        + ``draft_ms``) for L trees.  A tree without ``probs`` is kept whole (its nodes counted as rows)."""
        if not any(t.probs and len(t) > 1 for t in trees):
            return trees
        fixed = other_rows + sum(1 if t.probs else len(t) for t in trees)
        order = sorted(((-t.probs[i], j, i) for j, t in enumerate(trees) if t.probs for i in range(1, len(t))))
        cost = self.pass_ms(fixed + len(order))
        tokens = float(len(trees))
        best, best_k = tokens / (cost[fixed - 1] + draft_ms), 0
        for k, (neg, _, _) in enumerate(order, 1):
            tokens -= neg
            rate = tokens / (cost[fixed + k - 1] + draft_ms)
            if rate > best:
                best, best_k = rate, k
        keep: dict[int, list[int]] = {}
        for _, j, i in order[:best_k]:  # a parent before its children: p never rises along a path, ties by index
            keep.setdefault(j, []).append(i)
        return [t if not t.probs or len(keep.get(j, ())) == len(t) - 1 else t.keep(keep.get(j, []))
                for j, t in enumerate(trees)]


def _average(table: dict, key: str, ms: float) -> None:
    avg = table.get(key)
    table[key] = ms if avg is None else avg + EMA * (min(ms, CLIP * avg) - avg)


_LIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def live_costs(target) -> LiveCosts | None:
    """The target's ``LiveCosts`` in this process (shared by every generation on it), started from its
    stored cost curve; None without one (then trees are used as proposed)."""
    costs = _LIVE.get(target)
    if costs is None or costs.source != curve_path(target):
        curve = load_cost_curve(target)
        if curve is None:
            return None
        costs = _LIVE[target] = LiveCosts(curve, curve_path(target))
    return costs
