"""Speed-ups over plain greedy with the runs interleaved prompt by prompt (plain, then each drafter spec, on
the same prompt before the next), so a machine whose pace drifts moves every method alike.

    python scripts/interleaved.py DATASET N SPEC [SPEC ...] [--max-new 192] [--static SPEC ...] [--out F.json]
                                  [--target FILE.gguf] [--temperature T [--unmapped SPEC ...]]
    python scripts/interleaved.py docs/prompts/fresh_math.jsonl 8 phrase ngram phrase@budget=6

A spec is a drafter as --drafter takes it; ``--static`` specs run with their trees as proposed (no cut).
The order of the runs turns by one each prompt (no method always runs first).  A spec with options (``eagle3@fused=0``)
keeps its own live gate and drafting averages, apart from the plain name's.
With ``--temperature`` every run samples (prompt i with seed i) and plain sampling is the base; ``--unmapped`` specs
run without their ``sampled`` calibration map (their trees cut by the greedy probabilities).
Prints tokens per pass, ms per pass, speed-up and whether every output equals plain decoding's.
"""

from __future__ import annotations

import argparse
import json

from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.generate import GenerateConfig, generate
from specdraft.model.fast import kernel_info
from specdraft.target import Target
from specdraft.verify import Sampling


def interleave(target, prompts: list[list[int]], runs: dict, max_new: int, rotate: bool = False,
               sampling: Sampling | None = None) -> dict:
    """Every run on each prompt before the next prompt.  ``runs``: key -> (drafter, dynamic), the first key plain
    decoding (the reference outputs and the base of the speed-ups); ``rotate``: the order turns by one each
    prompt (no method always runs first).  Returns per key the totals (tokens, passes, wall_s without prefill,
    draft_s, exact: outputs equal to the first run's) and tok_s, speedup, tokens_per_pass, ms_per_pass, draft_ms."""
    keys = list(runs)
    tot = {key: {"tokens": 0, "passes": 0, "wall_s": 0.0, "draft_s": 0.0, "exact": 0} for key in keys}
    for i, ids in enumerate(prompts):
        order = keys[i % len(keys):] + keys[: i % len(keys)] if rotate else keys
        cfg = {"max_new_tokens": max_new} if sampling is None else {"max_new_tokens": max_new, "sampling": sampling, "seed": i}
        outs = {key: generate(target, ids, runs[key][0], GenerateConfig(dynamic=runs[key][1], **cfg)) for key in order}
        for key, r in outs.items():
            t = tot[key]
            t["tokens"] += r.stats.new_tokens
            t["passes"] += r.stats.passes
            t["wall_s"] += r.stats.wall_s - r.stats.prefill_s
            t["draft_s"] += r.stats.draft_s
            t["exact"] += r.token_ids == outs[keys[0]].token_ids
    base = tot[keys[0]]["tokens"] / tot[keys[0]]["wall_s"]
    for t in tot.values():
        t["tok_s"] = t["tokens"] / t["wall_s"]
        t["speedup"] = t["tok_s"] / base
        t["tokens_per_pass"] = t["tokens"] / t["passes"]
        t["ms_per_pass"] = 1000 * t["wall_s"] / t["passes"]
        t["draft_ms"] = 1000 * t["draft_s"] / t["passes"]
    return tot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dataset")
    ap.add_argument("n", type=int)
    ap.add_argument("specs", nargs="*")
    ap.add_argument("--static", nargs="*", default=[])
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--target", default="default", help="'default', a .gguf file or an HF folder")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sample (prompt i with seed i)")
    ap.add_argument("--unmapped", nargs="*", default=[], help="with --temperature: specs run without their sampled map")
    a = ap.parse_args()
    target = Target.load(a.target)
    prompts = [target.encode_prompt(p) for p in load_prompts(a.dataset, a.n)]
    runs = [("none", "none", True)] + [(s, s, True) for s in a.specs] + [(s + " (static)", s, False) for s in a.static]
    runs += [(s + " (unmapped)", s, True) for s in a.unmapped]
    if a.unmapped and a.temperature <= 0:
        ap.error("--unmapped needs --temperature (greedy decoding uses no sampled map)")
    drafters = {key: make_drafter(spec, target) for key, spec, _ in runs}
    for key, spec, _ in runs:
        if "@" in spec and drafters[key].name != "none":  # its own name keeps its live gate and drafting ms apart
            drafters[key].name = spec
        if key.endswith(" (unmapped)"):  # no sampled map; likewise
            drafters[key].sampled, drafters[key].name = {}, drafters[key].name + "~unmapped"
    sampling = Sampling(temperature=a.temperature) if a.temperature > 0 else None
    warm = {} if sampling is None else {"sampling": sampling, "seed": 0}
    for key, _, dyn in runs:  # warm-up
        generate(target, prompts[0], drafters[key], GenerateConfig(max_new_tokens=16, dynamic=dyn, **warm))
    tot = interleave(target, prompts, {key: (drafters[key], dyn) for key, _, dyn in runs}, a.max_new,
                     rotate=True, sampling=sampling)
    mode = "greedy" if sampling is None else f"T={a.temperature:g}"
    print(f"{a.dataset}, {len(prompts)} prompts, {a.max_new} tokens, {mode}, kernel {kernel_info(target.model)['isa']}")
    for key, _, _ in runs:
        t = tot[key]
        t["budget"] = drafters[key].default_budget
        print(f"  {key:28s} cap {t['budget']:2d}  {t['tokens_per_pass']:.2f} tok/pass  {t['ms_per_pass']:6.2f} ms/pass "
              f"(drafting {t['draft_ms']:.2f})  {t['tok_s']:6.1f} tok/s  {t['speedup']:.2f}x  exact {t['exact']}/{len(prompts)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"dataset": a.dataset, "kernel": kernel_info(target.model), "temperature": a.temperature,
                       "runs": tot}, f, indent=1)


if __name__ == "__main__":
    main()
