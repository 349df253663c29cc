"""What the training prompt makers (``train.prompts``, ``train.mix``) share, below both: reasoning-gym's
bundled code problems in the training's seeded order, and the chat template's text up to a new user turn
(where Magpie-style prompts start)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path

from specdraft.errors import SpecdraftError

TRAIN_SEED_BASE = 1_000  # training seeds: TRAIN_SEED_BASE + i, never GSM_EVAL_SEED (also the codeio rows' order)
USER_PLACEHOLDER = "\x00MAGPIE\x00"  # a user message no template changes, cut off again


def codeio_rows() -> list[dict]:
    """The code problems bundled with reasoning-gym, in the training's seeded order: the ``codeio``
    source takes rows from the start, the mix's held-out part and the calibration from the end."""
    spec = importlib.util.find_spec("reasoning_gym")
    if spec is None or not spec.submodule_search_locations:
        raise SpecdraftError("reasoning-gym is missing: `pip install reasoning-gym`")
    path = Path(spec.submodule_search_locations[0]) / "data" / "codeio.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    random.Random(TRAIN_SEED_BASE).shuffle(rows)
    return rows


def user_prefix(tokenizer, messages: list[dict] = ()) -> str:
    """The chat template's text up to where a new user message starts (after ``messages``, if any)."""
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": USER_PLACEHOLDER}], tokenize=False)
    return text[: text.index(USER_PLACEHOLDER)]
