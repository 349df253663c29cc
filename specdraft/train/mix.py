"""The broad prompt mix: prompts the target writes itself across topics and styles, rewriting and
extraction of passages it wrote, second turns of conversations it answered, code tasks over the
codeio programs, and more reasoning-gym tasks.

Every source has a training part and a held-out part that share nothing: other topics, other
instructions, other follow-ups, other code tasks over other programs, other reasoning tasks.  A
build with ``split="heldout"`` draws only from the held-out parts, so its prompts come from sources
no training build has seen.

The target writes prompts by sampling (Magpie-style): for ``topics``, its chat template up to the
user's message, under a system message that names a topic, with the message's first words (a
*lead*: "How do I", "Write a", ...) given; the rest it samples.  The lead steers the style, the
topic steers (weakly, at 135M) the subject, and sampling gives the variety.
"""

from __future__ import annotations

import random

import torch
from tqdm import tqdm

from specdraft.errors import SpecdraftError
from specdraft.model.batched_decode import generate_batch
from specdraft.train.sources import codeio_rows, user_prefix
from specdraft.verify import Sampling

SPLITS = ("train", "heldout")

TOPICS = {
    "train": (
        "gardening", "personal finance", "cooking dinner", "baking", "fitness", "running", "sleep", "nutrition",
        "mental health", "parenting", "pets", "dogs", "cats", "home repair", "cleaning", "moving house",
        "job interviews", "writing a CV", "starting a business", "marketing", "negotiation", "public speaking",
        "learning a language", "studying for exams", "university", "world history", "ancient Rome",
        "the Second World War", "geography", "astronomy", "physics", "chemistry", "biology", "evolution",
        "climate change", "renewable energy", "electric cars", "space exploration", "the human body",
        "medicine", "philosophy", "ethics", "psychology", "economics", "politics", "law", "music theory",
        "playing guitar", "painting", "photography", "film", "novels", "poetry", "board games", "video games",
        "football", "tennis", "chess", "travel in Europe", "travel in Japan", "camping", "hiking", "cars",
        "bicycles", "smartphones", "computers", "the internet", "cybersecurity", "Python programming",
        "JavaScript", "SQL databases", "Linux", "machine learning", "statistics", "algebra", "geometry",
        "probability", "spreadsheets", "email etiquette", "friendship", "weddings", "birthdays", "fashion",
        "skin care", "recycling", "ocean life", "birds", "weather", "volcanoes", "dinosaurs", "mythology",
    ),
    "heldout": (
        "beekeeping", "knitting", "sailing", "architecture", "opera", "archaeology", "coffee", "tea",
        "genealogy", "insurance", "taxes", "robotics", "Rust programming", "origami", "surfing", "wine",
    ),
}

LEADS = ("How do I", "How can I", "Can you explain", "Explain", "Write a", "Write me a", "What is the best way to",
         "Give me a list of", "List", "Why does", "Why do", "What are the differences between", "Compare",
         "I need help with", "I'm trying to", "What happens if", "Is it true that", "Describe", "Summarize",
         "Suggest", "What should I", "Help me", "Tell me about", "Create a", "What is", "Which", "Should I",
         "Can you give me", "Plan a", "Draft a")

WRITING_TASKS = {
    "train": (
        "Rewrite the following text in a more formal tone.", "Rewrite the following text so a ten-year-old could understand it.",
        "Summarize the following text in two sentences.", "Summarize the following text in one sentence.",
        "Turn the following text into a bulleted list of its main points.", "Give the following text a short title.",
        "Extract every person, place and organisation named in the following text, as a JSON list.",
        "Extract every number in the following text and say what it counts.",
        "Write three questions that the following text answers.", "Correct any grammar or spelling mistakes in the following text.",
        "Make the following text shorter without losing its meaning.", "Rewrite the following text as a short email to a friend.",
        "What is the main idea of the following text?", "List the key words of the following text, separated by commas.",
        "Continue the following text with one more paragraph.", "Rewrite the following text in the first person.",
    ),
    "heldout": (
        "Rewrite the following text as a tweet.", "Extract the facts in the following text as a table with two columns.",
        "Write a multiple-choice question about the following text.", "Rewrite the following text in a cheerful tone.",
    ),
}

FOLLOWUPS = {
    "train": (
        "Can you give me an example?", "Can you explain that in simpler words?", "Can you make it shorter?",
        "Why is that?", "What else should I know?", "Can you go into more detail on the first point?",
        "Can you put that in a table?", "What would you recommend for a beginner?", "Are there any risks?",
        "Thanks! Can you summarize that in one sentence?", "Can you write that as a numbered list?",
        "How long would that take?", "What are the alternatives?", "Can you give me three more ideas?",
        "Is there a cheaper way?", "What is the most common mistake?",
    ),
    "heldout": (
        "Could you rephrase that for a child?", "What would an expert add to this?", "Can you turn that into a checklist?",
        "Which of these matters most, and why?",
    ),
}

CODE_TASKS = {
    "train": (
        "Write a Python function `main_solution` for this task.\n\n{desc}",
        "Explain what this Python code does.\n\n```python\n{code}\n```",
        "Add a docstring and type hints to this Python code.\n\n```python\n{code}\n```",
        "Write three unit tests with pytest for this code.\n\n```python\n{code}\n```",
        "Suggest how to make this Python code simpler or faster.\n\n```python\n{code}\n```",
        "Describe, step by step, how you would solve this task in Python.\n\n{desc}",
    ),
    "heldout": (
        "Rewrite this Python code in JavaScript.\n\n```python\n{code}\n```",
        "What inputs could make this code fail? Explain.\n\n```python\n{code}\n```",
    ),
}
CODEIO_HELDOUT_ROWS = 400  # the last rows of the seeded shuffle of codeio: held-out programs

REASONING_TASKS = {
    "train": ("basic_arithmetic", "chain_sum", "leg_counting", "letter_counting", "number_sorting", "word_sorting",
              "spell_backward", "caesar_cipher", "simple_equations", "fraction_simplification", "gcd", "lcm",
              "word_ladder", "family_relationships", "calendar_arithmetic", "complex_arithmetic", "count_bits",
              "power_function", "prime_factorization", "products", "decimal_chain_sum", "bitwise_arithmetic",
              "number_format", "isomorphic_strings", "ransom_note", "palindrome_generation", "group_anagrams",
              "sentence_reordering", "word_sequence_reversal", "letter_jumble", "syllogism", "propositional_logic",
              "dice", "coin_flip", "polynomial_multiplication", "simple_geometry", "simple_integration"),
    "heldout": ("number_filtering", "base_conversion", "time_intervals", "count_primes", "decimal_arithmetic",
                "string_manipulation"),
}


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise SpecdraftError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")


def sample_texts(target, prefixes: list[list[int]], max_new_tokens: int, seed: int, temperature: float = 0.9,
                 desc: str = "", quiet: bool = False, batch_size: int = 32) -> list[tuple[str, bool]]:
    """(text, ended with EOS) the target samples after each prefix (token ids), in batches; T=0 is greedy."""
    gen = torch.Generator().manual_seed(seed)
    s = Sampling(temperature=temperature, top_p=0.95 if temperature > 0 else 1.0)
    out: list[tuple[str, bool]] = []
    for b in tqdm(range(0, len(prefixes), batch_size), desc=desc, disable=quiet or not desc, unit="batch"):
        res = generate_batch(target.model, prefixes[b : b + batch_size], max_new_tokens, target.eos_ids,
                             sampling=s, generator=gen)
        out += [(target.decode(t).strip(), f) for t, f in zip(res.tokens, res.finished)]
    return out


def _prefix_ids(target, messages: list[dict], lead: str = "") -> list[int]:
    """The chat template of ``messages`` followed by a new user turn that starts with ``lead``."""
    return target.tokenizer(user_prefix(target.tokenizer, messages) + lead, add_special_tokens=False).input_ids


def _whole_sentences(text: str, finished: bool) -> str:
    """A text cut short by the token limit, cut back to its last full sentence ("" if it has none)."""
    return text if finished else text[: max(text.rfind(". "), text.rfind(".\n")) + 1]


def _need_template(target, source: str) -> None:
    if target is None or getattr(target.tokenizer, "chat_template", None) is None:
        raise SpecdraftError(f"prompt source {source!r} needs a target with a chat template (it writes the prompts)")


def topic_questions(target, n: int, seed: int, split: str = "train", quiet: bool = False) -> list[str]:
    """``n`` user messages the target samples under a topic's system message, each after a lead."""
    _check_split(split)
    _need_template(target, "topics")
    rng = random.Random(seed)
    picks = [(rng.choice(TOPICS[split]), rng.choice(LEADS)) for _ in range(int(n * 1.3) + 4)]
    prefixes = [_prefix_ids(target, [{"role": "system", "content": f"You are a helpful assistant. "
                                      f"Today the user asks about {topic}."}], lead) for topic, lead in picks]
    texts = sample_texts(target, prefixes, 64, seed, desc="topic prompts", quiet=quiet)
    out = [lead + (" " if text[:1].isalnum() else "") + text  # the sampled words follow the lead's
           for (_, lead), (text, fin) in zip(picks, texts) if fin and len(text) >= 8]
    return out[:n]


def writing_prompts(target, n: int, seed: int, split: str = "train", quiet: bool = False) -> list[str]:
    """A rewriting or extraction instruction over a paragraph the target wrote about a topic."""
    _check_split(split)
    _need_template(target, "writing")
    rng = random.Random(seed + 1)
    topics = [rng.choice(TOPICS[split]) for _ in range(int(n * 1.2) + 4)]
    kinds = ("a short paragraph", "a short news report", "a short story", "a product description", "a short letter")
    prefixes = [target.encode_prompt(f"Write {rng.choice(kinds)} about {t}.") for t in topics]
    passages = sample_texts(target, prefixes, 120, seed + 1, temperature=0.8, desc="writing passages", quiet=quiet)
    out = []
    for text, fin in passages:
        text = _whole_sentences(text, fin)
        if len(text) >= 80:
            out.append(f"{rng.choice(WRITING_TASKS[split])}\n\n{text}")
    return out[:n]


def followup_conversations(target, n: int, seed: int, split: str = "train", quiet: bool = False) -> list[list[dict]]:
    """Conversations [user, assistant, user]: a topic question, the target's own greedy answer, and a
    follow-up (half from a list, half sampled by the target after the conversation)."""
    _check_split(split)
    _need_template(target, "followup")
    firsts = topic_questions(target, int(n * 1.3) + 4, seed + 2, split, quiet=quiet)
    answers = sample_texts(target, [target.encode_prompt(q) for q in firsts], 160, seed + 2, temperature=0.0,
                           desc="first answers", quiet=quiet)
    convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
             for q, a in zip(firsts, (_whole_sentences(a, fin) for a, fin in answers)) if len(a) >= 40]
    rng = random.Random(seed + 2)
    sampled = [c for i, c in enumerate(convs) if i % 2 == 1]
    seconds = sample_texts(target, [_prefix_ids(target, c) for c in sampled], 48, seed + 3,
                           desc="follow-ups", quiet=quiet)
    it = iter(seconds)
    out = []
    for i, c in enumerate(convs):
        if i % 2 == 0:
            out.append(c + [{"role": "user", "content": rng.choice(FOLLOWUPS[split])}])
        else:
            text, fin = next(it)
            if fin and len(text) >= 8:
                out.append(c + [{"role": "user", "content": text}])
    return out[:n]


def code_prompts(n: int, seed: int, split: str = "train") -> list[str]:
    """A code task (write, explain, document, test, simplify, plan) over a codeio program; the
    held-out split uses other tasks over the last ``CODEIO_HELDOUT_ROWS`` programs."""
    _check_split(split)
    rows = codeio_rows()
    rows = rows[:-CODEIO_HELDOUT_ROWS] if split == "train" else rows[-CODEIO_HELDOUT_ROWS:]
    rng = random.Random(seed + 4)
    out = []
    for _ in range(n):
        row, task = rng.choice(rows), rng.choice(CODE_TASKS[split])
        out.append(task.format(desc=row["task_description"].strip(), code=row["code_sample"].strip()))
    return out


def reasoning_mix(n: int, seed: int, split: str = "train") -> list[tuple[str, int]]:
    """(question, reasoning-gym seed) from the split's tasks, about equally many per task."""
    _check_split(split)
    import reasoning_gym  # heavy: only when these prompts are collected

    tasks = REASONING_TASKS[split]
    per = -(-n // len(tasks))
    out = []
    for i, task in enumerate(tasks):
        s = seed * 1_000 + 1 + i
        try:
            out += [(item["question"], s) for item in reasoning_gym.create_dataset(task, seed=s, size=per)]
        except (KeyError, ValueError):
            continue  # a task this reasoning-gym version lacks
    random.Random(seed).shuffle(out)
    return out[:n]
