"""Fit the drafters' node-probability calibrations (specdraft/drafters/calibration.py) and draw their
reliability diagrams.

Greedy outputs of training-source prompts that no drafter was trained on (gsm_symbolic and reasoning-gym
tasks with seeds the training never used, chat instructions the target writes itself from its chat
template's user prefix with an unused sampling seed, reasoning-gym's code problems from the end of the
shuffled list the training took its rows from the start of) are replayed (``specdraft.replay.simulate``) with a wide tree;
every drafted node is a (score, accepted) pair: accepted when the target's greedy continuation passes
through it.  Fitted: the lookup's acceptance table (``drafters.ngram.lookup_key``), then the phrase
drafter's and each model drafter's monotone map from raw score to acceptance.  With ``--check FILE.jsonl``
the fitted maps' reliability is also measured on those prompts (not used for fitting).

    python scripts/calibrate.py --prompts 48 --max-new 128 --out docs/results/calibration \
        [--drafters ngram,phrase,gumiho] [--check docs/prompts/fresh_chat.jsonl ...] [--write]

With ``--target FILE.gguf`` the maps are fitted for that target's shipped weights and written under
``NAME@MODEL`` (``calibration.entry_key``) beside the default target's.

With ``--temperature T`` the greedy maps are left as they are: the same prompts' answers are *sampled* at T
(seeded) and replayed with each drafter as shipped, and a second map from a node's calibrated probability to its
acceptance under sampling is fitted (the entry's ``sampled`` map for T, ``calibration.sampled_calibration``).
A greedy refit replaces a drafter's whole entry, its sampled maps included (they map the old greedy
probabilities): fit them again after it.

    python scripts/calibrate.py --prompts 48 --drafters ngram,phrase --temperature 0.7 \
        --out docs/results/calibration_sampled [--check ...] [--write]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from specdraft.drafters import make_drafter
from specdraft.drafters.calibration import (CALIBRATION_FILE, Calibration, entry_key, fit, fit_probabilities,
                                            load_calibrations)
from specdraft.drafters.datastore import store_for
from specdraft.drafters.ngram import NgramDrafter, lookup_key
from specdraft.replay import greedy_outputs, reference_outputs, sequence_hidden, simulate
from specdraft.datasets import load_prompts
from specdraft.model.load import cache_dir
from specdraft.target import Target
from specdraft.train.prompts import REASONING_TASKS, TRAIN_SEED_BASE, _rg_prompts, magpie_prompts
from specdraft.train.sources import codeio_rows
from specdraft.verify import Sampling

SEED = TRAIN_SEED_BASE + 5_000  # seeds the training prompts never used
PRIOR = 2.0  # pseudo-counts pulling a sparse lookup cell towards its depth's pooled rate


def calibration_prompts(n: int, target) -> list[str]:
    """n // 4 each of gsm_symbolic, reasoning-gym tasks, chat instructions the target writes itself (Magpie, an
    unused seed) and code problems."""
    third = n // 4
    out = _rg_prompts("gsm_symbolic", third, SEED)
    out += [p.text for p in magpie_prompts(target, third, seed=SEED, quiet=True)]
    rg = []
    for i, task in enumerate(REASONING_TASKS[:6]):
        try:
            rg += _rg_prompts(task, -(-third // 6), SEED + 1 + i)
        except (KeyError, ValueError):
            continue
    out += rg[:third]
    rows = codeio_rows()  # the training's order: it takes rows from the start
    out += [f"Write a Python function `main_solution` for this task.\n\n{r['task_description']}" for r in rows[-(n - 3 * third):]]
    return out


def replay(target, drafter, prompts, outputs, budget: int):
    """(tree, accepted path, extra) per pass over every prompt; ``extra``: what the drafter's recorder saw."""
    layers = tuple(sorted(drafter.hidden_layers))
    passes = []
    for ids, out in zip(prompts, outputs):
        hidden = sequence_hidden(target, list(ids) + list(out), layers) if layers else {}
        trees: list = []
        simulate(drafter, ids, out, hidden, budget, trees=trees)
        passes += trees
    return passes


class RecordingLookup(NgramDrafter):
    """Prompt lookup that keeps each proposal's scored candidates (for the table's cells)."""

    def propose(self, budget):
        self.last = self.scored()
        tree = super().propose(budget)
        self.seen.append(self.last)
        return tree


class RecordingStoreLookup(RecordingLookup):
    """The datastore's candidates alone: its cells measured as proposed, not behind the context's."""

    def context_scored(self):
        return []


def count_cells(target, drafter, prompts, outputs, budget: int) -> dict:
    """key -> [accepted, nodes] over every drafted node, in the cell of the first candidate reaching it."""
    drafter.seen = []
    passes = replay(target, drafter, prompts, outputs, budget)
    counts = defaultdict(lambda: [0, 0])
    for (tree, path), scored in zip(passes, drafter.seen):
        on = set(path)
        done = set()
        for cont, cell in scored:
            for depth, node in enumerate(tree.walk(cont), 1):
                if node not in done:
                    done.add(node)
                    c = counts[lookup_key(cell, depth)]
                    c[0] += node in on
                    c[1] += 1
    return counts


def fit_lookup(target, prompts, outputs, budget: int) -> tuple[dict, dict]:
    """The context's cells replayed with the context alone, the shipped datastore's (``d...``) with the datastore
    alone, each as the lookup proposes it; a sparse cell pulled towards its family's pooled rate at its depth."""
    counts = count_cells(target, RecordingLookup(table={}), prompts, outputs, budget)
    store = store_for(target)
    if store is not None:
        counts.update(count_cells(target, RecordingStoreLookup(table={}, store=store), prompts, outputs, budget))
    def family(key: str) -> tuple[bool, str]:  # (a datastore cell, its depth)
        return key[0] == "d", key.rsplit(",", 1)[1]

    pooled = defaultdict(lambda: [0, 0])
    for k, (a, m) in counts.items():
        pooled[family(k)][0] += a
        pooled[family(k)][1] += m
    table = {}
    for k, (a, m) in counts.items():
        a0, m0 = pooled[family(k)]
        table[k] = round((a + PRIOR * a0 / m0) / (m + PRIOR), 4)
    return table, {k: v for k, v in counts.items()}


def pairs_of(passes) -> tuple[list[float], list[bool]]:
    scores, acc = [], []
    for tree, path in passes:
        if not tree.probs:
            continue
        on = set(path)
        for i in range(1, len(tree)):
            scores.append(tree.probs[i])
            acc.append(i in on)
    return scores, acc


def reliability(scores, acc, cal: Calibration, bins: int = 10) -> list[dict]:
    """Per bin of calibrated probability: mean predicted, observed acceptance, nodes."""
    b = defaultdict(lambda: [0.0, 0, 0])
    for s, a in zip(scores, acc):
        p = cal(s)
        k = min(int(p * bins), bins - 1)
        b[k][0] += p
        b[k][1] += a
        b[k][2] += 1
    return [{"bin": k / bins, "predicted": v[0] / v[2], "observed": v[1] / v[2], "nodes": v[2]} for k, v in sorted(b.items())]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--drafters", default="ngram,phrase")
    ap.add_argument("--check", nargs="*", default=[])
    ap.add_argument("--out", default="docs/results/calibration")
    ap.add_argument("--target", default="default", help="the target whose drafters are fitted (default: the default target)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: fit the drafters' maps to acceptance under sampling at this temperature (seeded)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed with --temperature")
    ap.add_argument("--write", action="store_true", help=f"write the fitted maps into {CALIBRATION_FILE}")
    a = ap.parse_args()
    torch.manual_seed(0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target = Target.load(a.target)
    cal_texts = calibration_prompts(a.prompts, target)
    cal_ids = [target.encode_prompt(t) for t in cal_texts]
    cache = cache_dir() / "calibration"  # the greedy outputs (regenerated when the prompts or target change)
    if a.temperature > 0:
        fit_sampled(a, target, cal_ids, cache, out)
        return
    cal_out = greedy_outputs(target, cal_ids, a.max_new, cache=cache / "greedy_calibration.json", quiet=False)
    checks = check_sets(a.check, target, lambda ids, stem: greedy_outputs(target, ids, a.max_new,
                                                                          cache=cache / f"greedy_{stem}.json"))
    fitted = load_calibrations()
    report = {"target": target.weight_hash, "prompts": len(cal_texts), "max_new": a.max_new, "budget": a.budget,
              "drafters": {}}
    names = a.drafters.split(",")
    if "ngram" in names:
        table, counts = fit_lookup(target, cal_ids, cal_out, a.budget)
        default = a.target == "default"  # the default target's table also serves targets without their own
        fitted[entry_key("ngram", target, default)] = {"table": table} if default else \
            {"target": target.weight_hash, "model": target.model_hash, "table": table}
        report["drafters"]["ngram"] = {"table": table, "counts": counts}
    for name in names:
        d = make_drafter(name, target, budget=a.budget)
        inner = getattr(d, "inner", d)
        if name == "ngram":
            d.table = table
            cal = Calibration()
        else:
            inner.calibration = Calibration()  # raw scores out
            if getattr(inner, "ngram", None) is not None and "ngram" in names:
                inner.ngram.table = table
        scores, acc = pairs_of(replay(target, d, cal_ids, cal_out, a.budget))
        if name != "ngram":
            cal = fit(scores, acc)
            fitted[entry_key(name, target, a.target == "default")] = {"target": target.weight_hash, "model": target.model_hash, "map": cal.to_json()}
        rep = report["drafters"].setdefault(name, {})
        rep["calibration_set"] = reliability(scores, acc, cal)
        if name != "ngram":
            rep["raw"] = reliability(scores, acc, Calibration())
        for cname, (ids, outs) in checks.items():
            s2, a2 = pairs_of(replay(target, d, ids, outs, a.budget))
            rep[cname] = reliability(s2, a2, cal)
        print(name, json.dumps(rep["calibration_set"]))
    save(report, fitted, out, a.write)


def fit_sampled(a, target, cal_ids, cache: Path, out: Path) -> None:
    """Each drafter's map from its calibrated node probability (as shipped) to acceptance under sampling at
    ``a.temperature``, fitted on the calibration prompts' sampled answers; the ``--check`` sets' sampled answers
    (another seed) measure it."""
    s, tag = Sampling(temperature=a.temperature), f"{a.temperature:g}"

    def sampled(ids, name: str, seed: int):
        return reference_outputs(target, ids, a.max_new, sampling=s, seed=seed, quiet=False,
                                 cache=cache / f"sampled_{tag}_{name}.json")

    cal_out = sampled(cal_ids, "calibration", a.seed)
    checks = check_sets(a.check, target, lambda ids, stem: sampled(ids, stem, a.seed + 1))
    fitted = load_calibrations()
    report = {"target": target.weight_hash, "prompts": len(cal_ids), "max_new": a.max_new, "budget": a.budget,
              "temperature": a.temperature, "drafters": {}}
    for name in a.drafters.split(","):
        d = make_drafter(name, target, budget=a.budget)
        scores, acc = pairs_of(replay(target, d, cal_ids, cal_out, a.budget))
        if not scores:
            raise SystemExit(f"{name}: its trees carry no probabilities (no fitted calibration to start from)")
        cal = fit_probabilities(scores, acc)
        key = entry_key(name, target, a.target == "default")
        if key not in fitted:  # a sampled map refines a greedy one: an entry without it would fit any target
            raise SystemExit(f"{name}: no greedy calibration {key!r} for this target to refine; fit that first")
        fitted[key].setdefault("sampled", {})[tag] = cal.to_json()
        rep = report["drafters"][name] = {"greedy-calibrated": reliability(scores, acc, Calibration()),
                                          "calibration_set": reliability(scores, acc, cal)}
        for cname, (ids, outs) in checks.items():
            s2, a2 = pairs_of(replay(target, d, ids, outs, a.budget))
            rep[f"{cname} greedy-calibrated"] = reliability(s2, a2, Calibration())
            rep[cname] = reliability(s2, a2, cal)
        print(name, json.dumps(rep["calibration_set"]))
    save(report, fitted, out, a.write)


def check_sets(files: list[str], target, outputs) -> dict:
    """{stem: (prompt ids, ``outputs(ids, stem)``)} of each ``--check`` prompt file."""
    checks = {}
    for f in files:
        ids = [target.encode_prompt(t) for t in load_prompts(f)]
        checks[Path(f).stem] = (ids, outputs(ids, Path(f).stem))
    return checks


def save(report: dict, fitted: dict, out: Path, write: bool) -> None:
    """The reliability report (JSON and diagrams) into ``out``; with ``write`` the fitted maps into the shipped file."""
    (out / "reliability.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "reliability.png")
    if write:
        CALIBRATION_FILE.write_text(json.dumps(fitted, indent=1) + "\n")
        print(f"wrote {CALIBRATION_FILE}")


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    names = list(report["drafters"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        for key, rows in report["drafters"][name].items():
            if not isinstance(rows, list) or not rows:
                continue
            ax.plot([r["predicted"] for r in rows], [r["observed"] for r in rows], "o-", label=key)
        ax.plot([0, 1], [0, 1], "k:", lw=1)
        ax.set_title(f"{name}: node acceptance")
        ax.set_xlabel("predicted (calibrated)")
        ax.set_ylabel("observed")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
