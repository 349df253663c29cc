"""Batched decoding per drafter, offline (no server): the same requests one at a time (``Engine.generate``)
and through a ``Batcher`` kept full (a new request joins whenever one leaves), side by side in one run.

    .venv/bin/python scripts/batch_drafters.py --drafters none,ngram,phrase,gumiho --requests 24 --max-batch 8 \\
        --max-tokens 128 --json-out docs/results/batching/drafters.json --plot docs/results/batching/drafters.png
    .venv/bin/python scripts/batch_drafters.py --from docs/results/batching/drafters.json --plot drafters.png

Per drafter: total tok/s of both, the ratio, answers equal to the one-at-a-time run (greedy: they must
all be), passes, tokens per pass, and the drafting time per sequence and pass in the batch (what one
batched drafter pass could save at most).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_check import prompts  # noqa: E402


def plot(out: dict, path: str) -> None:
    """Grouped bars: tok/s one at a time and in the batch, per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar([i - 0.2 for i in x], [r["sequential_tok_s"] for r in rows], 0.4, label="one at a time")
    ax.bar([i + 0.2 for i in x], [r["batched_tok_s"] for r in rows], 0.4, label=f"batch of {out['max_batch']}")
    for i, r in zip(x, rows):
        ax.text(i + 0.2, r["batched_tok_s"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["drafter"] for r in rows])
    ax.set_ylabel("tok/s, all requests")
    ax.set_ylim(0, 1.3 * max(r["batched_tok_s"] for r in rows))
    ax.set_title(f"{out['target']}: {out['requests']} requests x {out['max_tokens']} tokens, greedy (answers equal)",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafters", default="none,ngram,phrase")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--static", action="store_true", help="also batch with the trees as proposed (no live cut)")
    ap.add_argument("--plot", default=None, help="draw the tok/s bars to this PNG")
    ap.add_argument("--from", dest="source", default=None, help="redraw the plot of an earlier --json-out; measure nothing")
    args = ap.parse_args(argv)
    if args.source:
        if not args.plot:
            sys.exit("error: --from needs --plot")
        plot(json.loads(Path(args.source).read_text()), args.plot)
        return 0

    from specdraft.batch import Batcher
    from specdraft.drafters import make_drafter
    from specdraft.engine import Engine
    from specdraft.generate import GenerateConfig
    from specdraft.target import Target

    target = Target.load(args.target)
    ids = [target.encode_messages([{"role": "user", "content": p}]) for p in prompts(args.requests)]
    cfg = GenerateConfig(max_new_tokens=args.max_tokens)
    rows = []
    for name in args.drafters.split(","):
        engine = Engine(target, make_drafter(name, target))
        engine.generate(ids[0], cfg)  # warm-up
        t0 = time.perf_counter()
        alone = [engine.generate(p, cfg) for p in ids]
        seq_s = time.perf_counter() - t0
        def batched(dynamic: bool):
            b = Batcher(engine, max_batch=args.max_batch, dynamic=dynamic)
            pending, done, passes = list(ids), [], 0
            while pending and len(b.live) < b.max_batch:
                b.add(pending.pop(0), cfg)
            t0 = time.perf_counter()
            while b.live:
                for s in b.step():
                    done.append(s)
                    if pending:
                        b.add(pending.pop(0), cfg)
                passes += 1
            return b, done, passes, time.perf_counter() - t0

        static_s = None
        if args.static:  # the trees as proposed, for comparison (same requests, same order)
            _, done_static, _, static_s = batched(False)
            assert all(s.result is not None for s in done_static)
        b, done, passes, bat_s = batched(True)
        by_prompt = {tuple(s.prompt_ids): s.result for s in done}
        tokens = sum(len(r.token_ids) for r in alone)
        draft_s = sum(r.stats.draft_s for r in by_prompt.values())
        row = {"drafter": name, "budget": engine.drafter.default_budget, "budget_at_max_batch": b.budget(args.max_batch),
               "sequential_tok_s": tokens / seq_s, "batched_tok_s": tokens / bat_s, "ratio": seq_s / bat_s,
               "equal": sum(by_prompt[tuple(p)].token_ids == r.token_ids for p, r in zip(ids, alone)),
               "requests": len(ids), "sequential_tokens_per_pass": sum(r.stats.committed for r in alone)
               / max(1, sum(r.stats.passes for r in alone)), "batched_passes": passes,
               "batched_tokens_per_pass": sum(r.stats.committed for r in by_prompt.values())
               / max(1, sum(r.stats.passes for r in by_prompt.values())),
               "draft_ms_per_sequence_pass": 1000 * draft_s / max(1, sum(r.stats.passes for r in by_prompt.values())),
               "batched_ms_per_pass": 1000 * bat_s / passes,
               "batched_static_tok_s": tokens / static_s if static_s else None}
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), file=sys.stderr)
    out = {"target": target.name, "requests": args.requests, "max_batch": args.max_batch, "max_tokens": args.max_tokens,
           "rows": rows}
    print(json.dumps(out, indent=1))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(out, args.plot)
    return 0 if all(r["equal"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
