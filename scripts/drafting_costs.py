"""What a drafter costs per target pass, beside what it buys: the drafter's own time (propose, and commit,
which reads the accepted features), tokens per pass and tok/s, for several drafter specs on the same
prompts in one process, plain decoding first and last (the machine is shared: compare within a run).

    python scripts/drafting_costs.py --out docs/results/drafting/costs.json mfd@fused=0 mfd gumiho@wbits=4

speed-up = tokens per pass / (pass(n) / pass(1) + drafting / pass(1)): the JSON has each term.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.generate import GenerateConfig, generate
from specdraft.model.fast import cpu_name, kernel_info
from specdraft.target import Target
from step_times import timed  # (this folder is on the path when the script runs)


def measure(target, spec: str, prompts: list[list[int]], max_new: int, budget: int | None = None,
            dynamic: bool = True) -> dict:
    d = make_drafter(spec, target, budget=budget if spec != "none" else None)
    cfg = GenerateConfig(max_new_tokens=max_new, dynamic=dynamic)
    acc: dict = defaultdict(float)
    for attr in ("propose", "commit"):
        timed(d, attr, attr, acc)
    generate(target, prompts[0], d, GenerateConfig(max_new_tokens=16))  # warm-up
    acc.clear()
    passes = toks = rows = 0
    wall = 0.0
    for ids in prompts:
        r = generate(target, ids, d, cfg)
        passes, toks = passes + r.stats.passes, toks + r.stats.new_tokens
        rows += r.stats.tree_nodes + r.stats.passes
        wall += r.stats.wall_s - r.stats.prefill_s
    return {"drafter": spec, "budget": getattr(d, "default_budget", None), "passes": passes, "new_tokens": toks,
            "tokens_per_pass": toks / passes, "rows_per_pass": rows / passes, "tok_s": toks / wall,
            "ms_per_pass": 1000 * wall / passes, "propose_ms": 1000 * acc["propose"] / passes,
            "commit_ms": 1000 * acc["commit"] / passes,
            "drafting_ms": 1000 * (acc["propose"] + acc["commit"]) / passes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", help="drafter specs (NAME@key=value)")
    ap.add_argument("--datasets", default="gsm,humaneval,mtbench")
    ap.add_argument("--n", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=None, help="drafted nodes per tree for every drafter (default: each one's own)")
    ap.add_argument("--static", action="store_true", help="every tree as proposed (no live cut or pause)")
    ap.add_argument("--out", default="", help="write the results here (JSON)")
    args = ap.parse_args()
    target = Target.load()
    prompts = [target.encode_prompt(p) for ds in args.datasets.split(",") for p in load_prompts(ds, args.n)]
    rows = []
    for spec in ["none", *args.drafters, "none"]:
        r = measure(target, spec, prompts, args.max_new_tokens, args.budget, not args.static)
        rows.append(r)
        print(f"{spec:24s} budget {r['budget']!s:>3}  drafting {r['drafting_ms']:6.3f} ms/pass (propose "
              f"{r['propose_ms']:.3f}, commit {r['commit_ms']:.3f})  {r['tokens_per_pass']:.2f} tok/pass  "
              f"{r['ms_per_pass']:6.2f} ms/pass  {r['tok_s']:6.1f} tok/s", flush=True)
    plain = sum(r["ms_per_pass"] for r in rows if r["drafter"] == "none") / 2
    for r in rows:
        r["drafting_share_of_plain_pass"] = r["drafting_ms"] / plain
        r["speedup_vs_plain"] = r["tok_s"] / (1000 / plain)
    out = {"cpu": cpu_name(), **kernel_info(target.model), "threads": torch.get_num_threads(),
           "datasets": args.datasets, "n_per_dataset": args.n, "max_new_tokens": args.max_new_tokens,
           "budget": args.budget, "dynamic": not args.static,
           "plain_ms_per_token": plain, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
