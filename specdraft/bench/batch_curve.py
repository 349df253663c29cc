"""``specdraft bench --batch-curve``: batched regeneration throughput against single-stream decoding.

The same training-style prompts are decoded greedily one at a time with ``generate`` and in
batches of 1, 8 and 32 with ``generate_batch``; each batched row is compared with its
single-stream output (a divergence at a top-2 logit gap under ``TIE_GAP`` is a floating-point tie).
"""

from __future__ import annotations

import random
import time

import torch
from tqdm import tqdm

from specdraft.bench.runner import TIE_GAP, first_divergence
from specdraft.generate import GenerateConfig, generate
from specdraft.model.batched_decode import generate_batch
from specdraft.train.prompts import codeio_prompts, gsm_train_prompts, reasoning_prompts


def divergence(target, prompt_ids: list[int], ours: list[int], ref: list[int], eos: int) -> dict | None:
    """``first_divergence`` with our target's own top-2 logit gap there."""
    div = first_divergence(ours, ref, eos)
    if div is not None:
        prefix = ref[: div["position"]]
        out = target.prefill(prompt_ids + prefix, max_slots=len(prompt_ids) + len(prefix) + 1)
        top = torch.topk(out.logits[0, -1], 2).values
        div["top2_gap"] = float(top[0] - top[1])
    return div


def batch_curve(target, n_prompts: int = 64, max_new_tokens: int = 64, sizes=(1, 8, 32, 64), quiet: bool = False,
                max_prompt_tokens: int = 512) -> dict:
    third = n_prompts // 2
    texts = [p.text for p in gsm_train_prompts(third) + reasoning_prompts(third) + codeio_prompts(third)]
    ids = [x for x in (target.encode_prompt(t) for t in texts) if len(x) <= max_prompt_tokens]
    ids = sorted(random.Random(0).sample(ids, min(n_prompts, len(ids))), key=len)  # as `data build` batches them
    eos = target.eos_ids
    t0 = time.perf_counter()
    single = [generate(target, p, None, GenerateConfig(max_new_tokens=max_new_tokens)).token_ids
              for p in tqdm(ids, desc="single-stream", disable=quiet)]
    single_wall = time.perf_counter() - t0
    single_tokens = sum(len(s) for s in single)
    out = {"n_prompts": len(ids), "max_new_tokens": max_new_tokens,
           "single_stream": {"tokens": single_tokens, "wall_s": single_wall, "tok_s": single_tokens / single_wall},
           "batched": {}}
    for b in sizes:
        t0 = time.perf_counter()
        rows: list[list[int]] = []
        for i in tqdm(range(0, len(ids), b), desc=f"batch {b}", disable=quiet):
            rows += generate_batch(target.model, ids[i : i + b], max_new_tokens, eos).tokens
        wall = time.perf_counter() - t0
        toks = sum(len(r) for r in rows)
        divs = [d for d in (divergence(target, p, r, s, min(eos)) for p, r, s in zip(ids, rows, single)) if d]
        out["batched"][str(b)] = {"tokens": toks, "wall_s": wall, "tok_s": toks / wall,
                                  "speedup_vs_single": (toks / wall) / out["single_stream"]["tok_s"],
                                  "rows_equal_single": len(ids) - len(divs), "divergences": divs,
                                  "divergences_all_ties": all(d["top2_gap"] < TIE_GAP for d in divs)}
    return out
