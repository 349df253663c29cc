"""One run of a side-by-side comparison of two kernel versions: hot GMAC/s of a 3072 x 576 Q4_1 / Q8_0
matrix at 1 / 8 / 16 / 64 rows, and the default target's pass time at 1-32 tokens after a 256-token
prefill (median of 11).  Prints one JSON line.  Run it alternately for the two versions, e.g. for an
older checkout in OLD_DIR (with its own build cache):

    PYTHONPATH=OLD_DIR TORCH_EXTENSIONS_DIR=/tmp/ext_old .venv/bin/python scripts/pass_side_by_side.py old
    .venv/bin/python scripts/pass_side_by_side.py new

(docs/results/kernels_avx2/side_by_side.json was made so.)
"""
import json
import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from specdraft.model import quant, fast
from specdraft.model.quant import RawQuant
from specdraft.target import Target
from specdraft.tree import Tree
assert quant.kernel_available()
tag = sys.argv[1]
rng = np.random.default_rng(0)
out = {"tag": tag, "hot": {}, "pass": {}}
for kind in ("Q4_1", "Q8_0"):
    w = rng.standard_normal((3072, 576)).astype(np.float32)
    fw = fast.FastWeight.from_raw(RawQuant(kind, 576, quantize(w, GGMLQuantizationType[kind])))
    for m in (1, 8, 16, 64):
        x = torch.randn(m, 576)
        for _ in range(5): fw(x)
        ts = []
        for _ in range(40):
            t = time.perf_counter(); fw(x); ts.append(time.perf_counter() - t)
        out["hot"][f"{kind}/{m}"] = m * 3072 * 576 / min(ts) / 1e9
t = Target.load("default")
prompt = [int(i) for i in torch.randint(10, 40000, (300,), generator=torch.Generator().manual_seed(0))]
for m in (1, 2, 4, 8, 16, 32):
    tree = Tree(tokens=prompt[256:256 + m], parents=[-1] + list(range(m - 1)))
    ts = []
    for _ in range(11):
        t.prefill(prompt[:256], 256 + m + 1)
        s = time.perf_counter(); t.forward_tree(tree); ts.append(time.perf_counter() - s)
    out["pass"][m] = 1000 * statistics.median(ts)
print(json.dumps(out))
