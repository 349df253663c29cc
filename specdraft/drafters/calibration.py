"""Calibrated node probabilities: what a drafter's scores say about acceptance, as measured.

A scored tree (``Tree.probs``) lets the budget policy cut each pass to the nodes that pay
(``drafters.budget.LiveCosts.cut``), so a node's probability must mean what it says: of the nodes
given p, a share p is accepted.  A drafter's raw score (a phrase's probability mass, a path's product
of draft probabilities, a lookup's match length and depth) is mapped to that share by a monotone
piecewise-linear ``Calibration`` fitted on replayed greedy outputs of training-source prompts
(``scripts/calibrate.py``: pool-adjacent-violators over binned scores; its reliability diagrams are in
docs/results/calibration/).  The fitted maps ship in ``specdraft/weights/calibration.json``.

Sampling accepts less than greedy decoding: a node is kept when the target's draw equals it, not when it is
the target's most likely token.  Each drafter's entry may hold ``sampled``: per temperature, a second monotone
map from the greedy-calibrated probability to the acceptance measured on replayed *sampled* outputs
(``calibrate.py --temperature T``); a sampling generation applies the one for its temperature
(``sampled_calibration``, ``rescored``).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

CALIBRATION_FILE = Path(__file__).resolve().parents[1] / "weights" / "calibration.json"


@dataclass
class Calibration:
    """raw score -> probability of acceptance: linear between knots (xs ascending, ys non-decreasing),
    flat past the ends.  No knots: the identity (the raw score taken at its word)."""

    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys):
            raise ValueError("a calibration needs as many ys as xs")
        if any(b < a for a, b in zip(self.xs, self.xs[1:])) or any(b < a for a, b in zip(self.ys, self.ys[1:])):
            raise ValueError("a calibration's knots must be non-decreasing in x and y")

    def __call__(self, raw: float) -> float:
        xs, ys = self.xs, self.ys
        if not xs:
            return min(max(raw, 0.0), 1.0)
        if raw <= xs[0]:
            return ys[0]
        if raw >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, raw)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (raw - x0) / (x1 - x0)

    def below(self, y: float) -> float:
        """The score under which this map gives less than ``y``: every raw < ``below(y)`` maps below y, none at or
        above it does (0 where every score reaches y, inf where none does; the identity: y itself)."""
        xs, ys = self.xs, self.ys
        if not xs:
            return max(y, 0.0)
        if y <= ys[0]:
            return 0.0
        if y > ys[-1]:
            return math.inf
        i = bisect.bisect_left(ys, y)  # ys[i - 1] < y <= ys[i]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return x0 + (x1 - x0) * (y - y0) / (y1 - y0)

    def to_json(self) -> dict:
        return {"xs": self.xs, "ys": self.ys}


def fit(scores: list[float], accepted: list[bool], bins: int = 20) -> Calibration:
    """A monotone map from ``scores`` to the observed acceptance: the scores in ``bins`` equal-count
    bins, each bin's acceptance rate made non-decreasing by pool-adjacent-violators, one knot per
    pooled bin at its mean score."""
    pairs = sorted(zip(scores, accepted))
    if not pairs:
        return Calibration()
    size = max(1, len(pairs) // bins)
    blocks = []  # [sum score, sum accepted, count]
    for i in range(0, len(pairs), size):
        chunk = pairs[i:i + size]
        blocks.append([sum(s for s, _ in chunk), float(sum(a for _, a in chunk)), len(chunk)])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] >= blocks[-1][1] / blocks[-1][2]:
            s, a, n = blocks.pop()
            blocks[-1] = [blocks[-1][0] + s, blocks[-1][1] + a, blocks[-1][2] + n]
    return Calibration([b[0] / b[2] for b in blocks], [b[1] / b[2] for b in blocks])


def fit_probabilities(probs: list[float], accepted: list[bool], width: float = 0.05, least: int = 100) -> Calibration:
    """A monotone map from probabilities already calibrated one way (greedy) to the acceptance observed another
    (sampling): ``probs`` in bins ``width`` wide, a bin with fewer than ``least`` nodes merged into the next one up
    (the last into the one below), then pool-adjacent-violators; one knot per pooled bin at its mean.  Equal-width
    bins resolve the few confident nodes that decide a cut, where ``fit``'s equal-count bins spend their knots on
    the many unlikely ones."""
    bins: dict[int, list[float]] = {}
    for p, a in zip(probs, accepted):
        b = bins.setdefault(min(int(p / width), int(1 / width) - 1), [0.0, 0.0, 0])
        b[0], b[1], b[2] = b[0] + p, b[1] + a, b[2] + 1
    chunks: list[list[float]] = []
    for k in sorted(bins):
        if chunks and chunks[-1][2] < least:
            chunks[-1] = [x + y for x, y in zip(chunks[-1], bins[k])]
        else:
            chunks.append(list(bins[k]))
    if len(chunks) > 1 and chunks[-1][2] < least:
        last = chunks.pop()
        chunks[-1] = [x + y for x, y in zip(chunks[-1], last)]
    blocks: list[list[float]] = []
    for c in chunks:
        blocks.append(c)
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] >= blocks[-1][1] / blocks[-1][2]:
            top = blocks.pop()
            blocks[-1] = [x + y for x, y in zip(blocks[-1], top)]
    return Calibration([b[0] / b[2] for b in blocks], [b[1] / b[2] for b in blocks])


def load_calibrations(path: Path = CALIBRATION_FILE) -> dict:
    """A calibration file read now: {drafter name: {"target": weight hash, "model": fingerprint, ...maps}}; {} when absent or torn."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@functools.cache
def shipped_calibrations() -> dict:
    """The shipped file (``load_calibrations``), read once per process: every drafter built reads it (the lookup
    table of each ``NgramDrafter``, a phrase's or model drafter's map).  Read-only."""
    return load_calibrations()


def entry_key(name: str, target, default: bool) -> str:
    """The calibration file's key of drafter ``name``'s maps for ``target``: ``NAME`` for the default target,
    ``NAME@<first 16 hex of its model fingerprint (else of its weight hash)>`` for another (one entry per target)."""
    return name if default else f"{name}@{(target.model_hash or target.weight_hash)[:16]}"


def _fits(entry: dict, target) -> bool:
    """Whether ``entry`` was fitted on ``target``'s weights or another quantization of its model (an entry that
    names no target, the lookup's table, fits any)."""
    want, model = entry.get("target"), entry.get("model")
    return not want or target is None or want == getattr(target, "weight_hash", None) or \
        (model is not None and model == getattr(target, "model_hash", None))


def entry_for(name: str, target=None) -> dict:
    """Drafter ``name``'s calibration entry for ``target``: the one (``NAME`` or ``NAME@MODEL``) fitted on these
    weights or another quantization of that model, before one that names no target; {} when none fits."""
    cals = shipped_calibrations()
    entries = [cals[name]] if name in cals else []
    entries += [e for k, e in sorted(cals.items()) if k.partition("@")[0] == name and k != name]
    if target is not None:
        entries.sort(key=lambda e: not e.get("target"))  # stable: this target's own entry first
    return next((e for e in entries if _fits(e, target)), {})  # no target: the default target's entry


def calibration_for(name: str, target=None, key: str = "map") -> Calibration:
    """Drafter ``name``'s fitted map ``key`` for ``target`` (``entry_for``); the identity when none was fitted
    for this model."""
    m = entry_for(name, target).get(key)
    return Calibration(m["xs"], m["ys"]) if m else Calibration()


def with_scores(tree, raw: list[float], calibration: Calibration | None, log: bool = False):
    """``tree`` carrying each node's calibrated probability ``calibration(raw[i])`` (``log``: raw holds log
    scores, exponentiated first; raw[0], the root's, is ignored); as proposed without a calibration."""
    if calibration is None or len(tree) == 1:
        return tree
    return tree.with_probs([1.0] + [calibration(math.exp(r) if log else r) for r in raw[1:]])


def sampled_maps(name: str, target) -> dict[float, Calibration]:
    """Drafter ``name``'s fitted sampled maps for ``target`` by temperature ({} where none was fitted); the registry
    gives them to the shipped drafters it builds (``drafter.sampled``), not to a checkpoint loaded by path."""
    maps = entry_for(name, target).get("sampled") or {}
    return {float(t): Calibration(m["xs"], m["ys"]) for t, m in maps.items()}


def sampled_calibration(maps: dict[float, Calibration] | None, sampling) -> Calibration | None:
    """The map from a node's greedy-calibrated probability to its acceptance under ``sampling`` (a
    ``verify.Sampling``): None for greedy decoding or a one-hot draw (top-k 1) or without maps; below the lowest
    fitted temperature T0, the map blended with the identity (greedy) in proportion T / T0; else the one fitted at
    the nearest temperature.  Top-p and top-k, which raise acceptance, are not modelled: the map errs low there."""
    if not maps or sampling.greedy or sampling.top_k == 1:
        return None
    lo, t = min(maps), sampling.temperature
    if t >= lo:
        return maps[min(maps, key=lambda k: abs(k - t))]
    m, w = maps[lo], t / lo  # between knots (and past the map's ends, up to 0 and 1) both are linear: so is the blend
    xs = sorted(set(m.xs) | {0.0, 1.0})
    return Calibration(xs, [(1 - w) * x + w * m(x) for x in xs])


def rescored(tree, calibration: Calibration | None):
    """``tree`` with each node's probability passed through ``calibration`` (a monotone map keeps a child no likelier
    than its parent); as it is without probabilities or a map."""
    if calibration is None or not tree.probs or len(tree) == 1:
        return tree
    return tree.with_probs([1.0] + [calibration(p) for p in tree.probs[1:]])
