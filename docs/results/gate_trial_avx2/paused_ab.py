"""What a paused drafter costs: plain decoding against DRAFTER with the gate forced to pause always (it never
drafts: its reset, the deferred rows and the gate's bookkeeping only), interleaved prompt by prompt:

    python docs/results/gate_trial_avx2/paused_ab.py gumiho docs/prompts/fresh4_chat.jsonl

Prints each generation's stats; docs/benchmarks.md sums wall_s per side (4.9% over plain before 0489cc3, 1.0%
after)."""
import sys, time, statistics
from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.drafters import budget as B
from specdraft.generate import GenerateConfig, generate
from specdraft.target import Target
B.LiveCosts.drafting_pays = lambda self, name: False   # never draft: a paused drafter's overhead alone
t = Target.load()
d = make_drafter(sys.argv[1], t)
prompts = [t.encode_prompt(p) for p in load_prompts(sys.argv[2], 8)]
generate(t, prompts[0], d, GenerateConfig(max_new_tokens=16)); generate(t, prompts[0], None, GenerateConfig(max_new_tokens=16))
tot = {"plain": 0.0, "paused": 0.0}
for i, p in enumerate(prompts):
    for k in (("plain", "paused") if i % 2 else ("paused", "plain")):
        r = generate(t, p, None if k == "plain" else d, GenerateConfig(max_new_tokens=192))
        tot[k] += r.stats.wall_s
        st = r.stats
        print(k, {kk: round(v, 4) if isinstance(v, float) else v for kk, v in vars(st).items() if kk in ("wall_s", "prefill_s", "draft_s", "verify_s", "passes")}, flush=True)
print("wall_s summed: plain %.3f, paused %.3f (paused / plain %.3f)" % (tot["plain"], tot["paused"], tot["paused"] / tot["plain"]))
