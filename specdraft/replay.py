"""Offline acceptance: tokens per pass of a drafter without timing the target.

Greedy output is fixed (lossless decoding reproduces it exactly), so how many tokens a drafter
banks per pass only depends on its trees along that output.  ``simulate`` replays a generation:
the target's hidden states come from *one* pass over prompt + greedy output, and at every step
the drafter's tree is walked along the known continuation, exactly as greedy verification would.
The drafter receives the hidden states of the accepted nodes (the only ones a lossless drafter
may read), so tokens per pass matches a real run up to floating-point noise in the features.
Use it to sweep vocabulary sizes and node budgets in minutes (``specdraft analyze acceptance``,
``specdraft train profile``); timing belongs to ``bench``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from specdraft.model.batched_decode import generate_batch
from specdraft.model.llama import ForwardOutput, causal_mask
from specdraft.verify import Accepted, Sampling


@torch.inference_mode()
def greedy_outputs(target, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 10,
                   cache: str | Path | None = None, quiet: bool = True) -> list[list[int]]:
    """Greedy continuations (EOS kept when produced), batched; cached in ``cache`` (JSON) if given."""
    return reference_outputs(target, prompts, max_new_tokens, batch_size=batch_size, cache=cache, quiet=quiet)


@torch.inference_mode()
def reference_outputs(target, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling | None = None,
                      seed: int = 0, batch_size: int = 10, cache: str | Path | None = None,
                      quiet: bool = True) -> list[list[int]]:
    """The target's own continuations (EOS kept when produced), batched: greedy, or drawn with ``sampling`` from
    a stream seeded ``seed``.  Replaying a sampled continuation measures sampled verification as replaying a
    greedy one measures greedy: each token is a draw from the target's distribution after the tokens before it,
    which is what sample-then-match verification compares a drafted node with.  Cached in ``cache`` (JSON)."""
    s = sampling or Sampling()
    key = {"target": target.weight_hash, "precision": target.model.precision, "max_new_tokens": max_new_tokens,
           "prompts": prompts}
    if not s.greedy:
        key["sampling"] = {**asdict(s), "seed": seed}
    if cache is not None and Path(cache).is_file():
        d = json.loads(Path(cache).read_text())
        if d["key"] == key:
            return d["outputs"]
    gen = None if s.greedy else torch.Generator(device=target.device).manual_seed(seed)
    outs: list[list[int]] = []
    desc = "greedy outputs" if s.greedy else f"sampled outputs (T={s.temperature:g})"
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=quiet):
        chunk = prompts[i : i + batch_size]
        res = generate_batch(target.model, chunk, max_new_tokens, target.eos_ids, sampling=s, generator=gen)
        for toks, fin in zip(res.tokens, res.finished):
            outs.append(list(toks) + ([min(target.eos_ids)] if fin and (not toks or toks[-1] not in target.eos_ids) else []))
    if cache is not None:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        Path(cache).write_text(json.dumps({"key": key, "outputs": outs}))
    return outs


@torch.inference_mode()
def sequence_hidden(target, tokens: list[int], layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Hidden states [1, T, H] of ``layers`` over the whole sequence in one causal pass."""
    n = len(tokens)
    cache = target.model.new_cache(1, n)
    ids = torch.tensor([tokens], device=target.device)
    pos = torch.arange(n, device=target.device)[None]
    out = target.model(ids, pos, causal_mask(n, 0, target.device), cache, 0, hidden_layers=tuple(layers), logits="none")
    return out.hidden


def simulate(drafter, prompt: list[int], output: list[int], hidden: dict[int, torch.Tensor], budget: int,
             trees: list | None = None) -> dict:
    """Replay greedy decoding of ``output`` with ``drafter``; returns passes and tokens per pass.

    ``hidden`` holds the states of prompt + output (from ``sequence_hidden``).  If ``trees`` is a
    list, each step's (tree, accepted path) is appended to it.
    """
    full = list(prompt) + list(output)
    p = len(prompt)
    if not output:
        return {"passes": 0, "tokens": 0, "tokens_per_pass": 0.0, "accept_hist": {}, "draft_s": 0.0}
    prefill = ForwardOutput(None, {k: v[:, :p] for k, v in hidden.items()})
    drafter.reset(list(prompt), full[p], prefill)
    n, passes, hist, draft_s = p, 0, {}, 0.0
    while n < len(full) - 1:
        t0 = time.perf_counter()
        tree = drafter.propose(budget)
        draft_s += time.perf_counter() - t0
        node, path = 0, [0]
        while n + len(path) < len(full):
            nxt = tree.child(node, full[n + len(path)])
            if nxt is None:
                break
            node = nxt
            path.append(node)
        d = len(path) - 1
        passes += 1
        hist[d] = hist.get(d, 0) + 1
        if trees is not None:
            trees.append((tree, path))
        if n + d + 1 >= len(full):
            break  # the output ends inside this tree: nothing left to predict
        fake = {}
        for k, v in hidden.items():
            h = torch.zeros(1, len(tree), v.shape[-1], dtype=v.dtype, device=v.device)
            h[0, path] = v[0, n : n + len(path)]
            fake[k] = h
        acc = Accepted(path=path, tokens=full[n + 1 : n + 1 + d], bonus=full[n + d + 1])
        t0 = time.perf_counter()
        drafter.commit(acc, ForwardOutput(None, fake))  # the drafter's work too: its time counts
        draft_s += time.perf_counter() - t0
        n += d + 1
    committed = len(full) - p - 1
    return {"passes": passes, "tokens": committed, "tokens_per_pass": committed / passes if passes else 0.0,
            "accept_hist": dict(sorted(hist.items())), "draft_s": draft_s}


def simulate_dataset(target, drafters: dict, prompts: list[list[int]], outputs: list[list[int]], budgets: list[int],
                     quiet: bool = True, draft_ms: dict | None = None, per_prompt: dict | None = None) -> dict:
    """Tokens per pass (committed tokens / passes, pooled over prompts) per drafter per budget.
    If ``draft_ms`` is a dict, it receives the mean wall time of one ``propose`` (ms) per drafter per budget;
    if ``per_prompt`` is a dict, it receives each prompt's [committed tokens, passes] per drafter per budget."""
    layers = sorted({layer for d in drafters.values() for layer in d.hidden_layers})
    each = {name: {b: [] for b in budgets} for name in drafters}  # per prompt [tokens, passes]
    draft_s = {name: {b: 0.0 for b in budgets} for name in drafters}
    for prompt, out in tqdm(list(zip(prompts, outputs)), desc="simulating", disable=quiet):
        hidden = sequence_hidden(target, list(prompt) + list(out), tuple(layers)) if layers else {}
        for name, d in drafters.items():
            for b in budgets:
                r = simulate(d, prompt, out, hidden, b)
                each[name][b].append([r["tokens"], r["passes"]])
                draft_s[name][b] += r["draft_s"]
    tot = {name: {b: (sum(t for t, _ in c), sum(p for _, p in c)) for b, c in v.items()} for name, v in each.items()}
    if draft_ms is not None:
        draft_ms.update({name: {b: (1000 * draft_s[name][b] / p if p else 0.0) for b, (_, p) in v.items()}
                         for name, v in tot.items()})
    if per_prompt is not None:
        per_prompt.update(each)
    return {name: {b: (t / p if p else 0.0) for b, (t, p) in v.items()} for name, v in tot.items()}


def predicted_speedup(curve: dict, tpp: float, budget: int, draft_ms: float) -> float | None:
    """Speed relative to plain greedy predicted from the cost curve: tokens per pass / (time of a pass
    over budget + 1 tokens + drafting time), in units of a one-token pass.  None off the curve."""
    n = budget + 1
    if n not in curve["n"]:
        return None
    worst = max(r for m, r in zip(curve["n"], curve["ratio"]) if m <= n)  # never cheaper for more tokens
    return tpp / (worst + draft_ms / curve["ms"][0])
