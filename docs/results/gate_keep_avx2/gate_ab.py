"""The gate A/B of docs/benchmarks.md ("Pauses kept across generations"): the gate as at 0489cc3 (each generation
cuts a paused drafter's pause back to PROBE steps) against the same gate where a new generation keeps the pause
("#keep"), the same weights, interleaved prompt by prompt with the order rotating, every dataset after the one
before in one process (the gate's state carries over, as in a server).

    python docs/results/gate_keep_avx2/gate_ab.py gumiho,eagle3 DATASET[,DATASET...] 8 OUT.json
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

now_start = B.LiveCosts.start
B.LiveCosts.start = lambda self, drafter: None if drafter.endswith("#keep") else now_start(self, drafter)
names, datasets, n, out = sys.argv[1].split(","), sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
t = Target.load()
runs = {"plain": (None, True)}
for name in names:
    for tag in ("", "#keep"):
        d = make_drafter(name, t)
        d.name = name + tag
        runs[name + tag] = (d, True)
res = {"kernel": kernel_info(t.model), "datasets": {}}
for ds in datasets:
    prompts = [t.encode_prompt(p) for p in load_prompts(ds, n)]
    if not res["datasets"]:
        for d, dyn in runs.values():
            generate(t, prompts[0], d, GenerateConfig(max_new_tokens=16, dynamic=dyn))
    res["datasets"][ds] = tot = interleave(t, prompts, runs, 192, rotate=True)
    for k, v in tot.items():
        print(f"{ds.split('/')[-1]} {k:12s} {v['speedup']:.3f}x tokens/pass {v['tokens_per_pass']:.2f} "
              f"ms/pass {v['ms_per_pass']:.2f} exact {v['exact']}", flush=True)
    json.dump(res, open(out, "w"), indent=1)
