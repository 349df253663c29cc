"""A per-step trace of the gate (each step: rows, pass, propose, commit and catch-up ms, tokens, drafted or not),
one plain run then one drafted run per prompt:

    python docs/results/gate_trial_avx2/trace.py gumiho docs/prompts/fresh4_chat.jsonl 8 OUT.json

It reads the trial's ``LiveCosts.window`` (commit 9e2396a).  The figures docs/benchmarks.md quotes from it were
taken with the trial in the gate, before the paused steps' hidden rows became views (0489cc3)."""
import json, sys, time
from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.drafters import budget as B
from specdraft.generate import GenerateConfig, generate
from specdraft.target import Target

log = []
orig = B.LiveCosts.observe
def observe(self, drafter, rows, pass_ms, propose_ms, commit_ms, tokens, drafted, catch_up_ms=0.0):
    w = self.window.get(drafter)
    log.append(dict(d=drafter, rows=rows, pass_ms=round(pass_ms, 3), prop=round(propose_ms, 3), commit=round(commit_ms, 3),
                    tok=tokens, drafted=drafted, cu=round(catch_up_ms, 3), win=None if w is None else int(w[3]),
                    avg=list(self.drafted.get(drafter, [0, 0, 0])[:2]), one=self.pass_ms(1)[0]))
    return orig(self, drafter, rows, pass_ms, propose_ms, commit_ms, tokens, drafted, catch_up_ms)
B.LiveCosts.observe = observe
name, ds, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
t = Target.load()
d = make_drafter(name, t)
prompts = [t.encode_prompt(p) for p in load_prompts(ds, n)]
generate(t, prompts[0], d, GenerateConfig(max_new_tokens=16))
res = []
for p in prompts:
    t0 = time.perf_counter(); r0 = generate(t, p, None, GenerateConfig(max_new_tokens=192)); tp = time.perf_counter() - t0
    log.clear()
    t0 = time.perf_counter(); r1 = generate(t, p, d, GenerateConfig(max_new_tokens=192)); td = time.perf_counter() - t0
    steps = list(log)
    dr = [s for s in steps if s["drafted"]]
    res.append(dict(plain_s=tp, draft_s=td, exact=r0.token_ids == r1.token_ids, steps=steps))
    print("speed %.3f steps %d drafted %d tok/drafted %.2f drafted ms %.2f paused ms %.2f catchup %.1f" % (
        tp / td, len(steps), len(dr), sum(s["tok"] for s in dr) / max(1, len(dr)),
        sum(s["pass_ms"] + s["prop"] + s["commit"] for s in dr) / max(1, len(dr)),
        sum(s["pass_ms"] for s in steps if not s["drafted"]) / max(1, len(steps) - len(dr)),
        sum(s["cu"] for s in steps)), flush=True)
json.dump(res, open(out, "w"))
