"""The gate A/B of docs/benchmarks.md ("Rarer probes where they lose much"): the gate with EXPLORE (a failed probe
pauses the drafter at least loss / (EXPLORE x pass(1)) steps) against the same gate with the pause only doubling
("#old", as before), the same weights, interleaved prompt by prompt with the order rotating, every dataset after the
one before in one process (the gate's state carries over, as in a server).

    python docs/results/gate_explore_avx2/gate_ab.py gumiho,eagle3,phrase,ngram DATASET[,DATASET...] 8 OUT.json
"""
import json
import sys

sys.path.insert(0, "scripts")  # run from the repository root
from interleaved import interleave  # noqa: E402
from specdraft.datasets import load_prompts  # noqa: E402
from specdraft.drafters import budget as B, make_drafter  # noqa: E402
from specdraft.generate import GenerateConfig, generate  # noqa: E402
from specdraft.model.fast import kernel_info  # noqa: E402
from specdraft.target import Target  # noqa: E402

explore = B.LiveCosts._next_pause


def doubling_only(self, drafter, burst):
    """The pause before EXPLORE for the "#old" runs: twice the last, up to PROBE_MAX."""
    if drafter.endswith("#old"):
        return min(2 * self.pause[drafter], B.PROBE_MAX)
    return explore(self, drafter, burst)


def main(names: list[str], datasets: list[str], n: int, out: str) -> None:
    B.LiveCosts._next_pause = doubling_only
    t = Target.load()
    runs = {"plain": (None, True)}
    for spec in [name + tag for name in names for tag in ("", "#old")]:
        runs[spec] = (make_drafter(spec.split("#")[0], t), True)
        runs[spec][0].name = spec
    res = {"kernel": kernel_info(t.model), "datasets": {}}
    for i, ds in enumerate(datasets):
        prompts = [t.encode_prompt(p) for p in load_prompts(ds, n)]
        for d, dyn in runs.values() if i == 0 else ():  # warm every drafter's shapes once
            generate(t, prompts[0], d, GenerateConfig(max_new_tokens=16, dynamic=dyn))
        res["datasets"][ds] = interleave(t, prompts, runs, 192, rotate=True)
        for k, v in res["datasets"][ds].items():
            print(f"{ds.split('/')[-1]} {k:12s} {v['speedup']:.3f}x tokens/pass {v['tokens_per_pass']:.2f} "
                  f"ms/pass {v['ms_per_pass']:.2f} exact {v['exact']}", flush=True)
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4])
