"""Chimera analysis: how much of a product-ranked draft tree is stitched from different futures.

Multi-Future Drafting (MFD, arXiv 2611.13017) observes that ranking prefixes by the product of
a block drafter's per-position marginals (DDTree) splices the continuations the target may take
into *chimeras*, "prefixes stitched together from different futures that the target never
produces", and reports them as 27-33% of a 64-node tree.  This module measures that share for a
drafter here; the definitions (docs/chimeras.md):

* **Contexts.**  Per prompt, ``contexts_per_prompt`` root slots n spread evenly along the
  target's greedy output.  The drafter is driven along that output with
  ``specdraft.replay`` (reset on the prompt, committed with the target's features of
  every committed token, as greedy decoding commits them), jumping from one analysed slot to the
  next; there its ``marginals(top_k)`` are recorded.  A block drafter's state depends only on the
  committed tokens and their features, so it is the state a real run has at slot n.
* **Futures.**  The target's own continuations of the context, each D tokens long (D = the
  drafter's draft positions, cut after an end-of-sequence token): ``samples`` continuations
  sampled at temperature 1 plus the greedy one (the rest of the greedy output).
* **Trees.**  ``ddtree`` over the marginals (for K > 1 modes: the modes' average,
  ``mixture_marginals``) with ``budget`` nodes; for K > 1 also the MFD ``mixture_tree``.
* **Classes.**  A node's prefix p = (p_1 .. p_d) is *coherent* if it is a prefix of some future,
  a *chimera* if it is not yet every p_i is the i-th token of at least one future (so it takes
  tokens from at least two different futures), and *off-future* otherwise.  Each class's share
  of the nodes and of the tree's product mass (sum over nodes of exp(score)) is pooled over all
  contexts of a dataset.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from tqdm import tqdm

from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.errors import SpecdraftError
from specdraft.model.llama import causal_mask
from specdraft.replay import greedy_outputs, simulate
from specdraft.search import Ranked, ddtree, mixture_marginals, mixture_tree
from specdraft.tree import Tree
from specdraft.verify import Sampling, target_probs

CLASSES = ("coherent", "chimera", "off_future")


@dataclass
class ChimeraConfig:
    budget: int = 64  # drafted nodes per tree (the paper's figure is for 64)
    contexts_per_prompt: int = 8  # drafting steps analysed per prompt, evenly spread along the output
    samples: int = 16  # futures sampled from the target at temperature 1 per context (plus the greedy one)
    top_k: int = 16  # candidates per draft position handed to the tree searches
    seed: int = 0  # sampling seed

    def __post_init__(self) -> None:
        if self.budget < 1 or self.contexts_per_prompt < 1 or self.samples < 0 or self.top_k < 1:
            raise SpecdraftError("--budget, --contexts-per-prompt and --top-k must be >= 1, --samples >= 0")


@dataclass
class Tally:
    """Nodes and product mass per class, pooled over trees."""

    trees: int = 0
    nodes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    mass: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))
    by_depth: dict[int, dict[str, int]] = field(default_factory=dict)  # depth -> class -> nodes

    def add(self, ranked: Ranked, futures: list[list[int]]) -> None:
        self.trees += 1
        for i, c in enumerate(classify(ranked.tree, futures)):
            if c is None:
                continue
            self.nodes[c] += 1
            self.mass[c] += math.exp(ranked.scores[i])
            row = self.by_depth.setdefault(ranked.tree.depths[i], dict.fromkeys(CLASSES, 0))
            row[c] += 1

    def summary(self) -> dict:
        n, m = sum(self.nodes.values()), sum(self.mass.values())
        return {
            "trees": self.trees,
            "nodes_per_tree": n / self.trees if self.trees else 0.0,
            "mass_per_tree": m / self.trees if self.trees else 0.0,  # expected drafted tokens under the product
            "node_share": {c: (v / n if n else 0.0) for c, v in self.nodes.items()},
            "mass_share": {c: (v / m if m else 0.0) for c, v in self.mass.items()},
            "by_depth": {d: dict(v) for d, v in sorted(self.by_depth.items())},
        }


def classify(tree: Tree, futures: list[list[int]]) -> list[str | None]:
    """Class of every node's prefix against ``futures`` (None for the root); see the module docstring."""
    prefixes = {tuple(f[:d]) for f in futures for d in range(1, len(f) + 1)}
    at_depth: dict[int, set[int]] = {}  # depth (1-based) -> tokens some future has there
    for f in futures:
        for i, t in enumerate(f):
            at_depth.setdefault(i + 1, set()).add(t)
    paths: list[tuple[int, ...]] = [()]
    covered = [True]  # every token so far appears at its depth in some future
    out: list[str | None] = [None]
    for i in range(1, len(tree)):
        p, d, t = tree.parents[i], tree.depths[i], tree.tokens[i]
        paths.append(paths[p] + (t,))
        covered.append(covered[p] and t in at_depth.get(d, ()))
        if paths[i] in prefixes:
            out.append("coherent")
        elif covered[i]:
            out.append("chimera")
        else:
            out.append("off_future")
    return out


@dataclass
class Context:
    n: int  # slot (= position) of the root, the last committed token
    root: int
    tokens: Tensor  # [K, D, k] the drafter's candidates for the next block
    logp: Tensor  # [K, D, k]
    prior: Tensor | None = None  # [K] log pi_k of a gated MFD drafter (None = the modes weigh equally)


class _Recorder:
    """Drives a drafter along a known sequence: its trees are replaced by the true next tokens up
    to the next wanted root slot (so the replay lands on every wanted slot), where its marginals
    are recorded.  Commits are the replay's, i.e. exactly greedy decoding's."""

    def __init__(self, drafter, full: list[int], wanted: list[int], top_k: int) -> None:
        self.inner, self.full, self.wanted, self.top_k = drafter, full, sorted(wanted), top_k
        self.name, self.hidden_layers = drafter.name, drafter.hidden_layers
        self.default_budget = drafter.default_budget
        self.records: list[Context] = []
        self.n, self.root, self.next = 0, 0, 0

    def reset(self, prompt_ids, first_token, prefill) -> None:
        self.n, self.root, self.next = len(prompt_ids), first_token, 0
        self.inner.reset(prompt_ids, first_token, prefill)

    def propose(self, budget: int) -> Tree:
        while self.next < len(self.wanted) and self.wanted[self.next] < self.n:
            self.next += 1  # unreachable (not expected: every jump lands on the next wanted slot)
        if self.next < len(self.wanted) and self.wanted[self.next] == self.n:
            tokens, logp = self.inner.marginals(self.top_k)
            gated = getattr(getattr(self.inner, "cfg", None), "gate", False)
            prior = self.inner.mode_prior().detach().float().cpu() if gated else None
            self.records.append(Context(self.n, self.root, tokens.detach().cpu(), logp.detach().float().cpu(), prior))
            self.next += 1
        stop = self.wanted[self.next] if self.next < len(self.wanted) else len(self.full)
        return Tree.from_paths(self.root, [self.full[self.n + 1 : stop]])  # accepted whole: next root = slot stop

    def commit(self, accepted, out) -> None:
        self.n += len(accepted.tokens) + 1
        self.root = accepted.bonus
        self.inner.commit(accepted, out)


@torch.inference_mode()
def continuations(target, cache, logits: Tensor, n: int, length: int, rows: int, eos_ids: set[int],
                  temperature: float = 1.0, generator: torch.Generator | None = None) -> list[list[int]]:
    """``rows`` continuations of ``length`` tokens after slot n, decoded in one batch.

    ``cache`` (batch 1) holds the K/V of slots 0..n of the sequence, ``logits`` [V] the target's
    prediction at slot n.  Each continuation is cut after its first end-of-sequence token.
    """
    model, s = target.model, Sampling(temperature=temperature)
    kv = model.new_cache(rows, n + 1 + length)
    kv.kv[:, :, :, :, : n + 1] = cache.kv[:, :, :, :, : n + 1]  # [L, 2, 1 -> rows, Hkv, n+1, D]

    def pick(lg: Tensor) -> Tensor:  # [rows, V] -> [rows]
        probs = target_probs(lg.float(), s).cpu()
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(lg.device)

    nxt = pick(logits[None].expand(rows, -1))
    out = [nxt]
    for j in range(1, length):
        pos = torch.full((rows, 1), n + j, device=nxt.device)
        res = model(nxt[:, None], pos, None, kv, n + j, logits="all")  # slot n+j holds token j
        nxt = pick(res.logits[:, -1])
        out.append(nxt)
    seqs = torch.stack(out, 1).tolist() if length > 0 else [[] for _ in range(rows)]  # [rows, length]
    cut = []
    for seq in seqs:
        end = next((i for i, t in enumerate(seq) if t in eos_ids), None)
        cut.append(seq if end is None else seq[: end + 1])
    return cut


def context_steps(prompt_len: int, output_len: int, count: int) -> list[int]:
    """Up to ``count`` root slots spread evenly over the output (a root needs a token after it)."""
    span = output_len - 1  # roots at slots prompt_len .. prompt_len + output_len - 2
    if span < 1:
        return []
    return sorted({prompt_len + (j * span) // count for j in range(count)})


@torch.inference_mode()
def analyze_prompt(target, drafter, prompt: list[int], output: list[int], cfg: ChimeraConfig,
                   generator: torch.Generator) -> list[dict]:
    """Contexts of one prompt: per context the futures and the trees' per-class tallies."""
    full = list(prompt) + list(output)
    steps = context_steps(len(prompt), len(output), cfg.contexts_per_prompt)
    if not steps:
        return []
    cache = target.model.new_cache(1, len(full))
    ids = torch.tensor([full], device=target.device)
    pos = torch.arange(len(full), device=target.device)[None]
    res = target.model(ids, pos, causal_mask(len(full), 0, target.device), cache, 0,
                       hidden_layers=tuple(drafter.hidden_layers), logits="all")
    rec = _Recorder(drafter, full, steps, cfg.top_k)
    simulate(rec, prompt, output, res.hidden, budget=len(full))
    out = []
    for ctx in rec.records:
        n_modes, depth, _ = ctx.tokens.shape
        greedy = full[ctx.n + 1 : ctx.n + 1 + depth]
        end = next((i for i, t in enumerate(greedy) if t in target.eos_ids), None)
        greedy = greedy if end is None else greedy[: end + 1]
        sampled = continuations(target, cache, res.logits[0, ctx.n], ctx.n, depth, cfg.samples, target.eos_ids,
                                generator=generator) if cfg.samples else []
        futures = [greedy] + sampled
        if n_modes == 1:
            pt, pl = ctx.tokens[0], ctx.logp[0]
        else:
            pt, pl = mixture_marginals(ctx.tokens, ctx.logp, cfg.top_k, prior=ctx.prior)
        trees = {"product": ddtree(ctx.root, pt, pl, cfg.budget)}
        if n_modes > 1:
            trees["mixture"] = mixture_tree(ctx.root, ctx.tokens, ctx.logp, cfg.budget, prior=ctx.prior)
        out.append({"n": ctx.n, "modes": n_modes, "depth": depth, "futures": futures,
                    "distinct_futures": len({tuple(f) for f in futures}), "trees": trees})
    return out


def require_marginals(drafter, spec: str) -> None:
    if not callable(getattr(drafter, "marginals", None)):
        raise SpecdraftError(f"--drafter {spec} has no per-position distributions; use block or mfd")


def chimera_stats(target, drafter, prompts: list[list[int]], outputs: list[list[int]], cfg: ChimeraConfig,
                  quiet: bool = True, desc: str = "chimeras") -> dict:
    """Pooled chimera statistics of ``drafter`` (any object with ``marginals(k)`` and the drafter
    interface) over the greedy ``outputs`` of ``prompts``."""
    require_marginals(drafter, getattr(drafter, "name", "?"))
    gen = torch.Generator().manual_seed(cfg.seed)
    tallies: dict[str, Tally] = {}
    contexts, distinct, modes, depth = 0, 0, 0, 0
    for prompt, output in tqdm(list(zip(prompts, outputs)), desc=desc, disable=quiet):
        for c in analyze_prompt(target, drafter, prompt, output, cfg, gen):
            contexts += 1
            distinct += c["distinct_futures"]
            modes, depth = c["modes"], c["depth"]
            for kind, ranked in c["trees"].items():
                tallies.setdefault(kind, Tally()).add(ranked, c["futures"])
    return {"contexts": contexts, "modes": modes, "draft_positions": depth,
            "futures_per_context": cfg.samples + 1,
            "mean_distinct_futures": distinct / contexts if contexts else 0.0,
            **{kind: t.summary() for kind, t in tallies.items()}}


def chimera_report(target, drafter_spec: str, datasets: list[str], n: int, max_new_tokens: int, cfg: ChimeraConfig,
                   out_dir: str | Path, quiet: bool = False, cache_dir: str | Path | None = None) -> dict:
    """``specdraft analyze chimeras``: per dataset statistics, written to DIR/chimeras.json."""
    if not datasets:
        raise SpecdraftError("give at least one --dataset")
    if n < 1 or max_new_tokens < 1:
        raise SpecdraftError("--n and --max-new-tokens must be >= 1")
    drafter = make_drafter(drafter_spec, target)
    require_marginals(drafter, drafter_spec)
    out = Path(out_dir)
    res: dict = {"config": {"drafter": drafter_spec, "n": n, "max_new_tokens": max_new_tokens, **asdict(cfg),
                            "target": target.name, "target_hash": target.weight_hash,
                            "method": "greedy-output replay; futures = target continuations (greedy + sampled at T=1)"},
                 "datasets": {}}
    for ds in datasets:
        prompts = [target.encode_prompt(p) for p in load_prompts(ds, n)]
        outs = greedy_outputs(target, prompts, max_new_tokens, quiet=quiet,
                              cache=Path(cache_dir or out / "greedy_outputs") / f"{Path(ds).stem}.json")
        res["datasets"][ds] = chimera_stats(target, drafter, prompts, outs, cfg, quiet=quiet, desc=f"chimeras {ds}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "chimeras.json").write_text(json.dumps(res, indent=1))
    return res


def format_summary(res: dict) -> str:
    """Markdown table: per dataset and tree, the class shares of nodes and of product mass."""
    lines = ["| dataset | tree | contexts | nodes/tree | coherent | chimera | off-future | chimera mass | distinct futures |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ds, r in res["datasets"].items():
        for kind in ("product", "mixture"):
            if kind not in r:
                continue
            t = r[kind]
            ns, ms = t["node_share"], t["mass_share"]
            lines.append(f"| {ds} | {kind} | {r['contexts']} | {t['nodes_per_tree']:.1f} | {ns['coherent']:.1%} | "
                         f"{ns['chimera']:.1%} | {ns['off_future']:.1%} | {ms['chimera']:.1%} | "
                         f"{r['mean_distinct_futures']:.1f} / {r['futures_per_context']} |")
    return "\n".join(lines)
