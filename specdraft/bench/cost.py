"""The target's verification cost curve: time of one pass over N tree tokens, N = 1..64.

On a CPU a pass over N tokens costs more than one token (here, 8 tokens ~1.4x with packed
weights, ~1.9x without), so a
drafter's node budget must be sized to this machine: ``budget_from_curve`` picks the largest
tree whose pass costs at most ``max_ratio`` times a single-token pass.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdraft.model.load import cache_dir
from specdraft.tree import Tree


ENGINE = 3  # bumped whenever a pass's cost changes (2: fused quantized decoder blocks; 3: their glue as plain loops): older curves are stale


def curve_path(target) -> Path:
    dtype = str(target.model.embed.weight.dtype).replace("torch.", "")
    q = target.model.quantized_rows
    name = (f"{target.weight_hash[:16]}_{target.device.type}_{dtype}{f'_q{q}' if q else ''}_t{torch.get_num_threads()}"
            f"_e{ENGINE}.json")
    return cache_dir() / "cost_curves" / name


def measure_cost_curve(target, max_n: int = 64, context: int = 256, repeats: int = 5, quiet: bool = False) -> dict:
    """Median wall time (ms) of ``target.forward_tree`` on an N-node chain after ``context`` tokens."""
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (context,), generator=g).tolist()
    target.prefill(prompt, max_slots=context + max_n + 1)
    ns = list(range(1, max_n + 1))
    ms: list[float] = []
    for n in tqdm(ns, desc="cost curve", disable=quiet):
        tree = Tree(tokens=prompt[:n], parents=[-1] + list(range(n - 1)))
        target.model.pack_for_rows(n)  # as generate() does for a budget of n - 1 nodes
        target.forward_tree(tree)  # warm-up for this shape
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            target.forward_tree(tree)
            times.append(time.perf_counter() - t)
        ms.append(1000 * statistics.median(times))
    return {"target": target.name, "target_hash": target.weight_hash, "device": target.device.type,
            "threads": torch.get_num_threads(), "context": context, "n": ns, "ms": ms,
            "ratio": [m / ms[0] for m in ms], "packed_weights": bool(target.model.lm_head.packs),
            "quantized_rows": target.model.quantized_rows}


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


def profile_budget(target, manifest: dict, default: int) -> int:
    """The budget a trained drafter loaded without one takes: ``best_budget`` over this machine's cost
    curve and the profile stored in its manifest (``acceptance_by_budget`` and, where measured,
    ``budget_profile.draft_ms``); ``default`` without a curve or a profile."""
    return best_budget(load_cost_curve(target), manifest.get("acceptance_by_budget", {}), default,
                       manifest.get("budget_profile", {}).get("draft_ms"))


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
