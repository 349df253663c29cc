"""Phrase-drafter vocabulary-size sweep: train one head per size (resumable, skipped when the
checkpoint exists), replay greedy output offline, and write a table + plot.

    python scripts/phrase_vocab_sweep.py --data data/smollm2 --features data/smollm2_feat \
        --sizes 2000,8000,32000,64000 --heads runs/phrase --out docs/phrase

Tokens per pass are measured with the head alone (``@ngram=0``, the vocabulary's own effect)
and with the prompt-lookup candidates merged in (the shipped configuration), at one budget.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft.bench.acceptance import acceptance_sweep  # noqa: E402
from specdraft.datasets import load_prompts  # noqa: E402
from specdraft.nn.checkpoint import load_checkpoint  # noqa: E402
from specdraft.nn.phrase import PhraseVocab  # noqa: E402
from specdraft.replay import greedy_outputs  # noqa: E402
from specdraft.target import Target  # noqa: E402
from specdraft.train.phrase import PhraseTrainConfig, longest_entry, train_phrase  # noqa: E402


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    sizes, b = table["sizes"], table["budget"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, title in zip(axes, ("head_only", "with_ngram"), ("phrase head only", "phrase + prompt lookup")):
        for ds, ys in table[key].items():
            ax.plot(sizes, ys, marker="o", label=ds)
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{v // 1000}k" for v in sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("draft vocabulary entries")
        ax.set_title(f"{title} (budget {b})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens per pass (offline replay, n=20 per dataset)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--features", required=True)
    ap.add_argument("--sizes", default="2000,8000,32000,64000")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--heads", default="runs/phrase")
    ap.add_argument("--out", default="docs/phrase")
    ap.add_argument("--budget", type=int, default=3)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--plot-only", action="store_true", help="redraw OUT/vocab_sweep.png from OUT/vocab_sweep.json")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads((Path(args.out) / "vocab_sweep.json").read_text()), Path(args.out) / "vocab_sweep.png")
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    target = Target.load()
    heads = {}
    for v in sizes:
        path = Path(args.heads) / f"phrase_{v}.safetensors"
        if not path.is_file():
            train_phrase(target, args.data, args.features, path, PhraseTrainConfig(vocab_size=v, epochs=args.epochs),
                         log=lambda m: print(m, file=sys.stderr, flush=True))
        heads[v] = path
    specs = [f"{p}@ngram=0" for p in heads.values()] + [str(p) for p in heads.values()]
    res = acceptance_sweep(target, specs, ["gsm", "mtbench", "humaneval"], args.n, args.max_new_tokens,
                           [args.budget], Path(args.heads), cache_dir=Path(args.heads) / "greedy_outputs")
    b = args.budget
    table: dict = {"budget": b, "sizes": sizes, "head_only": {}, "with_ngram": {}, "params": {}}
    outputs = {}  # the greedy outputs acceptance_sweep cached: positions with a matching entry
    for ds in ("gsm", "mtbench", "humaneval"):
        prompts = [target.encode_prompt(p) for p in load_prompts(ds, args.n)]
        outputs[ds] = greedy_outputs(target, prompts, args.max_new_tokens, cache=Path(args.heads) / "greedy_outputs" / f"{ds}.json")
    table["bench_coverage"] = {}
    for v, p in heads.items():
        _, m = load_checkpoint(p)
        trie = PhraseVocab.from_json(m["vocab"]).trie()
        table["bench_coverage"][v] = {}
        for ds, outs in outputs.items():
            hit = tot = 0
            for o in outs:
                o = [t for t in o if t not in target.eos_ids]
                for n in range(len(o) - 1):
                    tot += 1
                    hit += longest_entry(trie, o, n + 1) >= 0
            table["bench_coverage"][v][ds] = hit / max(1, tot)
        table["params"][v] = {"head": m["params"], "share_of_target": m["params"] / m["target_params"],
                              "train_wall_s": m["train_wall_s"], "coverage": m["coverage"]["share"],
                              "val_top1": m["history"][-1]["val_top1"]}
    for ds, per in res["datasets"].items():
        table["head_only"][ds] = [per[f"{heads[v]}@ngram=0"][b] for v in sizes]
        table["with_ngram"][ds] = [per[str(heads[v])][b] for v in sizes]
    largest = max(sizes)
    if 8000 in sizes:
        i8, il = sizes.index(8000), sizes.index(largest)
        table["share_8k_of_largest_gsm"] = {k: table[k]["gsm"][i8] / table[k]["gsm"][il] for k in ("head_only", "with_ngram")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab_sweep.json").write_text(json.dumps(table, indent=1))

    plot(table, out / "vocab_sweep.png")
    print("| entries | head params (% of target) | coverage | gsm | mtbench | humaneval | gsm +ngram | mtbench +ngram | humaneval +ngram |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, v in enumerate(sizes):
        pr = table["params"][v]
        print(f"| {v:,} | {pr['head']:,} ({pr['share_of_target']:.2%}) | {pr['coverage']:.1%} | "
              + " | ".join(f"{table['head_only'][ds][i]:.2f}" for ds in ("gsm", "mtbench", "humaneval")) + " | "
              + " | ".join(f"{table['with_ngram'][ds][i]:.2f}" for ds in ("gsm", "mtbench", "humaneval")) + " |")
    if "share_8k_of_largest_gsm" in table:
        print(f"8k head's share of the {largest:,}-entry head's gsm tokens per pass: {table['share_8k_of_largest_gsm']}")


if __name__ == "__main__":
    main()
