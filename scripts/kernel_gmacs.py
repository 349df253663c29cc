"""Hot-cache throughput of the fast kernel per block format, and the weight stream of real passes.

    .venv/bin/python scripts/kernel_gmacs.py [--target default|FILE.gguf] [--json-out FILE]

Part 1: a [2048 x 512] matrix in each format (random blocks, about 0.3-0.6 MB a core: it stays in L2)
against 1 / 8 / 16 / 64 activation rows, best of 40 calls: GMAC/s on all threads.  Part 2: the
target's one-token and N-token passes (median of 15, 256-token context): ms, the weight bytes a pass
streams (every projection and the head, as repacked) per ms = GB/s, and the rows' multiply-adds per
ms = GMAC/s.  Says which kernel ran (``fast.isa()``) and on which CPU.  Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from specdraft.model import blocks, fast
from specdraft.target import Target
from specdraft.tree import Tree


def best_ms(fn, n: int = 40) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


def hot(rows=(1, 8, 16, 64), n: int = 2048, k: int = 512) -> dict:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    out = {}
    for kind in blocks.FORMATS:
        fw = fast.FastWeight.from_raw(blocks.quantize(w, kind))
        res = {}
        for m in rows:
            x = torch.randn(m, k)
            ms = best_ms(lambda: fw(x))
            res[m] = {"ms": ms, "gmacs": m * n * k / ms / 1e6}
        out[kind] = res
        print(kind, " ".join(f"{m} rows {r['gmacs']:.0f} GMAC/s" for m, r in res.items()))
    return out


def stream(target: Target, rows=(1, 8, 16), context: int = 256) -> dict:
    model = target.model
    nbytes = sum(w.nbytes for w in model.fast_weights)
    cfg = model.cfg
    macs = cfg.num_layers * (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                             + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
    macs += cfg.hidden_size * cfg.vocab_size
    prompt = [int(i) for i in torch.randint(10, cfg.vocab_size, (context + max(rows),), generator=torch.Generator().manual_seed(0))]
    out = {"weight_bytes": nbytes, "macs_per_row": macs}
    for m in rows:
        tree = Tree(tokens=prompt[context:context + m], parents=[-1] + list(range(m - 1)))
        times = []
        for _ in range(15):
            target.prefill(prompt[:context], context + m + 1)
            t = time.perf_counter()
            target.forward_tree(tree)
            times.append(time.perf_counter() - t)
        ms = 1000 * statistics.median(times)
        out[m] = {"ms": ms, "gb_s": nbytes / ms / 1e6, "gmacs": m * macs / ms / 1e6}
        print(f"pass of {m}: {ms:.2f} ms, weights {nbytes / ms / 1e6:.1f} GB/s, rows {m * macs / ms / 1e6:.0f} GMAC/s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    target = Target.load(a.target, precision="fast")
    print(f"kernel {fast.isa()} on {fast.cpu_name()}, {torch.get_num_threads()} threads")
    res = {"kernel": fast.kernel_info(target.model), "cpu": fast.cpu_name(), "threads": torch.get_num_threads(),
           "hot": hot(), "stream": stream(target)}
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
