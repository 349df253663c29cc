"""``specdraft bench --report``: Markdown + PNGs from the JSON files of a bench folder, nothing re-run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft import cli
from specdraft.bench.report import acceptance_series, committed_hist, sweep_series, write_report

PNG = b"\x89PNG\r\n\x1a\n"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "bench"


def fake_results(with_hist: bool) -> dict:
    methods = ["hf_generate", "hf_prompt_lookup", "greedy", "ngram"]
    datasets = {}
    for ds, base in (("gsm", 20.0), ("mtbench", 22.0)):
        rows = []
        for i in range(3):
            for m in methods:
                tpp = None if m.startswith("hf") else (1.0 if m == "greedy" else 1.4 + 0.2 * i)
                row = {"prompt": i, "method": m, "new_tokens": 50, "wall_s": 2.0, "tok_s": 25.0,
                       "tokens_per_pass": tpp, "exact_match": True, "divergence": None}
                if with_hist and tpp is not None:
                    row["passes"] = 30
                    row["accept_hist"] = {"0": 30} if m == "greedy" else {"0": 15, "1": 10, "2": 5}
                rows.append(row)
        agg = {m: {"tok_s": base * (1.6 if m == "ngram" else 1.0), "new_tokens": 150, "wall_s": 6.0,
                   "tokens_per_pass": None if m.startswith("hf") else (1.0 if m == "greedy" else 1.6),
                   "exact_match": 1.0, "divergences": 0, "divergences_all_ties": True,
                   "speedup_vs_hf": 1.6 if m == "ngram" else 1.0, "speedup_vs_greedy": 1.6 if m == "ngram" else 1.0}
               for m in methods}
        datasets[ds] = {"methods": agg, "rows": rows}
    return {"config": {"drafters": ["ngram"], "n": 3, "max_new_tokens": 64, "target": "tiny", "device": "cpu",
                       "threads": 2, "budget": None, "budgets": {"greedy": 0, "ngram": 6}, "date": "2026-12-01"},
            "datasets": datasets}


def curve() -> dict:
    n = list(range(1, 17))
    return {"target": "tiny", "device": "cpu", "threads": 2, "context": 256, "n": n,
            "ms": [10 + 0.8 * (k - 1) for k in n], "ratio": [1 + 0.08 * (k - 1) for k in n]}


def pngs_ok(folder: Path, names: list[str]) -> None:
    for name in names:
        data = (folder / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name


def test_full_report_with_every_input(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(fake_results(with_hist=True)))
    (tmp_path / "cost_curve.json").write_text(json.dumps(curve()))
    (tmp_path / "budget_sweep.json").write_text(json.dumps({
        "ngram": {"budget": [1, 2, 4, 8], "tokens_per_pass": {"gsm": [1.3, 1.5, 1.6, 1.65]},
                  "speedup": {"gsm": [1.2, 1.4, 1.3, 1.1]}}}))
    (tmp_path / "budget_sweep_phrase.json").write_text(json.dumps({"phrase": {"1": 1.5, "4": 2.1, "16": 2.4}}))
    (tmp_path / "acceptance.json").write_text(json.dumps({"config": {}, "datasets": {
        "gsm": {"ngram": {"1": 1.3, "3": 1.5}}, "mtbench": {"ngram": {"1": 1.2, "3": 1.4}}}}))
    (tmp_path / "notes.json").write_text("{}")
    assert cli.main(["bench", "--report", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    for img in ("speedup.png", "tokens_per_pass.png", "budget_curve.png", "budget_sweep.png"):
        assert f"]({img})" in md
    pngs_ok(tmp_path, ["speedup.png", "tokens_per_pass.png", "budget_curve.png", "budget_sweep.png"])
    assert "| gsm | ngram | 32.0 | 1.60x |" in md
    assert "date 2026-12-01; node budgets ngram 6)" in md and "budget None" not in md  # each drafter's own
    assert "share of target passes that committed k tokens" in md
    assert "`acceptance.json`" in md and "Not rendered: `notes.json`" in md and "## Problems" not in md


def test_report_from_old_results_and_broken_files(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(fake_results(with_hist=False)))
    (tmp_path / "cost_curve.json").write_text("{ torn")
    (tmp_path / "budget_sweep.json").write_text(json.dumps({"ngram": "nonsense"}))
    path = write_report(tmp_path)
    md = path.read_text()
    assert "distribution over prompts" in md
    assert "`cost_curve.json` could not be read" in md and "`budget_sweep.json` has no series" in md
    pngs_ok(tmp_path, ["speedup.png", "tokens_per_pass.png"])
    assert not (tmp_path / "budget_curve.png").exists()


def test_report_without_results(tmp_path, capsys):
    assert cli.main(["bench", "--report", "--out", str(tmp_path / "missing")]) == 2
    assert "no folder" in capsys.readouterr().err
    assert cli.main(["bench", "--report", "--out", str(tmp_path)]) == 2
    (tmp_path / "cost_curve.json").write_text(json.dumps(curve()))
    md = write_report(tmp_path).read_text()
    assert "budget_curve.png" in md and "results.json" not in md
    (tmp_path / "cost_curve.json").write_text("[]")
    assert "Nothing to report" in write_report(tmp_path).read_text()


def test_helpers():
    rows = [{"method": "ngram", "accept_hist": {"0": 3, "2": 1}}, {"method": "ngram", "accept_hist": {"0": 1}},
            {"method": "greedy", "accept_hist": {"0": 9}}]
    assert committed_hist(rows, "ngram") == {1: 4, 3: 1}
    assert committed_hist([{"method": "ngram", "tokens_per_pass": 1.5}], "ngram") is None
    s = sweep_series({"a": {"budget": [1, 2], "tokens_per_pass": [1.1, 1.2]}, "b": {"2": 1.5, "1": 1.2}, "c": 3})
    assert s["a"]["tokens_per_pass"] == {"all": [1.1, 1.2]}
    assert s["b"] == {"budget": [1.0, 2.0], "tokens_per_pass": {"all": [1.2, 1.5]}}
    assert "c" not in s
    acc = acceptance_series({"datasets": {"gsm": {"ngram": {"3": 1.5, "1": 1.3}}, "bad": 4}})
    assert acc == {"ngram": {"budget": [1.0, 3.0], "tokens_per_pass": {"gsm": [1.3, 1.5]}}}
    assert acceptance_series({"datasets": []}) == {}


@pytest.mark.skipif(not (DOCS / "results.json").is_file(), reason="no committed bench run")
def test_report_of_the_committed_bench_run(tmp_path):
    for name in ("results.json", "cost_curve.json", "batch_curve.json"):
        if (DOCS / name).is_file():
            (tmp_path / name).write_bytes((DOCS / name).read_bytes())
    md = write_report(tmp_path).read_text()
    assert "| gsm | ngram |" in md and "## Problems" not in md
    pngs_ok(tmp_path, ["speedup.png", "tokens_per_pass.png"])


def test_predicted_speedup_series_and_formula():
    from specdraft.replay import predicted_speedup

    curve = {"n": [1, 2, 3, 4], "ms": [40.0, 44.0, 42.0, 60.0], "ratio": [1.0, 1.1, 1.05, 1.5]}
    # 2 tokens per pass over a 3-token tree: the pass counts as the dearest smaller tree (1.1), + 4 ms drafting
    assert abs(predicted_speedup(curve, 2.0, 2, 4.0) - 2.0 / (1.1 + 0.1)) < 1e-12
    assert predicted_speedup(curve, 2.0, 7, 0.0) is None  # off the curve
    acc = acceptance_series({"datasets": {"gsm": {"block": {"1": 1.5, "2": 2.0}}},
                             "predicted_speedup_vs_greedy": {"gsm": {"block": {"1": 1.4, "2": None}, "x": 3}}})
    assert acc["block"]["tokens_per_pass"] == {"gsm": [1.5, 2.0]}
    sp = acc["block"]["speedup"]["gsm"]  # a budget without a prediction is a gap
    assert sp[0] == 1.4 and sp[1] != sp[1]
    acc = acceptance_series({"datasets": {"gsm": {"block": {"1": 1.5, "2": 2.0}}},
                             "predicted_speedup_vs_greedy": {"gsm": {"block": {"1": 1.4, "2": 1.6}}}})
    assert acc["block"]["speedup"] == {"gsm": [1.4, 1.6]}


def test_bench_tokens_per_pass_pools_tokens_and_passes_over_prompts():
    from specdraft.bench.runner import summarize

    def row(m, tpp, passes, toks):
        return {"method": m, "new_tokens": toks, "wall_s": 1.0, "tokens_per_pass": tpp, "passes": passes,
                "exact_match": True, "divergence": None}

    # a short answer at 3 tokens/pass (4 passes) and a long one at 1.5 (100 passes)
    rows = [row("hf_generate", None, None, 13), row("hf_generate", None, None, 151),
            row("greedy", 1.0, 12, 13), row("greedy", 1.0, 150, 151),
            row("d", 3.0, 4, 13), row("d", 1.5, 100, 151)]
    agg = summarize(rows, ["hf_generate", "greedy", "d"])
    assert agg["d"]["tokens_per_pass"] == pytest.approx((12 + 150) / 104)  # not the per-prompt mean 2.25
    assert agg["d"]["tokens_per_pass_prompt_mean"] == pytest.approx(2.25)
    assert agg["d"]["passes"] == 104
    assert agg["greedy"]["tokens_per_pass"] == 1.0
    assert agg["hf_generate"]["tokens_per_pass"] is None
    assert agg["d"]["committed"] == 162
    # rows that carry "committed" are pooled from it, not from the ratio (2.0 * 3 would rebuild 6, not 7)
    exact = [{**row("d", 2.0, 3, 8), "committed": 7}, {**row("d", 1.0, 5, 6), "committed": 5}]
    agg = summarize(rows[:4] + exact, ["hf_generate", "greedy", "d"])
    assert agg["d"]["committed"] == 12 and agg["d"]["tokens_per_pass"] == pytest.approx(12 / 8)


def test_report_names_the_command_that_made_the_results():
    from specdraft.bench.report import bench_command_line as bench_command

    res = {"config": {"drafters": ["ngram"], "n": 5, "max_new_tokens": 64, "precision": "exact",
                      "llama_cpp": "~/bin/llama-server", "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 3},
                      "budget": None, "llama_cpp_ngram": ["--spec-type"], "hf": True},
           "datasets": {"gsm": {}, "mtbench": {}}}
    assert bench_command(res) == ("specdraft bench --llama-cpp ~/bin --drafter ngram --dataset gsm --dataset mtbench "
                                  "--n 5 --max-new-tokens 64 --temperature 0.7 --top-p 0.9 --seed 3 --precision exact")
    res["config"].update(llama_cpp=None, sampling={"temperature": 0.0}, precision="fast", budget=4, hf=False)
    assert bench_command(res) == ("specdraft bench --drafter ngram --dataset gsm --dataset mtbench --n 5 "
                                  "--max-new-tokens 64 --budget 4 --no-hf")
    del res["config"]["precision"]  # results from before the fast mode
    assert "--precision exact" in bench_command(res)


def test_bench_rows_hold_the_lossless_promise_and_the_agreements_apart():
    from specdraft.bench.runner import _rows, summarize

    got = {"greedy": {"tokens": [5, 6, 7], "wall_s": 1.0, "tokens_per_pass": 1.0},
           "d": {"tokens": [5, 6, 8], "wall_s": 0.5, "tokens_per_pass": 2.0},  # a lossless bug: must show
           "llamacpp": {"tokens": [5, 6, 7], "wall_s": 2.0, "tokens_per_pass": None}}
    rows = _rows(0, got, list(got), "greedy", True, [1, 2], None, 0)
    by = {r["method"]: r for r in rows}
    assert by["greedy"]["exact_match"] is True and by["d"]["exact_match"] is False
    assert by["llamacpp"]["exact_match"] is None and by["llamacpp"]["agrees_with_greedy"] is True
    assert all(r["hf_agreement"] is None for r in rows)  # no HF reference in this run
    agg = summarize(rows, list(got))
    assert agg["d"]["exact_match"] == 0.0 and agg["llamacpp"]["exact_match"] is None
    assert agg["d"]["speedup_vs_greedy"] == 2.0 and agg["greedy"]["speedup_vs_llamacpp"] == 2.0
    # sampling: only plain sampling itself has an exact_match (speculation draws other random numbers)
    rows = _rows(0, {"sample": got["greedy"], "d": got["d"]}, ["sample", "d"], "sample", False, [1], None, 0)
    assert [r["exact_match"] for r in rows] == [True, None]


def test_the_table_shows_drafting_time_and_its_share_of_a_plain_step():
    """speed-up = tokens per pass / (pass(n) / pass(1) + drafting / pass(1)): the table has the last term."""
    from specdraft.bench.report import format_table

    res = fake_results(with_hist=False)
    for d in res["datasets"].values():  # greedy: 150 tokens in 6 s = 40 ms a step
        d["methods"]["ngram"]["draft_ms_per_pass"] = 4.0
        d["methods"]["greedy"]["draft_ms_per_pass"] = 0.01
    table = format_table(res)
    assert "drafting ms/pass (share)" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if "| gsm | ngram |" in line)
    assert "| 4.00 (10%) |" in row
    greedy = next(line for line in table.splitlines() if "| gsm | greedy |" in line)
    assert "| 1.00 | - |" in greedy  # the baseline drafts nothing
    assert "| - | - |" in next(line for line in table.splitlines() if "| gsm | hf_generate |" in line)


def test_live_passes_table_from_the_policys_timings():
    from specdraft.bench.report import format_live_passes
    from specdraft.drafters.budget import LiveCosts

    costs = LiveCosts({"n": [1, 2, 3], "ms": [10.0, 12.0, 14.0]})
    for ms in (10.0, 10.0, 13.0):
        costs.observe_pass(1, ms)
    costs.observe_pass(2, 18.0)
    assert costs.totals == {1: [33.0, 3], 2: [18.0, 1]}  # as measured, never clipped
    live = {"rows": [1, 2], "passes": [3, 1], "live_ms": [10.3, 18.0], "mean_ms": [11.0, 18.0], "curve_ms": [10.0, 12.0]}
    table = format_live_passes({"live_costs": live})
    assert "| 1 | 3 | 11.00 (1.00x) | 10.00 (1.00x) | 1.10 |" in table
    assert "| 2 | 1 | 18.00 (1.64x) | 12.00 (1.20x) | 1.50 |" in table
    old = format_live_passes({"live_costs": {k: v for k, v in live.items() if k != "mean_ms"}})
    assert "moving average" in old and "| 1 | 3 | 10.30" in old
    assert format_live_passes({}) == ""
