"""Where a drafter's generation time goes, per target pass: drafting, the tree pass, verification,
the target's and the drafter's commits; then plain greedy on the same prompts for comparison.

    python scripts/step_times.py DRAFTER DATASET N [BUDGET]
    python scripts/step_times.py mfd humaneval 3          # the drafter's own budget
    python scripts/step_times.py gumiho@bf16=0 gsm 3 7

Timings are wall-clock on a shared machine: compare numbers from one run.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections import defaultdict

from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.generate import GenerateConfig, generate
from specdraft.target import Target

G = importlib.import_module("specdraft.generate")  # the module (``specdraft.generate`` is the exported function)


def timed(obj, attr: str, key: str, acc: dict) -> None:
    """Wrap ``obj.attr`` so that its wall time adds up in ``acc[key]``."""
    fn = getattr(obj, attr)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(obj, attr, wrapper)


def main() -> None:
    name, dataset, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    budget = int(sys.argv[4]) if len(sys.argv) > 4 else None
    target = Target.load()
    drafter = make_drafter(name, target, budget=budget)
    acc: dict = defaultdict(float)
    timed(target, "forward_tree", "target.forward_tree", acc)
    timed(target, "commit", "target.commit", acc)
    timed(drafter, "commit", "drafter.commit", acc)
    timed(drafter, "propose", "drafter.propose", acc)
    timed(G, "verify", "verify", acc)
    prompts = [target.encode_prompt(p) for p in load_prompts(dataset, n)]
    for ids in prompts:  # warm-up
        generate(target, ids, None, GenerateConfig(max_new_tokens=8))
    acc.clear()
    passes = toks = 0
    wall = 0.0
    for ids in prompts:
        r = generate(target, ids, drafter, GenerateConfig(max_new_tokens=256))
        passes, toks, wall = passes + r.stats.passes, toks + r.stats.new_tokens, wall + r.stats.wall_s - r.stats.prefill_s
    spec = dict(acc)
    g_toks, g_wall = 0, 0.0
    for ids in prompts:
        r = generate(target, ids, None, GenerateConfig(max_new_tokens=256))
        g_toks, g_wall = g_toks + r.stats.new_tokens, g_wall + r.stats.wall_s - r.stats.prefill_s
    print(f"{name} budget {drafter.default_budget}: {passes} passes, {toks} tokens, {toks / passes:.2f} per pass; "
          f"{1000 * wall / passes:.1f} ms per pass; greedy {1000 * g_wall / g_toks:.1f} ms per token; "
          f"speed-up over greedy {(toks / wall) / (g_toks / g_wall):.2f}")
    for key, v in sorted(spec.items()):
        print(f"  {key:22s} {1000 * v / passes:6.2f} ms per pass")


if __name__ == "__main__":
    main()
