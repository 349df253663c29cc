"""Drafter registry: ``make_drafter(name, target)``."""

from __future__ import annotations

from specdraft.drafters.base import Drafter, NoDrafter
from specdraft.drafters.ngram import NgramConfig, NgramDrafter
from specdraft.errors import SpecdraftError

DRAFTERS = ("none", "ngram")


def make_drafter(name: str, target=None) -> Drafter:
    """Build the drafter ``name`` for ``target`` (its cost curve, if measured, sets the budget)."""
    if name == "none":
        return NoDrafter()
    if name == "ngram":
        cfg = NgramConfig()
        if target is not None:
            from specdraft.bench.cost import budget_from_curve, load_cost_curve

            curve = load_cost_curve(target)
            if curve is not None:
                cfg.budget = budget_from_curve(curve, default=cfg.budget)
        return NgramDrafter(cfg)
    raise SpecdraftError(f"unknown drafter {name!r} (available: {', '.join(DRAFTERS)})")
