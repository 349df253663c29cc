"""End to end on this machine: a specdraft drafter exported, converted by llama.cpp's own converter,
and served by ``llama-server`` on the default target, beside specdraft's own decoding of the same
prompts.  Not part of CI (it needs llama.cpp built from the llama-cpp-python source distribution:
``bash scripts/build_llamacpp.sh``, and ``pip install sentencepiece`` for the converter).

    .venv/bin/python scripts/llamacpp_drafter_check.py --drafter eagle3 --prompts 20 --json-out out.json
    .venv/bin/python scripts/llamacpp_drafter_check.py --format dflash --drafter CKPT --n-max 7 --json-out out.json

Steps (the work folder keeps the exports between runs; ``--fresh`` redoes them):
1. ``specdraft export-target`` and ``specdraft export DRAFTER --format eagle3|dflash``;
2. ``convert_hf_to_gguf.py DRAFT --target-model-dir TARGET --outtype f32``, run from the llama.cpp
   source tree (not copied into the project);
3. ``llama-server -m <default GGUF> -md <drafter GGUF> --spec-type draft-eagle3|draft-dflash
   --spec-draft-n-max N --spec-draft-p-min 0``, greedy on the prompts (chat template applied), and the
   same server without a drafter;
4. specdraft on the same prompt ids: plain decoding, the drafter as a chain of N (what llama.cpp
   drafts: eagle3 ``topk=1,beams=1``, dflash ``tree=linear``, budget N) and in tree mode (its
   default budget).

Reported: llama.cpp's acceptance (``draft_n_accepted / draft_n``) and tok/s, specdraft's chain-mode
acceptance (accepted drafted tokens / drafted tokens), tokens per pass and tok/s, and how many
prompts' greedy outputs agree between the engines.  Every row runs one after the other on this
machine, so the tok/s columns compare side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from specdraft.bench.llamacpp import LlamaServer, find_binaries, with_working_repack
from specdraft.datasets import load_prompts
from specdraft.drafters import make_drafter
from specdraft.errors import SpecdraftError
from specdraft.export import export_drafter, export_target
from specdraft.generate import GenerateConfig, generate
from specdraft.model.load import default_gguf_path
from specdraft.target import Target

DATASETS = ("gsm", "mtbench", "humaneval")
CHAIN = {"eagle3": "topk=1,beams=1", "dflash": "tree=linear"}  # specdraft drafting what llama.cpp drafts


def prompts_of(n: int) -> list[str]:
    """``n`` benchmark prompts taken in turn from the three datasets."""
    per = [load_prompts(ds, n) for ds in DATASETS]
    return [per[i % 3][i // 3] for i in range(n)]


def convert(src: Path, draft: Path, target_hf: Path, out: Path) -> None:
    """llama.cpp's converter on the exported drafter, with the exported target for its tokenizer/config."""
    conv = src / "convert_hf_to_gguf.py"
    if not conv.is_file():
        raise SpecdraftError(f"{conv} not found: build llama.cpp with `bash scripts/build_llamacpp.sh`")
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    res = subprocess.run([sys.executable, str(conv), str(draft), "--target-model-dir", str(target_hf),
                          "--outfile", str(out), "--outtype", "f32"], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SpecdraftError(f"convert_hf_to_gguf.py failed: {res.stderr.strip().splitlines()[-3:]}")


def llama_rows(binaries, target_gguf: Path, spec: list[str], ids_list: list[list[int]], n: int, threads: int) -> dict:
    """Greedy completions of every prompt on one llama-server with ``spec`` flags."""
    outs, draft_n, accepted, tokens, wall = [], 0, 0, 0, 0.0
    with LlamaServer(binaries, target_gguf, threads, spec=spec) as srv:
        srv.complete(ids_list[0], 8)  # warm-up
        for ids in ids_list:
            r = srv.complete(ids, n)
            outs.append(r["tokens"])
            draft_n += r["draft_n"]
            accepted += r["draft_n_accepted"]
            tokens += len(r["tokens"])
            wall += r["wall_s"]
    return {"outputs": outs, "draft_n": draft_n, "draft_n_accepted": accepted,
            "acceptance": accepted / draft_n if draft_n else None, "tokens": tokens, "tok_s": tokens / wall}


def ours(target, spec: str | None, budget: int | None, ids_list: list[list[int]], n: int) -> dict:
    """specdraft's greedy decoding of every prompt with drafter ``spec`` (None = plain)."""
    drafter = make_drafter(spec, target, budget=budget) if spec else None
    outs, committed, passes, nodes, tokens, wall = [], 0, 0, 0, 0, 0.0
    generate(target, ids_list[0], drafter, GenerateConfig(max_new_tokens=8))  # warm-up
    for ids in ids_list:
        r = generate(target, ids, drafter, GenerateConfig(max_new_tokens=n))
        outs.append(r.token_ids)
        s = r.stats
        committed, passes, nodes = committed + s.committed, passes + s.passes, nodes + s.tree_nodes
        tokens, wall = tokens + s.new_tokens, wall + s.wall_s
    return {"outputs": outs, "drafted": nodes, "accepted": committed - passes,
            "acceptance": (committed - passes) / nodes if nodes else None,
            "tokens_per_pass": committed / passes if passes else None, "tok_s": tokens / wall,
            "budget": getattr(drafter, "default_budget", 0)}


def agree(a: list[list[int]], b: list[list[int]]) -> int:
    """Prompts whose outputs are equal (llama.cpp's stop token dropped)."""
    return sum(x[: len(y)] == y or y[: len(x)] == x for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="eagle3", help="a shipped drafter's name or a checkpoint path")
    ap.add_argument("--format", default="eagle3", choices=("eagle3", "dflash"), help="the export format")
    ap.add_argument("--llamacpp", default=str(Path.home() / ".cache" / "specdraft" / "llamacpp"),
                    help="the folder scripts/build_llamacpp.sh built (src/ and build/bin/)")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "specdraft" / "e2e"), help="exports and GGUFs")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n-max", type=int, default=4, help="tokens llama.cpp drafts per step (= our chain length)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--precision", default=None, choices=("fast", "exact"), help="specdraft's precision mode")
    ap.add_argument("--fresh", action="store_true", help="redo the exports and conversions")
    ap.add_argument("--json-out", default="")
    args = ap.parse_args()
    root, work = Path(args.llamacpp), Path(args.work)
    binaries = find_binaries(root / "build" / "bin")
    work.mkdir(parents=True, exist_ok=True)
    target = Target.load("default", precision=args.precision)
    fmt = args.format
    target_hf, draft_hf, draft_gguf = work / "target_hf", work / f"{Path(args.drafter).stem}_{fmt}", work / f"drafter_{fmt}.gguf"
    t0 = time.perf_counter()
    if args.fresh or not (target_hf / "config.json").is_file():
        export_target("default", target_hf, force=True)
    export_drafter(target, args.drafter, fmt, draft_hf, force=True)
    convert(root / "src", draft_hf, target_hf, draft_gguf)
    print(f"exported and converted in {time.perf_counter() - t0:.0f} s: {draft_gguf}", file=sys.stderr)

    texts = prompts_of(args.prompts)
    ids_list = [target.encode_prompt(t) for t in texts]
    gguf = default_gguf_path()
    binaries = with_working_repack(binaries, gguf, args.threads)
    spec = ["-md", str(draft_gguf), "--spec-type", f"draft-{fmt}", "--spec-draft-n-max", str(args.n_max),
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "--threads-draft", str(args.threads)]
    rows = {
        "llama.cpp plain": llama_rows(binaries, gguf, [], ids_list, args.max_tokens, args.threads),
        f"llama.cpp {fmt}": llama_rows(binaries, gguf, spec, ids_list, args.max_tokens, args.threads),
        "specdraft plain": ours(target, None, None, ids_list, args.max_tokens),
        f"specdraft {fmt} chain": ours(target, f"{args.drafter}@{CHAIN[fmt]}", args.n_max, ids_list, args.max_tokens),
        f"specdraft {fmt} tree": ours(target, args.drafter, None, ids_list, args.max_tokens),
    }
    ref = rows["specdraft plain"]["outputs"]
    for name, r in rows.items():
        r["outputs_equal_specdraft_plain"] = agree(r.pop("outputs"), ref)
    la, sa = rows[f"llama.cpp {fmt}"]["acceptance"], rows[f"specdraft {fmt} chain"]["acceptance"]
    summary = {"drafter": args.drafter, "format": fmt, "prompts": len(texts), "max_tokens": args.max_tokens, "n_max": args.n_max,
               "threads": args.threads, "precision": target.precision, "rows": rows,
               "acceptance_relative_difference": abs(la - sa) / sa if la is not None and sa else None}
    for name, r in rows.items():
        acc = "" if r.get("acceptance") is None else f", acceptance {r['acceptance']:.3f}"
        print(f"{name:24s} {r['tok_s']:7.1f} tok/s{acc}, outputs equal to specdraft plain: "
              f"{r['outputs_equal_specdraft_plain']}/{len(texts)}")
    if summary["acceptance_relative_difference"] is not None:
        print(f"acceptance: llama.cpp {la:.3f} vs specdraft chain {sa:.3f} "
              f"({summary['acceptance_relative_difference']:.1%} relative)")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SpecdraftError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
