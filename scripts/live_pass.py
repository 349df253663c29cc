"""A live pass against the cost curve: each target pass of a real generation, timed part by part and
grouped by its row count, beside the curve's pass over as many rows measured in the same process.

    python scripts/live_pass.py DRAFTER DATASET N [--max-new 192] [--budget B] [--out FILE.json]
    python scripts/live_pass.py phrase docs/prompts/fresh_chat.jsonl 8

Parts of a step: ``propose`` (drafting), ``forward`` (Target.forward_tree: mask, embedding, blocks, head),
``verify``, ``commit`` (the target's KV compaction), ``dcommit`` (the drafter's commit), ``rest`` (the loop's
own work: emit, stats).  The plain greedy step is measured the same way on the same prompts.
Timings are wall-clock on a shared machine: compare numbers from one run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections import defaultdict

from specdraft.bench.cost import measure_cost_curve
from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.generate import GenerateConfig, generate
from specdraft.model.fast import kernel_info
from specdraft.target import Target

G = importlib.import_module("specdraft.generate")


class Probe:
    """Wraps the loop's calls; each pass's part times go to ``passes`` ({part: s, "rows": n}).  A pass starts at
    the first propose or forward after the previous pass's forward (a paused drafter does not propose)."""

    def __init__(self, target, drafter) -> None:
        self.passes: list[dict] = []
        self.cur: dict = {}
        self.t_end = None
        self._wrap(drafter, "propose", "propose")
        self._wrap(target, "forward_tree", "forward")
        self._wrap(G, "verify", "verify")
        self._wrap(target, "commit", "commit")
        self._wrap(drafter, "commit", "dcommit")

    def _wrap(self, obj, attr: str, part: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            if part in ("propose", "forward") and "forward" in self.cur:
                if self.t_end is not None:
                    self.cur["rest"] = max(0.0, t0 - self.t_end - self.cur.get("dcommit", 0.0))
                self.passes.append(self.cur)
                self.cur = {}
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter()
                self.cur[part] = self.cur.get(part, 0.0) + t1 - t0
                if part == "forward":
                    self.cur["rows"] = len(a[0])
                if part == "commit":
                    self.t_end = t1

        setattr(obj, attr, wrapper)

    def flush(self) -> None:
        if "forward" in self.cur:
            self.passes.append(self.cur)
        self.cur, self.t_end = {}, None


def summarise(passes: list[dict]) -> dict:
    by = defaultdict(list)
    for p in passes:
        by[p["rows"]].append(p)
    out = {}
    for n, ps in sorted(by.items()):
        out[n] = {"passes": len(ps), **{k: 1000 * statistics.mean([p.get(k, 0.0) for p in ps])
                                         for k in ("propose", "forward", "verify", "commit", "dcommit", "rest")}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter")
    ap.add_argument("dataset")
    ap.add_argument("n", type=int)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--static", action="store_true", help="also the drafter's trees as proposed (no cut)")
    a = ap.parse_args()
    target = Target.load()
    prompts = [target.encode_prompt(p) for p in load_prompts(a.dataset, a.n)]
    curve = measure_cost_curve(target, max_n=16, quiet=True)
    res = {"kernel": kernel_info(target.model), "curve_ms": dict(zip(curve["n"], curve["ms"]))}
    runs = [("none", "none", True), (a.drafter, a.drafter, True)] + ([(a.drafter + "/static", a.drafter, False)] if a.static else [])
    for key, name, dynamic in runs:
        drafter = make_drafter(name, target, budget=a.budget if name != "none" else None)
        generate(target, prompts[0], drafter, GenerateConfig(max_new_tokens=16))  # warm-up
        probe = Probe(target, drafter)
        toks = passes = 0
        wall = 0.0
        for ids in prompts:
            r = generate(target, ids, drafter, GenerateConfig(max_new_tokens=a.max_new, dynamic=dynamic))
            probe.flush()
            toks, passes, wall = toks + r.stats.new_tokens, passes + r.stats.passes, wall + r.stats.wall_s - r.stats.prefill_s
        res[key] = {"budget": drafter.default_budget, "tokens": toks, "passes": passes,
                     "ms_per_pass": 1000 * wall / passes, "tokens_per_pass": toks / passes,
                     "by_rows": summarise(probe.passes)}
    one = res["none"]["ms_per_pass"]
    print(f"kernel {res['kernel']}; plain step {one:.2f} ms")
    for key, _, _ in runs[1:]:
        r = res[key]
        r["speedup"] = (r["tokens_per_pass"] / r["ms_per_pass"]) / (res["none"]["tokens_per_pass"] / one)
        print(f"{key} budget {r['budget']}: {r['tokens_per_pass']:.2f} tokens/pass, {r['ms_per_pass']:.2f} ms/pass, "
              f"speed-up {r['speedup']:.2f}x")
    print(f"{'who':6s} {'rows':>4s} {'passes':>6s} {'curve':>6s} {'fwd':>6s} {'verify':>6s} {'commit':>6s} "
          f"{'propose':>7s} {'dcommit':>7s} {'rest':>6s}")
    for key, _, _ in runs:
        for n, s in res[key]["by_rows"].items():
            c = res["curve_ms"].get(n, float("nan"))
            print(f"{key[:6]:6s} {n:4d} {s['passes']:6d} {c:6.2f} {s['forward']:6.2f} {s['verify']:6.2f} "
                  f"{s['commit']:6.2f} {s['propose']:7.2f} {s['dcommit']:7.2f} {s['rest']:6.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
