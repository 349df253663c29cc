"""A trained drafter's budget profile: held-out tokens per pass and drafting time per node budget.

The profile is stored in the checkpoint's manifest (``acceptance_by_budget``: budget -> tokens per
pass; ``budget_profile``: the same with the drafting time per pass and how it was measured), so a
drafter loaded without ``--budget`` picks the budget that maximises the predicted speed on the
machine it runs on: tokens per pass / (the machine's cost of verifying budget + 1 tokens + the
drafting time), see ``specdraft.drafters.budget.best_budget``.

Measured by offline replay (``specdraft.replay``) of the held-out training responses
(the same split the trainer validated on, never the benchmark prompts), with the drafter exactly
as ``make_drafter`` loads it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.drafters import make_drafter
from specdraft.errors import SpecdraftError
from specdraft.nn.checkpoint import load_checkpoint, save_checkpoint
from specdraft.replay import simulate_dataset
from specdraft.train.corpus import held_out_split
from specdraft.train.data import data_hashes, load_sequences, read_manifest

PROFILE_BUDGETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 63)  # 63: the largest tree on a 1..64 cost curve


def held_out_sequences(data_dir: str | Path, manifest: dict, max_seqs: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, responses) of the first ``max_seqs`` held-out sequences of the checkpoint's training run."""
    train, data = manifest.get("train", {}), manifest.get("data", {})
    if "seed" not in train or "holdout" not in train or "sequences" not in data:
        raise SpecdraftError("the checkpoint's manifest does not say how it was trained (train.seed, train.holdout, "
                             "data.sequences); a budget profile needs its held-out split")
    dm = read_manifest(Path(data_dir))
    if data.get("manifest_sha256") and data["manifest_sha256"] not in (
            *data_hashes(dm), *data_hashes({**dm, "shards_used": data.get("shards")})):  # as the trainer hashed it
        raise SpecdraftError(f"{data_dir} is not the data this drafter was trained on (its manifest differs; "
                             f"it was trained on {data.get('dir', '?')}, the first --data folder of its training run)")
    seqs = load_sequences(data_dir)[: data["sequences"]]
    held = held_out_split(len(seqs), train["seed"], train["holdout"])[1][:max_seqs]  # the trainer's own split
    return [seqs[i].tokens[: seqs[i].prompt_len] for i in held], [seqs[i].tokens[seqs[i].prompt_len :] for i in held]


def budget_profile(target, drafter, prompts: list[list[int]], outputs: list[list[int]],
                   budgets=PROFILE_BUDGETS, quiet: bool = True) -> dict:
    """Tokens per pass and mean drafting time (ms) per budget over (prompts, outputs)."""
    draft_ms: dict = {}
    tpp = simulate_dataset(target, {"d": drafter}, prompts, outputs, list(budgets), quiet=quiet, draft_ms=draft_ms)
    return {"tokens_per_pass": {str(b): round(v, 4) for b, v in tpp["d"].items()},
            "draft_ms": {str(b): round(v, 3) for b, v in draft_ms["d"].items()},
            "sequences": len(prompts), "response_tokens": sum(map(len, outputs)),
            "source": "offline replay of held-out training responses", "device": target.device.type,
            "threads": torch.get_num_threads()}


def add_budget_profile(target, checkpoint: str | Path, data_dir: str | Path, max_seqs: int = 32,
                       budgets=PROFILE_BUDGETS, quiet: bool = True) -> dict:
    """Measure a checkpoint's budget profile and store it in its manifest (tensors unchanged)."""
    tensors, manifest = load_checkpoint(checkpoint, target_hash=target.weight_hash)
    prompts, outputs = held_out_sequences(data_dir, manifest, max_seqs)
    drafter = make_drafter(str(checkpoint), target, budget=1)
    prof = budget_profile(target, drafter, prompts, outputs, budgets, quiet=quiet)
    manifest["acceptance_by_budget"] = prof["tokens_per_pass"]
    manifest["budget_profile"] = prof
    save_checkpoint(checkpoint, tensors, manifest)
    return prof
