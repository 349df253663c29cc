"""Batched decoding on the lean model: many sequences in one static cache, each row with its own
positions and length (left padding), greedy or sampled, stopping per row.

Row b's prompt sits at slots ``pad_b .. P-1`` (P = longest prompt) with RoPE positions
``0 .. len_b-1``; every later step writes slot ``P + step`` for all rows at position
``len_b + step``.  A row's queries see only its own non-pad slots, so its output does not depend
on the other rows (up to floating-point reassociation in batched matmuls).  When half the rows
have finished, the batch (cache included) is compacted to the live rows.

With ``hidden_layers`` it also returns the hidden states of those layers at every token of each row
(prompt and response, fp16): the prefill gives the prompt's, each step the token it read, and one last
step reads the tokens of rows cut at ``max_new_tokens``.  In the fast precision mode a row's states do
not depend on the rows beside it or on the padding, so they equal one pass over the sequence alone
(``train.data.compute_features``) bit for bit: a data build gets its feature cache for free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdraft.model.llama import Transformer
from specdraft.verify import Sampling, target_probs


@dataclass
class BatchResult:
    tokens: list[list[int]]  # generated ids per row, EOS excluded
    finished: list[bool]  # True when the row ended with EOS (else it hit max_new_tokens)
    steps: int  # decoding steps after prefill
    wall_s: float
    hidden: list[dict[int, torch.Tensor]] | None = None  # per row, layer -> [prompt + generated, H] fp16


@torch.inference_mode()
def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    pad_id: int = 0,
    hidden_layers: tuple[int, ...] = (),
) -> BatchResult:
    t0 = time.perf_counter()
    s = sampling or Sampling()
    dev = model.device
    n = len(prompts)
    if n == 0:
        return BatchResult([], [], 0, 0.0)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt in batch")
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    width = int(lens.max())
    pad = width - lens  # [B]
    tokens = torch.full((n, width), pad_id, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p) :] = torch.tensor(p, device=dev)
    slots = torch.arange(width, device=dev)
    positions = (slots[None] - pad[:, None]).clamp(min=0)  # [B, P]
    total = width + max_new_tokens
    cache = model.new_cache(n, total)
    key_ok = torch.zeros(n, total, dtype=torch.bool, device=dev)  # [B, S] real (non-pad) slots
    key_ok[:, :width] = slots[None] >= pad[:, None]
    causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
    mask = causal[None] & key_ok[:, None, :width]  # [B, P, P]
    mask |= torch.eye(width, dtype=torch.bool, device=dev)[None]  # pad queries see themselves (no empty rows)
    out = model(tokens, positions, mask, cache, 0, logits="last", hidden_layers=hidden_layers)
    states: list[dict[int, list[torch.Tensor]]] = [{k: [] for k in hidden_layers} for _ in range(n)]
    if hidden_layers:
        for b in range(n):
            for k in hidden_layers:
                states[b][k].append(out.hidden[k][b, int(pad[b]) :].to(torch.float16))

    def pick(logits: torch.Tensor) -> torch.Tensor:  # logits [B, V] -> [B]
        if s.greedy:
            return logits.argmax(-1)
        return torch.multinomial(target_probs(logits, s), 1, generator=generator).squeeze(-1)

    eos_t = torch.tensor(sorted(eos_ids), device=dev)
    gen: list[list[int]] = [[] for _ in range(n)]
    finished = [False] * n
    rows = list(range(n))  # original index of each batch row
    active = [True] * n  # finished rows ride along (outputs ignored) until the next compaction
    nxt = pick(out.logits[:, -1])
    steps = 0
    for step in range(max_new_tokens):
        is_eos = torch.isin(nxt, eos_t).tolist()
        cut = []  # rows that reached max_new_tokens with this token: its states need one more step
        for j, (tok, e) in enumerate(zip(nxt.tolist(), is_eos)):
            if not active[j]:
                continue
            r = rows[j]
            if e:
                finished[r], active[j] = True, False
                continue
            gen[r].append(tok)
            active[j] = len(gen[r]) < max_new_tokens
            if not active[j]:
                cut.append(j)
        live = [j for j, a in enumerate(active) if a]
        run = sorted(live + cut) if hidden_layers else live  # a cut row runs once more for its last token's state
        if not run:
            break
        cut_rows = {rows[j] for j in cut}
        if len(run) <= len(rows) // 2:  # drop finished rows, cache included
            keep = torch.tensor(run, device=dev)
            rows, active = [rows[j] for j in run], [active[j] for j in run]
            nxt, lens, key_ok = nxt[keep], lens[keep], key_ok[keep]
            cache.kv = cache.kv.index_select(2, keep)
        slot = width + step
        key_ok[:, slot] = True
        out = model(nxt[:, None], (lens + step)[:, None], key_ok[:, None, : slot + 1], cache, slot,
                    logits="all" if live else "none", hidden_layers=hidden_layers)
        for j, r in enumerate(rows):  # the state of the token each row read (finished rows: ignored)
            if active[j] or r in cut_rows:
                for k in hidden_layers:
                    states[r][k].append(out.hidden[k][j].to(torch.float16))
        if not live:
            break
        nxt = pick(out.logits[:, -1])
        steps += 1
    hidden = [{k: torch.cat(v) for k, v in st.items()} for st in states] if hidden_layers else None
    return BatchResult(tokens=gen, finished=finished, steps=steps, wall_s=time.perf_counter() - t0, hidden=hidden)

