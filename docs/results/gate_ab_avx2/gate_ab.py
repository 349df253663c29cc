"""The gate A/B of docs/benchmarks.md ("A gate that probes with a burst"): the gate as now (probes of BURST
steps, the commit counted) against the gate as at ec9ed66 (one-step probes, pass + propose only), the same
weights, interleaved prompt by prompt, the order rotating.

    python docs/results/gate_ab_avx2/gate_ab.py phrase,ngram,gumiho DATASET[,DATASET...] 8 OUT.json
"""
import json, sys
sys.path.insert(0, "scripts")  # run from the repository root
from interleaved import interleave
from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.drafters import budget as B
from specdraft.generate import GenerateConfig, generate
from specdraft.model.fast import kernel_info
from specdraft.target import Target

OLD_PROBE, OLD_PROBE_MAX = 8, 64
new_observe, new_pays = B.LiveCosts.observe, B.LiveCosts.drafting_pays

def observe(self, drafter, rows, pass_ms, propose_ms, commit_ms, tokens, drafted):
    if not drafter.endswith("#old"):
        return new_observe(self, drafter, rows, pass_ms, propose_ms, commit_ms, tokens, drafted)
    pass_ms = self.observe_pass(rows, pass_ms)
    B._average(self.commit, drafter, commit_ms)
    if drafted:
        B._average(self.propose, drafter, propose_ms)
        d = self.drafted.setdefault(drafter, [float(tokens), pass_ms + propose_ms, 0])
        d[0] += B.GATE_EMA * (tokens - d[0])
        d[1] += B.GATE_EMA * (min(pass_ms + propose_ms, B.CLIP * d[1]) - d[1])
        d[2] += 1

def drafting_pays(self, drafter):
    if not drafter.endswith("#old"):
        return new_pays(self, drafter)
    skipped = self.__dict__.setdefault("skipped", {}); interval = self.__dict__.setdefault("interval", {})
    d = self.drafted.get(drafter)
    if d is None or d[2] < B.SEEN or d[0] / d[1] > 1.0 / self.pass_ms(1)[0]:
        skipped[drafter], interval[drafter] = 0, OLD_PROBE
        return True
    skipped[drafter] = skipped.get(drafter, 0) + 1
    every = interval.get(drafter, OLD_PROBE)
    if skipped[drafter] < every:
        return False
    skipped[drafter], interval[drafter] = 0, min(2 * every, OLD_PROBE_MAX)
    return True

B.LiveCosts.observe, B.LiveCosts.drafting_pays = observe, drafting_pays
names, datasets, n, out = sys.argv[1].split(","), sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
t = Target.load()
res = {"kernel": kernel_info(t.model), "datasets": {}}
for ds in datasets:
    prompts = [t.encode_prompt(p) for p in load_prompts(ds, n)]
    runs = {"plain": (None, True)}
    for name in names:
        runs[name] = (make_drafter(name, t), True)
        old = make_drafter(name, t)
        old.name = name + "#old"
        runs[name + "#old"] = (old, True)
    for d, dyn in runs.values():
        generate(t, prompts[0], d, GenerateConfig(max_new_tokens=16, dynamic=dyn))
    tot = interleave(t, prompts, runs, 192, rotate=True)
    res["datasets"][ds] = tot
    for k, v in tot.items():
        print("%s %-12s %.3fx tpp %.2f ms/pass %.2f draft %.2f exact %d" % (ds.split("/")[-1], k, v["speedup"], v["tokens_per_pass"], v["ms_per_pass"], v["draft_ms"], v["exact"]), flush=True)
json.dump(res, open(out, "w"), indent=1)
