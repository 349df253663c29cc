"""``specdraft analyze acceptance``: offline tokens per pass per dataset, drafter and node budget.

The greedy output of each prompt is computed once (batched, cached), then every drafter's trees
are replayed along it (``specdraft.replay``): no target passes are timed, so a sweep takes
minutes.  With a stored cost curve the replay's tokens per pass and measured drafting time also
predict the speed-up over plain greedy per budget.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.bench.stats import paired_comparisons
from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.drafters.budget import load_cost_curve
from specdraft.errors import SpecdraftError
from specdraft.replay import greedy_outputs, predicted_speedup, simulate_dataset


def data_folder_outputs(target, data_dir: str | Path, n: int, max_new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, greedy outputs) of the first ``n`` greedy responses a data build holds (``specdraft data
    build``; its sampled responses are left out), each cut to ``max_new_tokens``, EOS kept where the
    response ended within them: the same as ``greedy_outputs`` would regenerate, without regenerating."""
    from specdraft.train.data import PROMPTS, built_precision, check_data_target, load_sequences, read_manifest, read_prompts

    manifest = read_manifest(Path(data_dir))
    check_data_target(manifest, target, data_dir)
    if (built := built_precision(manifest)) != target.precision:
        raise SpecdraftError(f"{data_dir} holds responses of the {built} precision mode; replay it with --precision {built}")
    temps = [p.temperature for p in read_prompts(Path(data_dir) / PROMPTS)]
    greedy = [s for s in load_sequences(data_dir) if temps[s.prompt_id] == 0.0][:n]
    if not greedy:
        raise SpecdraftError(f"{data_dir} holds no greedy responses yet")
    eos = min(target.eos_ids)
    outs = [s.response[:max_new_tokens] + ([eos] if s.finished and len(s.response) < max_new_tokens else [])
            for s in greedy]
    return [s.tokens[: s.prompt_len] for s in greedy], outs


def acceptance_sweep(target, drafters: list[str], datasets: list[str], n: int, max_new_tokens: int,
                     budgets: list[int], out_dir: str | Path, quiet: bool = False,
                     cache_dir: str | Path | None = None) -> dict:
    """Offline tokens per pass per dataset x drafter x budget; writes DIR/acceptance.json.

    With several drafters it also compares every pair at each budget over the same prompts
    (``paired``: pooled difference with a bootstrap interval, ``specdraft.bench.stats``), from the
    per-prompt counts it stores under ``per_prompt``.

    Also records each drafter's mean ``propose`` time per budget (measured during the replay: run it
    on a quiet machine) and, when this machine's cost curve is stored, the predicted speed-up over
    plain greedy per budget and the best budget by that prediction."""
    if not drafters:
        raise SpecdraftError("give at least one --drafter")
    if any(b < 0 for b in budgets):
        raise SpecdraftError("budgets must be >= 0")
    made = {spec: make_drafter(spec, target) for spec in dict.fromkeys(drafters)}
    out = Path(out_dir)
    res: dict = {"config": {"n": n, "max_new_tokens": max_new_tokens, "budgets": budgets, "target": target.name,
                            "target_hash": target.weight_hash, "method": "offline replay of greedy output"},
                 "datasets": {}}
    for ds in datasets:
        if (Path(ds) / "manifest.json").is_file():
            prompts, outs = data_folder_outputs(target, ds, n, max_new_tokens)
        else:
            prompts = [target.encode_prompt(p) for p in load_prompts(ds, n)]
            outs = greedy_outputs(target, prompts, max_new_tokens, quiet=quiet,
                                  cache=Path(cache_dir or out / "greedy_outputs") / f"{Path(ds).stem}.json")
        dms: dict = {}
        each: dict = {}
        res["datasets"][ds] = simulate_dataset(target, made, prompts, outs, budgets, quiet=quiet, draft_ms=dms,
                                               per_prompt=each)
        res.setdefault("draft_ms", {})[ds] = dms
        res.setdefault("per_prompt", {})[ds] = each
        if len(made) > 1:  # same prompts and output for every drafter: compare them paired
            res.setdefault("paired", {})[ds] = {b: paired_comparisons({m: each[m][b] for m in made}) for b in budgets}
    curve = load_cost_curve(target)
    if curve is not None:
        res["config"]["one_token_pass_ms"] = curve["ms"][0]
        for ds, per in res["datasets"].items():
            pred = {name: {b: predicted_speedup(curve, tpp[b], b, res["draft_ms"][ds][name][b]) for b in budgets}
                    for name, tpp in per.items()}
            res.setdefault("predicted_speedup_vs_greedy", {})[ds] = pred
            res.setdefault("best_budget", {})[ds] = {
                name: max((v, b) for b, v in p.items() if v is not None)[1] for name, p in pred.items()
                if any(v is not None for v in p.values())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(res, indent=1))
    return res
