"""The one budget policy: how many drafted nodes a drafter's tree gets when the user gives none.

On a CPU a pass over N tokens costs more than one token, so the budget must be sized to the
machine.  ``specdraft bench --cost-curve`` measures the target's pass time for N = 1..64 tokens
and stores it per target, device, dtype and thread count (``curve_path``).  A drafter then takes:

1. with a budget profile in its checkpoint (``acceptance_by_budget``: held-out tokens per pass per
   budget, from ``specdraft train profile``) and a stored cost curve: the budget maximising tokens
   per pass / (the pass over budget + 1 tokens + the measured drafting time) (``best_budget``);
2. with a cost curve but no profile, for a drafter whose registry entry scales with the curve
   (prompt lookup, the hybrid drafters): the largest tree costing at most 1.5x a one-token pass
   (``budget_from_curve``);
3. otherwise: the drafter's own fallback (its registry entry).
"""

from __future__ import annotations

import json
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
