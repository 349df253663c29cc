"""What a pass over n rows costs after 256 and after 512 tokens of context (the stored cost curve is measured
after 256), the two contexts alternated round by round in one process so the machine's pace moves both alike:

    python docs/results/attention_avx2/context_ab.py OUT.json
"""
import json, statistics, sys, time
import torch
from specdraft.target import Target
from specdraft.tree import Tree

t = Target.load()
g = torch.Generator().manual_seed(0)
prompt = torch.randint(100, t.config.vocab_size, (512,), generator=g).tolist()
contexts, rows, rounds, per = (256, 512), (1, 2, 3, 4), 12, 5
times = {(c, n): [] for c in contexts for n in rows}
for r in range(rounds):
    for c in (contexts if r % 2 else contexts[::-1]):
        t.prefill(prompt[:c], max_slots=c + 8)
        for n in rows:
            tree = Tree(tokens=prompt[:n], parents=[-1] + list(range(n - 1)))
            t.forward_tree(tree)  # warm
            for _ in range(per):
                t0 = time.perf_counter()
                t.forward_tree(tree)
                times[c, n].append(1000 * (time.perf_counter() - t0))
out = {f"{c}_{n}": statistics.median(v) for (c, n), v in times.items()}
for c in contexts:
    one = out[f"{c}_1"]
    print(c, " ".join(f"pass({n}) {out[f'{c}_{n}']:.2f} ms ({out[f'{c}_{n}'] / one:.2f}x)" for n in rows))
json.dump({"median_ms": out, "rounds": rounds, "passes_per_round": per}, open(sys.argv[1], "w"), indent=1)
