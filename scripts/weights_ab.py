"""Shipped weights against the ones they replaced, live: a registered drafter (its weights and fitted
calibration as installed) beside the same drafter loaded from the earlier checkpoint with the calibration
that shipped with it, and plain greedy, interleaved prompt by prompt (the order rotating), on the same
node cap, under the live policy.  Speed-up over plain greedy per dataset, tokens per pass, drafting ms,
and whether every output equals plain greedy's.

    git show HEAD~1:specdraft/weights/calibration.json > before.json
    python scripts/weights_ab.py phrase BEFORE.safetensors before.json --out ab.json \\
        --datasets docs/prompts/fresh2_chat.jsonl,docs/prompts/fresh2_math.jsonl [--target FILE.gguf]
"""

from __future__ import annotations

import argparse
import json

from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.drafters.calibration import Calibration, entry_key
from specdraft.model.fast import kernel_info
from specdraft.target import Target
from interleaved import interleave  # (this folder is on the path when the script runs)

FRESH = ",".join(f"docs/prompts/{s}_{c}.jsonl" for s in ("fresh2", "fresh") for c in ("chat", "math", "code"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="a registered drafter (phrase, gumiho, ...)")
    ap.add_argument("before", help="the checkpoint its shipped weights replaced")
    ap.add_argument("calibration", help="the calibration file that shipped with it (its entry NAME is used)")
    ap.add_argument("--datasets", default=FRESH)
    ap.add_argument("--n", type=int, default=8, help="prompts per dataset")
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--target", default="default", help="'default' or a .gguf file (its entry NAME@MODEL is used)")
    a = ap.parse_args()
    t = Target.load(a.target)
    old = make_drafter(a.before, t)
    fitted = json.load(open(a.calibration)).get(entry_key(a.name, t, a.target == "default"), {}).get("map")
    old.calibration = Calibration(fitted["xs"], fitted["ys"]) if fitted else Calibration()
    old.name = f"{a.name}_before"  # the live policy keeps its costs per name
    new = make_drafter(a.name, t)
    old.default_budget = new.default_budget = max(old.default_budget, new.default_budget)
    runs = {"none": (make_drafter("none", t), True), old.name: (old, True), a.name: (new, True)}
    res = {}
    for ds in a.datasets.split(","):
        prompts = [t.encode_prompt(p) for p in load_prompts(ds, a.n)]
        res[ds] = interleave(t, prompts, runs, a.max_new, rotate=True)
        for k, x in res[ds].items():
            print(f"{ds:36s} {k:16s} {x['tokens_per_pass']:.2f} tok/pass  {x['tok_s']:6.1f} tok/s  {x['speedup']:.2f}x  "
                  f"drafting {x['draft_ms']:.2f} ms  exact {x['exact']}/{len(prompts)}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"kernel": kernel_info(t.model), "budget_cap": new.default_budget, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
