"""Paired comparison of two drafters' tokens per pass over the same prompts.

Tokens per pass is pooled (all committed tokens / all passes), and on 20 prompts two drafters a
hundredth apart can swap places with the prompt sample.  ``paired_bootstrap`` resamples the
prompts with replacement (the same resample for both drafters, since they ran on the same prompts)
and reports the pooled difference with a percentile confidence interval and the share of
resamples in which the first drafter is ahead.  Pure Python and seeded: the same inputs give the
same numbers.
"""

from __future__ import annotations

import random
from itertools import combinations

from specdraft.errors import SpecdraftError


def _pooled(pairs: list[tuple[int, int]], idx: list[int]) -> float:
    passes = sum(pairs[i][1] for i in idx)
    return sum(pairs[i][0] for i in idx) / passes if passes else 0.0


def paired_bootstrap(a: list[tuple[int, int]], b: list[tuple[int, int]], reps: int = 2000, level: float = 0.95,
                     seed: int = 0) -> dict:
    """``a``, ``b``: per-prompt (committed tokens, passes) of two drafters on the same prompts, in
    the same order.  Returns the pooled tokens-per-pass difference a - b, its percentile bootstrap
    interval at ``level``, the share of resamples with a ahead (``p_ahead``), and how many prompts
    each side needed fewer passes on."""
    if len(a) != len(b):
        raise SpecdraftError(f"paired comparison needs the same prompts for both ({len(a)} against {len(b)})")
    if not a:
        raise SpecdraftError("paired comparison needs at least one prompt")
    if reps < 1 or not 0.0 < level < 1.0:
        raise SpecdraftError("reps must be >= 1 and level in (0, 1)")
    n = len(a)
    every = list(range(n))
    rng = random.Random(seed)
    diffs = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in every]
        diffs.append(_pooled(a, idx) - _pooled(b, idx))
    diffs.sort()
    lo = diffs[int((1 - level) / 2 * reps)]
    hi = diffs[min(reps - 1, int((1 + level) / 2 * reps))]
    return {"diff": _pooled(a, every) - _pooled(b, every), "ci": [lo, hi], "level": level, "reps": reps,
            "p_ahead": sum(d > 0 for d in diffs) / reps, "prompts": n,
            "fewer_passes": sum(x[1] < y[1] for x, y in zip(a, b)),
            "more_passes": sum(x[1] > y[1] for x, y in zip(a, b))}


def paired_comparisons(per_method: dict[str, list[tuple[int, int]]], **kw) -> list[dict]:
    """Every pair of methods (in the given order) compared with ``paired_bootstrap``."""
    return [{"a": m, "b": o, **paired_bootstrap(per_method[m], per_method[o], **kw)}
            for m, o in combinations(per_method, 2)]


def verdict(c: dict) -> str:
    """'a ahead', 'b ahead' or 'tie within noise', from whether the interval excludes 0."""
    lo, hi = c["ci"]
    if lo > 0:
        return f"{c['a']} ahead"
    if hi < 0:
        return f"{c['b']} ahead"
    return "tie within noise"


def format_comparison(c: dict) -> str:
    lo, hi = c["ci"]
    return (f"{c['a']} - {c['b']}: {c['diff']:+.3f} tokens/pass, {100 * c['level']:.0f}% interval "
            f"[{lo:+.3f}, {hi:+.3f}] over {c['prompts']} prompts, {c['a']} ahead in {100 * c['p_ahead']:.0f}% of "
            f"resamples, fewer passes on {c['fewer_passes']} prompts and more on {c['more_passes']}: {verdict(c)}")
