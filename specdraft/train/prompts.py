"""Training prompts from the package registries, never the benchmark's.

Sources:
- ``gsm``: reasoning-gym ``gsm_symbolic`` with training seeds (``TRAIN_SEED_BASE`` + i), disjoint
  from the benchmark's ``GSM_EVAL_SEED``;
- ``reasoning``: other reasoning-gym tasks (arithmetic, counting, sorting, ciphers, ...);
- ``codeio``: the code problems bundled with reasoning-gym (``data/codeio.jsonl.gz``), asked as
  "write this function" or "explain this code";
- ``magpie``: instructions the target writes itself when given only its chat template's user
  prefix (Magpie-style), sampled, deduplicated;
- the broad mix (``specdraft/train/mix.py``), each with a training and a held-out split:
  ``topics`` (messages the target writes on a topic after a lead such as "How do I"), ``writing``
  (rewriting and extraction of passages it wrote), ``followup`` (second turns of conversations it
  answered), ``code`` (tasks over the codeio programs), ``tasks`` (more reasoning-gym tasks).

Every prompt is checked against the benchmark prompts (MT-Bench, HumanEval, the gsm eval set)
after normalisation; a match is dropped, so no benchmark prompt enters the training data.
"""

from __future__ import annotations

import functools
import random
import re
import sys
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from specdraft.datasets import GSM_EVAL_SEED, gsm_prompts, humaneval_prompts, mtbench_turns
from specdraft.errors import SpecdraftError
from specdraft.model.batched_decode import generate_batch
from specdraft.train.sources import TRAIN_SEED_BASE, codeio_rows, user_prefix
from specdraft.verify import Sampling

SOURCES = ("gsm", "reasoning", "codeio", "magpie", "topics", "writing", "followup", "code", "tasks")
DEFAULT_SOURCES = SOURCES[:4]  # the shipped drafters' data
MIX_SOURCES = SOURCES[4:]  # the broad mix's own sources; the only ones with a held-out split
MIX = ("gsm", "magpie") + MIX_SOURCES  # ``--sources mix``: the broad training mix
SOURCE_WEIGHTS = {"gsm": 0.3, "reasoning": 0.25, "codeio": 0.25, "magpie": 0.2,
                  "topics": 0.6, "writing": 0.3, "followup": 0.3, "code": 0.3, "tasks": 0.25}
SAMPLED_TEMPERATURE = 0.7  # the temperature of the responses a build samples (``sampled`` share)
GSM_EVAL_GUARD = 500  # this many gsm eval prompts are excluded from training
REASONING_TASKS = ("basic_arithmetic", "chain_sum", "leg_counting", "letter_counting", "number_sorting",
                   "word_sorting", "spell_backward", "caesar_cipher", "simple_equations", "fraction_simplification",
                   "gcd", "lcm", "word_ladder", "family_relationships", "calendar_arithmetic")


@dataclass
class Prompt:
    id: int  # position in the prompt list
    source: str  # one of SOURCES
    text: str
    seed: int | None = None  # generator seed (reasoning-gym) or sampling seed (magpie)
    messages: list[dict] | None = None  # a whole conversation ending with a user turn (then text = its last turn)
    temperature: float = 0.0  # the response's decoding: 0 = greedy, else sampled at this temperature

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("messages", "temperature"):  # written only when set: older prompt lists stay byte-equal
            if d[k] == Prompt.__dataclass_fields__[k].default:
                del d[k]
        return d

    @property
    def key(self) -> str:
        """What deduplication compares: the normalised text of every turn."""
        if self.messages:
            return normalize(" | ".join(m["content"] for m in self.messages))
        return normalize(self.text)

    def encode(self, target) -> list[int]:
        """The prompt's token ids in the target's chat template."""
        return target.encode_messages(self.messages) if self.messages else target.encode_prompt(self.text)


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


@functools.lru_cache(maxsize=1)
def benchmark_prompt_set() -> frozenset[str]:
    """Normalised texts of every benchmark prompt (all MT-Bench turns, HumanEval, the gsm eval set)."""
    out: set[str] = set()
    for turns in mtbench_turns():
        out.update(normalize(t) for t in turns)
    for p in humaneval_prompts():
        out.add(normalize(p))
    out.update(normalize(p) for p in gsm_prompts(GSM_EVAL_GUARD, seed=GSM_EVAL_SEED))
    return frozenset(out)


def is_benchmark(text: str, bench: set[str]) -> bool:
    """A prompt is a benchmark prompt if it equals one after normalisation (case, whitespace)."""
    return normalize(text) in bench


def _rg_prompts(task: str, n: int, seed: int) -> list[str]:
    import reasoning_gym  # heavy (its task registry): only when these prompts are collected

    if seed == GSM_EVAL_SEED:
        raise SpecdraftError("refusing to build training prompts from the gsm evaluation seed")
    return [item["question"] for item in reasoning_gym.create_dataset(task, seed=seed, size=n)]


def gsm_train_prompts(n: int, seed: int = TRAIN_SEED_BASE) -> list[Prompt]:
    return [Prompt(0, "gsm", q, seed) for q in _rg_prompts("gsm_symbolic", n, seed)]


def reasoning_prompts(n: int) -> list[Prompt]:
    out: list[Prompt] = []
    per = -(-n // len(REASONING_TASKS))
    for i, task in enumerate(REASONING_TASKS):
        seed = TRAIN_SEED_BASE + 1 + i
        try:
            out += [Prompt(0, "reasoning", q, seed) for q in _rg_prompts(task, per, seed)]
        except (KeyError, ValueError):
            continue  # a task this reasoning-gym version lacks
    random.Random(TRAIN_SEED_BASE).shuffle(out)
    return out[:n]


def codeio_prompts(n: int) -> list[Prompt]:
    rows = codeio_rows()
    out = []
    for i, row in enumerate(rows[:n]):
        if i % 2 == 0:
            text = f"Write a Python function `main_solution` for this task.\n\n{row['task_description']}"
        else:
            text = f"Explain what this Python code does.\n\n```python\n{row['code_sample'].strip()}\n```"
        out.append(Prompt(0, "codeio", text, None))
    return out


def magpie_prompts(target, n: int, seed: int = TRAIN_SEED_BASE, batch_size: int = 32, quiet: bool = False) -> list[Prompt]:
    """Instructions sampled from the target given only the user prefix, deduplicated."""
    if getattr(target.tokenizer, "chat_template", None) is None:
        return []
    prefix_ids = target.tokenizer(user_prefix(target.tokenizer), add_special_tokens=False).input_ids
    gen = torch.Generator().manual_seed(seed)
    seen: set[str] = set()
    out: list[Prompt] = []
    bar = tqdm(total=n, desc="magpie prompts", disable=quiet)
    tries = 0
    while len(out) < n and tries < 4 * n:
        res = generate_batch(target.model, [prefix_ids] * batch_size, 48, target.eos_ids,
                             sampling=Sampling(temperature=1.0, top_p=0.95), generator=gen)
        tries += batch_size
        for toks, fin in zip(res.tokens, res.finished):
            text = target.decode(toks).strip()
            key = normalize(text)
            if fin and len(text) >= 12 and key not in seen and len(out) < n:
                seen.add(key)
                out.append(Prompt(0, "magpie", text, seed))
                bar.update(1)
    bar.close()
    return out


def _mix_makers(target, seed: int, split: str, quiet: bool) -> dict:
    """The broad mix's sources (``specdraft/train/mix.py``) as prompt makers ``k -> [Prompt]``."""
    from specdraft.train import mix

    def wrap(src, texts):
        return [Prompt(0, src, t, seed) for t in texts]

    return {
        "topics": lambda k: wrap("topics", mix.topic_questions(target, k, seed, split, quiet)),
        "writing": lambda k: wrap("writing", mix.writing_prompts(target, k, seed, split, quiet)),
        "followup": lambda k: [Prompt(0, "followup", c[-1]["content"], seed, messages=c)
                               for c in mix.followup_conversations(target, k, seed, split, quiet)],
        "code": lambda k: wrap("code", mix.code_prompts(k, seed, split)),
        "tasks": lambda k: [Prompt(0, "tasks", q, s) for q, s in mix.reasoning_mix(k, seed, split)],
    }


def collect_prompts(target, n_prompts: int, sources: tuple[str, ...] = DEFAULT_SOURCES, quiet: bool = False,
                    magpie_seed: int = TRAIN_SEED_BASE, exclude: set[str] | None = None, seed: int = TRAIN_SEED_BASE,
                    split: str = "train", sampled: float = 0.0) -> list[Prompt]:
    """``n_prompts`` deduplicated training prompts split across ``sources``; benchmark prompts removed,
    and so are prompts whose key (``Prompt.key``) is in ``exclude`` (e.g. another data folder's prompts).
    ``magpie_seed`` seeds the sampling of the magpie instructions (another seed, other instructions);
    ``seed`` the gsm problems and the broad mix's sources; ``split`` picks the mix's training or
    held-out part (a held-out build takes mix sources only); a seeded ``sampled`` share of the
    prompts gets a response sampled at ``SAMPLED_TEMPERATURE`` instead of greedy."""
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise SpecdraftError(f"unknown prompt source {unknown[0]!r} (choose from {', '.join(SOURCES)})")
    if split != "train" and set(sources) - set(MIX_SOURCES):
        raise SpecdraftError(f"a held-out build takes only the mix's sources ({', '.join(MIX_SOURCES)}): "
                             f"{', '.join(s for s in sources if s not in MIX_SOURCES)} have no held-out part")
    if not 0.0 <= sampled <= 1.0:
        raise SpecdraftError(f"the sampled share must be in [0, 1] (got {sampled})")
    weights = {s: SOURCE_WEIGHTS[s] for s in sources}
    total_w = sum(weights.values())
    want = {s: int(round(n_prompts * w / total_w)) for s, w in weights.items()}
    makers = {"gsm": lambda k: gsm_train_prompts(k, seed), "reasoning": reasoning_prompts, "codeio": codeio_prompts,
              "magpie": lambda k: magpie_prompts(target, k, seed=magpie_seed, quiet=quiet),
              **_mix_makers(target, seed, split, quiet)}
    bench = benchmark_prompt_set()
    seen: set[str] = set(exclude or ())
    out: list[Prompt] = []
    for src in sources:
        got = 0
        for p in makers[src](int(want[src] * 1.1) + 8):  # a margin for duplicates
            turns = [m["content"] for m in p.messages if m["role"] == "user"] if p.messages else [p.text]
            if p.key in seen or any(is_benchmark(t, bench) for t in turns):
                continue
            seen.add(p.key)
            out.append(p)
            got += 1
            if got >= want[src]:
                break
        if got < want[src] and not quiet:
            print(f"prompt source {src}: {got} of the {want[src]} prompts asked for (after dropping duplicates, "
                  "benchmark prompts and --exclude)", file=sys.stderr, flush=True)
    rng = random.Random(seed)
    for i, p in enumerate(out):
        p.id = i
        if sampled and rng.random() < sampled:
            p.temperature = SAMPLED_TEMPERATURE
    return out
