"""How much of a benchmark's greedy output the training data reaches (no timing, no drafting).

For each dataset: the share of the target's greedy output tokens that never occur in any training
response of the given data folders, and, per drafter with a restricted draft vocabulary (the
hybrid drafters), the share outside that vocabulary.  A token a drafter cannot score is a draft it
can never make, and one the training responses never hold is one it never learned to predict; both
bound the acceptance on that dataset whatever the tree.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.errors import SpecdraftError
from specdraft.replay import greedy_outputs
from specdraft.train.data import check_data_target, load_sequences, read_manifest


def training_response_tokens(data_dirs: list[str | Path]) -> Counter:
    """Token id -> count over the responses of every sequence in ``data_dirs``."""
    counts: Counter = Counter()
    for d in data_dirs:
        for s in load_sequences(d):
            counts.update(s.response)
    return counts


def drafter_vocabulary(drafter) -> set[int] | None:
    """The target ids a drafter can draft, or None when it scores the whole vocabulary."""
    ids = getattr(getattr(drafter, "model", None), "vocab_ids", None)
    return None if ids is None else set(int(x) for x in ids.tolist())


def coverage_stats(outputs: list[list[int]], seen: Counter, vocabs: dict[str, set[int] | None],
                   skip: set[int] = frozenset()) -> dict:
    """Shares of the output tokens (``skip`` ids left out, e.g. EOS) unseen in training / outside each vocabulary."""
    toks = [t for out in outputs for t in out if t not in skip]
    if not toks:
        raise SpecdraftError("no output tokens to measure")
    n = len(toks)
    res = {"tokens": n, "distinct_tokens": len(set(toks)),
           "unseen_in_training": sum(1 for t in toks if t not in seen) / n,
           "outside_draft_vocab": {}}
    for name, vocab in vocabs.items():
        res["outside_draft_vocab"][name] = None if vocab is None else sum(1 for t in toks if t not in vocab) / n
    return res


def coverage_report(target, data_dirs: list[str | Path], drafters: list[str], datasets: list[str], n: int,
                    max_new_tokens: int, out_dir: str | Path, quiet: bool = False) -> dict:
    """Writes DIR/coverage.json; greedy outputs are cached in DIR/greedy_outputs (shared with `analyze acceptance`)."""
    if not data_dirs:
        raise SpecdraftError("give at least one --data folder")
    for d in data_dirs:
        check_data_target(read_manifest(Path(d)), target, d)
    seen = training_response_tokens(data_dirs)
    vocabs = {spec: drafter_vocabulary(make_drafter(spec, target)) for spec in dict.fromkeys(drafters)}
    out = Path(out_dir)
    res: dict = {"config": {"data": [str(d) for d in data_dirs], "n": n, "max_new_tokens": max_new_tokens,
                            "target": target.name, "target_hash": target.weight_hash,
                            "training_response_tokens": sum(seen.values()), "training_distinct_tokens": len(seen)},
                 "datasets": {}}
    for ds in datasets:
        prompts = [target.encode_prompt(p) for p in load_prompts(ds, n)]
        outs = greedy_outputs(target, prompts, max_new_tokens, cache=out / "greedy_outputs" / f"{Path(ds).stem}.json",
                              quiet=quiet)
        res["datasets"][ds] = coverage_stats(outs, seen, vocabs, skip=set(target.eos_ids))
    out.mkdir(parents=True, exist_ok=True)
    (out / "coverage.json").write_text(json.dumps(res, indent=1))
    return res
