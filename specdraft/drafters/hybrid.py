"""Hybrid drafter (Gumiho, ICML 2025): serial Transformer steps for the first draft tokens,
parallel MLP heads for the later ones; Medusa (S = 0) and EAGLE-style (M = 0) are configurations
of the same network (``specdraft.nn.hybrid``).

Notation: committed tokens x_0 .. x_n, where the root x_n is committed but not yet run through
the target; f_i is the target's feature at position i (it predicted x_{i+1}).

Serial part.  The drafter keeps its own K/V cache of the committed positions, computed from the
target's true features of accepted nodes only.  Step 1 is position n-1 (input f_{n-1}, x_n): its
output h^1 scores depth 1 through the frozen target LM head.  Step s >= 2 runs at position
n+s-2 on the kept beams, input [e(x^_{s-1}) ; h^{s-1}] (the drafter's own state replaces the
target's feature), attending to the cache plus its own path's earlier steps.

Parallel part.  Head j reads [h^1 .. h^S ; e(x^_S)] of a depth-S path (for S = 0:
[g(f_{n-1}) ; e(x_n)]) and scores depth S+1+j in one step.  (Gumiho's heads read the serial states
only; the path's last token is added here so siblings get their own heads.)

Every LM-head product runs over the draft vocabulary's rows of the target's frozen LM head.

Tree: beam expansion per depth (top-k children per expanded node, at most ``beams`` nodes kept
per depth), then the global top-(budget) nodes by cumulative log-probability, prefix-closed,
plus the root (``build_beam_tree``).  Training: ``specdraft.train.hybrid``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdraft.drafters.base import TrainedDrafter, TrainedOptions, prepare_network
from specdraft.drafters.calibration import with_scores
from specdraft.errors import SpecdraftError
from specdraft.model.llama import ForwardOutput
from specdraft.nn.checkpoint import DraftCheckpoint
from specdraft.nn.hybrid import HybridModel
from specdraft.tree import Tree
from specdraft.verify import Accepted


# ---------------------------------------------------------------------------- tree


@dataclass
class Level:
    """Candidates at one depth: parent = index in the previous level (0 = the root for the first
    level), the token (target id) and its log-probability given the parent's path."""

    parents: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)


def build_beam_tree(root: int, levels: list[Level], budget: int) -> tuple[Tree, list[tuple[int, int]], list[float]]:
    """The ``budget`` candidates with the highest cumulative log-probability, prefix-closed, plus
    the root, as a Tree (best first within the topological order), and each node's cumulative log-probability.

    Best-first search from the root: a node becomes eligible once its parent is taken, so the
    result is prefix-closed even with ties; because a child never scores above its parent
    (log-probabilities <= 0), it is exactly the global top-(budget).  Ties: shallower first,
    then candidate order.  Also returns (level, index) of every drafted node, in tree order.
    """
    children: list[dict[int, list[int]]] = []
    for lv in levels:
        ch: dict[int, list[int]] = {}
        for i, p in enumerate(lv.parents):
            ch.setdefault(p, []).append(i)
        children.append(ch)
    tokens, parents, picked, scores = [root], [-1], [], [0.0]
    heap: list[tuple[float, int, int, int]] = []  # (-cumulative, depth-1, index, tree node of the parent)

    def push(depth: int, parent_idx: int, parent_node: int, parent_cum: float) -> None:
        if depth < len(levels):
            lv = levels[depth]
            for i in children[depth].get(parent_idx, []):
                heapq.heappush(heap, (-(parent_cum + lv.logps[i]), depth, i, parent_node))

    push(0, 0, 0, 0.0)
    while heap and len(tokens) - 1 < budget:
        neg, depth, i, parent_node = heapq.heappop(heap)
        tokens.append(int(levels[depth].tokens[i]))
        parents.append(parent_node)
        picked.append((depth, i))
        scores.append(-neg)
        push(depth + 1, i, len(tokens) - 1, -neg)
    return Tree(tokens=tokens, parents=parents), picked, scores


def expand_level(parent_cums: list[float], tokens: list[list[int]], logps: list[list[float]],
                 width: int) -> tuple[Level, list[float]]:
    """Children of the expanded nodes of one depth: ``tokens[p]``/``logps[p]`` are the top-k of
    node p; keeps the ``width`` best by cumulative log-probability (ties: candidate order).
    Returns the level (parents index into ``parent_cums``) and the kept nodes' cumulative scores."""
    cands = [(c + lp, p, t, lp) for p, c in enumerate(parent_cums) for t, lp in zip(tokens[p], logps[p])]
    cands = sorted(cands, key=lambda x: -x[0])[:width]  # stable: equal scores keep candidate order
    return Level([p for _, p, _, _ in cands], [t for _, _, t, _ in cands], [lp for *_, lp in cands]), \
        [c for c, *_ in cands]


def parallel_levels(beam_cums: list[float], tokens: list[list[list[int]]], logps: list[list[list[float]]],
                    width: int) -> list[Level]:
    """Beam expansion of the parallel heads.  Beam b (a depth-S node, score ``beam_cums[b]``) has
    per head j its top-k ``tokens[b][j]`` / ``logps[b][j]``; the heads' marginals multiply along a
    path.  The first level's parents index the beams; every level keeps ``width`` nodes."""
    out: list[Level] = []
    owner = list(range(len(beam_cums)))  # the beam each frontier node descends from
    cums = list(beam_cums)
    n_heads = len(tokens[0]) if tokens else 0
    for j in range(n_heads):
        lv, new_cums = expand_level(cums, [tokens[owner[p]][j] for p in range(len(cums))],
                                    [logps[owner[p]][j] for p in range(len(cums))], width)
        owner = [owner[p] for p in lv.parents]
        cums = new_cums
        out.append(lv)
    return out


# ---------------------------------------------------------------------------- drafter


class StepMasks:
    """What a serial step most often needs, as views of templates made once (growing with the context), so a
    step slices them instead of building them (each build is a few ops, tens of us live): masks [1, 1, T, n + T]
    bool (True = may attend) and positions [1, T].  ``chain``: T new committed rows after n slots, row i sees
    slots 0 .. n+i (a commit); ``siblings``: T drafted rows that see the n committed slots and themselves only
    (the first drafted step).  Up to ``ROWS`` rows (more: built directly)."""

    ROWS = 16

    def __init__(self) -> None:
        self.k = 0  # committed slots the templates cover
        self._chain: Tensor | None = None  # [ROWS, k + ROWS]: (i, j) True iff j <= i + k
        self._sib: Tensor | None = None  # [ROWS, k + ROWS]: True for j < k and for j = k + i
        self._pos: Tensor | None = None  # [k + ROWS]: 0, 1, 2, ...

    def _fit(self, n: int, device) -> None:
        if self._chain is not None and n <= self.k and self._chain.device == device:
            return
        k, r = max(1024, 2 * n), self.ROWS
        self._chain = torch.ones(r, k + r, dtype=torch.bool, device=device).tril(k)
        self._sib = torch.cat([torch.ones(r, k, dtype=torch.bool, device=device),
                               torch.eye(r, dtype=torch.bool, device=device)], 1)
        self._pos = torch.arange(k + r, device=device)
        self.k = k

    def chain(self, n: int, t: int, device) -> Tensor:
        if t > self.ROWS:
            mask = torch.ones(1, 1, t, n + t, dtype=torch.bool, device=device)
            mask[0, 0, :, n:] = torch.tril(mask[0, 0, :, n:])
            return mask
        self._fit(n, device)
        return self._chain[:t, self.k - n : self.k + t][None, None]

    def siblings(self, n: int, t: int, device) -> Tensor:
        if t > self.ROWS:
            mask = torch.zeros(1, 1, t, n + t, dtype=torch.bool, device=device)
            mask[..., :n] = True
            mask[0, 0, :, n:] = torch.eye(t, dtype=torch.bool, device=device)
            return mask
        self._fit(n, device)
        return self._sib[:t, self.k - n : self.k + t][None, None]

    def positions(self, n: int, t: int, device) -> Tensor:
        """[1, t]: n, n+1, ..., n+t-1."""
        self._fit(n + t, device)
        return self._pos[n : n + t][None]


@dataclass
class HybridOptions(TrainedOptions):
    """``gumiho@key=value,...`` (also medusa, eagle and a hybrid checkpoint path)."""

    topk: int = 8  # children scored per expanded node and depth (capped by the budget)
    beams: int = 4  # nodes kept per depth for further expansion (capped by the budget)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.topk < 1 or self.beams < 1:
            raise SpecdraftError(f"option {'topk' if self.topk < 1 else 'beams'} must be >= 1 "
                                 f"(got {min(self.topk, self.beams)})")


class HybridDrafter(TrainedDrafter):
    """Drafter protocol around a trained ``HybridModel`` (see the module docstring); its cache holds
    the serial layers' K/V."""

    default_budget = 3  # drafted nodes per tree without a cost curve (the registry sets the machine's)

    def __init__(self, model: HybridModel, options: HybridOptions | None = None, name: str | None = None,
                 manifest: dict | None = None) -> None:
        super().__init__(model, options or HybridOptions(), name or model.cfg.kind, manifest, model.cfg.serial_layers)
        self.state: Tensor | None = None  # [W]: h^1 (S > 0) or g(f_{n-1}) (S = 0)
        self._masks = StepMasks()  # a serial step's common masks and positions as views of stored templates
        self.floor = 0.0  # set by the loop each pass (LiveCosts.floor): the probability below which a node cannot pay
        # for its row on this machine now; the serial steps stop where no path reaches it

    # ------------------------------------------------------------------ protocol
    def _features(self, out: ForwardOutput, rows) -> Tensor:
        """g(f) of the given rows of ``out``: [rows, W]."""
        m = self.model
        if not m.fast_features:
            return m.feature(self.target_features(out, rows))
        feats = [out.hidden[layer][0] for layer in self.cfg.feature_layers]  # each [T, H]
        if isinstance(rows, int):
            return m.features_fast(feats, [rows])[0]
        return m.features_fast(feats, list(range(feats[0].shape[0]))[rows] if isinstance(rows, slice) else rows)

    @torch.inference_mode()
    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        self.start(first_token)
        p = len(prompt_ids)
        if self.cfg.serial == 0:
            self.state = self._features(prefill, p - 1)
            return
        g = self._features(prefill, slice(0, p))  # f_0 .. f_{p-1}
        self._advance(g, list(prompt_ids[1:]) + [first_token])

    @torch.inference_mode()
    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        self.root = accepted.bonus
        if self.cfg.serial == 0:
            self.state = self._features(out, accepted.path[-1])
            return
        # positions n .. n+d: the accepted nodes' true features with the token each predicted
        self._advance(self._features(out, accepted.path), accepted.new_tokens)

    def _advance(self, g: Tensor, next_tokens: list[int]) -> None:
        """Run the serial layers over new committed positions (true features) and cache their K/V."""
        t, n, dev = len(next_tokens), self.n, g.device
        self.cache.reserve(n + t + self.cfg.depth + 1, n, self.model.head_w)
        mask = self._masks.chain(n, t, dev) if t > 1 else None
        pos = self._masks.positions(n, t, dev)
        toks = torch.tensor([next_tokens], device=dev)
        h = self._step(g[None], toks, pos, mask, n)
        self.n = n + t
        self.state = h[0, -1]

    def _step(self, state: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None, start: int) -> Tensor:
        """One serial step over T rows (``HybridModel.serial``) that attend to cache slots 0 .. start-1 and to
        each other as ``mask`` [1, 1, T, start+T] allows (None: all); their K/V are written at slots
        start .. start+T-1.  On the fast kernel each layer is one C++ call.  Returns out [1, T, W]."""
        m = self.model
        if getattr(m, "fast_serial", False):
            return m.serial_fast(state, tokens, positions, None if mask is None else mask[:, 0], self.cache.kv, start)
        h, new = m.serial(state, tokens, positions, mask, self.cache.past(start))
        self.cache.write(new, start)
        return h

    # ------------------------------------------------------------------ drafting
    def _topk(self, h: Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k draft tokens (target ids) and log-probabilities of the rows of ``h`` [..., W]."""
        tokens, lp = self.model.top_logp(h, k)
        return tokens.tolist(), lp.tolist()

    @torch.inference_mode()
    def levels(self, budget: int) -> list[Level]:
        """Candidate levels for a tree of ``budget`` drafted nodes (no level deeper than the budget)."""
        m, cfg = self.model, self.cfg
        max_depth = min(cfg.depth, budget)
        k, width = min(self.opts.topk, budget), min(self.opts.beams, budget)
        dev = self.state.device
        if cfg.serial == 0:  # Medusa: the heads read [g(f_{n-1}) ; e(root)]
            x = torch.cat([self.state, m.embed[self.root]])[None]
            toks, lps = self._topk(m.head_states(x, max_depth), k)  # [1][heads][k]
            return parallel_levels([0.0], toks, lps, budget)
        levels: list[Level] = []
        # depth 1 from h^1 (computed at commit time)
        toks, lps = self._topk(self.state[None], k)
        lv, cums = expand_level([0.0], toks, lps, budget)
        levels.append(lv)
        states = [[self.state] for _ in lv.tokens]  # per node: h^1 .. h^depth along its path
        rows = [[] for _ in lv.tokens]  # per node: its ancestors' rows in the step blocks 2 .. depth
        blocks: list[int] = []  # per step >= 2: its rows, whose K/V sit in the cache after the committed slots
        self.cache.reserve(self.n + width * max_depth, self.n, m.head_w)
        for s in range(2, min(cfg.serial, max_depth) + 1):
            if self._hopeless(cums):
                return levels  # no deeper node can pay for its row: stop drafting here
            beam = list(range(min(width, len(lv.tokens))))  # levels are sorted best first
            nb = len(beam)
            # mask: every committed slot, the beam's own ancestors in earlier step blocks, itself
            off = self.n + sum(blocks)
            if not blocks:  # the first step block: a view of a stored template
                mask = self._masks.siblings(self.n, nb, dev)
            else:
                mask = torch.zeros(1, 1, nb, off + nb, dtype=torch.bool, device=dev)
                mask[..., : self.n] = True
                at = self.n
                for r, size in enumerate(blocks):
                    for i, b in enumerate(beam):
                        mask[0, 0, i, at + rows[b][r]] = True
                    at += size
                mask[0, 0, :, off:] = torch.eye(nb, dtype=torch.bool, device=dev)
            st = torch.stack([states[b][-1] for b in beam])[None]  # [1, nb, W]
            tk = torch.tensor([[lv.tokens[b] for b in beam]], device=dev)
            pos = torch.full((1, nb), self.n + s - 2, device=dev)
            h = self._step(st, tk, pos, mask, off)
            blocks.append(nb)
            toks, lps = self._topk(h[0], k)
            lv, cums = expand_level([cums[b] for b in beam], toks, lps, budget)
            states = [states[beam[p]] + [h[0, p]] for p in lv.parents]
            rows = [rows[beam[p]] + [p] for p in lv.parents]
            levels.append(lv)
        if max_depth > cfg.serial and not self._hopeless(cums):  # parallel heads on the best depth-S paths
            beam = list(range(min(width, len(lv.tokens))))
            x = torch.cat([torch.stack([torch.cat(states[b]) for b in beam]), m.embed[[lv.tokens[b] for b in beam]]], -1)
            toks, lps = self._topk(m.head_states(x, max_depth - cfg.serial), k)  # [beams][heads][k]
            par = parallel_levels([cums[b] for b in beam], toks, lps, budget)
            levels += par  # the first parallel level's parents are beam rows = indices in the depth-S level
        return levels

    def _hopeless(self, cums: list[float]) -> bool:
        """Whether the best path so far (cumulative log-probabilities ``cums``) is, calibrated, below ``floor``:
        its descendants score no higher, so none would be kept."""
        if self.floor <= 0.0 or self.calibration is None or not cums:
            return False
        return self.calibration(math.exp(max(cums))) < self.floor

    def propose(self, budget: int) -> Tree:
        if budget <= 0:
            return Tree.single(self.root)
        tree, _, scores = build_beam_tree(self.root, self.levels(budget), budget)
        return with_scores(tree, scores, self.calibration, log=True)


# ---------------------------------------------------------------------------- loading


def load_hybrid(target, ckpt: DraftCheckpoint, options: HybridOptions, name: str | None) -> HybridDrafter:
    """The registry's builder: the checkpoint's network on the fast kernel or in bfloat16 (``prepare_network``)."""
    return HybridDrafter(prepare_network(ckpt.model, target, options, ckpt.manifest), options, name=name, manifest=ckpt.manifest)
