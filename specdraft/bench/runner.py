"""``specdraft bench``: our methods side by side with HF ``generate()`` on the same prompts.

For every prompt the methods run back to back (order rotated per prompt, after a warm-up), so
machine noise hits them alike.  ``exact_match`` is the share of prompts whose tokens equal
``hf_generate``'s; each divergence records the target's top-2 logit gap at that position, and
a gap under ``TIE_GAP`` is a floating-point tie, not a bug.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdraft.bench.hf import build_hf_model, hf_generate
from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig
from specdraft.model.load import load_weights
from specdraft.target import Target

HF_METHODS = ("hf_generate", "hf_prompt_lookup")
TIE_GAP = 1e-3  # top-2 logit gap (fp32) below which a divergence counts as a tie
PROMPT_LOOKUP_TOKENS = 10


def top2_gap(target: Target, prompt_ids: list[int], prefix: list[int]) -> float:
    """Target's top-1 minus top-2 logit after ``prompt_ids + prefix``."""
    out = target.prefill(prompt_ids + prefix, max_slots=len(prompt_ids) + len(prefix) + 1)
    top = torch.topk(out.logits[0, -1], 2).values
    return float(top[0] - top[1])


def divergence(target: Target, prompt_ids: list[int], ours: list[int], ref: list[int], eos: int) -> dict | None:
    if ours == ref:
        return None
    j = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    gap = top2_gap(target, prompt_ids, ref[:j])
    pick = lambda seq: seq[j] if j < len(seq) else eos  # noqa: E731 - a shorter output stopped (EOS)
    return {"position": j, "ours": pick(ours), "hf": pick(ref), "top2_gap": gap, "tie": gap < TIE_GAP}


def run_bench(
    drafters: list[str],
    datasets: list[str],
    n: int = 20,
    max_new_tokens: int = 256,
    out_dir: str = "bench_out",
    target_spec: str = "default",
    device: str = "cpu",
    budget: int | None = None,
    quiet: bool = False,
) -> dict:
    if n < 1:
        raise SpecdraftError(f"--n must be >= 1 (got {n})")
    prompts_by_ds = {ds: load_prompts(ds, n) for ds in datasets}  # fail fast on a bad dataset
    weights = load_weights(target_spec)  # loaded once: our target and the HF reference share them
    target = Target.from_weights(weights, device=device)
    hf = build_hf_model(weights, device=device)
    ours = ["greedy"] + [d for d in dict.fromkeys(drafters) if d not in ("none", "greedy")]
    # one engine per method (reset before every generation); an unknown drafter fails before any work
    engine_of = {m: Engine(target, make_drafter("none" if m == "greedy" else m, target)) for m in ours}
    methods = list(HF_METHODS) + ours
    eos = target.eos_ids
    eos0 = min(eos)

    def run(method: str, ids: list[int]) -> dict:
        if method in HF_METHODS:
            look = PROMPT_LOOKUP_TOKENS if method == "hf_prompt_lookup" else 0
            toks, wall = hf_generate(hf, ids, max_new_tokens, eos, lookup=look)
            return {"tokens": toks, "wall_s": wall, "tokens_per_pass": None}
        gcfg = GenerateConfig(max_new_tokens=max_new_tokens, budget=budget)
        r = engine_of[method].generate(ids, gcfg)
        return {"tokens": r.token_ids, "wall_s": r.stats.wall_s, "tokens_per_pass": r.stats.tokens_per_pass,
                "passes": r.stats.passes, "committed": r.stats.committed, "accept_hist": r.stats.accept_hist}

    warm = target.encode_prompt("Say hello.")
    for m in methods:  # warm-up: first-call allocations and kernel choices
        run(m, warm)

    results: dict = {"config": {"drafters": drafters, "n": n, "max_new_tokens": max_new_tokens, "target": target.name,
                                "target_hash": target.weight_hash, "device": device, "budget": budget,
                                "threads": torch.get_num_threads(), "tie_gap": TIE_GAP,
                                "budgets": {m: (budget if budget is not None else e.drafter.default_budget)
                                            for m, e in engine_of.items()},
                                "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                     "datasets": {}}
    for ds, prompts in prompts_by_ds.items():
        rows = []
        for i, prompt in enumerate(tqdm(prompts, desc=f"bench {ds}", disable=quiet)):
            ids = target.encode_prompt(prompt)
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            got = {m: run(m, ids) for m in order}
            ref = got["hf_generate"]["tokens"]
            for m in methods:
                g = got[m]
                div = divergence(target, ids, g["tokens"], ref, eos0)
                rows.append({"prompt": i, "method": m, "new_tokens": len(g["tokens"]), "wall_s": g["wall_s"],
                             "tok_s": len(g["tokens"]) / g["wall_s"], "tokens_per_pass": g["tokens_per_pass"],
                             "exact_match": div is None, "divergence": div,
                             "passes": g.get("passes"), "committed": g.get("committed"),
                             "accept_hist": g.get("accept_hist")})
        results["datasets"][ds] = {"methods": summarize(rows, methods), "rows": rows}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot_results(results, out / "speedup.png")
    return results


def row_committed(row: dict) -> int:
    """Tokens a bench row's target passes committed; rows written before ``committed`` was recorded
    rebuild it from the rounded ratio."""
    return row["committed"] if row.get("committed") is not None else round(row["tokens_per_pass"] * row["passes"])


def summarize(rows: list[dict], methods: list[str]) -> dict:
    agg = {}
    for m in methods:
        r = [x for x in rows if x["method"] == m]
        toks, wall = sum(x["new_tokens"] for x in r), sum(x["wall_s"] for x in r)
        tpp = [x["tokens_per_pass"] for x in r if x["tokens_per_pass"] is not None]
        # tokens per pass pooled over the prompts (all committed tokens / all passes, as tok/s pools
        # tokens / wall time and the offline replay pools too); the mean of the per-prompt ratios,
        # which lets a short answer weigh as much as a long one, is kept alongside
        timed = [x for x in r if x["tokens_per_pass"] is not None and x.get("passes")]
        passes = sum(x["passes"] for x in timed)
        committed = sum(row_committed(x) for x in timed)
        divs = [x["divergence"] for x in r if x["divergence"] is not None]
        agg[m] = {"tok_s": toks / wall if wall else 0.0, "new_tokens": toks, "wall_s": wall,
                  "tokens_per_pass": committed / passes if passes else (sum(tpp) / len(tpp) if tpp else None),
                  "tokens_per_pass_prompt_mean": sum(tpp) / len(tpp) if tpp else None,
                  "passes": passes or None,
                  "committed": committed if passes else None,
                  "exact_match": sum(x["exact_match"] for x in r) / len(r),
                  "divergences": len(divs), "divergences_all_ties": all(d["tie"] for d in divs)}
    for m in methods:
        agg[m]["speedup_vs_hf"] = agg[m]["tok_s"] / agg["hf_generate"]["tok_s"]
        agg[m]["speedup_vs_greedy"] = agg[m]["tok_s"] / agg["greedy"]["tok_s"]
    return agg


def pyplot():
    """matplotlib's pyplot drawing to files only (heavy: imported when a plot is drawn, not with the CLI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_results(results: dict, path: Path) -> None:
    plt = pyplot()
    datasets = list(results["datasets"])
    methods = list(next(iter(results["datasets"].values()))["methods"]) if datasets else []
    fig, ax = plt.subplots(figsize=(3.6 + max(1.6, 0.3 * len(methods)) * len(datasets), 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [results["datasets"][d]["methods"][m]["speedup_vs_hf"] for d in datasets]
        xs = [i + j * width for i in range(len(datasets))]
        bars = ax.bar(xs, vals, width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel("tok/s relative to HF generate()")
    cfg = results["config"]
    ax.set_title(f"{cfg['target']}, {cfg['device']}, n={cfg['n']}, max {cfg['max_new_tokens']} new tokens", fontsize=9)
    ax.margins(y=0.12)  # room for the value labels above the tallest bar
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cost_curve(curve: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(curve["n"], curve["ms"], marker=".")
    ax.set_xlabel("tokens in one target pass (N)")
    ax.set_ylabel("pass time (ms)")
    ax.set_title(f"{curve['target']} verification cost, {curve['device']}, {curve['threads']} threads", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
