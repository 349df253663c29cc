"""``specdraft bench --report``: one Markdown report with PNG plots from the JSON files in a folder.

Nothing is re-run; every input is optional and a file that cannot be read is named in the report
instead of stopping it.  What is read from ``DIR``:

* ``results.json`` (``specdraft bench``): the results table, ``speedup.png`` (tok/s relative
  to HF ``generate()`` per dataset per method) and ``tokens_per_pass.png``: per drafter, the
  share of target passes that committed k tokens, pooled over prompts, from the per-prompt
  ``accept_hist`` rows (``{drafted tokens accepted: passes}``, so k = accepted + 1); results
  written before those rows existed get the histogram of per-prompt tokens per pass instead.
* ``cost_curve.json`` (``specdraft bench --cost-curve``: ``n``, ``ms``, ``ratio``):
  ``budget_curve.png``, the cost of one pass over N tree tokens relative to one token, which is
  also the tokens per pass a tree of N tokens must bank to break even, with the budget picked
  from it and the drafters' measured tokens per pass.
* ``budget_sweep*.json``: ``budget_sweep.png``, tokens per pass (and speedup, when given) against
  the node budget.  Expected shape, per drafter::

      {"ngram": {"budget": [1, 2, 4, 8],
                 "tokens_per_pass": {"gsm": [1.4, 1.6, 1.7, 1.8], ...},   # or one list
                 "speedup": {"gsm": [1.3, 1.5, 1.4, 1.2], ...}}}          # optional

  ``{"ngram": {"1": 1.4, "2": 1.6}}`` (budget -> tokens per pass) is read too.
  ``acceptance.json`` (offline replay: ``{"datasets": {dataset: {drafter: {budget: tokens per
  pass}}}}``) is drawn on the same plot.
* ``batch_curve.json`` (``specdraft bench --batch-curve``): a table.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.bench.runner import HF_METHODS, plot_results, pyplot, row_committed
from specdraft.bench.stats import paired_comparisons, verdict
from specdraft.drafters.budget import budget_from_curve
from specdraft.errors import SpecdraftError


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def _log2_axis(ax, values) -> None:
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter  # with pyplot: only when drawing

    ax.set_xscale("log", base=2)
    hi = max(values) if values else 1
    ax.xaxis.set_major_locator(FixedLocator([2**i for i in range(int(hi).bit_length() + 1) if 2**i <= 2 * hi]))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _load_json(path: Path, problems: list[str]):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"`{path.name}` could not be read ({type(e).__name__}: {e})")
        return None


# ---------------------------------------------------------------------- tokens per pass
def drafter_methods(results: dict) -> list[str]:
    """Methods with speculative stats other than plain greedy, in the order they appear."""
    seen: dict[str, None] = {}
    for d in results.get("datasets", {}).values():
        for m, v in d.get("methods", {}).items():
            if m not in HF_METHODS and m not in ("greedy", "sample") and v.get("tokens_per_pass") is not None:
                seen[m] = None
    return list(seen)


def committed_hist(rows: list[dict], method: str) -> dict[int, int] | None:
    """Passes that committed k tokens (k = drafted tokens accepted + 1), pooled over prompts;
    None when the rows carry no ``accept_hist``."""
    hist: dict[int, int] = {}
    found = False
    for r in rows:
        if r.get("method") != method or not isinstance(r.get("accept_hist"), dict):
            continue
        found = True
        for k, v in r["accept_hist"].items():
            hist[int(k) + 1] = hist.get(int(k) + 1, 0) + int(v)
    return dict(sorted(hist.items())) if found else None


def plot_tokens_per_pass(results: dict, path: Path) -> str | None:
    """One panel per drafter; returns what the plot shows (for the caption) or None if nothing."""
    methods = drafter_methods(results)
    if not methods:
        return None
    datasets = list(results["datasets"])
    fig, axes = pyplot().subplots(1, len(methods), figsize=(4.6 * len(methods), 3.6), squeeze=False)
    kinds = set()
    for ax, m in zip(axes[0], methods):
        hists = {ds: committed_hist(results["datasets"][ds].get("rows", []), m) for ds in datasets}
        if all(h is not None for h in hists.values()):
            kinds.add("passes")
            ks = sorted({k for h in hists.values() for k in h})
            width = 0.8 / len(datasets)
            for j, ds in enumerate(datasets):
                total = sum(hists[ds].values()) or 1
                ax.bar([k + (j - (len(datasets) - 1) / 2) * width for k in ks],
                       [hists[ds].get(k, 0) / total for k in ks], width, label=ds)
            ax.set_xticks(ks)
            ax.set_xlabel("tokens committed by one target pass")
            ax.set_ylabel("share of passes")
        else:
            kinds.add("prompts")
            vals = {ds: [r["tokens_per_pass"] for r in results["datasets"][ds].get("rows", [])
                         if r.get("method") == m and r.get("tokens_per_pass") is not None] for ds in datasets}
            allv = [x for v in vals.values() for x in v]
            lo, hi = (min(allv), max(allv)) if allv else (1.0, 2.0)
            bins = [lo + (hi - lo + 1e-9) * i / 12 for i in range(13)]
            for ds in datasets:
                if vals[ds]:
                    ax.hist(vals[ds], bins=bins, histtype="step", lw=1.6, label=ds)
            ax.set_xlabel("tokens per pass of one prompt")
            ax.set_ylabel("prompts")
        tpp = {ds: results["datasets"][ds]["methods"].get(m, {}).get("tokens_per_pass") for ds in datasets}
        ax.set_title(f"{m}: tokens/pass (all tokens / all passes) " + ", ".join(f"{ds} {v:.2f}" for ds, v in tpp.items() if v), fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    _save(fig, path)
    if kinds == {"passes"}:
        return "share of target passes that committed k tokens (accepted drafted tokens + the target's own), pooled over prompts"
    return "distribution over prompts of each prompt's tokens per pass (these results carry no per-pass histogram)"


def per_prompt_counts(rows: list[dict], method: str) -> list[tuple[int, int]] | None:
    """Per prompt (committed tokens, passes) of ``method``, ordered by prompt; None when the rows
    carry no pass counts."""
    got = sorted((r["prompt"], r) for r in rows if r.get("method") == method)
    if not got or any(not r.get("passes") or r.get("tokens_per_pass") is None for _, r in got):
        return None
    return [(row_committed(r), r["passes"]) for _, r in got]


def paired_section(results: dict) -> list[str]:
    """Markdown table: every pair of drafters per dataset, tokens per pass compared over the same
    prompts with a bootstrap interval (``specdraft.bench.stats``); empty with fewer than two."""
    methods = drafter_methods(results)
    if len(methods) < 2:
        return []
    budgets = results.get("config", {}).get("budgets", {})
    lines = []
    for ds, d in results["datasets"].items():
        counts = {m: per_prompt_counts(d.get("rows", []), m) for m in methods}
        counts = {m: c for m, c in counts.items() if c is not None}
        if len({len(c) for c in counts.values()}) > 1 or len(counts) < 2:
            continue
        for c in paired_comparisons(counts):
            ba, bb = budgets.get(c["a"]), budgets.get(c["b"])
            same = "" if ba == bb else f" ({ba} vs {bb} nodes)"
            lo, hi = c["ci"]
            lines.append(f"| {ds} | {c['a']} - {c['b']}{same} | {c['diff']:+.3f} | [{lo:+.3f}, {hi:+.3f}] | "
                         f"{100 * c['p_ahead']:.0f}% | {c['fewer_passes']} / {c['more_passes']} | {verdict(c)} |")
    if not lines:
        return []
    return ["## Drafters compared, paired over prompts", "",
            "Pooled tokens per pass of the first minus the second on the same prompts, with a 95% percentile "
            "bootstrap interval over prompts (2,000 resamples, seed 0); a difference whose interval holds 0 is "
            "a tie within the prompt sample's noise.", "",
            "| dataset | pair | difference | 95% interval | first ahead in resamples | prompts with fewer / more "
            "passes | verdict |", "|---|---|---|---|---|---|---|"] + lines + [""]


# ---------------------------------------------------------------------- node budget
def plot_budget_curve(curve: dict, results: dict | None, path: Path) -> int:
    """Cost of an N-token pass relative to one token; returns the budget picked from the curve."""
    budget = budget_from_curve(curve)
    fig, ax = pyplot().subplots(figsize=(6, 3.8))
    ax.plot(curve["n"], curve["ratio"], marker=".", label="pass cost / one-token pass")
    ax.axhline(1.5, color="gray", ls="--", lw=0.8, label="1.5x: largest tree ngram's default budget allows")
    ax.axvline(budget + 1, color="tab:red", ls=":", lw=1, label=f"ngram's pick: {budget} drafted nodes (+ root)")
    if results is not None:
        cfg = results.get("config", {})
        ran = cfg.get("budget")  # the run's --budget, else each drafter's own (recorded), else the one picked here
        for m in drafter_methods(results):
            used = ran if ran is not None else cfg.get("budgets", {}).get(m)
            at = (budget if used is None else used) + 1
            for ds, d in results["datasets"].items():
                tpp = d["methods"].get(m, {}).get("tokens_per_pass")
                if tpp:
                    ax.scatter([at], [tpp], marker="x", zorder=3, label=f"{m} {ds}: {tpp:.2f} tokens/pass")
    _log2_axis(ax, curve["n"])
    ax.set_xlabel("tokens in one target pass (tree size N)")
    ax.set_ylabel("relative cost = tokens/pass to break even")
    ax.set_title(f"{curve.get('target', '?')}, {curve.get('device', '?')}, {curve.get('threads', '?')} threads, "
                 f"one token {curve['ms'][0]:.1f} ms", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    _save(fig, path)
    return budget


def sweep_series(sweep: dict) -> dict[str, dict]:
    """Normalise a budget sweep to {drafter: {"budget": [...], metric: {dataset: [...]}}}."""
    out: dict[str, dict] = {}
    for drafter, v in sweep.items():
        if not isinstance(v, dict):
            continue
        if "budget" in v and isinstance(v["budget"], list):
            budgets = [float(b) for b in v["budget"]]
            series = {"budget": budgets}
            for metric in ("tokens_per_pass", "speedup", "tok_s"):
                m = v.get(metric)
                if isinstance(m, list):
                    m = {"all": m}
                if isinstance(m, dict):
                    series[metric] = {ds: [float(x) for x in xs] for ds, xs in m.items()
                                      if isinstance(xs, list) and len(xs) == len(budgets)}
            out[drafter] = series
        elif v and all(isinstance(x, (int, float)) for x in v.values()):
            try:
                pairs = sorted((float(b), float(x)) for b, x in v.items())
            except ValueError:
                continue
            out[drafter] = {"budget": [b for b, _ in pairs], "tokens_per_pass": {"all": [x for _, x in pairs]}}
    return out


def acceptance_series(d: dict) -> dict[str, dict]:
    """``specdraft analyze acceptance`` output, {"datasets": {dataset: {drafter: {budget: tokens/pass}}}},
    as budget-sweep series."""
    out: dict[str, dict] = {}
    per_ds = d.get("datasets")
    for ds, per in (per_ds.items() if isinstance(per_ds, dict) else []):
        for drafter, series in (sweep_series(per) if isinstance(per, dict) else {}).items():
            cur = out.setdefault(drafter, {"budget": series["budget"], "tokens_per_pass": {}})
            if cur["budget"] == series["budget"]:
                cur["tokens_per_pass"][ds] = series["tokens_per_pass"]["all"]
    # predicted speed-up over greedy (cost curve + measured drafting time), where recorded
    pred = d.get("predicted_speedup_vs_greedy")
    for ds, per in (pred.items() if isinstance(pred, dict) else []):
        for drafter, v in (per.items() if isinstance(per, dict) else []):
            cur = out.get(drafter)
            if cur is None or not isinstance(v, dict):
                continue
            try:
                ys = {float(b): float(x) for b, x in v.items() if x is not None}
            except (TypeError, ValueError):
                continue
            if ys:  # budgets off the cost curve (e.g. 64 nodes = 65 tokens) have no prediction: a gap
                cur.setdefault("speedup", {})[ds] = [ys.get(b, float("nan")) for b in cur["budget"]]
    return out


def plot_budget_sweep(series: dict[str, dict], path: Path) -> bool:
    metrics = [m for m in ("tokens_per_pass", "speedup", "tok_s") if any(s.get(m) for s in series.values())]
    if not metrics:
        return False
    fig, axes = pyplot().subplots(1, len(metrics), figsize=(6.5 * len(metrics), 4.8), squeeze=False)
    labels = {"tokens_per_pass": "tokens per pass", "speedup": "speedup vs greedy (offline replay: predicted)", "tok_s": "tok/s"}
    colors = {d: f"C{i % 10}" for i, d in enumerate(series)}  # one colour per drafter, one line style per dataset
    styles: dict[str, str] = {}
    for ax, metric in zip(axes[0], metrics):
        for drafter, s in series.items():
            for ds, ys in (s.get(metric) or {}).items():
                ls = styles.setdefault(ds, ["-", "--", ":", "-."][len(styles) % 4])
                ax.plot(s["budget"], ys, marker="o", ms=3, color=colors[drafter], linestyle=ls,
                        label=drafter if ds == "all" else f"{drafter} {ds}")
        _log2_axis(ax, [b for s in series.values() for b in s["budget"]])
        ax.set_xlabel("node budget (drafted nodes per tree)")
        ax.set_ylabel(labels[metric])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    _save(fig, path)
    return True


# ---------------------------------------------------------------------- the report
def _config_line(cfg: dict) -> str:
    keys = ("target", "device", "threads", "n", "max_new_tokens", "budget", "date")
    line = ", ".join(f"{k} {cfg[k]}" for k in keys if k in cfg and not (k == "budget" and cfg[k] is None))
    if cfg.get("budget") is None and cfg.get("budgets"):  # each drafter's own budget, as recorded by the run
        line += "; node budgets " + ", ".join(f"{m} {b}" for m, b in cfg["budgets"].items() if b)
    return line


def _json_section(out: Path, name: str, used: set[str], problems: list[str], render) -> list[str]:
    """``render(data)`` of ``out/name`` if it exists; a file that does not fit becomes a problem line."""
    path = out / name
    if not path.is_file():
        return []
    used.add(name)
    data = _load_json(path, problems)
    if data is None:
        return []
    try:
        return render(data)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        problems.append(f"`{name}` is missing fields ({type(e).__name__}: {e})")
        return []


def _cost_section(curve: dict, results: dict | None, out: Path) -> list[str]:
    budget = plot_budget_curve(curve, results, out / "budget_curve.png")
    picks = ", ".join(f"{n}: {r:.2f}x" for n, r in zip(curve["n"], curve["ratio"]) if n in (2, 4, 8, 16, 32, 64))
    return ["## Verification cost and node budget", "",
            f"`cost_curve.json`: one target pass over N tokens relative to one token ({picks}; one token "
            f"{curve['ms'][0]:.1f} ms). A tree of N tokens pays off only when a pass banks more than that "
            f"many tokens; `ngram`'s default budget is the largest tree costing at most 1.5x one token: "
            f"{budget} drafted nodes (trained drafters pick theirs from their own acceptance profile). "
            f"The crosses are the drafters' measured tokens per pass at the tree size they ran with.", "",
            "![node budget](budget_curve.png)", "", format_cost_table(curve), ""]


def _batch_section(bc: dict) -> list[str]:
    n = bc["n_prompts"]
    return (["## Batched regeneration", "",
             f"`batch_curve.json`: {n} prompts, {bc['max_new_tokens']} new tokens each, greedy.", "",
             "| decoding | tok/s | vs single-stream | rows equal to single-stream |", "|---|---|---|---|",
             f"| single-stream | {bc['single_stream']['tok_s']:.1f} | 1.00x | - |"]
            + [f"| batch {b} | {v['tok_s']:.1f} | {v['speedup_vs_single']:.2f}x | {v['rows_equal_single']}/{n} |"
               for b, v in bc["batched"].items()] + [""])


def write_report(out_dir: str | Path) -> Path:
    """Write ``out_dir/report.md`` (and its PNGs) from the JSON files there; returns its path."""
    out = Path(out_dir)
    if not out.is_dir():
        raise SpecdraftError(f"no folder {out} (run `specdraft bench --out {out}` first)")
    files = sorted(out.glob("*.json"))
    if not files:
        raise SpecdraftError(f"no JSON results in {out} (run `specdraft bench --out {out}` first)")
    problems: list[str] = []
    used: set[str] = set()
    md = ["# specdraft benchmark report", ""]
    n_intro = len(md)

    results = None
    if (out / "results.json").is_file():
        used.add("results.json")
        results = _load_json(out / "results.json", problems)
        if results is not None and not (isinstance(results, dict) and isinstance(results.get("datasets"), dict)
                                        and results["datasets"]):
            problems.append("`results.json` has no `datasets`")
            results = None
    if results is not None:
        cfg = results.get("config", {})
        md += [f"Source: `results.json` ({_config_line(cfg)}).", "",
               f"Command: `{bench_command_line(results)}`", "",
               "## Speed", "", "tok/s = all new tokens / all wall time (prefill included); tokens/pass = tokens "
               "committed by the target passes after prefill / those passes.", ""]
        try:
            md += [format_table(results), ""]
            dec = format_decomposition(results)
            if dec:
                md += ["## Where each speed-up comes from", "", "speed-up ~ tokens per pass / (live pass ratio + "
                       "drafting share); the curve's ratio is what the stored cost curve says the same passes cost.",
                       "", dec, ""]
            live = format_live_passes(results)
            if live:
                md += ["## Live passes against the cost curve", "", "Every pass of the run's drafted methods, by "
                       "its rows, as the live policy timed it, beside the stored curve.", "", live, ""]
            plot_results(results, out / "speedup.png")
            md += ["![speedup per dataset per method](speedup.png)", ""]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            problems.append(f"`results.json` is missing fields for the table or speedup plot ({type(e).__name__}: {e})")
        try:
            caption = plot_tokens_per_pass(results, out / "tokens_per_pass.png")
        except (KeyError, TypeError, ValueError) as e:
            caption = None
            problems.append(f"tokens-per-pass histogram skipped ({type(e).__name__}: {e})")
        if caption:
            md += ["## Tokens per pass", "", f"Per drafter: {caption}.", "",
                   "![tokens per pass](tokens_per_pass.png)", ""]
        try:
            md += paired_section(results)
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"paired comparison skipped ({type(e).__name__}: {e})")

    md += _json_section(out, "cost_curve.json", used, problems, lambda c: _cost_section(c, results, out))

    sweeps: dict[str, dict] = {}
    sweep_files = [p for p in files if p.name.startswith("budget_sweep") or p.name == "acceptance.json"]
    for p in sweep_files:
        used.add(p.name)
        d = _load_json(p, problems)
        if isinstance(d, dict):
            replay = p.name == "acceptance.json"
            found = acceptance_series(d) if replay else sweep_series(d)
            if not found:
                problems.append(f"`{p.name}` has no series in the expected shape")
            sweeps.update({f"{k} (offline replay)" if replay else k: v for k, v in found.items()})
    if sweeps and plot_budget_sweep(sweeps, out / "budget_sweep.png"):
        md += ["## Node-budget sweep", "", "From " + ", ".join(f"`{p.name}`" for p in sweep_files) + ".", "",
               "![node-budget sweep](budget_sweep.png)", ""]

    md += _json_section(out, "batch_curve.json", used, problems, _batch_section)

    rendered = len(md) > n_intro
    others = [p.name for p in files if p.name not in used]
    if others:
        md += ["## Other files", "", "Not rendered: " + ", ".join(f"`{n}`" for n in others) + ".", ""]
    if problems:
        md += ["## Problems", ""] + [f"- {p}" for p in problems] + [""]
    if not rendered:
        md += ["Nothing to report: no readable `results.json`, `cost_curve.json`, `budget_sweep*.json` or "
               "`batch_curve.json`.", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def bench_command_line(results: dict) -> str:
    """The ``specdraft bench`` command line that produced ``results`` (from its stored config)."""
    cfg = results.get("config", {})
    parts = ["specdraft bench"]
    if cfg.get("target") and cfg.get("target_spec", "default") != "default":
        parts.append(f"--target {cfg['target_spec']}")
    if cfg.get("device", "cpu") != "cpu":
        parts.append(f"--device {cfg['device']}")
    if cfg.get("llama_cpp"):
        parts.append(f"--llama-cpp {Path(cfg['llama_cpp']).parent}")
        if cfg.get("llama_cpp_ngram") is None:
            parts.append("--no-llamacpp-ngram")
    parts += [f"--drafter {d}" for d in cfg.get("drafters", [])]
    parts += [f"--dataset {d}" for d in results.get("datasets", {})]
    parts.append(f"--n {cfg.get('n', '?')} --max-new-tokens {cfg.get('max_new_tokens', '?')}")
    smp = cfg.get("sampling") or {}
    if smp.get("temperature"):
        parts.append(f"--temperature {smp['temperature']} --top-p {smp.get('top_p', 1.0)}"
                     + (f" --top-k {smp['top_k']}" if smp.get("top_k") else "") + f" --seed {smp.get('seed', 0)}")
    if cfg.get("precision", "exact") == "exact":  # results from before the fast mode ran exact
        parts.append("--precision exact")
    if cfg.get("budget") is not None:
        parts.append(f"--budget {cfg['budget']}")
    if cfg.get("hf") is False:
        parts.append("--no-hf")
    if cfg.get("hf_lookup"):
        parts.append("--hf-lookup")
    return " ".join(parts)


def format_table(res: dict) -> str:
    """The results as a Markdown table: tok/s against our plain decoding (the baseline) and llama.cpp,
    tokens per pass, the drafter's time per pass (propose and commit) and its share of a plain decoding
    step (speed-up = tokens per pass / (pass(n) / pass(1) + that share)), exact_match (equal to our plain
    decoding; llama.cpp rows: agreement with it) and hf_agreement (equal to HF fp32 greedy; the smallest
    top-2 gap at a divergence)."""
    base = res["config"].get("baseline", "greedy")
    methods = next(iter(res["datasets"].values()))["methods"] if res["datasets"] else {}
    peer = "llamacpp" if "llamacpp" in methods else "hf_generate"
    lines = [f"| dataset | method | tok/s | vs {base} | vs {peer} | tokens/pass | drafting ms/pass (share) | "
             f"exact_match | hf_agreement |", "|---|---|---|---|---|---|---|---|---|"]
    for ds, d in res["datasets"].items():
        plain = d["methods"].get(base, {})
        step_ms = 1000 * plain["wall_s"] / plain["new_tokens"] if plain.get("new_tokens") else None
        for m, v in d["methods"].items():
            tpp = "-" if v["tokens_per_pass"] is None else f"{v['tokens_per_pass']:.2f}"
            dms = v.get("draft_ms_per_pass")
            dms = "-" if dms is None or m == base else f"{dms:.2f}" + ("" if not step_ms else f" ({dms / step_ms:.0%})")
            em = v.get("exact_match")
            em = (f"{em:.2f}" if em is not None else
                  f"agrees {v['agrees_with_greedy']:.2f}" if v.get("agrees_with_greedy") is not None else "-")
            ha = v.get("hf_agreement")
            gap = v.get("hf_min_top2_gap")
            ha = "-" if ha is None else f"{ha:.2f}" + ("" if gap is None else f" (min gap {gap:.3f})")
            vs_peer = v.get(f"speedup_vs_{peer}")
            vs_peer = "-" if vs_peer is None else f"{vs_peer:.2f}x"
            lines.append(f"| {ds} | {m} | {v['tok_s']:.1f} | {v[f'speedup_vs_{base}']:.2f}x | {vs_peer} | {tpp} | {dms} | "
                         f"{em} | {ha} |")
    return "\n".join(lines)


def decomposition(res: dict) -> list[dict]:
    """Each drafter's speed-up over plain decoding taken apart, per dataset:
    speed-up ~ tokens per pass / (live pass ratio + drafting share), where the live pass ratio is a drafted
    step's time less its drafting (prefill left out) over a plain step's, the drafting share is the drafting
    (propose and commit) over a plain step, and the curve's pass ratio is what the stored cost curve says the
    same passes (the same row counts) cost over one token's."""
    base = res["config"].get("baseline", "greedy")
    curve = res.get("cost_curve")
    ms = dict(zip(curve["n"], curve["ms"])) if curve else {}
    out = []
    for ds, d in res["datasets"].items():
        plain = d["methods"].get(base, {})
        if not plain.get("passes") or plain.get("prefill_s") is None:
            continue
        step = 1000 * (plain["wall_s"] - plain["prefill_s"]) / plain["passes"]
        for m, v in d["methods"].items():
            if m == base or not v.get("passes") or v.get("prefill_s") is None:
                continue
            per_pass = 1000 * (v["wall_s"] - v["prefill_s"]) / v["passes"]
            draft = v.get("draft_ms_per_pass") or 0.0
            rows = v.get("pass_rows") or {}
            curve_ratio = None
            if rows and ms and all(int(n) in ms for n in rows):
                curve_ratio = sum(ms[int(n)] * c for n, c in rows.items()) / sum(rows.values()) / ms[1]
            out.append({"dataset": ds, "method": m, "tokens_per_pass": v["tokens_per_pass"],
                        "rows_per_pass": sum(int(n) * c for n, c in rows.items()) / sum(rows.values()) if rows else None,
                        "pass_ratio_live": (per_pass - draft) / step, "pass_ratio_curve": curve_ratio,
                        "drafting_share": draft / step, "speedup": v[f"speedup_vs_{base}"],
                        "speedup_decoding": (v["committed"] / (v["wall_s"] - v["prefill_s"]))
                        / (plain["committed"] / (plain["wall_s"] - plain["prefill_s"]))})
    return out


def format_decomposition(res: dict) -> str:
    """``decomposition`` as a Markdown table ("" when the results lack the fields)."""
    rows = decomposition(res)
    if not rows:
        return ""
    lines = ["| dataset | method | tokens/pass | rows/pass | pass ratio: live / curve | drafting share | "
             "decoding speed-up (prefill left out) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        curve = "-" if r["pass_ratio_curve"] is None else f"{r['pass_ratio_curve']:.2f}"
        rpp = "-" if r["rows_per_pass"] is None else f"{r['rows_per_pass']:.2f}"
        lines.append(f"| {r['dataset']} | {r['method']} | {r['tokens_per_pass']:.2f} | {rpp} | "
                     f"{r['pass_ratio_live']:.2f} / {curve} | {r['drafting_share']:.0%} | {r['speedup_decoding']:.2f}x |")
    return "\n".join(lines)


def format_live_passes(res: dict) -> str:
    """Per row count: the passes the live policy timed over the run, their mean ms (older results: the moving
    average) and the stored curve's ms, each relative to one row's ("" without them)."""
    live = res.get("live_costs")
    if not live:
        return ""
    ms = live.get("mean_ms") or live["live_ms"]
    what = "mean" if live.get("mean_ms") else "moving average"
    one_live = ms[0] if live["rows"][0] == 1 else None
    one_curve = live["curve_ms"][0] if live["rows"][0] == 1 else None
    lines = [f"| rows in the pass | passes | live ms, {what} (ratio) | curve ms (ratio) | live / curve |",
             "|---|---|---|---|---|"]
    for n, c, lm, cm in zip(live["rows"], live["passes"], ms, live["curve_ms"]):
        lr = f" ({lm / one_live:.2f}x)" if one_live else ""
        cr = f" ({cm / one_curve:.2f}x)" if one_curve else ""
        lines.append(f"| {n} | {c} | {lm:.2f}{lr} | {cm:.2f}{cr} | {lm / cm:.2f} |")
    return "\n".join(lines)


def format_cost_table(curve: dict) -> str:
    """Pass times (ms) at 1..64 tokens and prefill times, ours and llama.cpp's when measured."""
    peer, ns = curve.get("llamacpp"), [1, 2, 4, 8, 16, 32, 64]
    ms = dict(zip(curve["n"], curve["ms"]))
    ns = [n for n in ns if n in ms]
    lines = ["| tokens in the pass | " + " | ".join(map(str, ns)) + " |", "|---|" + "---|" * len(ns),
             f"| specdraft ({curve.get('precision', 'exact')}), ms | " + " | ".join(f"{ms[n]:.1f}" for n in ns) + " |",
             "| relative to 1 token | " + " | ".join(f"{ms[n] / ms[1]:.2f}x" for n in ns) + " |"]
    if peer:
        pm = dict(zip(peer["n"], peer["ms"]))
        lines.append("| llama.cpp (llama-bench), ms | " + " | ".join(f"{pm[n]:.1f}" if n in pm else "-" for n in ns) + " |")
    pre = curve.get("prefill")
    if pre:
        lines += ["", "| prefill | " + " | ".join(f"{n} tokens" for n in pre["n"]) + " |", "|---|" + "---|" * len(pre["n"]),
                  "| specdraft, ms | " + " | ".join(f"{m:.0f}" for m in pre["ms"]) + " |"]
        lp = curve.get("llamacpp_prefill")
        if lp:
            lm = dict(zip(lp["n"], lp["ms"]))
            lines.append("| llama.cpp, ms | " + " | ".join(f"{lm[n]:.0f}" if n in lm else "-" for n in pre["n"]) + " |")
    return "\n".join(lines)
