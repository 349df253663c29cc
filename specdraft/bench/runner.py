"""``specdraft bench``: our methods side by side on the same prompts, with our own plain decoding as
the baseline, llama.cpp as the peer (``--llama-cpp BIN_DIR``) and HF ``generate()`` as a reference.

For every prompt the methods run back to back (order rotated per prompt, after a warm-up), so
machine noise hits them alike.  Each row records:

- ``exact_match`` (our methods): the tokens equal our own plain decoding in the same precision mode
  and, when sampling, with the same seed.  This is the lossless promise and must be 1.0 for every
  drafter.  (Sampling: speculative decoding draws other random numbers than plain sampling, so its
  tokens are a different sample of the same distribution; ``exact_match`` is then None and the
  chi-square tests carry the promise.)
- ``hf_agreement`` (greedy runs): the tokens equal HF fp32 greedy; at the first divergence, HF's own
  top-2 logit gap there (``divergence.top2_gap``): a gap under ``TIE_GAP`` is a floating-point tie.
  The exact mode agrees up to ties; the fast mode rounds activations to 8 bits (as llama.cpp does),
  so it diverges where two tokens are close.
- llama.cpp rows (``llamacpp``, ``llamacpp_ngram``): their arithmetic differs from ours, so instead of
  ``exact_match`` they record ``agrees_with_greedy`` (equal to our plain greedy).  Their tok/s is from
  llama.cpp's own timings, prefill included, as ours.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdraft.bench.hf import build_hf_model, hf_generate
from specdraft.bench.llamacpp import LlamaServer, find_binaries, ngram_args, target_gguf, with_working_repack
from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.drafters.budget import live_costs, load_cost_curve
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig
from specdraft.model.fast import DEFAULT_PRECISION, cpu_name, kernel_info
from specdraft.model.load import load_weights
from specdraft.target import Target
from specdraft.verify import Sampling

HF_METHODS = ("hf_generate", "hf_prompt_lookup")
LLAMACPP_METHODS = ("llamacpp", "llamacpp_ngram")
TIE_GAP = 1e-3  # top-2 logit gap (fp32) below which a divergence counts as a tie
PROMPT_LOOKUP_TOKENS = 10


@torch.inference_mode()
def hf_top2_gap(hf, ids: list[int]) -> float:
    """HF's top-1 minus top-2 logit after ``ids`` (fp32)."""
    logits = hf(torch.tensor([ids], device=hf.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def first_divergence(ours: list[int], ref: list[int], eos: int) -> dict | None:
    """Where ``ours`` first differs from ``ref`` (None if equal); a shorter output stopped at EOS."""
    if ours == ref:
        return None
    j = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    pick = lambda seq: seq[j] if j < len(seq) else eos  # noqa: E731
    return {"position": j, "ours": pick(ours), "ref": pick(ref)}


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
    precision: str = DEFAULT_PRECISION,
    sampling: Sampling | None = None,
    seed: int = 0,
    llama_cpp: str | None = None,
    llama_cpp_ngram: bool = True,
    hf: bool = True,
    hf_lookup: bool = False,
) -> dict:
    """``drafters`` and our plain decoding (``greedy``, or ``sample`` and ``greedy`` with ``sampling``) on ``n`` prompts
    of each dataset; HF ``generate()`` (greedy runs, ``hf``) and llama.cpp (``llama_cpp``: the folder of
    its binaries; greedy runs) beside them.  Writes OUT/results.json and OUT/speedup.png."""
    if n < 1:
        raise SpecdraftError(f"--n must be >= 1 (got {n})")
    sampling = sampling or Sampling()
    greedy = sampling.greedy
    if llama_cpp and not greedy:
        raise SpecdraftError("--llama-cpp rows are greedy: run them without --temperature")
    prompts_by_ds = {ds: load_prompts(ds, n) for ds in datasets}  # fail fast on a bad dataset
    binaries = find_binaries(llama_cpp) if llama_cpp else None  # a missing / broken binary: one error line
    gguf = target_gguf(target_spec) if binaries is not None else None
    weights = load_weights(target_spec)  # loaded once: our target and the HF reference share them
    target = Target.from_weights(weights, device=device, precision=precision)
    hf_model = build_hf_model(weights, device=device) if hf and greedy else None
    base = "greedy" if greedy else "sample"
    ours = [base] + [d for d in dict.fromkeys(drafters) if d not in ("none", "greedy", "sample")]
    if not greedy:
        ours.append("greedy")  # plain greedy beside plain sampling: what sampling costs, in the same run
    # one engine per method (reset before every generation); an unknown drafter fails before any work
    engine_of = {m: Engine(target, make_drafter("none" if m in (base, "greedy") else m, target)) for m in ours}
    peers = list(LLAMACPP_METHODS if llama_cpp_ngram else LLAMACPP_METHODS[:1]) if binaries else []
    methods = ours + peers + ([] if hf_model is None else list(HF_METHODS if hf_lookup else HF_METHODS[:1]))
    eos = target.eos_ids
    eos0 = min(eos)
    threads = torch.get_num_threads()
    if binaries is not None:
        binaries = with_working_repack(binaries, gguf, threads)
    servers = {}
    try:
        if "llamacpp" in peers:  # started once; each request runs alone (no prompt cache), interleaved with ours
            servers["llamacpp"] = LlamaServer(binaries, gguf, threads).__enter__()

        def run(method: str, ids: list[int]) -> dict:
            if method in HF_METHODS:
                look = PROMPT_LOOKUP_TOKENS if method == "hf_prompt_lookup" else 0
                toks, wall = hf_generate(hf_model, ids, max_new_tokens, eos, lookup=look)
                return {"tokens": toks, "wall_s": wall, "tokens_per_pass": None}
            if method in LLAMACPP_METHODS:
                if method == "llamacpp":
                    r = servers[method].complete(ids, max_new_tokens)
                else:  # its n-gram pool outlives requests: a fresh server per prompt, as ours starts empty
                    with LlamaServer(binaries, gguf, threads, spec=ngram_args()) as srv:
                        r = srv.complete(ids, max_new_tokens)
                return {"tokens": r["tokens"], "wall_s": r["wall_s"], "tokens_per_pass": None,
                        "draft_n": r.get("draft_n"), "draft_n_accepted": r.get("draft_n_accepted")}
            gcfg = GenerateConfig(max_new_tokens=max_new_tokens, budget=budget, seed=seed,
                                  sampling=Sampling() if method == "greedy" else sampling)
            r = engine_of[method].generate(ids, gcfg)
            return {"tokens": r.token_ids, "wall_s": r.stats.wall_s, "tokens_per_pass": r.stats.tokens_per_pass,
                    "passes": r.stats.passes, "committed": r.stats.committed, "accept_hist": r.stats.accept_hist,
                    "draft_s": r.stats.draft_s, "prefill_s": r.stats.prefill_s, "pass_rows": r.stats.pass_rows}

        warm = target.encode_prompt("Say hello.")
        for m in methods:  # warm-up: first-call allocations and kernel choices
            run(m, warm)

        results: dict = {"config": {"drafters": drafters, "n": n, "max_new_tokens": max_new_tokens,
                                    "target": target.name, "target_hash": target.weight_hash, "device": device,
                                    "precision": target.precision, "budget": budget, "threads": threads,
                                    "kernel": kernel_info(target.model), "cpu": cpu_name(),
                                    "tie_gap": TIE_GAP, "baseline": base,
                                    "target_spec": "default" if target_spec in (None, "default") else
                                    _home_relative(Path(target_spec)),
                                    "hf": hf_model is not None, "hf_lookup": hf_lookup,
                                    "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                                 "top_k": sampling.top_k, "seed": seed},
                                    "llama_cpp": _home_relative(binaries.server) if binaries else None,
                                    "llama_cpp_repack": binaries.repack if binaries else None,
                                    "llama_cpp_ngram": ngram_args() if "llamacpp_ngram" in peers else None,
                                    "budgets": {m: (budget if budget is not None else e.drafter.default_budget)
                                                for m, e in engine_of.items()},
                                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                         "cost_curve": _curve_of(target), "datasets": {}}
        for ds, prompts in prompts_by_ds.items():
            rows = []
            for i, prompt in enumerate(tqdm(prompts, desc=f"bench {ds}", disable=quiet)):
                ids = target.encode_prompt(prompt)
                order = methods[i % len(methods):] + methods[: i % len(methods)]
                got = {m: run(m, ids) for m in order}
                rows.extend(_rows(i, got, methods, base, greedy, ids, hf_model, eos0))
            results["datasets"][ds] = {"methods": summarize(rows, methods, base), "rows": rows}
        results["live_costs"] = _live_of(target)
    finally:
        for srv in servers.values():
            srv.__exit__(None, None, None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot_results(results, out / "speedup.png")
    return results


def _curve_of(target) -> dict | None:
    """The stored cost curve the budget policy starts from ({"n", "ms"}), None without one."""
    curve = load_cost_curve(target)
    return None if curve is None else {"n": curve["n"], "ms": curve["ms"]}


def _live_of(target) -> dict | None:
    """What the live policy measured over the run (``drafters.budget.LiveCosts``): per row count the passes seen,
    their mean and moving-average ms beside the stored curve's, and each drafter's drafting ms."""
    costs = live_costs(target)
    if costs is None or not costs.live:
        return None
    rows = sorted(costs.live)
    return {"rows": rows, "passes": [costs.totals[n][1] for n in rows], "live_ms": [costs.live[n][0] for n in rows],
            "mean_ms": [costs.totals[n][0] / costs.totals[n][1] for n in rows],
            "curve_ms": [costs.curve_ms(n) for n in rows], "draft_ms": {d: costs.draft_ms(d) for d in costs.propose}}


def _home_relative(path: Path) -> str:
    """``path`` with the user's home folder written as ``~`` (results files name no personal folder)."""
    try:
        return "~/" + str(Path(path).relative_to(Path.home()))
    except ValueError:
        return str(path)


def _rows(i: int, got: dict, methods: list[str], base: str, greedy: bool, ids: list[int], hf_model, eos0: int) -> list[dict]:
    """One prompt's rows: every method's tokens against our baseline and against HF greedy."""
    ref = got[base]["tokens"]
    hf_ref = got["hf_generate"]["tokens"] if "hf_generate" in got else None
    rows = []
    for m in methods:
        g = got[m]
        peer = m in LLAMACPP_METHODS or m in HF_METHODS
        hf_div = None
        if hf_ref is not None:
            hf_div = first_divergence(g["tokens"], hf_ref, eos0)
            if hf_div is not None:
                hf_div["top2_gap"] = hf_top2_gap(hf_model, ids + hf_ref[: hf_div["position"]])
                hf_div["tie"] = hf_div["top2_gap"] < TIE_GAP
        rows.append({"prompt": i, "method": m, "new_tokens": len(g["tokens"]), "wall_s": g["wall_s"],
                     "tok_s": len(g["tokens"]) / g["wall_s"], "tokens_per_pass": g["tokens_per_pass"],
                     # the lossless promise: equal to our own plain decoding (same mode; same seed)
                     "exact_match": None if peer or not greedy and m != base else g["tokens"] == ref,
                     "agrees_with_greedy": g["tokens"] == ref if greedy else None,
                     "hf_agreement": None if hf_ref is None else hf_div is None, "hf_divergence": hf_div,
                     "passes": g.get("passes"), "committed": g.get("committed"), "accept_hist": g.get("accept_hist"),
                     "draft_s": g.get("draft_s"), "prefill_s": g.get("prefill_s"), "pass_rows": g.get("pass_rows"),
                     "draft_n": g.get("draft_n"),
                     "draft_n_accepted": g.get("draft_n_accepted")})
    return rows


def row_committed(row: dict) -> int:
    """Tokens a bench row's target passes committed; rows written before ``committed`` was recorded
    rebuild it from the rounded ratio."""
    return row["committed"] if row.get("committed") is not None else round(row["tokens_per_pass"] * row["passes"])


def _share(rows: list[dict], key: str) -> float | None:
    vals = [x[key] for x in rows if x.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(rows: list[dict], methods: list[str], base: str = "greedy") -> dict:
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
        divs = [x["hf_divergence"] for x in r if x.get("hf_divergence") is not None]
        draft_s = [x["draft_s"] for x in r if x.get("draft_s") is not None]
        drafted = [x for x in r if x.get("draft_n")]
        pass_rows: dict[int, int] = {}
        for x in r:
            for rows_, c in (x.get("pass_rows") or {}).items():
                pass_rows[int(rows_)] = pass_rows.get(int(rows_), 0) + c
        prefill = [x["prefill_s"] for x in r if x.get("prefill_s") is not None]
        agg[m] = {"tok_s": toks / wall if wall else 0.0, "new_tokens": toks, "wall_s": wall,
                  "tokens_per_pass": committed / passes if passes else (sum(tpp) / len(tpp) if tpp else None),
                  "tokens_per_pass_prompt_mean": sum(tpp) / len(tpp) if tpp else None,
                  "passes": passes or None,
                  "committed": committed if passes else None,
                  "draft_ms_per_pass": 1000 * sum(draft_s) / passes if passes and draft_s else None,
                  "prefill_s": sum(prefill) if len(prefill) == len(r) else None,
                  "pass_rows": dict(sorted(pass_rows.items())) or None,
                  "exact_match": _share(r, "exact_match"),
                  "agrees_with_greedy": _share(r, "agrees_with_greedy"),
                  "hf_agreement": _share(r, "hf_agreement"),
                  "hf_divergences": len(divs), "hf_divergences_all_ties": all(d["tie"] for d in divs),
                  "hf_min_top2_gap": min((d["top2_gap"] for d in divs), default=None),
                  "draft_acceptance": (sum(x["draft_n_accepted"] for x in drafted) / sum(x["draft_n"] for x in drafted)
                                       if drafted else None)}
    for m in methods:
        agg[m][f"speedup_vs_{base}"] = agg[m]["tok_s"] / agg[base]["tok_s"]
        for ref in ("llamacpp", "hf_generate"):
            if ref in agg:
                agg[m][f"speedup_vs_{ref}"] = agg[m]["tok_s"] / agg[ref]["tok_s"]
    return agg


def pyplot():
    """matplotlib's pyplot drawing to files only (heavy: imported when a plot is drawn, not with the CLI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_results(results: dict, path: Path) -> None:
    """tok/s of every method relative to our own plain decoding (the baseline), per dataset."""
    plt = pyplot()
    datasets = list(results["datasets"])
    methods = list(next(iter(results["datasets"].values()))["methods"]) if datasets else []
    base = results["config"].get("baseline", "greedy")
    fig, ax = plt.subplots(figsize=(3.6 + max(1.6, 0.3 * len(methods)) * len(datasets), 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [results["datasets"][d]["methods"][m][f"speedup_vs_{base}"] for d in datasets]
        xs = [i + j * width for i in range(len(datasets))]
        bars = ax.bar(xs, vals, width, label=m, hatch="//" if m in LLAMACPP_METHODS + HF_METHODS else None)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel(f"tok/s relative to our plain decoding ({base})")
    cfg = results["config"]
    ax.set_title(f"{cfg['target']}, {cfg['device']}, {cfg.get('precision', 'exact')} mode, n={cfg['n']}, "
                 f"max {cfg['max_new_tokens']} new tokens", fontsize=9)
    ax.margins(y=0.12)  # room for the value labels above the tallest bar
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cost_curve(curve: dict, path: Path) -> None:
    """Pass time against tokens in the pass; llama.cpp's (``curve["llamacpp"]``) beside ours when measured."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(curve["n"], curve["ms"], marker=".", label=f"specdraft ({curve.get('precision', 'exact')})")
    peer = curve.get("llamacpp")
    if peer:
        ax.plot(peer["n"], peer["ms"], marker="x", label="llama.cpp (llama-bench)")
        ax.legend(fontsize=8)
    ax.set_xlabel("tokens in one target pass (N)")
    ax.set_ylabel("pass time (ms)")
    ax.set_title(f"{curve['target']} verification cost, {curve['device']}, {curve['threads']} threads", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
