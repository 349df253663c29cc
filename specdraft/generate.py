"""One generate loop for every drafter (plain decoding = the empty drafter).

    prefill(prompt) -> first token (the first root) -> drafter.reset
    loop: tree = drafter.propose(budget), or the root alone where drafting does not pay (costs.drafting_pays)
          sampling: its probabilities rescored to sampled acceptance (drafters.calibration.rescored)
          tree = costs.cut(tree)   (a scored tree: the nodes that pay on this machine, drafters.budget)
          logits = target.forward_tree(tree)
          accepted = verify(tree, logits); target.commit(accepted.path); drafter.commit(...)
          costs.observe(the pass's, the drafting's time, the tokens); stream the new tokens;
          stop on EOS / max tokens / stop strings
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from specdraft.drafters.base import Drafter, NoDrafter
from specdraft.drafters.budget import LiveCosts, live_costs
from specdraft.drafters.calibration import rescored, sampled_calibration
from specdraft.errors import SpecdraftError
from specdraft.target import Target
from specdraft.tree import Tree
from specdraft.model.llama import ForwardOutput
from specdraft.verify import Accepted, Sampling, argmax_rows, sample, verify


MAX_TOP_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (OpenAI's limit)


@dataclass
class TokenLogprob:
    """The target's own log-probability of one emitted token: log_softmax of the raw logits (before temperature,
    top-k or top-p) at the position that produced it, and the ``top`` most likely tokens there."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, log-probability), most likely first


def token_logprobs(rows: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """rows: [n, V] the target's logits at the positions that produced ``tokens`` (n of them)."""
    lp = torch.log_softmax(rows.float(), -1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if top:
        vals, ids = lp.topk(min(top, lp.shape[-1]), -1)  # most likely first
        alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        alts = [[] for _ in tokens]
    return [TokenLogprob(t, c, a) for t, c, a in zip(tokens, chosen, alts)]


@dataclass
class GenerateConfig:
    max_new_tokens: int = 256  # tokens to generate at most (EOS excluded)
    sampling: Sampling = field(default_factory=Sampling)  # temperature 0 = greedy
    seed: int | None = None  # sampling seed (None = 0)
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the text)
    budget: int | None = None  # drafted nodes per tree; None = the drafter's default
    dynamic: bool = True  # cut each scored tree to the nodes that pay on this machine (drafters.budget.LiveCosts);
    # False: every tree as the drafter proposed it
    logprobs: int | None = None  # None: none; N >= 0: each token's log-probability and the N most likely (<= 20)

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise SpecdraftError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {self.logprobs})")


@dataclass
class GenerationStats:
    new_tokens: int = 0  # tokens generated (stop token excluded)
    passes: int = 0  # target passes after prefill
    committed: int = 0  # tokens those passes consumed: EOS counted, the prefill's first token not
    tokens_per_pass: float = 0.0  # committed / passes
    accept_hist: dict[int, int] = field(default_factory=dict)  # drafted tokens accepted -> passes
    tree_nodes: int = 0  # drafted nodes summed over passes
    pass_rows: dict[int, int] = field(default_factory=dict)  # rows in a target pass (tree size) -> passes
    prefill_s: float = 0.0
    draft_s: float = 0.0  # the drafter's work: propose, and commit (reading the accepted features)
    verify_s: float = 0.0  # target tree passes + verification + cache compaction
    wall_s: float = 0.0  # everything, prefill included
    tok_s: float = 0.0  # new_tokens / wall_s

    def to_dict(self) -> dict:
        return asdict(self)

    def finish(self, new_tokens: int, committed: int, hist: Counter, wall_s: float) -> None:
        """Fill in the totals once the generation has ended."""
        self.new_tokens, self.committed, self.wall_s = new_tokens, committed, wall_s
        self.tok_s = new_tokens / wall_s if wall_s > 0 else 0.0
        self.tokens_per_pass = committed / self.passes if self.passes else 0.0
        self.accept_hist = dict(sorted(hist.items()))


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids (EOS excluded)
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids (``GenerateConfig.logprobs``)


def check_budget(budget: int, target: Target) -> None:
    """A node budget must be >= 0 and fit the target's context (a tree's nodes take cache slots and
    logit rows; a budget past the context would only allocate memory no sequence can use)."""
    if budget < 0:
        raise SpecdraftError(f"budget must be >= 0 (got {budget})")
    if budget >= target.config.max_position:
        raise SpecdraftError(f"budget {budget} does not fit the target's context of {target.config.max_position} tokens")


@dataclass
class Plan:
    """What a generation starts with, once its request has been checked (``plan``)."""

    budget: int  # drafted nodes per tree
    max_new: int  # tokens to generate at most (the configured limit, or less where the context ends)
    slots: int  # cache slots the sequence may fill: prompt + max_new + budget + 1
    generator: torch.Generator | None  # the sampling stream, seeded (None: greedy)


def plan(target: Target, prompt_ids: list[int], drafter: Drafter, cfg: GenerateConfig) -> Plan:
    """Check a request (prompt, max tokens, budget, context, sliding window) and derive its ``Plan``; shared
    by ``generate`` and the batch (``batch.Batcher.add``), so both refuse and size a request alike."""
    if not prompt_ids:
        raise SpecdraftError("the prompt is empty")
    if cfg.max_new_tokens < 1:
        raise SpecdraftError(f"max new tokens must be >= 1 (got {cfg.max_new_tokens})")
    budget = drafter.default_budget if cfg.budget is None else cfg.budget
    check_budget(budget, target)
    n, ctx = len(prompt_ids), target.config.max_position
    if n >= ctx:
        raise SpecdraftError(f"the prompt is {n} tokens, longer than the target's context of {ctx}")
    max_new = min(cfg.max_new_tokens, ctx - n)
    slots = n + max_new + budget + 1
    gen = None
    if not cfg.sampling.greedy:
        gen = torch.Generator(device=target.device).manual_seed(0 if cfg.seed is None else cfg.seed)
    return Plan(budget, max_new, slots, gen)


def _first_stop(text: str, stops: list[str]) -> int:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


class Emitter:
    """The tokens a generation keeps and the text it streams.  ``push`` appends accepted tokens: EOS,
    ``max_new`` tokens or a stop string ends the generation (``done``, ``finish``); ``on_text`` gets
    the text once no stop string can still start in it and no UTF-8 sequence is cut.  With ``logprobs``
    (``GenerateConfig.logprobs``) ``push`` also takes the logits rows that produced the tokens and keeps
    each kept token's ``TokenLogprob``; ``on_logprobs`` gets them as they come, before the text they hold."""

    def __init__(self, target: Target, max_new: int, stop: list[str], on_text: Callable[[str], None] | None,
                 logprobs: int | None = None, on_logprobs: Callable[[list[TokenLogprob]], None] | None = None) -> None:
        self.target, self.max_new, self.stop, self.on_text = target, max_new, stop, on_text
        self.top, self.on_logprobs = logprobs, on_logprobs
        self.eos = target.eos_ids
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        self.emitted = 0  # characters already streamed
        self.hold = max((len(x) for x in stop), default=1) - 1  # chars that might start a stop string
        self.finish = "length"
        self.done = False

    def push(self, new: list[int], rows: Tensor | None = None) -> int:
        """Append accepted tokens (``rows`` [len(new), V]: the logits that produced each, needed with
        ``logprobs``); returns the tokens consumed (EOS included)."""
        used = kept = 0
        for tok in new:
            used += 1
            if tok in self.eos:
                self.finish, self.done = "stop", True
                break
            self.tokens.append(tok)
            kept += 1
            if len(self.tokens) >= self.max_new:
                self.done = True
                break
        if self.logprobs is not None and kept:
            entries = token_logprobs(rows[:kept], new[:kept], self.top)
            self.logprobs += entries
            if self.on_logprobs is not None:
                self.on_logprobs(entries)
        if self.stop or self.on_text is not None:
            text = self.target.decode(self.tokens)
            cut = _first_stop(text, self.stop) if self.stop else -1
            if cut >= 0:
                self.finish, self.done, text = "stop", True, text[:cut]
            safe = len(text) if self.done else max(self.emitted, len(text) - self.hold)
            while safe > self.emitted and text[safe - 1] == "\ufffd" and not self.done:
                safe -= 1  # an incomplete UTF-8 sequence: wait for the next token
            if self.on_text is not None and safe > self.emitted:
                self.on_text(text[self.emitted:safe])
            self.emitted = max(self.emitted, safe)
        return used

    def result(self, stats: GenerationStats) -> GenerationResult:
        text = self.target.decode(self.tokens)
        if self.stop:
            cut = _first_stop(text, self.stop)
            if cut >= 0:
                text = text[:cut]
        return GenerationResult(token_ids=self.tokens, text=text, finish_reason=self.finish, stats=stats,
                                logprobs=self.logprobs)


def path_rows(hidden: dict[int, Tensor], path: list[int], copy: bool = False) -> dict[int, Tensor]:
    """The rows ``path`` of each hidden state [B, T, H] of a pass.  Where the path is the first rows (a paused
    step's lone root) a slice, a view unless ``copy`` (each pass makes new tensors, so a view stays as it was;
    ``copy`` where the tensors are views of a bigger pass that should not be kept alive), else copies."""
    if path == list(range(len(path))):
        return {k: v[:, :len(path)].clone() if copy else v[:, :len(path)] for k, v in hidden.items()}
    rows = torch.tensor(path)
    return {k: v.index_select(1, rows.to(v.device)) for k, v in hidden.items()}


def catch_up(drafter: Drafter, deferred: list[tuple[list[int], dict]]) -> None:
    """Give ``drafter`` the passes it has not seen (``deferred``: per pass, the tokens it produced and the hidden
    rows of its committed nodes), as one commit: those tokens, and the rows in order (what a commit reads,
    ``Accepted.path`` rows and ``new_tokens``).  A drafter that steps over many positions at once (hybrid,
    block) does in one call what one call per pass would; its drafts may differ in the last bits, the output
    cannot.  Empties ``deferred``."""
    if not deferred:
        return
    tokens = [t for new, _ in deferred for t in new]
    hidden = {k: torch.cat([h[k] for _, h in deferred], 1) for k in deferred[0][1]}
    deferred.clear()
    drafter.commit(Accepted(path=list(range(len(tokens))), tokens=tokens[:-1], bonus=tokens[-1]),
                   ForwardOutput(logits=None, hidden=hidden))


def generate(
    target: Target,
    prompt_ids: list[int],
    drafter: Drafter | None = None,
    config: GenerateConfig | None = None,
    on_text: Callable[[str], None] | None = None,
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
) -> GenerationResult:
    """Generate from ``prompt_ids``; ``on_text`` receives the text as it is accepted, ``on_logprobs`` (with
    ``config.logprobs``) its tokens' log-probabilities just before."""
    cfg = config or GenerateConfig()
    drafter = drafter or NoDrafter()
    p = plan(target, prompt_ids, drafter, cfg)
    budget, max_new, gen, s = p.budget, p.max_new, p.generator, cfg.sampling
    stats = GenerationStats()
    hist: Counter[int] = Counter()
    t_start = time.perf_counter()

    target.prepare(budget)
    out = target.prefill(prompt_ids, max_slots=p.slots, hidden_layers=drafter.hidden_layers)
    last_logits = out.logits[0, -1]
    if s.greedy:
        first = argmax_rows(last_logits[None])[0]
    else:
        first = sample(last_logits, s, gen)
    stats.prefill_s = time.perf_counter() - t_start

    emit = Emitter(target, max_new, cfg.stop, on_text, cfg.logprobs, on_logprobs)
    emit.push([first], last_logits[None])
    done = emit.done
    if not done:
        drafter.reset(prompt_ids, first, out)
    committed_by_passes, root = 0, first
    costs: LiveCosts | None = live_costs(target) if cfg.dynamic and budget > 0 else None
    if costs is not None:
        costs.start(drafter.name)
    smap = sampled_calibration(getattr(drafter, "sampled", None), s) if costs is not None else None
    deferred: list[tuple[list[int], dict]] = []  # passes the drafter has not seen while drafting paused (catch_up)
    while not done:
        t0 = time.perf_counter()
        drafting = costs is None or costs.drafting_pays(drafter.name)
        if drafting:
            catch_up(drafter, deferred)
        tc = time.perf_counter()
        if costs is not None and isinstance(getattr(drafter, "floor", None), float):
            floor = costs.floor(drafter.name)  # serial drafters stop where no path can pay
            drafter.floor = floor if smap is None else smap.below(floor)  # sampling: where no path's rescored p can
        t1 = time.perf_counter()
        tree = drafter.propose(budget) if drafting else Tree.single(root)
        t2 = time.perf_counter()
        if costs is not None:
            tree = costs.cut(rescored(tree, smap), drafter.name)
        out = target.forward_tree(tree, hidden_layers=drafter.hidden_layers)
        t3 = time.perf_counter()
        acc = verify(tree, out.logits[0], s, gen)
        target.commit(acc.path)
        stats.verify_s += time.perf_counter() - t2
        stats.passes += 1
        stats.tree_nodes += len(tree) - 1
        stats.pass_rows[len(tree)] = stats.pass_rows.get(len(tree), 0) + 1
        hist[len(acc.tokens)] += 1
        rows = out.logits[0, acc.path] if cfg.logprobs is not None else None  # row path[i] produced token i
        committed_by_passes += emit.push(acc.new_tokens, rows)
        done, root = emit.done, acc.bonus
        t4 = t5 = time.perf_counter()
        if not done and drafting:
            drafter.commit(acc, out)
            t5 = time.perf_counter()
        elif not done:  # drafting paused: the drafter sees this pass when it next drafts
            deferred.append((acc.new_tokens, path_rows(out.hidden, acc.path)))
        stats.draft_s += (t2 - t0) + (t5 - t4)
        if costs is not None:
            costs.observe(drafter.name, len(tree), 1000 * (t3 - t2), 1000 * (t2 - t1), 1000 * ((t1 - tc) + (t5 - t4)),
                          len(acc.new_tokens), drafting, catch_up_ms=1000 * (tc - t0))
        if target.length + budget + 2 > target.capacity and not done:
            done = True  # context exhausted

    stats.finish(len(emit.tokens), committed_by_passes, hist, time.perf_counter() - t_start)
    return emit.result(stats)
