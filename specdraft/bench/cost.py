"""``specdraft bench --cost-curve``: the target's verification cost, the time of one pass over N
tree tokens for N = 1..64, and the prefill time of 128- and 512-token prompts.  Stored per machine
(``drafters.budget``), where the budget policy reads it.

On a CPU a pass over N tokens costs more than one token, so a drafter's node budget must be sized
to this machine.
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from specdraft.model.fast import cpu_name, kernel_info
from specdraft.tree import Tree

PEER_PASSES = [1, 2, 4, 8, 16, 32, 64]  # llama-bench's pp N beside ours (--llama-cpp)
PREFILL_LENGTHS = (128, 512)  # prompt lengths whose prefill time is reported (time to first token)


def measure_cost_curve(target, max_n: int = 64, context: int = 256, repeats: int = 9, quiet: bool = False) -> dict:
    """Median wall time (ms) of ``target.forward_tree`` on an N-node chain after ``context`` tokens.  The sizes
    are taken round-robin (each repeat passes over every N once), so a machine whose pace drifts during the
    measurement moves every N alike and the ratios to one token hold; except in the exact mode, whose
    ``target.prepare`` packs the weights for each size (keeping two): there each size's repeats run together,
    one packing per size."""
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (context,), generator=g).tolist()
    target.prefill(prompt, max_slots=context + max_n + 1)
    ns = list(range(1, max_n + 1))
    trees = {n: Tree(tokens=prompt[:n], parents=[-1] + list(range(n - 1))) for n in ns}
    times: dict[int, list[float]] = {n: [] for n in ns}
    order = ([(r, n) for r in range(repeats + 1) for n in ns] if target.precision == "fast"
             else [(r, n) for n in ns for r in range(repeats + 1)])
    for r, n in tqdm(order, desc="cost curve", disable=quiet):
        if r == 0:
            target.prepare(n - 1)  # as generate() does for a budget of n - 1 nodes (a no-op in the fast mode)
        t = time.perf_counter()
        target.forward_tree(trees[n])
        if r:  # each size's first pass warms its shape up
            times[n].append(time.perf_counter() - t)
    ms = [1000 * statistics.median(times[n]) for n in ns]
    return {"target": target.name, "target_hash": target.weight_hash, "device": target.device.type,
            "threads": torch.get_num_threads(), "context": context, "n": ns, "ms": ms,
            "ratio": [m / ms[0] for m in ms], "packed_weights": bool(getattr(target.model.lm_head, "packs", None)),
            "quantized_rows": target.model.quantized_rows, "precision": target.model.precision,
            "kernel": kernel_info(target.model), "cpu": cpu_name()}


def measure_prefill(target, lengths=PREFILL_LENGTHS, repeats: int = 3) -> dict:
    """Median wall time (ms) of ``target.prefill`` on random prompts of each length."""
    g = torch.Generator().manual_seed(1)
    ms = []
    lengths = [n for n in lengths if n < target.config.max_position]  # a prompt must fit the context
    for n in lengths:
        prompt = torch.randint(100, target.config.vocab_size, (n,), generator=g).tolist()
        target.prefill(prompt, max_slots=n + 1)  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            target.prefill(prompt, max_slots=n + 1)
            times.append(time.perf_counter() - t)
        ms.append(1000 * statistics.median(times))
    return {"n": list(lengths), "ms": ms}
