"""Loading, memory and pass costs of GGUF targets, ours beside llama.cpp's on the same files, one run:

    .venv/bin/python scripts/measure_loading.py --llama-cpp ~/.cache/specdraft/llamacpp/build/bin \
        --model default --model ~/.cache/specdraft/test_models/random-llama-1b.Q4_K_M-like.gguf ... \
        --out docs/results/loading_avx2/loading.json

Per model: `specdraft generate --max-new-tokens 8 "Hi"` wall time and peak RSS, for a file never loaded (its packed-weight
cache and tokenizer of that file cleared; the kernels built) and warm (three runs), beside
`llama-completion -n 8` on the same file; the load alone (Target.load, in-process, warm); the pass time
over 1 / 8 / 16 tokens after 256 (median of 5) beside `llama-bench -p 1,8,16 -n 0` and its tg; and
`--precision exact` where the memory check refuses it, with the line it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdraft.model.fast import cpu_name, isa
from specdraft.model.quant import kernel_available
from specdraft.model.load import cache_dir, cached_file_hash, default_gguf_path
from specdraft.target import Target
from specdraft.tree import Tree

SPECDRAFT = str(Path(sys.executable).with_name("specdraft"))


def timed(cmd: list[str]) -> dict:
    """Wall seconds and peak RSS (MB) of a command, by GNU time."""
    t = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-f", "RSS %M", *cmd], capture_output=True, text=True, errors="replace")
    wall = time.perf_counter() - t
    rss = re.findall(r"RSS (\d+)", res.stderr)
    lines = [x for x in res.stderr.strip().splitlines()
             if x.strip() and not x.startswith(("RSS ", "Command exited with"))]
    return {"wall_s": round(wall, 3), "peak_rss_mb": round(int(rss[-1]) / 1024, 1) if rss else None,
            "rc": res.returncode, "last_line": lines[-1] if lines else ""}


def passes(path: str, ns=(1, 8, 16), context: int = 256, repeats: int = 5) -> dict:
    t = time.perf_counter()
    target = Target.load(path, precision="fast")
    load_s = time.perf_counter() - t
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, target.config.vocab_size, (context,), generator=g).tolist()
    target.prefill(prompt, max_slots=context + max(ns) + 1)
    ms = []
    for n in ns:
        tree = Tree(tokens=prompt[:n], parents=[-1] + list(range(n - 1)))
        target.forward_tree(tree)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            target.forward_tree(tree)
            times.append(time.perf_counter() - t)
        ms.append(round(1000 * statistics.median(times), 2))
    return {"load_s_in_process": round(load_s, 3), "n": list(ns), "ms": ms, "precision": target.precision,
            "formats": target.model.fast_formats()}


def llama_bench(bin_dir: Path, path: str, ns=(1, 8, 16)) -> dict:
    out = {}
    for label, args in (("pp", ["-p", ",".join(map(str, ns)), "-n", "0"]), ("tg", ["-p", "0", "-n", "32"])):
        res = subprocess.run([str(bin_dir / "llama-bench"), "-m", path, "-t", "2", "-r", "3", "-o", "json", *args],
                             capture_output=True, text=True)
        rows = json.loads(res.stdout) if res.returncode == 0 else []
        if label == "pp":
            out["pp"] = {"n": [r["n_prompt"] for r in rows], "ms": [round(r["avg_ns"] / 1e6, 2) for r in rows]}
        else:
            out["tg_tok_s"] = round(rows[0]["avg_ts"], 1) if rows else None
    return out


def clear_file_caches(path: str) -> None:
    """The packed weights and converted tokenizer of this file (a first load does both)."""
    h = cached_file_hash(Path(path))
    for p in (cache_dir() / "packed").glob(f"{h[:24]}-*.safetensors"):
        p.unlink()
    shutil.rmtree(cache_dir() / "tokenizers" / h[:16], ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="'default' or a .gguf path (repeatable)")
    ap.add_argument("--llama-cpp", type=Path, required=True, help="folder with llama-completion and llama-bench")
    ap.add_argument("--exact", action="append", default=[], help="a --model to also run with --precision exact "
                    "(where the memory check refuses it; repeatable)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    kernel_available()
    results = {"cpu": cpu_name(), "isa": isa(), "threads": torch.get_num_threads(), "models": []}
    for spec in args.model:
        path = str(default_gguf_path()) if spec == "default" else str(Path(spec).expanduser())
        gen = [SPECDRAFT, "generate", "--target", spec, "--max-new-tokens", "8", "--quiet", "Hi"]
        row = {"model": spec, "file_gib": round(os.path.getsize(path) / 2**30, 3)}
        print(f"{spec}: first generate", file=sys.stderr)
        clear_file_caches(path)
        row["generate_new_file"] = timed(gen)
        row["generate_warm"] = [timed(gen) for _ in range(3)]
        comp = [str(args.llama_cpp / "llama-completion"), "-m", path, "-p", "Hi", "-n", "8", "-t", "2", "--temp", "0",
                "-no-cnv"]
        row["llama_completion"] = [timed(comp) for _ in range(3)]
        print(f"{spec}: passes", file=sys.stderr)
        row["ours"] = passes(path)
        row["llama_bench"] = llama_bench(args.llama_cpp, path)
        if spec in args.exact:
            row["generate_exact"] = timed([*gen[:2], "--precision", "exact", *gen[2:]])
        results["models"].append(row)
        print(json.dumps(row), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
