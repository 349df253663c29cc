"""The gate A/B of docs/benchmarks.md ("A trial after each probe", not kept); it runs at commit 9e2396a, where the trial
was in the gate: the gate as then (a probe that pays puts the
drafter on a TRIAL-step trial, judged on its own) against the gate without the trial (a probe that pays resumes
drafting at once, as at cadfbe6), the same weights, interleaved prompt by prompt, the order rotating, every
dataset after the one before in one process (the gate's state carries over, as in a server).

    python docs/results/gate_trial_avx2/gate_ab.py gumiho,phrase DATASET[,DATASET...] 8 OUT.json [#old,#start]

"#start" (a variant not taken): each generation also puts a drafting drafter on trial for its first steps;
"#keep" (a variant not taken): a new generation does not cut a paused drafter's pause back to PROBE.
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

new_close = B.LiveCosts._close

def close(self, drafter, tokens, ms, probe):  # "#old": a probe that pays resumes at once, no trial
    new_close(self, drafter, tokens, ms, probe)
    if drafter.endswith("#old") and self.window.get(drafter, (0, 0, 0, 0))[3] == B.TRIAL:
        del self.window[drafter]
        self.pause[drafter] = B.PROBE

new_start = B.LiveCosts.start

def start(self, drafter):  # "#start": also each generation's first TRIAL drafted steps are a trial
    if drafter.endswith("#keep"):  # "#keep": a new generation keeps the pause as it is
        return
    new_start(self, drafter)
    if drafter.endswith("#start") and drafter not in self.window and self._pays(drafter) \
            and self.drafted.get(drafter, (0, 0, 0))[2] >= B.SEEN:
        self.pause[drafter] = B.PROBE // 2  # a trial that fails: a pause of PROBE
        self.window[drafter] = [0.0, 0.0, 0, B.TRIAL]

B.LiveCosts._close, B.LiveCosts.start = close, start
names, datasets, n, out = sys.argv[1].split(","), sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
VARIANTS = sys.argv[5].split(",") if len(sys.argv) > 5 else ["#old"]
t = Target.load()
res = {"kernel": kernel_info(t.model), "datasets": {}}
runs = {"plain": (None, True)}
for name in names:
    runs[name] = (make_drafter(name, t), True)
    for tag in VARIANTS:
        d = make_drafter(name, t)
        d.name = name + tag
        runs[name + tag] = (d, True)
for ds in datasets:
    prompts = [t.encode_prompt(p) for p in load_prompts(ds, n)]
    if not res["datasets"]:
        for d, dyn in runs.values():
            generate(t, prompts[0], d, GenerateConfig(max_new_tokens=16, dynamic=dyn))
    tot = interleave(t, prompts, runs, 192, rotate=True)
    res["datasets"][ds] = tot
    for k, v in tot.items():
        print("%s %-14s %.3fx tpp %.2f ms/pass %.2f draft %.2f exact %d" % (ds.split("/")[-1], k, v["speedup"], v["tokens_per_pass"], v["ms_per_pass"], v["draft_ms"], v["exact"]), flush=True)
    json.dump(res, open(out, "w"), indent=1)
